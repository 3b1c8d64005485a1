"""A Megatron-style GPT pretraining entry: Megatron-LM's arguments and log lines, Megatron-Core's
model, DDP, optimizer, LR schedule and data, and a switch for who runs the pipeline::

    torchrun --nproc_per_node=2 -m piper_plugin.adapters.megatron.pretrain_gpt \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --lr 1e-3 \\
        --pipeline-engine=piper

``--pipeline-engine=megatron`` (the default) runs Megatron's own schedules; ``piper`` runs the
same step through :func:`piper_plugin.adapters.megatron.get_forward_backward_func`. Everything
else is the same code. Without a GPU it runs on gloo through the CPU path (:mod:`.cpu`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import datetime
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist

from piper_plugin.adapters.megatron.arguments import parse_args
from piper_plugin.adapters.megatron.cpu import apply_cpu_fixes, on_cpu
from piper_plugin.adapters.megatron.schedule import ArgumentError, stage_placement
from piper_plugin.adapters.megatron.tied import check_tied_layout, tie_output_to_embedding, tied_finalize
from piper_plugin.adapters.megatron.zero import ZeroChunk

__all__ = ["main", "pretrain"]


def _reports_loss(placement: dict[int, int] | None) -> bool:
    """Megatron-LM's ``print_rank_last``: the rank holding the last stage in the last
    data-parallel replica, last tensor-parallel rank, reports the loss (the global last rank in
    Megatron's layout)."""
    from megatron.core import parallel_state

    pp_rank, pp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()
    last_stage_rank = placement[len(placement) - 1] if placement else pp - 1
    dp_last = parallel_state.get_data_parallel_rank() == parallel_state.get_data_parallel_world_size() - 1
    tp_last = (parallel_state.get_tensor_model_parallel_rank()
               == parallel_state.get_tensor_model_parallel_world_size() - 1)
    return pp_rank == last_stage_rank and dp_last and tp_last


def _print_first(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _padded_vocab(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
               moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size, add_bias_linear=False,
               moe_router_load_balancing_type="aux_loss" if args.moe_aux_loss_coeff else "none",
               moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_token_dispatcher_type="alltoall",
               expert_model_parallel_size=args.expert_model_parallel_size) if args.num_experts else {}
    dtype = torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        ffn_hidden_size=args.ffn_hidden_size, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        use_cpu_initialization=on_cpu(), params_dtype=dtype, pipeline_dtype=dtype,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        batch_p2p_comm=not on_cpu(), **moe)  # gloo: batched p2p is wrong at pp=2 (HOST_FRAMEWORKS.md)


def build_model(args, vocab_size: int, placement: dict[int, int] | None = None):
    """This rank's model chunks, each in Megatron's DDP (in a :class:`~.zero.ZeroChunk` under
    ``--piper-zero``: Piper's plan reduces and shards), and the transformer config.

    ``placement`` (stage -> pipeline rank, from the Piper recipe) other than Megatron's loop
    layout builds each of this rank's stages as a chunk of its own (``piper_stage``): its share
    of the layers, the embedding on stage 0, the output layer on the last (tied to the embedding
    on this rank, :mod:`.tied`, unless ``--untie-embeddings-and-output-weights``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(args)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    loop = placement is None or all(rank == s % pp for s, rank in placement.items())
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    stages = list(range(vpp or 1)) if loop else sorted(s for s, rank in placement.items() if rank == pp_rank)
    if not loop:
        _check_own_layout(args, placement)
    tied = not args.untie_embeddings_and_output_weights
    models, configs = [], []
    for k, stage in enumerate(stages):
        if loop:
            vp = k if vpp else None
            chunk_config = config
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        else:  # one stage as a model of its own: its layers, no pipeline of Megatron's around it
            vp, first, last = None, stage == 0, stage == len(placement) - 1
            chunk_config = dataclasses.replace(
                config, num_layers=args.num_layers // len(placement), pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None)
        model = GPTModel(config=chunk_config, transformer_layer_spec=spec, vocab_size=vocab_size,
                         max_sequence_length=args.max_position_embeddings, share_embeddings_and_output_weights=tied,
                         pre_process=first, post_process=last, vp_stage=vp)
        if not loop:
            model.piper_stage = stage
        models.append(model)
        configs.append(chunk_config)
    finalize = finalize_model_grads
    if not loop and tied:  # before DDP builds its buckets: the copy's tags choose them
        tie_output_to_embedding(models)
        finalize = tied_finalize()
    chunks = []
    for k, (model, chunk_config) in enumerate(zip(models, configs)):
        if getattr(args, "piper_zero", None):
            chunks.append(ZeroChunk(chunk_config, model))
        else:
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer,
                                                grad_reduce_in_fp32=True)
            chunks.append(DistributedDataParallel(config=chunk_config, ddp_config=ddp, module=model,
                                                  disable_bucketing=k > 0))
    for chunk_config in {id(c): c for c in configs}.values():
        chunk_config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        chunk_config.finalize_model_grads_func = finalize
    return chunks, config


def _check_own_layout(args, placement: dict[int, int]) -> None:
    recipe = f"--piper-recipe {args.piper_recipe}"
    if not args.untie_embeddings_and_output_weights:
        check_tied_layout(args.piper_recipe, placement)
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ArgumentError(f"{recipe} with --decoder-first/last-pipeline-num-layers: this layout splits the layers "
                            f"evenly; drop them")


def forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: the batch's tokens through the model; the loss is the
    masked sum over tokens with the token count (Megatron divides by it), and the report is
    ``[loss sum, tokens]`` summed over the data-parallel ranks."""
    from megatron.core import parallel_state

    batch = next(data_iterator)
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    output = model(tokens, batch["position_ids"], batch.get("attention_mask"), labels=labels)

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
        dist.all_reduce(report, group=parallel_state.get_data_parallel_group())
        return loss, num_tokens, {"lm loss": report}

    return output, partial(loss_func, loss_mask)


def _log_line(iteration: int, args, elapsed_ms: float, lr: float, loss: float | None, grad_norm: float | None,
              consumed: int, skipped: int, nans: int) -> str:
    """One line of Megatron-LM's ``training_log``."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    line = f" [{stamp}] iteration {iteration:8d}/{args.train_iters:8d} |"
    line += f" consumed samples: {consumed:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {args.global_batch_size:5d} |"
    if loss is not None:
        line += f" lm loss: {loss:.6E} |"
    line += " loss scale: 1.0 |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nans:3d} |"
    return line


def pretrain(argv: Sequence[str] | None = None) -> list[float]:
    """Train as the arguments say; returns the last rank's per-iteration ``lm loss``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(argv, world)  # every check before Megatron is imported or any process group exists
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_forward_backward
    from megatron.core.tensor_parallel import random as mrandom

    from piper_plugin.adapters.megatron import get_forward_backward_func as piper_forward_backward
    from piper_plugin.adapters.megatron.checkpoint import load_checkpoint, save_checkpoint
    from piper_plugin.adapters.megatron.data import ShippedTokenizer, chunk_iterators, shipped_corpus, split_datasets
    from piper_plugin.adapters.megatron.evaluation import SplitEvaluation, result_lines

    cpu = apply_cpu_fixes()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size)
    torch.manual_seed(args.seed)
    mrandom.model_parallel_cuda_manual_seed(args.seed)  # on the CPU path the CPU generator is the device's

    tokenizer = ShippedTokenizer(args.tokenizer_file) if args.tokenizer_file else ShippedTokenizer()
    prefix = args.data_path or shipped_corpus(tokenizer)
    try:
        evaluations = (args.train_iters // args.eval_interval if args.eval_interval else 0) + 1
        dataset, valid_set, test_set = split_datasets(
            prefix, tokenizer, seq_length=args.seq_length, seed=args.seed, split=args.split,
            samples=(args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
                     args.eval_iters * args.global_batch_size))
    except FileNotFoundError:
        raise ArgumentError(f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx; give the prefix of a Megatron "
                            f"indexed dataset (as preprocess_data.py writes it)") from None
    placement = (stage_placement(args.piper_recipe, pp=args.pipeline_model_parallel_size,
                                 stages=args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1),
                                 microbatches=args.num_microbatches)
                 if args.pipeline_engine == "piper" else None)
    chunks, config = build_model(args, _padded_vocab(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by * args.tensor_model_parallel_size), placement)
    if args.pipeline_engine == "piper":
        forward_backward = piper_forward_backward(recipe=args.piper_recipe, timeout_s=args.piper_timeout,
                                                  zero=args.piper_zero, trace=args.piper_trace,
                                                  trace_memory=args.piper_trace_memory,
                                                  profile=args.piper_profile)
        if args.piper_zero:  # the parameters become faces of this rank's shards before the optimizer sees them
            forward_backward.prepare(model=chunks, num_microbatches=args.num_microbatches,
                                     seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
    else:
        forward_backward = megatron_forward_backward()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
                        bf16=False, fp16=False),
        chunks)
    samples = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples, lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples, wd_incr_style="constant")
    iteration, consumed = load_checkpoint(args, chunks, optimizer, scheduler) if args.load else (0, 0)
    if iteration:
        _print_first(f" loaded checkpoint from {args.load} at iteration {iteration}")
    tensor = (f" x tensor {args.tensor_model_parallel_size}{' (sequence parallel)' if args.sequence_parallel else ''}"
              if args.tensor_model_parallel_size > 1 else "")
    _print_first(f" > pipeline engine: {args.pipeline_engine}; {world} ranks = pipeline "
                 f"{args.pipeline_model_parallel_size}{tensor} x data {args.data_parallel_size}"
                 f"{f' x virtual {args.virtual_pipeline_model_parallel_size}' if args.virtual_pipeline_model_parallel_size else ''}"
                 f"{f', ZeRO-{args.piper_zero} by Piper' if args.piper_zero else ''}"
                 f"; {args.num_microbatches} microbatches of {args.micro_batch_size}")
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    reporter = _reports_loss(placement)
    validation = test = None
    if valid_set is not None:  # resumed: after the batches the earlier evaluations read
        validation = SplitEvaluation(valid_set, args, dp=dp, dp_rank=dp_rank, consumed_batches=(
            iteration // args.eval_interval * args.eval_iters if args.eval_interval else 0))
    if test_set is not None:
        test = SplitEvaluation(test_set, args, dp=dp, dp_rank=dp_rank)

    def evaluate(split: SplitEvaluation, where: str) -> None:
        values = split.run(forward_backward, forward_step, chunks)
        if reporter:
            print("\n".join(result_lines(where, values)), flush=True)

    losses: list[float] = []
    interval_loss, interval_iters, interval_start = 0.0, 0, time.perf_counter()
    skipped = nans = 0
    while iteration < args.train_iters:
        data = chunk_iterators(dataset, chunks, micro_batch_size=args.micro_batch_size, dp_size=dp, dp_rank=dp_rank,
                               consumed_samples=consumed)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(forward_step_func=forward_step,
                                   data_iterator=data, model=chunks,
                                   num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        iteration += 1
        consumed += args.global_batch_size
        if ok:
            scheduler.step(increment=args.global_batch_size)
        else:
            skipped += 1
        if reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
            loss = float(total[0] / total[1])
            nans += int(loss != loss)
            losses.append(loss)
            interval_loss += loss
        interval_iters += 1
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.perf_counter() - interval_start) * 1000 / interval_iters
            if reporter:
                print(_log_line(iteration, args, elapsed, optimizer.param_groups[0]["lr"],
                                interval_loss / interval_iters if reports else None, grad_norm, consumed, skipped,
                                nans), flush=True)
            interval_loss, interval_iters, interval_start = 0.0, 0, time.perf_counter()
        if validation is not None and args.eval_interval and iteration % args.eval_interval == 0:
            evaluate(validation, f"iteration {iteration}")
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, consumed, chunks, optimizer, scheduler)
            _print_first(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save_checkpoint(args, iteration, consumed, chunks, optimizer, scheduler)
        _print_first(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")
    if validation is not None:
        evaluate(validation, f"iteration {iteration} on validation set")
    if test is not None:
        evaluate(test, f"iteration {iteration} on test set")
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    try:
        pretrain(sys.argv[1:] if argv is None else argv)
    except ArgumentError as exc:
        if os.environ.get("RANK", "0") != "0":
            time.sleep(5.0)  # rank 0 says it and the launcher ends the job
        print(f"piper: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
