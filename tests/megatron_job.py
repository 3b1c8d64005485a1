"""Megatron-Core training on forked gloo ranks, under Megatron's engine and Piper's, for parity.

``run_job(world, scenario)`` runs one job of ``world`` ranks (a fork server, as
:mod:`forkserver_ranks`). Every rank initialises Megatron's parallel state (pipeline ``pp``,
virtual pipeline ``vpp``), builds its model chunks, wraps them in Megatron's DDP and optimizer
(``get_megatron_optimizer``; the distributed optimizer when asked) and, for each engine in
``scenario["engines"]`` ("megatron", "piper", "piper:<recipe>"), starts again from the same
weights and trains ``steps`` iterations. It reports, by global parameter name (layer numbers as
the whole model has them, the tied output weight as the embedding): the losses the last stage
reports, every gradient of the first iteration (after ``finalize_model_grads``), the gradient
norm of every step (as Megatron's optimizer computes it to clip by), and every parameter after
the last; and the reports of one evaluation pass (``forward_only``) on held-out
batches after training. A rank holding both copies of a tied embedding (DualPipeV's V) also
reports whether they are equal as built (``tied_at_start``) and after the last step of each engine
(``tied_after``).

With ``zero`` (1, 2, 3) the chunks are :class:`ZeroChunk` s and the one engine is Piper's with
its ZeRO over the data-parallel ranks: gradients and parameters are reported whole (gathered
from the faces of each rank's rows), with what each rank keeps between steps (``zero``: its
share of the parameter rows, and whether ZeRO-3's whole parameters were freed).

Weights are set from each parameter's global name, and microbatch ``j`` of the global batch is
made from ``(iteration, j)``, so a job of any layout (``pp=1``: single-device training) starts
from the same model and sees the same data.
"""
from __future__ import annotations

import os
import zlib
from functools import partial

from forkserver_ranks import run_ranks

__all__ = ["run_job", "SCENARIO"]

SCENARIO = dict(pp=2, vpp=None, layers=4, hidden=64, heads=4, ffn=256, vocab=128, seq=32, mbs=2,
                microbatches=4, steps=3, lr=1e-3, moe=False, tied=True, distributed_optimizer=False,
                batch_p2p_comm=True, loss_tuple=3, engines=("megatron", "piper"), aux_loss=1e-2, zero=None)


def run_job(world: int, scenario: dict, timeout_s: float = 300.0) -> dict:
    scenario = {**SCENARIO, **scenario, "world": world}
    return run_ranks(_rank, world, scenario, timeout_s=timeout_s)


def _rank(rank: int, port: int, scenario: dict, out) -> None:
    try:
        report = _train(rank, port, scenario)
    except BaseException as exc:  # noqa: BLE001 - the test sees the rank's error
        import traceback

        report = {"error": f"rank {rank}: {exc!r}\n{traceback.format_exc()}"}
    out.put((rank, _plain(report)))


def _plain(value):
    """Tensors as numpy arrays: a report outlives the rank that made it."""
    if hasattr(value, "numpy") and hasattr(value, "detach"):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _global_name(chunk, name: str, tied: bool) -> str:
    """``name`` in a stage's model chunk -> its name in the single-device model."""
    import re

    name = name.removeprefix("module.")
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        inner = _inner(chunk)
        layer = inner.decoder.layers[int(match.group(1))]
        stage = getattr(inner, "piper_stage", None)  # a stage built as a model of its own: local numbers
        offset = 0 if stage is None else stage * len(inner.decoder.layers)
        return f"decoder.layers.{offset + layer.layer_number - 1}.{match.group(2)}"
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def _inner(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _set_weights(chunks, tied: bool) -> None:
    import torch

    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(_global_name(chunk, name, tied).encode()))
                values = torch.randn(p.shape, generator=g, dtype=torch.float32)
                if p.dim() >= 2:
                    values *= 0.02
                elif name.endswith("weight"):
                    values = 1 + 0.02 * values
                else:
                    values *= 0.02
                p.copy_(values)


def _batch(step: int, index: int, scenario: dict) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 * step + index)
    mbs, seq = scenario["mbs"], scenario["seq"]
    tokens = torch.randint(0, scenario["vocab"], (mbs, seq + 1), generator=g)
    mask = (torch.rand(mbs, seq, generator=g) > 0.1).float()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(seq).expand(mbs, seq),
            "attention_mask": torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)}


CPU_MODES: set[int] = set()  # how many CPU-layer modes each forward step ran under


