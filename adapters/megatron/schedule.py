"""A drop-in for Megatron-Core's forward-backward functions, running a Piper plan.

Same keyword-only signature and contract as ``megatron.core.pipeline_parallel.schedules``'s
``forward_backward_pipelining_*``: the user's ``forward_step_func`` runs on each model chunk,
the last stage's loss function scales the loss as Megatron does, gradient reduction is
deferred by ``config.no_sync_func`` and finalised by ``config.finalize_model_grads_func``,
the MoE auxiliary-loss scale is set, and the last stage returns the loss function's reports in
microbatch order (every other rank: an empty list).

Invariants:
- every rank of a pipeline compiles the same plan (its hash is checked as the executor starts);
  chunk ``k`` of pipeline rank ``r`` is stage ``k * pp + r`` (Megatron's layout) unless it says
  otherwise (``piper_stage``, for chunks built in a recipe's own layout, e.g. DualPipeV's V),
  and the recipe must place it on that rank;
- each chunk reads its data iterator once per microbatch, item ``i`` for microbatch ``i``,
  whatever order the plan runs microbatches in;
- gradients accumulate as Megatron's backward leaves them (DDP's ``main_grad`` hooks); with
  ``overlap_grad_reduce`` a chunk's reduction starts right after its last backward on this rank,
  otherwise ``finalize_model_grads_func`` does it (never twice).

The executor (and its communicators) is built on the first call (or by :meth:`PiperForwardBackward.prepare`)
and kept for calls with the same chunks, microbatch count and hidden shape.

With ``zero`` (1, 2 or 3) data parallelism is Piper's instead of Megatron's DDP: the plan spans
Megatron's pipeline x data-parallel ranks with ZeRO at that level over the data-parallel group,
the chunks are :class:`~.zero.ZeroChunk` s, and :meth:`~PiperForwardBackward.prepare` must run
before the optimizer is built (it turns the chunks' parameters into faces of this rank's shards,
:mod:`.zero`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from piper_plugin import (
    DirectiveError, Executor, ExecutorConfig, Schedule, StepTrace, ValueSpec, compile_program, cost_model,
    prediction_line, read_profile, recipes,
)

from piper_plugin.adapters.megatron.cpu import cpu_context
from piper_plugin.adapters.megatron.errors import ArgumentError
from piper_plugin.adapters.megatron.groups import (
    data_parallel, hidden_shape, pipelines, plan_processes, tensor_parallel, tensor_parallel_rank,
)
from piper_plugin.adapters.megatron.linear import install_split_linears, stage_backward_splits
from piper_plugin.adapters.megatron.zero import LEVELS, own_expert
from piper_plugin.adapters.megatron.program import (
    DataFeed, LocalChunks, Microbatch, StageRun, build_program, hidden_name, set_aux_loss_scales,
)

__all__ = ["PiperForwardBackward", "ArgumentError", "DEFAULT_TIMEOUT_S", "stage_of", "stage_placement",
           "unwrap_chunk"]

DEFAULT_TIMEOUT_S = 300.0


class PiperForwardBackward:
    """Callable with the signature of Megatron's forward-backward functions.

    ``recipe``: a Piper recipe name, recipe file or JSON trace (None: ``1f1b``, or
    ``interleaved-1f1b`` when each rank holds several model chunks). ``zero``: Piper's ZeRO level
    over Megatron's data-parallel group (None: Megatron's DDP reduces, each pipeline a replica
    of the plan). ``trace``: a folder where each step's timeline and wall time go
    (:class:`~piper_plugin.StepTrace`), with ``trace_memory`` also each step's peak transient memory
    and the meter's windows (saved activations counted only then); ``profile``: a cost profile
    whose prediction of the plan's step, bubble and peak transient memory per rank global rank 0
    prints once the plan is compiled."""

    def __init__(self, recipe: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, zero: int | None = None,
                 trace: str | None = None, profile: str | None = None, trace_memory: bool = False):
        if zero is not None and zero not in LEVELS:
            raise ArgumentError(f"--piper-zero {zero}: the level is one of {', '.join(map(str, LEVELS))}")
        try:
            self._profile = read_profile(profile) if profile is not None else None
            if self._profile is not None:
                cost_model(self._profile)  # a profile this version cannot read fails here, before step 1
        except ValueError as exc:
            raise ArgumentError(f"--piper-profile: {exc}") from None
        self.recipe, self.timeout_s, self.zero = recipe, timeout_s, zero
        if trace_memory and trace is None:
            raise ArgumentError("--piper-trace-memory records into the step trace: add --piper-trace DIR")
        self.trace, self.profile, self.trace_memory = trace, profile, trace_memory
        self._cached: tuple[tuple, _Engine] | None = None

    def prepare(self, *, model, num_microbatches: int, seq_length: int, micro_batch_size: int,
                decoder_seq_length: int | None = None, pg_collection=None) -> None:
        """Compile the plan and build the executor now (a collective over every rank of the
        plan) rather than at the first step: with ``zero`` the chunks' parameters become faces
        of this rank's shards here, so call it before building the optimizer."""
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self._engine(chunks, num_microbatches, seq_length, micro_batch_size, decoder_seq_length, pg_collection)

    def _engine(self, chunks, num_microbatches, seq_length, micro_batch_size, decoder_seq_length,
                pg_collection) -> "_Engine":
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        shape = hidden_shape(config, seq_length, decoder_seq_length, micro_batch_size, pg_collection)
        key = (tuple(id(c) for c in chunks), num_microbatches, shape, config.pipeline_dtype)
        if self._cached is None or self._cached[0] != key:
            if self.zero is not None and self._cached is not None:
                raise ArgumentError("--piper-zero: the plan's shards were built for other chunks, microbatch "
                                    "count or sequence shape; make one forward-backward function per model and "
                                    "batch layout")
            engine = _Engine(chunks, num_microbatches, micro_batch_size, shape, config, self.recipe, self.timeout_s,
                             pg_collection, self.zero, trace_dir=self.trace, trace_memory=self.trace_memory)
            if self._profile is not None and dist.get_rank() == 0:
                print(f" > Piper plan {engine.plan.hash()} ({engine.recipe_name}) "
                      f"{prediction_line(engine.plan, self._profile, self.profile)}", flush=True)
            self._cached = (key, engine)
        return self._cached[1]

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: int | None = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                 adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator=None, pg_collection=None,
                 force_all_reduce: bool | None = False) -> list[Any]:
        from megatron.core.utils import get_model_config

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator] * len(chunks)
        if len(iterators) != len(chunks):
            raise ArgumentError(f"{len(chunks)} model chunks but {len(iterators)} data iterators; pass one per chunk")
        config = get_model_config(chunks[0])
        if adjust_tensor_shapes_fn is not None:
            raise ArgumentError("adjust_tensor_shapes_fn: the Piper engine sends each stage's hidden state at "
                                "[seq_length, micro_batch_size, hidden_size]; drop it or use Megatron's engine")
        if getattr(config, "overlap_p2p_comm", False) and len(chunks) == 1:
            raise ArgumentError("--overlap-p2p-comm without a virtual pipeline: Megatron refuses it too")
        engine = self._engine(chunks, num_microbatches, seq_length, micro_batch_size, decoder_seq_length,
                              pg_collection)
        return engine.run(forward_step_func, iterators, forward_only=forward_only,
                          collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                          pg_collection=pg_collection, force_all_reduce=force_all_reduce)


