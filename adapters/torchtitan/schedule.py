"""The object TorchTitan's trainer calls ``.step`` / ``.eval`` on, running a Piper plan.

``step`` feeds this rank's microbatches (pre-split by the trainer) to the rank's
:class:`~piper_plugin.Executor`, the same per-step executor Piper's own launchers run. Gradients stay in ``param.grad`` for TorchTitan's clip + optimizer
step: the executor has no optimizer of its own (``optimizer_fn=None``), and the loss gradient is 1 because
TorchTitan's loss already divides by the global number of valid tokens. FSDP-wrapped parts keep
unsharded, unreduced gradients during the step; each stage reduces them once, right after its
last backward task on this rank, once that task's input gradient went upstream (:mod:`.fsdp_sync`),
so B, BI and BW are the core's handlers unchanged and a stage finished early reduces inside the
cool-down's idle time, not after the step.

``eval`` runs forward only (``Executor.eval``): stage by stage in microbatch order, no
backward, nothing to schedule.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn

from piper_plugin import Executor, ExecutorConfig, StepTrace, ValueSpec

from piper_plugin.adapters.torchtitan.program import LocalStages, StageProgram
from piper_plugin.adapters.torchtitan.fsdp_sync import fsdp_roots, hold_gradients, reduce_gradients
from piper_plugin.adapters.torchtitan.spmd_threads import caller_spmd_context

__all__ = ["PiperPipelineSchedule"]

_BACKWARDS = ("B", "BI", "BW")


class PiperPipelineSchedule:
    """Duck-types ``torch.distributed.pipelining``'s schedule for TorchTitan's trainer over a
    Piper :class:`Executor` (built at the first step, once TorchTitan moved the parts off the
    meta device and initialised them)."""

    def __init__(self, *, plan, program: StageProgram, parts: dict[int, nn.Module], loss_fn,
                 rank: int, specs: dict[str, ValueSpec], timeout_s: float, recipe: str,
                 replicas: list[list[int]] | None = None, tensor_parallel: int = 1, mixed_precision=(None, None),
                 experts_sharded: bool = False, trace_dir: str | None = None, trace_memory: bool = False):
        self.plan, self.program, self.rank, self.recipe = plan, program, rank, recipe
        self.parts = parts
        self.loss_fn = loss_fn
        self.specs = specs
        self.microbatches = plan.microbatches
        self.num_stages = len({r.stage for r in program.regions.values()})
        # ``rank`` is this process's plan rank (its pipeline rank); ``replicas`` maps plan ranks to
        # process ranks per data-parallel replica, whose gradients TorchTitan's FSDP/HSDP wrapper reduces.
        # The loss is already sum / global valid tokens: each microbatch's loss gradient is 1. TorchTitan
        # reports the process's own memory: saved activations are counted only for ``--piper.trace_memory``.
        # ``mixed_precision``: FSDP's policy (param, reduce dtypes), done by Piper's ZeRO when it shards.
        self.config = ExecutorConfig(timeout_s=timeout_s, loss_scale=1.0, track_saved_memory=trace_memory,
                                     replicas=tuple(tuple(r) for r in replicas) if replicas else None,
                                     tensor_parallel=tensor_parallel,
                                     param_dtype=mixed_precision[0], reduce_dtype=mixed_precision[1],
                                     experts_sharded=experts_sharded)
        self._executor: Executor | None = None
        self._paused: list = []
        self.trace_dir = trace_dir
        self._trace: StepTrace | None = None  # ``--piper.trace``: made at the first step
        self._spmd_context = None
        # TorchTitan wraps every part in FSDP2: a stage's gradients are reduced once per step,
        # right after its last backward task on this rank (inside the cool-down's idle time).
        self._fsdp = {s: fsdp_roots({s: part}) for s, part in parts.items()}
        self._reduce_after = _last_backwards(plan, rank)
        self.has_first_stage = 0 in parts
        self.has_last_stage = self.num_stages - 1 in parts

    def _ensure_executor(self) -> Executor:
        if self._executor is None:  # collective: every rank builds its communicators at its first step
            self._executor = Executor(self.plan, self.program, self.rank, LocalStages(self.parts), self.loss_fn,
                                      specs=self.specs, optimizer_fn=None, config=self.config,
                                      after_task=self._after)
            # MoE stages' paused forwards (:mod:`.pieces`), each once though it serves several pieces
            self._paused = list({id(p): p for c in self._executor.state.chunks.values()
                                 if (p := getattr(c, "paused", None)) is not None}.values())
            for paused in self._paused:
                paused.timeout_s = self.config.timeout_s
        return self._executor

    def _in_meshes(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the caller's TorchTitan SPMD meshes (thread-local, spmd_types backend)."""
        if self._spmd_context is None:
            return fn()
        with self._spmd_context():
            return fn()

    def _after(self, key: str) -> None:
        """After a task, once the runner posted the sends it enabled (a stage's last backward
        hands its input gradient upstream first, then reduces): this stage's gradients are
        final on this rank."""
        stage = self._reduce_after.get(key)
        if stage is not None:
            self._in_meshes(lambda: reduce_gradients(self._fsdp[stage]))

    def _inputs(self, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs) -> dict[str, list[Any]]:
        m = self.microbatches
        kwarg_mbs = list(kwarg_mbs) if kwarg_mbs is not None else [{}] * m
        inputs: dict[str, list[Any]] = {"kwargs": kwarg_mbs, "loss_kwargs": [dict(loss_kwargs or {})] * m}
        if self.has_first_stage:
            if arg_mbs is None:
                raise ValueError("this rank holds the first stage: pass arg_mbs=[(tokens,), ...]")
            inputs["tokens"] = [a[0] if isinstance(a, (tuple, list)) else a for a in arg_mbs]
        if self.has_last_stage:
            if target_mbs is None:
                raise ValueError("this rank holds the last stage: pass target_mbs=[labels, ...]")
            inputs["labels"] = list(target_mbs)
        for name, values in inputs.items():
            if len(values) != m:
                raise ValueError(f"the Piper plan has {m} microbatches but {name} has {len(values)}; set "
                                 f"local_batch_size / pipeline_parallel_microbatch_size = {m}")
        return inputs

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if args or kwargs or target is not None:
            raise ValueError("the Piper schedule takes pre-split microbatches: arg_mbs=, kwarg_mbs=, target_mbs=")
        executor = self._ensure_executor()
        inputs = self._inputs(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)
        self._spmd_context = caller_spmd_context()
        for paused in self._paused:  # MoE stages' forwards re-enter this step's meshes on their threads
            paused.context = self._spmd_context
        for roots in self._fsdp.values():
            hold_gradients(roots)
        # every local stage reduces its gradients after its last backward (``_after``)
        started = time.perf_counter()
        out = executor.step(microbatches=inputs, compute_context=self._spmd_context)
        if self.trace_dir:
            if self._trace is None:
                self._trace = StepTrace(self.trace_dir, self.plan, self.rank, dist.get_rank(), self.program)
            self._trace.record(executor.runner.timeline, time.perf_counter() - started,
                               executor.state.meter if self.config.track_saved_memory else None)
        if losses is not None and self.has_last_stage:
            losses.extend(out)
        return None

    def eval(self, *args, target=None, losses: list | None = None, arg_mbs=None, kwarg_mbs=None,
             target_mbs=None, **kwargs):
        """Forward only, stage by stage in microbatch order (no backward, nothing to schedule)."""
        if args or kwargs or target is not None:
            raise ValueError("the Piper schedule takes pre-split microbatches: arg_mbs=, kwarg_mbs=, target_mbs=")
        out = self._ensure_executor().eval(self._inputs(arg_mbs, kwarg_mbs, target_mbs, None))
        if losses is not None and self.has_last_stage:
            losses.extend(out)
        return None


def _last_backwards(plan, rank: int) -> dict[str, int]:
    """Task key -> stage, for the last backward task (B, BI or BW) of each of ``rank``'s stages
    in its stream's order: after it the stage's gradients for the step are complete."""
    last: dict[int, str] = {}
    for keys in plan.ranks[rank].streams.values():
        for key in keys:
            node = plan.dag.nodes[key]
            if node.kind.value in _BACKWARDS:
                last[node.stage] = key
    return {key: stage for stage, key in last.items()}
