"""The CUDA path on this machine's GPUs, in one run: what a session lent a GPU executes.

Sections (each prints its figures and whether its goal holds; the exit code is 1 if one fails):

1. *streams*: one rank, the zero-bubble recipe with every weight-gradient chunk on a logical
   stream of its own, so the rank runs two CUDA streams joined by events wherever a dependency
   crosses them; and a one-rank 1F1B plan, whose step time (in a run of its own, without the
   parity check's host copies) is also set against a plain PyTorch step (same microbatches,
   gradient accumulation). Loss per step, last gradients and
   final parameters against single-device fp32 training on the CPU (goal: relative error <
   ``--tol``).
   The last step's measured timeline (device time on a GPU: timing events around each task
   on its CUDA stream) gives the bubble next to the simulator's (at the step's own task times
   and at unit costs); the compute tasks of one
   stream must not overlap in it and every task must lie within the step's span.
2. *memory*: that run's transient peak per step (the CUDA allocator's peak above what was
   allocated when the step began and the gradients the step makes) against the simulator's
   (goal: within 10%); the allocator's whole peak against the simulator's too (it also holds
   library workspaces the simulator does not know).
3. *nccl* (one GPU per rank: NCCL refuses two ranks on one GPU): 1F1B and DualPipeV on two ranks
   and ZeRO-3 on two data-parallel ranks against single-device training, with each rank's
   transient peak against the simulator's; then the ZeRO-3 plan with its gathers and
   reduce-scatters on their own stream against the same plan on one stream, alternating
   (goal: the streamed plan is faster).

``--device cpu`` runs every section on gloo with the same code (the test suite's smoke run).

    python -m benchmarks.cuda_check                  # writes benchmarks/results/cuda_check.md

On a lent GPU machine (its own torch, no installs; about a minute on one GPU), the two links
stand in for ``pip install -e .``'s mapping of ``recipes/`` and ``adapters/`` into the package:
``ln -sfn ../recipes piper_plugin/recipes && ln -sfn ../adapters piper_plugin/adapters &&
PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.cuda_check --out $OUT/cuda_check.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # fp32 matmuls in every rank (the fork server inherits it)

import torch

import piper_plugin as piper
from benchmarks._common import (
    code_version, command_line, lm_config, lm_job, markdown_table, piper_timed_body, run_piper, slowest_rank_times,
    write_result,
)
from benchmarks.parity_oracle import single_device_errors
from piper_plugin import Schedule, measured_costs, measured_result, simulate
from piper_plugin.recipes import apply_recipe

__all__ = ["main", "build_parser", "piper_step_ms", "plain_step_ms"]

SIZES = {  # toy LM shapes: "gpu" makes activations dwarf the allocator's rounding and workspaces
    "small": dict(dim=32, layers=4, heads=2, ffn=64, seq=16, vocab=64),
    "gpu": dict(dim=512, layers=4, heads=8, ffn=2048, seq=256, vocab=4096),
}
NCCL_CASES = {  # name: (recipe, pp, dp, zero)
    "1f1b-pp2": ("1f1b", 2, 1, 0),
    "dualpipev-pp2": ("dualpipev", 2, 1, 0),
    "zero3-dp2": ("1f1b", 1, 2, 3),
}
MEMORY_GOAL = 0.10


def _schedule(program, *, recipe: str, pp: int, dp: int, zero: int, microbatches: int,
              wgrad_stream: bool = False, one_stream: bool = False) -> Schedule:
    sch = apply_recipe(Schedule(program, pp=pp, dp=dp), recipe, microbatches=microbatches, zero=zero)
    if wgrad_stream:
        sch.stream("kind=BW", "wgrad")
    if one_stream:
        sch.stream("*", "compute")
    return sch


def _job(args, *, recipe: str, pp: int, dp: int = 1, zero: int = 0, **extra):
    cfg = lm_config(**SIZES[args.size])
    job = lm_job(cfg, recipe=recipe, pp=pp, microbatches=args.microbatches, batch=args.batch * dp)
    job.schedule_fn = functools.partial(_schedule, recipe=recipe, pp=pp, dp=dp, zero=zero,
                                        microbatches=args.microbatches, **extra)
    job.steps, job.device, job.capture_grads, job.timeout_s = args.steps, args.device, True, args.timeout
    return job


def _train(job) -> dict[str, Any]:
    """Run ``job`` on forked ranks (Piper's fork launcher); its parity and memory figures."""
    result = piper.run(job, launcher="fork")
    metrics, per_rank, plan, simulated = result.metrics, result.per_rank, result.plan, result.simulated
    errors = single_device_errors(job, metrics, per_rank)
    later = [m for m in metrics if m["step"] >= min(2, job.steps - 1)]  # replayed / warm steps
    memory = []
    for rank in range(plan.grid.world_size):
        mine = [m for m in later if m["rank"] == rank]
        memory.append((rank, statistics.median(m["transient_peak_bytes"] for m in mine),
                       simulated.peak_transient_bytes[rank], statistics.median(m["peak_memory_bytes"] for m in mine),
                       simulated.per_rank_peak[rank]))
    streams = sorted({s for rp in plan.ranks for s in rp.streams})
    timelines = {r: out["timeline"] for r, out in per_rank.items()}
    last_step_s = max(m["step_time_s"] for m in metrics if m["step"] == job.steps - 1)
    return {"errors": errors, "memory": memory, "streams": streams,
            "step_ms": statistics.median(m["step_time_s"] for m in later) * 1e3,
            "bubble": _bubbles(plan, timelines, simulated),
            "timeline_faults": _timeline_faults(plan, timelines, last_step_s),
            # the plan's regions are the captured program's
            "backward_working": max(r.backward.full.at(1 / plan.microbatches) for r in plan.dag.regions.values())}


def _bubbles(plan, timelines: dict[int, list], simulated) -> tuple[float, float, float]:
    """Last step's bubble: measured, simulated at its own task times, simulated at unit costs."""
    measured = measured_result(plan, timelines)
    return (measured.bubble_fraction, simulate(plan, measured_costs(plan, measured)).bubble_fraction,
            simulated.bubble_fraction)


def _timeline_faults(plan, timelines: dict[int, list], step_s: float) -> list[str]:
    """What is wrong with a measured last step: compute tasks of one stream that overlap (a
    stream runs one task at a time; on a GPU that says the timing events sit on the wrong
    stream) or a rank's span longer than its slowest rank's step (1% slack)."""
    faults = []
    for rank, timeline in sorted(timelines.items()):
        by_stream: dict[str, list[tuple[float, float, str]]] = {}
        for stream, key, start, end in timeline:
            if end < start:
                faults.append(f"rank {rank} {key} ends before it starts")
            if plan.node(key).is_compute:
                by_stream.setdefault(stream, []).append((start, end, key))
        for stream, spans in by_stream.items():
            spans.sort()
            for (_, end, key), (start, _, nxt) in zip(spans, spans[1:]):
                if start < end - 1e-6:
                    faults.append(f"rank {rank} {stream}: {nxt} starts {(end - start) * 1e3:.3f} ms before {key} ends")
        span = max(e for *_, e in timeline) - min(s for _, _, s, _ in timeline)
        if span > step_s * 1.01:
            faults.append(f"rank {rank}: timeline spans {span * 1e3:.1f} ms, the step took {step_s * 1e3:.1f} ms")
    return faults


def piper_step_ms(job) -> float:
    """Median step time of ``job`` on forked ranks without the parity snapshots (host copies
    of every gradient and parameter, which ``_train`` takes for the parity check)."""
    job = dataclasses.replace(job, capture_grads=False)
    warmup = min(2, job.steps - 1)
    out = run_piper(job, job.compile(), piper_timed_body(warmup=warmup, steps=job.steps - warmup))
    return statistics.median(slowest_rank_times(out)) * 1e3


def plain_step_ms(job, microbatches: int) -> float:
    """Median step time of the same model trained the plain way on one device: gradients
    accumulated over the same microbatches, then the optimizer (one torch thread, as a rank)."""
    device = torch.device("cuda", 0) if job.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = job.build_model().to(device)
        optimizer = job.optimizer_fn(list(model.parameters()))
        data, times = job.data_fn(job.seed), []
        for _ in range(job.steps):
            batch = [t.to(device) for t in next(data)]
            sync()
            start = time.perf_counter()
            for *inputs, target in zip(*(t.chunk(microbatches) for t in batch)):
                job.loss_fn(model(*inputs), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[min(2, len(times) - 1):]) * 1e3


def _backward_working_mib(job, microbatches: int) -> float:
    """On a GPU: the allocator's peak during one microbatch's backward above its start, plain
    PyTorch, gradients already allocated (a second pass): the working memory of a backward,
    set against the size probe's figure the simulator charges (``Region.backward``)."""
    device = torch.device("cuda", 0)
    model = job.build_model().to(device)
    tokens, target = (t.to(device) for t in next(job.data_fn(job.seed)))
    x, y = tokens.chunk(microbatches)[0], target.chunk(microbatches)[0]
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        loss = job.loss_fn(model(x), y)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, loss
    return peak / 2**20


def _overlap(args) -> tuple[list[float], list[float]]:
    """Slowest-rank step times of the ZeRO-3 plan with its own comm stream, and on one stream."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for one_stream in (False, True):
            job = _job(args, recipe="1f1b", pp=1, dp=2, zero=3, one_stream=one_stream)
            job.capture_grads = False
            out = run_piper(job, job.compile(), piper_timed_body(warmup=1, steps=args.steps - 1))
            times[one_stream] += slowest_rank_times(out)
    return times[False], times[True]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _deviation(measured: float, simulated: float) -> float:
    return measured / simulated - 1 if simulated else float("inf")


def _memory_rows(case: str, memory) -> tuple[list[list[Any]], bool]:
    """Table rows; the goal is on the transient part (activations and what comes and goes)."""
    rows, ok = [], True
    for rank, transient, sim_transient, total, sim_total in memory:
        dev = _deviation(transient, sim_transient)
        ok &= abs(dev) <= MEMORY_GOAL
        rows.append([case, rank, _mib(transient), _mib(sim_transient), f"{dev:+.1%}", _mib(total), _mib(sim_total),
                     f"{_deviation(total, sim_total):+.1%}"])
    return rows, ok


def _environment(device: str) -> tuple[str, int]:
    if device == "cpu":
        return f"torch {torch.__version__}, CPU only (gloo); {code_version()}", 2
    count = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {count} x {names}; "
            f"{code_version()}"), count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cuda_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), help="toy LM shapes (default: gpu on cuda, small on cpu)")
    p.add_argument("--steps", type=int, default=6, help="steps per run (figures from step 3 on)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="global batch per data-parallel replica")
    p.add_argument("--cases", nargs="*", choices=sorted(NCCL_CASES), default=sorted(NCCL_CASES),
                   help="multi-rank cases of the nccl section")
    p.add_argument("--rounds", type=int, default=3, help="overlap A/B rounds (each runs both plans; 0: none)")
    p.add_argument("--tol", type=float, help="parity goal (default: 1e-4 on cuda, 1e-5 on cpu)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, help="result file (default: benchmarks/results/cuda_check.md)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.size = args.size or ("gpu" if args.device == "cuda" else "small")
    args.tol = args.tol or (1e-4 if args.device == "cuda" else 1e-5)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here; use --device cpu")
    if args.steps < 2 or args.rounds < 0:
        parser.error("--steps must be at least 2 (the first is a warm-up) and --rounds at least 0")
    env, ranks_available = _environment(args.device)
    verdicts: dict[str, bool] = {}
    parity_rows, memory_rows = [], []

    def record(case: str, result: dict[str, Any]) -> None:
        e = result["errors"]
        verdicts[f"parity {case}"] = e.worst() < args.tol
        bubbles = " / ".join(f"{b:.1%}" for b in result["bubble"])
        parity_rows.append([case, " + ".join(result["streams"]), f"{e.loss:.1e}", f"{e.grad:.1e}", f"{e.param:.1e}",
                            f"{result['step_ms']:.1f}", bubbles])
        verdicts[f"timeline {case}"] = not result["timeline_faults"]
        for fault in result["timeline_faults"][:5]:
            print(f"{case}: timeline: {fault}", flush=True)
        rows, ok = _memory_rows(case, result["memory"])
        verdicts[f"memory {case}"] = ok
        memory_rows.extend(rows)
        print(f"{case}: worst error {e.worst():.1e}, memory {'within' if ok else 'outside'} 10%", flush=True)

    record("zb-h1 1 rank, BW stream", _train(_job(args, recipe="zb-h1", pp=1, wgrad_stream=True)))
    one_rank = _job(args, recipe="1f1b", pp=1)
    trained = _train(one_rank)
    record("1f1b 1 rank", trained)
    piper_ms = piper_step_ms(one_rank)
    plain_ms = plain_step_ms(one_rank, args.microbatches)
    probed = trained["backward_working"]
    working = (f"Backward working memory of one microbatch (the largest region's): size probe on fake tensors, "
               f"as the simulator charges it, {probed / 2**20:.2f} MiB")
    if args.device == "cuda":
        working += (f"; plain PyTorch on the GPU (allocator peak during the backward above its start, "
                    f"gradients already allocated) {_backward_working_mib(one_rank, args.microbatches):.1f} MiB")
        torch.cuda.empty_cache()  # this process's copies go before the ranks of later runs start
    print(working, flush=True)
    runtime = (f"One rank, 1F1B over {args.microbatches} microbatches: Piper's step / a plain PyTorch step "
               f"(same model, microbatches and optimizer): {piper_ms / plain_ms:.3f} "
               f"({piper_ms:.1f} vs {plain_ms:.1f} ms, medians from step 3 on; Piper timed in a run of its own, "
               f"without the parity check's host copies)")
    print(runtime, flush=True)
    if ranks_available >= 2:
        for case in args.cases:
            recipe, pp, dp, zero = NCCL_CASES[case]
            record(case, _train(_job(args, recipe=recipe, pp=pp, dp=dp, zero=zero)))
    if ranks_available >= 2 and args.rounds > 0:
        streamed, single = _overlap(args)
        ratio = statistics.median(streamed) / statistics.median(single)
        verdicts["overlap"] = ratio < 1.0
        overlap = (f"ZeRO-3, dp=2: own comm stream / one stream, median slowest-rank step time "
                   f"{ratio:.3f} ({len(streamed)} steps each, alternating runs; best {min(streamed) / min(single):.3f})")
        print(overlap, flush=True)
    elif ranks_available < 2:
        overlap = (f"Multi-rank section not run: {ranks_available} GPU here and NCCL needs one GPU per rank "
                   f"(it refuses two ranks on one device).")
        print(overlap, flush=True)
    else:
        overlap = "Not run (--rounds 0)."

    backend = "NCCL" if args.device == "cuda" else "gloo"
    timeline_kind = ("device time: timing events around each task on its CUDA stream" if args.device == "cuda"
                     else "host time")
    text = "\n\n".join([
        "# CUDA path check", env, f"Command: `{command_line('cuda_check', args, parser)}`",
        f"## Parity with single-device fp32 training on the CPU ({backend} between ranks; goal < {args.tol:g})",
        markdown_table(["case", "logical streams", "loss", "gradients", "parameters", "median step ms",
                        "bubble, last step: measured / simulated at its task times / at unit costs"], parity_rows),
        f"Measured bubble: 1 - compute / step span of the last step's timeline ({timeline_kind}), mean over "
        "ranks. Simulated at its task times: each chunk kind and region takes its mean measured time; at unit "
        "costs: F=1 B=2 W=1. Both with free communication.",
        "## Peak memory per step, MiB: measured (allocator on a GPU; kept state plus the meter on a CPU) vs "
        "simulated. Transient: above the parameters, gradients and optimizer state the rank keeps (goal within "
        f"{MEMORY_GOAL:.0%}); total: all of it",
        markdown_table(["case", "rank", "transient", "simulated", "deviation", "total", "simulated", "deviation"],
                       memory_rows),
        working,
        "## Runtime cost on one rank", runtime,
        "## Overlap", overlap,
        "## Verdicts", "\n".join(f"- {name}: {'holds' if ok else 'FAILS'}" for name, ok in verdicts.items()),
    ]) + "\n"
    path = write_result(args.out, "cuda_check.md", text)
    print(f"wrote {path}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
