"""Measured memory of one rank: what it keeps across steps and the peak of what comes and goes.

Kept: parameters (full, or the ZeRO shard), gradients and optimizer state, counted from the
tensors themselves. Transient: activations autograd saves for backward (counted through
saved-tensor hooks, released when autograd drops them), a backward's working memory (what its
kernels allocate while it runs, op by op: :mod:`.working_memory`), values waiting in inboxes,
messages in flight (receive buffers from their post, sent values until the send is let go),
gradients an input-gradient pass keeps for its weight pass, gathered ZeRO-3 buckets and a
block's gradient of one microbatch until its reduce-scatter ends (ZeRO by block). On a GPU the
allocator's own peak is used instead.

Saved activations change only inside *windows*: the stretch of a compute task where it saves
them (a chunk's forward) or where autograd releases them and allocates its working memory (a
backward; the working memory is gone, or handed to someone who counts it, by the window's
end). A hook is a Python call
per saved tensor, about 7% of a transformer stage's forward on a CPU. So once two consecutive
steps with the same batch shapes changed the count by the same bytes in the same windows, and
no change fell outside a window, later steps with those shapes replay each window's change at
its end, with no hooks; steps with new shapes are measured anew. Replayed steps reach the same
values at every window's end, and the same highs inside it, as the measured ones: a window also
logs its highest level of everything counted above where it began (what other code adds while
it runs, such as a block's gradients, included), which its replay reaches again. That level is
for replays only: :meth:`MemoryMeter.windows` gives the saved bytes' change and rise alone, which
do not depend on the ZeRO level. This assumes a
chunk saves the same bytes whenever its batch shapes are the same: true of static-shape models
(the toy MoE dispatches over a fixed capacity), not of data-dependent ones such as a dropless MoE
whose two measured steps happened to agree.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable

import torch

from piper_plugin.autograd.working_memory import WorkingMemory

__all__ = ["MemoryMeter", "GradientCount"]


class _Held:
    """A saved activation; it returns its bytes to the meter when autograd lets it go."""

    __slots__ = ("tensor", "meter", "ptr", "nbytes")

    def __init__(self, tensor: torch.Tensor, meter: "MemoryMeter", ptr: int, nbytes: int):
        self.tensor, self.meter, self.ptr, self.nbytes = tensor, meter, ptr, nbytes

    def __del__(self) -> None:  # CPython: runs as soon as autograd drops the saved value
        self.meter._drop(self.ptr, self.nbytes)


class _Window:
    """One window of a task (see the module docstring): measured through hooks, or replayed.
    ``key`` is the task and the window's count within the step."""

    __slots__ = ("meter", "key", "hooks", "working", "grad_hooks", "replay", "before", "start")

    def __init__(self, meter: "MemoryMeter", key: tuple[str, int], saves: bool):
        self.meter, self.key = meter, key
        self.replay = meter._replay.get(key) if meter._replay is not None else None
        measured = self.replay is None
        self.hooks = meter.saved_tensor_hooks() if saves and measured else None
        self.working = WorkingMemory(on_op=meter._working) if not saves and measured and meter.track_working else None
        self.grad_hooks: list = []

    def __enter__(self) -> None:
        meter = self.meter
        with meter._lock:
            self.before = meter._high = meter.saved
            self.start = meter._top = meter.current
        if self.hooks is not None:
            self.hooks.__enter__()
        if self.working is not None:
            # a parameter's first gradient of the step becomes its .grad: kept state from then on
            # (ZeRO by block: a block's gradient until its reduce-scatter ends, which BlockGathers adds)
            forget = self.working.forget
            self.grad_hooks = [p.register_post_accumulate_grad_hook(lambda p: forget(p.grad))
                               for p in meter._param_tensors if p.requires_grad]
            self.working.__enter__()

    def __exit__(self, *exc) -> None:
        meter = self.meter
        if self.hooks is not None:
            self.hooks.__exit__(*exc)
        if self.working is not None:
            self.working.__exit__(*exc)
            for handle in self.grad_hooks:
                handle.remove()
        if self.replay is not None:
            meter.replay_window(*self.replay, top=self.start + meter._tops.get((meter._shapes, *self.key), 0))
            return
        with meter._lock:
            meter._log[self.key] = (meter.saved - self.before, meter._high - self.before)
            top = (meter._shapes, *self.key)
            meter._tops[top] = max(meter._tops.get(top, 0), meter._top - self.start)


