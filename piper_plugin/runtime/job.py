"""A training job: what every launcher needs to compile a plan and run workers.

The callables are the user's own: ``model_fn`` builds the model (called under a seed, so
every rank initialises exactly as single-device training would), ``data_fn(seed)`` yields
global batches ``(inputs..., target)``, ``schedule_fn`` applies directives, and
``optimizer_fn`` / ``lr_scheduler_fn`` wrap any torch optimizer and LR scheduler (``optimizer_fn``
gets a region's parameters as a :class:`~piper_plugin.runtime.optimizers.ParamList`, names
included, and ZeRO rebinds its groups to shards). ``schedule_fn``
turns the captured program into a :class:`Schedule` (its grid sets the world size).
``checkpoint_dir`` / ``checkpoint_every`` / ``resume_from`` save and resume the job
(:mod:`~piper_plugin.runtime.train_checkpoint`): steps run from ``first_step`` (the resumed
checkpoint's step) to ``steps``. ``autocast`` (e.g. ``torch.bfloat16``): mixed precision as a
single-device loop gets it by running model and loss under ``torch.autocast``: every forward
runs so; parameters, gradients and optimizer state stay in their own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
    checkpoint_dir: str | None = None  # save into DIR/step-<N> after the last step (and every N)
    checkpoint_every: int | None = None
    resume_from: str | None = None  # a complete checkpoint directory (DIR/step-<N>)
    first_step: int = 0  # the resumed checkpoint's step
    description: dict = field(default_factory=dict)  # what a checkpoint records about the job
    on_nonfinite_loss: str = "stop"  # "stop": end the job naming the step; "skip": no rank applies that step
    autocast: torch.dtype | None = None  # forwards under torch.autocast(device, dtype); None: as the model is

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.model_fn()

    def compile(self) -> Compiled:
        """This job's strategy compiled on its first batch's shapes."""
        return compile_job(self)
