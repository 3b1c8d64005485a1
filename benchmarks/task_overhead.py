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
* ``bare replay``: the rank's tasks in the order a Piper step ran them, on one thread with
  nothing around them: the same chunk calls (forward, ``torch.autograd.backward``, AdamW) and
  the same messages as raw ``torch.distributed`` calls (``irecv`` where Piper posted the
  receive, waited for by its first consumer; ``isend`` after the chunk that made it). Steps
  alternate with Piper's, so both see the same machine;
* runtime overhead per task = ``(step - bare replay) / tasks`` (goal: < 100 us on CPU), median
  and best step, in wall time and in CPU time of the rank's process (every thread): what the
  executor adds to the work its plan asks for, messages included;
* for comparison ``(step - bare chunks) / tasks``, which also charges the runtime with every
  message's cost, and the executor's share ``(step - in handlers) / tasks``;
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
    ForeignLoad, code_version, command_line, machine_line, markdown_table, median, run_piper, run_ranks,
    slowest_rank_times, torch_pipeline_rank, wait_for_quiet, write_result,
)
from piper_plugin import Job, Schedule
from piper_plugin.models import layer_stages, mse_loss, toy_sequential
from piper_plugin.recipes import apply_recipe

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
    """The modules of ``toy_sequential`` tagged ``PP=stage`` (the region Piper cuts): as it tags
    them, each ``Linear`` with the ``ReLU`` after it, the groups split over the stages by
    :func:`layer_stages`."""
    groups: list[list[nn.Module]] = []
    for m in model:
        if isinstance(m, nn.Linear) or not groups:
            groups.append([m])
        else:
            groups[-1].append(m)
    owner = layer_stages(len(groups), num_stages)
    return nn.Sequential(*[m for group, s in zip(groups, owner) if s == stage for m in group])


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


def _bare(rank, repeats: int) -> float:
    """Seconds for this rank's chunk calls with no runtime around them (one step's worth)."""
    state, m = rank.state, rank.plan.microbatches
    shapes = rank.plan.dag.meta.value_shapes
    first = next(iter(rank.job.data_fn(rank.job.seed)))
    micro = rank.executor.shard(dict(zip(state.input_names, first)))  # the step's first microbatch
    values: dict[str, torch.Tensor] = {name: micro[name][0] for name in state.input_names}

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


def _replay_step(rank, order: list[str], inputs: dict[str, list[torch.Tensor]]) -> None:
    """One step of this rank's tasks in ``order`` with raw torch.distributed and bare chunks, on
    ``inputs`` (this rank's microbatches of a batch, cut before timing as the Worker cuts them)."""
    state, plan, comm = rank.state, rank.plan, rank.comm
    dag, deps = plan.dag, plan.ranks[rank.rank].deps
    receiving: dict[str, tuple[list, dict[str, torch.Tensor]]] = {}
    sends, saved, values = [], {}, {}
    for key in order:
        node = dag.nodes[key]
        kind = node.kind.value
        if kind in ("SEND", "RECV"):
            other, group = comm.channel(node)
            names = sorted(v for vs in dag.data_pred[key].values() for v in vs)
            if kind == "SEND":
                sends += [dist.isend(values[v].contiguous(), dst=other, group=group) for v in names]
            else:
                out = {v: comm.specs[v.removeprefix("grad:")].empty(rank.device) for v in names}
                receiving[key] = ([dist.irecv(t, src=other, group=group) for t in out.values()], out)
            continue
        for dep in deps[key]:
            if dep in receiving:
                works, out = receiving.pop(dep)
                for work in works:
                    work.wait()
                values.update(out)
        region, mb = dag.regions[node.region], node.microbatch
        if kind == "F":
            args = [values[v].detach().requires_grad_(True) if v in values else inputs[v][mb]
                    for v in region.inputs]
            outs = state.chunks[node.region](*args)
            saved[(node.region, mb)] = (args, outs)
            values.update((v, t.detach()) for v, t in zip(region.outputs, outs))
        elif kind == "B":
            args, outs = saved.pop((node.region, mb))
            roots = [(v, t) for v, t in zip(region.outputs, outs) if t.requires_grad]
            torch.autograd.backward([t for _, t in roots],
                                    [values.get(f"grad:{v}", torch.ones_like(t)) for v, t in roots])
            values.update((f"grad:{v}", a.grad) for v, a in zip(region.inputs, args)
                          if isinstance(a, torch.Tensor) and a.grad is not None)
        elif kind == "UPDATE":
            state.optimizers[node.region].step()
            state.optimizers[node.region].zero_grad(set_to_none=True)
        else:
            raise ValueError(f"task_overhead replays F, B, UPDATE, SEND and RECV only, not {key}")
    for work in sends:
        work.wait()


