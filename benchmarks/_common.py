"""What the benchmarks share: the toy-LM job, seeded data, a forked rank launcher, tables.

Every benchmark builds its model from one seed (``torch.manual_seed(seed)`` then the model
constructor, as :meth:`Job.build_model` does), feeds the same seeded random-token batches to
every engine it compares, and runs its ranks as processes forked from a fork server (as
Piper's own launcher does: a process that ran autograd must not be forked) on gloo (NCCL for a
Piper job on GPUs), with one torch thread each. Piper's ranks are :class:`piper_plugin.Worker`,
the rank ``piper.run`` builds (a Job's model and data around the published Executor).
"""
from __future__ import annotations

import argparse
import functools
import io
import multiprocessing as mp
import os
import queue
import shlex
import socket
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from piper_plugin import Compiled, Job, Schedule, Worker
from piper_plugin.models import ToyLM, ToyLMConfig, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe, stages_needed, stages_of_rank

__all__ = ["RESULTS", "RandomTokens", "lm_config", "build_lm", "lm_job", "run_ranks", "run_piper",
           "piper_timed_body", "torch_pipeline_rank", "alternating_rank", "ALTERNATION",
           "slowest_rank_times", "total_cpu_times", "command_line", "markdown_table", "write_result", "median",
           "fmt_ms", "machine_line", "code_version", "ForeignLoad", "wait_for_quiet"]

RESULTS = Path(__file__).resolve().parent / "results"


# -- model, data, job ---------------------------------------------------------------------
def lm_config(*, dim: int, layers: int, heads: int, ffn: int, seq: int, vocab: int) -> ToyLMConfig:
    return ToyLMConfig(vocab=vocab, dim=dim, n_layers=layers, n_heads=heads, ffn=ffn, seq=seq)


def build_lm(cfg: ToyLMConfig, stages: int | None) -> ToyLM:
    """The toy LM; ``stages`` only tags the forward, the weights depend on the seed alone."""
    return ToyLM(cfg, stages)


class RandomTokens:
    """Seeded random ``(tokens, targets)`` batches: batch ``k`` is the same for every engine."""

    def __init__(self, cfg: ToyLMConfig, batch: int, seed: int):
        self.cfg, self.batch = cfg, batch
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> "RandomTokens":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return lm_batch(self.cfg, self.batch, self.generator)


def _random_tokens(cfg: ToyLMConfig, batch: int, seed: int) -> RandomTokens:
    return RandomTokens(cfg, batch, seed)


