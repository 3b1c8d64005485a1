"""Simulator: runs every rank's plan against a cost model, before any process exists.

Semantics (the runtime's): each (rank, logical stream) runs its tasks strictly in plan order;
a task starts once its local dependencies finished; compute tasks of one rank share one
compute unit; SEND is buffered (never blocks) and its RECV completes once the data arrived;
a collective starts when every member of its group reached it (a cost model's ``comm_cpu_share``
of a communication task's time holds the rank's compute unit too); compute tasks ready at one time
start in the plan's global order (never by rank, so dp replicas with one plan keep one timeline,
and one replica per class is simulated: :mod:`.symmetry`). With a cost model's ``cores`` below
the rank count, a compute task also waits for one of that many shared cores (first come, first
served: the machine's throughput, not its time slicing). If tasks remain when nothing can
start, the plan would deadlock and :class:`DeadlockError` names the blocked stream heads.

Memory per rank: parameters, gradients and AdamW state (sized by ZeRO level and EP sharding)
plus the peak of what comes and goes (:mod:`.sim_memory`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from piper_plugin.ir.graph import gc_paused
from piper_plugin.ir.nodes import COLLECTIVES, Kind, weight_pass_key
from piper_plugin.scheduler.backward_passes import backward_splits
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.posting import POST_BUDGET
from piper_plugin.scheduler.sim_memory import TransientMemory

__all__ = ["simulate", "SimResult", "DeadlockError", "static_memory"]

_BYTES_PER_OPT_STATE = 2  # AdamW keeps exp_avg and exp_avg_sq, each the size of the params


class DeadlockError(RuntimeError):
    pass


@dataclass
class SimResult:
    step_time: float  # the tasks' makespan plus the cost model's step_overhead
    busy: list[float]  # per rank: compute time (chunks and optimizer updates)
    timeline: list[tuple[int, str, str, float, float]]  # rank, stream, key, start, end
    static_bytes: list[dict[str, int]]
    peak_transient_bytes: list[int]
    per_rank_peak: list[int] = field(default_factory=list)
    step_overhead: float = 0.0

    @property
    def makespan(self) -> float:
        """From the first task's start to the last one's end."""
        return self.step_time - self.step_overhead

    @property
    def idle(self) -> list[float]:
        """Per rank: the makespan's time without compute."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of idle compute time / the makespan."""
        return sum(self.idle) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    @property
    def peak_memory(self) -> list[int]:
        return [sum(s.values()) + t for s, t in zip(self.static_bytes, self.peak_transient_bytes)]


