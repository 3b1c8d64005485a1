"""``--piper.dump_state DIR``: each process writes, after every step, its model parts' parameters
(as the step left them) and gradients (the step's, as the optimizer saw them) by name, as whole
tensors and as the process's local shards (``local_params`` / ``local_grads``: what a TP or
FSDP rank holds), ``DIR/step<N>_rank<R>.pt``; :func:`read_state` puts one step's whole tensors
together, :func:`read_local` reads one process's shards. What a
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

__all__ = ["dump_state", "read_state", "read_local", "state_differences"]

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _whole(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # a DTensor: gathered over its mesh
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``t`` (a DTensor's local shard)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().to("cpu", copy=True)


def dump_state(model_parts: list[nn.Module], folder: str | Path, step: int, rank: int) -> Path:
    """Write this process's parameters and gradients after ``step``; returns the file."""
    state: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}, "local_params": {}, "local_grads": {}}
    for part in model_parts:
        for name, p in part.named_parameters():
            state["params"][_name(name)] = _whole(p)
            state["local_params"][_name(name)] = _local(p)
            if p.grad is not None:
                state["grads"][_name(name)] = _whole(p.grad)
                state["local_grads"][_name(name)] = _local(p.grad)
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


def read_local(folder: str | Path, step: int, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Process ``rank``'s local shards after ``step``: ``{"params": ..., "grads": ...}`` by name."""
    state = torch.load(Path(folder) / f"step{step}_rank{rank}.pt", weights_only=True)
    return {"params": state["local_params"], "grads": state["local_grads"]}


def _worst(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> float:
    """Largest max|got - want| / max|want| over the tensors of ``want`` (names must agree)."""
    if want.keys() != got.keys() or not want:
        raise ValueError(f"{what}: the runs hold different tensors (only in one: "
                         f"{sorted(want.keys() ^ got.keys())[:6]})" if want else f"{what}: nothing recorded")
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape:
            raise ValueError(f"{what} {name}: shape {tuple(g.shape)} against {tuple(w.shape)}")
        scale = w.abs().max().clamp_min(1e-12)
        worst = max(worst, float(((g.float() - w.float()).abs().max() / scale).item()))
    return worst


def state_differences(want: str | Path, got: str | Path, steps, processes: int) -> dict[str, float]:
    """Worst relative difference of run ``got`` from run ``want`` (both ``--piper.dump_state``
    folders) over ``steps``: whole gradients and parameters by name, and each process's local
    shards by name (``processes`` of them; the same process must hold the same shard)."""
    out = {"grads": 0.0, "params": 0.0, "local grads": 0.0, "local params": 0.0}
    for step in steps:
        a, b = read_state(want, step), read_state(got, step)
        for kind in ("grads", "params"):
            out[kind] = max(out[kind], _worst(a[kind], b[kind], f"step {step} {kind}"))
        for process in range(processes):
            a, b = read_local(want, step, process), read_local(got, step, process)
            for kind in ("grads", "params"):
                out[f"local {kind}"] = max(out[f"local {kind}"],
                                           _worst(a[kind], b[kind], f"step {step} process {process} local {kind}"))
    return out
