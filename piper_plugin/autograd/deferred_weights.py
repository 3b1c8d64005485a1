"""Weight gradients a layer hands from the input pass (BI) to the weight pass (BW).

A split backward (:mod:`.split_backward`) ordinarily replays each frontier node in BW, one
autograd call per group of nodes sharing a weight: exact, but each call walks the graph again.
A custom autograd Function whose class says ``defers_weight_grads = True`` can do better: while
BI runs, :func:`deferred_weight_grads` gives it the pass's store (only for nodes the split has
cleared: every weight below the node is reached through such nodes alone), and the Function
hands over what the weight gradients need instead of computing them; BW computes them and
accumulates every deferred gradient in one autograd call.

Invariants: a deferred gradient is computed by the Function's own code on the tensors its
backward saw, so it equals what the Function computes in one full backward; it enters autograd
at the node's own weight edges (hooks on the weights' accumulators see it as in a full
backward); a store is open only inside its BI, and a cleared node finds it from whichever
thread autograd runs it on (a GPU's backward runs on the device's own thread), since a node
belongs to one graph and one BI at a time.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["DeferredWeightGrads", "deferred_weight_grads", "will_execute"]

_open: list["DeferredWeightGrads"] = []  # the stores of the BIs running now, on any thread


class DeferredWeightGrads:
    """What BI's cleared Functions handed over: per node, its weight edges and the work.
    ``with store:`` opens it around BI's autograd call."""

    def __init__(self, nodes: set) -> None:
        self.nodes = nodes  # the frontier nodes cleared to defer
        self.held: list[torch.Tensor] = []  # tensors made in BI that the work keeps until BW
        self._work: list[tuple[list[GradientEdge], Callable[[], Sequence[torch.Tensor | None]]]] = []

    def defer(self, edges: Sequence[GradientEdge], compute: Callable[[], Sequence[torch.Tensor | None]],
              holds: Sequence[torch.Tensor] = ()) -> None:
        """``compute()`` returns one gradient (or None) per edge of ``edges`` (the node's own
        weight edges); ``holds``: tensors made in BI that it keeps alive until BW (counted)."""
        self._work.append((list(edges), compute))
        self.held.extend(holds)

    def compute(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Every deferred gradient, in the order BI handed them over; the store is emptied."""
        edges, grads = [], []
        for node_edges, work in self._work:
            for edge, g in zip(node_edges, work()):
                if g is not None:
                    edges.append(edge)
                    grads.append(g)
        self._work, self.held = [], []
        return edges, grads

    def __enter__(self) -> "DeferredWeightGrads":
        _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _open.remove(self)


def deferred_weight_grads(ctx) -> DeferredWeightGrads | None:
    """Inside a custom Function's backward: the running BI's store if this node (``ctx``) is
    cleared to defer its weight gradients, else None (compute them as usual)."""
    for store in tuple(_open):
        if ctx in store.nodes:
            return store
    return None


def will_execute(node) -> bool:
    """Inside a backward: whether the running autograd pass executes ``node`` (one of the
    Function's input edges' nodes), so that a Function computes only the gradients the pass
    uses. A leaf that ``autograd.grad`` captures (an input fed straight into the Function) is
    executed, though torch's query refuses to answer for such leaves."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
