"""replicate: data parallelism with ZeRO levels 0-3 over a region's replica group.

Parameters a region updates are cut into buckets (``bucket_bytes``; default one bucket).
Per bucket, with group = the region's replicas (axis ``data``; ``dp`` for EP-sharded experts):

* ZeRO-0: B -> ALL_REDUCE (once per step) -> UPDATE
* ZeRO-1: B -> REDUCE_SCATTER (once per step) -> UPDATE of the shard -> ALL_GATHER
* ZeRO-2: B -> REDUCE_SCATTER (per microbatch) -> UPDATE of the shard -> ALL_GATHER
* ZeRO-3: ALL_GATHER -> F and ALL_GATHER -> B (per microbatch), B -> REDUCE_SCATTER
  (per microbatch) -> UPDATE of the shard; nothing stays gathered.

By block (``blocks``, ZeRO 2 and 3, for regions that declare :attr:`Region.blocks`): each
block's parameters are a bucket of their own that the chunk reduce-scatters as the block's
backward ends and, at ZeRO-3, gathers as the block starts (the next one prefetched) and frees as
it ends (:mod:`piper_plugin.runtime.block_gathers`); those buckets get no per-microbatch nodes
here (a ZeRO-2 block keeps its step's ALL_GATHER after UPDATE), and B -> UPDATE stays. The
region's other parameters are bucketed as above.

Invariant: each microbatch's gradient contribution to a bucket is reduced exactly once.
"""
from __future__ import annotations

from piper_plugin.ir.graph import DAG, Bucket
from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["replicate", "make_buckets"]


def make_buckets(params: tuple[str, ...], param_bytes: dict[str, int], bucket_bytes: int | None) -> list[tuple[str, ...]]:
    """Greedy, in parameter order; a parameter larger than the bucket gets a bucket of its own."""
    if not params:
        return []
    if bucket_bytes is None:
        return [params]
    buckets: list[list[str]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + param_bytes[p] > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += param_bytes[p]
    return [tuple(b) for b in buckets]


def replicate(dag: DAG, grid: RankGrid, region: str, zero: int, bucket_bytes: int | None,
              blocks: bool = True) -> None:
    r = dag.regions[region]
    sharded = region in dag.meta.sharded
    axis = "dp" if sharded else "data"
    devices = dag.nodes[f"{region}F"].devices
    group_size = len(grid.groups(axis, devices)[0])
    params = dag.meta.update_params[region]
    sizes = dag.meta.param_bytes
    divisor = grid.ep if sharded else 1
    dag.meta.replicated[region] = zero if group_size > 1 else 0  # one replica: nothing to shard, plain ZeRO-0
    by_block = []  # (block path, its parameters this region updates)
    if blocks and zero >= 2 and group_size > 1:
        own = set(params)
        by_block = [(path, tuple(p for p in names if p in own)) for path, names in r.blocks]
        by_block = [(path, names) for path, names in by_block if names]
    in_blocks = {p for _, names in by_block for p in names}
    groups = [(None, names) for names in make_buckets(tuple(p for p in params if p not in in_blocks),
                                                      sizes, bucket_bytes)] + by_block
    buckets = [Bucket(region, i, names, sum(sizes[p] for p in names) // 4 // divisor, devices, zero, block)
               for i, (block, names) in enumerate(groups)]
    dag.buckets[region] = buckets
    if group_size == 1 or not buckets:
        return
    update, backward = f"{region}UPDATE", f"{region}B"
    if not by_block:  # otherwise B -> UPDATE stays: the chunk reduces its blocks before B ends
        dag.remove_data(backward, update)

    def comm(kind: Kind, bucket: Bucket, qual: str, phase: str, nbytes: int) -> str:
        node = Node(kind, region, r.stage, qual=qual, devices=devices, stream="dp", tags=r.tags,
                    bytes=nbytes, bucket=bucket.index, phase=phase, axis=axis)
        return dag.add(node).key

    for b in buckets:
        full = b.numel * 4
        shard = -(-full // group_size)
        if b.block is None:
            if zero == 0:
                red = comm(Kind.ALL_REDUCE, b, f"b{b.index}", "step", full)
            else:
                red = comm(Kind.REDUCE_SCATTER, b, f"b{b.index}", "B" if zero >= 2 else "step", full)
            dag.add_data(backward, red, ("grads",))
            dag.add_data(red, update, ("grads",))
            for tie_key, param in dag.meta.ties.items():
                if param in b.params:
                    dag.add_data(tie_key, red, ("tie:" + param,))
        if zero in (1, 2):
            gather = comm(Kind.ALL_GATHER, b, f"b{b.index}", "step", shard)
            dag.add_data(update, gather, ("params",))
        if zero == 3 and b.block is None:
            for phase, target in (("F", f"{region}F"), ("B", backward)):
                gather = comm(Kind.ALL_GATHER, b, f"{phase}.b{b.index}", phase, shard)
                dag.add_data(gather, target, ("params",))
