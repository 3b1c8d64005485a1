"""``--parallelism.data_parallel_shard_degree D`` under the Piper engine: Piper's ZeRO, not FSDP.

The pipeline plan gets a data-parallel axis of ``D`` ranks with ``replicate(zero=level)`` over
every stage; the level is TorchTitan's own knob (``--parallelism.fsdp_reshard_after_forward``:
``never`` -> ZeRO-2, ``default`` / ``always`` -> ZeRO-3) unless ``--piper.zero`` sets it.
TorchTitan's ``parallelize_fn`` still applies activation checkpointing (and the rest of its
SPMD work) to each stage, but its ``fully_shard`` calls are withheld (:func:`withhold_fsdp`):
Piper gathers, frees and reduce-scatters the parameters per microbatch as its plan orders.
Each parameter is registered as a DTensor face (``Shard(0)`` over TorchTitan's ``fsdp``
mesh, FSDP2's layout) while still on the meta device (:func:`shard_faces`), so TorchTitan's
``init_weights`` initialises exactly what FSDP2 would, and its optimizer, gradient clipping and
DCP checkpoints see the parameters as they would under FSDP2
(:mod:`piper_plugin.runtime.host_faces` keeps the faces on Piper's shards).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from piper_plugin.adapters.torchtitan.flags import FlagError

__all__ = ["zero_level", "check_parallelism", "withhold_fsdp", "check_withheld", "shard_faces", "shard_mesh",
           "expert_faces",
           "plan_replicas"]

_LEVEL_OF_RESHARD = {"never": 2, "default": 3, "always": 3}


def zero_level(parallelism, options, shard_degree: int) -> int | None:
    """The ZeRO level Piper runs, or None when there is no data-parallel shard axis
    (``shard_degree``: the resolved one; TorchTitan's flag may say -1, "the rest")."""
    level = getattr(options, "zero", None)
    if shard_degree <= 1:
        if level is not None:
            raise FlagError(f"--piper.zero {level} needs --parallelism.data_parallel_shard_degree > 1 (the ranks "
                            f"ZeRO shards over); drop --piper.zero or set the shard degree")
        return None
    if level is None:
        return _LEVEL_OF_RESHARD[parallelism.fsdp_reshard_after_forward]
    if level not in (0, 1, 2, 3):
        raise FlagError(f"--piper.zero {level}: the ZeRO level is 0, 1, 2 or 3")
    return level


def check_parallelism(parallel_dims, zero: int | None = None, alternate: bool = False) -> None:
    """The meshes Piper's engine runs: pp x dp_shard (ZeRO), pp x dp_replicate, or both (HSDP:
    ZeRO over each replica's shards, the gradients summed over the replicas); expert
    parallelism over the whole dp_shard group (TorchTitan's ep borrowed from it); TorchTitan's
    tensor parallelism in the stages (:mod:`.tensor_parallel` says with what)."""
    unsupported = [(flag, degree) for flag, degree in (
        ("context_parallel_degree", parallel_dims.cp),) if degree > 1]
    if unsupported:
        flags = ", ".join(f"--parallelism.{flag} {degree}" for flag, degree in unsupported)
        raise FlagError(f"{flags}: the Piper engine runs pipeline x data x expert x tensor parallelism (ZeRO over "
                        f"data_parallel_shard_degree, replicated by data_parallel_replicate_degree, experts over "
                        f"expert_parallel_degree, TorchTitan's TP in the stages), not yet context parallelism; set "
                        f"{', '.join(f'--parallelism.{flag} 1' for flag, _ in unsupported)} or use "
                        f"--parallelism.pipeline_engine torch")
    ep = parallel_dims.ep
    if ep <= 1:
        return
    if alternate:
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} with --parallelism.pipeline_engine alternate: "
                        f"the two engines dispatch experts differently; compare them in two runs (piper, torch)")
    if ep != parallel_dims.dp_shard:
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} with data_parallel_shard_degree "
                        f"{parallel_dims.dp_shard}: the Piper engine shards experts over the whole shard group "
                        f"(each expert on one rank); set --parallelism.expert_parallel_degree "
                        f"{parallel_dims.dp_shard} or use --parallelism.pipeline_engine torch")
    if zero == 3:
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} with ZeRO-3 (--piper.zero 3, or "
                        f"fsdp_reshard_after_forward default / always): the Piper engine runs expert "
                        f"parallelism with ZeRO 1-2 for now; add --piper.zero 2 (or 1)")
    if zero == 0:  # TorchTitan's clipping under EP wants every parameter a DTensor; ZeRO-0 keeps them plain
        raise FlagError(f"--parallelism.expert_parallel_degree {ep} with --piper.zero 0: TorchTitan's gradient "
                        f"clipping under expert parallelism needs sharded (DTensor) parameters; use --piper.zero 2 "
                        f"(or 1)")


