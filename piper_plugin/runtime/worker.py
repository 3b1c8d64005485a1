"""A rank of one of Piper's own launchers: a :class:`Job`'s model and data around an Executor.

Every launch mode (forked processes, Ray actors, torchrun) runs this same class. Plans arrive
compiled; the worker checks nothing about recipes. Per step it feeds the global batch to its
:class:`Executor` (which takes its data shard and runs the rank's plan), steps its LR
schedulers and reports the metrics: loss (the global mean, on last-stage ranks), step time,
tokens/s, peak memory and the process's resident memory.
"""
from __future__ import annotations

import gc
import math
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from piper_plugin.ir.capture import Program
from piper_plugin.runtime.executor import Executor, ExecutorConfig
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.memory import tensor_bytes
from piper_plugin.runtime.train_checkpoint import load_checkpoint, save_checkpoint
from piper_plugin.runtime.value_specs import probe_values
from piper_plugin.scheduler.plan import Plan

__all__ = ["Worker", "device_for", "init_distributed"]


class Worker:
    """Rank ``rank`` of a :class:`Job`: builds the model as single-device training would, runs
    an :class:`Executor` over the job's data and reports each step's metrics."""

    def __init__(self, rank: int, job: Job, program: Program, plan: Plan, init_method: str | None = None):
        self.rank, self.job, self.plan = rank, job, plan
        torch.set_num_threads(1)
        self.device = device_for(job.device, rank)
        init_distributed(self.device, job.timeout_s, init_method=init_method, rank=rank,
                         world_size=plan.grid.world_size)
        model = job.build_model().to(self.device)  # initialised on the CPU like single-device runs
        self.data = iter(job.data_fn(job.seed))
        first = next(iter(job.data_fn(job.seed)))
        self.tokens_per_step = first[0].numel()
        micro = {name: t.chunk(plan.grid.data_shards)[0].chunk(plan.microbatches)[0]
                 for name, t in zip(program.input_names, first)}
        with torch.device("meta"):
            meta_model = job.model_fn()
        specs = probe_values(program, meta_model, job.loss_fn, micro, autocast=job.autocast, device=self.device)
        self.executor = Executor(plan, program, rank, model, job.loss_fn, specs=specs, optimizer_fn=job.optimizer_fn,
                                 config=ExecutorConfig(timeout_s=job.timeout_s, capture_grads=job.capture_grads,
                                                       skip_nonfinite_loss=job.on_nonfinite_loss == "skip",
                                                       autocast=job.autocast))
        self.state, self.comm, self.runner = self.executor.state, self.executor.comm, self.executor.runner
        self.schedulers = [job.lr_scheduler_fn(o) for o in self.state.optimizers.values()] if job.lr_scheduler_fn else []
        self.loss_group = self._loss_group(program)
        self.step_index = 0
        if job.resume_from:
            self._resume(job.resume_from)
        self.step_base_bytes = 0  # allocated when the current step began (GPU)
        gc.collect()
        gc.freeze()  # model, plan and DAG live for the whole job: keep them out of every collection

    def _resume(self, path: str) -> None:
        """Continue from a checkpoint: its parameters, optimizer state and RNG, the data after
        the batches it consumed, every LR schedule replayed to its step."""
        self.step_index = load_checkpoint(self.executor, Path(path))
        if self.step_index != self.job.first_step:
            raise ValueError(f"checkpoint {path} is at step {self.step_index}, the job expects {self.job.first_step}")
        for _ in range(self.step_index):
            next(self.data)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": a replay
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(self.step_index):
                for scheduler in self.schedulers:
                    scheduler.step()

    def _loss_group(self, program: Program):
        """All ranks holding the loss region, so every last-stage rank reports the global loss."""
        ranks = self.plan.grid.slice(self.plan.dag.meta.placement[program.loss_region])
        group = dist.new_group(list(ranks))  # collective: every rank creates it
        return group if self.rank in ranks else None

    def step(self) -> dict[str, Any]:
        microbatches = self.executor.shard(dict(zip(self.state.input_names, next(self.data))))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step_base_bytes = torch.cuda.memory_allocated(self.device)
        rss_start = _reset_peak_rss()
        start = time.perf_counter()
        losses = self.executor.step(microbatches=microbatches)
        del microbatches
        for scheduler in self.schedulers:
            scheduler.step()
        elapsed = time.perf_counter() - start
        metrics: dict[str, Any] = {"step": self.step_index, "rank": self.rank, "step_time_s": elapsed,
                                   "tokens_per_s": self.tokens_per_step / elapsed,
                                   "peak_memory_bytes": self.peak_memory(),
                                   "transient_peak_bytes": self.transient_peak()}
        rss, peak = _status_bytes("VmRSS:", "VmHWM:")
        metrics["rss_bytes"] = rss
        if rss_start is not None and peak is not None:  # the kernel's count, independent of the meter
            metrics["rss_step_peak_bytes"] = peak - rss_start
        if self.loss_group is not None:
            loss = torch.stack(losses).sum().reshape(1)
            dist.all_reduce(loss, group=self.loss_group)
            metrics["loss"] = loss.item()
            if not math.isfinite(metrics["loss"]) and self.job.on_nonfinite_loss == "stop":
                raise FloatingPointError(f"step {self.step_index + 1}: the loss is {metrics['loss']} on rank {self.rank}; "
                                         f"the job stops here (no checkpoint after this step); skip such steps "
                                         f"instead with --on-nan skip")
        if self.executor.gate is not None and self.executor.gate.skipped:
            metrics["skipped"] = True
        if self.job.capture_grads:  # this step's reduced gradients and the parameters after it
            metrics["grad_pieces"] = [p for ps in self.state.grad_pieces.values() for p in ps]
            metrics["param_pieces"] = self.state.param_pieces()
        self.step_index += 1
        every, job = self.job.checkpoint_every, self.job
        if job.checkpoint_dir and (self.step_index == job.steps or (every and self.step_index % every == 0)):
            saved = save_checkpoint(self.executor, Path(job.checkpoint_dir), self.step_index, job.description)
            if self.rank == 0:
                metrics["checkpoint"] = str(saved)
        return metrics

    def peak_memory(self) -> int:
        """The allocator's own peak on a GPU; kept state plus the measured transient peak on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.kept_bytes() + self.state.meter.peak

    def transient_peak(self) -> int:
        """This step's peak above the state the rank keeps: activations, messages, gathered
        ZeRO-3 buckets, per-microbatch gradients. On a GPU: the allocator's peak above what was
        allocated when the step began (parameters, optimizer state, library workspaces) and the
        gradients the step makes (UPDATE frees them); on a CPU: the meter's peak."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.step_base_bytes - self.grad_bytes()
        return self.state.meter.peak

    def kept_bytes(self) -> int:
        """Parameters, gradients and optimizer state this rank keeps through a step."""
        tensors = []
        for bucket in self.state.buckets.values():
            tensors += [bucket.flat] + ([bucket.shard_flat] if bucket.shard_flat is not None else [])
        tensors += list(self.state.unbucketed().values())
        for optimizer in self.state.optimizers.values():
            for per_param in optimizer.state.values():
                tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return tensor_bytes(tensors) + self.grad_bytes()

    def grad_bytes(self) -> int:
        """Gradients, by size (UPDATE frees them after every step): the parameters' below ZeRO-2,
        the shard's from ZeRO-2 on (full ones come and go per microbatch)."""
        total = sum((b.shard_numel if b.zero >= 2 else b.numel) * b.flat.element_size()
                    for b in self.state.buckets.values())
        return total + sum(p.numel() * p.element_size() for p in self.state.unbucketed().values() if p.requires_grad)


def _status_bytes(*fields: str) -> tuple[int | None, ...]:
    """Sizes from ``/proc/self/status`` (Linux; None elsewhere), one read: ``VmRSS`` is the resident
    memory now (what a leak outside the meter's view, such as Python objects, traces or message
    buffers, would grow), ``VmHWM`` its peak since the last :func:`_reset_peak_rss`."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(fields):
                    key, kib = line.split()[:2]
                    found[key] = int(kib) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return tuple(found.get(field) for field in fields)


def _reset_peak_rss() -> int | None:
    """Reset the kernel's peak resident size of this process to its current size (Linux:
    ``/proc/self/clear_refs``) and return that size; None where the kernel offers no reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS:")[0]


def init_distributed(device: torch.device, timeout_s: float, **kwargs: Any) -> None:
    """The default process group for ``device``, unless one exists: gloo on a CPU; on a GPU,
    NCCL bound to this rank's device, so every communicator is created when its group is
    (in the same order on every rank), not lazily by its first operation."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                            **kwargs)


def device_for(kind: str, rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device {kind!r} is not available here; use 'cpu'" if kind == "cuda"
                         else f"unknown device {kind!r}; use 'cpu' or 'cuda'")
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    return torch.device("cuda", local)
