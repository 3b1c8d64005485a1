"""A host framework's trainer on N Ray actors, one per rank (what ``piper launch`` runs).

Invariants:

* every actor runs its :class:`HostRank` subclass's ``main(argv)`` in-process with the
  torch.distributed env torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT: a free port on rank 0's node; ranks of one node are contiguous),
  the driver's working directory when it exists there, and 1 torch thread;
* each rank's stdout/stderr (file descriptors 1 and 2, so C++ output too) reaches the driver's
  stdout as ``(rank R) <line>``, and still lands in Ray's worker log;
* the job ends when every rank returned; a failing rank (exception, non-zero exit, dead actor)
  ends it with :class:`WorkerFailed` naming the earliest failure and its traceback; no output
  from any rank for ``timeout_s`` seconds ends it too; either way every actor is killed, and a
  Ray started here is shut down.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Sequence, TextIO

from piper_plugin.runtime.launch.processes import WorkerFailed
from piper_plugin.runtime.launch.ray_actors import start_ray

__all__ = ["HostRank", "launch_host"]

_POLL_S = 0.5  # how often the driver collects output
_GRACE_S = 3.0  # after a failure, how long to wait for other ranks' results (to name the earliest)


# -- the actor -----------------------------------------------------------------------------------
class _Capture:
    """Routes file descriptors 1 and 2 through a pipe: every line is kept for :meth:`take` and
    still written to the original stdout (Ray's worker log)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._saved: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        self._saved = (os.dup(1), os.dup(2))
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True, name="piper-capture")
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for raw in pipe:
                try:
                    os.write(self._saved[0], raw)
                except OSError:
                    pass
                with self._lock:
                    self._lines.append(raw.decode(errors="replace").rstrip("\r\n"))

    def stop(self) -> None:
        """Restore fds 1 and 2; the pipe then reaches EOF and every line is in :meth:`take`."""
        if self._saved is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        self._reader.join(timeout=5)

    def take(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


class HostRank:
    """One rank of a host framework's trainer, as a Ray actor: ``where`` (node, and a free port
    for the rendezvous), ``run`` (the trainer: ``main(argv)``, which every host's subclass
    defines; :func:`launch_host` refuses a class without it), ``drain`` (output lines since the
    last call; answers while ``run`` is busy)."""

    program = "the trainer"

    def __init__(self) -> None:
        self._capture = _Capture()

    def where(self) -> tuple[str, str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, env: dict[str, str], argv: list[str], cwd: str) -> dict[str, Any]:
        os.environ.update(env)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        self._capture.start()
        result: dict[str, Any] = {"ok": True}
        try:
            self.main(argv)
        except SystemExit as exc:  # argument errors exit; --help exits 0
            if exc.code not in (None, 0):
                result = {"ok": False, "error": f"{self.program} exited with status {exc.code}",
                          "traceback": traceback.format_exc()}
        except BaseException as exc:  # noqa: BLE001 - reported to the driver with its traceback
            lines = traceback.format_exception_only(type(exc), exc)
            result = {"ok": False, "error": lines[-1].strip() if lines else repr(exc),
                      "traceback": traceback.format_exc()}
        finally:
            self._capture.stop()
        result["time"] = time.time()
        return result

    def drain(self) -> list[str]:
        return self._capture.take()


# -- the driver ----------------------------------------------------------------------------------
def _layout(places: list[tuple[str, str, int]]) -> tuple[list[int], dict[int, dict[str, str]]]:
    """Actor order by rank (ranks of one node contiguous, nodes in order of first appearance) and
    each rank's torch.distributed env."""
    nodes: dict[str, list[int]] = {}
    for actor, (node, _, _) in enumerate(places):
        nodes.setdefault(node, []).append(actor)
    order = [actor for members in nodes.values() for actor in members]
    first = places[order[0]]
    single_node = len(nodes) == 1
    common = {"WORLD_SIZE": str(len(places)), "MASTER_ADDR": "127.0.0.1" if single_node else first[1],
              "MASTER_PORT": str(first[2]), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if single_node:
        common["GLOO_SOCKET_IFNAME"] = "lo"
    envs = {}
    for rank, actor in enumerate(order):
        members = nodes[places[actor][0]]
        envs[rank] = {**common, "RANK": str(rank), "LOCAL_RANK": str(members.index(actor)),
                      "LOCAL_WORLD_SIZE": str(len(members))}
    return order, envs


class _Forwarder:
    """Keeps one ``drain`` call in flight per rank and prints what comes back, prefixed."""

    def __init__(self, actors: list, out: TextIO) -> None:
        self.actors, self.out = actors, out
        self.inflight: dict[int, Any] = {}
        self.last_line = time.monotonic()

    def poll(self, wait_s: float = 0.0) -> None:
        import ray

        for rank, actor in enumerate(self.actors):
            if rank not in self.inflight:
                self.inflight[rank] = actor.drain.remote()
        refs = {ref: rank for rank, ref in self.inflight.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in done:
            rank = refs[ref]
            del self.inflight[rank]
            try:
                lines = ray.get(ref)
            except ray.exceptions.RayError:  # a dead actor: its run() result reports it
                continue
            for line in lines:
                self.out.write(f"(rank {rank}) {line}\n")
            if lines:
                self.out.flush()
                self.last_line = time.monotonic()

    def flush(self, wait_s: float = 2.0) -> None:
        """Collect the answers in flight, then ask every rank once more (a returned rank answers all)."""
        self.poll(wait_s)
        self.poll(wait_s)


def launch_host(nproc: int, argv: Sequence[str], rank_cls: type, *, address: str | None = None,
                timeout_s: float = 600.0, start_timeout_s: float | None = None, out: TextIO | None = None) -> None:
    """Run ``rank_cls().main(argv)`` (a :class:`HostRank` subclass) on ``nproc`` Ray actors, one per
    rank, with torchrun's environment; raises WorkerFailed. ``timeout_s`` bounds every silence of all
    ranks, ``start_timeout_s`` (default ``timeout_s``) the actors' placement and start."""
    if not callable(getattr(rank_cls, "main", None)):
        raise TypeError(f"{rank_cls.__name__} names no trainer: define main(self, argv) on it")
    out = out or sys.stdout
    owned = start_ray(address, num_cpus=max(2, os.cpu_count() or 2))
    import ray

    cpus = min(1.0, float(ray.cluster_resources().get("CPU", 1.0)) / nproc)
    cls = ray.remote(num_cpus=cpus, max_concurrency=2)(rank_cls)
    actors = [cls.remote() for _ in range(nproc)]
    try:
        refs = [a.where.remote() for a in actors]
        start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        done, _ = ray.wait(refs, num_returns=nproc, timeout=start_timeout_s)
        if len(done) < nproc:
            raise WorkerFailed(None, f"only {len(done)} of {nproc} actors started within {start_timeout_s:.0f}s "
                                     f"(--timeout); the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs")
        try:
            places = ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise WorkerFailed(None, f"an actor failed to start: {str(exc).strip().splitlines()[0]}") from None
        order, envs = _layout(places)
        actors = [actors[i] for i in order]  # index = rank
        cwd = os.getcwd()
        runs = {a.run.remote(envs[rank], list(argv), cwd): rank for rank, a in enumerate(actors)}
        _wait(runs, _Forwarder(actors, out), timeout_s)
    finally:
        for actor in actors:
            ray.kill(actor)
        if owned:
            ray.shutdown()


def _wait(runs: dict, forward: _Forwarder, timeout_s: float) -> None:
    """Until every rank returned: forward output, and fail on the first failure or a silent stall."""
    import ray

    failures: list[tuple[float, int, str, str]] = []
    failed_at = None
    while runs:
        done, _ = ray.wait(list(runs), num_returns=len(runs), timeout=_POLL_S)
        forward.poll(_POLL_S / 2)
        for ref in done:
            rank = runs.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:
                result = {"ok": False, "time": time.time(), "traceback": "",
                          "error": f"actor died: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"}
            if not result["ok"]:
                failures.append((result["time"], rank, result["error"], result["traceback"]))
                failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        if failures and (not runs or now - failed_at > _GRACE_S):
            break
        if runs and not failures and now - forward.last_line > timeout_s:
            raise WorkerFailed(min(runs.values()), f"no output from any rank for {timeout_s:.0f}s (--timeout); "
                                                   f"ranks {sorted(runs.values())} still running")
    forward.flush()  # the last lines (a failed rank's own error output among them)
    if failures:
        _, rank, error, details = min(failures)
        raise WorkerFailed(rank, error, details)
