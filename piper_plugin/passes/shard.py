"""shard: expert parallelism (EP) of a region over the grid's ``ep`` axis.

The region's parameters and its one input and one output carry a leading expert dimension E
(GShard layout ``[E, capacity, dim]``); each EP rank keeps E/ep experts. A *routed* region
(``DagMeta.routed``: dropless routing, as TorchTitan's MoE) takes and returns ``(tokens,
counts)`` instead, token rows grouped by destination with their counts per member; its
all-to-alls move the counts with the rows (uneven splits) and the gradients of the rows back. Dispatch is an
ALL_TO_ALL before the region's F (and after its B, for the input gradient); combine is an
ALL_TO_ALL after its F (and before its B, for the output gradient). EP groups are the ranks of
a pipeline slice that share a ``dp`` coordinate, so the EP degree is independent of DP.
"""
from __future__ import annotations

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["shard", "shard_problem"]


def shard_problem(dag: DAG, region: str, degree: int) -> str | None:
    """Why ``region`` cannot be expert-sharded ``degree`` ways (None if it can)."""
    r = dag.regions[region]
    if not r.params:
        return f"region {region} has no parameters to shard"
    shapes = dag.meta.param_shapes
    leading = {shapes[p][0] if shapes[p] else None for p in r.params}
    if len(leading) != 1 or None in leading:
        return (f"region {region}'s parameters do not share a leading expert dimension "
                f"({', '.join(f'{p}{list(shapes[p])}' for p in r.params)})")
    experts = leading.pop()
    if experts % degree:
        return f"region {region} has {experts} experts, not divisible by ep={degree}"
    if region in dag.meta.routed:  # (tokens, counts) in and out: the splits come with the data
        if len(r.inputs) != 2 or len(r.outputs) != 2:
            return (f"routed expert region {region} must take and return (tokens, counts); it has inputs "
                    f"{r.inputs} and outputs {r.outputs}")
        return None
    if len(r.inputs) != 1 or len(r.outputs) != 1:
        return (f"region {region} must take one tensor and return one tensor of layout "
                f"[experts, capacity, dim]; it has inputs {r.inputs} and outputs {r.outputs}")
    values = dag.meta.value_shapes
    for v in r.inputs + r.outputs:
        if values.get(v, (None,))[0] != experts:
            return f"value {v} of region {region} has shape {values.get(v)}, expected leading dim {experts}"
    return None


def shard(dag: DAG, grid: RankGrid, region: str) -> None:
    r = dag.regions[region]
    dag.meta.sharded[region] = grid.ep
    f, b = f"{region}F", f"{region}B"
    devices = dag.nodes[f].devices
    nbytes = r.value_bytes[r.inputs[0]]

    def a2a(qual: str, phase: str) -> str:
        return dag.add(Node(Kind.ALL_TO_ALL, region, r.stage, qual=qual, devices=devices, stream="ep",
                            tags=r.tags, bytes=nbytes, phase=phase, axis="ep")).key

    def wrap(edges: list[tuple[str, str]], qual: str, phase: str) -> None:
        """Route every (src, dst) edge through one ALL_TO_ALL node."""
        mid = a2a(qual, phase)
        for src, dst in edges:
            values = dag.remove_data(src, dst)
            dag.add_data(src, mid, values)
            dag.add_data(mid, dst, values)

    x, y = r.inputs[0], r.outputs[0]
    xs, ys = set(r.inputs), set(r.outputs)  # a routed region's counts travel with its tokens
    wrap([(k, f) for k, v in list(dag.data_pred[f].items()) if xs & set(v)], "F.in", "F")
    wrap([(f, k) for k, v in list(dag.data_succ[f].items()) if ys & set(v)], "F.out", "F")
    wrap([(k, b) for k, v in list(dag.data_pred[b].items()) if f"grad:{y}" in v], "B.out", "B")
    wrap([(b, k) for k, v in list(dag.data_succ[b].items()) if f"grad:{x}" in v], "B.in", "B")
