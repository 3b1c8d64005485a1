"""What a rank keeps resident between steps, measured from its live tensors (either engine).

``--piper.memory_split`` logs, after every step and per rank, the bytes of the parameters,
gradients and optimizer state it holds (each storage counted once, at its allocated size, so a
ZeRO-1/2 bucket's full parameters count whole and a ZeRO-3 shard counts as the shard), its
resident set at start-up (before the model exists) and, on CPU, the step's peak RSS (TorchTitan's
``memory:`` figure). The rest is what the step held only while it ran:
``transient = peak - start-up - parameters - gradients - optimizer state``. The tensors at the
peak are the peak less what the process held besides tensors as the step began; the Piper
engine logs the simulator's figure for the same (``Piper simulated memory``).
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["resident_bytes", "current_rss_bytes", "split_line", "simulated_memory_line"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def resident_bytes(model_parts: list[torch.nn.Module], optimizers) -> dict[str, int]:
    """(parameters, gradients, optimizer state) bytes this rank holds, each storage once."""
    seen: set[int] = set()
    params = [p for m in model_parts for p in m.parameters()]
    out = {"params": _storage_bytes(params, seen), "grads": _storage_bytes((p.grad for p in params), seen)}
    states = []
    for opt in getattr(optimizers, "optimizers", None) or [optimizers]:
        for state in getattr(opt, "state", {}).values():
            states += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = _storage_bytes(states, seen)
    return out


def current_rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``; 0 where unknown)."""
    from piper_plugin.adapters.torchtitan.cpu import status_bytes

    return status_bytes("VmRSS") or 0


def split_line(rank: int, step: int, resident: dict[str, int], startup: int, peak: int, others: int = 0) -> str:
    """One rank's split of its step ``peak`` (0: unknown), in GiB; with ``others`` (the RSS
    besides tensors as the step began) also the tensors at the peak, ``peak - others``: what the
    simulator predicts (:func:`simulated_memory_line`), if what is not a tensor stays put."""
    g = 2**30
    line = (f"Piper memory split: rank {rank} step {step} params {resident['params'] / g:.4f}GiB "
            f"grads {resident['grads'] / g:.4f}GiB optimizer {resident['optimizer'] / g:.4f}GiB "
            f"start-up {startup / g:.4f}GiB")
    if peak:
        line += f" peak {peak / g:.4f}GiB transient {(peak - startup - sum(resident.values())) / g:.4f}GiB"
        if others:
            line += f" tensors at peak {(peak - others) / g:.4f}GiB"
    return line


def simulated_memory_line(rank: int, plan_rank: int, result) -> str:
    """The simulator's memory for process ``rank``, plan rank ``plan_rank`` of ``result`` (a
    :class:`piper_plugin.SimResult`), in GiB: what :func:`split_line`'s tensors at peak measure."""
    g, static = 2**30, result.static_bytes[plan_rank]
    return (f"Piper simulated memory: rank {rank} plan rank {plan_rank} params {static['params'] / g:.4f}GiB "
            f"grads {static['grads'] / g:.4f}GiB optimizer {static['optimizer'] / g:.4f}GiB "
            f"transient {result.peak_transient_bytes[plan_rank] / g:.4f}GiB "
            f"peak {result.per_rank_peak[plan_rank] / g:.4f}GiB")
