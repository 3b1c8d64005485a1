"""torch.compile under both engines: TorchTitan's pipelining and Piper's, with and without compile.

Per schedule and round, two ``torchtitan.train`` jobs of :mod:`benchmarks.torchtitan_ab` run back
to back, one eager and one with ``--compile.enable`` (TorchTitan's default components, model and
loss, and its default backend, inductor, unless ``--backend`` says otherwise). In each job the two
engines alternate step by step over the same compiled (or eager) stages, so the piper / torch
ratio of a job compares neighbouring steps. Compile against eager compares two jobs: each
engine's tokens/s of the compiled job over the eager job of the same round (adjacent in time),
median over rounds. DualPipeV and ZBVZeroBubble are left out: TorchTitan's own engine fails
under compile there (its split backward keeps the compiled graph, which AOTAutograd's donated
buffers refuse), so no job could alternate; ``tests/test_torchtitan_flags.py`` pins Piper's
compiled DualPipeV against TorchTitan's eager one instead.

    python -m benchmarks.compile_ab                       # the published table
    python -m benchmarks.compile_ab --schedules 1F1B --rounds 1 --steps 8 --warmup 0
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import torchtitan_ab
from benchmarks._common import command_line, machine_line, markdown_table, median, write_result

__all__ = ["main", "build_parser"]

MODES = ("eager", "compiled")
SCHEDULES = ("1F1B", "Interleaved1F1B")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3_debugmodel")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES, metavar="SCHEDULE",
                        help=f"pipeline_parallel_schedule values: {', '.join(SCHEDULES)}")
    parser.add_argument("--backend", default="inductor", help="--compile.backend of the compiled jobs")
    parser.add_argument("--rounds", type=int, default=2, help="eager + compiled job pairs per schedule")
    parser.add_argument("--steps", type=int, default=16, help="steps per job, both engines together")
    parser.add_argument("--warmup", type=int, default=4, help="steps dropped at the start of each job "
                        "(the compiled job compiles in its first steps)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    print(command_line("compile_ab", args, parser), flush=True)
    flags = {"eager": "", "compiled": f"--compile.enable --compile.backend {args.backend}"}
    # schedule -> mode -> per round: torchtitan_ab's summary of that job
    jobs: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in MODES} for s in args.schedules}
    with tempfile.TemporaryDirectory(prefix="compile_ab_") as tmp:
        for r in range(args.rounds):
            for schedule in args.schedules:
                for mode in MODES if r % 2 == 0 else MODES[::-1]:  # alternate which goes first
                    ab = ["--model", args.model, "--schedules", schedule, "--rounds", "1", "--steps", str(args.steps),
                          "--warmup", str(args.warmup), "--seq", str(args.seq), "--batch", str(args.batch),
                          f"--extra={flags[mode]}", "--out", str(Path(tmp) / f"{schedule}-{mode}-{r}.md")]
                    summary = torchtitan_ab.main(ab)[schedule]
                    jobs[schedule][mode].append(summary)
                    print(f"round {r} {schedule} {mode}: torch {summary['torch_tps']:.0f} tokens/s, "
                          f"piper {summary['piper_tps']:.0f}, loss {summary['loss']:.4f}", flush=True)
    summary = _summarise(jobs)
    text = _report(args, parser, flags, jobs, summary)
    path = write_result(args.out, f"compile_ab_{args.model}_pp2.md", text)
    print(text)
    print(f"written to {path}")
    return summary


def _summarise(jobs) -> dict[str, dict]:
    out = {}
    for schedule, by_mode in jobs.items():
        row = {}
        for mode, runs in by_mode.items():
            row[mode] = {"torch": median([x["torch_tps"] for x in runs]), "piper": median([x["piper_tps"] for x in runs]),
                         "ratio": median([x["run_ratio"] for x in runs]), "loss": runs[0]["loss"]}
        for engine in ("torch", "piper"):  # compiled / eager of the same round (adjacent jobs)
            row[f"{engine}_speedup"] = median([c[f"{engine}_tps"] / e[f"{engine}_tps"]
                                               for c, e in zip(by_mode["compiled"], by_mode["eager"])])
        out[schedule] = row
    return out


def _report(args, parser, flags, jobs, summary) -> str:
    rows = []
    for schedule, row in summary.items():
        for mode in MODES:
            x = row[mode]
            rows.append([schedule, mode, f"{x['torch']:.0f}", f"{x['piper']:.0f}", f"**{x['ratio']:.3f}**",
                         f"{x['loss']:.5f}"])
    speed = [[schedule, f"**{row['torch_speedup']:.3f}**", f"**{row['piper_speedup']:.3f}**"]
             for schedule, row in summary.items()]
    per_job = shlex.join(["python", "-m", "benchmarks.torchtitan_ab", "--model", args.model, "--schedules",
                          "<schedule>", "--rounds", "1", "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--seq", str(args.seq), "--batch", str(args.batch), "--extra=<flags>"])
    return "\n".join([
        f"# torch.compile under TorchTitan's pipelining and Piper's ({args.model}, 2 ranks)", "",
        f"Command: `{command_line('compile_ab', args, parser)}`", "",
        f"Each job: `{per_job}` with flags `{flags['eager'] or '(none)'}` (eager) or `{flags['compiled']}` "
        f"(compiled); per round and schedule one of each, back to back, the first of the pair alternating from "
        f"round to round; {args.rounds} round(s). In a job the engines alternate step by step over the same "
        f"stages; the first {args.warmup} steps are dropped. tokens/s: TorchTitan's `tps` (per device), "
        "median over an engine's measured steps, median over rounds; piper / torch: median of the per-job "
        "ratios; loss: the last step's, round 0 (one trajectory per job).", "",
        markdown_table(["schedule", "stages", "torch tokens/s", "piper tokens/s", "piper / torch", "last loss"], rows),
        "",
        "Compiled / eager tokens/s of each engine (the two jobs of a round, median over rounds):", "",
        markdown_table(["schedule", "torch compiled / eager", "piper compiled / eager"], speed),
        "", machine_line("started by torchrun"), "",
    ])


if __name__ == "__main__":
    main()
