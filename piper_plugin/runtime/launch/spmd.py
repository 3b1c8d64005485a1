"""Launch mode SPMD: inside processes someone else started (torchrun, a host framework).

Every rank compiles the same plan from the same job; before step 1 the ranks compare plan
hashes (the :class:`Executor` does as it starts), so a rank that compiled something else (other code, other flags) stops the job with
both hashes named instead of deadlocking later.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job

__all__ = ["run_spmd"]


def run_spmd(job: Job, *, on_metrics: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Compile here, check the plan hash across ranks, then train ``job.steps`` steps."""
    from piper_plugin.runtime.launch.processes import _final
    from piper_plugin.runtime.worker import Worker, device_for, init_distributed

    rank = int(os.environ.get("RANK", 0)) if not dist.is_initialized() else dist.get_rank()
    init_distributed(device_for(job.device, rank), job.timeout_s)  # NCCL for --device cuda
    program, _, plan, _ = compile_job(job)
    worker = Worker(dist.get_rank(), job, program, plan)
    for _ in range(job.first_step, job.steps):
        metrics = worker.step()
        if on_metrics:
            on_metrics(metrics)
    return _final(worker)
