"""Shapes of the values that cross ranks, for one microbatch of one data shard.

Receivers allocate buffers from these specs, so a P2P transfer is the data alone. Values that
are not tensors (sizes read in one region, used in another) are static for a given microbatch
size: the receiver takes them from here and nothing is sent.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from piper_plugin.ir.activations import fake_copy
from piper_plugin.ir.capture import Program

__all__ = ["ValueSpec", "probe_values"]


@dataclass(frozen=True)
class ValueSpec:
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    constant: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def probe_values(program: Program, model: nn.Module, loss_fn: Callable, microbatch: dict[str, torch.Tensor], *,
                 autocast: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, ValueSpec]:
    """Run every region once with microbatch-sized inputs on fake tensors of ``device`` (no data,
    the device's kernels and dtype rules: autocast inside the model's own code applies), under
    ``torch.autocast`` in the job's ``autocast`` dtype if it has one."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device)
    fake = fake_copy(model, mode, device)
    chunks = program.instantiate(fake, loss_fn)
    values: dict[str, Any] = {k: FakeTensor(mode, torch.empty(v.shape, dtype=v.dtype, device="meta"), device)
                              for k, v in microbatch.items()}
    cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with mode, torch.no_grad(), cast:
        for name, region in program.regions.items():
            outputs = chunks[name](*[values[v] for v in region.inputs])
            values.update(zip(region.outputs, outputs))
    specs = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            specs[name] = ValueSpec(tuple(value.shape), value.dtype)
        else:
            specs[name] = ValueSpec(None, None, value)
    return specs

