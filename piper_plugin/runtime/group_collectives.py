"""Gathers and reduce-scatters over one replica group, asynchronous, in the layouts of
:class:`piper_plugin.runtime.buckets.FlatBucket`: what ZeRO's buckets move, whether inside a
chunk (:mod:`.block_gathers`) or as the plan's own nodes (:mod:`.dist_comm`).

Invariant: every member issues the same operations in the same order on one communicator, so
the pairwise messages (FIFO per peer and tag) pair up.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_plugin.runtime.buckets import FlatBucket, add_in_member_order, then_last

__all__ = ["GroupCollectives", "all_gather_into", "reduce_scatter_into"]

# flat-tensor collectives under their current names (the older ones warn from torch 2.14 on)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GATHER, _REDUCE = 1, 2  # message tags of the pairwise exchanges


class GroupCollectives:
    """Asynchronous gathers and reduce-scatters over one group, each issued as a list of
    ``(work, then)``: ``then`` (or None) runs once that work and those before it ended.

    On gloo both run as pairwise exchanges: each member sends every other member the rows it
    owes it and receives its own from each, the bytes of a ring's; measured at about half the
    time of gloo's all-gather or all-reduce on the same rows (HOST_FRAMEWORKS.md). Where every
    parameter's rows split evenly over the group the messages go per parameter straight from
    the gradients and into the parameters (:meth:`FlatBucket.gather_pairwise`,
    :meth:`FlatBucket.reduce_pairwise`); otherwise one message per peer moves a rank-major
    block. Every member posts its messages in the same order (FIFO per peer and tag). A
    reduce-scatter sums the members' rows in member order."""

    def __init__(self, group: Any, index: int, n: int):
        self.group, self.index, self.n = group, index, n
        self.pairwise = dist.get_backend(group) == "gloo"
        self.peers = [j for j in range(n) if j != index]

    def exchange(self, triples: list[tuple[int, torch.Tensor, torch.Tensor]], tag: int) -> list:
        """Per ``(peer, into, send)``: receive ``into`` from that member, send it ``send``."""
        issued = [(dist.irecv(into, group=self.group, group_src=j, tag=tag), None) for j, into, _ in triples]
        return issued + [(dist.isend(send, group=self.group, group_dst=j, tag=tag), None) for j, _, send in triples]

    def gather(self, out: torch.Tensor, shard: torch.Tensor) -> list:
        """``out`` (rank-major) = every member's ``shard``."""
        if not self.pairwise:
            return [(all_gather_into(out, shard, group=self.group, async_op=True), None)]
        blocks = out.view(self.n, -1)
        blocks[self.index].copy_(shard)
        return self.exchange([(j, blocks[j], shard) for j in self.peers], _GATHER)

    def reduce_scatter(self, out: torch.Tensor, src: torch.Tensor) -> list:
        """``out`` = the sum over members of their ``src`` (rank-major) block ``index``."""
        if not self.pairwise:
            return [(reduce_scatter_into(out, src, group=self.group, async_op=True), None)]
        blocks = src.view(self.n, -1)
        parts = [blocks[j] if j == self.index else src.new_empty(blocks.shape[1]) for j in range(self.n)]
        issued = self.exchange([(j, parts[j], blocks[j]) for j in self.peers], _REDUCE)
        return then_last(issued, lambda: add_in_member_order(out, parts))

    def gather_bucket(self, bucket: FlatBucket) -> tuple[list, torch.Tensor]:
        """Per parameter, straight into ``bucket``'s parameters (``in_place`` buckets)."""
        if self.pairwise:
            return bucket.gather_pairwise(lambda triples: self.exchange(triples, _GATHER))
        return bucket.gather_in_place(lambda out, shard: self.gather(out, shard)[0])

    def reduce_bucket(self, bucket: FlatBucket) -> tuple[list, torch.Tensor, Any]:
        """Per parameter, straight from ``bucket``'s gradients (``in_place`` buckets)."""
        if self.pairwise:
            return bucket.reduce_pairwise(lambda triples: self.exchange(triples, _REDUCE))
        return bucket.reduce_in_place(lambda out, src: self.reduce_scatter(out, src)[0],
                                      lambda t: (dist.all_reduce(t, group=self.group, async_op=True), None))

    def finish(self, issued: list, timeout: timedelta | None) -> None:
        """Wait for ``issued`` in order (each within ``timeout``; None: no limit, as on a GPU,
        where NCCL's watchdog bounds the wait) and run each one's ``then``."""
        for work, then in issued:
            work.wait() if timeout is None else work.wait(timeout)
            if then is not None:
                then()
