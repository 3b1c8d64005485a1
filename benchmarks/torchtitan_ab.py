"""A/B: Piper vs TorchTitan's own pipelining, through the real ``torchtitan.train`` entry point.

For each schedule the drop-in config ``<model>_pp2_<schedule>`` (2 pipeline ranks) runs under
torchrun with ``--parallelism.pipeline_engine alternate``: both engines drive the same stage
modules, data, optimizer and LR schedule in one job, and the steps alternate torch, piper, piper,
torch, ... (:mod:`piper_plugin.adapters.torchtitan.alternate`). On a shared machine whose speed
drifts by tens of percent from run to run, that is the only comparison that holds: neighbouring
steps see the same machine. The first ``--warmup`` steps are dropped (lazy set-up of both
engines). Reported per schedule and engine:

* tokens/s: median over an engine's measured steps (all runs) of TorchTitan's own ``tps``
  (tokens per second per device), the mean over the two ranks of one step. The ratio is
  piper / torch of those medians. The per-run ratios are the same within each run; their
  median is the figure that does not mix runs: this machine's speed moves by up to a third
  from one run to the next, so pooled medians of a run at a slow moment and one at a fast
  moment compare two different mixtures. The cycle ratio is the median over complete
  torch-piper-piper-torch cycles of piper / torch, which cancels a drift inside the run;
* peak memory per rank: TorchTitan's ``memory/max_reserved`` metric for each rank and step (read
  from its TensorBoard log, written for every rank), the maximum over an engine's measured steps,
  median over runs. On CUDA that is the caching allocator's reserved peak; on CPU it is the rank
  process's peak RSS, reset after every step (``adapters/torchtitan/cpu.py``);
* the loss of the last step (one trajectory: both engines compute the same gradients; the
  parity tests pin that separately);
* the cores other processes kept busy during the runs (the machine may be shared).

    python -m benchmarks.torchtitan_ab                                   # the published table
    python -m benchmarks.torchtitan_ab --schedules 1F1B DualPipeV --rounds 2
"""
from __future__ import annotations

import argparse
import glob
import re
import shlex
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ForeignLoad, command_line, machine_line, markdown_table, median, write_result
from piper_plugin.adapters.torchtitan import SCHEDULES, TitanRun, on_cpu, run_titan, titan_command

__all__ = ["main", "build_parser", "SCHEDULE_CONFIG", "rank_memory_by_step", "engines_by_step"]

ENGINES = ("torch", "piper")
_ENGINE_LINE = re.compile(r"Piper A/B: step (\d+) runs on the (torch|piper) engine")
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
    parser.add_argument("--rounds", type=int, default=1, help="runs per schedule")
    parser.add_argument("--steps", type=int, default=28, help="steps per run, both engines together")
    parser.add_argument("--warmup", type=int, default=4, help="steps dropped at the start of each run")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="local batch (microbatches at microbatch size 1)")
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2],
                        help="tensor_parallel_degree inside each stage: 2 runs <model>_pp2_tp2_<schedule> on 4 ranks")
    parser.add_argument("--extra", default="", help="more torchtitan.train flags, one string")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def config_name(model: str, schedule: str, tp: int = 1) -> str:
    return f"{model}_pp2_{'tp2_' if tp == 2 else ''}{SCHEDULE_CONFIG[schedule]}"


