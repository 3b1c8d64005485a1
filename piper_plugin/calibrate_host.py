"""``piper calibrate --host NAME -- <the host's arguments>``: a cost profile of a host framework's
model, measured through its adapter.

A host adapter registers a module in the ``piper_plugin.calibration`` entry-point group (pyproject.toml;
TorchTitan's and Megatron's do) with:

- ``program``: the module its ranks run (``python -m torch.distributed.run ... -m <program>``);
- ``calibration_layouts(argv, nproc)``: ``(batch, layouts)``, checking ``argv`` first (a
  UsageError names the flag): the sequences per pipeline per step, and the stage layouts the
  host can run for the command as ``(stages per rank, recipe, recipe splitting the backward or
  None)``, the command's own first (others, where the model allows: regions of other sizes);
  :func:`plan_jobs` makes the jobs of them;
- ``job_argv(argv, nproc, *, recipe, microbatches, chunks, steps, trace)``: the user's arguments
  with the Piper engine, that recipe, microbatch count and stages per rank, ``steps`` steps and a
  step trace into ``trace`` (:class:`~piper_plugin.StepTrace`); without ``steps`` and ``trace``,
  the arguments that run a tuned plan's file;
- optionally ``tunable_recipes(argv, nproc)``: the built-in recipes the host runs for them
  (``piper tune`` searches only those);
- optionally ``tunable_zero(argv, nproc)``: the ZeRO levels the host runs beside them
  (``piper tune`` searches those and passes the one it picks to ``job_argv(..., zero=)``;
  without it: the command's own level, as level 0).

Each job runs as the user would run it (torchrun, gloo, 1 torch thread per rank); its trace
gives the plan, every task's span and each step's seconds, which the toy calibration's fit
(:func:`piper_plugin.calibrate.fit_profile`) turns into the same profile. Invariant: the profile
names the host, arguments and grid it was measured on and keeps the host's program of each
stage count its jobs ran (pickled: ``piper tune --profile`` searches plans of them); the
adapters' ``--piper.profile`` / ``--piper-profile`` print what it predicts for a plan of that model.
"""
from __future__ import annotations

import base64
import os
import pickle
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Sequence

from piper_plugin.cli_args import UsageError

__all__ = ["CALIBRATION_HOSTS", "calibration_hosts", "calibrate_host", "plan_jobs", "run_host_job",
           "HostJobsFailed", "pack_programs", "unpack_programs", "host_module"]

CALIBRATION_HOSTS = "piper_plugin.calibration"  # entry-point group: host name -> its calibration module
JOB_TIMEOUT_S = 900.0


def calibration_hosts() -> dict:
    """Host name -> entry point of its calibration module (loaded only when chosen)."""
    return {e.name: e for e in entry_points(group=CALIBRATION_HOSTS)}


def host_module(name: str):
    hosts = calibration_hosts()
    if name not in hosts:
        raise UsageError(f"--host {name!r}: no adapter registered a calibration for it; the hosts are "
                         f"{', '.join(sorted(hosts)) or 'none (install piper_plugin with its adapters)'}")
    return hosts[name].load()


