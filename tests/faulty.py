"""A two-stage model whose stage-1 chunk can raise, die, stall or turn NaN on one rank (fault tests)."""
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

import piper_plugin as piper

_plan = {"fault": None, "rank": -1, "call": 1, "n": 0}  # set in each process by TwoStage()


def trip(x: torch.Tensor) -> torch.Tensor:
    """Inside a chunk at run time: on the planned rank, at the planned call, raise, die or stall."""
    if dist.is_initialized() and dist.get_rank() == _plan["rank"]:
        _plan["n"] += 1
        if _plan["n"] == _plan["call"]:
            fault = _plan["fault"]
            if fault == "raise":
                raise RuntimeError("boom inside the stage-1 chunk")
            if fault == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stall":
                time.sleep(120)
            if fault == "nan":
                return x * float("nan")
    return x


torch.fx.wrap("trip")


class TwoStage(nn.Module):
    def __init__(self, dim: int = 8, fault: str | None = None, rank: int = 1, call: int = 1):
        super().__init__()
        _plan.update(fault=fault, rank=rank, call=call, n=0)
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        with piper.annotate(PP=0):
            h = torch.relu(self.a(x))
        with piper.annotate(PP=1):
            return self.b(trip(h))


def mse(out, target):
    return ((out - target) ** 2).mean()


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def cast_while_training(h: torch.Tensor) -> torch.Tensor:
    """bf16 while gradients are on: the one-microbatch shape probe (no gradients) sees fp32."""
    return h.to(torch.bfloat16) if torch.is_grad_enabled() else h


torch.fx.wrap("cast_while_training")


class ShiftingDtype(TwoStage):
    """Stage 0's output changes dtype between the probe and the run."""

    def forward(self, x):
        with piper.annotate(PP=0):
            h = cast_while_training(torch.relu(self.a(x)))
        with piper.annotate(PP=1):
            return self.b(h.float())
