"""Does a cost profile measured through a host adapter predict that host's steps, schedule by schedule?

Per host (TorchTitan: ``llama3_debugmodel``'s 2-stage pipeline drop-in; Megatron: the
``pretrain_gpt`` entry's GPT, 8 layers, hidden 256, seq 128, global batch 16), each round:

1. ``piper calibrate --host <host> -- <the host's command>``: its jobs (1F1B at three microbatch
   counts, ZB-H1 at two, interleaved 1F1B over two stages per rank at two) run the host's own
   trainer under torchrun with a step trace;
2. every schedule of the table runs as a user runs it (torchrun, the host's entry, Piper's
   engine), with ``--piper.profile`` / ``--piper-profile`` (the log line with the profile's
   prediction of that plan's step) and a step trace (the measured step: per step the slowest
   process's executor time, median over the steps after ``--warmup``).

Each round also runs ``piper tune --profile`` with that round's profile (the host's programs the
calibration kept) and the plan it writes, by the command it prints.

Reported: per schedule the predicted / measured ratio per round and its median; which schedules
the calibration ran (a recipe and microbatch count among its jobs; the rest it never saw: other
recipes, microbatch counts or stage counts); and each rank's peak transient memory (activations,
messages, backward working memory: what Piper's plan moves, not the whole process's), as the
run's memory meter measured it and as the profile predicts it (from the region memory the
calibration's meters measured).

    python -m benchmarks.host_predict                              # the published table
    python -m benchmarks.host_predict --hosts megatron --rounds 1  # a smaller run
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import code_version, command_line, machine_line, markdown_table, median, write_result
from piper_plugin import read_step_traces

__all__ = ["main", "build_parser", "HOSTS"]

_TT = ["--config", "llama3_debugmodel_pp2_1f1b"]
_MEG = ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads",
        "8", "--seq-length", "128", "--global-batch-size", "16", "--lr", "1e-4", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
_V = ["--virtual-pipeline-model-parallel-size", "2"]
# host -> (program, calibration arguments, schedule -> the arguments of its run)
HOSTS: dict[str, tuple[str, list[str], dict[str, list[str]]]] = {
    "torchtitan": ("torchtitan.train", _TT, {
        "1f1b m=4": _TT,
        "zb-h1 m=4": [*_TT, "--piper.recipe", "zb-h1"],
        "gpipe m=4": [*_TT, "--piper.recipe", "gpipe"],
        "gpipe m=2": [*_TT, "--piper.recipe", "gpipe", "--parallelism.pipeline_parallel_microbatch_size", "2"],
        "interleaved-1f1b m=4 v=2": ["--config", "llama3_debugmodel_pp2_interleaved"],
        "dualpipev m=4 v=2": ["--config", "llama3_debugmodel_pp2_dualpipev"],
    }),
    "megatron": ("piper_plugin.adapters.megatron.pretrain_gpt", _MEG, {
        "1f1b m=4": [*_MEG, "--micro-batch-size", "4"],
        "1f1b m=8": [*_MEG, "--micro-batch-size", "2"],
        "zb-h1 m=8": [*_MEG, "--micro-batch-size", "2", "--piper-recipe", "zb-h1"],
        "gpipe m=8": [*_MEG, "--micro-batch-size", "2", "--piper-recipe", "gpipe"],
        "interleaved-1f1b m=8 v=2": [*_MEG, "--micro-batch-size", "2", *_V],
        "dualpipev m=8 v=2 (untied embeddings)": [*_MEG, "--micro-batch-size", "2", *_V, "--piper-recipe",
                                                  "dualpipev", "--untie-embeddings-and-output-weights"],
    }),
}
PREDICTED = re.compile(r"predicted with cost profile \S+: step ([\d.]+) ms")
PREDICTED_PEAKS = re.compile(r"peak transient per rank ([\d. /]+) MiB \((\w+) region memory\)")
TUNED = "tuned (piper tune's first choice)"
_TUNED = re.compile(r"run it with torchrun --nproc_per_node=\d+ -m \S+ (.*) \(and the run")
_FIRST = re.compile(r"^\s*1  (.+?)\s{2,}", re.M)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="+", choices=list(HOSTS), default=list(HOSTS))
    parser.add_argument("--schedules", nargs="+", metavar="NAME",
                        help="only these rows (names as in the table; default: every one)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each run (calibration jobs: --calibrate-steps)")
    parser.add_argument("--calibrate-steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="results file (default: benchmarks/results/host_predict.md)")
    return parser


def _run_args(host: str, argv: list[str], steps: int, trace: Path, profile: Path) -> list[str]:
    if host == "torchtitan":
        module = [] if argv[:1] == ["--module"] else ["--module", "piper_plugin.adapters.torchtitan"]
        return [*module, *argv, "--parallelism.pipeline_engine=piper",
                "--training.steps", str(steps), "--piper.trace", str(trace), "--piper.trace_memory",
                "--piper.profile", str(profile),
                "--dump_folder", f"{trace}_dump"]
    return [*argv, "--pipeline-engine", "piper", "--train-iters", str(steps), "--piper-trace", str(trace),
            "--piper-trace-memory",
            "--piper-profile", str(profile)]


def _torchrun(program: str, argv: list[str], cwd: Path, timeout_s: float = 900.0) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node=2 -m program argv``, 1 torch thread per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", program, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    return proc.returncode, proc.stdout + proc.stderr


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code_version()
    work = Path(tempfile.mkdtemp(prefix="host_predict_"))
    sections = []
    for host in args.hosts:
        program, base, schedules = HOSTS[host]
        names = [*(n for n in schedules if not args.schedules or n in args.schedules), TUNED]
        schedules = {**schedules, TUNED: []}  # each round: the tuner's command
        ratios: dict[str, list[float]] = {n: [] for n in names}
        measured: dict[str, list[float]] = {n: [] for n in names}
        peaks: dict[str, list[tuple[list[float], list[float]]]] = {n: [] for n in names}  # (predicted, measured) MiB
        calibration, calibrated = "", set()
        tuned_as: dict[str, int] = {}  # the tuner's first choice -> rounds it was chosen
        for round_ in range(args.rounds):
            profile = work / f"{host}_{round_}.json"
            cal = subprocess.run([sys.executable, "-m", "piper_plugin.cli", "calibrate", "--host", host, "--steps",
                                  str(args.calibrate_steps), "--out", str(profile), "--", *base],
                                 capture_output=True, text=True)
            if cal.returncode != 0:
                print(cal.stdout + cal.stderr, file=sys.stderr)
                return 1
            calibration = "\n".join(line for line in cal.stdout.splitlines() if line.startswith("calibrate"))
            calibrated = {job["job"] for job in json.loads(profile.read_text())["jobs"]}
            tuned = work / f"{host}_{round_}_tuned.json"
            tune = subprocess.run([sys.executable, "-m", "piper_plugin.cli", "tune", "--profile", str(profile),
                                   "--out", str(tuned)], capture_output=True, text=True)
            command = _TUNED.search(tune.stdout)
            if tune.returncode != 0 or command is None:
                print(tune.stdout + tune.stderr, file=sys.stderr)
                return 1
            first = _FIRST.search(tune.stdout)[1]
            schedules[TUNED] = shlex.split(command[1])
            tuned_as[first] = tuned_as.get(first, 0) + 1
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                trace = work / f"{host}_{round_}_{names.index(name)}"
                run_argv = _run_args(host, schedules[name], args.steps, trace, profile)
                code, log = _torchrun(program, run_argv, work)
                found = PREDICTED.search(log)
                if code != 0 or found is None:
                    print(f"{host} {name} failed (exit status {code}):\n{log[-3000:]}", file=sys.stderr)
                    return 1
                traced = read_step_traces(trace)
                step = traced.median_step(args.warmup)
                measured[name].append(step)
                ratios[name].append(float(found[1]) / 1e3 / step)
                memory = PREDICTED_PEAKS.search(log)
                if memory is None or memory[2] != "measured" or not traced.peak_transient:
                    print(f"{host} {name}: no measured region memory or peaks:\n{log[-3000:]}", file=sys.stderr)
                    return 1
                mib = [traced.peak_transient[r] / 2 ** 20 for r in sorted(traced.peak_transient)]
                peaks[name].append(([float(x) for x in memory[1].split(" / ")], mib))
                print(f"round {round_ + 1}: {host} {name}: measured {step * 1e3:.1f} ms, predicted / measured "
                      f"{ratios[name][-1]:.2f}; peak transient predicted / measured "
                      f"{' '.join(f'{a / b:.2f}' for a, b in zip(*peaks[name][-1]))}", flush=True)
        def memory_ratios(name: str) -> list[float]:  # every rank of every round
            return [a / b for predicted, mib in peaks[name] for a, b in zip(predicted, mib)]

        rows = [(name, "-" if name == TUNED else "yes" if name.split(" (")[0] in calibrated else "no",
                 f"{median(measured[name]) * 1e3:.1f}", " ".join(f"{r:.2f}" for r in ratios[name]),
                 f"**{median(ratios[name]):.2f}**", " / ".join(f"{m:.1f}" for m in peaks[name][-1][1]),
                 f"{min(memory_ratios(name)):.3f}-{max(memory_ratios(name)):.3f}") for name in names]
        worst = max(abs(median(ratios[n]) - 1) for n in names)
        worst_memory = max(abs(r - 1) for n in names for r in memory_ratios(n))
        written = [n for n in names if n != TUNED]
        fastest = min(written, key=lambda n: median(measured[n]))
        against = median(measured[TUNED]) / median(measured[fastest])
        sections += [f"## {host}", "", f"Calibrated on: `piper calibrate --host {host} --steps {args.calibrate_steps} "
                     f"-- {' '.join(base)}`", "",
                     markdown_table(("schedule", "a calibration job's", "measured step (ms, median)",
                                     "predicted / measured per round", "median",
                                     "peak transient per rank, measured (MiB, last round)",
                                     "peak predicted / measured (every rank and round)"), rows), "",
                     f"Every schedule's median step within {worst:.0%}; every rank's peak transient memory "
                     f"within {worst_memory:.1%}. `piper tune --profile` (the round's "
                     f"profile) chose: {'; '.join(f'{k} ({v} of {args.rounds} rounds)' for k, v in tuned_as.items())}; "
                     f"its measured median over the fastest other row's ({fastest}): {against:.2f}.",
                     "",
                     "The last round's calibration:", "", "```", calibration, "```", ""]
    text = "\n".join([
        "# Host cost profiles: predicted against measured steps and memory",
        "",
        f"Command: `{command_line('host_predict', args, parser)}`",
        "",
        f"Machine: {machine_line(ranks='2 ranks under torchrun, one job at a time')}",
        "",
        f"Each run: {args.steps} steps, the median of steps {args.warmup + 1}-{args.steps} of the slowest process "
        f"(its executor's step); {args.rounds} rounds, each calibrated just before its runs, the order rotated.",
        "",
        *sections,
    ])
    path = write_result(args.out, "host_predict.md", text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
