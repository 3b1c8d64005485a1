"""A/B: Piper vs TorchTitan's own pipelining, through the real ``torchtitan.train`` entry point.

For each schedule the same drop-in config ``<model>_pp2_<schedule>`` (2 pipeline ranks) runs
under torchrun with ``--parallelism.pipeline_engine torch`` and ``piper``; each round runs every
schedule once per engine, the engine that goes first alternating by round (T P, P T, ...) so
drift of the machine hits both alike. Same seed, data, optimizer and stages; the first
``--warmup`` steps of each run are dropped. Reported per schedule and engine:

* tokens/s: median over all measured steps of all rounds of TorchTitan's own ``tps`` (tokens per
  second per device), the mean over the two ranks of one step; the ratio is piper / torch;
* peak memory per rank: TorchTitan's ``memory/max_reserved`` metric for each rank (read from its
  TensorBoard log, written for every rank), the maximum over the measured steps of a run, median
  over rounds. On CUDA that is the caching allocator's reserved peak; on CPU it is the rank
  process's peak RSS, reset after every step (``adapters/torchtitan/cpu.py``);
* the loss of the last step of round 0 (both engines must compute the same thing);
* the cores other processes kept busy during the runs (the machine may be shared).

    python -m benchmarks.torchtitan_ab                                   # the published table
    python -m benchmarks.torchtitan_ab --schedules 1F1B DualPipeV --rounds 2
"""
from __future__ import annotations

import argparse
import glob
import shlex
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ForeignLoad, command_line, machine_line, markdown_table, median, write_result
from piper_plugin.adapters.torchtitan import cpu
from piper_plugin.adapters.torchtitan.config_registry import SCHEDULES
from piper_plugin.adapters.torchtitan.launch import TitanRun, run_titan, titan_command

__all__ = ["main", "build_parser", "SCHEDULE_CONFIG", "rank_memory_peaks"]

ENGINES = ("torch", "piper")
# TorchTitan schedule name -> the suffix of its drop-in config (config_registry.SCHEDULES)
SCHEDULE_CONFIG = {titan: suffix for suffix, titan in SCHEDULES.items()}
MEMORY_TAG = "memory/max_reserved(GiB)"
TB_FLAGS = ["--metrics.enable_tensorboard", "--metrics.save_for_all_ranks", "--metrics.save_tb_folder", "tb"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchtitan_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3_debugmodel",
                        help="stock TorchTitan config; each run uses its drop-in <model>_pp2_<schedule>")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULE_CONFIG), choices=list(SCHEDULE_CONFIG),
                        metavar="SCHEDULE", help=f"pipeline_parallel_schedule values: {', '.join(SCHEDULE_CONFIG)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="local batch (microbatches at microbatch size 1)")
    parser.add_argument("--extra", default="", help="more torchtitan.train flags, one string")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def config_name(model: str, schedule: str) -> str:
    return f"{model}_pp2_{SCHEDULE_CONFIG[schedule]}"