class _Engine:
    """One compiled plan and its executor for this rank's chunks."""

    def __init__(self, chunks: list[nn.Module], microbatches: int, micro_batch_size: int, shape, config,
                 recipe: str | None, timeout_s: float, pg_collection, zero: int | None = None,
                 trace_dir: str | None = None, trace_memory: bool = False):
        """``trace_dir``: ``--piper-trace``'s folder (its StepTrace is made at the first training
        step); ``trace_memory``: saved activations counted on the memory meter and recorded there."""
        from megatron.core import parallel_state

        pp_group = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        dp, dp_rank = data_parallel(zero, chunks, pg_collection)
        self.chunks, self.pp, self.pp_rank = chunks, pp, pp_rank
        self.config = config
        self.cp_size = (pg_collection.cp.size() if pg_collection is not None
                        else parallel_state.get_context_parallel_world_size())
        self.stages = {stage_of(c, k, pp, pp_rank): c for k, c in enumerate(chunks)}
        num_stages = pp * len(chunks)
        # every stage's parameters, from the rank that holds it: the same program on every rank.
        # Under Piper's ZeRO an expert rank's own experts (Megatron's allreduce=False) stay out of
        # the plan's replicated buckets: ZeroChunk reduces them over the expert-data-parallel group.
        # With them, whether its backward splits once its linear layers run through .linear
        for chunk in chunks:
            install_split_linears(chunk)
        mine = {s: ([(n, tuple(p.shape), p.numel() * p.element_size()) for n, p in c.named_parameters()
                     if zero is None or not own_expert(p)], stage_backward_splits(c))
                for s, c in self.stages.items()}
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, mine, group=pp_group)
        stages = {s: v for part in gathered for s, v in part.items()}
        program = build_program({s: params for s, (params, _) in stages.items()}, microbatch_size=micro_batch_size,
                                microbatches=microbatches, hidden_shape=shape, dtype=config.pipeline_dtype,
                                model_type=type(unwrap_chunk(chunks[0])).__name__,
                                attention_heads=config.num_attention_heads // tensor_parallel(pg_collection),
                                replicas=dp, backward_splits={s: splits for s, (_, splits) in stages.items()})
        name = recipe or ("1f1b" if len(chunks) == 1 else "interleaved-1f1b")
        try:
            loaded = recipes.load(name)
        except recipes.RecipeError as exc:
            raise ArgumentError(f"--piper-recipe: {exc}") from None
        try:
            compiled = compile_program(program, lambda prog: loaded.schedule(
                prog, pp=pp, dp=dp, ep=1, microbatches=microbatches, chunks=len(chunks), zero=zero or 0,
                bucket_bytes=None))
        except (DirectiveError, recipes.RecipeError) as exc:
            raise ArgumentError(f"--piper-recipe {loaded.name}: {exc} (the model has {num_stages} stages: "
                                f"--pipeline-model-parallel-size {pp} x {len(chunks)} model chunks per rank)") from None
        plan = compiled.plan
        if plan.grid.world_size != pp * dp:
            fix = ("use a recipe that takes a data-parallel axis" if zero else
                   "data parallelism stays Megatron's (or Piper's with --piper-zero)")
            raise ArgumentError(f"--piper-recipe {loaded.name} runs on {plan.grid.world_size} ranks but the plan "
                                f"needs {pp * dp} (--pipeline-model-parallel-size {pp}"
                                f"{f' x data-parallel {dp}' if zero else ''}); {fix}")
        placement = {int(r): rank for r, rank in plan.dag.meta.placement.items()}
        wrong = sorted(s for s in self.stages if placement[s] != pp_rank)
        if wrong:
            s = wrong[0]
            raise ArgumentError(f"--piper-recipe {loaded.name} puts stage {s} on pipeline rank {placement[s]}, but "
                                f"the model chunk for it was built on rank {pp_rank} (Megatron's layout: chunk k of "
                                f"rank r is stage k x pp + r); use a recipe with the loop layout (1f1b, "
                                f"interleaved-1f1b, gpipe, zb-h1), or build the chunks where the recipe places them "
                                f"(stage_placement) and mark each with its stage (chunk.piper_stage = s)")
        self.plan, self.recipe_name, self.simulation = plan, loaded.name, compiled.simulation
        self.program = program
        self.microbatches = microbatches
        specs = {hidden_name(s): ValueSpec(shape, config.pipeline_dtype) for s in range(num_stages - 1)}
        # Megatron's loss function already divides by the microbatch count; over Piper's data-parallel
        # axis the plan sums what Megatron's DDP averages (unless the loss is per token: Megatron sums)
        self.grad_scale = 1.0 if zero is None or config.calculate_per_token_loss else 1.0 / dp
        tp, tp_rank = tensor_parallel(pg_collection), tensor_parallel_rank(pg_collection)
        if zero is None:  # every pipeline a copy of the plan, ordered (data replica, TP coordinate)
            replicas, plan_rank = pipelines(pp_rank, tp_rank), pp_rank
        else:  # one copy per TP coordinate: Piper's ZeRO over the data-parallel ranks of that coordinate
            replicas = plan_processes(plan, pp_rank, dp_rank, tp_rank, tp)
            plan_rank = plan.grid.rank(pp_rank, dp_rank)
        self._context = cpu_context()
        self._overlap_reduce = {s: _overlaps_reduce(c) for s, c in self.stages.items()}
        self._reduce_after = _last_backwards(plan, plan_rank)
        self._no_sync: dict[int, Any] = {}
        self.plan_rank, self.trace_dir, self.trace = plan_rank, trace_dir, None
        self.executor = Executor(plan, program, plan_rank, LocalChunks(self.stages), None, specs=specs,
                                 optimizer_fn=None, after_task=self._after,
                                 config=ExecutorConfig(timeout_s=timeout_s, loss_scale=self.grad_scale,
                                                       track_saved_memory=trace_memory,
                                                       replicas=tuple(tuple(r) for r in replicas),
                                                       tensor_parallel=tp))
        self.last_stage = num_stages - 1
        self.device = next((p.device for p in chunks[0].parameters()), torch.device("cpu"))  # the aux-loss scale's

    # -- gradient synchronisation, as Megatron's schedules defer and finish it ----------------
    def _disable_sync(self) -> None:
        no_sync = self.config.no_sync_func
        if no_sync is None:
            return
        funcs = no_sync if isinstance(no_sync, (list, tuple)) else [no_sync] * len(self.stages)
        for (s, _), func in zip(sorted(self.stages.items()), funcs):
            context = func()
            context.__enter__()
            self._no_sync[s] = context

    def _enable_sync(self, stage: int) -> None:
        context = self._no_sync.pop(stage, None)
        if context is not None:
            context.__exit__(None, None, None)

    def _after(self, key: str) -> None:
        """After a chunk's last backward on this rank its gradients are final: with overlapped
        reduction, it starts now (inside the rest of the step), as Megatron's last microbatch does."""
        stage = self._reduce_after.get(key)
        if stage is None or not self.running_backward:
            return
        self._enable_sync(stage)
        if self._overlap_reduce[stage]:
            with self._context():
                self.stages[stage].start_grad_sync()

    def run(self, forward_step_func, iterators: list[Iterator | None], *, forward_only: bool,
            collect_non_loss_data: bool, first_val_step, pg_collection, force_all_reduce) -> list[Any]:
        feeds = {stage_of(c, k, self.pp, self.pp_rank): DataFeed(it)
                 for k, (c, it) in enumerate(zip(self.chunks, iterators))}
        run = StageRun(forward_step_func=forward_step_func, feeds=feeds, num_microbatches=self.microbatches,
                       forward_only=forward_only, collect_non_loss_data=collect_non_loss_data, cp_size=self.cp_size,
                       first_val_step=first_val_step, store={}, num_tokens={})
        for chunk in self.executor.state.chunks.values():
            chunk.run = run
        inputs = {"batch": [Microbatch(i) for i in range(self.microbatches)]}
        set_aux_loss_scales(self.config, self.microbatches, self.cp_size, self.device, self.grad_scale)
        self.running_backward = not forward_only
        try:
            if forward_only:
                with self._context():
                    self.executor.eval(inputs)
                return self._reported(run)
            self._disable_sync()
            started = time.perf_counter()
            self.executor.step(microbatches=inputs, compute_context=self._context)
            if self.trace_dir is not None:  # evaluation-only engines never write one
                if self.trace is None:
                    self.trace = StepTrace(self.trace_dir, self.plan, self.plan_rank, dist.get_rank(), self.program)
                self.trace.record(self.executor.runner.timeline, time.perf_counter() - started,
                                  self.executor.state.meter if self.executor.config.track_saved_memory else None)
            for stage in sorted(self._no_sync):  # chunks with no backward on this rank (none in a pipeline)
                self._enable_sync(stage)
            if self.config.grad_sync_func is not None:
                for chunk in self.chunks:
                    self.config.grad_sync_func(chunk.parameters())
            if self.config.finalize_model_grads_func is not None:
                total = sum(run.num_tokens.values(), torch.zeros([], dtype=torch.int))
                with self._context():
                    self.config.finalize_model_grads_func(
                        self.chunks, total if self.config.calculate_per_token_loss else None,
                        pg_collection=pg_collection, force_all_reduce=force_all_reduce)
            return self._reported(run)
        finally:
            for stage in list(self._no_sync):
                self._enable_sync(stage)
            for chunk in self.executor.state.chunks.values():
                chunk.run = None

    def _reported(self, run: StageRun) -> list[Any]:
        if self.last_stage not in self.stages:
            return []
        return [run.store[i] for i in sorted(run.store)]


