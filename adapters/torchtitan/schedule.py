"""The object TorchTitan's trainer calls ``.step`` / ``.eval`` on, running a Piper plan.

``step`` feeds this rank's microbatches (pre-split by the trainer) into the rank's
:class:`RankState`, runs the plan's streams and waits for outstanding sends: the same per-step
executor as Piper's Worker. Gradients stay in ``param.grad`` for TorchTitan's clip + optimizer
step: the plan's UPDATE nodes run a no-op optimizer, and the loss gradient is 1 because
TorchTitan's loss already divides by the global number of valid tokens. FSDP-wrapped parts keep
unsharded, unreduced gradients during the step; each stage reduces them once, right after its
last backward task on this rank, once that task's input gradient went upstream (:mod:`.fsdp_sync`),
so B, BI and BW are the core's handlers unchanged and a stage finished early reduces inside the
cool-down's idle time, not after the step.

``eval`` runs forward only, stage by stage in microbatch order (no backward, nothing to
schedule), with blocking P2P of the hidden states.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from piper_plugin.ir.nodes import COMPUTE, Kind
from piper_plugin.runtime.compute import run_compute
from piper_plugin.runtime.dist_comm import DistComm
from piper_plugin.runtime.rank_state import RankState
from piper_plugin.runtime.streams import Continue, StreamRunner, compute_stream, posted_streams
from piper_plugin.runtime.value_specs import ValueSpec
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.posting import post_sizes

from piper_plugin.adapters.torchtitan.program import LocalStages, StageChunk, StageProgram, hidden_name
from piper_plugin.adapters.torchtitan.fsdp_sync import fsdp_roots, hold_gradients, reduce_gradients
from piper_plugin.adapters.torchtitan.spmd_threads import caller_spmd_context

__all__ = ["PiperPipelineSchedule", "HostOptimizer"]


class HostOptimizer:
    """The optimizer Piper's UPDATE nodes call: nothing. TorchTitan clips and steps the
    parameters itself, reading the gradients Piper left in ``param.grad``."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = list(params)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class PiperPipelineSchedule:
    """Duck-types ``torch.distributed.pipelining``'s schedule for TorchTitan's trainer."""

    def __init__(self, *, plan: Plan, program: StageProgram, parts: dict[int, nn.Module], loss_fn,
                 rank: int, specs: dict[str, ValueSpec], timeout_s: float, recipe: str,
                 replicas: list[list[int]] | None = None, split_last_backward: bool = True):
        self.plan, self.program, self.rank, self.recipe = plan, program, rank, recipe
        # a rank's last backward may run BI, send, BW (RankState.input_grads_first); not under
        # activation checkpointing (selective AC allows one backward through a region)
        self.split_last_backward = split_last_backward
        self.parts = parts
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        self.specs = specs
        self.microbatches = plan.microbatches
        self.num_stages = len(program.regions)
        # collective: every process builds every replica's communicators now. ``rank`` is this
        # process's plan rank (its pipeline rank); ``replicas`` maps plan ranks to process ranks
        # per data-parallel replica, whose gradients TorchTitan's FSDP/HSDP wrapper reduces.
        self.comm = DistComm(plan, rank, specs, timeout_s, replicas=replicas)
        self._state: RankState | None = None
        self._runner: StreamRunner | None = None
        self._spmd_context = None
        placement = plan.dag.meta["placement"]
        self.stage_rank = {int(r): pp for r, pp in placement.items()}
        self._eval_group = dist.new_group(list(range(dist.get_world_size())))
        # TorchTitan wraps every part in FSDP2: a stage's gradients are reduced once per step,
        # right after its last backward task on this rank (inside the cool-down's idle time).
        self._fsdp = {s: fsdp_roots({s: part}) for s, part in parts.items()}
        self._reduce_after = _last_backwards(plan, rank)
        self.has_first_stage = 0 in parts
        self.has_last_stage = self.num_stages - 1 in parts

    # -- lazy set-up: after TorchTitan moved the parts off meta and initialised them ---------
    def _ensure_state(self) -> RankState:
        if self._state is None:
            model = LocalStages(self.parts)
            self._state = RankState(self.rank, self.plan, self.program, model, self.loss_fn, HostOptimizer)
            self._state.scale = 1.0  # the loss is already sum / global valid tokens
            # TorchTitan reports the process's own memory (peak RSS, or the CUDA allocator's):
            # counting saved activations through autograd hooks would only cost time here.
            self._state.meter.track_saved = False
            if not self.split_last_backward:
                self._state.input_grads_first = set()
            device = self._device()  # where TorchTitan put the parts: receive buffers go there too
            self.comm.device = device
            self._runner = StreamRunner(self.rank, self.plan.ranks[self.rank], self._execute, self.timeout_s,
                                        device=device, inline=compute_stream(self.plan, self.rank),
                                        posted=posted_streams(self.plan, self.rank),
                                        sizes=post_sizes(self.plan, self.rank), after=self._after)
        return self._state

    def _in_meshes(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the caller's TorchTitan SPMD meshes (thread-local, spmd_types backend)."""
        if self._spmd_context is None:
            return fn()
        with self._spmd_context():
            return fn()

    def _execute(self, key: str):
        node = self.plan.dag.nodes[key]
        if node.kind not in COMPUTE:  # messages need no mesh
            return self.comm.run(self._state, node)  # a RECV returns its completion
        self.comm.retire_sends()  # messages that arrived free their buffers before this task's own
        # a B sending its input gradients first returns its rest
        result = self._in_meshes(lambda: run_compute(self._state, node))
        if isinstance(result, Continue) and self._spmd_context is not None:
            rest = result.rest
            return Continue(lambda: self._in_meshes(rest))
        return result

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
        state = self._ensure_state()
        state.inputs = self._inputs(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)
        state.losses = []
        state.meter.reset_peak()
        self._spmd_context = caller_spmd_context()
        for roots in self._fsdp.values():
            hold_gradients(roots)
        self._runner.run_step()  # every local stage reduced its gradients after its last backward
        self.comm.wait_sends()
        if losses is not None and self.has_last_stage:
            losses.extend(state.losses)
        state.inputs = {}
        return None

    # -- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def eval(self, *args, target=None, losses: list | None = None, arg_mbs=None, kwarg_mbs=None,
             target_mbs=None, **kwargs):
        if args or kwargs or target is not None:
            raise ValueError("the Piper schedule takes pre-split microbatches: arg_mbs=, kwarg_mbs=, target_mbs=")
        inputs = self._inputs(arg_mbs, kwarg_mbs, target_mbs, None)
        last = self.num_stages - 1
        chunks = {s: StageChunk(p, s == last, self.loss_fn) for s, p in self.parts.items()}
        carried = None  # a stage's output handed to the next stage on this rank
        for mb in range(self.microbatches):
            for s in sorted(chunks):
                if s == 0:
                    x = inputs["tokens"][mb]
                elif self.stage_rank[s - 1] == self.rank:
                    x = carried
                else:
                    x = self.specs[hidden_name(s - 1)].empty(self._device())
                    dist.recv(x, src=self.comm.process_rank[self.stage_rank[s - 1]], group=self._eval_group)
                labels = inputs["labels"][mb] if s == last else None
                (out,) = chunks[s](x, inputs["kwargs"][mb], labels, {})
                if s == last:
                    if losses is not None:
                        losses.append(out.detach())
                elif self.stage_rank[s + 1] == self.rank:
                    carried = out
                else:
                    dist.send(out.contiguous(), dst=self.comm.process_rank[self.stage_rank[s + 1]],
                              group=self._eval_group)
        return None

    def _device(self) -> torch.device:
        return next(p for m in self.parts.values() for p in m.parameters()).device


def _last_backwards(plan: Plan, rank: int) -> dict[str, int]:
    """Task key -> stage, for the last backward task (B, BI or BW) of each of ``rank``'s stages
    in its stream's order: after it the stage's gradients for the step are complete."""
    last: dict[int, str] = {}
    for keys in plan.ranks[rank].streams.values():
        for key in keys:
            node = plan.dag.nodes[key]
            if node.kind in (Kind.B, Kind.BI, Kind.BW):
                last[int(node.region)] = key
    return {key: stage for stage, key in last.items()}