def plan_jobs(batch: int, layouts: Sequence[tuple[int, str, str | None]]) -> list[tuple[str, int, int]]:
    """``(recipe, microbatches, stages per rank)`` of the calibration jobs: at the first (the
    command's own) layout its recipe at the smallest, a middle and the largest microbatch count
    ``batch`` divides into, and its split-backward recipe at the middle and largest; at every
    other layout its recipe at the middle and largest (the fit then tells per-FLOP work from
    per-task overhead: with one layout every stage varies only with the microbatch)."""
    counts = [m for m in range(1, batch + 1) if batch % m == 0]
    low, mid, high = counts[0], counts[len(counts) // 2], counts[-1]
    (own, plain, split), *others = layouts
    jobs = [(plain, m, own) for m in (low, mid, high)] + [(split, m, own) for m in (mid, high) if split]
    jobs += [(recipe, m, chunks) for chunks, recipe, _ in others for m in (mid, high)]
    return list(dict.fromkeys(jobs))


class HostJobsFailed(RuntimeError):
    """No calibration job ran; ``details``: the first failure's command and output."""

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


def run_host_job(program: str, argv: Sequence[str], nproc: int, cwd: Path,
                 timeout_s: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node=nproc -m program argv`` in ``cwd``, 1 torch thread
    per rank: (exit status, its output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", program, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        return 124, (out.decode() if isinstance(out, bytes) else out) + f"\ntimed out after {timeout_s:.0f} s"


def calibrate_host(host: str, argv: Sequence[str], *, nproc: int, steps: int = 8, rounds: int = 1,
                   workdir: str | Path | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``host``'s calibration jobs for the command ``argv`` on ``nproc`` ranks (``steps``
    each, the first :data:`~piper_plugin.calibrate.WARMUP_STEPS` left out), ``rounds`` times
    over, time messages between two forked ranks, fit; the profile. A job's measured step and
    peaks are the medians over the rounds of each round's median (rounds alternate the jobs, so
    a slow stretch of a shared machine lands on one round of each, not on every step of one);
    its tasks and collectives are fitted from every round, its memory from the first. A job that
    fails runs once more; failing again it is left out of this and later rounds, its output kept
    in the profile's ``failed_jobs``; none succeeding raises :class:`HostJobsFailed` with the
    first failure's output."""
    from piper_plugin.calibrate import (WARMUP_STEPS, collective_samples, fit_profile, measure_messages,
                                        step_outside_tasks, task_samples)
    from piper_plugin.measured_memory import memory_samples, stage_count
    from piper_plugin.step_trace import read_step_traces

    if steps <= WARMUP_STEPS:
        raise UsageError(f"--steps {steps}: a calibration job needs more than its {WARMUP_STEPS} warm-up steps")
    if nproc < 2:
        raise UsageError(f"--ranks {nproc}: calibrating messages needs 2 ranks or more")
    if rounds < 1:
        raise UsageError(f"--rounds {rounds}: run the calibration jobs once at least")
    module = host_module(host)
    jobs = plan_jobs(*module.calibration_layouts(list(argv), nproc))
    cpus = os.cpu_count() or nproc
    shared = cpus if nproc > cpus else None
    samples: list = []
    outside: list[float] = []  # per job and round: its last step's time outside its tasks
    collectives: list[tuple[float, float]] = []  # (bytes, seconds) of the collectives the jobs ran
    measured: dict[str, tuple[Any, list[float], list[dict[int, int]]]] = {}  # job -> (plan, steps, peaks) per round
    programs: dict[int, Any] = {}  # stage count -> the host's program (for piper tune)
    memory: dict[int, list] = {}  # stage count -> (region, part, scale, bytes) the jobs' meters measured
    failures: dict[str, str] = {}  # job -> both runs' output, once it failed twice
    with tempfile.TemporaryDirectory(prefix="piper_calibrate_", dir=workdir) as tmp:
        for round_ in range(rounds):
            for recipe, m, chunks in jobs:
                name = f"{recipe} m={m}" + (f" v={chunks}" if chunks > 1 else "")
                if name in failures:
                    continue
                trace = Path(tmp) / f"{recipe}_m{m}_v{chunks}_r{round_}"
                job = module.job_argv(list(argv), nproc, recipe=recipe, microbatches=m, chunks=chunks, steps=steps,
                                      trace=str(trace))
                started = time.monotonic()
                failed = _run_twice(module.program, job, nproc, Path(tmp), trace, name, say)
                if failed is not None:
                    failures[name] = failed
                    measured.pop(name, None)
                    continue
                traced = read_step_traces(trace)
                plan = traced.plan
                if traced.program is not None:
                    programs.setdefault(stage_count(traced.program.regions), traced.program)
                _, job_steps, job_peaks = measured.setdefault(name, (plan, [], []))
                job_steps.append(traced.median_step(WARMUP_STEPS))
                job_peaks.append(traced.median_peaks(WARMUP_STEPS))
                if round_ == 0:
                    memory.setdefault(stage_count(plan.dag.regions), []).extend(
                        memory_samples(plan, traced.windows, traced.kept_for_weights))
                samples += task_samples(plan, traced.timelines, shared)
                outside.append(step_outside_tasks(traced.step_seconds[-1], traced.last_timelines))
                collectives += collective_samples(plan, traced.last_timelines)
                say(f"calibrate  {name}: {len(plan.dag.regions)} regions on {plan.grid.world_size} plan ranks, step "
                    f"{job_steps[-1] * 1e3:.1f} ms, {time.monotonic() - started:.1f} s"
                    + (f" (round {round_ + 1}/{rounds})" if rounds > 1 else ""))
    if not measured:
        if failures:
            first, output = next(iter(failures.items()))
            raise HostJobsFailed(f"no calibration job of --host {host} ran (each failed twice); the first, "
                                 f"{first}, ended so:", output)
        raise HostJobsFailed(f"--host {host} proposed no calibration job for these arguments", "")
    steps_measured = [(name, plan, statistics.median(job_steps)) for name, (plan, job_steps, _) in measured.items()]
    peaks = [{r: int(statistics.median(p[r] for p in job_peaks)) for r in job_peaks[0]}
             for _, _, job_peaks in measured.values()]
    messages = measure_messages(nproc)
    profile = fit_profile(samples, steps_measured, messages, cores=shared, outside_tasks=outside,
                          collectives=collectives, say=say)
    profile["memory"] = _fit_memory(memory)
    _check_memory(profile, steps_measured, peaks, say)
    grid = steps_measured[0][1].grid
    return {"model": f"{host}: {shlex.join(argv)}", "host": host, "host_args": list(argv), "ranks": nproc,
            "grid": {"pp": grid.pp, "dp": grid.dp, "ep": grid.ep}, "rounds": rounds, **profile,
            "failed_jobs": [{"job": name, "output": out} for name, out in failures.items()],
            "programs": pack_programs(programs)}


def _run_twice(program: str, job: list[str], nproc: int, cwd: Path, trace: Path, name: str,
               say: Callable[[str], None]) -> str | None:
    """Run one calibration job, once more if it fails (a launcher's rendezvous can fail for
    reasons of its own); None when a run succeeded, else both runs' output."""
    code, log = run_host_job(program, job, nproc, cwd)
    if code == 0:
        return None
    say(f"calibrate  {name}: failed (exit status {code}), run once more")
    shutil.rmtree(trace, ignore_errors=True)
    first = _tail(log)
    code, log = run_host_job(program, job, nproc, cwd)
    if code == 0:
        return None
    say(f"calibrate  {name}: failed again (exit status {code}), left out")
    return f"exit status {code}: {shlex.join(job)}\n{first}\n---\n{_tail(log)}"


def _fit_memory(samples: dict[int, list]) -> dict[str, Any]:
    from piper_plugin.measured_memory import fit_memory

    return {str(stages): fit_memory(points) for stages, points in sorted(samples.items()) if points}


def _check_memory(profile: dict[str, Any], steps_measured: list, peaks: list[dict[int, int]],
                  say: Callable[[str], None]) -> None:
    """Each job's peak transient bytes per plan rank, measured (the median over its steps after
    the warm-up) and as the profile just fitted
    predicts them (:func:`~piper_plugin.calibrate.predict_plan`, as the adapters' profile lines do;
    into the profile's ``jobs``)."""
    from piper_plugin.calibrate import predict_plan

    for job, (name, plan, _), measured in zip(profile["jobs"], steps_measured, peaks):
        if not measured:
            continue
        predicted = predict_plan(plan, profile)[0].peak_transient_bytes
        job["measured_peak_transient_bytes"] = [measured.get(r) for r in range(len(predicted))]
        job["predicted_peak_transient_bytes"] = predicted
        say(f"calibrate  {name}: peak transient per rank predicted "
            f"{' / '.join(f'{b / 2**20:.1f}' for b in predicted)} MiB, measured "
            f"{' / '.join('?' if b is None else f'{b / 2**20:.1f}' for b in job['measured_peak_transient_bytes'])} MiB")


def _tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.splitlines()[-lines:])


def pack_programs(programs: dict[int, Any]) -> dict[str, str]:
    """Stage count -> the program, pickled and base64-encoded (a profile is JSON)."""
    return {str(k): base64.b64encode(pickle.dumps(v)).decode() for k, v in sorted(programs.items())}


def unpack_programs(profile: dict[str, Any]) -> dict[int, Any]:
    """The programs a host profile keeps, by stage count (only profiles you trust: pickles)."""
    return {int(k): pickle.loads(base64.b64decode(v)) for k, v in profile.get("programs", {}).items()}
