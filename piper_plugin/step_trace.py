"""A host trainer's Piper steps written as they run, read back beside the simulator.

The host adapters write one (``--piper.trace DIR`` under TorchTitan, ``--piper-trace DIR`` under
Megatron); ``piper calibrate --host`` reads them. The folder holds:

- ``plan.pkl``: the plan, and ``program.pkl``: the single-device program it was compiled from
  (written once, by process rank 0; ``piper calibrate --host`` keeps the program for ``piper tune``);
- ``rank<process rank>.json``, rewritten after every step: ``plan_rank``, ``step`` (steps so
  far), ``timeline`` (``[stream, task, start s, end s]`` of the latest step), ``blocks`` (the
  plan rank's overlap blocks, :func:`~piper_plugin.overlap_blocks`) and ``step_seconds`` (the
  wall time of every step so far); where the writer gave its memory meter also
  ``peak_transient_bytes`` (every step's peak of what comes and goes: activations, messages,
  working memory; the meter's :attr:`peak`) and ``windows`` (``[task, count, change, rise]`` of
  the latest step's memory windows, :meth:`MemoryMeter.windows`) and ``kept_for_weights`` (per
  input-gradient task of that step, the bytes it left for its weight pass).

Invariants: a step's seconds are this process's wall time in the plan's executor (the pipeline
step: no optimizer, no data loading); every process of a step writes the same ``step``; start
and end times are ``time.perf_counter`` seconds, one clock for every process of a machine.
"""
from __future__ import annotations

import json
import pickle
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StepTrace", "TracedSteps", "read_step_traces"]


class StepTrace:
    """Writes one process's trace into ``folder`` (see the module's layout)."""

    def __init__(self, folder: str | Path, plan, plan_rank: int, process_rank: int, program=None):
        from piper_plugin.overlap_report import overlap_blocks

        self.folder, self.plan_rank, self.process_rank = Path(folder), plan_rank, process_rank
        self.folder.mkdir(parents=True, exist_ok=True)
        self.blocks = overlap_blocks(plan, plan_rank)
        self.step_seconds: list[float] = []
        self.peaks: list[int] = []
        if process_rank == 0:
            with open(self.folder / "plan.pkl", "wb") as f:
                pickle.dump(plan, f)
            if program is not None:
                with open(self.folder / "program.pkl", "wb") as f:
                    pickle.dump(program, f)

    def record(self, timeline: list, seconds: float, meter=None) -> None:
        """After a step: its measured timeline (``(stream, task, start, end)`` entries) and wall
        time; with ``meter`` (the executor's memory meter) its memory too."""
        self.step_seconds.append(float(seconds))
        entries = [[stream, key, start, end] for stream, key, start, end in timeline]
        record = {"plan_rank": self.plan_rank, "step": len(self.step_seconds), "timeline": entries,
                  "blocks": self.blocks, "step_seconds": self.step_seconds}
        if meter is not None:
            self.peaks.append(int(meter.peak))
            record["peak_transient_bytes"] = self.peaks
            record["windows"] = [[task, count, change, rise]
                                 for (task, count), (change, rise) in sorted(meter.windows().items())]
            record["kept_for_weights"] = dict(meter.kept_for_weights)
        (self.folder / f"rank{self.process_rank}.json").write_text(json.dumps(record))


@dataclass
class TracedSteps:
    """What a trace folder holds: the plan, each plan rank's latest timeline (its first process's,
    where data-parallel replicas share a plan rank), per step the slowest process's seconds, and
    the program (None where the writer gave none). Where the writer recorded memory: per plan
    rank the latest step's peak transient bytes (the highest of its processes), its first
    process's memory windows ``(task, count, change, rise)`` and what its input-gradient tasks
    kept for their weight passes, and every step's peak (the highest of its processes); empty
    otherwise. ``last_timelines``: the latest step's timeline of every process (replicas too)."""

    plan: Any
    timelines: dict[int, list[tuple[str, str, float, float]]]
    step_seconds: list[float]
    program: Any = None
    peak_transient: dict[int, int] = field(default_factory=dict)
    windows: dict[int, list[tuple[str, int, int, int]]] = field(default_factory=dict)
    kept_for_weights: dict[int, dict[str, int]] = field(default_factory=dict)
    last_timelines: list[list[tuple[str, str, float, float]]] = field(default_factory=list)  # every process's
    step_peaks: dict[int, list[int]] = field(default_factory=dict)  # plan rank -> every step's peak

    def median_peaks(self, skip: int) -> dict[int, int]:
        """Per plan rank, the median of its peak transient bytes over the steps after the first
        ``skip`` (a step whose gradient reduction ran late holds more than most)."""
        return {r: int(statistics.median(p[skip:] or p)) for r, p in self.step_peaks.items()}

    def median_step(self, skip: int) -> float:
        """The median step after the first ``skip`` (warm-up)."""
        if len(self.step_seconds) <= skip:
            raise ValueError(f"the trace has {len(self.step_seconds)} steps, not more than the {skip} left out")
        return statistics.median(self.step_seconds[skip:])


def read_step_traces(folder: str | Path) -> TracedSteps:
    """The trace in ``folder``; a ValueError names what is missing (no plan, no rank, ranks that
    stopped at different steps)."""
    folder = Path(folder)
    if not (folder / "plan.pkl").exists():
        raise ValueError(f"{folder}: no plan.pkl; is it a folder that --piper.trace / --piper-trace wrote?")
    with open(folder / "plan.pkl", "rb") as f:
        plan = pickle.load(f)
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    if not ranks:
        raise ValueError(f"{folder}: no rank<N>.json: no step finished")
    if len({r["step"] for r in ranks}) > 1:
        raise ValueError(f"{folder}: the processes stopped at steps {sorted({r['step'] for r in ranks})}")
    timelines: dict[int, list] = {}
    windows: dict[int, list] = {}
    kept: dict[int, dict[str, int]] = {}
    step_peaks: dict[int, list[int]] = {}  # per plan rank, per step: the highest of its processes
    by_process: list[list] = []  # every process's latest timeline
    for r in ranks:
        by_process.append([tuple(e) for e in r["timeline"]])
        timelines.setdefault(r["plan_rank"], by_process[-1])
        if r.get("peak_transient_bytes"):
            seen = step_peaks.get(r["plan_rank"], r["peak_transient_bytes"])
            step_peaks[r["plan_rank"]] = [max(a, b) for a, b in zip(seen, r["peak_transient_bytes"])]
            windows.setdefault(r["plan_rank"], [tuple(w) for w in r["windows"]])
            kept.setdefault(r["plan_rank"], dict(r.get("kept_for_weights", {})))
    peaks = {rank: p[-1] for rank, p in step_peaks.items()}
    steps = [max(r["step_seconds"][i] for r in ranks) for i in range(ranks[0]["step"])]
    program = None
    if (folder / "program.pkl").exists():
        with open(folder / "program.pkl", "rb") as f:
            program = pickle.load(f)
    return TracedSteps(plan, timelines, steps, program, peaks, windows, kept, by_process, step_peaks)
