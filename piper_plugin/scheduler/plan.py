"""The central scheduler: global DAG -> one plan per rank, a total order per logical stream.

Passes, in order:
1. *prefetch*: a ZeRO-3 gather waits for the compute task before its consumer on that rank,
   so gathered parameters live for about one chunk (not for the whole step);
2. *P2P alignment*: on every direction's communicator, SENDs and RECVs are chained in one
   order, so both ends issue matching operations in the same sequence;
3. one global topological order; each (rank, stream) runs its restriction of that order.
Because every stream order is a restriction of one global topological order, collectives on
a communicator are issued in the same order by every member. The simulator then proves that
the plan finishes before anything runs.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["Plan", "RankPlan", "build_plan", "PlanError"]


class PlanError(ValueError):
    """The DAG cannot be turned into per-rank plans; the message names the nodes."""


@dataclass
class RankPlan:
    rank: int
    streams: dict[str, list[str]] = field(default_factory=dict)
    deps: dict[str, tuple[str, ...]] = field(default_factory=dict)  # local preds, any stream

    def tasks(self) -> list[str]:
        return [k for keys in self.streams.values() for k in keys]


@dataclass
class Plan:
    grid: RankGrid
    dag: DAG
    order: list[str]
    ranks: list[RankPlan]

    @property
    def microbatches(self) -> int:
        return int(self.dag.meta.get("microbatches", 1))

    def node(self, key: str) -> Node:
        return self.dag.nodes[key]

    def to_json(self) -> dict[str, Any]:
        return {
            "grid": self.grid.to_json(),
            "microbatches": self.microbatches,
            "ranks": [{"rank": rp.rank, "streams": rp.streams,
                       "deps": {k: list(v) for k, v in rp.deps.items() if v}} for rp in self.ranks],
            "nodes": {k: self.dag.nodes[k].to_json() for k in self.order},
        }

    def hash(self) -> str:
        """Identical on every rank that compiles the same schedule (SPMD launch checks it)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def compute_sequence(self, rank: int) -> list[str]:
        return [k for k in self.ranks[rank].tasks() if self.dag.nodes[k].is_compute]


def _gather_prefetch(dag: DAG, order: list[str]) -> bool:
    """Chain per-microbatch ALL_GATHERs after the compute task preceding their consumer."""
    last_compute: dict[int, str] = {}
    previous: dict[str, str] = {}
    for key in order:
        node = dag.nodes[key]
        if node.is_compute and node.devices:
            lead = node.devices[0]
            if lead in last_compute:
                previous[key] = last_compute[lead]
            last_compute[lead] = key
    position = {key: i for i, key in enumerate(order)}
    changed = False
    for key, node in dag.nodes.items():
        if node.kind == Kind.ALL_GATHER and node.phase in ("F", "B") and not dag.temporal_pred[key]:
            consumers = [s for s in dag.data_succ[key] if dag.nodes[s].is_compute]
            before = previous.get(min(consumers, key=position.__getitem__))
            while before is not None and (before in dag.temporal_succ[key] or before in dag.data_succ[key]):
                before = previous.get(before)  # already after the gather (an overlap block): look earlier
            if before is not None:
                dag.add_temporal(before, key)
                changed = True
    return changed


def _align_p2p(dag: DAG, order: list[str]) -> None:
    by_direction: dict[str, list[str]] = {}
    for key in order:
        node = dag.nodes[key]
        if node.kind == Kind.SEND:
            by_direction.setdefault(node.stream, []).append(key)
    for sends in by_direction.values():
        for a, b in zip(sends, sends[1:]):
            dag.add_temporal(a, b)
            ra, rb = dag.nodes[a].peer, dag.nodes[b].peer
            dag.add_temporal(ra, rb)


def _asap_priority(dag: DAG) -> dict[str, tuple[float, int]]:
    """Earliest start with unit compute and free comm: orders comm as its producers run."""
    order = dag.topological_order()
    start: dict[str, float] = {}
    for key in order:
        t = 0.0
        for p in dag.preds(key):
            t = max(t, start[p] + (1.0 if dag.nodes[p].is_compute else 0.0))
        start[key] = t
    index = {key: i for i, key in enumerate(dag.nodes)}
    return {key: (start[key], index[key]) for key in dag.nodes}


def build_plan(dag: DAG, grid: RankGrid) -> Plan:
    """Compile a split DAG into per-rank plans (the DAG gains scheduler temporal edges)."""
    if "microbatches" not in dag.meta:
        raise PlanError("the schedule is not split: call split(microbatches=N) before compiling")
    dag = dag.copy()
    order = dag.topological_order(_asap_priority(dag))
    if _gather_prefetch(dag, order):
        order = dag.topological_order(_asap_priority(dag))
    _align_p2p(dag, order)
    try:
        order = dag.topological_order(_asap_priority(dag))
    except ValueError as exc:
        raise PlanError(f"P2P alignment is impossible: a receiver needs messages in another order "
                        f"than its sender sends them ({exc})") from None
    for key in order:
        for pred in dag.temporal_pred[key]:
            if not set(dag.nodes[pred].devices) & set(dag.nodes[key].devices):
                raise PlanError(f"order edge {pred} -> {key} joins nodes on different ranks; "
                                f"only data (comm) edges may cross ranks")
    ranks = [RankPlan(r) for r in range(grid.world_size)]
    for key in order:
        node = dag.nodes[key]
        if not node.devices:
            raise PlanError(f"node {key} has no devices: place its region")
        for r in node.devices:
            rp = ranks[r]
            rp.streams.setdefault(node.stream, []).append(key)
            rp.deps[key] = tuple(p for p in dag.preds(key) if r in dag.nodes[p].devices)
    return Plan(grid=grid, dag=dag, order=order, ranks=ranks)
