"""``ModelSpec.pipelining_fn`` replacement: TorchTitan's stage split, Piper's schedule.

Stage boundaries follow TorchTitan's own rules (``pipeline_parallel_layers_per_stage``,
``module_fqns_per_model_part``, first/last stage weights); the recipe comes from
``pipeline_parallel_schedule`` (or ``--piper.recipe``); which stages a rank holds comes from the
compiled plan's placement (loop layout for 1F1B / GPipe / interleaved, V for ZBV / DualPipeV,
exactly as TorchTitan places them). Every rank compiles the same plan and checks its hash.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part, _get_pipeline_metadata, _split_module,
)
from torchtitan.tools.logging import logger

from piper_plugin import (
    DirectiveError, PlanError, Schedule, ValueSpec, check_plan_hash, compile_program, prediction_line, read_profile,
    recipes,
)

from piper_plugin.adapters.torchtitan.alternate import AlternatingSchedule, torch_schedule
from piper_plugin.adapters.torchtitan.flags import FlagError, one_line_errors
from piper_plugin.adapters.torchtitan.pieces import routed_layers
from piper_plugin.adapters.torchtitan.program import build_stage_program, hidden_name
from piper_plugin.adapters.torchtitan.resident import simulated_memory_line
from piper_plugin.adapters.torchtitan.schedule import PiperPipelineSchedule
from piper_plugin.adapters.torchtitan.stage_memory import apply_stage_memory, measure_stage_memory
from piper_plugin.adapters.torchtitan.tensor_parallel import check_tensor_parallel, plan_copies
from piper_plugin.adapters.torchtitan.titan_log import say_fsdp_withheld
from piper_plugin.adapters.torchtitan.zero import (
    check_parallelism, check_withheld, expert_faces, plan_replicas, shard_faces, shard_mesh, withhold_fsdp,
    zero_level,
)

__all__ = ["make_pipelining_fn", "pipeline_with_piper", "RECIPE_OF_SCHEDULE", "recipe_for"]

# TorchTitan schedule name -> the Piper recipe with the same stage layout and order family.
RECIPE_OF_SCHEDULE = {
    "1f1b": "1f1b",
    "gpipe": "gpipe",
    "interleaved1f1b": "interleaved-1f1b",
    "loopedbfs": "interleaved-1f1b",
    "interleavedzerobubble": "interleaved-1f1b",
    "zbvzerobubble": "dualpipev",
    "dualpipev": "dualpipev",
}


def recipe_for(schedule: str) -> str:
    name = schedule.lower()
    if name not in RECIPE_OF_SCHEDULE:
        raise FlagError(f"pipeline_parallel_schedule {schedule!r} has no Piper recipe; use one of "
                        f"{sorted(RECIPE_OF_SCHEDULE)} or pass --piper.recipe")
    return RECIPE_OF_SCHEDULE[name]


def _schedule_fn(recipe: str, *, pp: int, microbatches: int, stages: int, dp: int = 1, ep: int = 1,
                 zero: int = 0, bucket_bytes: int | None = None) -> tuple[str, Callable[[Any], Schedule]]:
    """(label, program -> Schedule) for a recipe name, a Python recipe file or a JSON trace."""
    try:
        loaded = recipes.load(recipe)
    except recipes.RecipeError as exc:
        raise FlagError(f"--piper.recipe: {exc}") from None
    chunks = max(1, stages // pp)
    buckets = bucket_bytes if loaded.builtin else None  # a user's recipe or trace sets its own
    return loaded.name, lambda program: loaded.schedule(program, pp=pp, dp=dp, ep=ep, microbatches=microbatches,
                                                        chunks=chunks, zero=zero, bucket_bytes=buckets)


def _compile(program, schedule_fn, world: int, split_last_backward: bool):
    compiled = compile_program(program, schedule_fn, split_last_backward=split_last_backward)
    if compiled.plan.grid.world_size != world:
        raise FlagError(f"the Piper schedule needs {compiled.plan.grid.world_size} ranks but the pipeline x "
                        f"data_parallel_shard_degree has {world}: a --piper.recipe trace fixes its own grid; "
                        f"record it for this mesh")
    return compiled  # its plan hash is the same in every process


def _unit(model: nn.Module, param_name: str) -> str:
    """The shortest module path above a parameter that is not a container (``layers`` is a
    ModuleDict / ModuleList; ``layers.3`` is a unit a stage can take)."""
    parts = param_name.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if not isinstance(model.get_submodule(name), (nn.ModuleList, nn.ModuleDict)):
            return name
    return param_name


def check_stage_modules(model: nn.Module, fqns: list[list[str]]) -> None:
    """Every name in ``--parallelism.module_fqns_per_model_part`` is a module of the model, and
    every parameter falls in some stage: a misspelt or left-out module would otherwise be
    dropped from every stage and the model would train without it."""
    modules = dict(model.named_modules())
    units = list(dict.fromkeys(_unit(model, n) for n, _ in model.named_parameters()))
    for name in (f for part in fqns for f in part):
        if name not in modules:
            raise FlagError(f"--parallelism.module_fqns_per_model_part names {name!r}, which {type(model).__name__} "
                            f"does not have; its stage units are {', '.join(units[:4])}, ..., {units[-1]}")
    named = [f for part in fqns for f in part]
    left = [u for u in units if not any(u == f or u.startswith(f + ".") or f.startswith(u + ".") for f in named)]
    if left:
        raise FlagError(f"--parallelism.module_fqns_per_model_part leaves {', '.join(left)} in no stage: the model "
                        f"would train without {'them' if len(left) > 1 else 'it'}; name every one of "
                        f"{type(model).__name__}'s stage units in some part")


def pipeline_with_piper(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                        dump_folder: str, device: torch.device, model_config, parallelize_fn, loss_fn,
                        options=None, alternate: bool = False) -> tuple[Any, list[nn.Module], bool, bool]:
    """TorchTitan's ``pipelining_fn`` contract; ``alternate`` also builds TorchTitan's own schedule
    over the same parts and alternates the two step by step (:mod:`.alternate`)."""
    zero = zero_level(parallelism, options, parallel_dims.dp_shard)
    check_parallelism(parallel_dims, zero, alternate)
    pp, dp = parallel_dims.pp, parallel_dims.dp_replicate  # dp: copies of the plan TorchTitan reduces
    tp = parallel_dims.tp  # a plan rank is a TP group: each member runs the plan on its local shards
    check_tensor_parallel(tp, zero, parallel_dims.ep)
    shards = parallel_dims.dp_shard if zero is not None else 1  # Piper's own data-parallel axis
    ep = parallel_dims.ep  # experts over the shards (check_parallelism): the grid's ep axis
    compiled = bool(getattr(compile_config, "enable", False)) and "model" in compile_config.components  # all ranks
    if ep > 1 and ac_config is not None:
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} with activation checkpointing under the Piper "
                        f"engine: a recomputed MoE layer would exchange its tokens again inside the backward; "
                        f"end the command with activation-checkpoint:none")
    num_stages, num_layers, input_weight, output_weight = _get_pipeline_metadata(parallel_dims, parallelism, model_config)
    if parallelism.module_fqns_per_model_part:
        check_stage_modules(model, parallelism.module_fqns_per_model_part)
    fqns = parallelism.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(
        num_stages, num_layers, input_weight, output_weight)
    num_stages = len(fqns)
    mbs = parallelism.pipeline_parallel_microbatch_size
    if training.local_batch_size % mbs:
        raise FlagError(f"local_batch_size {training.local_batch_size} is not a multiple of "
                        f"pipeline_parallel_microbatch_size {mbs}")
    microbatches = training.local_batch_size // mbs
    recipe = getattr(options, "recipe", None) or recipe_for(parallelism.pipeline_parallel_schedule)
    bucket_mb = getattr(options, "bucket_mb", None)
    label, schedule_fn = _schedule_fn(recipe, pp=pp, microbatches=microbatches, stages=num_stages, dp=shards // ep,
                                      ep=ep, zero=zero or 0,
                                      bucket_bytes=int(bucket_mb * 2**20) if bucket_mb else None)
    dtype = next(model.parameters()).dtype
    dim = getattr(model_config, "dim", None) or getattr(model_config, "hidden_size")
    sizes = dict(microbatch_size=mbs, microbatches=microbatches, seq_len=training.seq_len, hidden_dim=dim,
                 dtype=dtype, model_type=type(model).__name__, data_shards=shards)

    # 1. every stage on the meta device; the recipe's placement says which are ours
    parts = [_split_module(model, names) for names in fqns]
    split_last_backward = ac_config is None  # AC may allow only one backward through a stage
    program = build_stage_program(parts, **sizes)  # whole stages: what the memory probe can run
    memory = measure_stage_memory(program, parts, loss_fn, ac_config=ac_config, dump_folder=dump_folder,
                                  seq_len=training.seq_len, split=split_last_backward)
    if ep > 1:  # MoE stages as pieces around their expert all-to-alls (:mod:`.pieces`)
        program = build_stage_program(parts, **sizes, routed=True)  # experts whole: not yet split
        if not program.dag.meta.routed:
            raise FlagError(f"--parallelism.expert_parallel_degree {ep}: {type(model).__name__} has no routed-expert "
                            f"(MoE) layer to split over ranks; set --parallelism.expert_parallel_degree 1")
        check_expert_split(program, ep)
    try:
        plan = _compile(program, schedule_fn, pp * shards, split_last_backward).plan
    except (DirectiveError, recipes.RecipeError) as exc:
        raise FlagError(f"Piper recipe {label!r} does not fit {num_stages} stages on pp={pp} "
                        f"(--parallelism.pipeline_parallel_schedule {parallelism.pipeline_parallel_schedule}): {exc}; "
                        f"under TorchTitan the stages come from --parallelism.pipeline_parallel_layers_per_stage or "
                        f"--parallelism.module_fqns_per_model_part") from None
    pp_rank = parallel_dims.get_mesh("pp").get_local_rank()
    placement = plan.dag.meta.placement
    local = sorted({plan.dag.regions[r].stage for r, rank in placement.items() if rank == pp_rank})

    # 2. SPMD parallelisms (AC, compile, ...) on our parts, as TorchTitan's pipeline_llm does
    model_parts: dict[int, nn.Module] = {}
    mixed: tuple[torch.dtype | None, torch.dtype | None] = (None, None)  # Piper ZeRO's (param, reduce) dtypes
    if zero is not None:
        say_fsdp_withheld(f"FSDP withheld: Piper's ZeRO-{zero} shards the parameters over {shards} data-parallel ranks")
    for s in local:
        withheld: list[dict[str, Any]] = []
        with withhold_fsdp(withheld) if zero is not None else contextlib.nullcontext():
            model_parts[s] = parallelize_fn(parts[s], parallel_dims=parallel_dims, training=training,
                                            parallelism=parallelism, compile_config=compile_config,
                                            ac_config=ac_config, dump_folder=dump_folder)
        if zero is not None:
            mixed = check_withheld(withheld, training, model_parts[s], zero)
        parts[s] = model_parts[s]
        logger.info(f"Piper: PP rank {pp_rank} holds stage {s} with modules {fqns[s]}")

    # 3. the plan over the parts as they will run (parameter names after wrapping), with the
    # stages' memory measured in 1
    program = build_stage_program(parts, **sizes, routed=ep > 1, expert_shards=ep,  # TorchTitan split the experts
                                  compiled=compiled)
    apply_stage_memory(program, memory)
    built = _compile(program, schedule_fn, pp * shards, split_last_backward)
    plan, result = built.plan, built.simulation
    try:  # before TorchTitan's own collectives run on these parts
        check_plan_hash(plan, replicas=dp * tp, tensor_parallel=tp)
    except PlanError as exc:
        raise FlagError(f"--parallelism.tensor_parallel_degree {tp} with Piper recipe {label!r}: {exc}") from None
    mesh = shard_mesh(parallel_dims) if zero is not None else None
    for s in local:  # DTensor faces, before TorchTitan initialises the parameters
        experts = {n for layer in routed_layers(model_parts[s]) for n in layer} if ep > 1 else set()
        if zero:  # Piper shards the dense parameters; the experts stay as TorchTitan split them
            shard_faces(model_parts[s], mesh, skip={id(p) for n, p in model_parts[s].named_parameters() if n in experts})
        if experts:
            expert_faces(model_parts[s], parallel_dims.get_mesh("ep"), experts)
    plan_rank = (plan.grid.rank(pp_rank, *divmod(mesh.get_local_rank(mesh.ndim - 1), ep)) if mesh is not None
                 else pp_rank)
    replicas = f" x {dp} data-parallel replicas" if dp > 1 else ""
    sharded = f" x ZeRO-{zero} over {shards} data-parallel ranks" if zero is not None else ""
    sharded += f", experts over {ep}" if ep > 1 else ""
    logger.info(f"Piper: recipe {label}, {num_stages} stages on {pp} ranks{sharded}{replicas}, {microbatches} "
                f"microbatches, plan {plan.hash()}, simulated bubble {result.bubble_fraction:.3f}")
    logger.info(simulated_memory_line(dist.get_rank(), plan_rank, result))
    if getattr(options, "profile", None):
        logger.info(_predicted_line(plan, options.profile))
    if compiled:
        logger.info("Piper: --compile.enable compiles the model's blocks: each compiled backward yields input and "
                    "weight gradients in one call, so every backward runs as one pass (the plan times each "
                    "input-gradient task as a whole backward and its weight-gradient task as nothing)")
    # what a stage hands the next: each TP rank's local tensor (under sequence parallelism its
    # slice of the sequence), to the same TP rank of the next stage
    hidden_seq = training.seq_len // tp if tp > 1 and parallelism.enable_sequence_parallel else training.seq_len
    specs = {hidden_name(s): ValueSpec((mbs, hidden_seq, dim), mixed[0] or _hidden_dtype(model_parts, training, dtype))
             for s in range(num_stages - 1)}
    trace, trace_memory = getattr(options, "trace", None), bool(getattr(options, "trace_memory", False))
    if trace_memory and not trace:
        raise FlagError("--piper.trace_memory records into the step trace: add --piper.trace DIR")
    schedule = PiperPipelineSchedule(plan=plan, program=program, parts=model_parts, loss_fn=loss_fn,
                                     rank=plan_rank, specs=specs, timeout_s=getattr(options, "timeout_s", 300.0),
                                     tensor_parallel=tp,
                                     recipe=label, mixed_precision=mixed, experts_sharded=ep > 1,
                                     trace_dir=trace, trace_memory=trace_memory,
                                     replicas=(plan_replicas(parallel_dims, mesh, plan.grid) if mesh is not None
                                               else plan_copies(parallel_dims)))
    if alternate:
        baseline = torch_schedule(model_parts, parallel_dims=parallel_dims, parallelism=parallelism,
                                  training=training, device=device, loss_fn=loss_fn)
        schedule = AlternatingSchedule(baseline, schedule)
    return schedule, [model_parts[s] for s in local], 0 in model_parts, num_stages - 1 in model_parts


def _predicted_line(plan, profile: str) -> str:
    """``--piper.profile``: the plan's step, bubble and peaks as the cost profile predicts them."""
    try:
        return f"Piper: {prediction_line(plan, read_profile(profile), profile)}"
    except ValueError as exc:  # not a profile, or one this version cannot read
        raise FlagError(f"--piper.profile: {exc}") from None


