"""Launch mode SPMD: inside processes someone else started (torchrun, a host framework).

Every rank compiles the same plan from the same job; before step 1 the ranks compare plan
hashes, so a rank that compiled something else (other code, other flags) stops the job with
both hashes named instead of deadlocking later.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from piper_plugin.runtime.job import Job, compile_job

__all__ = ["run_spmd", "PlanMismatch", "check_plan_hash"]


class PlanMismatch(RuntimeError):
    pass


def check_plan_hash(plan, replicas: int = 1) -> None:
    """Every process compiled the same plan, and the job has its ranks once per ``replicas``
    (data-parallel copies of the plan a host framework reduces itself)."""
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan.hash())
    if len(set(hashes)) != 1:
        raise PlanMismatch(f"ranks compiled different plans (hash per rank: {hashes}); run the same code "
                           f"and flags on every rank")
    if plan.grid.world_size * replicas != dist.get_world_size():
        copies = f" x {replicas} replicas" if replicas > 1 else ""
        raise PlanMismatch(f"the plan needs {plan.grid.world_size} ranks (pp x dp x ep){copies} but the job has "
                           f"{dist.get_world_size()}; set --nproc_per_node accordingly")


def run_spmd(job: Job, *, on_metrics: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Compile here, check the plan hash across ranks, then train ``job.steps`` steps."""
    from piper_plugin.runtime.launch.processes import _final
    from piper_plugin.runtime.worker import Worker, device_for, init_distributed

    rank = int(os.environ.get("RANK", 0)) if not dist.is_initialized() else dist.get_rank()
    init_distributed(device_for(job.device, rank), job.timeout_s)  # NCCL for --device cuda
    program, _, plan, _ = compile_job(job)
    check_plan_hash(plan)
    worker = Worker(dist.get_rank(), job, program, plan)
    for _ in range(job.steps):
        metrics = worker.step()
        if on_metrics:
            on_metrics(metrics)
    return _final(worker)
