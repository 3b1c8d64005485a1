"""Expert parallelism over an emulated link: does DualPipeV hide the all-to-all?

On this machine gloo messages cost CPU, so compute and communication compete for the same cores.
Here every message costs wire time instead: the benchmark re-runs itself inside a private network
namespace (``unshare -n``, loopback up) whose loopback is rate-limited by a ``tc ... tbf`` qdisc
(``--rate``; every rank, the rendezvous and every collective share that one link). In that
namespace, side by side in one job, real ``torchtitan.train`` runs of the deepseek_v3 debug MoE
(pp 2 x data_parallel_shard_degree 2 x expert_parallel_degree 2, 4 ranks): Piper's DualPipeV,
1F1B and Interleaved1F1B (ZeRO-2 for the dense part; the expert all-to-alls as the plan's
ALL_TO_ALL nodes) and TorchTitan's own DualPipeV and 1F1B (FSDP, reshard ``never``), same
seed, data and flags (``--balanced-v``: DualPipeV on a stage split that balances the MoE layers
over the V's rank pairs, for both engines). Per cell: TorchTitan's logged tokens/s (median over the steps after
``--warmup``, mean over ranks), its ratio to Piper 1F1B; for Piper's cells, from the measured
trace of the last step (``--piper.trace``): the measured bubble (1 - compute / step span, mean
over ranks), the bubble the simulator gives the same plan at the measured task times with the
link's bandwidth for messages (sizes as the plan estimates them), and the share of overlap
block members' all-to-all time that ran under the other member's compute, and the all-to-alls' time
as a share of the step (mean over ranks; an exchange's time includes waiting for its peer). Measured and
simulated timelines of each Piper cell are written as PNGs next to the results file.

    python -m benchmarks.ep_overlap --out benchmarks/results/ep_overlap.md

4 ranks on 2 cores: a rank that waits lends its core to another, so these figures are limited
by the core count; no 2-rank cell has both a pipeline and an expert group (EP needs the shard
degree), so there is no 2-rank comparison of these schedules.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from piper_plugin import (
    block_overlap, inside_link, link_bits_per_second, measured_costs, measured_result, run_in_emulated_link, simulate,
    write_trace,
)
from piper_plugin.adapters.torchtitan import run_titan

from benchmarks._common import code_version, command_line, markdown_table, write_result
from benchmarks.ep_parity import CONFIG, cell_flags

CELLS = (("piper", "DualPipeV"), ("piper", "1F1B"), ("piper", "Interleaved1F1B"), ("torch", "DualPipeV"),
         ("torch", "1F1B"))


def enter_link(rate: str, argv: Sequence[str]) -> int:
    """Re-run this benchmark inside a new network namespace whose loopback is ``rate``."""
    try:
        return run_in_emulated_link(rate, [sys.executable, "-m", "benchmarks.ep_overlap", *argv],
                                    cwd=Path(__file__).resolve().parents[1])
    except RuntimeError as exc:
        raise SystemExit(f"piper: error: {exc}") from None


def bits_per_second(rate: str) -> float:
    try:
        return link_bits_per_second(rate)
    except ValueError as exc:
        raise SystemExit(f"piper: error: --rate: {exc}") from None


# DualPipeV's V puts stages 0 and 3 on one rank pair, 1 and 2 on the other. TorchTitan's split, which
# counts the embeddings and the head as a layer each, gives the pairs [embeddings, 0] + [5, head] and
# [1, 2] + [3, 4]: one MoE layer against four. Counting neither (its two flags below) gives
# [embeddings, 0, 1] + [5, head] and [2, 3] + [4]: two against three, as 1F1B's and Interleaved1F1B's
# splits give their ranks.
BALANCED_V = ["--parallelism.pipeline_parallel_first_stage_less_layers", "0",
              "--parallelism.pipeline_parallel_last_stage_less_layers", "0"]


def run_cell(engine: str, schedule: str, args, folder: Path) -> dict:
    trace = folder / f"{engine}-{schedule}-trace"
    extra = [*cell_flags(schedule, args.seq_len)]
    if schedule == "DualPipeV" and args.balanced_v:
        extra += BALANCED_V
    if engine == "piper":
        extra += ["--piper.zero", str(args.zero), "--piper.trace", str(trace)]
    run = run_titan(CONFIG, engine, dump_folder=folder / f"{engine}-{schedule}", nproc=4, steps=args.steps,
                    extra=[*extra, "activation-checkpoint:none"], timeout_s=args.timeout)
    if not run.ok:
        raise SystemExit(f"piper: error: {engine} {schedule} failed (exit {run.returncode}):\n{run.tail(40)}")
    steps = [s for s in sorted(run.tps) if s > args.warmup]
    row = {"engine": engine, "schedule": schedule, "losses": run.losses,
           "tps": statistics.median(statistics.fmean(run.tps[s]) for s in steps)}
    if engine == "piper":
        row.update(_trace_figures(trace, bits_per_second(args.rate), args, f"{engine}-{schedule}"))
    return row


def _trace_figures(trace: Path, link_bits: float, args, name: str) -> dict:
    """Measured and simulated bubble, and the exchange time hidden in overlap blocks, of the last step."""
    with open(trace / "plan.pkl", "rb") as f:
        plan = pickle.load(f)
    ranks = [json.loads(p.read_text()) for p in sorted(trace.glob("rank*.json"))]
    timelines = {r["plan_rank"]: [tuple(e) for e in r["timeline"]] for r in ranks}
    measured = measured_result(plan, timelines)
    cost = measured_costs(plan, measured)
    cost.seconds_per_byte = 8 / link_bits
    simulated = simulate(plan, cost)
    members = [m for r in ranks for block in block_overlap(r["blocks"], r["timeline"]) for m in block]
    exchanges = [sum(e - s for _, key, s, e in r["timeline"] if "ALL_TO_ALL" in key) for r in ranks]
    comm = sum(m["comm_s"] for m in members)
    results = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "ep_overlap.md"
    out = results.parent
    pictures = write_trace(out / f"{results.stem}_{name}", plan, measured, simulated, name, simulated_in_seconds=True)
    cores = os.cpu_count() or 1
    return {"measured_bubble": measured.bubble_fraction, "simulated_bubble": simulated.bubble_fraction,
            # ranks computing at once, on average over the step, per core: near 1 the cores are full,
            # and no schedule shortens the step by more than its inverse
            "cores_busy": sum(measured.busy) / measured.step_time / cores,
            "measured_step": measured.step_time, "simulated_step": simulated.step_time,
            "hidden": sum(m["hidden_s"] for m in members) / comm if comm else None,
            "exchange_share": statistics.fmean(exchanges) / measured.step_time,
            "pictures": [str(p.relative_to(out)) for p in pictures[1:]]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep_overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="the loopback's bandwidth, as tc writes it")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--zero", type=int, default=1, choices=[1, 2],
                        help="Piper's ZeRO level for the dense part (1 reduces once per step, as FSDP with "
                             "reshard never does; 2 reduce-scatters per microbatch)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the tokens/s median")
    parser.add_argument("--balanced-v", action="store_true",
                        help="DualPipeV (both engines) on a stage split that gives each rank pair 2-3 MoE layers "
                             "instead of TorchTitan's even split (1 and 4)")
    parser.add_argument("--cells", nargs="+", default=[f"{e}:{s}" for e, s in CELLS],
                        choices=[f"{e}:{s}" for e, s in CELLS], help="engine:schedule, Piper 1F1B included")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    bits_per_second(args.rate)
    if inside_link() != args.rate:
        raise SystemExit(enter_link(args.rate, argv))
    version = code_version()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ep_overlap_") as tmp:
        for engine, schedule in (cell.split(":") for cell in args.cells):
            rows.append(run_cell(engine, schedule, args, Path(tmp)))
            print(f"{engine} {schedule}: {rows[-1]['tps']:.0f} tokens/s", flush=True)
    base = next((r["tps"] for r in rows if (r["engine"], r["schedule"]) == ("piper", "1F1B")), float("nan"))
    pct = lambda x: "" if x is None else f"{x:.0%}"  # noqa: E731
    table = markdown_table(
        ["engine", "schedule", "tokens/s", "vs Piper 1F1B", "bubble measured", "bubble simulated",
         "all-to-all time / step", "all-to-all under the paired compute", "cores computing"],
        [[r["engine"], r["schedule"], f"{r['tps']:.0f}", f"{r['tps'] / base:.2f}x", pct(r.get("measured_bubble")),
          pct(r.get("simulated_bubble")), pct(r.get("exchange_share")), pct(r.get("hidden")),
          pct(r.get("cores_busy"))] for r in rows])
    pictures = "\n".join(f"- {r['engine']} {r['schedule']}: " + ", ".join(f"[{Path(p).name}]({p})" for p in r["pictures"])
                         for r in rows if "pictures" in r)
    path = write_result(args.out, "ep_overlap.md", (
        f"# Expert parallelism over an emulated {args.rate} link: Piper's schedules and TorchTitan's\n\n"
        f"Command: `{command_line('ep_overlap', args, parser)}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, gloo over a "
        f"loopback limited to {args.rate} (tc tbf, burst 32kb, queue up to 2 s, MTU 9000, in a private network "
        f"namespace), 4 ranks started by "
        f"torchrun with 1 torch thread each; {version}\n\n"
        f"{CONFIG}, pp 2 x data_parallel_shard_degree 2 x expert_parallel_degree 2, {args.seq_len} tokens per "
        f"microbatch, 4 microbatches"
        f"{', DualPipeV with ' + ' '.join(BALANCED_V) + ' (stages [embeddings, 0, 1], [2, 3], [4], [5, head])' if args.balanced_v else ''}, {args.steps} steps (tokens/s: median of steps {args.warmup + 1}-{args.steps} "
        f"as TorchTitan logs them, mean over ranks). Bubbles and the all-to-all share are of the last step's measured "
        f"trace; the simulation runs the same plan at the measured task times with messages at {args.rate} (their "
        f"sizes as the plan estimates them). 4 ranks share {os.cpu_count()} cores: every figure here is limited by "
        f"the core count; 'cores computing' is the ranks' summed compute time over the step span per core (the "
        f"last step's trace): near 100% the cores are full and no schedule shortens the step by more than its "
        f"inverse.\n\n"
        f"{table}\n\nTimelines (measured, simulated):\n{pictures}\n"))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
