"""Per-task overhead of Piper's executor: plans whose chunks do (almost) nothing.

The model is a chain of ``nn.Linear(1, 1)`` (+ReLU) stages (``toy_sequential`` with width 1),
one row per microbatch, so a chunk's compute is a few microseconds and a step's time is
almost all runtime: picking the next task, waiting for cross-stream dependencies, moving
values between inboxes, saved-tensor bookkeeping, P2P over gloo and the stream threads.

Per configuration, on the slowest rank (tasks: every task of the rank's plan, compute and
communication):

* ``step``: median step time (all ranks start each step from a barrier);
* ``in handlers``: summed time of the compute tasks measured around ``execute`` (the
  chunk itself plus its handler: inbox, autograd, delivery);
* ``bare chunks``: the same chunk calls with nothing around them: each local region's
  forward then its backward (``torch.autograd.backward``), once per microbatch, and one
  AdamW step per region, timed in the rank after the run;
* overhead per task = ``(step - bare chunks) / tasks`` (goal: < 100 us on CPU) for the median
  and the best step, and the executor's own share ``(step - in handlers) / tasks``;
* CPU overhead per task = ``(CPU time of the rank's process in a step, every thread - bare
  chunks) / tasks``, median step: the work the runtime adds per task, without the time a rank
  only waits for a message (with two ranks and empty chunks, that wait is most of a step);
* for reference, the same job (weights, batches, stages, schedule) run by
  ``torch.distributed.pipelining``, and the gloo round-trip latency between two local ranks
  (with two ranks, a tiny step is a chain of P2P messages: latency, not compute).

    python -m benchmarks.task_overhead
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks._common import (
    ForeignLoad, code_version, command_line, machine_line, markdown_table, median, run_ranks, slowest_rank_times,
    torch_pipeline_rank, wait_for_quiet, write_result,
)
from piper_plugin.api.annotate import module_tags
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.nodes import COMPUTE
from piper_plugin.models import mse_loss, toy_sequential
from piper_plugin.recipes import apply_recipe
from piper_plugin.runtime.job import Job, compile_job
from piper_plugin.runtime.launch.processes import run_forked

__all__ = ["main", "build_parser", "CONFIGS"]

# name -> (recipe, pp, stages per rank)
CONFIGS: dict[str, tuple[str, int, int]] = {
    "1 rank, 8 stages (no comm)": ("interleaved-1f1b", 1, 8),
    "2 ranks, 1f1b, 1 stage/rank": ("1f1b", 2, 1),
    "2 ranks, interleaved, 4 stages/rank": ("interleaved-1f1b", 2, 4),
}


class _Rows:
    """Seeded ``(x, y)`` batches of width 1, one row per microbatch."""

    def __init__(self, rows: int, seed: int):
        self.rows = rows
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> "_Rows":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(self.rows, 1, generator=self.generator), torch.randn(self.rows, 1, generator=self.generator)


def _data(rows: int, seed: int) -> _Rows:
    return _Rows(rows, seed)


def _model(stages: int) -> nn.Module:
    return toy_sequential((1,) * (stages + 1), stages=stages)


def _schedule(program, *, recipe: str, pp: int, microbatches: int, chunks: int) -> Schedule:
    return apply_recipe(Schedule(program, pp=pp), recipe, microbatches=microbatches, chunks=chunks)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def tiny_job(recipe: str, pp: int, per_rank: int, microbatches: int, seed: int = 0) -> Job:
    stages = pp * per_rank
    return Job(model_fn=functools.partial(_model, stages), loss_fn=mse_loss,
               data_fn=functools.partial(_data, microbatches),
               schedule_fn=functools.partial(_schedule, recipe=recipe, pp=pp, microbatches=microbatches,
                                             chunks=per_rank),
               optimizer_fn=_adamw, steps=0, seed=seed, timeout_s=120.0)


TORCH_SCHEDULES = {"1f1b": ("Schedule1F1B", "loop"), "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop")}


def sequential_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """The modules of ``toy_sequential`` tagged ``PP=stage`` (the region Piper cuts)."""
    return nn.Sequential(*[m for m in model if module_tags(m).get("PP") == stage])


def _gloo_round_trip(rank: int, world: int, n: int = 1000) -> tuple[float, float]:
    """Seconds per 1-float send + recv round trip between ranks 0 and 1: wall, and the CPU time
    this rank's process (every thread) spent on it."""
    t = torch.zeros(1)
    for i in range(n + 100):
        if i == 100:
            start, start_cpu = time.perf_counter(), time.process_time()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    return (time.perf_counter() - start) / n, (time.process_time() - start_cpu) / n


