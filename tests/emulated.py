"""A model whose chunks spend *device time* (sleep, off the CPU and the GIL) instead of host
compute, as kernels on an accelerator do. Used to show that communication on its own
logical stream overlaps compute even on a small CPU machine."""
import time

import torch
import torch.fx
import torch.nn as nn

import piper_plugin as piper

DEVICE_SECONDS = 0.02


class _DeviceTime(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(DEVICE_SECONDS)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(DEVICE_SECONDS)
        return grad


def device_time(x: torch.Tensor) -> torch.Tensor:
    return _DeviceTime.apply(x)


torch.fx.wrap("device_time")


class Wide(nn.Module):
    """One pipeline stage of wide linears: little host compute, megabytes of parameters."""

    def __init__(self, dim: int = 1024, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        with piper.annotate(PP=0):
            for layer in self.layers:
                x = device_time(layer(x))
            return x


def mse(out, target):
    return ((out - target) ** 2).mean()


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(16, 1024, generator=g), torch.randn(16, 1024, generator=g)
