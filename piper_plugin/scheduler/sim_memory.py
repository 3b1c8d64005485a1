"""Transient memory of each rank as the simulator runs its tasks (the runtime meter's counterpart).

Activations, gathered ZeRO-3 buckets, per-microbatch gradients awaiting a reduce-scatter (from
the end of the backward that hands them over) and received buffers (from their post,
:mod:`.posting`) are held until their last local consumer finishes. A bucket's collective holds
the buffers it allocates while it runs (:func:`_collective_bytes`). A bucket gathered for several
microbatches at once is one copy (as in the runtime, which counts references to it). A backward
task also holds its region's working memory while it runs (``Region.backward``, as the runtime
runs that task: whole, or split in input and weight passes), and an input-gradient pass leaves
what it recorded for the weight pass until that one finishes. What a region's forwards share
(``Region.shared_activation_bytes``) is held once per rank while any of its microbatches'
activations are. Sent messages are held as :class:`TransientMemory` says. A microbatch's gradient
of the buckets the plan reduce-scatters per microbatch (ZeRO-2/3) rises over the backward that
accumulates it and is let go as its payload is made, so for an instant both are held.

ZeRO by block (buckets reduced, and at ZeRO-3 gathered, inside a chunk,
:mod:`piper_plugin.runtime.block_gathers`): at ZeRO-3 a forward holds two blocks' parameters (the
one running and the next, prefetched), a backward four (the block, the next one's prefetch, its
gradient and the previous block's gradient being reduced), and an input-gradient pass gathers
every block of its region and keeps them until its weight pass has run (one copy however many
wait); at ZeRO-2 a backward holds two blocks' gradients. A weight pass (a BW, or a B that runs its
input gradients first) reduces its blocks only as it ends, so at either level their gradients
rise evenly over its span to every block's at its end.
"""
from __future__ import annotations

from piper_plugin.ir.graph import rows_split_evenly
from piper_plugin.ir.nodes import Kind
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.posting import post_times

__all__ = ["TransientMemory"]


_BACKWARDS = frozenset({Kind.B, Kind.BI, Kind.BW})
_BUCKET_COLLECTIVES = frozenset({Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER})