def _adamw(lr: float, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _recipe_schedule(program, *, recipe: str, pp: int, microbatches: int, chunks: int) -> Schedule:
    return apply_recipe(Schedule(program, pp=pp), recipe, microbatches=microbatches, chunks=chunks)


def lm_job(cfg: ToyLMConfig, *, recipe: str, pp: int, microbatches: int, batch: int, chunks: int = 2,
           seed: int = 0, lr: float = 1e-3, timeout_s: float = 300.0) -> Job:
    """A Piper job: ``cfg``'s LM tagged with the stages ``recipe`` needs, AdamW, seeded data."""
    stages = stages_needed(recipe, pp, chunks)
    return Job(model_fn=functools.partial(build_lm, cfg, stages), loss_fn=lm_loss,
               data_fn=functools.partial(_random_tokens, cfg, batch),
               schedule_fn=functools.partial(_recipe_schedule, recipe=recipe, pp=pp,
                                             microbatches=microbatches, chunks=chunks),
               optimizer_fn=functools.partial(_adamw, lr), steps=0, seed=seed, timeout_s=timeout_s)


# -- timed steps (a barrier first, so all ranks start together) -------------------------
def _timed_step(step: Callable[[], float | None], record: dict[str, list]) -> None:
    """One step from a barrier (all ranks start together) to its end: wall and process CPU time."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step()
    record["times"].append(time.perf_counter() - start)
    record["cpu"].append(time.process_time() - start_cpu)
    record["losses"].append(loss)


def _new_record() -> dict[str, list]:
    return {"times": [], "cpu": [], "losses": []}


def _measured(record: dict[str, list], warmup: int) -> dict[str, Any]:
    """Times and CPU of the steps after ``warmup``; every step's loss; the process's CPU so far."""
    return {"times": record["times"][warmup:], "cpu": record["cpu"][warmup:], "losses": record["losses"],
            "cpu_total": time.process_time()}


def _piper_timed(rank: Worker, warmup: int, steps: int) -> dict[str, Any]:
    """``warmup + steps`` steps, each started together on every rank (a barrier before it)."""
    record = _new_record()
    for _ in range(warmup + steps):
        _timed_step(lambda: rank.step().get("loss"), record)
    return {**_measured(record, warmup), "timeline": rank.runner.timeline, "peak": rank.state.meter.peak}


def piper_timed_body(warmup: int, steps: int) -> Callable:
    """A :func:`run_piper` body timing ``rank.step()``; returns times, losses, last timeline."""
    return functools.partial(_piper_timed, warmup=warmup, steps=steps)


# -- the same job on torch.distributed.pipelining -------------------------------------------
def _torch_stepper(rank: int, world: int, *, job: Job, stage_module: Callable[[nn.Module, int, int], nn.Module],
                   schedule: str, layout: str, num_stages: int, microbatches: int) -> Callable[[], float | None]:
    """One rank of ``job`` on ``torch.distributed.pipelining.<schedule>``: a function running one
    training step (schedule + optimizer) and returning the loss on the last stage's rank.

    Same weights (``job.build_model()`` seeds as Piper's workers do), same batches
    (``job.data_fn(job.seed)``), same loss and optimizer factory; stage ``s`` is
    ``stage_module(model, s, num_stages)`` on the rank ``layout`` gives it.
    """
    from torch.distributed import pipelining

    local = stages_of_rank(rank, world, num_stages // world, layout)
    model = job.build_model()
    modules = [stage_module(model, s, num_stages) for s in local]
    stages = [pipelining.PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, local)]
    cls = getattr(pipelining, schedule)
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    runner = cls(stages if multi else stages[0], microbatches, loss_fn=job.loss_fn)
    optimizer = job.optimizer_fn([p for m in modules for p in m.parameters()])
    first, last = 0 in local, num_stages - 1 in local
    data = iter(job.data_fn(job.seed))

    def step() -> float | None:
        *inputs, target = next(data)
        mb_losses: list[torch.Tensor] = []
        runner.step(*(inputs if first else ()), target=target if last else None,
                    losses=mb_losses if last else None, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(mb_losses).mean().item() if last else None

    return step


def torch_pipeline_rank(rank: int, world: int, *, job: Job, stage_module: Callable[[nn.Module, int, int], nn.Module],
                        schedule: str, layout: str, num_stages: int, microbatches: int, warmup: int,
                        steps: int) -> dict[str, Any]:
    """One rank of ``job`` run by ``torch.distributed.pipelining.<schedule>`` (call in ``run_ranks``);
    each step is timed from a barrier to the end of the optimizer step."""
    step = _torch_stepper(rank, world, job=job, stage_module=stage_module, schedule=schedule, layout=layout,
                          num_stages=num_stages, microbatches=microbatches)
    record = _new_record()
    for _ in range(warmup + steps):
        _timed_step(step, record)
    return _measured(record, warmup)


ALTERNATION = ("torch", "piper", "piper", "torch")  # every 4 steps: each engine twice, order cancelled


def alternating_rank(rank: int, world: int, *, job: Job, program, plan, stage_module, schedule: str, layout: str,
                     num_stages: int, warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    """One rank running both engines side by side in one process (call in ``run_ranks``).

    Piper's rank (:class:`Worker`, as ``piper.run`` builds it) and torch's schedule each hold
    their own model (same seed, so the same weights), optimizer and batch stream; steps follow
    :data:`ALTERNATION`, so neighbouring steps of the two engines see the same machine. Each engine
    runs ``warmup + steps`` steps and drops its first ``warmup``. Returns engine -> times, cpu,
    losses (as the single-engine bodies).
    """
    torch_step = _torch_stepper(rank, world, job=job, stage_module=stage_module, schedule=schedule, layout=layout,
                                num_stages=num_stages, microbatches=plan.microbatches)
    piper = Worker(rank, job, program, plan)  # the process group is up: it only adds its own groups
    steppers = {"torch": torch_step, "piper": lambda: piper.step().get("loss")}
    records = {e: _new_record() for e in steppers}
    for k in range(2 * (warmup + steps)):
        engine = ALTERNATION[k % len(ALTERNATION)]
        _timed_step(steppers[engine], records[engine])
    return {e: _measured(r, warmup) for e, r in records.items()}


def slowest_rank_times(results: dict[int, dict[str, Any]]) -> list[float]:
    """Per step, the time of the slowest rank."""
    return [max(ts) for ts in zip(*(r["times"] for r in results.values()))]


def total_cpu_times(results: dict[int, dict[str, Any]]) -> list[float]:
    """Per step, the CPU seconds of all ranks together (every thread of each rank process)."""
    return [sum(ts) for ts in zip(*(r["cpu"] for r in results.values()))]


# -- a forked rank launcher for both engines -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(payload: Any) -> bytes:
    """Results travel as bytes (``torch.save``): shared-memory handles would die with the rank."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _stop(procs) -> None:
    """Kill what still runs and reap everything (no process left behind)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def rank_device(kind: str, rank: int) -> torch.device:
    """The device of ``rank`` for a job's ``device`` (``LOCAL_RANK``'s GPU, else rank modulo GPUs)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device {kind!r} is not available here; use 'cpu'" if kind == "cuda"
                         else f"unknown device {kind!r}; use 'cpu' or 'cuda'")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))


