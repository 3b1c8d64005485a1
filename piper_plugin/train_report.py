"""What ``piper train`` reports: per-step progress lines, a metrics file, the measured trace.

Readers only; nothing here runs a rank. Workers report one metrics dict per step and rank
(``step``, ``rank``, ``step_time_s``, ``tokens_per_s``, ``peak_memory_bytes`` and ``loss`` on
the ranks holding the loss); :class:`Progress` writes each to a JSON-lines file as it arrives
and prints one line per step once every rank reported it. :func:`measured_result` turns the
per-rank timelines of the last step into a :class:`SimResult`, so the simulator's exporters
(Chrome trace, timeline picture) draw measured time as they draw predicted time.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.simulate import SimResult

__all__ = ["StepStats", "Progress", "measured_result", "measured_costs", "write_trace", "human_bytes",
           "covered_seconds"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class StepStats:
    """One training step over all ranks."""

    step: int  # as the workers count it, from 0
    loss: float | None  # the global loss (every loss-holding rank reports the same value)
    step_time_s: float  # slowest rank
    tokens_per_s: float  # global tokens of the step / slowest rank's step time
    peak_memory_bytes: int  # largest rank

    @classmethod
    def of(cls, reports: list[Mapping[str, Any]]) -> "StepStats":
        losses = [m["loss"] for m in reports if m.get("loss") is not None]
        slowest = max(reports, key=lambda m: m["step_time_s"])
        return cls(step=slowest["step"], loss=sum(losses) / len(losses) if losses else None,
                   step_time_s=slowest["step_time_s"],
                   tokens_per_s=slowest["tokens_per_s"],  # each rank divides the global batch's tokens
                   peak_memory_bytes=max(m["peak_memory_bytes"] for m in reports))


class Progress:
    """Callback for :func:`piper_plugin.training.run`: ``progress(metrics)`` per rank and step."""

    def __init__(self, world: int, steps: int, *, metrics_file: IO[str] | None = None,
                 echo: Callable[[str], None] | None = None, first_step: int = 0):
        self.world, self.steps, self.metrics_file, self.first_step = world, steps, metrics_file, first_step
        self.echo = echo if echo is not None else (lambda line: print(line, flush=True))
        self.done: list[StepStats] = []
        self.pending: dict[int, dict[int, Mapping[str, Any]]] = {}
        self.started = time.monotonic()
        self.first_step_at: float | None = None

    def __call__(self, metrics: Mapping[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(dict(metrics)) + "\n")
            self.metrics_file.flush()
        self.pending.setdefault(metrics["step"], {})[metrics["rank"]] = metrics
        while len(self.pending.get(self._next, {})) == self.world:  # steps finish in order
            ranks = list(self.pending.pop(self._next).values())
            stats = StepStats.of(ranks)
            if self.first_step_at is None:
                self.first_step_at = time.monotonic()
            self.done.append(stats)
            self.echo(self.line(stats))
            if any(m.get("skipped") for m in ranks):
                self.echo(f"skipped  step {stats.step + 1}: a loss was not finite, no rank applied its update")
            for saved in sorted({m["checkpoint"] for m in ranks if "checkpoint" in m}):
                self.echo(f"saved    {saved}")

    @property
    def _next(self) -> int:
        return self.done[-1].step + 1 if self.done else self.first_step

    def line(self, s: StepStats) -> str:
        width = len(str(self.steps))
        loss = f"{s.loss:7.4f}" if s.loss is not None else "      -"
        return (f"step {s.step + 1:>{width}}/{self.steps}  loss {loss}  step {s.step_time_s * 1e3:7.1f} ms  "
                f"{s.tokens_per_s:9,.0f} tokens/s  peak mem {human_bytes(s.peak_memory_bytes)}")

    def summary(self) -> list[str]:
        if not self.done:
            return ["summary  no step finished"]
        losses = [(s.step + 1, s.loss) for s in self.done if s.loss is not None]
        times = [s.step_time_s for s in self.done]
        lines = []
        if losses:
            (a, first), (b, last) = losses[0], losses[-1]
            lines.append(f"loss     {first:.4f} (step {a}) -> {last:.4f} (step {b})")
        lines.append(f"step     median {statistics.median(times) * 1e3:.1f} ms, "
                     f"median {statistics.median(s.tokens_per_s for s in self.done):,.0f} tokens/s, "
                     f"peak memory {human_bytes(max(s.peak_memory_bytes for s in self.done))} (largest rank)")
        total = time.monotonic() - self.started
        startup = (self.first_step_at - self.started - self.done[0].step_time_s) if self.first_step_at else 0.0
        lines.append(f"time     {total:.1f} s, of which {max(startup, 0.0):.1f} s starting ranks")
        return lines


def covered_seconds(start: float, end: float, spans: Sequence[tuple[float, float]]) -> float:
    """Seconds of [start, end] inside the union of ``spans`` (sorted by start); with an unbounded
    window, the length of the union (overlapping spans counted once)."""
    total, cursor = 0.0, start
    for s, e in spans:
        s, e = max(s, cursor), min(e, end)
        if e > s:
            total += e - s
            cursor = e
    return total


def measured_result(plan, timelines: Mapping[int, list[tuple[str, str, float, float]]]) -> SimResult:
    """The measured last step as a :class:`SimResult` (times in seconds from the earliest start).

    ``timelines[r]`` is rank r's ``(stream, node_key, start, end)`` list (``time.perf_counter``;
    one clock for all processes of a machine; ranks on other machines are not aligned).
    ``busy`` is the union of each rank's compute intervals (F, B, BI, BW, UPDATE; concurrent
    compute streams count once) and ``step_time`` the span from the earliest start to the
    latest end over all ranks, so ``bubble_fraction`` is 1 - busy / span, averaged over ranks.
    """
    world = plan.grid.world_size
    events = [(r, *e) for r in range(world) for e in timelines.get(r, [])]
    if not events:
        raise ValueError("no measured timeline came back from the ranks")
    t0 = min(e[3] for e in events)
    span = max(e[4] for e in events) - t0
    busy = []
    for r in range(world):
        spans = sorted((s - t0, e - t0) for rr, _, key, s, e in events if rr == r and plan.node(key).is_compute)
        busy.append(covered_seconds(float("-inf"), float("inf"), spans))
    timeline = [(r, stream, key, s - t0, e - t0) for r, stream, key, s, e in events]
    return SimResult(step_time=span, busy=busy, timeline=timeline, static_bytes=[{} for _ in range(world)],
                     peak_transient_bytes=[0] * world)


def measured_costs(plan, measured: SimResult):
    """A cost model with each compute task's measured time: per (kind, region), the mean over
    ranks and microbatches of ``measured``'s timeline (so a rank's compute adds up to what it
    measured), communication free. Simulating the plan with it gives the schedule's own bubble
    at these task times; what the measured step has beyond that is messages, waits, runtime."""
    durations: dict[tuple[str, str], list[float]] = {}
    for _, _, key, start, end in measured.timeline:
        node = plan.node(key)
        if node.is_compute:
            durations.setdefault((node.kind.value, node.region), []).append(end - start)
    return CostModel(per_task={task: statistics.fmean(times) for task, times in durations.items()})


def write_trace(directory: Path, plan, measured: SimResult, simulated: SimResult, name: str,
                simulated_in_seconds: bool = False) -> list[Path]:
    """``trace.json`` (measured Chrome/Perfetto trace), ``timeline.png`` (measured), ``simulated.png``
    (in units of a forward, or in seconds when ``simulated_in_seconds``: a measured cost model)."""
    from piper_plugin.scheduler import export

    directory.mkdir(parents=True, exist_ok=True)
    g = plan.grid
    trace = export.chrome_trace(plan, measured, us_per_unit=1e6)
    trace["otherData"].update(source="measured: last training step", step_time_s=measured.step_time,
                              simulated_bubble_fraction=simulated.bubble_fraction)
    paths = [directory / "trace.json", directory / "timeline.png", directory / "simulated.png"]
    paths[0].write_text(json.dumps(trace))
    head = f"{name}: pp={g.pp} dp={g.dp} ep={g.ep}, m={plan.microbatches}"
    export.timeline_png(plan, _split_p2p_rows(plan, measured), paths[1], time_label="time (ms)", time_scale=1e3,
                        title=f"measured last step, {head}: {measured.step_time * 1e3:.1f} ms, "
                              f"bubble {measured.bubble_fraction:.1%}")
    step = f"{simulated.step_time * 1e3:.1f} ms" if simulated_in_seconds else f"{simulated.step_time:.4g} units"
    export.timeline_png(plan, simulated, paths[2], time_label="time (ms)" if simulated_in_seconds else "time (F = 1)",
                        time_scale=1e3 if simulated_in_seconds else 1.0,
                        title=f"simulated, {head}: step {step}, bubble {simulated.bubble_fraction:.1%}")
    return paths


def _split_p2p_rows(plan, result: SimResult) -> SimResult:
    """For the picture only: a measured receive is a long wait that would hide the sends drawn
    on the same row, so each P2P direction gets its own row ("send>pp1", "recv<pp0")."""
    def row(r: int, stream: str) -> str:
        match = re.fullmatch(r"p2p:(\d+)>(\d+)", stream)  # pipeline ranks, not global ranks
        if not match:
            return stream
        src, dst = map(int, match.groups())
        return f"send>pp{dst}" if plan.grid.coords(r)[0] == src else f"recv<pp{src}"

    timeline = [(r, row(r, stream), *rest) for r, stream, *rest in result.timeline]
    return SimResult(step_time=result.step_time, busy=result.busy, timeline=timeline,
                     static_bytes=result.static_bytes, peak_transient_bytes=result.peak_transient_bytes,
                     step_overhead=result.step_overhead)