def _timed(rank, warmup: int, steps: int) -> dict[str, Any]:
    nodes = rank.plan.dag.nodes
    for _ in range(warmup):
        dist.barrier()
        rank.step()
    order = [key for _, key, begin, _ in sorted(rank.runner.timeline, key=lambda e: e[2])]
    first = next(iter(rank.job.data_fn(rank.job.seed)))
    inputs = rank.executor.shard(dict(zip(rank.state.input_names, first)))
    for _ in range(2):
        dist.barrier()
        _replay_step(rank, order, inputs)
    out: dict[str, Any] = {"times": [], "handlers": [], "cpu": [], "replay": [], "replay_cpu": []}
    for i in range(2 * steps):  # Piper and the bare replay alternate, each first every other pair
        piper = (i % 2 == 0) == (i % 4 < 2)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        rank.step() if piper else _replay_step(rank, order, inputs)
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if not piper:
            out["replay"].append(wall)
            out["replay_cpu"].append(cpu)
            continue
        out["times"].append(wall)
        out["cpu"].append(cpu)
        out["handlers"].append(sum(end - begin for _, key, begin, end in rank.runner.timeline
                                   if nodes[key].is_compute))
    kinds: dict[str, int] = {}
    for _, key, _, _ in rank.runner.timeline:
        kinds[nodes[key].kind.value] = kinds.get(nodes[key].kind.value, 0) + 1
    return {**out, "tasks": len(rank.runner.timeline), "kinds": kinds, "bare": _bare(rank, 5),
            "cpu_total": time.process_time()}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    recipe, pp, per_rank = CONFIGS[name]
    job = tiny_job(recipe, pp, per_rank, args.microbatches, args.seed)
    compiled = job.compile()
    if args.quiet_wait > 0:
        wait_for_quiet(args.quiet_wait)
    with ForeignLoad() as load:
        per_rank_results = run_piper(job, compiled, functools.partial(_timed, warmup=args.warmup, steps=args.steps))
        load.add_own(per_rank_results)
    steps = slowest_rank_times(per_rank_results)
    step, best = median(steps), min(steps)
    replays = slowest_rank_times({r: {"times": v["replay"]} for r, v in per_rank_results.items()})
    replay, replay_best = median(replays), min(replays)
    torch_steps = _torch_steps(job, recipe, pp, per_rank, args)
    worst = max(per_rank_results.values(), key=lambda r: (step - r["bare"]) / r["tasks"])
    tasks = worst["tasks"]
    best_handlers = worst["handlers"][steps.index(best)]  # the slowest rank's, in the best step
    return {"config": name, "load": load.cores, "microbatches": args.microbatches,
            "tasks": tasks, "kinds": worst["kinds"], "step": step, "best": best,
            "bare": worst["bare"], "overhead": (step - worst["bare"]) / tasks,
            "replay": replay, "replay_best": replay_best, "runtime": (step - replay) / tasks,
            "runtime_best": (best - replay_best) / tasks,
            "runtime_cpu": max((median(r["cpu"]) - median(r["replay_cpu"])) / r["tasks"]
                               for r in per_rank_results.values()),
            "executor_best": (best - best_handlers) / tasks,
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
        ["configuration", "tasks/rank", "task kinds", "step ms: median / best", "bare replay ms: median / best",
         "runtime overhead/task us: median / best step", "runtime CPU overhead/task us (busiest rank)",
         "bare chunks ms", "(step - bare chunks)/task us", "executor/task us (best step)",
         "torch.pipelining step ms: median / best", "other load, cores"],
        [[r["config"], r["tasks"], " ".join(f"{k}:{v}" for k, v in sorted(r["kinds"].items())),
          f"{_ms(r['step'])} / {_ms(r['best'])}", f"{_ms(r['replay'])} / {_ms(r['replay_best'])}",
          f"**{_us(r['runtime'])}** / **{_us(r['runtime_best'])}**", f"**{_us(r['runtime_cpu'])}**",
          _ms(r["bare"]), _us(r["overhead"]), _us(r["executor_best"]),
          "" if r["torch_step"] != r["torch_step"] else f"{_ms(r['torch_step'])} / {_ms(r['torch_best'])}",
          "n/a" if r["load"] is None else f"{r['load']:.2f}"]
         for r in rows])
    print(table)
    print(f"gloo round trip (1 float, send + recv, 2 local ranks): {_us(round_trip)} us, "
          f"{_us(round_trip_cpu)} us CPU per rank")
    verdicts = "; ".join(f"{r['config']}: {_us(r['runtime'])} us (best step {_us(r['runtime_best'])} us, "
                         f"CPU {_us(r['runtime_cpu'])} us), "
                         f"{'meets' if max(r['runtime'], r['runtime_cpu']) < 100e-6 else 'misses'} the goal"
                         for r in rows)
    print(f"runtime overhead per task, median step (goal < 100 us): {verdicts}")
    text = "\n".join([
        "# Per-task overhead of Piper's executor", "",
        f"Command: `{command}`", "",
        f"Machine: {machine_line()}.", "",
        "Model: a chain of `nn.Linear(1, 1)`+ReLU stages (`toy_sequential` of width 1), MSE loss, AdamW, one row "
        "per microbatch. Slowest rank per step; tasks = every task of the rank's plan (compute and P2P). "
        "'Bare replay' = the rank's tasks in the order a Piper step ran them, on one thread with nothing around "
        "them: the same chunk calls and the same messages as raw `torch.distributed` calls (`irecv` where Piper "
        "posted the receive, waited for by its first consumer; `isend` after the chunk that made it); Piper's "
        "steps and the replay's alternate (ABBA), so both see the same machine. Runtime overhead/task = (step - "
        "bare replay) / tasks, in wall time (median and best step) and in CPU time of the rank's process, every "
        "thread (median, on the rank where it is largest). For comparison: 'bare chunks' = the chunk calls "
        "alone, best of 5, and (step - bare chunks) / tasks, which also charges every message's own cost to "
        "the runtime; executor/task = (step - summed compute-task durations) / tasks. 'Other load' = cores "
        "other processes kept busy meanwhile (this machine is shared).", "",
        table, "",
        f"Gloo round trip between two local ranks (1 float, blocking send + recv): {_us(round_trip)} us, of which "
        f"each rank's process spends {_us(round_trip_cpu)} us of CPU (one message sent and one received). With "
        "two ranks a tiny step is a chain of such messages: the bare replay's time is mostly theirs, for any "
        "engine; compare with the torch.pipelining column.", "",
        f"Runtime overhead per task, median step (goal < 100 us, in wall and in CPU time): {verdicts}.", "",
    ])
    path = write_result(args.out, "task_overhead.md", text)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