def static_memory(plan: Plan) -> list[dict[str, int]]:
    """Per rank: bytes of params, grads and optimizer state kept across the step."""
    dag, grid = plan.dag, plan.grid
    sizes = dag.meta.param_bytes
    sharded = dag.meta.sharded
    out = []
    for r in range(grid.world_size):
        mem = {"params": 0, "grads": 0, "optimizer": 0}
        for region, params in dag.meta.update_params.items():
            node = dag.nodes.get(f"{region}F0")
            if node is None or r not in node.devices:
                continue
            full = sum(sizes[p] for p in params) // sharded.get(region, 1)
            zero = dag.meta.replicated.get(region, 0)
            buckets = dag.buckets.get(region) or []
            axis = "dp" if region in sharded else "data"
            n = grid.group_size(axis, node.devices) if buckets else 1
            shard = -(-full // n)
            mem["params"] += shard if zero == 3 else full
            mem["grads"] += shard if zero >= 2 else full
            mem["optimizer"] += _BYTES_PER_OPT_STATE * (shard if zero >= 1 else full)
        out.append(mem)
    return out


def _simulated(plan: Plan) -> list[int]:
    """Per rank, the rank simulated for it: ``plan.representative`` while every replica's plan
    still equals its class's (a plan edited after :func:`build_plan` may differ), else itself."""
    rep = plan.representative
    for r, rank_plan in enumerate(plan.ranks):
        if rep[r] != r:
            other = plan.ranks[rep[r]]
            if (rank_plan.streams, rank_plan.deps, rank_plan.fused, rank_plan.split_first, rank_plan.posted) != \
                    (other.streams, other.deps, other.fused, other.split_first, other.posted):
                return list(range(len(plan.ranks)))
    return rep


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
    # dp replicas with one plan (plan.representative) have identical timelines: only one per
    # class runs; ties at one time go by the global order, never by rank (so they stay so).
    # Ranks that share fewer cores than there are ranks each run (their timelines differ)
    cores = cost.cores if cost.cores is not None and cost.cores < world else None
    rep = _simulated(plan) if cores is None else list(range(world))
    runs = [r for r in range(world) if rep[r] == r]
    position = {key: i for i, key in enumerate(plan.order)}
    heap: list[tuple[float, int, int, str]] = []
    heappush, heappop = heapq.heappush, heapq.heappop
    # Per rank: stream -> [its tasks, position of its head, when it is free]; task -> local
    # deps left (-1 once handed to the event heap), local users, finish time.
    streams = [{s: [keys, 0, 0.0] for s, keys in rp.streams.items()} if rep[rp.rank] == rp.rank else {}
               for rp in plan.ranks]
    deps = [rp.deps for rp in plan.ranks]
    left = [{k: len(d) for k, d in plan.ranks[r].deps.items()} if rep[r] == r else {} for r in range(world)]
    users: list[dict[str, list[str]]] = [{} for _ in range(world)]
    for r in runs:
        users_r = users[r]
        for k, ds in plan.ranks[r].deps.items():
            for d in ds:
                if d in users_r:
                    users_r[d].append(k)
                else:
                    users_r[d] = [k]
    end: list[dict[str, float]] = [{} for _ in range(world)]
    compute_free = [0.0] * world
    core_free = [0.0] * (cores or 0)  # a heap: when each shared core is next free
    busy = [0.0] * world
    arrivals: dict[tuple[str, tuple[int, ...]], dict[int, float]] = {}
    timeline = []
    memory = TransientMemory(plan, shards, post_budget, rep)
    on_task = memory.on_task
    placement = dag.meta.placement
    # (axis, devices) -> rank -> (its group, the group's simulated members)
    group_of: dict[tuple[str, tuple[int, ...]], dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    peer_rank: list[dict[str, int]] = [{} for _ in range(world)]  # per rank: P2P node -> other side
    RECV, SEND = Kind.RECV, Kind.SEND
    cpu_share = cost.comm_cpu_share
    # a BI of a region whose backward does not split runs the whole backward: it costs its BW
    # too, and that BW nothing (a BI fused with the BW right after it keeps the two costs, or,
    # under a cost model that measured whole backwards, costs one: its BW nothing)
    as_b = cost.measures_whole_backward
    whole = [{key: weight_pass_key(nodes[key]) for key in rp.fused
              if as_b or not backward_splits(dag, nodes[key].region)} if rep[rp.rank] == rp.rank else {}
             for rp in plan.ranks]
    emptied = [set(w.values()) for w in whole]

    def group(node, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The group of ``node``'s collective that holds rank ``r``, and its simulated members."""
        by_rank = group_of.get((node.axis, node.devices))
        if by_rank is None:
            by_rank = group_of[(node.axis, node.devices)] = {}
            for g in grid.groups(node.axis, node.devices):
                simulated = tuple(sorted({rep[member] for member in g}))
                for member in g:
                    by_rank.setdefault(member, (g, simulated))
        return by_rank[r]

    def peer_of(r: int, key: str, node) -> int:
        """The simulated rank on the other side of a SEND / RECV ``node`` on rank ``r``."""
        got = peer_rank[r].get(key)
        if got is None:
            got = peer_rank[r][key] = rep[grid.peer(r, placement[nodes[node.peer].region])]
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
            members = group(node, r)[1]
            got = arrivals.setdefault((key, members), {})
            got[r] = t
            left_r[key] = -1
            if len(got) == len(members):
                start = max(got.values())
                for member in members:
                    heappush(heap, (start, position[key], member, key))
            return
        left_r[key] = -1
        heappush(heap, (t, position[key], r, key))

    for r in runs:
        for state in streams[r].values():
            try_head(r, state)
    done = 0
    total = sum(len(plan.ranks[r].deps) for r in runs)
    while heap:
        t, _, r, key = heappop(heap)
        node = nodes[key]
        kind = node.kind
        if node.is_compute:
            free = compute_free[r]
            if cores is not None and core_free[0] > free:
                free = core_free[0]
            if free > t:
                heappush(heap, (free, position[key], r, key))
                continue
            start = t
            if key in emptied[r]:
                duration = 0.0
            elif as_b and key in whole[r]:
                duration = cost.compute(dag, node, "B")
            else:
                duration = cost.compute(dag, node)
                if key in whole[r] and whole[r][key] in nodes:
                    duration += cost.compute(dag, nodes[whole[r][key]])
            compute_free[r] = start + duration
            if cores is not None:
                heapq.heapreplace(core_free, start + duration)
            busy[r] += duration  # an UPDATE is compute too, as in a measured timeline
        else:
            start = t
            size = len(group(node, r)[0]) if node.axis else 2
            duration = 0.0 if kind == RECV else cost.comm(node, size)
            if cpu_share and duration:  # the CPU that moves it is the one that computes
                compute_free[r] = max(compute_free[r], start) + cpu_share * duration
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
        for r, s in sorted((r, s) for r in runs for s in streams[r]):
            keys, i, _ = streams[r][s]
            if i < len(keys):
                heads.append(f"rank {r} {s}: {keys[i]}")
        raise DeadlockError("plan deadlocks; blocked stream heads: " + "; ".join(heads[:16]))
    step = max((f for end_r in end for f in end_r.values()), default=0.0)
    peaks = memory.peaks()
    if len(runs) < world:  # each replica's timeline is its class's
        members: dict[int, list[int]] = {}
        for r in range(world):
            members.setdefault(rep[r], []).append(r)
        timeline = [(m, *entry[1:]) for entry in timeline for m in members[entry[0]]]
        busy = [busy[rep[r]] for r in range(world)]
    static = static_memory(plan)
    return SimResult(step_time=step + cost.step_overhead, busy=busy, timeline=timeline, static_bytes=static,
                     peak_transient_bytes=peaks,
                     per_rank_peak=[sum(s.values()) + p for s, p in zip(static, peaks)],
                     step_overhead=cost.step_overhead)
