"""The user's optimizer over ZeRO shards: built over the parameters as written, then rebound.

``optimizer_fn`` is called with a :class:`ParamList` of a region's parameters as the model
defines them (whole shapes, ``requires_grad``, names through :meth:`ParamList.named`), so its
parameter groups (no weight decay for norms and biases, another lr for embeddings, ...) and
options are exactly the user's. With ZeRO >= 1 each parameter of each group is then replaced
by this rank's shard of it (its rows along dim 0), before any state exists. This is exact for
optimizers that update each element from that element's own gradient and state (SGD, Adam,
AdamW, ...); others (Muon, Shampoo, Adafactor, LBFGS: they read a parameter's whole matrix)
are refused with the fix, unless the optimizer class sets ``elementwise = True``.
:class:`HostOptimizer` stands in where the host steps its own optimizer.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["HostOptimizer", "ParamList", "rebind", "ELEMENTWISE", "is_elementwise"]

#: torch optimizers whose update of an element reads only that element's gradient and state.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name))


class ParamList(list):
    """A list of parameters that also knows their names in the model (``named()``)."""

    def __init__(self, params: list[nn.Parameter], names: list[str]):
        super().__init__(params)
        self.names = list(names)

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return list(zip(self.names, self))


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    cls = type(optimizer)
    if getattr(cls, "elementwise", False):
        return True
    # a subclass that keeps the built-in step keeps its element-wise update
    return any(cls is base or (issubclass(cls, base) and cls.step is base.step) for base in ELEMENTWISE)


def rebind(optimizer: torch.optim.Optimizer, shards: dict[int, nn.Parameter], region: str) -> None:
    """Replace every parameter of ``optimizer``'s groups found in ``shards`` (by id) with its
    shard. Refuses an optimizer that holds state already or whose update is not element-wise."""
    name = type(optimizer).__name__
    if getattr(optimizer, "host_steps", False):
        return  # the host steps its own optimizer over the shards' DTensor faces
    if not is_elementwise(optimizer):
        raise ValueError(
            f"region {region!r} is replicated with ZeRO >= 1, so its optimizer steps shards of each parameter, "
            f"but {name} is not an element-wise optimizer Piper knows (it may read a parameter's whole matrix, as "
            f"Muon, Shampoo and Adafactor do): use replicate(zero=0) for this region, an element-wise optimizer "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}), or set {name}.elementwise = True if its update of "
            f"each element reads only that element's gradient and state")
    if optimizer.state:
        raise ValueError(f"region {region!r}: optimizer_fn returned a {name} that already holds state; Piper shards "
                         f"the parameters before the first step, so build the optimizer fresh and load its state "
                         f"through Executor.load_state_dict")
    for group in optimizer.param_groups:
        group["params"] = [shards.get(id(p), p) for p in group["params"]]


class HostOptimizer:
    """The optimizer UPDATE tasks call when the host steps its own: nothing. The host clips and
    steps the parameters itself, reading the gradients left in ``param.grad`` (or in the faces'
    ``.grad`` for ZeRO shards)."""

    host_steps = True

    def __init__(self, params: list[nn.Parameter]):
        self.params = list(params)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}  # the host checkpoints its own optimizer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
