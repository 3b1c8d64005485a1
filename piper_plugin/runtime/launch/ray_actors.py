"""Launch mode Ray (the default of ``piper`` commands): one actor per rank.

The driver compiles once and ships each actor the compiled plan once; actors own their
torch.distributed groups and run a whole training step per call (never one call per task).
Without ``address`` a quiet local Ray starts (and stops) here; with one, the job joins that
cluster, which is how it spans machines. Failures of any actor (exception, death, stall past
``job.timeout_s``) kill every actor and raise :class:`WorkerFailed` with the rank and the
original traceback.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import (
    WorkerFailed, free_port, headline, local_rendezvous, root_cause,
)

__all__ = ["run_ray", "start_ray"]


# Ray's own processes compete with the ranks for the cores (a 2-core machine has no spare):
# nothing Piper does not read is started, collected or reported.
_LEAN_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_IMPORT_WARNING": "1",
             "RAY_LOGGER_LEVEL": "warning"}  # read when ray is first imported: no "Started a local Ray" line
_LEAN_SYSTEM_CONFIG = {"enable_metrics_collection": False, "enable_timeline": False, "event_stats": False,
                       "task_events_report_interval_ms": 0}


def start_ray(address: str | None, num_cpus: int, runtime_env: dict | None = None) -> bool:
    """Start a lean local Ray (True) or connect to ``address`` (False: not ours to stop).

    Lean and quiet: no dashboard, usage stats, metrics, timeline or task events, no INFO lines
    (when ray is first imported here). ``address`` HOST:PORT where nothing answers fails in seconds with
    :class:`ConnectionError` (ray.init would retry for minutes). ``runtime_env`` (Ray's own
    option) lets actors import the caller's modules, e.g.
    ``{"env_vars": {"PYTHONPATH": "/path/to/my/code"}}``.
    """
    for key, value in _LEAN_ENV.items():
        os.environ.setdefault(key, value)
    if address:
        _check_reachable(address)
        # the port answered, so its GCS is up: a refused driver is told in 5 s (Ray retries ~20 by default)
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "5")
    elif "ray" not in sys.modules:  # read as ray is imported: a one-machine cluster keeps to the loopback
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        _join(ray, address, runtime_env)
        return False
    temp_dir = tempfile.mkdtemp(prefix="piper_ray_", dir="/tmp")
    # the node's address is the loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 above): every server
    # of the local cluster (GCS, raylet, object manager, workers, agents) listens on 127.0.0.1
    # alone; Ray's own token authentication stays as the user set it (RAY_AUTH_MODE)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20, _temp_dir=temp_dir, runtime_env=runtime_env,
             _system_config=_LEAN_SYSTEM_CONFIG)
    atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    return True


_TOKEN_FIX = ("a cluster started with `ray get-auth-token --generate` then `RAY_AUTH_MODE=token ray start --head` "
              "is joined with RAY_AUTH_MODE=token here and its token in RAY_AUTH_TOKEN (or ~/.ray/auth_token, "
              "or the file RAY_AUTH_TOKEN_PATH names)")
_warned_unauthenticated: set[str] = set()


def _join(ray, address: str, runtime_env: dict | None) -> None:
    """Join the cluster at ``address`` (its port answers). A refused driver (a missing or wrong
    token) fails in seconds with :class:`ConnectionError` naming the fix; joining without a
    token is said once per address: that cluster runs code for anyone who reaches it."""
    try:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:  # no token, or one the GCS refused
        raise ConnectionError(f"Ray address {address}: the cluster there did not accept this driver "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); {_TOKEN_FIX}") from None
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token" and address not in _warned_unauthenticated:
        _warned_unauthenticated.add(address)
        print(f"piper: warning: the Ray cluster at {address} accepted this driver without a token: anyone who "
              f"can reach its ports can run code on it; {_TOKEN_FIX}", file=sys.stderr, flush=True)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    import re
    import socket

    match = re.fullmatch(r"(?:ray://)?\[?([^\[\]]+?)\]?:(\d+)", address)
    if not match:  # "auto" and other forms: left to Ray
        return
    host, port = match.group(1), int(match.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"Ray address {address}: cannot reach a Ray cluster there ({exc.strerror or exc}); "
                              f"start one and pass the address it prints: {_TOKEN_FIX}") from None


class RankActor:
    """Hosts one :class:`Worker`; ``max_concurrency=2`` keeps it answering while busy."""

    def endpoint(self, local: bool) -> tuple[str, int]:
        import ray

        return ("127.0.0.1" if local else ray.util.get_node_ip_address()), free_port()

    def setup(self, rank: int, job: Job, program, plan, init_method: str, local: bool) -> int:
        if local:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        from piper_plugin.runtime.worker import Worker

        self.worker = Worker(rank, job, program, plan, init_method=init_method)
        return os.getpid()

    def step(self) -> dict[str, Any]:
        return self.worker.step()

    def status(self) -> str:
        worker = getattr(self, "worker", None)
        return f"step {worker.step_index}: {worker.runner.status()}" if worker is not None else "setting up"

    def final(self) -> dict[str, Any]:
        from piper_plugin.runtime.launch.processes import _final

        return _final(self.worker)


def _wait(refs: list, ranks: list[int], job: Job, actors: list) -> list[Any]:
    """Every rank's result, or :class:`WorkerFailed` for the root cause of the first failure.
    The driver waits ``job.timeout_s`` + 5 s for progress, so ranks report their own timeouts
    first (they name the peer they waited for); past that it names each stalled rank's streams."""
    import ray

    patience = job.timeout_s + 5
    deadline = time.monotonic() + patience
    pending = dict(zip(refs, ranks))
    results: dict[int, Any] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            stuck = sorted(pending.values())
            raise WorkerFailed(stuck[0], f"no progress for {patience:.0f}s (ranks {stuck} stalled); "
                               + _statuses(actors, stuck))
        for ref in done:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                raise _root_cause([_failure(rank, exc)] + _more_failures(pending)) from None
    return [results[r] for r in ranks]


