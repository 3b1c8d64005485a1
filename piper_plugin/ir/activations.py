"""What each region's forward keeps for its backward, measured without real memory.

The regions run once, in order, on fake CPU tensors (FakeTensorMode picks the kernels the
CPU would: e.g. the fused SDPA that saves q, k, v, out and a log-sum-exp, not the math path's
attention matrix), each input from another region made a fresh autograd leaf as the runtime
does. A region's activation bytes are the storages autograd saves (each once: views share a
storage; parameters' storages excluded) plus its outputs (the runtime keeps them as backward
roots). Invariant: the simulator's activation memory is the runtime meter's, up to allocator
effects.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["saved_activation_bytes"]


def _fake_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``model`` with every parameter a fake CPU tensor (no parameter data is copied)."""
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
            for p in model.parameters()}
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = FakeTensor(mode, torch.empty(p.shape, dtype=p.dtype, device="meta"), torch.device("cpu"))
                module._parameters[name] = nn.Parameter(fake, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = FakeTensor(mode, torch.empty(b.shape, dtype=b.dtype, device="meta"),
                                                   torch.device("cpu"))
    return clone


def saved_activation_bytes(program, model: nn.Module, loss_fn: Callable, inputs: Sequence[Any]) -> dict[str, int]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(model, mode)
    chunks = program.instantiate(fake, loss_fn)
    params = {p.untyped_storage()._cdata for p in fake.parameters()}
    result: dict[str, int] = {}
    with mode:
        env: dict[str, Any] = {n: mode.from_tensor(t.to("cpu") if t.device.type == "meta" else t)
                               if isinstance(t, torch.Tensor) else t for n, t in zip(program.input_names, inputs)}
        for name, region in program.regions.items():
            args = [env[v] if v in program.input_names or not isinstance(env[v], torch.Tensor)
                    else env[v].detach().requires_grad_(env[v].is_floating_point()) for v in region.inputs]
            held: dict[int, int] = {}

            def note(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage._cdata not in params:
                    held[storage._cdata] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
                outs = chunks[name](*args)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    note(t)
            result[name] = sum(held.values())
            env.update({v: t.detach() if isinstance(t, torch.Tensor) else t for v, t in zip(region.outputs, outs)})
    return result
