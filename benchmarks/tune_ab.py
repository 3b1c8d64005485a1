"""Is ``piper tune``'s first choice at least as fast as every hand-written recipe, measured?

``piper calibrate`` measures a cost profile on this machine, ``piper tune`` picks a plan for
the ranks by simulating every candidate with it and writes it as a recipe file; then
that file and each built-in recipe (at ``--pp`` ranks, ``--microbatches``), plus plain data
parallelism over the ranks, train the same toy LM (same layers, batch, seed) with
``piper train --launcher fork``, one job after another, the order rotated every round so the
machine's drift hits all alike. A job's step time is, per step, the slowest rank's (its
``--metrics`` file), median over the steps after ``--warmup``; a configuration's figure is the
median over its rounds. Reported: those medians, each one's ratio to the tuned plan's, the
profile's prediction for each (``piper plan --profile``: the same plan simulated with the
measured cost profile) against the measured median, step time and peak memory of the fullest
rank (measured: the runtime's count, kept state plus its meter's peak, largest over ranks and
steps), and the tuner's own table. Every round but the first calibrates again before its jobs (the
machine's speed drifts by 10-15% over minutes here); the tuned plan stays the first round's.

    python -m benchmarks.tune_ab                       # the published table
    python -m benchmarks.tune_ab --steps 4 --rounds 1  # a smoke run

Invariant: predictions come from the profile alone (measured before any of the timed jobs ran).
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
from piper_plugin import inside_link, link_bits_per_second, run_in_emulated_link

__all__ = ["main", "build_parser", "HAND_WRITTEN"]

HAND_WRITTEN = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128,
                        help="sequence length (calibration, tuning and every job; default 128: compute, not overhead)")
    parser.add_argument("--microbatches", type=int, default=4, help="the hand-written recipes' microbatches")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each job's median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--link", metavar="RATE",
                        help="everything (calibration and jobs) over an emulated link of this rate (tc's form: "
                             "1gbit): a private network namespace with a rate-limited loopback (root)")
    parser.add_argument("--out", type=Path, help="results file (default: benchmarks/results/tune_ab.md)")
    return parser


def _piper(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "piper_plugin.cli", *argv], capture_output=True, text=True,
                          timeout=900)


def _step_time(metrics: Path, warmup: int) -> tuple[float, int]:
    """Median over the steps after ``warmup`` of the slowest rank's step time; the largest peak
    memory of any rank and step."""
    per_step: dict[int, float] = {}
    peak = 0
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        per_step[m["step"]] = max(per_step.get(m["step"], 0.0), m["step_time_s"])
        peak = max(peak, int(m["peak_memory_bytes"]))
    return median([t for s, t in sorted(per_step.items()) if s >= warmup]), peak


_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}


def predicted(config: list[str], profile: Path) -> tuple[float, float, str]:
    """``piper plan --profile`` of a configuration: (simulated step seconds, peak bytes of the
    fullest rank, to the printed precision, the plan's hash)."""
    run = _piper("plan", *config, "--profile", str(profile))
    if run.returncode != 0:
        raise SystemExit(f"piper plan {' '.join(config)} failed:\n{run.stderr[-2000:]}")
    lines = run.stdout.splitlines()
    step = float(next(line.split()[2] for line in lines if line.startswith("step time")))
    digest = next(line.split()[-1] for line in lines if line.startswith("plan "))
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("peak memory per rank")) + 2:]
    peak = max(float(row.split()[-2]) * _UNITS[row.split()[-1]] for row in table if row.strip())
    return step, peak, digest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.link is not None and inside_link() != args.link:
        try:
            link_bits_per_second(args.link)
            return run_in_emulated_link(args.link, [sys.executable, "-m", "benchmarks.tune_ab", *argv],
                                        cwd=Path(__file__).resolve().parents[1])
        except (ValueError, RuntimeError) as exc:
            print(f"piper: error: --link: {exc}", file=sys.stderr)
            return 2
    code_version()
    work = Path(tempfile.mkdtemp(prefix="tune_ab_"))
    tuned, profile = work / "tuned.json", work / "profile.json"
    sizes = ["--ranks", str(args.ranks), "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
    link = ["--link", args.link] if args.link else []
    calibrate = _piper("calibrate", *sizes, *link, "--out", str(profile))
    tune = _piper("tune", *sizes, "--profile", str(profile), "--top", "8", "--out", str(tuned))
    for step in (calibrate, tune):
        if step.returncode != 0:
            print(step.stdout + step.stderr, file=sys.stderr)
            return 1
    model = ["--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
    common = [*model, "--steps", str(args.steps), "--launcher", "fork", "--timeout", "300"]
    configs = {"tuned (piper tune's first choice)": ["--recipe-file", str(tuned)]}
    configs[f"plain data parallel (1f1b pp=1 dp={args.ranks}, m=1)"] = [
        "--recipe", "1f1b", "--pp", "1", "--dp", str(args.ranks), "--microbatches", "1"]
    for recipe in HAND_WRITTEN:
        configs[f"{recipe} pp={args.ranks} m={args.microbatches}"] = [
            "--recipe", recipe, "--pp", str(args.ranks), "--microbatches", str(args.microbatches)]
    times: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, int] = {name: 0 for name in configs}
    peak_ratio: dict[str, float] = {}
    ratios: dict[str, list[float]] = {name: [] for name in configs}  # per round: predicted / measured step
    names = list(configs)
    predictions = {name: predicted([*configs[name], "--batch", str(args.batch)], profile) for name in names}
    for round_ in range(args.rounds):
        if round_:  # each round predicts with a profile measured just before it (the machine drifts)
            again = _piper("calibrate", *sizes, *link, "--out", str(profile))
            if again.returncode != 0:
                print(again.stdout + again.stderr, file=sys.stderr)
                return 1
            predictions = {name: predicted([*configs[name], "--batch", str(args.batch)], profile) for name in names}
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            metrics = work / f"{len(times[name])}_{names.index(name)}.jsonl"
            run = _piper("train", *configs[name], *common, "--metrics", str(metrics))
            if run.returncode != 0:
                print(f"{name} failed:\n{run.stderr[-3000:]}", file=sys.stderr)
                return 1
            step, peak = _step_time(metrics, args.warmup)
            times[name].append(step)
            ratios[name].append(predictions[name][0] / step)
            peaks[name] = max(peaks[name], peak)
            peak_ratio[name] = predictions[name][1] / peaks[name]
            print(f"round {round_ + 1}: {name}: {times[name][-1] * 1e3:.1f} ms", flush=True)
    tuned_ms = median(times[names[0]])
    rows = [(name, " ".join(f"{t * 1e3:.1f}" for t in times[name]), f"{median(times[name]) * 1e3:.1f}",
             f"{median(times[name]) / tuned_ms:.2f}", " ".join(f"{r:.2f}" for r in ratios[name]),
             f"**{median(ratios[name]):.2f}**", f"{peaks[name] / 2 ** 20:.1f}", f"{peak_ratio[name]:.2f}")
            for name in names]
    rows = [(*row, predictions[name][2]) for row, name in zip(rows, names)]
    table = markdown_table(("plan", "step (ms) per round", "median (ms)", "/ tuned", "predicted / measured per round",
                            "median", "peak (MiB, measured)", "peak predicted / measured", "plan hash"), rows)
    same = [n for n in names[1:] if predictions[n][2] == predictions[names[0]][2]]
    step_error = max(abs(median(ratios[n]) - 1) for n in names)
    round_error = max(abs(r - 1) for n in names for r in ratios[n])
    peak_error = max(abs(peak_ratio[n] - 1) for n in names)
    fastest = min(names, key=lambda n: median(times[n]))
    text = "\n".join([
        "# piper tune's first choice against the hand-written recipes",
        "",
        f"Command: `{command_line('tune_ab', args, parser)}`",
        "",
        f"Machine: {machine_line(ranks='started by piper train --launcher fork, one job at a time')}"
        + (f"; every message over an emulated {args.link} link (a rate-limited loopback, tc tbf, in a private "
           f"network namespace)" if args.link else ""),
        "",
        f"Toy LM, {args.layers} layers, batch {args.batch}, seq {args.seq}, {args.ranks} ranks, {args.steps} steps per job "
        f"(median of steps {args.warmup + 1}-{args.steps} of the slowest rank), {args.rounds} rounds, order rotated.",
        "",
        table,
        "",
        f"Fastest measured: {fastest}. The tuned plan's median over the fastest hand-written one's: "
        f"{tuned_ms / min(median(times[n]) for n in names[1:]):.2f}."
        + (f" The tuned plan is the same plan as {', '.join(same)} (one plan hash): their difference is "
           f"this run's job-to-job noise." if same else ""),
        "",
        f"The profile's predictions (`piper plan --profile` of each plan, with a profile `piper calibrate` "
        f"measured at the start of the round, before its timed jobs) against the measured steps: the median "
        f"over rounds within {step_error:.0%} for every plan (single rounds within {round_error:.0%}); peak "
        f"memory of the fullest rank within {peak_error:.0%}.",
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