@contextlib.contextmanager
def withhold_fsdp(calls: list[dict[str, Any]]) -> Iterator[None]:
    """Within the block TorchTitan's ``fully_shard`` (bound by name in each of its modules)
    records its keyword arguments in ``calls`` and leaves the module as it is, its FSDP
    settings (``set_*``: prefetching, resharding) accepted and ignored."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    settings = [name for name in dir(FSDPModule) if name.startswith("set_")]  # e.g. prefetch under EP

    def withheld(module, **kwargs):
        calls.append(kwargs)
        for unit in module if isinstance(module, (list, tuple)) else [module]:
            for name in settings:  # what TorchTitan may set on the unit afterwards: nothing to set
                object.__setattr__(unit, name, _ignore)
        return module

    patched = [(m, name) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("torchtitan")
               for name in ("fully_shard",) if getattr(m, name, None) is fully_shard]
    for module, name in patched:
        setattr(module, name, withheld)
    try:
        yield
    finally:
        for module, name in patched:
            setattr(module, name, fully_shard)


def _ignore(*args, **kwargs) -> None:
    return None


def check_withheld(calls: list[dict[str, Any]], training: Any, part: nn.Module,
                   zero: int) -> tuple[torch.dtype | None, torch.dtype | None]:
    """What FSDP would have done that Piper's ZeRO does itself: its mixed-precision policy,
    returned as (param dtype, reduce dtype) for Piper's buckets (None: the parameters' own).
    Refuses, by flag, what Piper's ZeRO does not do."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in part.modules()):
        raise FlagError("this model's parallelize_fn applied FSDP in a way Piper cannot take over; run "
                        "--parallelism.data_parallel_shard_degree with --parallelism.pipeline_engine torch")
    dtype = next((p.dtype for p in part.parameters()), torch.float32)
    wanted = reduce = None
    for kwargs in calls:
        if kwargs.get("offload_policy") is not None:
            raise FlagError("--training.enable_cpu_offload with the Piper engine's ZeRO: not supported; turn it off")
        policy = kwargs.get("mp_policy")
        wanted = getattr(policy, "param_dtype", None) or wanted
        reduce = getattr(policy, "reduce_dtype", None) or reduce
    if wanted is not None and wanted != dtype and zero == 0:
        raise FlagError(f"--training.mixed_precision_param {training.mixed_precision_param} with --piper.zero 0: "
                        f"Piper computes in the master weights' dtype without shards; use --piper.zero 1, 2 or 3 "
                        f"(bf16 compute copies of fp32 shards) or --training.mixed_precision_param "
                        f"{str(dtype).removeprefix('torch.')}")
    return (wanted if wanted != dtype else None), (reduce if reduce != dtype else None)


def shard_faces(part: nn.Module, mesh, skip: set[int] = frozenset()) -> None:
    """Register every parameter of ``part`` (on the meta device) as a DTensor face sharded
    ``Shard(0)`` over ``mesh``'s last dimension (replicated over the others: HSDP), with the
    local shape FSDP2 gives it (rows cut like ``torch.chunk``), so initialising the part fills
    exactly this rank's rows. Parameters whose id is in ``skip`` stay as they are."""
    n, me = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    faces: dict[int, nn.Parameter] = {}
    for module in part.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor) or id(p) in skip:
                continue
            face = faces.get(id(p))
            if face is None:
                rows = p.shape[0] if p.dim() else 1
                chunk = -(-rows // n)
                mine = max(0, min(chunk, rows - me * chunk))
                local = torch.empty((mine, *p.shape[1:]) if p.dim() else (mine,), dtype=p.dtype, device=p.device)
                face = nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                                                       stride=p.stride()), requires_grad=p.requires_grad)
                faces[id(p)] = face
            module._parameters[name] = face


def expert_faces(part: nn.Module, mesh, names: set[str]) -> None:
    """Register the experts ``names`` of ``part`` (this rank's experts, as TorchTitan split them
    over the ep axis) as DTensor faces ``Shard(0)`` over ``mesh`` (TorchTitan's ``ep`` mesh), as
    its gradient clipping and checkpoints expect expert parameters under expert parallelism."""
    n = mesh.size()
    for module_name, module in part.named_modules():
        for name, p in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if p is None or full not in names or isinstance(p, DTensor):
                continue
            shape = (p.shape[0] * n, *p.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            module._parameters[name] = nn.Parameter(
                DTensor.from_local(p.data, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride),
                requires_grad=p.requires_grad)


def shard_mesh(parallel_dims):
    """TorchTitan's data-parallel mesh that FSDP would shard over: ``fsdp`` (``dp_shard`` in
    the SPMD backends, where asking for ``fsdp`` raises), as (``dp_replicate``, that) with
    replicas (HSDP's 2-D mesh)."""
    try:
        shard = "fsdp" if parallel_dims.get_optional_mesh("fsdp") is not None else "dp_shard"
    except ValueError:
        shard = "dp_shard"
    if parallel_dims.dp_replicate > 1:
        return parallel_dims.get_mesh(["dp_replicate", shard])
    return parallel_dims.get_mesh(shard)


def plan_replicas(parallel_dims, mesh, grid) -> list[list[int]]:
    """Process rank of every plan rank, per replica (a collective): the plan rank at pipeline rank
    ``pp`` and data shard ``d`` (``grid.data_shard``) of replica ``i`` is the process at pipeline
    rank ``pp``, shard rank ``d`` (``mesh``'s last dimension) and replicate rank ``i``."""
    replica = mesh.get_local_rank(0) if mesh.ndim > 1 else 0
    mine = (replica, parallel_dims.get_mesh("pp").get_local_rank(), mesh.get_local_rank(mesh.ndim - 1))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    where = {coords: process for process, coords in enumerate(everyone)}
    return [[where[(i, grid.coords(r)[0], grid.data_shard(r))] for r in range(grid.world_size)]
            for i in range(parallel_dims.dp_replicate)]
