"""What a measured step's timelines give the calibration's fit (:mod:`piper_plugin.calibrate`).

Timelines are per process (or plan rank) lists of ``(stream, task, start s, end s)`` of one step,
all on one clock (``time.perf_counter`` on one machine). Invariants: a compute task's sample is
its span (or, with shared cores, the core time it had); a collective's is from its last member's
start to its first member's end; a step's overhead is never negative.
"""
from __future__ import annotations

__all__ = ["task_samples", "collective_samples", "step_outside_tasks"]


def task_samples(plan, timelines: dict[int, list],
                 cores: int | None = None) -> list[tuple[str, tuple[float, ...], float]]:
    """``(kind, features, seconds)`` of the measured compute tasks in ``timelines`` (rank ->
    its timeline). A BI the plan runs as the whole backward (fused with its BW) is a sample of
    B; its BW, which does nothing, none. With ``cores``, a task's span counts only the share of
    a core it had: where more ranks computed at once than there are cores, they took turns (the
    simulator gives such ranks ``cores`` shared units, so it charges the work, not the span)."""
    from piper_plugin.ir.nodes import weight_pass_key
    from piper_plugin.scheduler.cost import task_features

    computing = [(s, e) for tl in timelines.values() for _, k, s, e in tl if plan.node(k).is_compute]
    out = []
    for rank, timeline in timelines.items():
        fused = plan.ranks[rank].fused
        emptied = {weight_pass_key(plan.node(k)) for k in fused}
        for _, key, start, end in timeline:
            node = plan.node(key)
            if not node.is_compute or key in emptied:
                continue
            kind = "B" if key in fused else node.kind.value
            seconds = end - start if cores is None else _core_seconds(start, end, computing, cores)
            out.append((kind, task_features(plan.dag, node), seconds))
    return out


def _core_seconds(start: float, end: float, computing: list[tuple[float, float]], cores: int) -> float:
    """Of the span ``[start, end]``, the core time it had: each stretch counts min(1, cores /
    ranks computing then) (``computing``: every rank's compute spans, this one's included)."""
    near = [(max(s, start), min(e, end)) for s, e in computing if s < end and e > start]
    cuts = sorted({start, end, *(t for span in near for t in span)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        busy = sum(s <= mid < e for s, e in near)
        total += (b - a) * min(1.0, cores / max(busy, 1))
    return total


def collective_samples(plan, timelines) -> list[tuple[float, float]]:
    """``(bytes it moves per member, seconds)`` of every collective in a step's ``timelines``
    (per process, of one clock): from when its last member started it to when the first one
    it was seen done by (its end stamps are upper bounds: when the runtime noticed); the bytes
    as the simulator's ring formulas count them (:meth:`CostModel.comm`)."""
    from piper_plugin.ir.nodes import COLLECTIVES
    from piper_plugin.scheduler.cost import CostModel

    spans: dict[str, list[tuple[float, float]]] = {}
    for timeline in timelines:
        for _, key, start, end in timeline:
            spans.setdefault(key, []).append((start, end))
    per_byte = CostModel(seconds_per_byte=1.0)
    out = []
    for key, seen in spans.items():
        node = plan.node(key)
        if node.kind not in COLLECTIVES or not node.bytes or len(seen) < 2:
            continue
        size = plan.grid.group_size(node.axis, node.devices)
        out.append((per_byte.comm(node, size), max(0.0, min(e for _, e in seen) - max(s for s, _ in seen))))
    return out


def step_outside_tasks(seconds: float, timelines) -> float:
    """Of a step's measured ``seconds`` (its slowest process's), what lies outside its tasks: the
    seconds less the span from the first task's start to the last one's end over every rank's
    ``timelines`` of that step (one clock on one machine); never below 0."""
    spans = [(start, end) for timeline in timelines for _, _, start, end in timeline]
    if not spans:
        return 0.0
    return max(0.0, seconds - (max(e for _, e in spans) - min(s for s, _ in spans)))