def _failure(rank: int, exc: Exception) -> WorkerFailed:
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        return WorkerFailed(rank, headline(cause), getattr(cause, "details", "") or str(exc))
    return WorkerFailed(rank, f"actor died: {str(exc).splitlines()[0]}")


def _more_failures(pending: dict, grace_s: float = 1.0) -> list[WorkerFailed]:
    """Failures of other ranks within ``grace_s`` of the first (a peer's failure often makes
    its neighbours fail too; the root cause may come in second)."""
    import ray

    found, deadline = [], time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            rank = pending.pop(ref)
            try:
                ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                found.append(_failure(rank, exc))
    return found


def _root_cause(failures: list[WorkerFailed]) -> WorkerFailed:
    """A rank that died, else :func:`~piper_plugin.runtime.launch.processes.root_cause`."""
    died = [f for f in failures if "actor died" in str(f)]
    if died:
        return died[0]
    reports = [(f.rank, str(f).split("\n")[0], f.details) for f in failures]
    return failures[reports.index(root_cause(reports))]


def _statuses(actors: list, ranks: list[int], timeout_s: float = 2.0) -> str:
    """Each stalled rank's streams, asked while it is stuck (actors answer while busy)."""
    import ray

    refs = {r: actors[r].status.remote() for r in ranks}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    lines = []
    for r, ref in refs.items():
        try:
            lines.append(f"rank {r}: {ray.get(ref, timeout=0)}")
        except Exception:  # noqa: BLE001 - a dead or unresponsive actor says nothing
            lines.append(f"rank {r}: no answer")
    return "; ".join(lines)


def _started(actors: list, timeout_s: float = 120.0) -> None:
    """Every actor's process is up (spawning one imports torch: seconds on a busy machine, not
    part of ``job.timeout_s``, which bounds a step's progress); else :class:`WorkerFailed`."""
    import ray

    refs = [a.status.remote() for a in actors]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(done) < len(refs):
        cpus = ray.cluster_resources().get("CPU", 0)
        raise WorkerFailed(None, f"only {len(done)} of {len(refs)} rank actors started within {timeout_s:.0f}s; "
                                 f"the Ray cluster has {cpus:g} CPUs")
    try:
        ray.get(done)
    except ray.exceptions.RayActorError as exc:
        raise WorkerFailed(None, f"a rank actor failed to start: {str(exc).splitlines()[0]}") from None


def run_ray(job: Job, program, plan, *, address: str | None = None,
            on_metrics: Callable[[dict], None] | None = None) -> dict[int, Any]:
    owned = start_ray(address, num_cpus=max(2, os.cpu_count() or 2))
    import ray

    local = address is None
    world = plan.grid.world_size
    gpus = 1 if job.device == "cuda" else 0  # Ray sets CUDA_VISIBLE_DEVICES: each actor sees its own GPU
    cls = ray.remote(num_cpus=min(1.0, (os.cpu_count() or 2) / world), num_gpus=gpus, max_concurrency=2)(RankActor)
    actors = [cls.remote() for _ in range(world)]
    ranks = list(range(world))
    folder = None
    try:
        _started(actors)
        if local:  # a file store: nothing listens for the rendezvous
            init_method, folder = local_rendezvous()
        else:
            host, port = ray.get(actors[0].endpoint.remote(local))
            init_method, folder = f"tcp://{host}:{port}", None
        setup = [a.setup.remote(r, job, program, plan, init_method, local) for r, a in enumerate(actors)]
        _wait(setup, ranks, job, actors)
        for _ in range(job.first_step, job.steps):
            for metrics in _wait([a.step.remote() for a in actors], ranks, job, actors):
                if on_metrics:
                    on_metrics(metrics)
        return dict(enumerate(_wait([a.final.remote() for a in actors], ranks, job, actors)))
    finally:
        for actor in actors:
            ray.kill(actor)
        if owned:
            ray.shutdown()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
