"""Parameter buckets: the unit of gradient reduction and ZeRO sharding on one rank.

Parameters are sharded one by one along dim 0, as FSDP2 does: with ``n`` members each
parameter of ``d`` rows is cut into ``n`` chunks of ``ceil(d / n)`` rows (the last ones may be
short or empty), and member ``i`` owns chunk ``i`` of every parameter. Collectives move one
buffer per bucket in *rank-major* layout (member ``i``'s block holds its chunk of each
parameter, padded, in bucket order), so a reduce-scatter hands each member exactly its chunks
and an all-gather's result is every member's block in order. The parameters themselves view a
*parameter-major* flat buffer (``flat``: each parameter whole and contiguous) that compute reads.

``zero`` decides what stays resident:

* 0: full params, full grads, the optimizer over the params themselves;
* 1, 2: full params; the optimizer over one :attr:`shards` entry per parameter: this member's
  rows of it, a view into ``flat`` (the update lands in the params, no second copy);
* 3: only the shards, which view a buffer of their own; ``materialize`` refills ``flat`` (same
  storage, so autograd's saved references stay valid), ``release`` frees it.

Mixed precision (ZeRO >= 1, as FSDP's policy): with ``compute_dtype`` the parameters compute in
that dtype (``flat`` holds them so, and all-gathers move them so) while the shards keep the
parameters' own dtype in a buffer of their own (the master weights the optimizer steps);
gradients are reduced in ``reduce_dtype`` (default: the shards' dtype).

Gradient payloads carry one flag per parameter after the gradients (1 where this rank's
parameter had a gradient): reduced with them, they say which parameters got a gradient
anywhere, so a frozen or unused parameter keeps ``grad = None`` and optimizers skip it exactly
as they do on one device.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn as nn

from piper_plugin.ir.graph import rows_split_evenly

__all__ = ["FlatBucket", "add_in_member_order", "then_last"]


def add_in_member_order(out: torch.Tensor, parts) -> None:
    """``out`` = the members' contributions summed in member order (the same order on every member)."""
    for j, part in enumerate(parts):
        out.copy_(part) if j == 0 else out.add_(part)


def then_last(works: list, then) -> list:
    """``works`` (``(work, then)`` pairs) with ``then`` run once the last has ended; at once
    when there is none (a group of one)."""
    if works:
        works[-1] = (works[-1][0], then)
    else:
        then()
    return works