def _bare(worker, repeats: int) -> float:
    """Seconds for this rank's chunk calls with no runtime around them (one step's worth)."""
    state, m = worker.state, worker.plan.microbatches
    shapes = worker.plan.dag.meta["value_shapes"]
    values: dict[str, torch.Tensor] = {}
    for name in state.input_names:
        values[name] = state.inputs[name][0]

    def arg(v: str) -> torch.Tensor:
        if v in values:
            return values[v]
        shape = (1,) + tuple(shapes[v][1:])  # one row: a microbatch here
        return torch.randn(shape).requires_grad_(True)

    args = {r: [arg(v) for v in state.dag.regions[r].inputs] for r in state.regions}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(m):
            for r in state.regions:
                outs = state.chunks[r](*args[r])
                roots = [t for t in outs if t.requires_grad]
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        for optimizer in state.optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best


def _timed(worker, warmup: int, steps: int) -> dict[str, Any]:
    nodes = worker.plan.dag.nodes
    times, handlers, cpu = [], [], []
    for _ in range(warmup + steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        worker.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        handlers.append(sum(end - begin for _, key, begin, end in worker.runner.timeline
                            if nodes[key].kind in COMPUTE))
    kinds: dict[str, int] = {}
    for _, key, _, _ in worker.runner.timeline:
        kinds[nodes[key].kind.value] = kinds.get(nodes[key].kind.value, 0) + 1
    return {"times": times[warmup:], "handlers": handlers[warmup:], "cpu": cpu[warmup:],
            "tasks": len(worker.runner.timeline), "kinds": kinds, "bare": _bare(worker, 5), "cpu_total": time.process_time()}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    recipe, pp, per_rank = CONFIGS[name]
    job = tiny_job(recipe, pp, per_rank, args.microbatches, args.seed)
    program, _, plan, _ = compile_job(job)
    if args.quiet_wait > 0:
        wait_for_quiet(args.quiet_wait)
    with ForeignLoad() as load:
        per_rank_results = run_forked(job, program, plan, body=functools.partial(
            _timed, warmup=args.warmup, steps=args.steps))
        load.add_own(per_rank_results)
    steps = slowest_rank_times(per_rank_results)
    step, best = median(steps), min(steps)
    torch_steps = _torch_steps(job, recipe, pp, per_rank, args)
    worst = max(per_rank_results.values(), key=lambda r: (step - r["bare"]) / r["tasks"])
    tasks = worst["tasks"]
    best_handlers = worst["handlers"][steps.index(best)]  # the slowest rank's, in the best step
    return {"config": name, "load": load.cores, "microbatches": args.microbatches,
            "tasks": tasks, "kinds": worst["kinds"], "step": step, "best": best, "in_handlers": best_handlers,
            "bare": worst["bare"], "overhead": (step - worst["bare"]) / tasks,
            "overhead_best": (best - worst["bare"]) / tasks, "executor_best": (best - best_handlers) / tasks,
            "cpu_overhead": max((median(r["cpu"]) - r["bare"]) / r["tasks"] for r in per_rank_results.values()),
            "torch_step": median(torch_steps), "torch_best": min(torch_steps)}


def _torch_steps(job: Job, recipe: str, pp: int, per_rank: int, args: argparse.Namespace) -> list[float]:
    if args.quiet_wait > 0:
        wait_for_quiet(args.quiet_wait)
    schedule, layout = TORCH_SCHEDULES[recipe]
    torch_fn = functools.partial(torch_pipeline_rank, job=job, stage_module=sequential_stage, schedule=schedule,
                                 layout=layout, num_stages=pp * per_rank, microbatches=args.microbatches,
                                 warmup=args.warmup, steps=args.steps)
    return slowest_rank_times(run_ranks(pp, torch_fn, timeout_s=job.timeout_s))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.task_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="CONFIG",
                   help=f"any of: {', '.join(repr(c) for c in CONFIGS)}")
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for other processes to go quiet (0: never)")
    p.add_argument("--round-trips", type=int, default=3, help="gloo ping-pong runs (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/task_overhead.md)")
    return p


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    code_version()  # the engine as imported now, before any rank forks
    command = command_line("task_overhead", args, parser)
    print(command, flush=True)
    rows = [measure(name, args) for name in args.configs]
    trips = [run_ranks(2, _gloo_round_trip)[0] for _ in range(args.round_trips)]
    round_trip, round_trip_cpu = median([w for w, _ in trips]), median([c for _, c in trips])
    table = markdown_table(
        ["configuration", "tasks/rank", "task kinds", "step ms: median / best",
         "in handlers ms (best step)", "bare chunks ms", "overhead/task us: median / best step",
         "executor/task us (best step)", "CPU overhead/task us (median step, busiest rank)", "torch.pipelining step ms: median / best", "other load, cores"],
        [[r["config"], r["tasks"], " ".join(f"{k}:{v}" for k, v in sorted(r["kinds"].items())),
          f"{_ms(r['step'])} / {_ms(r['best'])}", _ms(r["in_handlers"]), _ms(r["bare"]),
          f"**{_us(r['overhead'])}** / **{_us(r['overhead_best'])}**", _us(r["executor_best"]), f"**{_us(r['cpu_overhead'])}**",
          "" if r["torch_step"] != r["torch_step"] else f"{_ms(r['torch_step'])} / {_ms(r['torch_best'])}",
          "n/a" if r["load"] is None else f"{r['load']:.2f}"]
         for r in rows])
    print(table)
    print(f"gloo round trip (1 float, send + recv, 2 local ranks): {_us(round_trip)} us, "
          f"{_us(round_trip_cpu)} us CPU per rank")
    verdicts = "; ".join(f"{r['config']}: {_us(r['overhead'])} us (best step {_us(r['overhead_best'])} us), "
                         f"{'meets' if r['overhead'] < 100e-6 else 'misses'} the goal" for r in rows)
    print(f"overhead per task, median step (goal < 100 us): {verdicts}")
    cpu_verdicts = "; ".join(f"{r['config']}: {_us(r['cpu_overhead'])} us" for r in rows)
    print(f"CPU overhead per task: {cpu_verdicts}")
    text = "\n".join([
        "# Per-task overhead of Piper's executor", "",
        f"Command: `{command}`", "",
        f"Machine: {machine_line()}.", "",
        "Model: a chain of `nn.Linear(1, 1)`+ReLU stages (`toy_sequential` of width 1), MSE loss, AdamW, one row "
        "per microbatch. Slowest rank shown; tasks = every task of the rank's plan (compute and P2P). "
        "'in handlers' = summed duration of the compute tasks around `execute`; 'bare chunks' = the same "
        "chunk forwards/backwards and optimizer steps called directly, best of 5; overhead/task = (step - bare "
        "chunks) / tasks; executor/task = (step - in handlers) / tasks; CPU overhead/task = (CPU time of the "
        "rank's process in the step, all threads - bare chunks) / tasks, on the rank where it is largest: the "
        "work the runtime adds per task, leaving out time spent only waiting for a message. 'Other load' = "
        "cores other processes kept busy meanwhile (this machine is shared; the best step is the least "
        "disturbed one).", "",
        table, "",
        f"Gloo round trip between two local ranks (1 float, blocking send + recv): {_us(round_trip)} us, of which "
        f"each rank's process spends {_us(round_trip_cpu)} us of CPU (one message sent and one received). With "
        "two ranks a tiny step is a chain of such messages, which bounds the two-rank rows from below for any "
        "engine, in time and in CPU (every RECV and SEND task is one message); compare with the "
        "torch.pipelining column.", "",
        f"Overhead per task, median step (goal < 100 us): {verdicts}.", "",
        f"CPU overhead per task, median step: {cpu_verdicts}.", "",
    ])
    path = write_result(args.out, "task_overhead.md", text)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
