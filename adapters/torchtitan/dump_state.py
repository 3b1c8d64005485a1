"""``--piper.dump_state DIR``: each process writes, after every step, its model parts' parameters
(as the step left them) and gradients (the step's, as the optimizer saw them) as whole tensors by
name, ``DIR/step<N>_rank<R>.pt``; :func:`read_state` puts one step's files together. What a
per-parameter comparison of two engines, or of an engine and single-device training, reads.

DTensors (FSDP's shards, Piper's ZeRO faces, experts split over ranks) are gathered whole first:
``full_tensor`` is a collective of the tensor's mesh, which every member joins in the same order
(the members of a mesh hold the same parameter names in the same order). Names drop the wrappers
TorchTitan adds (activation checkpointing, compile), so both engines' files share keys.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["dump_state", "read_state"]

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _whole(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # a DTensor: gathered over its mesh
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def dump_state(model_parts: list[nn.Module], folder: str | Path, step: int, rank: int) -> Path:
    """Write this process's parameters and gradients after ``step``; returns the file."""
    state: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}}
    for part in model_parts:
        for name, p in part.named_parameters():
            state["params"][_name(name)] = _whole(p)
            if p.grad is not None:
                state["grads"][_name(name)] = _whole(p.grad)
    path = Path(folder) / f"step{step}_rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def read_state(folder: str | Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """One step's parameters and gradients by name from every process's file. Copies of one
    tensor on several processes (data-parallel replicas, gathered shards) must be equal; a
    difference raises :class:`ValueError` naming the tensor and the files."""
    merged: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}}
    where: dict[tuple[str, str], str] = {}
    files = sorted(Path(folder).glob(f"step{step}_rank*.pt"))
    if not files:
        raise FileNotFoundError(f"no step{step}_rank*.pt in {folder}")
    for path in files:
        state = torch.load(path, weights_only=True)
        for kind in ("params", "grads"):
            for name, t in state[kind].items():
                if name in merged[kind]:
                    first = merged[kind][name]
                    if first.shape != t.shape or not torch.allclose(first, t, rtol=1e-6, atol=0):
                        raise ValueError(f"{kind} {name}: {where[kind, name]} and {path.name} hold different values")
                    continue
                merged[kind][name], where[kind, name] = t, path.name
    return merged