class TransientMemory:
    """Transient memory per rank: a buffer is allocated when its producer starts (a receive on
    a posted stream: when the posting policy posts it) and freed when its last local consumer
    finishes. A forward's activations are the exception: autograd saves them op by op, so they
    rise evenly over the forward's span and are all held at its end (what the runtime's meter
    sees; a collective that ends inside the forward holds its buffers beside the part saved so
    far, not beside all of it). A sent message is held from its SEND until the sender notices it arrived: the
    runtime lets go of completed sends as a compute task starts, so at the start of the
    sender's first compute task after the matching RECV finished (or at the step's end)."""

    def __init__(self, plan: Plan, shards: int, post_budget: int, representative: list[int]):
        """``representative``: per rank, the rank simulated for it (a dp replica's class)."""
        self.plan, self.shards, self.post_budget = plan, shards, post_budget
        self.representative = representative
        world = plan.grid.world_size
        self.events: list[list[tuple[float, int]]] = [[] for _ in range(world)]
        self.ramps: list[list[tuple[float, float, int]]] = [[] for _ in range(world)]  # (start, end, bytes)
        self.waiting: list[dict[str, tuple[int, set[str]]]] = [{} for _ in range(world)]
        self.released_by: list[dict[str, list[str]]] = [{} for _ in range(world)]
        self.held: dict[str, int] = {}  # per node: the same on every rank it runs on
        # Kinds that never hold a buffer (see _held_bytes) skip the per-node computation.
        self.holding = {Kind.F, Kind.ALL_GATHER, Kind.RECV}
        if any(level >= 2 for level in plan.dag.meta.replicated.values()):
            self.holding |= {Kind.B, Kind.BW}
        self.receives: list[dict[str, list]] = [{} for _ in range(world)]  # posted RECV -> [bytes, first use]
        # ZeRO-3 gathers -> [start, end, bucket, bytes]: a rank holds one copy of a bucket while any
        # gather of it is in use (the runtime counts references; parameters do not change in a step)
        self.gathers: list[dict[str, list]] = [{} for _ in range(world)]
        self.sent: dict[tuple[str, int], int] = {}  # (SEND, its rank) in flight -> bytes
        self.arrived: list[list[tuple[float, int]]] = [[] for _ in range(world)]  # (RECV's finish, bytes)
        self.for_weights: dict[tuple[int, str, int], int | None] = {}  # (rank, region, mb) -> BI's kept (None: whole)
        # ZeRO-3 by block: region -> (largest block, all blocks) in bytes; BI -> its span of held blocks
        self.blocks = {region: (max(sizes), sum(sizes)) for region, buckets in plan.dag.buckets.items()
                       if (sizes := [b.numel * 4 for b in buckets if b.block is not None])}
        self.pinned: dict[tuple[int, str, int], list] = {}
        self.weight_passes: set[tuple[int, str, int]] = set()  # (rank, region, mb): a BI whose BW has work left
        self.handed_grads = {region: _whole_bucket_bytes(plan, region) for region in plan.dag.regions}
        self.accumulated: set[tuple[int, str, int]] = set()  # (rank, region, mb): gradients a BI left for its BW
        self.instants: list[list[tuple[float, int]]] = [[] for _ in range(world)]  # zero-length holds
        self.collective: dict[str, int] = {}  # per bucket collective: what it allocates while it runs
        # per rank, region -> forward -> [its start, when its activations are let go]
        self.shared: list[dict[str, dict[str, list[float]]]] = [{} for _ in range(world)]

    def on_task(self, r: int, key: str, start: float, finish: float) -> None:
        node = self.plan.dag.nodes[key]
        if node.is_compute and self.arrived[r]:
            self._let_go(r, start)
        elif node.kind == Kind.SEND and node.bytes:
            self.events[r].append((start, node.bytes))
            self.sent[(key, r)] = node.bytes
        elif node.kind == Kind.RECV and node.bytes:
            dag = self.plan.dag
            sender = self.representative[self.plan.grid.peer(r, dag.meta.placement[dag.nodes[node.peer].region])]
            self.arrived[sender].append((finish, self.sent.pop((node.peer, sender))))
        if node.bucket is not None and node.kind in _BUCKET_COLLECTIVES:
            self._collective(r, node, start, finish)
        if node.kind in _BACKWARDS:
            self._working(r, node, start, finish)
        if node.is_compute and node.region in self.blocks:
            self._block_memory(r, node, start, finish)
        if node.kind in _BACKWARDS and self.handed_grads.get(node.region):
            self._handed_gradients(r, node, start, finish)
        if node.kind == Kind.F and self.plan.dag.regions[node.region].shared_activation_bytes:
            self.shared[r].setdefault(node.region, {})[key] = [start, finish]
        if node.kind in self.holding:
            held = self.held.get(key)
            if held is None:
                held = self.held[key] = _held_bytes(self.plan, node, self.shards)
            if held:
                events = self.events[r]
                consumers = _consumers(self.plan, r, key)
                if consumers and node.kind == Kind.RECV and node.stream in self.plan.ranks[r].posted:
                    self.receives[r][key] = [held, float("inf")]  # allocated when posted (peaks)
                elif node.kind == Kind.ALL_GATHER:
                    self.gathers[r][key] = [start, finish, (node.region, node.bucket), held]
                    held = 0  # counted in peaks(), once per bucket while in use
                elif node.kind == Kind.F and finish > start:  # saved op by op while it runs
                    self.ramps[r].append((start, finish, held))
                else:  # a backward hands over its gradient payload as it ends
                    events.append((finish if node.kind in _BACKWARDS else start, held))
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
                        made = self.plan.dag.nodes[producer]
                        if made.kind == Kind.F and made.region in self.shared[r]:
                            self.shared[r][made.region][producer][1] = finish
                    del waiting[producer]

    def _collective(self, r: int, node, start: float, finish: float) -> None:
        """The buffers a bucket's collective allocates while it runs (:func:`_collective_bytes`);
        one that takes no time still holds them for an instant (see :meth:`peaks`)."""
        rise = self.collective.get(node.key)
        if rise is None:
            rise = self.collective[node.key] = _collective_bytes(self.plan, node)
        if not rise:
            return
        if finish > start:
            self.events[r] += [(start, rise), (finish, -rise)]
        else:
            self.instants[r].append((start, rise))

    def _working(self, r: int, node, start: float, finish: float) -> None:
        """A backward's working memory while it runs, and what a BI keeps for its BW."""
        dag = self.plan.dag
        b = dag.regions[node.region].backward
        scale, ep = 1 / self.shards, dag.meta.sharded.get(node.region, 1)
        slot = (r, node.region, node.microbatch)
        kept = 0
        if node.kind == Kind.B:  # a B split by the plan runs BI, its sends, then BW
            split = node.key in self.plan.ranks[r].split_first
            rise = max(b.inputs.at(scale), b.kept.at(scale) + b.weights.at(scale)) if split else b.full.at(scale)
        elif node.kind == Kind.BI:
            whole = node.key in self.plan.ranks[r].fused  # a BI run whole (its BW: nothing)
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

    def _block_memory(self, r: int, node, start: float, finish: float) -> None:
        largest, whole = self.blocks[node.region]
        slot = (r, node.region, node.microbatch)
        ranks = self.plan.ranks[r]
        zero2 = self.plan.dag.meta.replicated.get(node.region) == 2  # parameters whole: gradients only
        rise = 0
        if node.kind == Kind.BW:
            if slot not in self.weight_passes:  # its BI ran the whole backward
                return
            self.weight_passes.discard(slot)
            span = self.pinned.pop(slot, None)
            if span is not None:
                span[1] = finish
            self._gradients(r, whole, start, finish)
            return
        if node.kind == Kind.B and node.key in ranks.split_first:  # BI, its sends, then BW in one task
            self._gradients(r, whole, start, finish)
            rise = 0 if zero2 else whole  # BI's gathers stay for its BW
        elif node.kind == Kind.B or (node.kind == Kind.BI and node.key in ranks.fused):  # run whole
            rise = 2 * largest if zero2 else 4 * largest
        elif node.kind == Kind.BI:
            self.weight_passes.add(slot)
            if not zero2:
                span = self.pinned[slot] = [start, finish, (node.region, "blocks"), whole]
                self.gathers[r][f"{node.key}:blocks"] = span
        elif not zero2:  # a forward
            rise = 2 * largest
        if rise:
            self.events[r] += [(start, rise), (finish, -rise)]

    def _handed_gradients(self, r: int, node, start: float, finish: float) -> None:
        """Whole buckets reduce-scattered per microbatch (ZeRO-2/3): the gradient rises over the
        backward that accumulates it (a B, a BI run whole or a BW with work left) and is let go
        once its payload is made (:func:`_held_bytes`) as the B or BW ends: both for an instant,
        before the reduce-scatter allocates its buffers."""
        grads = self.handed_grads[node.region]
        slot = (r, node.region, node.microbatch)
        whole_bi = node.kind == Kind.BI and node.key in self.plan.ranks[r].fused
        if node.kind == Kind.BW and slot in self.accumulated:  # its BI ran the whole backward
            self.accumulated.discard(slot)
        elif node.kind != Kind.BI or whole_bi:
            if finish > start:
                self.ramps[r].append((start, finish, grads))
            else:
                self.events[r].append((start, grads))
        if whole_bi:
            self.accumulated.add(slot)
        elif node.kind != Kind.BI:
            self.events[r].append((finish, -grads))
            self.instants[r].append((finish, 2 * grads))

    def _gradients(self, r: int, nbytes: int, start: float, finish: float) -> None:
        """A weight pass's gradients of every block: they rise over its span and are reduced as it ends."""
        if finish > start:
            self.ramps[r].append((start, finish, nbytes))
            self.events[r].append((finish, -nbytes))
        else:
            self.instants[r].append((start, nbytes))

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
        """Per rank; a dp replica the simulator did not run has its class's peak."""
        out = []
        rep = self.representative
        for r, receives in enumerate(self.receives):
            if rep[r] != r:
                out.append(out[rep[r]])
                continue
            events = list(self.events[r]) + _bucket_spans(self.gathers[r].values())
            for region, spans in self.shared[r].items():
                events += _while_any(sorted(spans.values()), self.plan.dag.regions[region].shared_activation_bytes)
            for stream in self.plan.ranks[r].posted:
                order = [(k, *receives[k]) for k in self.plan.ranks[r].streams[stream] if k in receives]
                events += [(posted, receives[key][0]) for key, posted in post_times(order, budget=self.post_budget).items()]
            out.append(_peak(events, self.instants[r], self.ramps[r]))
        return out


