"""A distributed run against single-device training: the worst relative errors.

The reference trains ``job``'s model the plain way (same seed, same batches, the job's own
optimizer and LR scheduler) on the CPU: plain PyTorch, no Piper code; in fp32 on whole batches,
or, for a job under bf16 autocast, by plain gradient accumulation over the microbatches the plan
cuts (bf16 rounds each microbatch's products, so that is the run a strategy must equal). A run is compared
by every step's loss as the last-stage ranks reported it, and by the gradients and parameters
stitched whole from the pieces every rank captured (``Job.capture_grads``): every step's
gradients and the parameters after it, each by name, every data-parallel replica compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from piper_plugin import Job, ParamList, stitch

__all__ = ["ParityErrors", "rel", "single_device_errors"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| (the fp32 parity metric)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@dataclass
class ParityErrors:
    loss: float = 0.0
    grad: float = 0.0
    param: float = 0.0
    where: dict[str, str] = field(default_factory=dict)  # what the worst error of each kind is in
    steps: dict[int, dict[str, float]] = field(default_factory=dict)  # the worst of each kind per step

    def note(self, kind: str, err: float, where: str, step: int | None = None) -> None:
        if step is not None:
            mine = self.steps.setdefault(step, {})
            mine[kind] = max(mine.get(kind, 0.0), err)
        if err >= getattr(self, kind):
            setattr(self, kind, err)
            self.where[kind] = where

    def worst(self) -> float:
        return max(self.loss, self.grad, self.param)


def single_device_errors(job: Job, metrics: list[dict[str, Any]], per_rank: dict[int, dict[str, Any]],
                         accumulate: int = 1, device: str = "cpu") -> ParityErrors:
    """Train ``job.steps`` steps on one device and compare every step; raises when a step has no
    loss or the ranks' pieces do not cover every parameter. ``per_rank`` (the ranks' final
    results) is compared after the last step too, when it holds pieces. ``accumulate``: the
    reference cuts each batch into this many equal slices and accumulates their gradients
    (each slice's loss / ``accumulate``), as a plain gradient-accumulation loop does. ``device``:
    where the reference trains (a float8 model on a GPU is compared with float8 on that GPU)."""
    reference = job.build_model().to(device)
    named = list(reference.named_parameters())
    optimizer = job.optimizer_fn(ParamList([p for _, p in named], [n for n, _ in named]))
    scheduler = job.lr_scheduler_fn(optimizer) if job.lr_scheduler_fn else None
    data = job.data_fn(job.seed)
    errors = ParityErrors()
    for step in range(job.steps):
        loss = _accumulated_step(job, reference, [t.to(device) for t in next(data)], accumulate)
        losses = [m["loss"] for m in metrics if m["step"] == step and "loss" in m]
        if not losses:
            raise ValueError(f"no last-stage rank reported a loss for step {step}")
        for got in losses:
            errors.note("loss", abs(got - loss) / abs(loss), f"step {step}: {got} vs {loss}", step)
        # a parameter without a gradient (frozen, unused) is compared as zeros
        grads = {n: p.grad.to("cpu", copy=True) if p.grad is not None else torch.zeros_like(p, device="cpu")
                 for n, p in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        params = {n: p.detach().cpu() for n, p in reference.named_parameters()}
        ranks = [m for m in metrics if m["step"] == step and "grad_pieces" in m]
        if ranks:
            _compare(errors, step, grads, params, ranks)
    if per_rank and all("grad_pieces" in r for r in per_rank.values()):
        _compare(errors, job.steps - 1, grads, params, list(per_rank.values()))
    return errors


def _accumulated_step(job: Job, model: torch.nn.Module, batch: tuple[torch.Tensor, ...], slices: int) -> float:
    """One step's forward and backward over ``slices`` equal slices of ``batch`` (under the job's
    autocast, if any); returns the batch's loss."""
    total = 0.0
    for *inputs, target in zip(*[t.chunk(slices) for t in batch]):
        with torch.autocast(target.device.type, dtype=job.autocast, enabled=job.autocast is not None):
            loss = job.loss_fn(model(*inputs), target) / slices
        loss.backward()
        total += loss.item()
    return total


def _compare(errors: ParityErrors, step: int, grads: dict, params: dict, ranks: list[dict[str, Any]]) -> None:
    """One step's gradients and the parameters after it, per parameter, from every rank's pieces
    (every data-parallel replica compared: :func:`stitch`)."""
    for kind, whole, pieces in (("grad", grads, "grad_pieces"), ("param", params, "param_pieces")):
        got = stitch([piece for result in ranks for piece in result[pieces]])
        if set(got) != set(whole):
            raise ValueError(f"step {step}: the ranks' {pieces} cover {sorted(set(got) ^ set(whole))[:3]}... "
                             f"differently from the model's parameters")
        for name, tensor in got.items():
            errors.note(kind, rel(tensor, whole[name]), f"step {step}: {name}", step)
