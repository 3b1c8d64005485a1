"""Split backward: input gradients first (BI), weight gradients later (BW), with no work done twice.

BI runs autograd from a chunk's outputs to its input leaves only, keeping the graph, and records
the gradient arriving at every *frontier* node: an autograd node on a path to an input with an
edge into a subgraph that reaches weights but no input (for ``x @ W.T`` that is the matmul's
node; the subgraph is ``W``'s transpose and accumulator). BW restarts autograd at the frontier
nodes with the recorded gradients and asks for the weights alone, so only the weight-side
kernels run. Weights are every leaf the graph reaches that is not a chunk input (tied and
wrapped weights included); their gradients accumulate into ``.grad`` as in a full backward.

Invariant: BI + BW yields exactly the input and weight gradients of one full backward. Every
path from an output to a weight crosses from the input side to the weight side once, at a
frontier node's edge, or never touches the input side (outputs whose graph reaches no input
start a backward of their own). Frontier nodes sharing a weight run in one backward in which
each one's incoming gradient is pinned to its recorded value, so a path recomputed through
another frontier node of the group is not counted twice.

Two kinds of group skip that replay (one autograd call per group, each walking the graph again):
groups whose weights are all vectors (norm scales, biases: an elementwise pass's cost) get their
gradients in BI's own call, returned rather than accumulated (unless a weight also hangs below an
output that reaches no input); groups made only of custom
Functions marked ``defers_weight_grads`` hand their work to BI's store
(:mod:`.deferred_weights`). BW accumulates both in one autograd call, so no weight sees a
gradient before BW.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge

from piper_plugin.autograd.deferred_weights import DeferredWeightGrads

__all__ = ["backward_input", "PendingWeightGrads", "weight_pass_repeats_work"]


class _Group:
    __slots__ = ("nodes", "weights")

    def __init__(self, nodes: list, weights: list[torch.Tensor]):
        self.nodes, self.weights = nodes, weights


class PendingWeightGrads:
    """What BI leaves for BW: the frontier groups and the gradients recorded at them.

    ``outs`` / ``grads`` (the chunk's outputs and their gradients) keep the graph alive and let
    a host that must see every hook (FSDP) replay one full backward instead of :meth:`run`.
    """

    def __init__(self, outs: list[torch.Tensor], grads: list[torch.Tensor], groups: list[_Group],
                 recorded: dict, root_edges: list[GradientEdge], root_grads: list[torch.Tensor],
                 root_weights: list[torch.Tensor], deferred: DeferredWeightGrads,
                 early: tuple[list[torch.Tensor], list[torch.Tensor | None]]):
        self.outs, self.grads = outs, grads
        self._groups, self._recorded = groups, recorded
        self._roots = (root_edges, root_grads, root_weights)
        self._deferred, self._early = deferred, early  # the store; (vector weights, BI's gradients)
        # what BI made and leaves alive for BW, beyond the chunk's saved activations and output
        # gradients: the recorded gradients, each storage once
        kept = [g for grads in recorded.values() for g in grads if g is not None]
        kept += [g for g in early[1] if g is not None] + deferred.held
        storages = {g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in kept}
        for g in grads:
            storages.pop(g.untyped_storage()._cdata, None)
        self.recorded_bytes = sum(storages.values())

    def run(self) -> None:
        """Accumulate every weight gradient into ``.grad``; the graph is released afterwards."""
        for group in self._groups:
            edges, grads = [], []
            for node in group.nodes:
                for i, g in enumerate(self._recorded.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue  # no gradient reached this group in BI: its weights get none
            pins = [node.register_prehook(_pin(self._recorded[node])) for node in group.nodes
                    if node in self._recorded] if len(group.nodes) > 1 else []
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.weights)
            finally:
                for handle in pins:
                    handle.remove()
        edges, grads = self._deferred.compute()
        for w, g in zip(*self._early):
            if g is not None:
                edges.append(get_gradient_edge(w))
                grads.append(g)
        if edges:  # each edge leads to weights alone: one call accumulates them all
            torch.autograd.backward(edges, grads, retain_graph=True)
        edges, grads, weights = self._roots
        if edges:
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=weights)
        self.outs = self.grads = []
        self._groups, self._recorded, self._roots = [], {}, ([], [], [])
        self._early = ([], [])


def _pin(recorded: tuple):
    return lambda grad_outputs: recorded


def weight_pass_repeats_work(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> bool:
    """Whether splitting this backward would run some of it twice: a custom autograd Function
    sits on the frontier (e.g. a linear layer written as one Function of input and weight). Its
    backward computes every gradient it returns in one call whatever BI asks for, and BW calls it
    again, so BI + BW costs about two full passes through it (built-in nodes compute only the
    gradients their edges need). A Function that computes only the gradients the running pass
    executes (``torch._C._will_engine_execute_node`` on its edges) says so with a class attribute
    ``backward_splits = True`` and does not count."""
    roots = [get_gradient_edge(t) for t in outs]
    frontier, _, _ = _frontier(roots, {id(t) for t in inputs})
    return any(isinstance(node, BackwardCFunction) and not getattr(node._forward_cls, "backward_splits", False)
               for node in frontier)


def _frontier(roots: list[GradientEdge], input_ids: set[int]) -> tuple[dict, dict, dict]:
    """Frontier node -> ids of the weights below its weight-side edges; plus :func:`_classify`'s
    reaches-input and weights-below maps and id -> weight."""
    reaches_input, weights_below, weights = _classify([e.node for e in roots], input_ids)
    frontier: dict = {}
    for node, reaches in reaches_input.items():
        if not reaches:
            continue
        below: set[int] = set()
        for child, _ in node.next_functions:
            if child is not None and not reaches_input[child]:
                below |= weights_below[child]
        if below:
            frontier[node] = below
    return frontier, (reaches_input, weights_below), weights


def backward_input(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], PendingWeightGrads]:
    """Gradients of ``inputs`` (leaves requiring grad) now; the weights' work for later."""
    outs, grads = list(outs), list(grads)
    roots = [get_gradient_edge(t) for t in outs]
    frontier, (reaches_input, weights_below), weights = _frontier(roots, {id(t) for t in inputs})
    groups = _group(frontier, weights)

    root_edges, root_grads, root_weights = [], [], set()
    for edge, g in zip(roots, grads):
        if not reaches_input[edge.node] and weights_below[edge.node]:
            root_edges.append(edge)
            root_grads.append(g)
            root_weights |= weights_below[edge.node]

    replayed, cleared, early = [], set(), []
    for group in groups:
        if all(_defers(node) for node in group.nodes):
            cleared.update(group.nodes)
        elif all(w.dim() <= 1 and id(w) not in root_weights for w in group.weights):
            # BI's call reaches these from every output: not from one that BW runs on its own too
            early += group.weights
        else:
            replayed.append(group)
    store = DeferredWeightGrads(cleared)
    recorded: dict = {}
    handles = [node.register_prehook(_record(recorded, node)) for group in replayed for node in group.nodes]
    try:
        with store:
            got = (torch.autograd.grad(outs, [*inputs, *early], grads, retain_graph=True, allow_unused=True)
                   if outs and inputs else [None] * (len(inputs) + len(early)))
    finally:
        for handle in handles:
            handle.remove()
    pending = PendingWeightGrads(outs, grads, replayed, recorded, root_edges, root_grads,
                                 [weights[i] for i in sorted(root_weights)], store, (early, list(got[len(inputs):])))
    return list(got[:len(inputs)]), pending


def _defers(node) -> bool:
    """A custom Function's node whose class hands its weight work to BI's store."""
    return isinstance(node, BackwardCFunction) and getattr(node._forward_cls, "defers_weight_grads", False)


def _record(recorded: dict, node):
    def hook(grad_outputs):
        recorded[node] = grad_outputs

    return hook


def _classify(roots: list, input_ids: set[int]) -> tuple[dict, dict, dict]:
    """Walk the graph below ``roots`` once (iteratively: graphs can be deep).

    Returns, per autograd node: whether it reaches an input leaf; for nodes that do not, the ids
    of the weight leaves below them; and id -> tensor of every weight leaf.
    """
    reaches: dict = {}
    below: dict = {}
    weights: dict[int, torch.Tensor] = {}
    stack = [(node, False) for node in roots if node is not None]
    while stack:
        node, expanded = stack.pop()
        if node in reaches:
            continue
        if expanded:
            children = [c for c, _ in node.next_functions if c is not None]
            hit = any(reaches[c] for c in children)
            reaches[node] = hit
            below[node] = frozenset() if hit else frozenset().union(*(below[c] for c in children))
            continue
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's accumulator
        if leaf is not None:
            is_input = id(leaf) in input_ids
            reaches[node] = is_input
            below[node] = frozenset() if is_input else frozenset((id(leaf),))
            if not is_input:
                weights[id(leaf)] = leaf
            continue
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in reaches)
    return reaches, below, weights


def _group(frontier: dict, weights_by_id: dict[int, torch.Tensor]) -> list[_Group]:
    """Frontier nodes that share a weight end up in one group (union-find over weights)."""
    parent: dict[int, int] = {}

    def find(w: int) -> int:
        while parent.setdefault(w, w) != w:
            parent[w] = parent[parent[w]]
            w = parent[w]
        return w

    for weights in frontier.values():
        first, *rest = weights
        for w in rest:
            parent[find(w)] = find(first)
    nodes: dict[int, list] = {}
    weights_of: dict[int, set[int]] = {}
    for node, weights in frontier.items():
        root = find(next(iter(weights)))
        nodes.setdefault(root, []).append(node)
        weights_of.setdefault(root, set()).update(weights)
    return [_Group(nodes[r], [weights_by_id[w] for w in sorted(weights_of[r])]) for r in nodes]
