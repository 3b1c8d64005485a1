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

import dataclasses
import hashlib
from itertools import chain
import heapq
import json
from dataclasses import dataclass, field
from typing import Any

from piper_plugin.ir.graph import DAG, gc_paused
from piper_plugin.ir.nodes import COMPUTE, Kind, Node
from piper_plugin.ir.rank_grid import RankGrid
from piper_plugin.scheduler.lowering import lower_rank_plan
from piper_plugin.scheduler.symmetry import representatives

__all__ = ["Plan", "RankPlan", "build_plan", "PlanError"]


class PlanError(ValueError):
    """The DAG cannot be turned into per-rank plans; the message names the nodes."""


@dataclass
class RankPlan:
    """One rank's complete plan: a total order per logical stream, each task's local
    dependencies, and how the tasks run (written by :func:`lower_rank_plan`)."""

    rank: int
    streams: dict[str, list[str]] = field(default_factory=dict)
    deps: dict[str, tuple[str, ...]] = field(default_factory=dict)  # local preds, any stream
    fused: frozenset[str] = frozenset()  # BI tasks run as one full backward (their BW: nothing)
    split_first: frozenset[str] = frozenset()  # B tasks run as BI, post their sends, then BW
    inline: str | None = None  # the stream the caller's thread runs
    posted: tuple[str, ...] = ()  # P2P-only streams, issued in order without a thread; sends first
    post_bytes: dict[str, int] = field(default_factory=dict)  # bytes of each posted task

    def tasks(self) -> list[str]:
        return [k for keys in self.streams.values() for k in keys]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "streams": self.streams, "deps": {k: list(v) for k, v in self.deps.items() if v},
                "fused": sorted(self.fused), "split_first": sorted(self.split_first), "inline": self.inline,
                "posted": list(self.posted)}


