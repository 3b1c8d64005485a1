"""Simulator: runs every rank's plan against a cost model, before any process exists.

Semantics (the runtime's): each (rank, logical stream) runs its tasks strictly in plan order;
a task starts once its local dependencies finished; compute tasks of one rank share one
compute unit; SEND is buffered (never blocks) and its RECV completes once the data arrived;
a collective starts when every member of its group reached it. If tasks remain when nothing
can start, the plan would deadlock and :class:`DeadlockError` names the blocked stream heads.

Memory per rank: parameters, gradients and AdamW state (sized by ZeRO level and EP sharding)
plus the peak of activations, gathered ZeRO-3 buckets, per-microbatch gradients awaiting a
reduce-scatter and received buffers (from their post, :mod:`.posting`), each held until its last
local consumer finishes. A bucket gathered for several microbatches at once is one copy (as in
the runtime, which counts references to it). A backward task also holds its region's working
memory while it runs (``Region.backward``, as the runtime runs that task: whole, or split in
input and weight passes), and an input-gradient pass leaves what it recorded for the weight
pass until that one finishes.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from piper_plugin.ir.graph import gc_paused
from piper_plugin.ir.nodes import COLLECTIVES, Kind
from piper_plugin.scheduler.backward_passes import fused_backwards, input_grads_first
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.posting import POST_BUDGET, post_times, posted_streams

__all__ = ["simulate", "SimResult", "DeadlockError", "static_memory"]

_BYTES_PER_OPT_STATE = 2  # AdamW keeps exp_avg and exp_avg_sq, each the size of the params


class DeadlockError(RuntimeError):
    pass


@dataclass
class SimResult:
    step_time: float
    busy: list[float]  # per rank: compute time (chunks and optimizer updates)
    timeline: list[tuple[int, str, str, float, float]]  # rank, stream, key, start, end
    static_bytes: list[dict[str, int]]
    peak_transient_bytes: list[int]
    per_rank_peak: list[int] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.step_time - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of idle compute time / step time."""
        return sum(self.idle) / (len(self.busy) * self.step_time) if self.step_time else 0.0

    @property
    def peak_memory(self) -> list[int]:
        return [sum(s.values()) + t for s, t in zip(self.static_bytes, self.peak_transient_bytes)]