class MemoryMeter:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.saved = 0  # the part of ``current`` that is saved activations
        self._high = 0  # the highest ``saved`` since the open window began
        self._top = 0  # the highest ``current`` (working memory included) since the open window began
        self._tops: dict[tuple, int] = {}  # (batch shapes, task, count) -> the window's highest ``current`` above its start
        self._lock = threading.RLock()  # a saved value can be released by the GC inside a locked section
        self._params: set[int] = set()
        self._refs: dict[int, int] = {}
        self.track_saved = True  # False: saved activations go uncounted (a host reports memory itself)
        self.track_working = True  # False: backward working memory goes uncounted (a GPU's allocator sees it)
        self._param_tensors: list[torch.Tensor] = []
        # per window: (change of ``saved``, its highest rise above the start), this step's
        self._log: dict[tuple[str, int], tuple[int, int]] = {}  # by (task, its window's count)
        self._logs: dict[tuple, dict[tuple[str, int], tuple[int, int]]] = {}  # batch shapes -> last measured step's
        self._replays: dict[tuple, dict[tuple[str, int], tuple[int, int]]] = {}  # shapes -> what two steps agreed on
        self._replay: dict[tuple[str, int], tuple[int, int]] | None = None
        self._opened: dict[str, int] = {}  # windows each task opened this step
        self.kept_for_weights: dict[str, int] = {}  # this step: BI task -> bytes it keeps for its BW
        self._shapes: tuple | None = None

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
            if self.current > self._top:
                self._top = self.current

    def replay_window(self, change: int, rise: int, top: int = 0) -> None:
        """A replayed window: saved bytes rise by ``rise``, then end ``change`` above the start;
        the whole count reached ``top`` inside it when it was measured."""
        with self._lock:
            self.peak = max(self.peak, self.current + rise, top)
            self.saved += change
            self.current += change

    def windows(self) -> dict[tuple[str, int], tuple[int, int]]:
        """This step's windows as ``(task, its count in the step) -> (change of the saved bytes,
        their highest rise above the window's start, working memory included)``: as measured, or
        for a replayed step the measured steps' that it replays (empty while nothing is tracked)."""
        with self._lock:
            return dict(self._replay if self._replay is not None else self._log)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def begin_step(self, shapes: tuple) -> None:
        """Start a step whose batch has ``shapes``: close the last one (replay its windows from
        now on if it agreed with the step before of the same shapes), reset the peak."""
        if self._replay is None and self._shapes is not None:
            log, saved = self._log, self.saved
            whole = saved == 0 and sum(c for c, _ in log.values()) == 0  # nothing left, nothing outside a window
            if whole and self._logs.get(self._shapes) == log:
                self._replays[self._shapes] = log
            self._logs[self._shapes] = log
        self._log, self._shapes, self._opened = {}, shapes, {}
        self.kept_for_weights = {}
        self._replay = self._replays.get(shapes) if self.track_saved else None
        self.reset_peak()

    def window(self, task: str, saves: bool = False):
        """Context for where ``task`` saves activations (``saves``: hooks go on) or releases them.
        A task may open several windows in a step (a backward split around its sends): each is
        logged and replayed as its own, by the task and its count within the step."""
        if not self.track_saved:
            return contextlib.nullcontext()
        with self._lock:
            index = self._opened.get(task, 0)
            self._opened[task] = index + 1
        return _Window(self, (task, index), saves)

    def ignore(self, tensors) -> None:
        """Parameters are kept memory, not activations, even when autograd saves them; so are
        their gradients."""
        self._param_tensors = list({id(t): t for t in tensors}.values())
        self._params = {id(t) for t in self._param_tensors}

    def _working(self, live: int) -> None:
        """After each op of a measured backward window: ``live`` working bytes on top of the
        saved activations left."""
        with self._lock:
            if self.saved + live > self._high:
                self._high = self.saved + live
            if self.current + live > self.peak:
                self.peak = self.current + live
            if self.current + live > self._top:
                self._top = self.current + live

    def _drop(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            count = self._refs[ptr] - 1
            if count:
                self._refs[ptr] = count
            else:
                del self._refs[ptr]
                self.current -= nbytes
                self.saved -= nbytes

    def count_storage(self, t: torch.Tensor) -> tuple[int, int]:
        """Count ``t``'s storage (once however many holders); the last ``_drop`` uncounts it."""
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            count = self._refs.get(ptr, 0)
            self._refs[ptr] = count + 1
            if count == 0:
                self.current += nbytes
                self.saved += nbytes
                self._high = max(self._high, self.saved)
                if self.current > self.peak:
                    self.peak = self.current
                if self.current > self._top:
                    self._top = self.current
        return ptr, nbytes

    def saved_tensor_hooks(self):
        """The hooks a measured forward window installs (only while ``track_saved``)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t  # linear saves weight.t(), a view
        if id(t) in self._params or id(base) in self._params or t.is_meta:
            return t
        ptr, nbytes = self.count_storage(t)
        # Hold a detached alias: a saved *output* holding its own grad_fn would make a cycle through
        # autograd's C++ graph that no collector sees (it leaked whenever a graph was retained).
        return _Held(t.detach(), self, ptr, nbytes)


class GradientCount:
    """Gradients the meter counts from their first accumulation, per key (a block, a bucket):
    each parameter's once until :meth:`take` hands the key's bytes to the caller, which takes
    them off the meter when that memory goes (the payload made, the reduce-scatter ended)."""

    def __init__(self, meter: MemoryMeter):
        self.meter = meter
        self._bytes: dict[Any, int] = {}
        self._params: dict[Any, set[int]] = {}

    def watch(self, key: Any, params: Iterable[torch.nn.Parameter],
              when: Callable[[], bool] = lambda: True) -> list:
        """Count ``params``' gradients under ``key`` while ``when()`` holds; the hooks' handles."""
        counted = self._params.setdefault(key, set())

        def hook(p):
            if when() and id(p) not in counted and p.grad is not None:
                counted.add(id(p))
                nbytes = p.grad.untyped_storage().nbytes()
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
                self.meter.add(nbytes)
        return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    def take(self, key: Any) -> int:
        """The bytes counted under ``key`` since the last take (still on the meter)."""
        self._params.get(key, set()).clear()
        return self._bytes.pop(key, 0)


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
