"""split: copy the per-microbatch sub-DAG N times; optionally split B into BI and BW.

Per-microbatch nodes (F, B and the comm serving them) get one copy per microbatch; per-step
nodes (UPDATE, step-level reductions and gathers) stay single. Edges between per-microbatch
nodes connect copies of the same microbatch; edges to or from a per-step node connect every
copy. Activation comm shrinks to one microbatch of one data shard.

With ``split_backward``, B becomes BI (input gradients: edges labelled ``grad:*``) and BW
(weight gradients: ``grads`` / ``tie:*`` edges); both read what B read. Regions without
parameters get a BI only.
"""
from __future__ import annotations

import dataclasses

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, format_key, parse_key

__all__ = ["split"]


def split(dag: DAG, microbatches: int, data_shards: int, split_backward: bool) -> DAG:
    out = DAG(regions=dag.regions, buckets=dag.buckets, batch_size=dag.batch_size, meta=dict(dag.meta))
    out.meta["microbatches"] = microbatches
    out.meta["split_backward"] = split_backward
    copies: dict[str, list[str]] = {}
    shrink = microbatches * data_shards
    for key, node in dag.nodes.items():
        if not node.per_microbatch:
            copies[key] = [out.add(dataclasses.replace(node)).key]
            continue
        keys = []
        for i in range(microbatches):
            nbytes = node.bytes // shrink if node.kind in (Kind.SEND, Kind.RECV, Kind.ALL_TO_ALL) else node.bytes
            clone = dataclasses.replace(node, microbatch=i, bytes=nbytes)
            if clone.peer is not None:
                clone.peer = _with_mb(clone.peer, i)
            keys.append(out.add(clone).key)
        copies[key] = keys
    for src, succ in dag.data_succ.items():
        for dst, values in succ.items():
            _connect(out, copies[src], copies[dst], dag.nodes[src].per_microbatch,
                     dag.nodes[dst].per_microbatch, values)
    if split_backward:
        _split_backward(out)
    return out


def _with_mb(key: str, mb: int) -> str:
    region, kind, _, qual = parse_key(key)
    return format_key(region, kind, mb, qual)


def _connect(dag: DAG, srcs: list[str], dsts: list[str], src_mb: bool, dst_mb: bool, values) -> None:
    if src_mb and dst_mb:
        for s, d in zip(srcs, dsts):
            dag.add_data(s, d, values)
    else:
        for s in srcs:
            for d in dsts:
                dag.add_data(s, d, values)


def _split_backward(dag: DAG) -> None:
    for key in [k for k, n in dag.nodes.items() if n.kind == Kind.B]:
        node = dag.nodes[key]
        has_weights = bool(dag.regions[node.region].params)
        bi = dag.add(dataclasses.replace(node, kind=Kind.BI)).key
        bw = dag.add(dataclasses.replace(node, kind=Kind.BW)).key if has_weights else None
        for pred, values in list(dag.data_pred[key].items()):
            dag.add_data(pred, bi, values)
            if bw:
                dag.add_data(pred, bw, values)
        for succ, values in list(dag.data_succ[key].items()):
            weight_grads = tuple(v for v in values if v == "grads" or v.startswith("tie:"))
            input_grads = tuple(v for v in values if v not in weight_grads)
            if input_grads:
                dag.add_data(bi, succ, input_grads)
            if weight_grads and bw:
                dag.add_data(bw, succ, weight_grads)
        if bw:
            dag.add_temporal(bi, bw)
        dag.remove(key)
