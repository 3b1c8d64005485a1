"""Shapes of the values that cross ranks, for one microbatch of one data shard.

Receivers allocate buffers from these specs, so a P2P transfer is the data alone. Values that
are not tensors (sizes read in one region, used in another) are static for a given microbatch
size: the receiver takes them from here and nothing is sent.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

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


def probe_values(program: Program, model: nn.Module, loss_fn: Callable, microbatch: dict[str, torch.Tensor]) -> dict[str, ValueSpec]:
    """Run every region once on meta tensors with microbatch-sized inputs."""
    meta_model = copy.deepcopy(model).to("meta") if any(not p.is_meta for p in model.parameters()) else model
    chunks = program.instantiate(meta_model, loss_fn)
    values: dict[str, Any] = {k: v.to("meta") for k, v in microbatch.items()}
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