@dataclass
class Plan:
    grid: RankGrid
    dag: DAG
    order: list[str]
    ranks: list[RankPlan]
    representative: list[int] = field(default_factory=list)  # per rank: the dp replica whose plan it copies

    def __post_init__(self) -> None:
        if not self.representative:
            self.representative = list(range(len(self.ranks)))

    @property
    def microbatches(self) -> int:
        return self.dag.meta.microbatches or 1

    def node(self, key: str) -> Node:
        return self.dag.nodes[key]

    def to_json(self) -> dict[str, Any]:
        return {
            "grid": self.grid.to_json(),
            "microbatches": self.microbatches,
            "ranks": [rp.to_json() for rp in self.ranks],
            "nodes": {k: self.dag.nodes[k].to_json() for k in self.order},
        }

    def hash(self) -> str:
        """Identical on every rank that compiles the same schedule (SPMD launch checks it)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def compute_sequence(self, rank: int) -> list[str]:
        return [k for k in self.ranks[rank].tasks() if self.dag.nodes[k].is_compute]


def _gather_prefetch(dag: DAG, order: list[str]) -> bool:
    """Start each per-microbatch ALL_GATHER once the compute task two before its consumer is
    done, so it runs alongside the task right before its consumer (prefetch one chunk ahead):
    at most two gathered buckets are alive per rank."""
    nodes = dag.nodes
    gathers = [key for key, node in nodes.items()
               if node.kind == Kind.ALL_GATHER and node.phase in ("F", "B") and not dag.temporal_pred[key]]
    if not gathers:
        return False
    last_compute: dict[int, str] = {}
    previous: dict[str, str] = {}
    for key in order:
        node = nodes[key]
        if node.is_compute and node.devices:
            lead = node.devices[0]
            if lead in last_compute:
                previous[key] = last_compute[lead]
            last_compute[lead] = key
    position = {key: i for i, key in enumerate(order)}
    changed = False
    for key in gathers:
        consumers = [s for s in dag.data_succ[key] if nodes[s].is_compute]
        before = previous.get(previous.get(min(consumers, key=position.__getitem__), ""))
        while before is not None and (before in dag.temporal_succ[key] or before in dag.data_succ[key]):
            before = previous.get(before)  # already after the gather (an overlap block): look earlier
        if before is not None:
            dag.add_temporal(before, key)
            changed = True
    return changed


def _align_p2p(dag: DAG, order: list[str]) -> list[tuple[str, str]]:
    """One communicator per (stream, direction): its SENDs and RECVs are chained in one order."""
    by_direction: dict[tuple[str, int, int], list[str]] = {}
    nodes = dag.nodes
    placement = dag.meta.placement
    for key in order:
        node = nodes[key]
        if node.kind == Kind.SEND:
            direction = (node.stream, placement[node.region], placement[nodes[node.peer].region])
            by_direction.setdefault(direction, []).append(key)
    added = []
    for sends in by_direction.values():
        for a, b in zip(sends, sends[1:]):
            dag.add_temporal(a, b)
            ra, rb = nodes[a].peer, nodes[b].peer
            dag.add_temporal(ra, rb)
            added += ((a, b), (ra, rb))
    return added


def _asap_order(dag: DAG) -> tuple[list[str], dict[str, float], dict[str, int]]:
    """Topological order by earliest start (unit compute, free comm). At equal starts: comm
    first, ordered by the position of its last predecessor (as its producers ran: two
    exchanges ready together follow the compute that made them, so a rank's communication
    stream follows its compute stream); then compute that feeds an all-to-all (its exchange
    starts while the next ready task computes: in an overlap block, one member's exchange
    runs under the other's compute); then other compute; each by insertion order last.

    A node's earliest start and last predecessor are final once that predecessor is ordered,
    so one Kahn pass whose heap holds each ready node's (start, class, last predecessor's
    position for comm, insertion index) gives the order of ranking every node by that key.
    Raises CycleError if the DAG has a cycle. Returns the order, the earliest starts and each
    node's last predecessor's position (-1: none).
    """
    nodes, data_succ, temporal_succ = dag.nodes, dag.data_succ, dag.temporal_succ
    data_pred, temporal_pred = dag.data_pred, dag.temporal_pred
    keys = list(nodes)
    index = {key: i for i, key in enumerate(keys)}
    indegree = {key: len(data_pred[key]) + len(temporal_pred[key]) for key in keys}
    # the tie class: 0 comm, 1 compute feeding an all-to-all, 2 other compute
    tie_class = [0 if nodes[key].kind not in COMPUTE else
                 1 if any(nodes[s].kind == Kind.ALL_TO_ALL for s in data_succ[key]) else 2 for key in keys]
    heap = [(0.0, tie_class[i], -1, i) for i, key in enumerate(keys) if not indegree[key]]  # ascending: a heap
    start = dict.fromkeys(keys, 0.0)
    last = dict.fromkeys(keys, -1)
    push, pop = heapq.heappush, heapq.heappop
    order: list[str] = []
    append = order.append
    while heap:
        t, tie, _, i = pop(heap)
        key = keys[i]
        position = len(order)
        append(key)
        done = t + 1.0 if tie else t
        for succ in chain(data_succ[key], temporal_succ[key]):
            if start[succ] < done:
                start[succ] = done
            left = indegree[succ] - 1
            indegree[succ] = left
            if not left:
                last[succ] = position
                j = index[succ]
                push(heap, (start[succ], tie_class[j], -1 if tie_class[j] else position, j))
    if len(order) != len(nodes):
        dag.topological_order()  # raises CycleError naming a cycle
    return order, start, last


def _still_asap(dag: DAG, order: list[str], start: dict[str, float], last: dict[str, int],
                added: list[tuple[str, str]]) -> bool:
    """Whether ``order`` is still :func:`_asap_order` of ``dag`` after the edges ``added``.

    It is if each added edge a -> b runs forward in ``order``, before b's last predecessor,
    and b's earliest start already allows for a (start[b] >= start[a] + a's unit): then no
    earliest start or last predecessor changes, and the greedy order, whose every pick stays
    ready, picks the same node at each step.
    """
    if not added:
        return True
    position = {key: i for i, key in enumerate(order)}
    nodes = dag.nodes
    for a, b in added:
        if position[a] >= last[b] or start[b] < start[a] + (1.0 if nodes[a].is_compute else 0.0):
            return False
    return True


def build_plan(dag: DAG, grid: RankGrid, *, split_last_backward: bool = True) -> Plan:
    """Compile a split DAG into complete per-rank plans (the DAG gains scheduler temporal
    edges). ``split_last_backward=False``: every B runs as one pass (see :mod:`.lowering`)."""
    with gc_paused():
        plan = _build_plan(dag, grid)
    rep = plan.representative
    for r, rank_plan in enumerate(plan.ranks):
        if rep[r] == r:
            lower_rank_plan(plan.dag, rank_plan, split_last_backward=split_last_backward)
    for r in range(len(plan.ranks)):
        if rep[r] != r:  # a dp replica: a copy of its class's plan (each rank's plan is its own)
            src = plan.ranks[rep[r]]
            plan.ranks[r] = dataclasses.replace(src, rank=r, streams={s: list(keys) for s, keys in src.streams.items()},
                                                deps=dict(src.deps), post_bytes=dict(src.post_bytes))
    return plan


def _build_plan(dag: DAG, grid: RankGrid) -> Plan:
    if dag.meta.microbatches is None:
        raise PlanError("the schedule is not split: call split(microbatches=N) before compiling")
    dag = dag.copy()
    order, start, last = _asap_order(dag)
    if _gather_prefetch(dag, order):
        order, start, last = _asap_order(dag)
    added = _align_p2p(dag, order)
    try:
        if not _still_asap(dag, order, start, last, added):
            order, start, last = _asap_order(dag)
    except ValueError as exc:
        raise PlanError(f"P2P alignment is impossible: a receiver needs messages in another order "
                        f"than its sender sends them ({exc})") from None
    nodes, data_pred, temporal_pred = dag.nodes, dag.data_pred, dag.temporal_pred
    ranks = [RankPlan(r) for r in range(grid.world_size)]
    rep = representatives(dag, grid)  # dp replicas share their class's plan: build it once
    builds = [r == rep[r] for r in range(grid.world_size)]
    unplaced = None  # reported after every order edge is checked
    for key in order:
        node = nodes[key]
        devices = node.devices
        temporal = temporal_pred[key]
        if len(devices) == 1:  # the common case: every order edge into it comes from its rank
            r = devices[0]
            for pred in temporal:
                if r not in nodes[pred].devices:
                    raise PlanError(f"order edge {pred} -> {key} joins nodes on different ranks; "
                                    f"only data (comm) edges may cross ranks")
            if not builds[r]:
                continue
            deps = [p for p in data_pred[key] if r in nodes[p].devices]
            if temporal:
                deps.extend(sorted(temporal))  # sets iterate in hash order: sort for a stable plan hash
            rp = ranks[r]
            stream = rp.streams.get(node.stream)
            if stream is None:
                stream = rp.streams[node.stream] = []
            stream.append(key)
            rp.deps[key] = tuple(deps)
            continue
        for pred in temporal:
            if not any(r in devices for r in nodes[pred].devices):
                raise PlanError(f"order edge {pred} -> {key} joins nodes on different ranks; "
                                f"only data (comm) edges may cross ranks")
        if not devices:
            unplaced = unplaced or key
            continue
        preds = [(p, nodes[p].devices) for p in data_pred[key]]
        preds += [(p, nodes[p].devices) for p in sorted(temporal)]
        for r in devices:
            if not builds[r]:
                continue
            rp = ranks[r]
            stream = rp.streams.get(node.stream)
            if stream is None:
                stream = rp.streams[node.stream] = []
            stream.append(key)
            rp.deps[key] = tuple(p for p, on in preds if r in on)
    if unplaced is not None:
        raise PlanError(f"node {unplaced} has no devices: place its region")
    return Plan(grid=grid, dag=dag, order=order, ranks=ranks, representative=rep)
