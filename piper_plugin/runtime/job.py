"""A training job: what every launcher needs to compile a plan and run workers.

The callables are the user's own: ``model_fn`` builds the model (called under a seed, so
every rank initialises exactly as single-device training would), ``data_fn(seed)`` yields
global batches ``(inputs..., target)``, ``schedule_fn`` applies directives, and
``optimizer_fn`` / ``lr_scheduler_fn`` wrap any torch optimizer and LR scheduler (``optimizer_fn``
gets a region's parameters as a :class:`~piper_plugin.runtime.optimizers.ParamList`, names
included, and ZeRO rebinds its groups to shards). ``schedule_fn``
turns the captured program into a :class:`Schedule` (its grid sets the world size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

from piper_plugin.api.schedule import Schedule
from piper_plugin.compiler import Compiled, compile_job
from piper_plugin.ir.capture import Program

__all__ = ["Job"]


@dataclass
class Job:
    model_fn: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    data_fn: Callable[[int], Iterator[tuple[torch.Tensor, ...]]]
    schedule_fn: Callable[[Program], Schedule]
    optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer]  # called with a ParamList
    steps: int = 10
    seed: int = 0
    timeout_s: float = 60.0
    lr_scheduler_fn: Callable[[torch.optim.Optimizer], object] | None = None
    capture_grads: bool = False
    device: str = "cpu"  # "cuda": each rank uses GPU LOCAL_RANK with NCCL; "cpu": gloo

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.model_fn()

    def compile(self) -> Compiled:
        """This job's strategy compiled on its first batch's shapes."""
        return compile_job(self)