def _hidden_dtype(parts: dict[int, nn.Module], training, param_dtype: torch.dtype) -> torch.dtype:
    """What stages hand each other: FSDP's mixed-precision policy (``mixed_precision_param``)
    casts the parameters, hence the activations, of wrapped parts; otherwise the parameters' dtype."""
    from torchtitan.config import TORCH_DTYPE_MAP

    wrapped = any(isinstance(m, FSDPModule) for p in parts.values() for m in p.modules())
    return TORCH_DTYPE_MAP[training.mixed_precision_param] if wrapped else param_dtype


def make_pipelining_fn(options=None, alternate: bool = False) -> Callable[..., Any]:
    """A ``ModelSpec.pipelining_fn`` running Piper with ``options`` (``PiperOptions``); a flag it
    refuses ends the process in one line (:mod:`.flags`; caught here, inside TorchTitan's
    ``Trainer.__init__``, whose elastic ``record`` would write the traceback for torchrun)."""
    def pipelining_fn(*args, **kwargs):
        with one_line_errors():
            return pipeline_with_piper(*args, options=options, alternate=alternate, **kwargs)
    return pipelining_fn


def check_expert_split(program, ep: int) -> None:
    """Each MoE layer's experts split evenly over the ``ep`` ranks (each holds ``experts / ep``)."""
    meta = program.dag.meta
    counts = sorted({meta.param_shapes[name][0] for region in meta.routed for name in program.dag.regions[region].params})
    uneven = [n for n in counts if n % ep]
    if uneven:
        divisors = [d for d in range(2, uneven[0] + 1) if all(n % d == 0 for n in counts)]
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} does not divide the {uneven[0]} experts of a MoE "
                       f"layer (each rank holds experts / degree of them); set it to one of {divisors}, with "
                       f"--parallelism.data_parallel_shard_degree the same")