def rank_memory_peaks(dump_folder: Path, after_step: int) -> dict[int, float]:
    """Per rank, the largest ``memory/max_reserved`` (bytes) TorchTitan logged for a step after
    ``after_step``, read from the TensorBoard files it writes under ``dump_folder/tb``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    peaks: dict[int, float] = {}
    for path in glob.glob(str(dump_folder / "tb" / "*" / "rank_*" / "events.out.tfevents.*")):
        rank = int(Path(path).parent.name.split("_")[1])
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag == MEMORY_TAG and event.step > after_step:
                    gib = float(make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                    peaks[rank] = max(peaks.get(rank, 0.0), gib * 2 ** 30)
    return peaks


def _run(args, schedule: str, engine: str, dump: Path, extra: list[str]) -> tuple[TitanRun, ForeignLoad]:
    with ForeignLoad() as load:
        run = run_titan(config_name(args.model, schedule), engine, dump_folder=dump, steps=args.steps,
                        extra=extra, timeout_s=900)
    if not run.ok:
        print(run.tail(), file=sys.stderr)
        raise SystemExit(f"{schedule} {engine} run failed (exit {run.returncode}); command: "
                         f"{shlex.join(run.command)}")
    measured = [s for s in run.tps if s > args.warmup]
    if not measured:
        raise SystemExit(f"{schedule} {engine}: no step after --warmup {args.warmup} was logged; "
                         f"raise --steps above --warmup")
    return run, load


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    print(command_line("torchtitan_ab", args, parser), flush=True)
    extra = ["--debug.seed", "0", "--training.seq_len", str(args.seq), "--training.local_batch_size",
             str(args.batch), "--metrics.log_freq", "1", *TB_FLAGS, *shlex.split(args.extra)]
    # schedule -> engine -> collected figures
    stats = {s: {e: {"tps": [], "wall": [], "mem": {}, "load": [], "loss": None} for e in ENGINES}
             for s in args.schedules}
    with tempfile.TemporaryDirectory(prefix="titan_ab_") as tmp:
        for r in range(args.rounds):
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for schedule in args.schedules:
                for engine in order:
                    dump = Path(tmp) / f"{schedule}_{engine}{r}"
                    run, load = _run(args, schedule, engine, dump, extra)
                    s = stats[schedule][engine]
                    rates = [sum(run.tps[k]) / len(run.tps[k]) for k in sorted(run.tps) if k > args.warmup]
                    s["tps"] += rates
                    s["wall"].append(run.wall_s)
                    if load.cores is not None:
                        s["load"].append(load.cores)
                    for rank, peak in rank_memory_peaks(dump, args.warmup).items():
                        s["mem"].setdefault(rank, []).append(peak)
                    if s["loss"] is None:
                        s["loss"] = run.losses[max(run.losses)]
                    print(f"round {r} {schedule} {engine}: median tps {median(rates):.0f}, wall {run.wall_s:.1f}s, "
                          f"peak MiB per rank {_mem_cells(s['mem'], last=True)}", flush=True)
    summary = _summarise(stats)
    text = _report(args, parser, extra, stats, summary)
    path = write_result(args.out, f"torchtitan_ab_{args.model}_pp2.md", text)
    print(text)
    print(f"written to {path}")
    return summary


def _mem_cells(mem: dict[int, list[float]], last: bool = False) -> str:
    if not mem:
        return "n/a"
    return " / ".join(f"{(m[-1] if last else median(m)) / 2 ** 20:.0f}" for _, m in sorted(mem.items()))


def _summarise(stats) -> dict[str, dict]:
    summary = {}
    for schedule, per_engine in stats.items():
        t, p = per_engine["torch"], per_engine["piper"]
        summary[schedule] = {
            "torch_tps": median(t["tps"]), "piper_tps": median(p["tps"]),
            "ratio": median(p["tps"]) / median(t["tps"]),
            "torch_loss": t["loss"], "piper_loss": p["loss"],
            "torch_mem": {k: median(v) for k, v in t["mem"].items()},
            "piper_mem": {k: median(v) for k, v in p["mem"].items()},
        }
    return summary


def _report(args, parser, extra, stats, summary) -> str:
    memory = ("peak RSS of the rank process (VmHWM, reset after every step)" if cpu.on_cpu()
              else "CUDA max reserved memory")
    rows = []
    for schedule, per_engine in stats.items():
        for engine in ENGINES:
            s = per_engine[engine]
            rows.append([schedule, engine, f"{median(s['tps']):.0f}", len(s["tps"]), _mem_cells(s["mem"]),
                         f"{median(s['wall']):.1f}", f"{s['loss']:.5f}",
                         f"{median(s['load']):.2f}" if s["load"] else "n/a"])
    ratios = [[schedule, f"**{s['ratio']:.3f}**",
               " / ".join(f"{(s['piper_mem'].get(k, 0) - s['torch_mem'].get(k, 0)) / 2 ** 20:+.0f}"
                          for k in sorted(s["torch_mem"]))] for schedule, s in summary.items()]
    run_cmd = shlex.join(titan_command(f"{args.model}_pp2_<schedule>", "<engine>", steps=args.steps, extra=extra))
    return "\n".join([
        f"# Piper vs TorchTitan's pipelining ({args.model}, torchtitan.train, 2 ranks)", "",
        f"Command: `{command_line('torchtitan_ab', args, parser)}`", "",
        f"Each run: `{run_cmd}` (schedule suffixes: "
        f"{', '.join(f'{k} -> {v}' for k, v in SCHEDULE_CONFIG.items())})", "",
        f"{args.rounds} rounds, engine order alternating by round; first {args.warmup} steps of each run dropped. "
        f"tokens/s: TorchTitan's `tps` (per device), mean over ranks per step, median over measured steps. "
        f"Peak memory: {memory}, max over measured steps, median over rounds, rank 0 / rank 1. "
        f"Other load: cores kept busy by other processes during the runs (median over runs).", "",
        markdown_table(["schedule", "engine", "median tokens/s", "steps measured", "peak MiB per rank (0 / 1)",
                        "median wall s / run", f"loss at step {args.steps} (round 0)", "other load (cores)"], rows),
        "",
        markdown_table(["schedule", "piper / torch tokens/s", "piper - torch peak MiB (rank 0 / 1)"], ratios), "",
        machine_line(), "",
    ])


if __name__ == "__main__":
    main()
