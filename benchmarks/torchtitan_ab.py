"""A/B: Piper vs TorchTitan's own pipelining, through the real ``torchtitan.train`` entry point.

Each round runs the same TorchTitan config twice under torchrun — ``--parallelism.pipeline_engine
torch`` and ``piper`` — alternating which goes first (T P, P T, ...) so drift of the machine hits
both alike. Same seed, data, optimizer and stages; the first ``--warmup`` steps of each run are
dropped. Reported per engine: median tokens/s over all measured steps of all rounds (TorchTitan's
own ``tps``, the mean over ranks of one step), and the losses of the last step of the first round
(a check that both computed the same thing).

    python -m benchmarks.torchtitan_ab                                   # the published table
    python -m benchmarks.torchtitan_ab --config llama3_debugmodel_pp2_interleaved --rounds 2
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import command_line, machine_line, markdown_table, median, write_result
from piper_plugin.adapters.torchtitan.launch import run_titan, titan_command

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchtitan_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama3_debugmodel_pp2_1f1b",
                        help="config function of piper_plugin.adapters.torchtitan")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="local batch (microbatches at microbatch size 1)")
    parser.add_argument("--extra", default="", help="more torchtitan.train flags, one string")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    extra = ["--debug.seed", "0", "--training.seq_len", str(args.seq), "--training.local_batch_size",
             str(args.batch), *shlex.split(args.extra)]
    rates: dict[str, list[float]] = {"torch": [], "piper": []}
    walls: dict[str, list[float]] = {"torch": [], "piper": []}
    last_loss: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="titan_ab_") as tmp:
        for r in range(args.rounds):
            order = ("torch", "piper") if r % 2 == 0 else ("piper", "torch")
            for engine in order:
                run = run_titan(args.config, engine, dump_folder=Path(tmp) / f"{engine}{r}", steps=args.steps,
                                extra=extra, timeout_s=900)
                if not run.ok:
                    print(run.tail(), file=sys.stderr)
                    raise SystemExit(f"{engine} run failed (exit {run.returncode})")
                steps = [s for s in sorted(run.tps) if s > args.warmup]
                rates[engine] += [sum(run.tps[s]) / len(run.tps[s]) for s in steps]
                walls[engine].append(run.wall_s)
                last_loss.setdefault(engine, run.losses[max(run.losses)])
                print(f"round {r} {engine}: median tps {median([sum(run.tps[s]) / len(run.tps[s]) for s in steps]):.0f}"
                      f", wall {run.wall_s:.1f}s", flush=True)
    rows = [[e, f"{median(rates[e]):.0f}", len(rates[e]), f"{median(walls[e]):.1f}", f"{last_loss[e]:.5f}"]
            for e in ("torch", "piper")]
    ratio = median(rates["piper"]) / median(rates["torch"])
    cmd = command_line("torchtitan_ab", args, parser)
    text = "\n".join([
        "# Piper vs TorchTitan's pipelining (torchtitan.train, 2 ranks)", "",
        f"Command: `{cmd}`", "",
        f"Each run: `{shlex.join(titan_command(args.config, '<engine>', steps=args.steps, extra=extra))}`", "",
        markdown_table(["engine", "median tokens/s", "steps measured", "median wall s / run",
                        f"loss at step {args.steps} (round 0)"], rows), "",
        f"Piper / torch tokens/s: **{ratio:.3f}**", "",
        machine_line(), "",
    ])
    path = write_result(args.out, f"torchtitan_ab_{args.config}.md", text)
    print(text)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