def static_memory(plan: Plan) -> list[dict[str, int]]:
    """Per rank: bytes of params, grads and optimizer state kept across the step."""
    dag, grid = plan.dag, plan.grid
    sizes = dag.meta["param_bytes"]
    sharded = dag.meta.get("sharded", {})
    out = []
    for r in range(grid.world_size):
        mem = {"params": 0, "grads": 0, "optimizer": 0}
        for region, params in dag.meta.get("update_params", {}).items():
            node = dag.nodes.get(f"{region}F0")
            if node is None or r not in node.devices:
                continue
            full = sum(sizes[p] for p in params) // sharded.get(region, 1)
            zero = dag.meta.get("replicated", {}).get(region, 0)
            buckets = dag.buckets.get(region) or []
            axis = "dp" if region in sharded else "data"
            n = len(grid.groups(axis, node.devices)[0]) if buckets else 1
            shard = -(-full // n)
            mem["params"] += shard if zero == 3 else full
            mem["grads"] += shard if zero >= 2 else full
            mem["optimizer"] += _BYTES_PER_OPT_STATE * (shard if zero >= 1 else full)
        out.append(mem)
    return out


def simulate(plan: Plan, cost: CostModel | None = None, post_budget: int = POST_BUDGET) -> SimResult:
    """``post_budget``: the runtime's receive-posting budget (:mod:`.posting`), for memory."""
    with gc_paused():
        return _simulate(plan, cost, post_budget)


def _simulate(plan: Plan, cost: CostModel | None, post_budget: int) -> SimResult:
    cost = cost or CostModel()
    dag, grid = plan.dag, plan.grid
    nodes = dag.nodes
    world = grid.world_size
    shards = plan.microbatches * grid.data_shards
    heap: list[tuple[float, int, int, str]] = []
    counter = itertools.count(1)
    heappush, heappop = heapq.heappush, heapq.heappop
    # Per rank: stream -> [its tasks, position of its head, when it is free]; task -> local
    # deps left (-1 once handed to the event heap), local users, finish time.
    streams = [{s: [keys, 0, 0.0] for s, keys in rp.streams.items()} for rp in plan.ranks]
    deps = [rp.deps for rp in plan.ranks]
    left = [{k: len(d) for k, d in rp.deps.items()} for rp in plan.ranks]
    users: list[dict[str, list[str]]] = [{} for _ in range(world)]
    for r in range(world):
        users_r = users[r]
        for k, ds in plan.ranks[r].deps.items():
            for d in ds:
                if d in users_r:
                    users_r[d].append(k)
                else:
                    users_r[d] = [k]
    end: list[dict[str, float]] = [{} for _ in range(world)]
    compute_free = [0.0] * world
    busy = [0.0] * world
    arrivals: dict[tuple[str, tuple[int, ...]], dict[int, float]] = {}
    timeline = []
    memory = _Memory(plan, shards, post_budget)
    on_task = memory.on_task
    placement = dag.meta.get("placement", {})
    group_of: dict[tuple[str, tuple[int, ...]], dict[int, tuple[int, ...]]] = {}
    peer_rank: list[dict[str, int]] = [{} for _ in range(world)]  # per rank: P2P node -> other side
    RECV, SEND = Kind.RECV, Kind.SEND

    def group(node, r: int) -> tuple[int, ...]:
        """The group of ``node``'s collective that holds rank ``r``."""
        by_rank = group_of.get((node.axis, node.devices))
        if by_rank is None:
            by_rank = group_of[(node.axis, node.devices)] = {}
            for g in grid.groups(node.axis, node.devices):
                for member in g:
                    by_rank.setdefault(member, g)
        return by_rank[r]

    def peer_of(r: int, key: str, node) -> int:
        """The rank on the other side of a SEND / RECV ``node`` on rank ``r``."""
        got = peer_rank[r].get(key)
        if got is None:
            got = peer_rank[r][key] = grid.peer(r, placement[nodes[node.peer].region])
        return got

    def try_head(r: int, state: list) -> None:
        keys, i, t = state
        if i >= len(keys):
            return
        key = keys[i]
        left_r = left[r]
        if left_r[key]:  # deps left, or already queued (-1)
            return
        end_r = end[r]
        for d in deps[r][key]:
            if end_r[d] > t:
                t = end_r[d]
        node = nodes[key]
        kind = node.kind
        if kind == RECV:
            sent = end[peer_of(r, key, node)].get(node.peer)
            if sent is None:
                return
            if sent > t:
                t = sent
        elif kind in COLLECTIVES:
            members = group(node, r)
            got = arrivals.setdefault((key, members), {})
            got[r] = t
            left_r[key] = -1
            if len(got) == len(members):
                start = max(got.values())
                for member in members:
                    heappush(heap, (start, next(counter), member, key))
            return
        left_r[key] = -1
        heappush(heap, (t, next(counter), r, key))

    for r in range(world):
        for state in streams[r].values():
            try_head(r, state)
    done = 0
    total = sum(len(rp.deps) for rp in plan.ranks)
    while heap:
        t, _, r, key = heappop(heap)
        node = nodes[key]
        kind = node.kind
        if node.is_compute:
            free = compute_free[r]
            if free > t:
                heappush(heap, (free, next(counter), r, key))
                continue
            start = t
            duration = cost.compute(dag, node)
            compute_free[r] = start + duration
            busy[r] += duration  # an UPDATE is compute too, as in a measured timeline
        else:
            start = t
            size = len(group(node, r)) if node.axis else 2
            duration = 0.0 if kind == RECV else cost.comm(node, size)
        finish = start + duration
        stream = node.stream
        end[r][key] = finish
        timeline.append((r, stream, key, start, finish))
        on_task(r, key, start, finish)
        streams_r = streams[r]
        state = streams_r[stream]
        state[1] += 1
        state[2] = finish
        done += 1
        waiting = users[r].get(key)
        if waiting:
            touched = {stream}
            left_r = left[r]
            for u in waiting:
                left_r[u] -= 1
                touched.add(nodes[u].stream)
            for s in touched:
                try_head(r, streams_r[s])
        else:
            try_head(r, state)
        if kind == SEND:
            dst = peer_of(r, key, node)
            try_head(dst, streams[dst][nodes[node.peer].stream])
    if done != total:
        heads = []
        for r, s in sorted((r, s) for r in range(world) for s in streams[r]):
            keys, i, _ = streams[r][s]
            if i < len(keys):
                heads.append(f"rank {r} {s}: {keys[i]}")
        raise DeadlockError("plan deadlocks; blocked stream heads: " + "; ".join(heads[:16]))
    step = max((f for end_r in end for f in end_r.values()), default=0.0)
    peaks = memory.peaks()
    static = static_memory(plan)
    return SimResult(step_time=step, busy=busy, timeline=timeline, static_bytes=static,
                     peak_transient_bytes=peaks,
                     per_rank_peak=[sum(s.values()) + p for s, p in zip(static, peaks)])


_BACKWARDS = frozenset({Kind.B, Kind.BI, Kind.BW})


class _Memory:
    """Transient memory per rank: a buffer is allocated when its producer starts (a receive on
    a posted stream: when the posting policy posts it) and freed when its last local consumer
    finishes. A sent message is held from its SEND until the sender notices it arrived: the
    runtime lets go of completed sends as a compute task starts, so at the start of the
    sender's first compute task after the matching RECV finished (or at the step's end)."""

    def __init__(self, plan: Plan, shards: int, post_budget: int):
        self.plan, self.shards, self.post_budget = plan, shards, post_budget
        world = plan.grid.world_size
        self.events: list[list[tuple[float, int]]] = [[] for _ in range(world)]
        self.waiting: list[dict[str, tuple[int, set[str]]]] = [{} for _ in range(world)]
        self.released_by: list[dict[str, list[str]]] = [{} for _ in range(world)]
        self.held: dict[str, int] = {}  # per node: the same on every rank it runs on
        # Kinds that never hold a buffer (see _held_bytes) skip the per-node computation.
        self.holding = {Kind.F, Kind.ALL_GATHER, Kind.RECV}
        if any(level >= 2 for level in plan.dag.meta.get("replicated", {}).values()):
            self.holding |= {Kind.B, Kind.BW}
        self.posted = [posted_streams(plan, r) for r in range(world)]
        self.receives: list[dict[str, list]] = [{} for _ in range(world)]  # posted RECV -> [bytes, first use]
        # ZeRO-3 gathers -> [start, end, bucket, bytes]: a rank holds one copy of a bucket while any
        # gather of it is in use (the runtime counts references; parameters do not change in a step)
        self.gathers: list[dict[str, list]] = [{} for _ in range(world)]
        self.sent: dict[tuple[str, int], int] = {}  # (SEND, its rank) in flight -> bytes
        self.arrived: list[list[tuple[float, int]]] = [[] for _ in range(world)]  # (RECV's finish, bytes)
        self.fused = [fused_backwards(plan, r) for r in range(world)]  # BIs run whole (their BW: nothing)
        self.split = [input_grads_first(plan, r) for r in range(world)]  # Bs run as BI, sends, BW
        self.for_weights: dict[tuple[int, str, int], int | None] = {}  # (rank, region, mb) -> BI's kept (None: whole)

    def on_task(self, r: int, key: str, start: float, finish: float) -> None:
        node = self.plan.dag.nodes[key]
        if node.is_compute and self.arrived[r]:
            self._let_go(r, start)
        elif node.kind == Kind.SEND and node.bytes:
            self.events[r].append((start, node.bytes))
            self.sent[(key, r)] = node.bytes
        elif node.kind == Kind.RECV and node.bytes:
            dag = self.plan.dag
            sender = self.plan.grid.peer(r, dag.meta["placement"][dag.nodes[node.peer].region])
            self.arrived[sender].append((finish, self.sent.pop((node.peer, sender))))
        if node.kind in _BACKWARDS:
            self._working(r, node, start, finish)
        if node.kind in self.holding:
            held = self.held.get(key)
            if held is None:
                held = self.held[key] = _held_bytes(self.plan, node, self.shards)
            if held:
                events = self.events[r]
                consumers = _consumers(self.plan, r, key)
                if consumers and node.kind == Kind.RECV and node.stream in self.posted[r]:
                    self.receives[r][key] = [held, float("inf")]  # allocated when posted (peaks)
                elif node.kind == Kind.ALL_GATHER:
                    self.gathers[r][key] = [start, finish, (node.region, node.bucket), held]
                    held = 0  # counted in peaks(), once per bucket while in use
                else:
                    events.append((start, held))
                if consumers:
                    self.waiting[r][key] = (held, set(consumers))
                    released_by = self.released_by[r]
                    for c in consumers:
                        if c in released_by:
                            released_by[c].append(key)
                        else:
                            released_by[c] = [key]
                else:
                    events.append((finish, -held))
        producers = self.released_by[r].pop(key, None)
        if producers:
            events = self.events[r]
            waiting = self.waiting[r]
            receives = self.receives[r]
            for producer in producers:
                if producer in receives and start < receives[producer][1]:
                    receives[producer][1] = start
                nbytes, left = waiting[producer]
                left.discard(key)
                if not left:
                    if producer in self.gathers[r]:
                        self.gathers[r][producer][1] = finish
                    else:
                        events.append((finish, -nbytes))
                    del waiting[producer]

    def _working(self, r: int, node, start: float, finish: float) -> None:
        """A backward's working memory while it runs, and what a BI keeps for its BW."""
        dag = self.plan.dag
        b = dag.regions[node.region].backward
        scale, ep = 1 / self.shards, dag.meta.get("sharded", {}).get(node.region, 1)
        slot = (r, node.region, node.microbatch)
        kept = 0
        if node.kind == Kind.B:
            rise = (max(b.inputs.at(scale), b.kept.at(scale) + b.weights.at(scale)) if node.key in self.split[r]
                    else b.full.at(scale))
        elif node.kind == Kind.BI:
            whole = node.key in self.fused[r]
            rise = b.full.at(scale) if whole else b.inputs.at(scale)
            kept = 0 if whole else b.kept.at(scale) // ep
            self.for_weights[slot] = None if whole else kept
        else:
            left = self.for_weights.pop(slot, 0)
            if left is None:  # its BI ran the whole backward
                return
            rise, kept = b.weights.at(scale), -left
        rise //= ep
        if rise or kept:
            self.events[r] += [(start, rise), (finish, kept - rise)]

    def _let_go(self, r: int, start: float) -> None:
        """Sends that arrived before a compute task starting at ``start`` on rank ``r`` free
        their buffers then."""
        waiting = []
        for arrival, nbytes in self.arrived[r]:
            if arrival < start:
                self.events[r].append((start, -nbytes))
            else:
                waiting.append((arrival, nbytes))
        self.arrived[r] = waiting

    def peaks(self) -> list[int]:
        out = []
        for r, receives in enumerate(self.receives):
            events = list(self.events[r]) + _bucket_spans(self.gathers[r].values())
            for stream in self.posted[r]:
                order = [(k, *receives[k]) for k in self.plan.ranks[r].streams[stream] if k in receives]
                events += [(posted, receives[key][0]) for key, posted in post_times(order, budget=self.post_budget).items()]
            level = peak = 0
            for _, delta in sorted(events):
                level += delta
                peak = max(peak, level)
            out.append(peak)
        return out


def _bucket_spans(gathers) -> list[tuple[float, int]]:
    """Memory events of gathered buckets: overlapping uses of one bucket share a copy."""
    events: list[tuple[float, int]] = []
    by_bucket: dict[tuple, list[list]] = {}
    for span in gathers:
        by_bucket.setdefault(span[2], []).append(span)
    for spans in by_bucket.values():
        spans.sort(key=lambda s: s[0])
        start, end, _, nbytes = spans[0]
        for s in spans[1:]:
            if s[0] < end:  # still held when this gather lands: no second copy
                end = max(end, s[1])
                continue
            events += [(start, nbytes), (end, -nbytes)]
            start, end = s[0], s[1]
        events += [(start, nbytes), (end, -nbytes)]
    return events


def _held_bytes(plan: Plan, node, shards: int) -> int:
    dag = plan.dag
    if node.kind == Kind.F:
        return dag.regions[node.region].activation_bytes // shards // plan.dag.meta.get("sharded", {}).get(node.region, 1)
    if node.kind == Kind.ALL_GATHER and node.phase in ("F", "B"):
        return node.bytes * len(next(iter(plan.grid.groups(node.axis, node.devices))))
    if node.kind == Kind.RECV:
        return node.bytes
    if node.kind in (Kind.B, Kind.BW) and dag.meta.get("replicated", {}).get(node.region, 0) >= 2:
        sizes = dag.meta["param_bytes"]
        return sum(sizes[p] for p in dag.meta["update_params"][node.region]) // dag.meta.get("sharded", {}).get(node.region, 1)
    return 0


def _consumers(plan: Plan, r: int, key: str) -> list[str]:
    """Local tasks after which a buffer made by ``key`` is released."""
    dag = plan.dag
    node = dag.nodes[key]
    if node.kind == Kind.F:  # activations live until the backward that finishes with them
        last = Kind.BW if dag.meta.get("split_backward") and dag.regions[node.region].params else (
            Kind.BI if dag.meta.get("split_backward") else Kind.B)
        return [s for s in dag.data_succ[key] if dag.nodes[s].kind == last]
    return [s for s in dag.data_succ[key] if r in dag.nodes[s].devices]
