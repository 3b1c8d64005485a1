"""How a rank runs its backward tasks: which run as one pass though the DAG splits them, and
which run split though the DAG has one task. Decided once, when the plan is made
(:mod:`.lowering` writes them into each :class:`RankPlan`); the runtime runs them so and the
simulator charges their memory so."""
from __future__ import annotations

from typing import TYPE_CHECKING

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind

if TYPE_CHECKING:
    from piper_plugin.scheduler.plan import RankPlan

__all__ = ["backward_splits", "fused_backwards", "input_grads_first"]


def backward_splits(dag: DAG, region: str) -> bool:
    """Whether ``region``'s backward can run as BI then BW without repeating work (a DAG made
    without regions: yes)."""
    found = dag.regions.get(region)
    return found is None or found.backward_splits


def fused_backwards(dag: DAG, rank_plan: "RankPlan") -> set[str]:
    """BI tasks that run as one full backward (same gradients, one pass; their BW does
    nothing): those whose own BW follows right after them on the same stream (splitting buys no
    schedule freedom), and every BI of a region whose backward does not split
    (``Region.backward_splits``: a compiled graph computes both kinds of gradient at once)."""
    nodes, fused = dag.nodes, set()
    for keys in rank_plan.streams.values():
        for a, b in zip(keys, keys[1:]):
            x, y = nodes[a], nodes[b]
            if x.kind == Kind.BI and y.kind == Kind.BW and (x.region, x.microbatch) == (y.region, y.microbatch):
                fused.add(a)
        fused.update(k for k in keys if nodes[k].kind == Kind.BI and not backward_splits(dag, nodes[k].region))
    return fused


def input_grads_first(dag: DAG, rank_plan: "RankPlan") -> set[str]:
    """B tasks that send their input gradients before computing their weight gradients.

    A B qualifies when it is the last backward of its stream (only UPDATEs may follow), its
    region has parameters, and what waits for it on other streams is SENDs alone: the upstream
    rank's last backward waits for exactly that message while this rank has no backward left,
    so splitting this one B (BI, post the sends, BW) starts the upstream cool-down a weight
    pass earlier; unless the region's backward does not split (``Region.backward_splits``).
    Every other B stays one pass (a split costs 20-30% more backward on a CPU).
    """
    nodes = dag.nodes
    stream_of = {k: s for s, keys in rank_plan.streams.items() for k in keys}
    dependents: dict[str, list[str]] = {}
    for key, deps in rank_plan.deps.items():
        for dep in deps:
            dependents.setdefault(dep, []).append(key)
    chosen = set()
    for keys in rank_plan.streams.values():
        backwards = [k for k in keys if nodes[k].kind in (Kind.B, Kind.BI, Kind.BW)]
        if not backwards or nodes[backwards[-1]].kind != Kind.B:
            continue
        last = backwards[-1]
        if any(nodes[k].kind == Kind.F for k in keys[keys.index(last):]):
            continue
        if not dag.regions[nodes[last].region].params or not backward_splits(dag, nodes[last].region):
            continue
        across = [k for k in dependents.get(last, ()) if stream_of[k] != stream_of[last]]
        if across and all(nodes[k].kind == Kind.SEND for k in across):
            chosen.add(last)
    return chosen