def stage_of(chunk: nn.Module, k: int, pp: int, pp_rank: int) -> int:
    """The pipeline stage of this rank's ``k``-th chunk: its ``piper_stage`` if it was built for
    a recipe's own layout, else Megatron's (``k * pp + pp_rank``)."""
    for module in (chunk, unwrap_chunk(chunk)):
        if getattr(module, "piper_stage", None) is not None:
            return int(module.piper_stage)
    return k * pp + pp_rank


def stage_placement(recipe: str | None, *, pp: int, stages: int, microbatches: int) -> dict[int, int]:
    """Stage -> pipeline rank, as ``recipe`` places ``stages`` stages on ``pp`` ranks (what to
    build where); a recipe that cannot is refused by name. A trace's placement is read on a
    stand-in model of ``stages`` stages: the model it was recorded on is checked when the real
    one is compiled."""
    name = recipe or ("1f1b" if stages == pp else "interleaved-1f1b")
    try:
        loaded = recipes.load(name)
        data = {**json.loads(Path(name).read_text()), "model": None} if name.endswith(".json") else {}
        shards = data.get("grid", {}).get("dp", 1) * data.get("grid", {}).get("ep", 1)  # a trace's data shards
        program = build_program({s: [("weight", (1,), 4)] for s in range(stages)}, microbatch_size=1,
                                microbatches=microbatches, hidden_shape=(1, 1, 1), dtype=torch.float32,
                                replicas=shards)
        if data:  # a trace (piper tune's): its placement, on a model of as many stages
            plan = compile_program(program, lambda prog: Schedule.from_json(prog, data)).plan
        else:
            plan = compile_program(program, lambda prog: loaded.schedule(
                prog, pp=pp, dp=1, ep=1, microbatches=microbatches, chunks=max(1, stages // pp), zero=0,
                bucket_bytes=None)).plan
    except (DirectiveError, recipes.RecipeError) as exc:
        raise ArgumentError(f"--piper-recipe {name}: {exc} ({stages} stages on --pipeline-model-parallel-size "
                            f"{pp})") from None
    return {int(r): rank for r, rank in plan.dag.meta.placement.items()}


def unwrap_chunk(module: nn.Module) -> nn.Module:
    """The model inside a chunk's wrappers (Megatron's DDP, :class:`~.zero.ZeroChunk`)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _overlaps_reduce(chunk: nn.Module) -> bool:
    ddp_config = getattr(chunk, "ddp_config", None)
    return bool(getattr(ddp_config, "overlap_grad_reduce", False)) and hasattr(chunk, "start_grad_sync")


def _last_backwards(plan, rank: int) -> dict[str, int]:
    """Task key -> stage, for the last backward task (B, BI or BW) of each of ``rank``'s stages
    in its streams' order: after it the stage's gradients for the step are complete on the rank."""
    last: dict[int, str] = {}
    for keys in plan.ranks[rank].streams.values():
        for key in keys:
            node = plan.dag.nodes[key]
            if node.kind.value in ("B", "BI", "BW"):
                last[node.stage] = key
    return {key: stage for stage, key in last.items()}
