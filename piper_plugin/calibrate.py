"""A cost profile measured on this machine (``piper calibrate``), for the simulator and the tuner.

Compute: a few short jobs of the toy model on forked ranks (1F1B and ZB-H1 pipelines with
small and large microbatches, and data parallelism over whole-model regions) record each
task's span in their last step. Per task kind (F, B, BI, BW, UPDATE) a non-negative
least-squares fit gives seconds per task, per op of the region (Python and dispatch overhead:
what dominates small models on a CPU), per forward matmul FLOP and per activation byte of the
microbatch, and per parameter byte (:func:`piper_plugin.scheduler.cost.task_features`). Messages: rank 0 and 1 time
ping-pongs of several sizes (gloo) for the seconds per byte; the time per message the
simulator charges is then the one (searched over 1 us-100 ms) whose simulations of the
calibration jobs come closest to their measured step times (log error), each simulated step
with the step overhead added (what a job's last step spent before its first task and after its
last, over all ranks: the median over the jobs): it carries what the
runtime adds to each message (its threads, copies, waits), which a raw ping-pong does not; with
it, the share of a message's time that also holds the rank's compute (gloo copies and reduces
on the cores that compute; searched over 0-100%), which decides whether overlapping a
collective with compute pays. The profile (JSON, with each job's measured and predicted step)
is what :func:`cost_model` reads. With more ranks than the machine has cores, a task is charged
the core time it had (where more ranks computed at once than there are cores, a share of its
span) and the profile names the cores, which the simulator's ranks then share.

Invariant: a profile is measured on the model and sizes it names and used for that model; a
profile for another model still loads, with its figures as measured (the tuner says which).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from piper_plugin.trace_samples import collective_samples, step_outside_tasks, task_samples

__all__ = ["CALIBRATION_JOBS", "calibrate", "fit_profile", "measure_messages", "cost_model", "read_profile",
           "predict_plan", "prediction_line",
           "fit_compute", "fit_messages", "fit_latency", "fit_latencies", "fit_cpu_share",
           "task_samples", "collective_samples", "step_outside_tasks"]

KINDS = ("F", "B", "BI", "BW", "UPDATE")
# (recipe, pipeline over "all" ranks or "one" (data parallel), microbatches, ZeRO level, chunks per
# rank): every task kind at small and large microbatches (the whole batch down to a sample or
# two), so neither its per-task nor its per-FLOP term is a guess outside the sizes measured; and
# data parallelism with a gradient reduction that can overlap the backward (two chunks per rank)
CALIBRATION_JOBS: tuple[tuple[str, str, int, int, int], ...] = (
    ("1f1b", "all", 1, 0, 1), ("1f1b", "all", 4, 0, 1), ("1f1b", "all", 16, 0, 1), ("zb-h1", "all", 2, 0, 1),
    ("zb-h1", "all", 8, 0, 1), ("1f1b", "one", 4, 0, 1), ("1f1b", "one", 1, 0, 1),
    ("interleaved-1f1b", "one", 1, 0, 2), ("1f1b", "one", 2, 3, 1))
LATENCIES = tuple(10 ** (-6 + k / 10) for k in range(51))  # 1 us .. 100 ms, the per-message time searched
WARMUP_STEPS = 2  # a job's first steps, left out of its median step
CPU_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # of a message's time, also on the compute's CPU: searched
MESSAGE_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)


def _nnls(rows: list[list[float]], times: list[float], relative: bool = False) -> list[float]:
    """Non-negative least squares, columns scaled to unit norm first (features span 10 orders);
    ``relative``: each row weighted by 1 / its time (relative errors, so small tasks count as
    much as large ones)."""
    import numpy as np
    from scipy.optimize import nnls

    a, b = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    if relative:
        weight = 1.0 / np.maximum(b, 1e-9)
        a, b = a * weight[:, None], b * weight
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, b)
    return [float(c) for c in coef / scale]


def fit_compute(samples: list[tuple[str, tuple[float, ...], float]]) -> dict[str, list[float]]:
    """``(kind, features, seconds)`` samples -> per kind the coefficients of the features. A
    kind never measured (BI/BW without a split plan) takes half of B's."""
    fitted: dict[str, list[float]] = {}
    for kind in KINDS:
        mine = [(f, t) for k, f, t in samples if k == kind]
        if mine:
            fitted[kind] = _nnls([list(f) for f, _ in mine], [t for _, t in mine], relative=True)
    if "B" in fitted:
        for half in ("BI", "BW"):
            fitted.setdefault(half, [c / 2 for c in fitted["B"]])
    if "BI" in fitted and "BW" in fitted:
        fitted.setdefault("B", [i + w for i, w in zip(fitted["BI"], fitted["BW"])])
    return fitted