def _init_group(rank: int, world: int, port: int, timeout_s: float, device: str) -> None:
    """The default group as Piper's ranks make it: gloo on a CPU; on a GPU, NCCL bound to the
    rank's device (every communicator created with its group, in one order on every rank)."""
    from datetime import timedelta

    kwargs: dict[str, Any] = {}
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)


def _rank_main(rank: int, world: int, port: int, shipped: bytes, timeout_s: float, device: str, out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import cloudpickle

        fn = cloudpickle.loads(shipped)
        torch.set_num_threads(1)
        _init_group(rank, world, port, timeout_s, device)
        result = fn(rank, world)
        dist.barrier()
        out.put(("result", rank, _pack(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        out.put(("error", rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _fork_server():
    """The start method of Piper's fork launcher: a fork server that imported torch and Piper
    but never ran autograd (a process that ran autograd must not be forked). One fork server
    serves the whole process, so both engines' ranks come from the same one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks._warm"])
    return ctx


def run_ranks(world: int, fn: Callable[[int, int], Any], timeout_s: float = 300.0,
              device: str = "cpu") -> dict[int, Any]:
    """Run ``fn(rank, world)`` in ``world`` processes with a default group (gloo; NCCL for
    ``device="cuda"``), one torch thread each; ``timeout_s`` bounds the group's operations and
    the whole run.

    The processes come from the fork server Piper's launcher uses (``fn`` travels with
    cloudpickle), so both engines start their ranks the same way.
    """
    import cloudpickle

    ctx = _fork_server()
    out = ctx.Queue()
    port = free_port()
    shipped = cloudpickle.dumps(fn)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, shipped, timeout_s, device, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                kind, rank, payload = out.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                       f"within {timeout_s:.0f}s") from None
                dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
                if dead and out.empty():
                    time.sleep(0.5)
                    if out.empty():
                        raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = _unpack(payload)
    finally:
        _stop(procs)
    return results


def _piper_body(rank: int, world: int, *, job: Job, program, plan, body: Callable[[Worker], Any]) -> Any:
    return body(Worker(rank, job, program, plan))


def run_piper(job: Job, compiled: Compiled, body: Callable[[Worker], Any]) -> dict[int, Any]:
    """``body(rank)`` on every rank of ``compiled``'s plan, each rank a :class:`Worker` of
    ``job`` (what ``piper.run(job, launcher="fork")`` runs, with the benchmark's body in place
    of its step loop); rank -> what ``body`` returned. The whole run gets ``job.timeout_s``."""
    fn = functools.partial(_piper_body, job=job, program=compiled.program, plan=compiled.plan, body=body)
    return run_ranks(compiled.plan.grid.world_size, fn, timeout_s=job.timeout_s, device=job.device)


# -- other processes on the machine ----------------------------------------------------------
def _machine_busy_s() -> float | None:
    """CPU seconds all processes have used so far (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """Cores kept busy by *other* processes while the block runs: machine CPU time minus this
    process's, its reaped children's and what :meth:`add_own` reports (rank processes forked
    by a fork server are not our children), over wall time. None where /proc/stat is missing."""

    def __enter__(self) -> "ForeignLoad":
        self.cores: float | None = None
        self._extra = 0.0
        self._start = (_machine_busy_s(), _own_cpu_s(), time.perf_counter())
        return self

    def add_own(self, results: dict[int, dict[str, Any]]) -> None:
        """Count the CPU time the ranks of a run report (``cpu_total``) as ours."""
        self._extra += sum(r.get("cpu_total", 0.0) for r in results.values())

    def __exit__(self, *exc) -> None:
        busy0, own0, t0 = self._start
        busy1 = _machine_busy_s()
        if busy0 is not None and busy1 is not None:
            wall = time.perf_counter() - t0
            own = _own_cpu_s() - own0 + self._extra
            self.cores = max(0.0, ((busy1 - busy0) - own) / wall) if wall > 0 else 0.0


def wait_for_quiet(max_wait_s: float, below_cores: float = 0.3, sample_s: float = 1.0) -> float | None:
    """Wait (at most ``max_wait_s``) until other processes use fewer than ``below_cores`` cores;
    returns the last load seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with ForeignLoad() as load:
            time.sleep(sample_s)
        if load.cores is None or load.cores < below_cores or time.monotonic() >= deadline:
            return load.cores


# -- reporting ------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def command_line(module: str, args: Any, parser: argparse.ArgumentParser) -> str:
    """The exact command, every option spelled out, that reproduces this run."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of its options
        if not action.option_strings or isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        flag = max(action.option_strings, key=len)
        value = getattr(args, action.dest)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # noqa: SLF001
            if value != action.default:
                argv.append(flag)
        elif value is not None:
            argv += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return f"python -m benchmarks.{module} " + shlex.join(argv)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(lines)


def write_result(path: Path | None, default_name: str, text: str) -> Path:
    target = Path(path) if path is not None else RESULTS / default_name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The engine's commit, and a hash of its uncommitted changes if any (call it before running:
    forked ranks run the code the parent imported)."""
    import hashlib
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "piper_plugin", "recipes", "adapters"], cwd=root,
                              capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "code version unknown"
    if not commit:
        return "code version unknown"
    if diff:
        return f"code at {commit} plus uncommitted engine changes (diff sha1 {hashlib.sha1(diff).hexdigest()[:10]})"
    return f"code at {commit}"


def machine_line(ranks: str = "forked from a fork server") -> str:
    """Software, cores, load (other processes share the cores), how the ranks started (``ranks``)
    and the code measured."""
    import platform

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores "
            f"({platform.machine()}), load average {load} when the run ended; gloo, ranks {ranks}, "
            f"1 torch thread each; {code_version()}")
