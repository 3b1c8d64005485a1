"""Single-device vs Piper reference-executor parity, shared by the parity tests."""
from __future__ import annotations

import copy
from typing import Callable

import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from benchmarks.parity_oracle import rel
from reference_executor import ReferenceExecutor
from piper_plugin.scheduler.plan import build_plan
from piper_plugin.scheduler.simulate import simulate

TOL = 1e-5


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def check_parity(model, loss_fn, batch: tuple, schedule: Callable[[Schedule], None], *, pp: int,
                 dp: int = 1, ep: int = 1, steps: int = 3, on_plan: Callable | None = None,
                 meter: bool = True, optimizer: Callable | None = None, program=None) -> dict:
    """Train ``steps`` AdamW steps both ways; assert loss, grads and params agree. ``on_plan``
    sees the compiled plan before it runs; ``meter=False`` leaves activation memory uncounted;
    ``optimizer`` (default AdamW) makes both sides' optimizers from a parameter list;
    ``program``: ``model``'s capture on this batch's shapes, made before (None: captured here)."""
    *inputs, target = batch
    program = program if program is not None else capture(model, loss_fn, tuple(inputs), target)
    sch = Schedule(program, pp=pp, dp=dp, ep=ep)
    schedule(sch)
    plan = build_plan(sch.dag, sch.grid)
    simulate(plan)  # the plan must be proven deadlock-free before it runs
    if on_plan is not None:
        on_plan(plan)
    optimizer_fn = optimizer or adamw
    executor = ReferenceExecutor(plan, program, model, loss_fn, optimizer_fn)
    for state in executor.states:
        state.snapshot_grads = True
        state.meter.track_saved = state.meter.track_working = meter
    reference = copy.deepcopy(model)
    optimizer = optimizer_fn(list(reference.parameters()))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        loss = executor.step(*batch)
        ref_loss = loss_fn(reference(*inputs), target)
        ref_loss.backward()
        grads = executor.full_gradients()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        assert set(grads) == set(ref_grads), f"gradients missing: {set(ref_grads) ^ set(grads)}"
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        for name, g in ref_grads.items():
            err = rel(grads[name], g)
            assert err < TOL, f"step {step}: gradient of {name} differs by {err:.2e}"
            worst["grad"] = max(worst["grad"], err)
        optimizer.step()
        optimizer.zero_grad()
    assert worst["loss"] < TOL, f"loss differs by {worst['loss']:.2e}"
    params = executor.full_parameters()
    for name, p in reference.named_parameters():
        err = rel(params[name], p.detach())
        assert err < TOL, f"parameter {name} after {steps} steps differs by {err:.2e}"
        worst["param"] = max(worst["param"], err)
    return worst


def lm_data(cfg, batch: int):
    """``data_fn`` for a Job: the same seeded random LM batches on every rank."""
    from piper_plugin.models import lm_batch

    def data_fn(seed: int):
        generator = torch.Generator().manual_seed(seed + 1)
        while True:
            yield lm_batch(cfg, batch, generator)

    return data_fn


def check_distributed_parity(model_fn, cfg, batch: int, schedule_fn, steps: int = 3,
                             autocast: torch.dtype | None = None):
    """Train on forked gloo ranks and compare with one device: every step's loss, gradients and
    parameters. Under ``autocast`` the reference accumulates over the plan's microbatches
    (:func:`~benchmarks.parity_oracle.single_device_errors`). Returns the job, its program, every
    step's metrics and the ranks' final results, for further checks."""
    from piper_plugin.models import lm_loss
    from piper_plugin.compiler import compile_job
    from piper_plugin.runtime.job import Job
    from piper_plugin.runtime.launch.processes import run_forked
    from benchmarks.parity_oracle import single_device_errors

    job = Job(model_fn, lm_loss, lm_data(cfg, batch), schedule_fn, adamw, steps=steps, capture_grads=True,
              timeout_s=60, autocast=autocast)
    program, _, plan, _ = compile_job(job)
    metrics: list[dict] = []
    per_rank = run_forked(job, program, plan, on_metrics=metrics.append)
    slices = plan.microbatches * plan.grid.data_shards if autocast is not None else 1
    errors = single_device_errors(job, metrics, per_rank, accumulate=slices)
    for kind in ("loss", "grad", "param"):
        err = getattr(errors, kind)
        assert err < TOL, f"{kind} differs by {err:.2e} ({errors.where[kind]})"
    return job, program, metrics, per_rank
