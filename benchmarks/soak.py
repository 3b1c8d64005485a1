"""Soak: train for a long stretch and watch every rank's memory and the step time, minute by minute.

4 ranks (pp=2 x dp=2, ZeRO-3, 1F1B) on the default Ray launcher train the toy LM on seeded
random tokens for ``--minutes``; every minute one line: steps so far, the median step time of
the minute's steps (slowest rank), each rank's resident memory (RSS of its actor process: what
a leak in activations, message buffers, traces or Ray objects would grow) and the meter's peak.
The job is stopped once the time is up (every actor killed, Ray shut down). Not in CI.

    python -m benchmarks.soak                         # 30 minutes, the published table
    python -m benchmarks.soak --minutes 2 --out /tmp/soak.md
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    _adamw, _random_tokens, build_lm, code_version, command_line, lm_config, machine_line, markdown_table,
    write_result,
)
from piper_plugin import Job, Schedule, run
from piper_plugin.models import lm_loss
from piper_plugin.recipes import apply_recipe

__all__ = ["main", "build_parser"]

MIB = 2 ** 20


class _TimeUp(Exception):
    pass


def _schedule(program, *, pp: int, dp: int, zero: int, microbatches: int) -> Schedule:
    return apply_recipe(Schedule(program, pp=pp, dp=dp), "1f1b", microbatches=microbatches, zero=zero)


class _Minutes:
    """The metrics callback: groups steps by the minute they finished in."""

    def __init__(self, world: int, seconds: float):
        self.world, self.deadline, self.start = world, time.monotonic() + seconds, time.monotonic()
        self.steps: dict[int, list[dict]] = {}
        self.rows: list[list] = []
        self.minute = 1

    def __call__(self, m: dict) -> None:
        self.steps.setdefault(m["step"], []).append(m)
        if len(self.steps[m["step"]]) < self.world:
            return
        now = time.monotonic()
        if now - self.start >= 60 * self.minute:
            self._row(m["step"])
            self.minute += 1
        if now >= self.deadline:
            raise _TimeUp

    def _row(self, last: int) -> None:
        done = sorted(s for s, ms in self.steps.items() if len(ms) == self.world and s <= last)
        since = [s for s in done if s > (self.rows[-1][1] - 1 if self.rows else -1)]
        times = [max(m["step_time_s"] for m in self.steps[s]) for s in since]
        ranks = sorted(self.steps[last], key=lambda m: m["rank"])
        row = [self.minute, last + 1, f"{statistics.median(times) * 1e3:.1f}",
               " / ".join(f"{m['rss_bytes'] / MIB:.0f}" for m in ranks),
               " / ".join(f"{m['peak_memory_bytes'] / MIB:.2f}" for m in ranks)]
        self.rows.append(row)
        print(" | ".join(map(str, row)), flush=True)
        for s in since[:-1]:
            del self.steps[s]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--launcher", choices=("ray", "fork"), default="ray")
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()
    cfg = lm_config(dim=args.dim, layers=args.layers, heads=4, ffn=4 * args.dim, seq=args.seq, vocab=512)
    job = Job(model_fn=functools.partial(build_lm, cfg, 2), loss_fn=lm_loss,
              data_fn=functools.partial(_random_tokens, cfg, args.batch),
              schedule_fn=functools.partial(_schedule, pp=2, dp=2, zero=3, microbatches=args.microbatches),
              optimizer_fn=functools.partial(_adamw, 1e-3), steps=10 ** 9, timeout_s=120.0)
    minutes = _Minutes(4, args.minutes * 60)
    print("minute | steps | median step ms | RSS MiB per rank | meter peak MiB per rank", flush=True)
    try:
        run(job, launcher=args.launcher, on_metrics=minutes)
    except _TimeUp:
        pass
    rows = minutes.rows
    first, last = rows[0], rows[-1]
    rss = lambda row: [float(x) for x in row[3].split(" / ")]  # noqa: E731
    growth = max(b - a for a, b in zip(rss(rows[min(1, len(rows) - 1)]), rss(last)))
    text = "\n".join([
        "# Soak: memory and step time over a long run", "",
        f"Command: `{command_line('soak', args, parser)}`", "",
        f"Machine: {machine_line(f'started by the {args.launcher} launcher')} ({version} when the run started).", "",
        f"Job: toy LM (dim {args.dim}, {args.layers} layers, seq {args.seq}, vocab 512), batch {args.batch} in "
        f"{args.microbatches} microbatches, 1F1B on pp=2 x dp=2 with ZeRO-3, AdamW, {args.launcher} launcher, "
        f"4 ranks on this machine's cores. Each row: the minute, steps finished by then, the median step time "
        f"(slowest rank) of that minute's steps, each rank's resident memory (RSS of its process) and the "
        f"memory meter's peak (kept state + transient) at the minute's last step.", "",
        markdown_table(["minute", "steps", "median step ms", "RSS MiB (ranks 0-3)", "meter peak MiB (ranks 0-3)"],
                       rows), "",
        f"Largest RSS growth of a rank from minute {min(2, len(rows))} to minute {last[0]}: {growth:.0f} MiB; "
        f"median step time {first[2]} ms in minute 1, {last[2]} ms in minute {last[0]}.", ""])
    path = write_result(args.out, "soak.md", text)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
