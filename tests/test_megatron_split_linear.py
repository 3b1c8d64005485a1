"""Megatron's linear layers under Piper: a backward that splits into input and weight passes
with no work done twice, and numbers equal to Megatron's own Function's bit for bit."""
from __future__ import annotations

import os

import pytest

from forkserver_ranks import run_ranks


def _rank(rank: int, port: int, out) -> None:
    try:
        report = _checks(port)
    except BaseException as exc:  # noqa: BLE001 - the test sees the rank's error
        import traceback

        report = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    out.put((rank, report))


def _block(moe: bool = False, recompute: bool = False):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    extra = dict(num_moe_experts=4, moe_router_topk=2) if moe else {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, add_bias_linear=True, **extra)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False)
    return TransformerBlock(config, spec, pre_process=True, post_process=False)


def _step(block, x, g, split: bool, mode=None):
    """One forward of ``block`` on ``x`` and a backward from ``g``, whole or split into input and
    weight passes (under the dispatch ``mode`` if given): (output, input gradient, gradients)."""
    import contextlib

    from piper_plugin.autograd.split_backward import backward_input

    block.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_(True)
    out = block(inp, attention_mask=None)
    with mode if mode is not None else contextlib.nullcontext():
        if split:
            (grad_input,), pending = backward_input([out], [g], [inp])
            pending.run()
        else:
            out.backward(g)
            grad_input = inp.grad
    return out.detach(), grad_input, {n: p.grad.clone() for n, p in block.named_parameters()}


def _graph(block, x):
    """A fresh forward's ([output], [input]) for questions about its backward graph."""
    inp = x.clone().requires_grad_(True)
    return [block(inp, attention_mask=None)], [inp]


def _checks(port: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from piper_plugin.adapters.megatron import apply_cpu_fixes

    apply_cpu_fixes()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from piper_plugin.adapters.megatron.linear import SplitLinear, install_split_linears, stage_backward_splits
    from piper_plugin.autograd.split_backward import weight_pass_repeats_work

    parallel_state.initialize_model_parallel(1, 1)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    megatron, piper = _block(), _block()
    report: dict = {"before": stage_backward_splits(piper)}
    install_split_linears(piper)
    install_split_linears(piper)  # a second install changes nothing
    report["after"] = stage_backward_splits(piper)
    moe = _block(moe=True)
    install_split_linears(moe)
    report["moe"] = stage_backward_splits(moe)  # its router's gate is a matrix outside a linear layer
    recomputed = _block(recompute=True)
    install_split_linears(recomputed)
    report["recompute"] = stage_backward_splits(recomputed)

    torch.manual_seed(1)
    x = torch.randn(8, 2, 32)
    g = torch.randn(8, 2, 32)

    def run(block, split: bool):
        counter = CountMatmuls()
        out, grad_input, grads = _step(block, x, g, split, counter)
        return out, grad_input, grads, counter.count, weight_pass_repeats_work(*_graph(block, x))

    ref = run(megatron, split=False)
    routed = run(piper, split=False)
    split = run(piper, split=True)
    twice = run(megatron, split=True)
    report["equal_full"] = bool(torch.equal(ref[0], routed[0]) and torch.equal(ref[1], routed[1])
                                and all(torch.equal(ref[2][n], routed[2][n]) for n in ref[2]))
    report["equal_split"] = bool(torch.equal(ref[1], split[1]) and all(torch.equal(ref[2][n], split[2][n]) for n in ref[2]))
    report["equal_megatron_split"] = bool(all(torch.equal(ref[2][n], twice[2][n]) for n in ref[2]))
    report["matmuls"] = {"megatron": ref[3], "piper": routed[3], "piper split": split[3], "megatron split": twice[3]}
    report["repeats"] = {"piper": split[4], "megatron": twice[4]}
    # a call Megatron's Function must make (a deferred weight-gradient buffer) goes to it
    layer = next(m for m in piper.modules() if type(m).__name__ == "ColumnParallelLinear")
    deferred = layer._forward_impl(input=torch.randn(4, 1, 32, requires_grad=True), weight=layer.weight, bias=None,
                                   gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                                   grad_output_buffer=[], wgrad_deferral_limit=0, tp_group=None)
    report["fallback"] = type(deferred.grad_fn).__name__
    plain = layer._forward_impl(input=torch.randn(4, 1, 32, requires_grad=True), weight=layer.weight, bias=None,
                                gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                                grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None)
    report["routed"] = type(plain.grad_fn).__name__ == f"{SplitLinear.__name__}Backward"
    dist.destroy_process_group()
    return report


@pytest.mark.slow
def test_split_linears_equal_megatrons_and_split_without_repeating_work():
    report = run_ranks(_rank, 1)[0]
    assert "error" not in report, report["error"]
    assert (report["before"], report["after"], report["moe"], report["recompute"]) == (False, True, False, False)
    assert report["equal_full"], "Piper's linear forward/backward differs from Megatron's Function"
    assert report["equal_split"], "input pass + weight pass differ from one full backward"
    assert report["equal_megatron_split"]
    counts = report["matmuls"]
    assert counts["piper"] == counts["megatron"] > 0
    assert counts["piper split"] == counts["piper"], counts  # each product once, split or not
    assert counts["megatron split"] > counts["megatron"], counts  # Megatron's Function repeats them
    assert report["repeats"] == {"piper": False, "megatron": True}
    assert report["routed"]
    assert report["fallback"] == "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def _tp_rank(rank: int, port: int, sequence_parallel: bool, out) -> None:
    try:
        report = _tp_checks(rank, port, sequence_parallel)
    except BaseException as exc:  # noqa: BLE001 - the test sees the rank's error
        import traceback

        report = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    out.put((rank, report))


def _tp_checks(rank: int, port: int, sequence_parallel: bool) -> dict:
    """Tensor parallel 2 (with or without sequence parallelism): a block's input gradient and
    every local weight gradient through SplitLinear, full and split, against Megatron's Function."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from piper_plugin.adapters.megatron import apply_cpu_fixes

    apply_cpu_fixes()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from piper_plugin.adapters.megatron.linear import install_split_linears, stage_backward_splits

    parallel_state.initialize_model_parallel(2, 1)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    def block():
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, use_cpu_initialization=True, add_bias_linear=True,
                                   tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        return TransformerBlock(config, get_gpt_layer_local_spec(), pre_process=True, post_process=False)

    megatron, piper = block(), block()
    install_split_linears(piper)
    torch.manual_seed(1)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    if sequence_parallel:  # each TP rank holds its slice of the sequence
        x, g = x.chunk(2)[rank].contiguous(), g.chunk(2)[rank].contiguous()

    ref, full, split = (_step(megatron, x, g, False), _step(piper, x, g, False), _step(piper, x, g, True))
    same = lambda a, b: bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # noqa: E731
                             and a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2]))
    report = {"splits": stage_backward_splits(piper), "equal_full": same(ref, full), "equal_split": same(ref, split)}
    dist.destroy_process_group()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_split_linears_under_tensor_parallelism_equal_megatrons(sequence_parallel):
    reports = run_ranks(_tp_rank, 2, sequence_parallel)
    for rank, report in sorted(reports.items()):
        assert "error" not in report, report["error"]
        assert report == {"splits": True, "equal_full": True, "equal_split": True}, (rank, report)