def _peak(events: list[tuple[float, int]], instants: list[tuple[float, int]],
          ramps: list[tuple[float, float, int]]) -> int:
    """The highest level of ``events`` (time, change), ``instants`` (time, bytes held for no
    time) and ``ramps`` (start, end, bytes rising evenly between them, held from the end on).
    At one time, releases come first, then instants (a collective that takes no time runs
    between the tasks that end at its time and those that start then), then allocations; a
    ramp's level just before a time counts what that time releases as still held."""
    marks = [(t, 0 if delta < 0 else 2, delta) for t, delta in events]
    marks += [(t, 1, rise) for t, rise in instants]
    marks += [(end, 2, nbytes) for _, end, nbytes in ramps]
    rising = sorted(ramps)
    level = peak = 0
    active: list[tuple[float, float, int]] = []
    head = 0
    last = None
    for t, order, delta in sorted(marks):
        if t != last:  # ramps under way: the part saved by t, beside what is held until t
            while head < len(rising) and rising[head][0] < t:
                active.append(rising[head])
                head += 1
            active = [a for a in active if a[1] >= t]
            partial = sum(n * (t - s) / (e - s) for s, e, n in active)
            peak = max(peak, level + int(partial))
            last = t
        if order == 1:
            peak = max(peak, level + delta)
        else:
            level += delta
            peak = max(peak, level)
    return peak


