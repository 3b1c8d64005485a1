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
from piper_plugin.ir.nodes import Kind, Node, format_key, parse_key

__all__ = ["split"]


def split(dag: DAG, microbatches: int, data_shards: int, split_backward: bool) -> DAG:
    out = DAG(regions=dag.regions, buckets=dag.buckets, batch_size=dag.batch_size, meta=dag.meta.copy())
    out.meta.microbatches = microbatches
    out.meta.split_backward = split_backward
    copies: dict[str, list[str]] = {}
    per_mb: dict[str, bool] = {}
    shrink = microbatches * data_shards
    for key, node in dag.nodes.items():
        per_mb[key] = node.per_microbatch
        if not per_mb[key]:
            copies[key] = [out.add(_clone(node)).key]
            continue
        nbytes = node.bytes // shrink if node.kind in (Kind.SEND, Kind.RECV, Kind.ALL_TO_ALL) else node.bytes
        peer = parse_key(node.peer) if node.peer is not None else None
        head, tail = format_key(node.region, node.kind, None), f"@{node.qual}" if node.qual else ""
        keys = []
        for i in range(microbatches):
            clone = _clone(node, microbatch=i, bytes=nbytes)
            if peer is not None:
                clone.peer = format_key(peer[0], peer[1], i, peer[3])
            clone_key = f"{head}{i}{tail}"  # format_key(region, kind, i, qual)
            out.add(clone, clone_key)
            keys.append(clone_key)
        copies[key] = keys
    for src, succ in dag.data_succ.items():
        for dst, values in succ.items():
            _connect(out, copies[src], copies[dst], per_mb[src], per_mb[dst], values)
    if split_backward:
        _split_backward(out)
    return out


def _make_clone():
    """``dataclasses.replace`` for :class:`Node`, without its per-call field introspection.

    Generated from the dataclass fields (as dataclasses generates ``__init__``), so a field
    added to Node is copied too; each clone is built by ``Node.__init__``.
    """
    names = [f.name for f in dataclasses.fields(Node) if f.init]
    params = ", ".join(f"{n}=_KEEP" for n in names)
    args = ", ".join(f"{n}=node.{n} if {n} is _KEEP else {n}" for n in names)
    scope = {"Node": Node, "_KEEP": object()}
    exec(f"def _clone(node, *, {params}):\n    return Node({args})\n", scope)  # noqa: S102
    return scope["_clone"]


_clone = _make_clone()


def _connect(dag: DAG, srcs: list[str], dsts: list[str], src_mb: bool, dst_mb: bool, values) -> None:
    values = tuple(dict.fromkeys(values))
    data_succ, data_pred = dag.data_succ, dag.data_pred
    pairs = zip(srcs, dsts) if src_mb and dst_mb else ((s, d) for s in srcs for d in dsts)
    for s, d in pairs:
        if d in data_succ[s]:
            dag.add_data(s, d, values)
        else:  # a new edge: what add_data stores
            data_succ[s][d] = values
            data_pred[d][s] = values


def _split_backward(dag: DAG) -> None:
    for key in [k for k, n in dag.nodes.items() if n.kind == Kind.B]:
        node = dag.nodes[key]
        has_weights = bool(dag.regions[node.region].params)
        bi = dag.add(_clone(node, kind=Kind.BI)).key
        bw = dag.add(_clone(node, kind=Kind.BW)).key if has_weights else None
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
