"""Measured memory of one rank: what it keeps across steps and the peak of what comes and goes.

Kept: parameters (full, or the ZeRO shard), gradients and optimizer state, counted from the
tensors themselves. Transient: activations autograd saves for backward (counted through
saved-tensor hooks, released when autograd drops them), values waiting in inboxes and
gathered ZeRO-3 buckets. On a GPU the allocator's own peak is used instead.
"""
from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["MemoryMeter"]


class _Held:
    """A saved activation; it returns its bytes to the meter when autograd lets it go."""

    __slots__ = ("tensor", "meter", "ptr", "nbytes")

    def __init__(self, tensor: torch.Tensor, meter: "MemoryMeter", ptr: int, nbytes: int):
        self.tensor, self.meter, self.ptr, self.nbytes = tensor, meter, ptr, nbytes

    def __del__(self) -> None:  # CPython: runs as soon as autograd drops the saved value
        self.meter._drop(self.ptr, self.nbytes)


class MemoryMeter:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._lock = threading.RLock()  # a saved value can be released by the GC inside a locked section
        self._params: set[int] = set()
        self._refs: dict[int, int] = {}
        self.track_saved = True  # False: saved activations go uncounted (a host reports memory itself)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def ignore(self, tensors) -> None:
        """Parameters are kept memory, not activations, even when autograd saves them."""
        self._params = {id(t) for t in tensors}

    def _drop(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            count = self._refs[ptr] - 1
            if count:
                self._refs[ptr] = count
            else:
                del self._refs[ptr]
                self.current -= nbytes

    def count_storage(self, t: torch.Tensor) -> tuple[int, int]:
        """Count ``t``'s storage (once however many holders); the last ``_drop`` uncounts it."""
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            count = self._refs.get(ptr, 0)
            self._refs[ptr] = count + 1
            if count == 0:
                self.current += nbytes
                if self.current > self.peak:
                    self.peak = self.current
        return ptr, nbytes

    def saved_tensor_hooks(self):
        if not self.track_saved:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t  # linear saves weight.t(), a view
        if id(t) in self._params or id(base) in self._params or t.is_meta:
            return t
        ptr, nbytes = self.count_storage(t)
        # Hold a detached alias: a saved *output* holding its own grad_fn would make a cycle through
        # autograd's C++ graph that no collector sees (it leaked whenever a graph was retained).
        return _Held(t.detach(), self, ptr, nbytes)


def _unpack(obj):
    return obj.tensor if isinstance(obj, _Held) else obj


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