def _while_any(spans: list[list[float]], nbytes: int) -> list[tuple[float, int]]:
    """``nbytes`` held while any of the (sorted) ``spans`` is: once per stretch they cover."""
    events: list[tuple[float, int]] = []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            events += [(start, nbytes), (end, -nbytes)]
            start, end = s, e
        else:
            end = max(end, e)
    return events + [(start, nbytes), (end, -nbytes)]


def _collective_bytes(plan: Plan, node) -> int:
    """What a bucket's collective allocates while it runs, as the pairwise exchanges run them
    (:mod:`piper_plugin.runtime.group_collectives`), with ``n`` members and a shard of ``w``
    bytes: an all-reduce copies the gradients; a reduce-scatter receives ``n - 1`` shards and
    sums into one (``n w``), plus the rank-major payload (``n w``) at the step's end where
    some parameter's rows do not split evenly over the members (else it reads the gradients
    where they lie; a per-microbatch one's payload is its backward's); a step's all-gather
    copies our shard (``w``), and ``n w`` more for a rank-major result where rows do not
    split evenly; a ZeRO-3 gather receives into a rank-major result (``n w``) it then lays out
    into the bucket (counted as the gathered bucket)."""
    dag = plan.dag
    bucket = dag.buckets[node.region][node.bucket]
    n = plan.grid.group_size(node.axis, node.devices)
    full = bucket.numel * 4
    w = -(-full // n)
    even = rows_split_evenly([dag.meta.param_shapes.get(p, ()) for p in bucket.params], n)
    if node.kind == Kind.ALL_REDUCE:
        return full
    if node.kind == Kind.REDUCE_SCATTER:
        return n * w if even or node.phase == "B" else 2 * n * w
    if node.phase == "step":
        return w if even else (n + 1) * w
    return n * w


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


def _whole_bucket_bytes(plan: Plan, region: str) -> int:
    """A microbatch's gradient of ``region``'s buckets the plan reduce-scatters per microbatch
    (ZeRO-2/3 not by block; blocks reduce inside the chunk)."""
    if plan.dag.meta.replicated.get(region, 0) < 2:
        return 0
    return sum(b.numel * 4 for b in plan.dag.buckets.get(region, ()) if b.block is None)


def _held_bytes(plan: Plan, node, shards: int) -> int:
    dag = plan.dag
    if node.kind == Kind.F:
        return dag.regions[node.region].activation_bytes // shards // plan.dag.meta.sharded.get(node.region, 1)
    if node.kind == Kind.ALL_GATHER and node.phase in ("F", "B"):
        return node.bytes * plan.grid.group_size(node.axis, node.devices)
    if node.kind == Kind.RECV:
        return node.bytes
    if node.kind in (Kind.B, Kind.BW) and dag.meta.replicated.get(node.region, 0) >= 2:
        return _whole_bucket_bytes(plan, node.region)  # the payload handed to the reduce-scatters
    return 0


def _consumers(plan: Plan, r: int, key: str) -> list[str]:
    """Local tasks after which a buffer made by ``key`` is released."""
    dag = plan.dag
    node = dag.nodes[key]
    if node.kind == Kind.F:  # activations live until the backward that finishes with them
        if not dag.meta.split_backward:
            return [s for s in dag.data_succ[key] if dag.nodes[s].kind == Kind.B]
        fused = plan.ranks[r].fused  # a BI run as one whole backward lets them go itself
        inputs = [s for s in dag.data_succ[key] if dag.nodes[s].kind == Kind.BI]
        if not dag.regions[node.region].params or (inputs and all(s in fused for s in inputs)):
            return inputs
        return [s for s in dag.data_succ[key] if dag.nodes[s].kind == Kind.BW]
    if node.kind in (Kind.B, Kind.BW):  # its gradient payloads: until their reduce-scatters ran
        return [s for s in dag.data_succ[key] if dag.nodes[s].kind == Kind.REDUCE_SCATTER]
    return [s for s in dag.data_succ[key] if r in dag.nodes[s].devices]
