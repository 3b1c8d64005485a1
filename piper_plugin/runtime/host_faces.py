"""DTensor faces of ZeRO shards, for a host that steps, clips and checkpoints its own optimizer.

Between steps every parameter Piper shards (a region replicated with ZeRO >= 1) is registered
in its module as a *face*: an ``nn.Parameter`` holding a DTensor, ``Shard(0)`` over the
region's data-parallel group, whose local tensor is this rank's rows of the parameter (the
very storage the ZeRO bucket steps: a host update lands in Piper's shard) and whose ``.grad``
is the reduced gradient of those rows after a step (``None`` where no rank had one). The host
therefore sees each parameter as itself (FQN, global shape, ``requires_grad``, its own
non-tensor attributes, FSDP2's DCP layout; faces over the same ranks share one device mesh):
its optimizer groups, gradient clipping over DTensors and checkpointer work unchanged.
During a step the whole compute parameters are registered instead.

A host may hand over faces it made itself (sharded before its weights were initialised, as
FSDP2 does on the meta device): :func:`unwrap_faces` gathers them whole, before Piper builds
its buckets, and :meth:`HostFaces.bind` points each face at the bucket's shard.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from piper_plugin.runtime.buckets import FlatBucket

__all__ = ["HostFaces", "unwrap_faces"]

Slot = tuple[nn.Module, str]


def _slots(model: nn.Module) -> dict[int, list[Slot]]:
    """id(parameter) -> every (module, attribute) registering it."""
    out: dict[int, list[Slot]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, name))
    return out


def unwrap_faces(model: nn.Module, keep: set[int] = frozenset()) -> dict[int, nn.Parameter]:
    """Replace every DTensor parameter of ``model`` by a plain one holding it whole (a
    collective over each face's mesh, in module order on every rank), but those whose id is in
    ``keep`` (experts the host sharded over the plan's ep axis). Returns id(plain) -> face."""
    faces: dict[int, nn.Parameter] = {}
    for pid, slots in _slots(model).items():
        face = getattr(slots[0][0], slots[0][1])
        if not isinstance(face, DTensor) or pid in keep:
            continue
        placements = tuple(face.placements)
        if placements != (Replicate(),) * (len(placements) - 1) + (Shard(0),):
            raise ValueError(f"parameter {slots[0][1]!r} of {type(slots[0][0]).__name__} is a DTensor placed "
                             f"{placements}; Piper takes over parameters sharded Shard(0) over the last mesh "
                             f"dimension, replicated over any others (FSDP2's and HSDP's layouts) only")
        with torch.no_grad():
            whole = nn.Parameter(face.full_tensor().clone(), requires_grad=face.requires_grad)
        for module, name in slots:
            module._parameters[name] = whole
        faces[id(whole)] = face
    return faces


def _carry_tags(p: nn.Parameter, face: nn.Parameter) -> None:
    """The host's own tags on a parameter (plain Python attributes, e.g. Megatron's ``shared``,
    ``allreduce``, ``tensor_model_parallel``) go with its face; tensors hung on it (gradient
    buffers) do not."""
    for name, value in vars(p).items():
        if not name.startswith("_") and not isinstance(value, torch.Tensor):
            setattr(face, name, value)


class HostFaces:
    """The faces of one rank's ZeRO buckets (see the module docstring)."""

    def __init__(self, model: nn.Module, buckets: dict[Any, Any], group_of: Callable[[Any], dist.ProcessGroup],
                 adopted: dict[int, nn.Parameter], device_type: str):
        slots = _slots(model)
        self.buckets = {key: b for key, b in buckets.items() if b.shards}
        self.entries: list[tuple[list[Slot], nn.Parameter, nn.Parameter, Any, int]] = []
        meshes: dict[tuple[int, ...], DeviceMesh] = {}  # one mesh per member set: faces share its group
        for key, bucket in self.buckets.items():
            mesh = None  # the bucket's, made when its first face is
            for i, (p, shard) in enumerate(zip(bucket.params, bucket.shards)):
                face = adopted.get(id(p))
                if face is None:
                    if mesh is None:
                        group = group_of(key)
                        members = tuple(dist.get_process_group_ranks(group))
                        if members not in meshes:
                            meshes[members] = DeviceMesh.from_group(group, device_type)
                        mesh = meshes[members]
                    face = nn.Parameter(DTensor.from_local(shard.detach(), mesh, [Shard(0)],
                                                           run_check=False, shape=p.shape, stride=p.stride()),
                                        requires_grad=p.requires_grad)
                    _carry_tags(p, face)
                else:
                    mesh, dim = face.device_mesh, face.device_mesh.ndim - 1  # sharded over the last dimension
                    if mesh.size(dim) != bucket.n or mesh.get_local_rank(dim) != bucket.index:
                        raise ValueError(f"a host-sharded parameter of shape {tuple(p.shape)} lives on a mesh of "
                                         f"{mesh.size(dim)} ranks where this rank is {mesh.get_local_rank(dim)}, but "
                                         f"Piper's plan shards it {bucket.n} ways with this rank as member "
                                         f"{bucket.index}: give the plan the host's data-parallel ranks in mesh order")
                    face._local_tensor.data = shard.detach()  # the host's updates land in Piper's shard
                self.entries.append((slots.get(id(p), []), p, face, bucket, i))
        self.faces_in()

    def compute_in(self) -> None:
        """Register the whole compute parameters (a step runs on them)."""
        for slots, p, _, _, _ in self.entries:
            for module, name in slots:
                module._parameters[name] = p

    def faces_in(self) -> None:
        """Register the faces, each with its shard's reduced gradient (or None)."""
        for slots, _, face, bucket, i in self.entries:
            grad = bucket.shards[i].grad
            face.grad = None if grad is None else DTensor.from_local(
                grad, face.device_mesh, face.placements, run_check=False, shape=face.shape, stride=face.stride())
            for module, name in slots:
                module._parameters[name] = face

    def refresh(self, gather: Callable[[Any, FlatBucket], None]) -> None:
        """ZeRO-1/2 keep whole parameters: after the host stepped the shards, gather them anew
        (``gather(bucket key, bucket)`` fills the bucket's parameters, in bucket order on every
        rank)."""
        for key, bucket in self.buckets.items():
            if bucket.zero < 3:
                gather(key, bucket)

    def new_step(self) -> None:
        """The host stepped (and cleared its gradients): the buckets' shard gradients start anew."""
        for bucket in self.buckets.values():
            bucket.step_done()
