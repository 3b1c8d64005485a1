"""ZeRO by block: one region's blocks reduced (ZeRO-2 and 3) and gathered and freed (ZeRO-3) one
at a time inside its chunk.

A region's blocks (:attr:`Region.blocks`: sequential submodules, each using only its own
parameters, as FSDP's units) hold one bucket each (:func:`piper_plugin.passes.replicate`).
Module hooks drive them, all on one communicator of the region's replica group (at ZeRO-2 the
parameters stay whole: the gathers and frees below do not happen, the reductions do):

* forward (F): as block ``k`` starts, its gather is waited for (or issued) and laid out in the
  bucket, and block ``k+1``'s gather is issued (prefetch); as it ends, ``k`` is freed and a hook
  on its outputs' gradient marks where its backward begins;
* backward (B): where block ``k``'s backward begins, every block after it has finished its
  backward (blocks run in sequence, and autograd accumulates a parameter's gradient before the
  node that consumes the block's input runs), so their gradients are reduce-scattered
  (asynchronously) and their parameters freed; ``k`` is gathered and ``k-1`` prefetched. The
  task's end reduces what is left and waits for every reduction before B counts as done;
* an input-gradient pass (BI) gathers as B does but frees and reduces nothing: its weight pass
  (BW) may still read the blocks, so they stay gathered (whatever runs in between) until every
  pending weight pass has run; a BW reduces every block as it ends.

Invariants: every member of the group issues the same collectives in the same order (the
choice of what to gather or reduce depends on the block order and the task alone, never on
local values); a block's parameters are materialized while any code of the task may read them;
each microbatch's gradient of a block is reduced exactly once (its ``.grad`` is taken into the
payload), and the meter counts it from its first accumulation until its reduce-scatter ends. A
freed block keeps its storage object (resized to 0 and back), so what a compiled block's forward
saved of its parameters for the backward reads the gathered values again.
Forwards run again inside a backward (activation checkpointing) and forwards outside a task (an
evaluation, which gathers every bucket first) neither gather nor free.
"""
from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from piper_plugin.runtime.buckets import FlatBucket
from piper_plugin.runtime.group_collectives import GroupCollectives
from piper_plugin.runtime.memory import GradientCount

__all__ = ["BlockGathers"]


