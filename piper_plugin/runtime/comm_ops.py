"""What each communication node sends and what it does with what it receives.

``payload`` gives this rank's input tensor; ``absorb`` stores the result. Backends (the
in-process reference, torch.distributed) only move tensors, with these group semantics:
ALL_REDUCE sums; REDUCE_SCATTER sums then gives member i chunk i; ALL_GATHER concatenates in
group order; ALL_TO_ALL *dispatch* (``F.in``, ``B.out``) sends chunk j of dim 0 to member j and
concatenates what arrives along dim 1, *combine* (``F.out``, ``B.in``) is its inverse.
"""
from __future__ import annotations

import torch

from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.runtime.rank_state import RankState

__all__ = ["payload", "absorb", "gather_target", "is_dispatch", "tied_param"]


def is_dispatch(node: Node) -> bool:
    return node.qual in ("F.in", "B.out")


def tied_param(state: RankState, node: Node):
    name = state.dag.meta.ties[node.key]
    for chunk in state.chunks.values():
        for n, p in chunk.named_parameters():
            if n == name:
                return p
    raise RuntimeError(f"rank {state.rank} holds no copy of tied parameter {name}")


def payload(state: RankState, node: Node):
    if node.kind == Kind.SEND:
        return state.take(node.key)
    if node.kind == Kind.ALL_TO_ALL:
        (value,) = state.take(node.key).values()
        return value
    if node.kind == Kind.ALL_REDUCE and node.qual.startswith("tie"):
        p = tied_param(state, node)
        return p.grad if p.grad is not None else torch.zeros_like(p)
    bucket = state.buckets[(node.region, node.bucket)]
    if node.kind == Kind.REDUCE_SCATTER and node.phase == "B":
        return state.take(node.key, counted=True)["grads"]  # this microbatch's, held until reduced
    if node.kind in (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER):
        return bucket.flat_grad(take=True)
    return bucket.shard_data()  # ALL_GATHER


def gather_target(state: RankState, node: Node) -> bool:
    """A ZeRO-3 gather for a forward or backward: count its local consumers on the bucket.
    True when no copy was held: the bucket got its storage back and the gathered parameters
    go there (:meth:`FlatBucket.materialize`); False when one is held already (parameters do
    not change within a step, so that copy serves). Serialized with releases
    (:meth:`RankState.finished`)."""
    bucket = state.buckets[(node.region, node.bucket)]
    with state.bucket_lock:
        fresh = bucket.refs == 0
        if fresh:
            state.meter.add(bucket.padded * bucket.flat.element_size())
            bucket.allocate()
        bucket.refs += state.local_consumers(node.key)
    return fresh


def absorb(state: RankState, node: Node, result) -> None:
    if node.kind == Kind.RECV:
        state.deliver(node.key, result)
    elif node.kind == Kind.ALL_TO_ALL:
        name = next(v for vs in state.dag.data_pred[node.key].values() for v in vs)
        state.deliver(node.key, {name: result})
    elif node.kind == Kind.ALL_REDUCE and node.qual.startswith("tie"):
        tied_param(state, node).grad = result
    else:
        bucket = state.buckets[(node.region, node.bucket)]
        if node.kind == Kind.ALL_REDUCE:
            bucket.set_grad(result)
        elif node.kind == Kind.REDUCE_SCATTER:
            bucket.add_shard_grad(result)
            if node.phase == "B":  # the handed-over gradient (bucket.flat_grad) is reduced: it goes
                state.meter.add(-bucket.grad_numel * bucket.flat.element_size())
        else:
            if node.phase in ("F", "B"):  # ZeRO-3: parameters do not change within a step
                if gather_target(state, node):
                    bucket.materialize(result)
            else:
                bucket.materialize(result)
    state.finished(node.key)
