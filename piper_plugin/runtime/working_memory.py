"""Working memory of a backward: the gradients and temporaries its kernels allocate.

A backward allocates, besides what it returns, the gradients flowing between its autograd
nodes and each kernel's temporaries (a log-softmax backward holds the incoming gradient and its
own output at once: two logits-sized buffers). A GPU allocator sees them; activation
accounting does not. :class:`WorkingMemory` counts them op by op: every storage an op returns
that none of its arguments had is live until its storage is freed. After each op the level
(live bytes, plus ``baseline``'s still-alive storages) is reported, so a caller can keep the
high-water mark. Invariant: a storage is counted once, from the op that made it until it is
gone or :meth:`forget` hands it to someone else's accounting (a parameter's new ``.grad``).
"""
from __future__ import annotations

from typing import Callable

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

    def __init__(self, on_op: Callable[[int], None] | None = None):
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.start = self.high = 0
        self.on_op = on_op

    def __enter__(self):
        self._expire()
        self.start = self.high = self.live
        return super().__enter__()

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (once) until it is freed."""
        key = storage._cdata
        if key not in self._storages:
            nbytes = storage.nbytes()
            self._storages[key] = (StorageWeakRef(storage), nbytes)
            self.live += nbytes

    def _expire(self) -> None:
        gone = [key for key, (ref, _) in self._storages.items() if ref.expired()]
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
        if self.on_op is not None:
            self.on_op(self.live)
        return out

    def settle(self) -> int:
        """The live bytes now, after dropping what was freed since the last op."""
        self._expire()
        return self.live

    @property
    def rise(self) -> int:
        """The high-water mark above the level at the start."""
        return self.high - self.start
