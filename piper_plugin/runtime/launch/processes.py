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
import re
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

__all__ = ["WorkerFailed", "SECONDARY_ERRORS", "headline", "run_forked", "root_cause", "free_port", "local_rendezvous", "stop"]


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


def waits_on(text: str) -> set[int]:
    """The ranks a timed-out wait names (``(a message from rank 3)``, ``(rank 3)``,
    ``(a collective with ranks [0, 1])``): whom the waiting rank blamed."""
    ranks = {int(r) for r in re.findall(r"\(a message from rank (\d+)\)|\(rank (\d+)\)", text) for r in r if r}
    for group in re.findall(r"a collective with ranks \[([\d, ]+)\]", text):
        ranks.update(int(r) for r in group.split(","))
    return ranks


def root_cause(errors: list[tuple[int, str, str]]) -> tuple[int, str, str] | None:
    """Of ``(rank, headline, details)`` reports: a rank's own error (not a consequence of a
    peer's), else one stuck inside its own compute, else a wait that names a rank which reported
    nothing (the silent one is the likely stall; a wait on a rank that timed out itself is a
    link of the chain), else the first."""
    if not errors:
        return None
    reported = {r for r, _, _ in errors}
    primary = [e for e in errors if not any(s in e[1] + e[2] for s in SECONDARY_ERRORS)]
    busy = [e for e in errors if "computing" in e[1]]
    on_silent = [e for e in errors if waits_on(e[1]) - reported - {e[0]}]
    return (primary or busy or on_silent or errors)[0]


def _raise_first_cause(procs, finished, errors, out, patience_s: float, grace_s: float = 1.0) -> None:
    """After the first sign of failure, wait briefly and blame the root cause: a rank that
    died, else :func:`root_cause`. While every report is a timed-out wait and some live rank
    has said nothing, wait up to ``patience_s`` more: ranks time out at their own pace, and the
    report that ends the chain (a wait on the silent rank) may come last."""
    start = time.monotonic()
    while True:
        try:
            kind, rank, payload = out.get(timeout=0.05)
            if kind == "error":
                errors.append((rank, *payload))
        except queue.Empty:
            pass
        waited = time.monotonic() - start
        if waited < grace_s:
            continue
        dead = [r for r, p in enumerate(procs) if r not in finished and not p.is_alive() and p.exitcode != 0]
        reported = {r for r, _, _ in errors}
        for r in dead:
            if r not in reported:
                raise WorkerFailed(r, f"process died with exit code {procs[r].exitcode}")
        cause = root_cause(errors)
        chained = cause is not None and any(s in cause[1] + cause[2] for s in SECONDARY_ERRORS) \
            and "computing" not in cause[1]
        quiet = [r for r, p in enumerate(procs) if r not in reported and r not in finished and p.is_alive()]
        if cause is not None and (not chained or waited >= grace_s + patience_s or not quiet
                                  or len(quiet) == 1 and waits_on(cause[1]) - reported - {cause[0]}):
            raise WorkerFailed(*cause)
        if cause is None:
            return


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
                    _raise_first_cause(procs, finished, errors, out, min(job.timeout_s, 10.0))
                if time.monotonic() - last_progress > patience:
                    stuck = [r for r in range(len(procs)) if r not in finished]
                    raise WorkerFailed(stuck[0], f"no progress for {patience:.0f}s (ranks {stuck} stalled)")
                continue
            last_progress = time.monotonic()
            if kind == "error":
                errors.append((rank, *payload))
                _raise_first_cause(procs, finished, errors, out, min(job.timeout_s, 10.0))
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
