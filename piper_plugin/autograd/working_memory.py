"""Working memory of a backward: the gradients and temporaries its kernels allocate.

A backward allocates, besides what it returns, the gradients flowing between its autograd
nodes and each kernel's temporaries (a log-softmax backward holds the incoming gradient and its
own output at once: two logits-sized buffers). A GPU allocator sees them; activation
accounting does not. :class:`WorkingMemory` counts them op by op: every storage an op returns
that none of its arguments had is live until its storage is freed. After each op the level
(live bytes, plus ``baseline``'s still-alive storages) is reported, so a caller can keep the
high-water mark. Invariant: a storage is counted once, from the op that made it until it is
gone or :meth:`forget` hands it to someone else's accounting (a parameter's new ``.grad``).

With ``record``, it also keeps every op's live set, so the level can be split afterwards into
what scales with the batch and what does not (:meth:`mark_fixed`: a parameter's gradient is
parameter-sized whatever the batch): :meth:`rise_by_batch`.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WorkingMemory"]


class WorkingMemory(TorchDispatchMode):
    """While active: ``live`` bytes of the storages it tracks, ``high`` the most at once.

    Before it is entered, :meth:`track` may add storages alive already whose freeing lowers the
    level (a probe's saved activations); ``on_op(live)`` runs after every op.
    """

    def __init__(self, on_op: Callable[[int], None] | None = None, record: bool = False):
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int, int]] = {}  # key -> (ref, bytes, serial)
        self._serial = itertools.count()
        self.live = self.start = self.high = 0
        self.on_op = on_op
        self.record = record
        self._sizes: dict[int, int] = {}  # serial -> bytes (with ``record``)
        self._fixed: set[int] = set()  # serials of storages that do not scale with the batch
        self._snapshots: list[frozenset[int]] = []

    def __enter__(self):
        """Levels count from here: the start is the live bytes now, earlier records are dropped."""
        self._expire()
        self.start = self.high = self.live
        self._snapshots.clear()
        return super().__enter__()

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (once) until it is freed."""
        key = storage._cdata
        if key not in self._storages:
            nbytes, serial = storage.nbytes(), next(self._serial)
            self._storages[key] = (StorageWeakRef(storage), nbytes, serial)
            self.live += nbytes
            if self.record:
                self._sizes[serial] = nbytes

    def mark_fixed(self, t: torch.Tensor) -> None:
        """``t``'s storage (if tracked) has the same size whatever the batch."""
        entry = self._storages.get(t.untyped_storage()._cdata)
        if entry is not None:
            self._fixed.add(entry[2])

    def _snapshot(self) -> frozenset[int]:
        return frozenset(entry[2] for entry in self._storages.values())

    def _expire(self) -> None:
        gone = [key for key, (ref, _, _) in self._storages.items() if ref.expired()]
        for key in gone:
            self.live -= self._storages.pop(key)[1]

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s storage is counted elsewhere from now on (kept state, a delivered value)."""
        entry = self._storages.pop(t.untyped_storage()._cdata, None)
        if entry is not None:
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._expire()  # what autograd let go since the last op is gone before this one allocates
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.track(t.untyped_storage())
        if self.live > self.high:
            self.high = self.live
        if self.record:
            self._snapshots.append(self._snapshot())
        if self.on_op is not None:
            self.on_op(self.live)
        return out

    def settle(self) -> int:
        """The live bytes now, after dropping what was freed since the last op."""
        self._expire()
        return self.live

    def live_by_batch(self) -> tuple[int, int]:
        """The live bytes now above the start: (the part that scales with the batch, the rest)."""
        self._expire()
        return self._split(self._snapshot())

    def _split(self, live: frozenset[int]) -> tuple[int, int]:
        fixed = sum(self._sizes[i] for i in live & self._fixed)
        return sum(self._sizes[i] for i in live) - fixed - self.start, fixed

    def rise_by_batch(self, scales: Iterable[float]) -> tuple[tuple[int, int], ...]:
        """The ops' levels above the start as (batch part, fixed part), reduced to those that are
        the high-water mark ``batch part x scale + fixed part`` for one of ``scales`` (a run
        at a smaller batch scales the first part alone)."""
        levels = {self._split(live) for live in self._snapshots} | {(0, 0)}
        return tuple(sorted({max(levels, key=lambda lv: lv[0] * s + lv[1]) for s in scales}))

    @property
    def rise(self) -> int:
        """The high-water mark above the level at the start."""
        return self.high - self.start