def fit_messages(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """``(bytes, seconds)`` of single messages -> (latency, seconds per byte)."""
    latency, per_byte = _nnls([[1.0, float(n)] for n, _ in samples], [t for _, t in samples])
    return latency, per_byte


def _message_body(repeats: int) -> Callable:
    """In every rank (a forked worker with its default group): one-way times of ping-pongs between
    ranks 0 and 1 (rank 0 reports)."""
    def body(worker) -> dict[str, list[tuple[int, float]]]:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        p2p = []
        for nbytes in MESSAGE_BYTES:
            buf = torch.zeros(nbytes // 4)
            dist.barrier()
            if rank in (0, 1):
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    if rank == 0:
                        dist.send(buf, 1)
                        dist.recv(buf, 1)
                    else:
                        dist.recv(buf, 0)
                        dist.send(buf, 0)
                    times.append((time.perf_counter() - start) / 2)
                p2p.append((nbytes, sorted(times)[len(times) // 2]))
        return {"p2p": p2p}
    return body


def calibrate(*, model: str, ranks: int, layers: int, batch: int, seq: int = 32, steps: int = 8,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the calibration jobs (``steps`` each; the first :data:`WARMUP_STEPS`, slower while
    allocations and caches settle, left out of the median) and the message
    timings on ``ranks`` forked ranks; the profile."""
    from piper_plugin.compiler import compile_job
    from piper_plugin.recipes import load
    from piper_plugin.runtime.launch.processes import run_forked
    from piper_plugin.training import toy_job

    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps={steps}: a calibration job needs more than its {WARMUP_STEPS} warm-up steps")
    cpus = os.cpu_count() or ranks
    shared = cpus if ranks > cpus else None  # more ranks than cores: they share them
    samples: list[tuple[str, tuple[float, ...], float]] = []
    steps_measured: list[tuple[str, Any, float]] = []  # (job, plan, median step of the slowest rank)
    outside: list[float] = []  # per job: its last step's time outside its tasks
    collectives: list[tuple[float, float]] = []  # (bytes, seconds) of the collectives the jobs ran
    for recipe, grid, m, zero, chunks in CALIBRATION_JOBS:
        pp = ranks if grid == "all" else 1
        dp = ranks // pp
        if batch % (dp * m) or zero and dp == 1:
            continue
        stages = load(recipe).stages(pp, chunks)
        if stages > layers:
            continue

        def schedule(program, recipe=recipe, pp=pp, dp=dp, m=m, zero=zero, chunks=chunks):
            return load(recipe).schedule(program, pp=pp, dp=dp, ep=1, microbatches=m, zero=zero, chunks=chunks)

        job = toy_job(schedule, model=model, stages=stages, layers=layers, batch=batch, seq=seq, steps=steps)
        program, _, plan, _ = compile_job(job)
        started = time.monotonic()
        metrics: list[dict] = []
        per_rank = run_forked(job, program, plan, on_metrics=metrics.append)
        slowest: dict[int, float] = {}
        for m_ in metrics:
            slowest[m_["step"]] = max(slowest.get(m_["step"], 0.0), m_["step_time_s"])
        name = f"{recipe} pp={pp} dp={dp} m={m} zero={zero}" + (f" v={chunks}" if chunks > 1 else "")
        steps_measured.append((name, plan, statistics.median(t for s_, t in slowest.items() if s_ >= WARMUP_STEPS)))
        timelines = {r: result["timeline"] for r, result in per_rank.items()}
        samples += task_samples(plan, timelines, shared)
        outside.append(step_outside_tasks(slowest[max(slowest)], timelines.values()))
        collectives += collective_samples(plan, timelines.values())
        say(f"calibrate  {name}: {len(plan.dag.regions)} regions, step {steps_measured[-1][2] * 1e3:.1f} ms, "
            f"{time.monotonic() - started:.1f} s")
    if not steps_measured:
        raise ValueError(f"batch {batch} does not split into any calibration job's microbatches on {ranks} ranks; "
                         f"use a batch that is a multiple of {8 * ranks}")
    profile = fit_profile(samples, steps_measured, measure_messages(ranks), cores=shared, outside_tasks=outside,
                          collectives=collectives, say=say)
    return {"model": model, "layers": layers, "batch": batch, "seq": seq, "ranks": ranks, **profile}


def measure_messages(ranks: int) -> dict[str, list[tuple[int, float]]]:
    """Ping-pong times between ranks 0 and 1 of ``ranks`` forked ranks (of a two-layer toy job:
    the ranks and their gloo group as a calibration job has them), for :func:`fit_profile`."""
    from piper_plugin.compiler import compile_job
    from piper_plugin.recipes import load
    from piper_plugin.runtime.launch.processes import run_forked
    from piper_plugin.training import toy_job

    def schedule(program):
        return load("1f1b").schedule(program, pp=ranks, dp=1, ep=1, microbatches=ranks, zero=0, chunks=1)

    job = toy_job(schedule, model="toy-lm", stages=ranks, layers=ranks, batch=ranks, seq=8, steps=1)
    program, _, plan, _ = compile_job(job)
    return run_forked(job, program, plan, body=_message_body(repeats=20))[0]


def fit_profile(samples: list[tuple[str, tuple[float, ...], float]], steps_measured: list[tuple[str, Any, float]],
                messages: dict[str, list[tuple[int, float]]], *, cores: int | None = None,
                outside_tasks: list[float] = (), collectives: list[tuple[float, float]] = (),
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """The profile's fitted part: compute coefficients from the task ``samples``, message
    bytes/s from the ping-pong ``messages``, the step overhead (the median of ``outside_tasks``,
    each job's :func:`step_outside_tasks`), and the per-message times and CPU share from the
    ``(job, plan, measured median step)`` list; each job's predicted step beside its measured one.
    With ``collectives`` (:func:`collective_samples` of the jobs' steps) the per-collective time
    is measured, not fitted: the median of each one's seconds less its bytes at the ping-pongs'
    rate."""
    from piper_plugin.scheduler.cost import TASK_FEATURES

    wire_latency, per_byte = fit_messages(messages["p2p"])
    compute = fit_compute(samples)
    overhead = statistics.median(outside_tasks) if outside_tasks else 0.0
    measured = (max(LATENCIES[0], statistics.median(t - n * per_byte for n, t in collectives))
                if collectives else None)
    latency, collective, share = fit_cpu_share(compute, per_byte, [(plan, step) for _, plan, step in steps_measured],
                                               cores=cores, overhead=overhead, collective=measured)
    predicted = _predict(compute, (latency, collective), per_byte, [plan for _, plan, _ in steps_measured], share,
                         cores, overhead)
    say(f"calibrate  step overhead (the step's time before its first task and after its last) "
        f"{overhead * 1e3:.1f} ms")
    say(f"calibrate  messages: ping-pong latency {wire_latency * 1e6:.0f} us, "
        f"{1 / per_byte / 1e6 if per_byte else float('inf'):.0f} MB/s; per message in the runtime "
        f"{latency * 1e6:.0f} us point to point, {collective * 1e6:.0f} us per collective "
        f"({f'measured: {len(collectives)} collectives' if collectives else 'fitted'}), {share:.0%} of it on the "
        f"compute's CPU" + (f"; the ranks share {cores} cores (tasks charged the core time they had)" if cores
                            else ""))
    jobs = [{"job": name, "measured_step_s": step, "predicted_step_s": p}
            for (name, _, step), p in zip(steps_measured, predicted)]
    for j in jobs:
        say(f"calibrate  {j['job']}: predicted {j['predicted_step_s'] * 1e3:.1f} ms, "
            f"measured {j['measured_step_s'] * 1e3:.1f} ms")
    return {"features": list(TASK_FEATURES),
            "compute": compute, "latency_s": latency, "collective_latency_s": collective, "seconds_per_byte": per_byte,
            "comm_cpu_share": share, "cores": cores, "step_overhead_s": overhead,
            "ping_pong_latency_s": wire_latency, "messages": messages, "tasks_measured": len(samples),
            "jobs": jobs}


def _model(compute: dict[str, Any], latencies: tuple[float, float], per_byte: float, cpu_share: float = 0.0,
           cores: int | None = None, overhead: float = 0.0):
    """``latencies``: (point to point, collective) seconds per message; ``overhead``: per step."""
    from piper_plugin.ir.nodes import COLLECTIVES
    from piper_plugin.scheduler.cost import CostModel

    p2p, collective = latencies
    return CostModel(linear={k: tuple(float(c) for c in v) for k, v in compute.items()}, latency=p2p,
                     latency_by_kind={kind.value: collective for kind in COLLECTIVES}, seconds_per_byte=per_byte,
                     comm_cpu_share=cpu_share, cores=cores, step_overhead=overhead)


def _predict(compute: dict[str, list[float]], latencies: tuple[float, float], per_byte: float,
             plans: list, cpu_share: float = 0.0, cores: int | None = None, overhead: float = 0.0) -> list[float]:
    from piper_plugin.scheduler.simulate import simulate

    cost = _model(compute, latencies, per_byte, cpu_share, cores, overhead)
    return [simulate(plan, cost).step_time for plan in plans]


def _log_error(predicted: list[float], measured: list[float]) -> float:
    return sum(math.log(p / s) ** 2 for p, s in zip(predicted, measured))


def fit_cpu_share(compute: dict[str, list[float]], per_byte: float,
                  measured: list[tuple[Any, float]], cores: int | None = None,
                  overhead: float = 0.0, collective: float | None = None) -> tuple[float, float, float]:
    """(point to point, collective, CPU share): for each share of :data:`CPU_SHARES` the
    per-message times :func:`fit_latencies` gives, and the share whose simulated steps of the
    ``(plan, measured step)`` pairs have the least squared log error."""
    plans, steps = [p for p, _ in measured], [s for _, s in measured]
    best = None
    for share in CPU_SHARES:
        pair = fit_latencies(compute, per_byte, measured, cpu_share=share, cores=cores, overhead=overhead,
                             collective=collective)
        error = _log_error(_predict(compute, pair, per_byte, plans, share, cores, overhead), steps)
        if best is None or error < best[0]:
            best = (error, (*pair, share))
    return best[1]


def fit_latency(compute: dict[str, list[float]], per_byte: float, measured: list[tuple[Any, float]],
                which: int = 0, other: float | None = None, cpu_share: float = 0.0, cores: int | None = None,
                overhead: float = 0.0) -> float:
    """The per-message time (of :data:`LATENCIES`) whose simulated steps of the ``(plan,
    measured step)`` pairs have the least squared log error: ``which`` 0 fits the point-to-point
    time (collectives at ``other``, or the same), 1 the collectives' (point to point at ``other``)."""
    plans, steps = [p for p, _ in measured], [s for _, s in measured]

    def error(latency: float) -> float:
        pair = (latency, latency if other is None else other)
        return _log_error(_predict(compute, pair if which == 0 else pair[::-1], per_byte, plans, cpu_share, cores,
                                   overhead), steps)

    return min(LATENCIES, key=error)


def fit_latencies(compute: dict[str, list[float]], per_byte: float,
                  measured: list[tuple[Any, float]], cpu_share: float = 0.0,
                  cores: int | None = None, overhead: float = 0.0,
                  collective: float | None = None) -> tuple[float, float]:
    """(point to point, collective) per-message times: the first from the jobs without
    collectives, the second from the others with it fixed (one time for both when either set
    of jobs is empty); with ``collective`` (measured) the first from every job, the second that."""
    from piper_plugin.ir.nodes import COLLECTIVES

    def has_collectives(plan) -> bool:
        return any(node.kind in COLLECTIVES for node in plan.dag.nodes.values())

    p2p_only = [(p, s) for p, s in measured if not has_collectives(p)]
    rest = [(p, s) for p, s in measured if has_collectives(p)]
    if collective is not None:
        return fit_latency(compute, per_byte, p2p_only or measured, other=collective, cpu_share=cpu_share,
                           cores=cores, overhead=overhead), collective
    if not p2p_only or not rest:
        both = fit_latency(compute, per_byte, measured, cpu_share=cpu_share, cores=cores, overhead=overhead)
        return both, both
    p2p = fit_latency(compute, per_byte, p2p_only, cpu_share=cpu_share, cores=cores, overhead=overhead)
    return p2p, fit_latency(compute, per_byte, rest, which=1, other=p2p, cpu_share=cpu_share, cores=cores,
                            overhead=overhead)


def _not_a_profile(where: str, exc: BaseException) -> ValueError:
    return ValueError(f"cost profile {where!r} is not one `piper calibrate` wrote "
                      f"({type(exc).__name__}: {exc}); write one with `piper calibrate --out FILE`")


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile file's contents; a ValueError names the file and the fix when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError, TypeError) as exc:
        raise _not_a_profile(str(path), exc) from None
    return data


def cost_model(profile: dict[str, Any] | str | Path):
    """The :class:`~piper_plugin.scheduler.cost.CostModel` of a profile (or its JSON file)."""
    from piper_plugin.scheduler.cost import TASK_FEATURES

    where = "" if isinstance(profile, dict) else str(profile)
    if where:
        profile = read_profile(where)
    try:
        if list(profile.get("features", TASK_FEATURES)) != list(TASK_FEATURES):
            raise ValueError(f"its compute is fitted on {profile['features']}, this version fits "
                             f"{list(TASK_FEATURES)}")
        latency = float(profile["latency_s"])
        cores = profile.get("cores")
        return _model(profile["compute"], (latency, float(profile.get("collective_latency_s", latency))),
                      float(profile["seconds_per_byte"]), float(profile.get("comm_cpu_share", 0.0)),
                      int(cores) if cores else None, float(profile.get("step_overhead_s", 0.0)))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        if not where:
            raise
        raise _not_a_profile(where, exc) from None


def predict_plan(plan, profile: dict[str, Any]):
    """``plan`` simulated at the profile's costs, with the region memory it measured where it
    measured that plan's stage count (:func:`~piper_plugin.measured_memory.with_measured_memory`):
    ``(SimResult, whether the memory is measured)``."""
    from piper_plugin.measured_memory import with_measured_memory
    from piper_plugin.scheduler.simulate import simulate

    measured = with_measured_memory(plan, profile)
    return simulate(measured, cost_model(profile)), measured is not plan


def prediction_line(plan, profile: dict[str, Any], name: str) -> str:
    """What a host's ``--piper.profile`` / ``--piper-profile`` logs: the plan's step, bubble and
    peak transient memory per rank as the profile (its file ``name``) predicts them."""
    result, measured = predict_plan(plan, profile)
    peaks = " / ".join(f"{b / 2 ** 20:.1f}" for b in result.peak_transient_bytes)
    return (f"predicted with cost profile {name}: step {result.step_time * 1e3:.1f} ms, bubble "
            f"{result.bubble_fraction:.3f}, peak transient per rank {peaks} MiB "
            f"({'measured' if measured else 'estimated'} region memory)")
