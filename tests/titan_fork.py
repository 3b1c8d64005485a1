"""``torchtitan.train`` (and Megatron entry) ranks forked from one process that has imported
TorchTitan and the adapters already.

torchrun starts each rank as a fresh interpreter, and importing ``torchtitan.train`` alone costs
~10 s of CPU per rank on this machine; the TorchTitan parity tests run some twenty jobs. Here one
zygote process per test session imports TorchTitan and the adapter once, then forks the ranks of
each job. A rank gets what torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port, the job's working
directory, ``sys.argv``), calls ``torchtitan.train.main()`` as ``python -m torchtitan.train``
does, and writes its stdout and stderr to the job's log. As under torchrun, one failing rank ends
the others. The zygote never runs a tensor op nor starts a Python thread, so forking it is safe.

TorchTitan's rank 0 sleeps 2 s after its last step "for other ranks to complete" (torchrun would
otherwise stop them as it exits); here the zygote waits for every rank itself, so the forked
ranks skip that sleep (:func:`_without_exit_sleep`): 2 s less per job, nothing else changes.

:func:`run_host_job_forked` is :func:`piper_plugin.calibrate_host.run_host_job` (``torchrun -m
PROGRAM ARGV``) with the ranks forked so: ``torchtitan.train`` as above, any other program (the
Megatron entry, ``piper_plugin.adapters.megatron.pretrain_gpt``) run as ``python -m`` runs it.

The issue's own command (``test_issue_command_runs_stock_config_with_the_flag``), ``piper launch``
and the A/B benchmark still start real torchrun jobs.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from piper_plugin.adapters.torchtitan.launch import TitanRun, parse_steps, titan_args, titan_command, train_main
from piper_plugin.runtime.launch.processes import free_port

TITAN = "torchtitan.train"
FAIL_GRACE_S = 10.0  # after one rank fails, the others get this long to exit before SIGKILL


# -- the zygote (its own process) -----------------------------------------------------------------
def _rank(job: dict, rank: int, port: int) -> None:
    """In the forked child: become rank ``rank`` of ``job`` and exit with the trainer's status."""
    code = 1
    try:
        log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(job["cwd"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                           "WORLD_SIZE": str(job["nproc"]), "LOCAL_WORLD_SIZE": str(job["nproc"]),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        program = job.get("program", TITAN)
        if program == TITAN:
            train_main(job["argv"], threads=job["threads"])
        else:
            import runpy

            import torch

            torch.set_num_threads(job["threads"])
            sys.argv = [program, *job["argv"]]
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the job's log, like an uncaught error under torchrun
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(code)


def _run_job(job: dict) -> int:
    """Fork the job's ranks and wait: the first non-zero exit status, 124 after the timeout."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(job, rank, port)
        pids[pid] = rank
    deadline = time.monotonic() + job["timeout_s"]
    status, failed_at = 0, None
    while pids:
        pid, raw = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(raw)
            pids.pop(pid, None)
            if code and not status:
                status, failed_at = code if code > 0 else 128 - code, time.monotonic()
            continue
        now = time.monotonic()
        if now > deadline and not status:
            status, failed_at = 124, now - FAIL_GRACE_S
        if failed_at is not None:
            sig = signal.SIGKILL if now > failed_at + FAIL_GRACE_S else signal.SIGTERM
            for live in pids:
                try:
                    os.kill(live, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    return status


def _without_exit_sleep() -> None:
    """``torchtitan.trainer`` sees a ``time`` module whose ``sleep`` returns at once (its only
    sleep is rank 0's wait after the last step); every other name is the real module's."""
    import types

    import torchtitan.trainer as trainer

    shim = types.ModuleType("time")
    shim.__dict__.update(vars(time))
    shim.sleep = lambda seconds: None
    trainer.time = shim


def zygote_main() -> None:
    """Import TorchTitan and the adapter, then serve one JSON job per stdin line (answer: a line)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed here goes to stderr, not into the answers
    import torch

    torch.set_num_threads(1)
    import torchtitan.train  # noqa: F401
    _without_exit_sleep()
    import piper_plugin.adapters.torchtitan.config_registry  # noqa: F401
    import piper_plugin.adapters.torchtitan.pipelining  # noqa: F401
    import piper_plugin.adapters.megatron.pretrain_gpt  # noqa: F401

    answers.write("ready\n")
    for line in sys.stdin:
        job = json.loads(line)
        answers.write(json.dumps({"returncode": _run_job(job)}) + "\n")


# -- the test side ---------------------------------------------------------------------------------
_zygote: subprocess.Popen | None = None


def _close() -> None:
    if _zygote is not None and _zygote.poll() is None:
        _zygote.stdin.close()
        try:
            _zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _zygote.kill()


def _get_zygote() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        _zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
        ready = _zygote.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the torchtitan.train zygote did not start (exit {_zygote.poll()})")
        atexit.register(_close)
    return _zygote


def run_titan_forked(config: str, engine: str, *, dump_folder: str | Path, nproc: int = 2,
                     steps: int | None = None, extra: Sequence[str] = (), timeout_s: float = 600,
                     threads: int = 1) -> TitanRun:
    """What :func:`piper_plugin.adapters.torchtitan.launch.run_titan` does, with forked ranks."""
    dump = Path(dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    tail = ["--dump_folder", str(dump), *extra]
    log = dump / "ranks.log"
    log.unlink(missing_ok=True)
    job = {"argv": titan_args(config, engine, steps=steps, extra=tail), "nproc": nproc, "cwd": str(dump),
           "log": str(log), "timeout_s": timeout_s, "threads": threads}
    start = time.perf_counter()
    code, text = _ask(job)
    run = TitanRun(titan_command(config, engine, nproc=nproc, steps=steps, extra=tail), code,
                   time.perf_counter() - start, text)
    run.losses, run.grad_norms, run.tps = parse_steps(text)
    return run


def _ask(job: dict) -> tuple[int, str]:
    """Run ``job`` in the zygote: (exit status, the ranks' log)."""
    zygote = _get_zygote()
    zygote.stdin.write(json.dumps(job) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    if not answer:
        raise RuntimeError(f"the torchtitan.train zygote died (exit {zygote.poll()})")
    code = json.loads(answer)["returncode"]
    text = Path(job["log"]).read_text(errors="replace") if Path(job["log"]).exists() else ""
    if code == 124:
        text += f"\ntimed out after {job['timeout_s']}s"
    return code, text


def run_host_job_forked(program: str, argv: Sequence[str], nproc: int, cwd: Path,
                        timeout_s: float = 900.0) -> tuple[int, str]:
    """What :func:`piper_plugin.calibrate_host.run_host_job` does, with forked ranks."""
    import tempfile

    fd, log = tempfile.mkstemp(prefix="ranks_", suffix=".log", dir=cwd)
    os.close(fd)
    try:
        return _ask({"program": program, "argv": list(argv), "nproc": nproc, "cwd": str(cwd), "log": log,
                     "timeout_s": timeout_s, "threads": 1})
    finally:
        os.unlink(log)


if __name__ == "__main__":
    zygote_main()
