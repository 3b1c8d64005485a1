"""What each region's forward keeps for its backward, and what its backward allocates,
measured without real memory.

The regions run in order on fake CPU tensors (FakeTensorMode picks the kernels the CPU
would: e.g. the fused SDPA that saves q, k, v, out and a log-sum-exp, not the math path's
attention matrix), each input from another region made a fresh autograd leaf as the runtime
does. A region's activation bytes are the storages its forward's ops made that are still
alive once it returned (each once: views share a storage; parameters and inputs are no op's
new storage): what autograd saves, what activation checkpointing keeps in its own frames, and
the outputs (the runtime keeps them as backward roots). Its backward then runs on the same fake
tensors under :class:`~piper_plugin.autograd.working_memory.WorkingMemory`, gradients already
allocated (the state of every microbatch after a step's first): once whole (B), and once split
as the runtime splits it (BI, then BW). Each op's level is kept in two parts, what scales with the batch and
the parameter-sized gradients that do not, so the simulator can read a microbatch's peak.
Regions of one structure on inputs of one shape are measured once. Invariant: the simulator's
activation and backward memory is the runtime meter's, up to allocator effects.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Container, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg
from torch.utils.flop_counter import FlopCounterMode

from piper_plugin.ir.graph import BackwardBytes, Rise
from piper_plugin.autograd.split_backward import backward_input
from piper_plugin.autograd.working_memory import WorkingMemory

__all__ = ["RegionMemory", "fake_copy", "region_memory", "saved_activation_bytes"]


@dataclass(frozen=True)
class RegionMemory:
    """One region's memory for the batch it ran on: saved activations, backward working memory;
    with them the forward's matrix-product FLOPs as torch's flop counter counts them (what
    :attr:`~piper_plugin.Region.matmul_flops` holds, for a region a host cut itself)."""

    saved: int
    backward: BackwardBytes
    matmul_flops: int = 0


def fake_copy(model: nn.Module, mode: FakeTensorMode, device: torch.device | str = "cpu") -> nn.Module:
    """``model`` with every parameter and buffer a fake tensor on ``device`` (no data is copied)."""
    device = torch.device(device)
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
            for p in model.parameters()}
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = FakeTensor(mode, torch.empty(p.shape, dtype=p.dtype, device="meta"), device)
                module._parameters[name] = nn.Parameter(fake, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = FakeTensor(mode, torch.empty(b.shape, dtype=b.dtype, device="meta"), device)
    return clone


def saved_activation_bytes(program, model: nn.Module, loss_fn: Callable, inputs: Sequence[Any]) -> dict[str, int]:
    """Per region: the bytes one forward keeps for its backward (see :func:`region_memory`)."""
    return {name: m.saved for name, m in region_memory(program, model, loss_fn, inputs).items()}


def region_memory(program, model: nn.Module, loss_fn: Callable, inputs: Sequence[Any],
                  fake: bool = True, *, split: bool = True,
                  measure: Container[str] | None = None) -> dict[str, RegionMemory]:
    """Per region (in program order, each fed the outputs of those before): what one forward
    keeps and what its backward allocates. Regions of one structure on inputs of one shape (a
    model's repeated layers) are measured once. ``fake=False`` measures ``model`` itself on
    real tensors instead (a check of the fake run; it zeroes the model's gradients). ``split=False``
    measures the whole backward alone (a region whose graph allows one backward: selective
    activation checkpointing). ``measure``: only these regions (the others run forward only, to
    feed them): ranks can share the work and exchange the results. Code under ``torch.compile``
    (a host's compiled blocks or loss) runs eagerly here: a compiled kernel would read fake
    tensors' memory."""
    with torch.compiler.set_stance("force_eager"):
        return _region_memory(program, model, loss_fn, inputs, fake, split, measure)


def _region_memory(program, model: nn.Module, loss_fn: Callable, inputs: Sequence[Any], fake: bool, split: bool,
                   measure: Container[str] | None) -> dict[str, RegionMemory]:
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        model = fake_copy(model, mode)
        inputs = [mode.from_tensor(t.to("cpu") if t.device.type == "meta" else t) if isinstance(t, torch.Tensor)
                  else t for t in inputs]
    chunks = program.instantiate(model, loss_fn)
    result: dict[str, RegionMemory] = {}
    measured: dict[str, RegionMemory] = {}
    with mode:
        for p in model.parameters():
            if p.requires_grad:  # gradients exist: a backward's new ones are temporaries added in
                p.grad = torch.zeros_like(p)
        env: dict[str, Any] = dict(zip(program.input_names, inputs))
        for name, region in program.regions.items():
            chunk = chunks[name]

            def leaves() -> list:
                return [env[v] if v in program.input_names or not isinstance(env[v], torch.Tensor)
                        else env[v].detach().requires_grad_(env[v].is_floating_point()) for v in region.inputs]

            def forward(tracker: WorkingMemory) -> tuple[list, Any, int]:
                args = leaves()
                outs, saved = _forward(chunk, args, tracker)
                return args, outs, saved

            def keep(outs) -> None:  # the regions after this one read its outputs
                env.update({v: t.detach() if isinstance(t, torch.Tensor) else t for v, t in zip(region.outputs, outs)})

            args = leaves()
            if measure is not None and name not in measure:
                with torch.no_grad():
                    keep(chunk(*args))
                continue
            key = _structure(program.graphs.get(name), chunk, args)
            if key in measured:
                with torch.no_grad():
                    keep(chunk(*args))
                result[name] = measured[key]
                continue
            tracker = WorkingMemory(record=True)
            with FlopCounterMode(display=False) as counter:
                outs, saved = _forward(chunk, args, tracker)
            keep(outs)
            weights = [p for p in chunk.parameters() if p.requires_grad] if region.params else []
            full = _whole_backward(tracker, outs, weights)
            del args, outs
            backward = _split_backward(forward, full, weights) if split else BackwardBytes(full=full)
            result[name] = measured[key] = RegionMemory(saved, backward, counter.get_total_flops())
    return result


def _forward(chunk: nn.Module, args: list, tracker) -> tuple[Any, int]:
    """Run ``chunk`` under ``tracker``: what it keeps is every storage its ops made that is
    still alive once it returned (what autograd saved, what activation checkpointing keeps in
    its own frames, the outputs; parameters and inputs are no op's new storage). Returns the
    outputs and those storages' bytes."""
    before = tracker.settle()
    with tracker:
        outs = chunk(*args)
    return outs, tracker.settle() - before


def _structure(graph, chunk: nn.Module, args: list) -> str:
    """The region's ops (parameters and modules by shape, values by position) and its inputs'
    shapes: equal for regions whose memory is equal, such as a model's repeated layers. A
    module region (no graph) is its chunk's modules and their parameters' shapes."""
    shapes = [(tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    if graph is None:
        return repr((repr(chunk), [(tuple(p.shape), p.dtype, p.requires_grad) for p in chunk.parameters()], shapes))
    index = {n: i for i, n in enumerate(graph.nodes)}
    ops = []
    for n in graph.nodes:
        target: Any = n.target
        if n.op == "placeholder":
            target = None
        elif n.op == "get_attr":
            value = functools.reduce(getattr, n.target.split("."), chunk)
            target = (tuple(value.shape), value.dtype, value.requires_grad) if isinstance(value, torch.Tensor) else value
        elif n.op == "call_module":
            module = chunk.get_submodule(n.target)
            target = (repr(module), tuple((k, tuple(p.shape), p.requires_grad) for k, p in module.named_parameters()))
        ops.append((n.op, target, map_arg((n.args, n.kwargs), index.__getitem__)))
    return repr((ops, shapes))


def _roots(outs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs a backward starts from and incoming gradients of their sizes (the runtime's
    arrive as messages before the backward starts: not working memory)."""
    roots = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


# A region probed on the example batch runs on microbatches of 1/k of it (k: microbatches x data
# shards): the rises keep the levels that are the peak for one of these.
_SCALES = tuple(1 / k for k in range(1, 65)) + tuple(1 / 2 ** k for k in range(7, 13))


@contextlib.contextmanager
def _probing(tracker, params: list[torch.Tensor]):
    """``tracker`` active; each parameter's incoming gradient marked as not scaling with the batch."""
    handles = [p.register_hook(lambda g: tracker.mark_fixed(g) or None) for p in params]
    try:
        with tracker:
            yield tracker
    finally:
        for handle in handles:
            handle.remove()


def _whole_backward(tracker, outs, params: list[torch.Tensor]) -> Rise:
    """One full backward from ``outs``: its rise above the start (saved activations, tracked by
    ``tracker`` since the forward, are let go as it goes: the level falls with them)."""
    roots, grads = _roots(outs)
    del outs
    with _probing(tracker, params):
        if roots:
            torch.autograd.backward(roots, grads)
    return Rise(tracker.rise_by_batch(_SCALES))


def _split_backward(forward: Callable, full: Rise, params: list[torch.Tensor]) -> BackwardBytes:
    """BI then BW as the runtime runs them, on a fresh forward (``forward(tracker)`` returns its
    inputs, outputs and saved bytes); ``full``: the whole backward's rise."""
    tracker = WorkingMemory(record=True)
    args, outs, _ = forward(tracker)
    roots, grads = _roots(outs)
    del outs
    wanted = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with _probing(tracker, params):
        got, pending = backward_input(roots, grads, wanted)
    inputs = Rise(tracker.rise_by_batch(_SCALES))
    returned = sum(g.untyped_storage().nbytes() for g in got if g is not None)
    del got
    if not params:
        return BackwardBytes(full=full, inputs=inputs)
    batch, fixed = tracker.live_by_batch()  # recorded for BW, alive until it ran
    kept = Rise.of(max(0, batch - returned), fixed)
    weights = WorkingMemory(record=True)
    with _probing(weights, params):
        pending.run()
    return BackwardBytes(full=full, inputs=inputs, kept=kept, weights=Rise(weights.rise_by_batch(_SCALES)))