class FlatBucket:
    def __init__(self, params: list[nn.Parameter], zero: int, group_size: int, index_in_group: int,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        self.params = params
        self.zero = zero
        self.n = group_size
        self.index = index_in_group
        self.numel = sum(p.numel() for p in params)
        self.rows = [p.shape[0] if p.dim() else 1 for p in params]
        self.row_numel = [p.numel() // r if r else 0 for p, r in zip(params, self.rows)]
        self.chunk_rows = [-(-r // self.n) for r in self.rows]
        self.segments = [c * s for c, s in zip(self.chunk_rows, self.row_numel)]  # per-parameter block size
        self.shard_numel = sum(self.segments)
        self.padded = max(self.shard_numel * self.n, self.numel)
        self.flags = len(params)
        # every parameter's rows split evenly over the members: its rank-major layout is its own,
        # so collectives can run per parameter straight on ``flat`` and ``.grad`` with no layout
        # copy (:meth:`gather_in_place`, :meth:`reduce_in_place`)
        self.in_place = rows_split_evenly([p.shape for p in params], self.n)
        self._offsets = list(accumulate((p.numel() for p in params[:-1]), initial=0))  # parameter-major
        self._starts = list(accumulate(self.segments[:-1], initial=0))  # within a member's block
        dtype = params[0].dtype
        mixed = zero >= 1 and compute_dtype is not None and compute_dtype != dtype
        self.reduce_dtype = reduce_dtype if zero >= 1 and reduce_dtype is not None else dtype
        self.flat = torch.zeros(self.padded, dtype=dtype, device=params[0].device)
        with torch.no_grad():
            for p, offset in zip(params, self._offsets):
                self.flat[offset:offset + p.numel()].copy_(p.detach().flatten())
        self.refs = 0
        self.shards: list[nn.Parameter] = []
        self.shard_flat: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        self.seen = torch.zeros(self.flags, dtype=torch.bool)
        if zero == 3 or mixed:  # the shards in a buffer of their own, in the parameters' dtype
            self.shard_flat = self.to_rank_major(self.flat).view(self.n, self.shard_numel)[self.index].clone()
        if mixed:
            self.flat = self.flat.to(compute_dtype)
        with torch.no_grad():
            for p, offset in zip(params, self._offsets):
                p.data = self.flat[offset:offset + p.numel()].view(p.shape)
        if zero >= 1:
            self.shards = [nn.Parameter(self._own_rows(i), requires_grad=p.requires_grad)
                           for i, p in enumerate(params)]
        if zero == 3:
            self.release()

    # -- layout -----------------------------------------------------------------------------
    def _valid_rows(self, i: int, member: int) -> int:
        return max(0, min(self.chunk_rows[i], self.rows[i] - member * self.chunk_rows[i]))

    def _own_rows(self, i: int) -> torch.Tensor:
        """This member's rows of parameter ``i``: a view of ``flat`` (ZeRO-1/2) or of its shard
        buffer (ZeRO-3), shaped like the parameter but for dim 0."""
        p, rows = self.params[i], self._valid_rows(i, self.index)
        shape = (rows, *p.shape[1:]) if p.dim() else (rows,)
        if self.shard_flat is not None:
            start = self._starts[i]
            return self.shard_flat[start:start + rows * self.row_numel[i]].view(shape)
        start = self._offsets[i] + self.index * self.chunk_rows[i] * self.row_numel[i]
        return self.flat[start:start + rows * self.row_numel[i]].view(shape)

    def _layout(self):
        """Per parameter: (parameter-major offset, elements per row, block start, chunk size in
        elements, members holding a full chunk, rows of the one partial chunk)."""
        for i, offset in enumerate(self._offsets):
            full = self.rows[i] // self.chunk_rows[i] if self.chunk_rows[i] else 0
            yield (offset, self.row_numel[i], self._starts[i], self.segments[i], full,
                   self.rows[i] - full * self.chunk_rows[i])

    def _scatter(self, src: torch.Tensor | None, offset_in_src: int, blocks: torch.Tensor, row: int, start: int,
                 seg: int, full: int, rest: int) -> None:
        """Copy one parameter (from ``src`` at ``offset_in_src``, or zeros when ``src`` is None)
        into the rank-major ``blocks`` [n, >= shard_numel], padding short and empty chunks with
        zeros. Two copies, no temporaries."""
        if src is None:
            blocks[:, start:start + seg].zero_()
            return
        if full:
            blocks[:full, start:start + seg].copy_(src[offset_in_src:offset_in_src + full * seg].view(full, seg))
        if full < self.n:
            blocks[full:, start:start + seg].zero_()
            if rest:
                lo = offset_in_src + full * seg
                blocks[full, start:start + rest * row].copy_(src[lo:lo + rest * row])

    def to_rank_major(self, flat: torch.Tensor) -> torch.Tensor:
        """A parameter-major flat tensor (``numel`` first elements used) in rank-major layout."""
        out = flat.new_empty(self.n * self.shard_numel)
        blocks = out.view(self.n, self.shard_numel)
        for offset, *layout in self._layout():
            self._scatter(flat, offset, blocks, *layout)
        return out

    def from_rank_major(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Write a rank-major tensor into the parameter-major ``out`` (two copies per parameter)."""
        blocks = gathered.view(self.n, self.shard_numel)
        for offset, row, start, seg, full, rest in self._layout():
            if full:
                out[offset:offset + full * seg].view(full, seg).copy_(blocks[:full, start:start + seg])
            if rest:
                lo = offset + full * seg
                out[lo:lo + rest * row].copy_(blocks[full, start:start + rest * row])

    # -- parameters -----------------------------------------------------------------------
    @property
    def materialized(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def allocate(self) -> torch.Tensor:
        """Give the flat buffer its storage back (same storage object) and return it."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.flat.element_size())
        return self.flat

    def materialize(self, gathered: torch.Tensor) -> None:
        """Fill ``flat`` from an all-gather's (rank-major) result."""
        with torch.no_grad():
            self.from_rank_major(gathered, self.allocate())

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def shard_data(self) -> torch.Tensor:
        """This member's block of the parameters (what it contributes to an all-gather), in the
        compute dtype."""
        if self.shard_flat is not None:
            return self.shard_flat if self.shard_flat.dtype == self.flat.dtype else self.shard_flat.to(self.flat.dtype)
        out = self.flat.new_zeros(self.shard_numel)
        for shard, start in zip(self.shards, self._starts):
            out[start:start + shard.numel()] = shard.detach().reshape(-1)
        return out

    # -- collectives per parameter, in place ------------------------------------------------

    def gather_in_place(self, all_gather) -> tuple[list, torch.Tensor]:
        """Give ``flat`` its storage back and issue ``all_gather(out, shard)`` per parameter from
        this member's rows into it. Returns the works and the source (alive until they end)."""
        flat, shard = self.allocate(), self.shard_data()
        return [all_gather(flat[o:o + s * self.n], shard[st:st + s])
                for o, st, s in zip(self._offsets, self._starts, self.segments)], shard

    def reduce_in_place(self, reduce_scatter, all_reduce) -> tuple[list, torch.Tensor, list]:
        """Issue ``reduce_scatter(out, grad)`` per parameter from its ``.grad`` (taken) into this
        member's block of the result, and ``all_reduce`` of the per-parameter flags after it:
        :meth:`add_shard_grad`'s input once the works end. Returns the works, the result and the
        sources (alive until the works end)."""
        dtype, device = self.reduce_dtype, self.flat.device
        out = torch.empty(self.shard_numel + self.flags, dtype=dtype, device=device)
        works, sources = [], []
        for p, st, s in zip(self.params, self._starts, self.segments):
            g = p.grad
            src = (g.reshape(-1).to(dtype).contiguous() if g is not None
                   else torch.zeros(p.numel(), dtype=dtype, device=device))
            sources.append(src)
            works.append(reduce_scatter(out[st:st + s], src))
        flags = out[self.shard_numel:]
        flags.copy_(torch.tensor([p.grad is not None for p in self.params], dtype=dtype))
        works.append(all_reduce(flags))
        for p in self.params:
            p.grad = None
        return works, out, sources

    # -- collectives per parameter and peer, in place (pairwise exchanges) ---------------------

    def gather_pairwise(self, exchange) -> tuple[list, torch.Tensor]:
        """Give ``flat`` its storage back holding this member's rows of every parameter, and
        issue ``exchange(triples)``, ``(peer, into, send)`` per parameter and peer: the peer's
        rows received straight into place, ours sent. Needs :attr:`in_place`. Returns the works
        and the source (alive until they end)."""
        flat, shard = self.allocate(), self.shard_data()
        triples = []
        for offset, start, seg in zip(self._offsets, self._starts, self.segments):
            rows, mine = flat[offset:offset + seg * self.n].view(self.n, seg), shard[start:start + seg]
            rows[self.index].copy_(mine)
            triples += [(j, rows[j], mine) for j in range(self.n) if j != self.index]
        return exchange(triples), shard

    def reduce_pairwise(self, exchange) -> tuple[list, torch.Tensor, list]:
        """Issue ``exchange(triples)`` from the gradients (``.grad``, taken) and flags: each peer
        is sent its rows of every parameter and our flags, and its contributions to our rows are
        received, one slot per peer (our own rows are read where they lie). Needs
        :attr:`in_place`. The last work's ``then`` sums the members' contributions in member
        order into the result (:meth:`add_shard_grad`'s input). Returns the works, the result
        and the sources (alive until the works end)."""
        dtype, device = self.reduce_dtype, self.flat.device
        width = self.shard_numel + self.flags
        received = torch.empty(self.n - 1, width, dtype=dtype, device=device)  # per peer, in member order
        slot = {j: k for k, j in enumerate(j for j in range(self.n) if j != self.index)}
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=dtype).to(device)
        grads, triples, sums = [], [], []
        for p, start, seg in zip(self.params, self._starts, self.segments):
            g = (p.grad.reshape(-1).to(dtype).contiguous() if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=device))
            rows = g.view(self.n, seg)
            grads.append(rows)
            triples += [(j, received[k, start:start + seg], rows[j]) for j, k in slot.items()]
            sums.append((slice(start, start + seg), rows[self.index]))
        triples += [(j, received[k, self.shard_numel:], flags) for j, k in slot.items()]
        sums.append((slice(self.shard_numel, width), flags))
        for p in self.params:
            p.grad = None
        out = torch.empty(width, dtype=dtype, device=device)

        def add() -> None:
            for where, own in sums:
                add_in_member_order(out[where], [own if j == self.index else received[slot[j], where]
                                                 for j in range(self.n)])

        return then_last(exchange(triples), add), out, [grads, received, flags]

    # -- gradients --------------------------------------------------------------------------
    def flat_grad(self, take: bool = True) -> torch.Tensor:
        """This rank's accumulated gradient with its flags: parameter-major (``numel`` + flags)
        for ZeRO 0, rank-major with each block's flags after it for ZeRO >= 1 (``take`` clears
        p.grad). Each gradient is copied once, straight into place."""
        dtype, device = self.reduce_dtype, self.flat.device
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=dtype).to(device)
        if self.zero == 0:
            out = torch.empty(self.numel + self.flags, dtype=dtype, device=device)
            for p, offset in zip(self.params, self._offsets):
                target = out[offset:offset + p.numel()]
                target.copy_(p.grad.reshape(-1)) if p.grad is not None else target.zero_()
            out[self.numel:] = flags
        else:
            width = self.shard_numel + self.flags
            out = torch.empty(self.n * width, dtype=dtype, device=device)
            blocks = out.view(self.n, width)
            for p, (_, *layout) in zip(self.params, self._layout()):
                self._scatter(p.grad.reshape(-1) if p.grad is not None else None, 0, blocks, *layout)
            blocks[:, self.shard_numel:] = flags
        if take:
            for p in self.params:
                p.grad = None
        return out

    def set_grad(self, reduced: torch.Tensor) -> None:
        """Write a full reduced gradient (:meth:`flat_grad`'s ZeRO-0 layout) into ``.grad`` of
        every parameter some rank had a gradient for."""
        flags = reduced[self.numel:]
        for i, (p, offset) in enumerate(zip(self.params, self._offsets)):
            p.grad = reduced[offset:offset + p.numel()].view_as(p).clone() if flags[i] > 0 else None

    @property
    def grad_numel(self) -> int:
        """Elements of :meth:`flat_grad`'s payload."""
        return self.numel + self.flags if self.zero == 0 else self.n * (self.shard_numel + self.flags)

    def add_shard_grad(self, reduced: torch.Tensor) -> None:
        """Add a reduce-scatter's result (this member's block and flags) to the shards' grads."""
        grads, flags = reduced[:self.shard_numel], reduced[self.shard_numel:]
        master = self.shards[0].dtype if self.shards else grads.dtype
        # a fresh result (converted here, or one owning its whole storage) is kept as it is, not copied
        fresh = grads.dtype != master or reduced.untyped_storage().nbytes() == reduced.nbytes
        if grads.dtype != master:
            grads = grads.to(master)
        if self.shard_grad is None:
            self.shard_grad = grads if fresh else grads.clone()
            self.seen = flags.cpu() > 0
        else:
            self.shard_grad.add_(grads)
            self.seen |= flags.cpu() > 0
        self._point_shard_grads()

    def _point_shard_grads(self) -> None:
        for shard, start, seen in zip(self.shards, self._starts, self.seen.tolist()):
            shard.grad = (self.shard_grad[start:start + shard.numel()].view_as(shard)
                          if seen and shard.requires_grad else None)

    def sum_over_replicas(self, all_reduce) -> None:
        """Sum this step's reduced gradient with the other replicas' of the plan (``all_reduce``
        in place over one plan rank's copies: data parallelism around Piper's own), flags
        included, so a parameter with a gradient in any replica has one in all. The same
        call on every replica: whether a bucket has a gradient follows the plan alone."""
        if self.zero == 0:
            reduced = self.flat_grad(take=True)
            all_reduce(reduced)
            self.set_grad(reduced)
            return
        if self.shard_grad is None:  # no reduce-scatter ran (the plan's, so on every replica alike)
            return
        both = torch.cat([self.shard_grad, self.seen.to(self.shard_grad)])
        all_reduce(both)
        self.shard_grad.copy_(both[:self.shard_numel])
        self.seen = both[self.shard_numel:].cpu() > 0
        self._point_shard_grads()

    def step_done(self) -> None:
        """The optimizer stepped: the next step's gradients start from nothing."""
        self.shard_grad = None
        self.seen = torch.zeros(self.flags, dtype=torch.bool)
        for shard in self.shards:
            shard.grad = None
