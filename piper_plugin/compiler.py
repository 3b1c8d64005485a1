"""``compile``: capture + directives + scheduling + simulation, in one call.

The result is what every launcher and host needs before a rank starts: the captured
:class:`Program`, the :class:`Schedule` (its directives and trace), the per-rank :class:`Plan`
and the simulation that proved the plan finishes. Compiling is deterministic: every rank that
compiles the same model, batch shapes and directives gets a plan with the same hash.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn as nn

from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.capture import Program, capture
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.plan import Plan, build_plan
from piper_plugin.scheduler.simulate import SimResult, simulate

__all__ = ["Compiled", "compile", "compile_program", "compile_job"]

ScheduleFn = Callable[[Program], Schedule]


class Compiled(NamedTuple):
    """A compiled strategy: ``plan.ranks[r]`` is rank r's complete plan."""

    program: Program
    schedule: Schedule
    plan: Plan
    simulation: SimResult


def compile(model: nn.Module | Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor],
            inputs: Sequence[torch.Tensor], target: torch.Tensor, schedule_fn: ScheduleFn, *,
            split_last_backward: bool = True) -> Compiled:
    """Capture ``loss_fn(model(*inputs), target)`` (one global batch) and compile ``schedule_fn``.

    ``model`` is a module (on any device, "meta" included) or a zero-argument callable that
    builds one; a callable is built on the meta device, so no weights are allocated.
    ``split_last_backward=False`` keeps every backward one pass (needed when activation
    checkpointing lets a region backward only once).
    """
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model()
    return compile_program(capture(model, loss_fn, tuple(inputs), target), schedule_fn,
                           split_last_backward=split_last_backward)


def compile_program(program: Program, schedule_fn: ScheduleFn, *, split_last_backward: bool = True,
                    cost: CostModel | None = None) -> Compiled:
    """Apply ``schedule_fn`` to an already captured program (module regions, for instance);
    ``cost`` is the simulation's cost model (default: unit costs)."""
    sch = schedule_fn(program)
    if not isinstance(sch, Schedule):
        raise TypeError(f"the schedule function returned {type(sch).__name__}, not a Schedule: "
                        f"return the Schedule its directives were applied to")
    plan = build_plan(sch.dag, sch.grid, split_last_backward=split_last_backward)
    return Compiled(program, sch, plan, simulate(plan, cost))


def compile_job(job: Any) -> Compiled:
    """A :class:`~piper_plugin.runtime.job.Job`'s strategy, compiled on its first batch's shapes."""
    *inputs, target = next(iter(job.data_fn(job.seed)))
    return compile(job.model_fn, job.loss_fn, tuple(inputs), target, job.schedule_fn)
