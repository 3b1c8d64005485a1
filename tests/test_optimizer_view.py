"""Invariant 8 under ZeRO: the optimizer sees each parameter as the user wrote it.

The model has a frozen parameter (``pos``), a parameter that gets no gradient (``gate``: read
through ``detach``), a 3-D one and 1-D ones; the optimizer has groups by shape (no weight decay
for vectors) and by name (another lr for the embedding) and an LR schedule per group. Every
ZeRO level and order family must train it exactly as one device does, on the reference
executor and on forked gloo ranks; an optimizer that reads whole matrices is refused.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from piper_plugin import ParamList, capture, recipes
from piper_plugin.api.schedule import Schedule
from piper_plugin.models import ToyLM, ToyLMConfig, lm_batch, lm_loss
from piper_plugin.scheduler.plan import build_plan
from benchmarks.parity_oracle import rel
from reference_executor import ReferenceExecutor

RECIPES = ["1f1b", "interleaved-1f1b", "dualpipev"]


class GatedLM(ToyLM):
    """:class:`ToyLM` with a frozen position table and a parameter no gradient reaches."""

    def __init__(self, cfg: ToyLMConfig, stages: int | None = None):
        super().__init__(cfg, stages)
        self.pos.weight.requires_grad_(False)
        self.gate = nn.Parameter(torch.full((3, cfg.dim), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        with self._stage(self.stages - 1 if self.stages is not None else 0):
            return logits + self.gate.detach().sum() * 0.0


def grouped_adamw(params: ParamList) -> torch.optim.Optimizer:
    """Groups by name (the embedding: half the lr) and by shape (vectors: no weight decay)."""
    embed, vectors, rest = [], [], []
    for name, p in params.named():
        (embed if name.startswith("embed") else vectors if p.ndim < 2 else rest).append(p)
    groups = [{"params": embed, "lr": 5e-3}, {"params": vectors, "weight_decay": 0.0}, {"params": rest}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2, weight_decay=0.3)


def per_group_schedule(optimizer: torch.optim.Optimizer):
    """Each group decays at its own rate (set by its options, so every region agrees)."""
    rates = [0.5 if g["weight_decay"] == 0.0 else 0.8 if g["lr"] < 1e-2 else 0.9 for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s, r=r: r ** s for r in rates])


def _setup(recipe: str, pp: int = 2):
    stages = recipes.stages_needed(recipe, pp)
    cfg = ToyLMConfig(n_layers=stages)
    return stages, cfg


def _schedule(recipe, pp, dp, zero, program):
    m = 4
    return recipes.apply_recipe(Schedule(program, pp=pp, dp=dp), recipe, microbatches=m, zero=zero)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_executor_keeps_groups_frozen_and_unused(recipe, zero):
    stages, cfg = _setup(recipe)
    torch.manual_seed(0)
    model = GatedLM(cfg, stages=stages)
    batches = [lm_batch(cfg, 8, torch.Generator().manual_seed(s)) for s in range(3)]
    program = capture(model, lm_loss, (batches[0][0],), batches[0][1])
    sch = _schedule(recipe, 2, 2, zero, program)
    plan = build_plan(sch.dag, sch.grid)
    executor = ReferenceExecutor(plan, program, model, lm_loss, grouped_adamw)
    schedulers = [per_group_schedule(o) for s in executor.states for o in s.optimizers.values()]
    torch.manual_seed(0)
    reference = GatedLM(cfg, stages=stages)
    reference.load_state_dict(model.state_dict())
    named = list(reference.named_parameters())
    optimizer = grouped_adamw(ParamList([p for _, p in named], [n for n, _ in named]))
    scheduler = per_group_schedule(optimizer)
    for x, y in batches:
        loss = executor.step(x, y)
        ref = lm_loss(reference(x), y)
        ref.backward()
        assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
        optimizer.step()
        optimizer.zero_grad()
        for s in [scheduler, *schedulers]:
            s.step()
    got = executor.full_parameters()
    for name, p in reference.named_parameters():
        assert rel(got[name], p.detach()) < 1e-5, f"{name} differs by {rel(got[name], p.detach()):.2e}"
    assert torch.equal(got["pos.weight"], model.pos.weight), "the frozen parameter changed"
    assert torch.equal(got["gate"], model.gate), "the parameter without gradients changed"


@pytest.mark.slow
@pytest.mark.parametrize("recipe, zero", [(r, z) for r in RECIPES for z in (1, 2, 3)] + [("1f1b", 0)])
def test_real_ranks_keep_groups_frozen_and_unused(recipe, zero):
    from piper_plugin import Job
    from piper_plugin.compiler import compile_job
    from piper_plugin.runtime.launch.processes import run_forked
    from benchmarks.parity_oracle import single_device_errors
    from parity import lm_data

    stages, cfg = _setup(recipe)
    job = Job(functools.partial(GatedLM, cfg, stages), lm_loss, lm_data(cfg, 16),
              functools.partial(_schedule, recipe, 2, 2, zero), grouped_adamw, steps=3, capture_grads=True,
              lr_scheduler_fn=per_group_schedule, timeout_s=60)
    program, _, plan, _ = compile_job(job)
    metrics: list[dict] = []
    per_rank = run_forked(job, program, plan, on_metrics=metrics.append)
    errors = single_device_errors(job, metrics, per_rank)
    assert errors.worst() < 1e-5, errors


class WholeMatrix(torch.optim.SGD):
    """An update that reads the whole matrix (as Muon's orthogonalisation does)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


def test_an_optimizer_reading_whole_matrices_is_refused_under_zero():
    stages, cfg = _setup("1f1b")
    model = ToyLM(cfg, stages=stages)
    x, y = lm_batch(cfg, 8)
    program = capture(model, lm_loss, (x,), y)
    sch = _schedule("1f1b", 2, 2, 1, program)
    plan = build_plan(sch.dag, sch.grid)
    with pytest.raises(ValueError, match=r"WholeMatrix is not an element-wise optimizer.*replicate\(zero=0\)"):
        ReferenceExecutor(plan, program, model, lm_loss, functools.partial(WholeMatrix, lr=0.1))
    sch = _schedule("1f1b", 2, 2, 0, program)  # ZeRO 0: each rank steps whole parameters, any optimizer works
    ReferenceExecutor(build_plan(sch.dag, sch.grid), program, model, lm_loss, functools.partial(WholeMatrix, lr=0.1))