def rank_memory_by_step(dump_folder: Path) -> dict[int, dict[int, float]]:
    """rank -> step -> TorchTitan's ``memory/max_reserved`` (bytes) for that step, read from the
    TensorBoard files it writes under ``dump_folder/tb``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    per_rank: dict[int, dict[int, float]] = {}
    for path in glob.glob(str(dump_folder / "tb" / "*" / "rank_*" / "events.out.tfevents.*")):
        rank = int(Path(path).parent.name.split("_")[1])
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag == MEMORY_TAG:
                    gib = float(make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                    per_rank.setdefault(rank, {})[event.step] = gib * 2 ** 30
    return per_rank


def engines_by_step(log: str) -> dict[int, str]:
    """step -> engine, from the line the alternating schedule logs before each step."""
    return {int(m[1]): m[2] for m in _ENGINE_LINE.finditer(log)}


def _run(args, schedule: str, dump: Path, extra: list[str]) -> tuple[TitanRun, ForeignLoad, dict[int, str]]:
    with ForeignLoad() as load:
        run = run_titan(config_name(args.model, schedule, args.tp), "alternate", dump_folder=dump, steps=args.steps,
                        nproc=2 * args.tp, extra=extra, timeout_s=1800)
    if not run.ok:
        print(run.tail(), file=sys.stderr)
        raise SystemExit(f"{schedule} run failed (exit {run.returncode}); command: {shlex.join(run.command)}")
    engines = engines_by_step(run.log)
    measured = {e for k, e in engines.items() if k > args.warmup and k in run.tps}
    if measured != set(ENGINES):
        raise SystemExit(f"{schedule}: after --warmup {args.warmup} steps not both engines ran a logged step; "
                         f"raise --steps (now {args.steps}) to at least --warmup + 4")
    return run, load, engines


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 4:
        parser.error(f"--steps {args.steps} must be at least --warmup {args.warmup} + 4 (one torch, piper, piper, "
                     f"torch cycle)")
    print(command_line("torchtitan_ab", args, parser), flush=True)
    extra = ["--debug.seed", "0", "--training.seq_len", str(args.seq), "--training.local_batch_size",
             str(args.batch), "--metrics.log_freq", "1", *TB_FLAGS, *shlex.split(args.extra)]
    # schedule -> engine -> collected figures
    stats = {s: {"load": [], "loss": None, "wall": [], "cycles": [], "runs": [],
                 **{e: {"tps": [], "mem": {}} for e in ENGINES}} for s in args.schedules}
    with tempfile.TemporaryDirectory(prefix="titan_ab_") as tmp:
        for r in range(args.rounds):
            for schedule in args.schedules:
                dump = Path(tmp) / f"{schedule}{r}"
                run, load, engines = _run(args, schedule, dump, extra)
                s = stats[schedule]
                rate = {k: sum(v) / len(v) for k, v in run.tps.items() if k > args.warmup}
                for step, tps in sorted(rate.items()):
                    s[engines[step]]["tps"].append(tps)
                s["runs"].append(median([v for k, v in rate.items() if engines[k] == "piper"])
                                 / median([v for k, v in rate.items() if engines[k] == "torch"]))
                s["cycles"] += _cycle_ratios(rate, engines)
                s["wall"].append(run.wall_s)
                if load.cores is not None:
                    s["load"].append(load.cores)
                for rank, steps in rank_memory_by_step(dump).items():
                    for engine in ENGINES:
                        peaks = [m for k, m in steps.items() if k > args.warmup and engines.get(k) == engine]
                        if peaks:
                            s[engine]["mem"].setdefault(rank, []).append(max(peaks))
                if s["loss"] is None:
                    s["loss"] = run.losses[max(run.losses)]
                print(f"round {r} {schedule}: median tps torch {median(s['torch']['tps']):.0f}, "
                      f"piper {median(s['piper']['tps']):.0f}, wall {run.wall_s:.1f}s", flush=True)
    summary = _summarise(stats)
    text = _report(args, parser, extra, stats, summary)
    path = write_result(args.out, f"torchtitan_ab_{args.model}_pp2{'_tp2' if args.tp == 2 else ''}.md", text)
    print(text)
    print(f"written to {path}")
    return summary


def _cycle_ratios(rate: dict[int, float], engines: dict[int, str]) -> list[float]:
    """Piper / torch tokens/s of every complete torch, piper, piper, torch cycle of measured steps."""
    ratios = []
    for first in sorted(rate):
        steps = list(range(first, first + 4))
        if (first - 1) % 4 == 0 and all(k in rate for k in steps):
            by = {e: [rate[k] for k in steps if engines[k] == e] for e in ENGINES}
            if all(len(v) == 2 for v in by.values()):
                ratios.append(sum(by["piper"]) / sum(by["torch"]))
    return ratios


def _mem_cells(mem: dict[int, list[float]], last: bool = False) -> str:
    if not mem:
        return "n/a"
    return " / ".join(f"{(m[-1] if last else median(m)) / 2 ** 20:.0f}" for _, m in sorted(mem.items()))


def _summarise(stats) -> dict[str, dict]:
    summary = {}
    for schedule, s in stats.items():
        t, p = s["torch"], s["piper"]
        summary[schedule] = {
            "torch_tps": median(t["tps"]), "piper_tps": median(p["tps"]),
            "ratio": median(p["tps"]) / median(t["tps"]),
            "cycle_ratio": median(s["cycles"]) if s["cycles"] else None, "cycles": len(s["cycles"]),
            "run_ratios": list(s["runs"]), "run_ratio": median(s["runs"]),
            "loss": s["loss"],
            "torch_mem": {k: median(v) for k, v in t["mem"].items()},
            "piper_mem": {k: median(v) for k, v in p["mem"].items()},
        }
    return summary


def _report(args, parser, extra, stats, summary) -> str:
    memory = ("peak RSS of the rank process (VmHWM, reset after every step)" if on_cpu()
              else "CUDA max reserved memory")
    rows = []
    for schedule, s in stats.items():
        for engine in ENGINES:
            e = s[engine]
            rows.append([schedule, engine, f"{median(e['tps']):.0f}", len(e["tps"]), _mem_cells(e["mem"])])
    ratios = []
    for schedule, x in summary.items():
        cycle = f"{x['cycle_ratio']:.3f} ({x['cycles']})" if x["cycle_ratio"] is not None else "n/a"
        mem = " / ".join(f"{(x['piper_mem'].get(k, 0) - x['torch_mem'].get(k, 0)) / 2 ** 20:+.0f}"
                         for k in sorted(x["torch_mem"]))
        s = stats[schedule]
        runs = " ".join(f"{r:.3f}" for r in x["run_ratios"])
        ahead = sum(r >= 1.0 for r in x["run_ratios"])
        ratios.append([schedule, f"**{x['ratio']:.3f}**", f"**{x['run_ratio']:.3f}** ({runs}; {ahead} of "
                       f"{len(x['run_ratios'])} at or above 1)", cycle, mem, f"{x['loss']:.5f}", f"{median(s['wall']):.1f}",
                       f"{median(s['load']):.2f}" if s["load"] else "n/a"])
    layout = "pp2_tp2_" if args.tp == 2 else "pp2_"
    run_cmd = shlex.join(titan_command(f"{args.model}_{layout}<schedule>", "alternate", nproc=2 * args.tp,
                                       steps=args.steps, extra=extra))
    ranks = "4 ranks: pipeline 2 x tensor parallel 2, on 2 cores" if args.tp == 2 else "2 ranks"
    ranks_note = ("4 ranks share 2 cores: a rank waiting on a message lends its core to another, so the ratio shows "
                  "engine overhead under that sharing, not what a pipeline schedule gains on a machine with a core per "
                  "rank. " if args.tp == 2 else "")
    return "\n".join([
        f"# Piper vs TorchTitan's pipelining ({args.model}, torchtitan.train, {ranks})", "",
        f"Command: `{command_line('torchtitan_ab', args, parser)}`", "",
        f"Each run: `{run_cmd}` (schedule suffixes: "
        f"{', '.join(f'{k} -> {v}' for k, v in SCHEDULE_CONFIG.items())})", "",
        f"{args.rounds} run(s) per schedule; in each the two engines alternate step by step over the same stages "
        f"(torch, piper, piper, torch, ...); the first {args.warmup} steps are dropped. "
        f"tokens/s: TorchTitan's `tps` (per device), mean over ranks per step, median over an engine's measured "
        f"steps. Per-run ratios: the same within each run, and their median (runs at different machine speeds are "
        f"not pooled). Cycle ratio: median over complete torch-piper-piper-torch cycles of piper / torch tokens/s (number of "
        f"cycles in brackets). Peak memory: {memory}, max over an engine's measured steps, median over runs, "
        f"rank 0 / rank 1{' / ...' if args.tp == 2 else ''}. Other load: cores kept busy by other processes during "
        f"the runs (median over runs). {ranks_note}", "",
        markdown_table(["schedule", "engine", "median tokens/s", "steps measured", "peak MiB per rank"], rows),
        "",
        markdown_table(["schedule", "piper / torch tokens/s", "median of per-run ratios (each run)", "cycle ratio", "piper - torch peak MiB per rank",
                        f"loss at step {args.steps} (run 0)", "median wall s / run", "other load (cores)"], ratios),
        "", machine_line("started by torchrun"), "",
    ])


if __name__ == "__main__":
    main()
