"""Piper's ZeRO under Megatron's pipeline (``--piper-zero 1|2|3``), in place of Megatron's DDP.

Megatron shards at most the optimizer state (its distributed optimizer: ZeRO-1) and keeps
whole gradient buffers. With ``zero`` set, :class:`ZeroChunk` stands where Megatron's
``DistributedDataParallel`` would, and the Piper plan gets a data-parallel axis over Megatron's
data-parallel group with ``replicate(zero=level)`` on every stage: level 2 reduce-scatters the
gradients per microbatch and keeps only this rank's rows, level 3 also frees the parameters
after each use and gathers them again per microbatch.

Between steps each parameter is a DTensor face of this rank's shard (``Shard(0)`` over the
data-parallel group; :mod:`piper_plugin.runtime.host_faces`), carrying Megatron's own tags
(``shared``, ``allreduce``...): Megatron's optimizer, its weight-decay groups, gradient clipping
(whose norm sums DTensor gradients over their group) and ``finalize_model_grads`` (the tied
embedding's reduction) run on them unchanged, and an update lands in Piper's shard.

Checkpoints (:func:`full_model_state`, :func:`load_full_model_state`, :func:`local_optimizer_state`,
:func:`load_local_optimizer_state`): the model is saved whole, in Megatron's layout (any engine
loads it); each data-parallel rank saves its own rows of the optimizer state.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["ZeroChunk", "LEVELS", "own_expert", "full_model_state", "load_full_model_state", "local_optimizer_state",
           "load_local_optimizer_state"]

LEVELS = (1, 2, 3)


def own_expert(param: nn.Parameter) -> bool:
    """An expert rank's own expert parameter (Megatron tags it ``allreduce=False``): not
    replicated over the data-parallel group, so outside the plan's ZeRO buckets."""
    return not getattr(param, "allreduce", True)


class ZeroChunk(nn.Module):
    """A model chunk whose data parallelism is Piper's ZeRO: what Megatron's schedules,
    optimizer and ``finalize_model_grads`` ask of a DDP-wrapped chunk, with the reduction left to
    the Piper plan (``no_sync`` / ``start_grad_sync`` / ``finish_grad_sync`` have nothing to do;
    gradients are reduced inside the step)."""

    def __init__(self, config, module: nn.Module):
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__()
        self.config = config
        self.module = module
        self.ddp_config = DistributedDataParallelConfig()  # no Megatron FSDP, no distributed optimizer

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def start_grad_sync(self) -> None:
        pass

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """An expert rank's own experts (``allreduce=False``) are outside the plan's buckets:
        their gradients, scaled as the plan scales every gradient, are summed here over the
        expert-data-parallel group (Megatron's DDP does the same for them)."""
        from megatron.core import parallel_state

        grads = [p.grad for p in self.module.parameters() if own_expert(p) and p.grad is not None]
        group = parallel_state.get_expert_data_parallel_group()
        if grads and dist.get_world_size(group) > 1:  # one collective for them all
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(summed.view_as(g))

    def zero_grad_buffer(self) -> None:
        pass  # the plan starts each step's shard gradients anew; the optimizer clears the faces'

    def scale_gradients(self, scaling: float) -> None:
        """Megatron's per-token normalisation (``calculate_per_token_loss``): scale this rank's rows."""
        for p in self.module.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(scaling)


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s checkpoint state with every face gathered whole (a collective over each
    face's data-parallel group: every member calls it, in one order)."""
    state = module.state_dict_for_save_checkpoint(keep_vars=True)
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value.detach() if
                  isinstance(value, torch.Tensor) else value) for key, value in state.items()}


def load_full_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Load a whole (Megatron-layout) model state into ``module``: each face takes its own rows
    (FSDP2's split: ``ceil(rows / n)`` per member), other tensors are copied whole."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"model state does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for key, target in own.items():
            value = state[key]
            if isinstance(target, DTensor):
                local = target.to_local()
                local.copy_(_rows(value, target).view_as(local))
            elif isinstance(target, torch.Tensor):
                target.copy_(value)


def _rows(whole: torch.Tensor, face: DTensor) -> torch.Tensor:
    """This member's rows of ``whole`` under ``face``'s ``Shard(0)`` over the last mesh dimension
    (``torch.chunk``'s split, as FSDP2 and Piper's buckets cut rows; trailing members may get none)."""
    mesh = face.device_mesh
    n, me = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    pieces = (whole.reshape(1) if whole.dim() == 0 else whole).chunk(n)
    return pieces[me] if me < len(pieces) else whole.new_empty((0, *whole.shape[1:]))


def local_optimizer_state(inner: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer's state dict with DTensor states as this rank's rows (plain tensors)."""
    state = inner.state_dict()
    state["state"] = {k: {name: (v.to_local().clone() if isinstance(v, DTensor) else v) for name, v in s.items()}
                      for k, s in state["state"].items()}
    return state


def load_local_optimizer_state(inner: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what :func:`local_optimizer_state` saved: per-parameter states shaped like a face's
    rows become DTensors over the face's mesh again."""
    inner.load_state_dict(state)
    for group in inner.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in inner.state:
                continue
            local = p.to_local()
            for name, v in list(inner.state[p].items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == local.shape:
                    inner.state[p][name] = DTensor.from_local(v.to(local.device), p.device_mesh, p.placements,
                                                              run_check=False, shape=p.shape, stride=p.stride())
