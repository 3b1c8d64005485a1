"""The DAG validator, run after every pass.

Checks: the DAG is acyclic; every region input produced by another region reaches each F
(and every output gradient reaches each B / BI); every SEND has its RECV (same microbatch,
same values, linked both ways); every collective names a grid axis whose groups cover its
devices; once the DAG is split, every parameter bucket of a region with more than one replica
receives each microbatch's gradient through exactly one reduction per step.
"""
from __future__ import annotations

from piper_plugin.ir.graph import DAG, CycleError
from piper_plugin.ir.nodes import COLLECTIVES, Kind
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["validate", "ValidationError"]


class ValidationError(ValueError):
    """The DAG breaks an invariant; the message names the node and the rule."""


def validate(dag: DAG, grid: RankGrid, *, acyclic: bool = False) -> None:
    """Raise :class:`ValidationError` if ``dag`` breaks an invariant.

    ``acyclic=True`` skips the cycle check when the caller has just proven the DAG acyclic.
    """
    if not acyclic and not dag.is_acyclic():
        try:
            dag.topological_order()
        except CycleError as exc:
            raise ValidationError(f"the DAG has a {exc}") from None
    needed = _inputs_from_other_regions(dag)
    groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = {}
    grad_nodes: dict[str, list[str]] = {}  # per region: the nodes whose output is its gradient
    nodes, data_pred, regions = dag.nodes, dag.data_pred, dag.regions
    F, B, BI, BW, SEND, RECV = Kind.F, Kind.B, Kind.BI, Kind.BW, Kind.SEND, Kind.RECV
    for key, node in nodes.items():
        kind = node.kind
        if kind == F:
            wanted = needed[node.region]
            if wanted:
                _check_inputs(key, wanted, data_pred[key])
        elif kind == SEND or kind == RECV:
            peer = nodes.get(node.peer or "")
            if peer is None or peer.peer != key or peer.microbatch != node.microbatch:
                raise ValidationError(f"{key} has no matching peer (peer={node.peer!r})")
            if kind == SEND and peer.kind != RECV:
                raise ValidationError(f"{key} must pair with a RECV, not {peer.key}")
        elif kind in COLLECTIVES:
            if not node.devices or node.axis is None:
                raise ValidationError(f"collective {key} has no devices or no grid axis")
            cached = groups.get((node.axis, node.devices))
            if cached is None:
                cached = groups[(node.axis, node.devices)] = grid.groups(node.axis, node.devices)
            if sum(map(len, cached)) != len(node.devices):
                raise ValidationError(f"collective {key}: groups {cached} do not cover {node.devices}")
        if kind == B or kind == BW or (kind == BI and not regions[node.region].params):
            if node.region in grad_nodes:
                grad_nodes[node.region].append(key)
            else:
                grad_nodes[node.region] = [key]
    if dag.meta.microbatches is not None:
        _check_gradients(dag, grid, grad_nodes)


def _inputs_from_other_regions(dag: DAG) -> dict[str, tuple[str, ...]]:
    """Per region: its inputs that another region produces (each must arrive on a data edge)."""
    producers: dict[str, set[str]] = {}
    for r in dag.regions.values():
        for v in r.outputs:
            producers.setdefault(v, set()).add(r.name)
    return {name: tuple(v for v in r.inputs if producers.get(v, set()) - {name})
            for name, r in dag.regions.items()}


def _check_inputs(key: str, needed: tuple[str, ...], preds: dict[str, tuple[str, ...]]) -> None:
    for v in needed:
        if not any(v in values for values in preds.values()):
            arriving = {v for values in preds.values() for v in values}
            missing = [v for v in needed if v not in arriving]
            raise ValidationError(f"{key} needs values {missing} but no data edge brings them")


def _check_gradients(dag: DAG, grid: RankGrid, grad_nodes: dict[str, list[str]]) -> None:
    sharded = dag.meta.sharded
    for region, params in dag.meta.update_params.items():
        if not params:
            continue
        devices = dag.nodes[grad_nodes[region][0]].devices
        axis = "dp" if region in sharded else "data"
        replicas = len(grid.groups(axis, devices)[0])
        buckets = dag.buckets.get(region)
        if replicas == 1:
            continue
        if not buckets:
            raise ValidationError(
                f"gradients of region {region} are not reduced over its {replicas} replicas "
                f"(ranks {devices}): add replicate('region={region}') or replicate('*')")
        by_bucket = {key: _reductions(dag, key) for key in grad_nodes[region]}  # one pass per node
        for bucket in buckets:
            if bucket.block is not None:  # reduced inside the chunk as its block's backward ends
                continue
            for key in grad_nodes[region]:
                reductions = by_bucket[key].get(bucket.index, [])
                if len(reductions) != 1:
                    raise ValidationError(
                        f"bucket {bucket.index} of region {region}: {key}'s gradient reaches "
                        f"{len(reductions)} reductions ({reductions}); it must reach exactly one")


def _reductions(dag: DAG, key: str) -> dict[int | None, list[str]]:
    """The reductions ``key``'s gradient reaches, per bucket index."""
    out: dict[int | None, list[str]] = {}
    for s, values in dag.data_succ[key].items():
        node = dag.nodes[s]
        if "grads" in values and node.kind in (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER):
            out.setdefault(node.bucket, []).append(s)
    return out