def _forward_step(loss_tuple: int, data_iterator, model):
    import torch
    from torch.overrides import _get_current_function_mode_stack

    from piper_plugin.adapters.megatron.cpu import CudaOnCpu

    CPU_MODES.add(sum(isinstance(m, CudaOnCpu) for m in _get_current_function_mode_stack()))
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1)
        if loss_tuple == 3:
            total = torch.sum(losses * mask)
            tokens = mask.sum().to(torch.int)
            return total, tokens, {"lm loss": torch.stack([total.detach().clone(), mask.sum()])}
        loss = torch.sum(losses * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, partial(loss_func, data["loss_mask"])


def _tied_copies(chunks) -> tuple | None:
    """The embedding and the output weight where one rank holds both as two parameters."""
    pre = [_inner(c) for c in chunks if _inner(c).pre_process]
    post = [_inner(c) for c in chunks if _inner(c).post_process]
    if not pre or not post or post[0].output_layer.weight is None:
        return None
    return pre[0].embedding.word_embeddings.weight, post[0].output_layer.weight


def _v_chunks(scenario: dict) -> list:
    """This rank's stages in DualPipeV's V, built as the shipped entry builds them (the tied
    output weight a copy of the embedding on the rank holding both)."""
    from megatron.core import parallel_state

    from piper_plugin.adapters.megatron.arguments import parse_args
    from piper_plugin.adapters.megatron.pretrain_gpt import build_model
    from piper_plugin.adapters.megatron.schedule import stage_placement

    pp = scenario["pp"]
    argv = ["--num-layers", str(scenario["layers"]), "--hidden-size", str(scenario["hidden"]),
            "--num-attention-heads", str(scenario["heads"]), "--ffn-hidden-size", str(scenario["ffn"]),
            "--seq-length", str(scenario["seq"]), "--micro-batch-size", str(scenario["mbs"]), "--train-iters", "1",
            "--lr", "1", "--pipeline-model-parallel-size", str(pp), "--virtual-pipeline-model-parallel-size", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            *([] if scenario["tied"] else ["--untie-embeddings-and-output-weights"]),
            *(["--piper-zero", str(scenario["zero"])] if scenario["zero"] else []),
            *(["--use-distributed-optimizer"] if scenario["distributed_optimizer"] else []), "--global-batch-size", str(scenario["mbs"] * scenario["microbatches"] * (scenario["world"] // pp)),
            "--pipeline-engine", "piper", "--piper-recipe", "dualpipev"]
    if scenario["moe"]:
        argv += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
                 "--moe-aux-loss-coeff", str(scenario["aux_loss"])]
    args = parse_args(argv, scenario["world"])
    placement = stage_placement("dualpipev", pp=pp, stages=2 * pp, microbatches=scenario["microbatches"])
    assert parallel_state.get_pipeline_model_parallel_world_size() == pp
    chunks, _ = build_model(args, scenario["vocab"], placement)
    return chunks


def _train(rank: int, port: int, scenario: dict) -> dict:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from piper_plugin.adapters.megatron import ZeroChunk, apply_cpu_fixes, get_forward_backward_func

    apply_cpu_fixes()
    world = scenario["world"]
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func as megatron_func
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp, vpp = scenario["pp"], scenario["vpp"]
    parallel_state.initialize_model_parallel(1, pp, vpp)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, add_bias_linear=False,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=scenario["aux_loss"],
               moe_token_dispatcher_type="alltoall") if scenario["moe"] else {}
    config = TransformerConfig(
        num_layers=scenario["layers"], hidden_size=scenario["hidden"], num_attention_heads=scenario["heads"],
        ffn_hidden_size=scenario["ffn"], use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=scenario["batch_p2p_comm"], **moe)
    spec = get_gpt_layer_local_spec(num_experts=4 if scenario["moe"] else None, moe_grouped_gemm=False)
    chunks = [] if scenario.get("layout") != "v" else _v_chunks(scenario)
    for k in range(0 if chunks else (vpp or 1)):
        vp = k if vpp else None
        chunk = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=scenario["vocab"],
                         max_sequence_length=scenario["seq"], share_embeddings_and_output_weights=scenario["tied"],
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                         vp_stage=vp)
        if scenario["zero"]:
            chunks.append(ZeroChunk(config, chunk))
            continue
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=scenario["distributed_optimizer"],
                                            overlap_grad_reduce=scenario.get("overlap_grad_reduce", False))
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp, module=chunk,
                                              disable_bucketing=k > 0))
    if scenario.get("layout") != "v":  # else the entry's build set them
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    m = scenario["microbatches"]
    last = any(_inner(c).post_process for c in chunks)  # holds the loss (DualPipeV's V: pipeline rank 0)
    report: dict = {}
    zero = scenario["zero"]
    assert not zero or len(scenario["engines"]) == 1 and scenario["engines"][0].startswith("piper"), \
        "ZeroChunks run under Piper's engine only"
    whole = (lambda t: t.full_tensor()) if zero else (lambda t: t)  # faces of this rank's rows, gathered
    copies = _tied_copies(chunks) if scenario["tied"] else None  # both on this rank: the V's rank 0
    if copies is not None:  # as the entry built them, before the weights are set by name
        report["tied_at_start"] = bool(torch.equal(*copies))
    for engine in scenario["engines"]:
        _set_weights([c.module for c in chunks], scenario["tied"])
        if engine != "megatron":
            func = get_forward_backward_func(recipe=engine.partition(":")[2] or None, zero=zero)
            if zero:  # the parameters become faces of this rank's shards before the optimizer sees them
                func.prepare(model=chunks, num_microbatches=m, seq_length=scenario["seq"],
                             micro_batch_size=scenario["mbs"])
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=scenario["lr"], weight_decay=0.01, bf16=False, fp16=False,
                            use_distributed_optimizer=scenario["distributed_optimizer"], clip_grad=1.0),
            chunks)
        if engine == "megatron":
            func = megatron_func()
        losses, grads, norms = [], {}, []
        for step in range(scenario["steps"]):
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            batches = [_batch(step, dp_rank * m + i, scenario) for i in range(m)]
            iterators = [iter(list(batches)) for _ in chunks]
            reported = func(forward_step_func=partial(_forward_step, scenario["loss_tuple"]),
                            data_iterator=iterators if len(chunks) > 1 else iterators[0],
                            model=chunks, num_microbatches=m, seq_length=scenario["seq"],
                            micro_batch_size=scenario["mbs"], forward_only=False)
            if step == 0 and not scenario["distributed_optimizer"]:
                grads = {_global_name(c, n, scenario["tied"]): whole(p.grad if zero else p.main_grad).detach().clone()
                         for c in chunks for n, p in c.module.named_parameters()}
            norms.append(float(optimizer.step()[1]))  # the gradient norm Megatron's optimizer clips by
            if last:
                losses.append([{k: v.tolist() for k, v in r.items()} for r in reported])
            elif reported:
                raise AssertionError(f"rank {rank} is not the last stage but its engine reported {reported}")
        params = {_global_name(c, n, scenario["tied"]): whole(p).detach().clone()
                  for c in chunks for n, p in c.module.named_parameters()}
        if copies is not None:
            report["tied_after"] = bool(torch.equal(*(whole(p) for p in _tied_copies(chunks))))  # ZeRO: faces
        if zero:  # what the rank keeps between steps
            buckets = func._cached[1].executor.state.buckets.values()
            report["zero"] = {"rows": sum(p.to_local().numel() for c in chunks for p in c.module.parameters()),
                              "numel": sum(p.numel() for c in chunks for p in c.module.parameters()),
                              "whole_resident": any(b.materialized for b in buckets if b.zero == 3)}
        split = []  # the backwards that ran as an input pass, the sends, then a weight pass; the BIs that left their BW
        if engine != "megatron":
            plan, state = func._cached[1].plan, func._cached[1].executor.state
            pays = {k for k in plan.ranks[state.rank].tasks() if state.split_pays.get(plan.dag.nodes[k].region)}
            split = sorted(pays & state.input_grads_first)
            split += sorted(k for k in pays if plan.dag.nodes[k].kind.value == "BI" and k not in state.fused_backward)
        batches = [_batch(10_000, dp_rank * m + i, scenario) for i in range(m)]  # held-out data
        with torch.no_grad():
            evaluated = func(forward_step_func=partial(_forward_step, scenario["loss_tuple"]),
                             data_iterator=[iter(list(batches)) for _ in chunks] if len(chunks) > 1
                             else iter(list(batches)), model=chunks, num_microbatches=m,
                             seq_length=scenario["seq"], micro_batch_size=scenario["mbs"], forward_only=True)
        evaluation = [[{k: v.tolist() for k, v in r.items()} for r in evaluated]] if last else []
        report[engine] = {"losses": losses, "grads": grads, "params": params, "eval": evaluation,
                          "grad_norms": norms, "split": split, "cpu_modes": sorted(CPU_MODES)}
        CPU_MODES.clear()
    report["dp"] = dp
    dist.destroy_process_group()
    return report
