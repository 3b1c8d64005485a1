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
import tempfile
import time
from typing import Any, Callable

from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import WorkerFailed, free_port

__all__ = ["run_ray", "start_ray"]


def start_ray(address: str | None, num_cpus: int, runtime_env: dict | None = None) -> bool:
    """Start a quiet local Ray (True) or connect to ``address`` (False: not ours to stop).

    ``runtime_env`` (Ray's own option) lets actors import the caller's modules, e.g.
    ``{"env_vars": {"PYTHONPATH": "/path/to/my/code"}}``.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
        return False
    temp_dir = tempfile.mkdtemp(prefix="piper_ray_", dir="/tmp")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20, _temp_dir=temp_dir, runtime_env=runtime_env)
    atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    return True


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

    def final(self) -> dict[str, Any]:
        from piper_plugin.runtime.launch.processes import _final

        return _final(self.worker)


def _wait(refs: list, ranks: list[int], job: Job, actors: list) -> list[Any]:
    import ray

    deadline = time.monotonic() + job.timeout_s
    pending = dict(zip(refs, ranks))
    results: dict[int, Any] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise WorkerFailed(min(pending.values()), f"no progress for {job.timeout_s:.0f}s "
                               f"(ranks {sorted(pending.values())} stalled)")
        for ref in done:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause
                raise WorkerFailed(rank, repr(cause).split("\n")[0], getattr(cause, "details", "") or str(exc)) from None
            except ray.exceptions.RayActorError as exc:
                raise WorkerFailed(rank, f"actor died: {str(exc).splitlines()[0]}") from None
    return [results[r] for r in ranks]


def run_ray(job: Job, program, plan, *, address: str | None = None,
            on_metrics: Callable[[dict], None] | None = None) -> dict[int, Any]:
    import ray

    owned = start_ray(address, num_cpus=max(2, os.cpu_count() or 2))
    local = address is None
    world = plan.grid.world_size
    gpus = 1 if job.device == "cuda" else 0  # Ray sets CUDA_VISIBLE_DEVICES: each actor sees its own GPU
    cls = ray.remote(num_cpus=min(1.0, (os.cpu_count() or 2) / world), num_gpus=gpus, max_concurrency=2)(RankActor)
    actors = [cls.remote() for _ in range(world)]
    ranks = list(range(world))
    try:
        host, port = ray.get(actors[0].endpoint.remote(local), timeout=job.timeout_s)
        setup = [a.setup.remote(r, job, program, plan, f"tcp://{host}:{port}", local) for r, a in enumerate(actors)]
        _wait(setup, ranks, job, actors)
        for _ in range(job.steps):
            for metrics in _wait([a.step.remote() for a in actors], ranks, job, actors):
                if on_metrics:
                    on_metrics(metrics)
        return dict(enumerate(_wait([a.final.remote() for a in actors], ranks, job, actors)))
    finally:
        for actor in actors:
            ray.kill(actor)
        if owned:
            ray.shutdown()
