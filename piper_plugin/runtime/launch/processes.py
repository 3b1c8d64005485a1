"""Launch mode for tests and single machines: worker processes forked on gloo.

Children are forked from a fork server that has imported torch and Piper but never run
autograd (forking a process that has run autograd breaks autograd in the child), so they
start in milliseconds whatever the caller did before. The parent compiles once and ships
the job, plan and program with cloudpickle (lambdas and closures are fine); children run the
worker loop and stream metrics back. The first failure, death or stall of
any rank stops the whole job within ``job.timeout_s``: all children are killed and the
parent raises :class:`WorkerFailed` naming the rank with its original traceback.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import cloudpickle
import torch

from piper_plugin.runtime.job import Job
from piper_plugin.runtime.streams import TaskFailed

__all__ = ["WorkerFailed", "SECONDARY_ERRORS", "headline", "run_forked", "free_port", "local_rendezvous", "stop"]


class WorkerFailed(RuntimeError):
    def __init__(self, rank: int | None, reason: str, details: str = ""):
        self.rank, self.details = rank, details
        who = "the job" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed: {reason}" + (f"\n--- original traceback of rank {rank} ---\n{details}" if details else ""))


def headline(exc: BaseException) -> str:
    """One line for a rank's failure: a task failure's own first line (it names the rank, the
    task and the original error; the traceback follows it), else the exception's repr."""
    text = str(exc) if isinstance(exc, TaskFailed) else repr(exc)
    return text.split("\n")[0]


def local_rendezvous() -> tuple[str, str]:
    """A torch.distributed init method for ranks on this machine: a file store in a fresh
    directory (no listening socket, unlike a TCP store, which binds every interface), and that
    directory, to remove once the job ended."""
    folder = tempfile.mkdtemp(prefix="piper_rdzv_")
    return f"file://{os.path.join(folder, 'store')}", folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(payload: Any) -> bytes:
    """Tensors travel as bytes: shared-memory handles would die with the child process."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["piper_plugin.runtime.launch.warm"])
    return ctx


def _child(rank: int, shipped: bytes, init_method: str, out: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # local ranks talk over loopback only
    try:
        from piper_plugin.runtime.worker import Worker

        job, program, plan, body = cloudpickle.loads(shipped)
        worker = Worker(rank, job, program, plan, init_method=init_method)
        if body is not None:
            out.put(("result", rank, _pack(body(worker))))
        else:
            for _ in range(job.first_step, job.steps):
                out.put(("metrics", rank, worker.step()))
            out.put(("result", rank, _pack(_final(worker))))
        out.put(("done", rank, None))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it with the traceback
        details = exc.details if isinstance(exc, TaskFailed) else traceback.format_exc()
        out.put(("error", rank, (headline(exc), details)))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _final(worker) -> dict[str, Any]:
    result: dict[str, Any] = {"timeline": worker.runner.timeline}
    if worker.job.capture_grads:
        result["grad_pieces"] = [p for ps in worker.state.grad_pieces.values() for p in ps]
        result["param_pieces"] = worker.state.param_pieces()
    return result


# words of an error that follows from a peer's failure (a dropped connection, a wait that timed out)
SECONDARY_ERRORS = ("Connection reset", "Connection closed", "waited more than", "did not finish", "Broken pipe",
                    "Timed out")


def _raise_first_cause(procs, finished, errors, out, grace_s: float = 1.0) -> None:
    """After the first sign of failure, wait briefly and blame the root cause: a rank that
    died, else a rank whose own error is not a consequence of a peer's failure."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            kind, rank, payload = out.get(timeout=0.05)
            if kind == "error":
                errors.append((rank, *payload))
        except queue.Empty:
            pass
    dead = [r for r, p in enumerate(procs) if r not in finished and not p.is_alive() and p.exitcode != 0]
    reported = {r for r, _, _ in errors}
    for r in dead:
        if r not in reported:
            raise WorkerFailed(r, f"process died with exit code {procs[r].exitcode}")
    primary = [e for e in errors if not any(s in e[1] + e[2] for s in SECONDARY_ERRORS)]
    busy = [e for e in errors if "computing" in e[1]]  # a rank stuck inside its own compute
    if primary or busy or errors:
        raise WorkerFailed(*(primary or busy or errors)[0])


def run_forked(job: Job, program, plan, *, on_metrics: Callable[[dict], None] | None = None,
               body: Callable | None = None) -> dict[int, Any]:
    """Run ``job.steps`` steps on every rank of the plan, forked; returns each rank's result."""
    ctx = _context()
    shipped = cloudpickle.dumps((job, program, plan, body))
    out: mp.Queue = ctx.Queue()
    init_method, folder = local_rendezvous()
    procs = [ctx.Process(target=_child, args=(r, shipped, init_method, out), daemon=True)
             for r in range(plan.grid.world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    finished: set[int] = set()
    errors: list[tuple[int, str, str]] = []
    last_progress = time.monotonic()
    patience = job.timeout_s + 5  # ranks report their own timeouts first, with more detail
    try:
        while len(finished) < len(procs):
            try:
                kind, rank, payload = out.get(timeout=0.2)
            except queue.Empty:
                if any(r not in finished and not p.is_alive() for r, p in enumerate(procs)) or errors:
                    _raise_first_cause(procs, finished, errors, out)
                if time.monotonic() - last_progress > patience:
                    stuck = [r for r in range(len(procs)) if r not in finished]
                    raise WorkerFailed(stuck[0], f"no progress for {patience:.0f}s (ranks {stuck} stalled)")
                continue
            last_progress = time.monotonic()
            if kind == "error":
                errors.append((rank, *payload))
                _raise_first_cause(procs, finished, errors, out)
            if kind == "metrics" and on_metrics:
                on_metrics(payload)
            elif kind == "result":
                results[rank] = _unpack(payload)
            elif kind == "done":
                finished.add(rank)
    finally:
        stop(procs)
        shutil.rmtree(folder, ignore_errors=True)
    return results


def stop(procs) -> None:
    """Kill what still runs and reap everything (no process left behind)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
