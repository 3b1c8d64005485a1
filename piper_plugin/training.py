"""Training the toy LMs on the shipped dataset: the job behind ``piper train``.

``toy_job`` builds a :class:`Job` whose callables are plain module functions (so Ray can
ship them); ``run`` executes any job with a launch mode: ``ray`` (default), ``fork`` (local
processes) or ``spmd`` (inside torchrun).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from piper_plugin.data.text import TextBatches, vocab_size
from piper_plugin.models import TOY_MODELS, lm_loss
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job

__all__ = ["toy_job", "run", "RunResult", "LAUNCHERS"]

LAUNCHERS = ("ray", "fork", "spmd")


def _toy_model(name: str, stages: int, layers: int, seq: int) -> nn.Module:
    model, _ = TOY_MODELS[name](stages=stages, layers=layers, vocab=vocab_size(), seq=seq)
    return model


def _text(batch: int, seq: int, seed: int):
    return TextBatches(batch, seq, seed=seed)


def _adamw(lr: float, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def toy_job(schedule_fn: Callable, *, model: str = "toy-lm", stages: int, layers: int | None = None,
            batch: int, seq: int = 32, steps: int = 10, lr: float = 3e-3, seed: int = 0,
            timeout_s: float = 60.0, optimizer_fn: Callable | None = None,
            lr_scheduler_fn: Callable | None = None, device: str = "cpu", **options: Any) -> Job:
    """The toy LM ``model`` trained on the shipped text; ``options``: further :class:`Job`
    fields (checkpointing)."""
    return Job(model_fn=functools.partial(_toy_model, model, stages, max(layers or stages, stages), seq),
               loss_fn=lm_loss, data_fn=functools.partial(_text, batch, seq),
               schedule_fn=schedule_fn, optimizer_fn=optimizer_fn or functools.partial(_adamw, lr),
               lr_scheduler_fn=lr_scheduler_fn, steps=steps, seed=seed, timeout_s=timeout_s, device=device,
               **options)


@dataclass
class RunResult:
    metrics: list[dict[str, Any]]
    per_rank: dict[int, Any] = field(default_factory=dict)
    plan: Any = None
    simulated: Any = None


def run(job: Job, *, launcher: str = "ray", address: str | None = None,
        on_metrics: Callable[[dict], None] | None = None) -> RunResult:
    metrics: list[dict[str, Any]] = []

    def record(m: dict) -> None:
        metrics.append(m)
        if on_metrics:
            on_metrics(m)

    if launcher == "spmd":
        from piper_plugin.runtime.launch.spmd import run_spmd

        final = run_spmd(job, on_metrics=record)
        return RunResult(metrics, {0: final})
    program, _, plan, simulated = compile_job(job)
    if launcher == "fork":
        from piper_plugin.runtime.launch.processes import run_forked

        per_rank = run_forked(job, program, plan, on_metrics=record)
    elif launcher == "ray":
        from piper_plugin.runtime.launch.ray_actors import run_ray

        per_rank = run_ray(job, program, plan, address=address, on_metrics=record)
    else:
        raise ValueError(f"unknown launcher {launcher!r}; use one of {LAUNCHERS}")
    return RunResult(metrics, per_rank, plan, simulated)
