"""Is ``piper tune``'s first choice at least as fast as every hand-written recipe, measured?

``piper calibrate`` measures a cost profile on this machine, ``piper tune`` picks a plan for
the ranks by simulating every candidate with it and writes it as a recipe file; then
that file and each built-in recipe (at ``--pp`` ranks, ``--microbatches``), plus plain data
parallelism over the ranks, train the same toy LM (same layers, batch, seed) with
``piper train --launcher fork``, one job after another, the order rotated every round so the
machine's drift hits all alike. A job's step time is, per step, the slowest rank's (its
``--metrics`` file), median over the steps after ``--warmup``; a configuration's figure is the
median over its rounds. Reported: those medians, each one's ratio to the tuned plan's, and
the tuner's own table.

    python -m benchmarks.tune_ab                       # the published table
    python -m benchmarks.tune_ab --steps 4 --rounds 1  # a smoke run
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import code_version, command_line, machine_line, markdown_table, median, write_result

__all__ = ["main", "build_parser", "HAND_WRITTEN"]

HAND_WRITTEN = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4, help="the hand-written recipes' microbatches")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each job's median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="results file (default: benchmarks/results/tune_ab.md)")
    return parser


def _piper(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "piper_plugin.cli", *argv], capture_output=True, text=True,
                          timeout=900)


def _step_time(metrics: Path, warmup: int) -> float:
    """Median over the steps after ``warmup`` of the slowest rank's step time."""
    per_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        per_step[m["step"]] = max(per_step.get(m["step"], 0.0), m["step_time_s"])
    return median([t for s, t in sorted(per_step.items()) if s >= warmup])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code_version()
    work = Path(tempfile.mkdtemp(prefix="tune_ab_"))
    tuned, profile = work / "tuned.json", work / "profile.json"
    sizes = ["--ranks", str(args.ranks), "--layers", str(args.layers), "--batch", str(args.batch)]
    calibrate = _piper("calibrate", *sizes, "--out", str(profile))
    tune = _piper("tune", *sizes, "--profile", str(profile), "--top", "8", "--out", str(tuned))
    for step in (calibrate, tune):
        if step.returncode != 0:
            print(step.stdout + step.stderr, file=sys.stderr)
            return 1
    common = ["--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
              "--launcher", "fork", "--timeout", "300"]
    configs = {"tuned (piper tune's first choice)": ["--recipe-file", str(tuned)]}
    configs[f"plain data parallel (1f1b pp=1 dp={args.ranks}, m=1)"] = [
        "--recipe", "1f1b", "--pp", "1", "--dp", str(args.ranks), "--microbatches", "1"]
    for recipe in HAND_WRITTEN:
        configs[f"{recipe} pp={args.ranks} m={args.microbatches}"] = [
            "--recipe", recipe, "--pp", str(args.ranks), "--microbatches", str(args.microbatches)]
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            metrics = work / f"{len(times[name])}_{names.index(name)}.jsonl"
            run = _piper("train", *configs[name], *common, "--metrics", str(metrics))
            if run.returncode != 0:
                print(f"{name} failed:\n{run.stderr[-3000:]}", file=sys.stderr)
                return 1
            times[name].append(_step_time(metrics, args.warmup))
            print(f"round {round_ + 1}: {name}: {times[name][-1] * 1e3:.1f} ms", flush=True)
    tuned_ms = median(times[names[0]])
    rows = [(name, " ".join(f"{t * 1e3:.1f}" for t in times[name]), f"{median(times[name]) * 1e3:.1f}",
             f"{median(times[name]) / tuned_ms:.2f}") for name in names]
    table = markdown_table(("plan", "step (ms) per round", "median (ms)", "/ tuned"), rows)
    fastest = min(names, key=lambda n: median(times[n]))
    text = "\n".join([
        "# piper tune's first choice against the hand-written recipes",
        "",
        f"Command: `{command_line('tune_ab', args, parser)}`",
        "",
        f"Machine: {machine_line(ranks='started by piper train --launcher fork, one job at a time')}",
        "",
        f"Toy LM, {args.layers} layers, batch {args.batch}, {args.ranks} ranks, {args.steps} steps per job "
        f"(median of steps {args.warmup + 1}-{args.steps} of the slowest rank), {args.rounds} rounds, order rotated.",
        "",
        table,
        "",
        f"Fastest measured: {fastest}. The tuned plan's median over the fastest hand-written one's: "
        f"{tuned_ms / min(median(times[n]) for n in names[1:]):.2f}.",
        "",
        "`piper calibrate` and `piper tune` (simulation with the measured profile):",
        "",
        "```",
        calibrate.stdout.rstrip().replace(str(profile), "profile.json"),
        tune.stdout.rstrip().replace(str(tuned), "tuned.json").replace(str(profile), "profile.json"),
        "```",
        "",
    ])
    path = write_result(args.out, "tune_ab.md", text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