class BlockGathers:
    """The blocks of one region on this rank: ``modules[k]`` runs with ``buckets[k]``'s
    parameters. ``meter`` counts materialized buckets and reductions in flight; ``lock`` is the
    rank's bucket lock (an evaluation's gathers and these never interleave, but releases share it)."""

    def __init__(self, region: str, modules: list[nn.Module], buckets: list[FlatBucket], group: Any,
                 meter: Any, lock: threading.Lock, timeout_s: float, cuda: bool):
        self.region, self.modules, self.buckets, self.group = region, modules, buckets, group
        self.meter, self.lock, self.cuda = meter, lock, cuda
        self.timeout = timedelta(seconds=timeout_s)
        self.ops = GroupCollectives(group, buckets[0].index, buckets[0].n)
        self.reduces = [any(p.requires_grad for p in b.params) for b in buckets]
        self.gathers = buckets[0].zero == 3  # ZeRO-2: the parameters stay whole, only reductions
        self.mode: str | None = None  # the kind of this region's task now running (F, B, BI, BW)
        self._in_flight: dict[int, tuple[Any, torch.Tensor]] = {}  # gathers issued, not laid out yet
        self._held: set[int] = set()  # buckets this region's tasks materialized and still hold
        self._reductions: list[tuple[int, Any, torch.Tensor, torch.Tensor, int]] = []  # in flight, bytes counted
        self._reduced: set[int] = set()  # blocks reduced by the running task
        self._pinned = 0  # input-gradient passes whose weight pass has not run: blocks stay gathered
        self._grads = GradientCount(meter)  # per block: its gradients inside this region's tasks, not yet reduced
        self._handles = [h for k, bucket in enumerate(buckets)
                         for h in self._grads.watch(k, bucket.params, lambda: self.mode is not None)]
        for k, module in enumerate(modules):
            # outside any compiled graph (TorchTitan compiles each block as a full graph): dynamo runs
            # them eagerly around the block's compiled forward, as it does FSDP's
            self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(self._before_forward(k))))
            self._handles.append(module.register_forward_hook(torch.compiler.disable(self._after_forward(k))))

    # -- the task around the hooks ---------------------------------------------------------
    @contextlib.contextmanager
    def task(self, kind: str):
        """Run one of the region's tasks (``F``, ``B``, ``BI`` or ``BW``) with the hooks live."""
        if self.mode is not None:
            raise RuntimeError(f"region {self.region}: task {kind} started while {self.mode} runs; a region's "
                               f"blocks serve one task at a time")
        self.mode = kind
        try:
            yield
            self._end(kind)
        finally:
            self.mode = None

    def _end(self, kind: str) -> None:
        for k in list(self._in_flight):  # a prefetch no block used: complete it, as every member does
            self._lay_out(k)
            self._let_go(k)
        if kind == "BI":
            self._pinned += 1
        elif kind == "BW":
            self._pinned -= 1
        if kind in ("B", "BW"):  # every block has this microbatch's gradient now: reduce the rest
            for k in reversed(range(len(self.buckets))):
                if k not in self._reduced:
                    self._reduce(k)
            self._finish_reductions()
            self._check_reduced()
        for k in sorted(self._held):
            self._let_go(k)

    # -- hooks ------------------------------------------------------------------------------
    def _before_forward(self, k: int) -> Callable:
        def hook(module, args):
            if self.mode == "F":
                self._acquire(k)
                if k + 1 < len(self.buckets):
                    self._prefetch(k + 1)
            elif self.mode is not None and not self.buckets[k].materialized:  # a recompute in backward
                self._acquire(k)
            elif self.mode is None and not self.buckets[k].materialized:
                raise RuntimeError(f"region {self.region}: block {k} ran outside a task with its parameters "
                                   f"sharded; gather the buckets first (Executor.eval does)")
        return hook

    def _after_forward(self, k: int) -> Callable:
        def hook(module, args, output):
            if self.mode != "F":
                return
            self._let_go(k)
            outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            fired = [False]

            def begins(grad):
                if not fired[0]:
                    fired[0] = True
                    self._backward_begins(k)
            for t in outs:
                t.register_hook(begins)
        return hook

    def _backward_begins(self, k: int) -> None:
        if self.mode == "B":
            for j in reversed(range(k + 1, len(self.buckets))):
                if j not in self._reduced:
                    self._reduce(j)
        elif self.mode != "BI":
            return  # a weight pass restarting below the blocks' outputs: BI gathered them already
        self._acquire(k)
        if k > 0:
            self._prefetch(k - 1)

    # -- gathers ------------------------------------------------------------------------------
    def _prefetch(self, k: int) -> None:
        if not self.gathers or k in self._in_flight or k in self._held or self.buckets[k].materialized:
            return
        bucket = self.buckets[k]
        if bucket.in_place:  # per parameter, straight into them: no layout copy
            with self.lock:
                self.meter.add(bucket.padded * bucket.flat.element_size())
                works, shard = self.ops.gather_bucket(bucket)
            self._in_flight[k] = (works, shard, None)
            return
        shard = bucket.shard_data().contiguous()
        out = shard.new_empty(shard.numel() * bucket.n)
        with self.lock:
            self.meter.add(out.nbytes)  # the rank-major copy, until it is laid out
        self._in_flight[k] = (self.ops.gather(out, shard), shard, out)

    def _acquire(self, k: int) -> None:
        if not self.gathers or k in self._held:
            return
        if self.buckets[k].materialized and k not in self._in_flight:  # an evaluation's whole copy
            return
        self._prefetch(k)
        self._lay_out(k)

    def _lay_out(self, k: int) -> None:
        works, _, out = self._in_flight.pop(k)
        for work in works:
            self._wait(work)
        if out is not None:  # rank-major: laid out into the parameters
            bucket = self.buckets[k]
            with self.lock:
                self.meter.add(bucket.padded * bucket.flat.element_size())
                bucket.materialize(out)
                self.meter.add(-out.nbytes)
        self._held.add(k)

    def _let_go(self, k: int) -> None:
        """Free block ``k`` unless a weight pass still to run reads it (an input-gradient pass
        gathered it)."""
        if not self._pinned:
            self._release(k)

    def _release(self, k: int) -> None:
        if k not in self._held:
            return
        self._held.discard(k)
        bucket = self.buckets[k]
        if self.cuda:
            bucket.flat.record_stream(torch.cuda.current_stream(bucket.flat.device))
        with self.lock:
            bucket.release()
            self.meter.add(-bucket.padded * bucket.flat.element_size())

    # -- reductions ---------------------------------------------------------------------------
    def _reduce(self, k: int) -> None:
        """Reduce-scatter block ``k``'s gradient of this microbatch (taken from ``.grad``),
        asynchronously, and free its parameters. The reduction before it, issued a block's
        backward ago, is completed first: one payload in flight at a time."""
        self._finish_reductions()
        if self.reduces[k]:
            bucket = self.buckets[k]
            if bucket.in_place:  # per parameter, from the gradients: no layout copy
                works, out, sources = self.ops.reduce_bucket(bucket)
            else:
                sources = bucket.flat_grad(take=True)
                out = sources.new_empty(sources.numel() // bucket.n)
                works = self.ops.reduce_scatter(out, sources)
            self._reductions.append((k, works, sources, out, self._grads.take(k)))
        self._reduced.add(k)
        self._let_go(k)

    def _finish_reductions(self) -> None:
        reductions, self._reductions = self._reductions, []
        for k, works, sources, out, counted in reductions:
            for work in works:
                self._wait(work)
            self.buckets[k].add_shard_grad(out)
            del sources
            self.meter.add(-counted)

    def _check_reduced(self) -> None:
        """A block whose gradient grew after its reduce-scatter broke the blocks' contract."""
        reduced, self._reduced = self._reduced, set()
        for k in reduced:
            if any(p.grad is not None for p in self.buckets[k].params):
                raise RuntimeError(f"region {self.region}: block {k} got a gradient after its reduce-scatter; "
                                   f"blocks must run in sequence and use only their own parameters")

    def _wait(self, issued) -> None:
        self.ops.finish([issued], None if self.cuda else self.timeout)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
