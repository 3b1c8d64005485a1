"""Cost model for the simulator: compute time per chunk kind, alpha-beta communication.

``uniform`` gives every region the same F / B / BI / BW time (textbook formulas); ``from_flops``
derives compute time from each region's FLOPs for one microbatch of one data shard;
``per_task`` sets the time of a (kind, region) outright (measured times, for one).
Collective time follows ring algorithms: all-reduce moves 2(n-1)/n of the buffer, all-gather,
reduce-scatter and all-to-all (n-1)/n.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, Node

__all__ = ["CostModel", "task_features"]


@dataclass
class CostModel:
    F: float = 1.0
    B: float = 2.0
    BI: float = 1.0
    BW: float = 1.0
    UPDATE: float = 0.0
    latency: float = 0.0  # seconds per comm op (alpha)
    latency_by_kind: dict[str, float] = field(default_factory=dict)  # comm kind -> its alpha, first
    seconds_per_byte: float = 0.0  # 1 / bandwidth (beta)
    flops_per_second: float | None = None  # if set, compute time comes from region FLOPs
    per_region: dict[str, float] = field(default_factory=dict)  # multiplier per region
    per_task: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, region) -> seconds, first
    # kind -> seconds (per task, per op of the region, per forward FLOP of the microbatch, per parameter
    # byte): a calibrated profile (:mod:`piper_plugin.calibrate`), second
    linear: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)

    @classmethod
    def uniform(cls, F: float = 1.0, B: float = 2.0, W: float | None = None, comm: float = 0.0) -> "CostModel":
        """F, full backward B = BI + BW (BW = W, default B/2), and a fixed per-comm latency."""
        w = B / 2 if W is None else W
        return cls(F=F, B=B, BI=B - w, BW=w, latency=comm)

    @classmethod
    def cpu_default(cls) -> "CostModel":
        """Rough figures of this project's 2-core CPU with gloo (for pictures, not promises)."""
        return cls(flops_per_second=2e10, latency=2e-4, seconds_per_byte=1e-9, UPDATE=0.0)

    def compute(self, dag: DAG, node: Node) -> float:
        if self.per_task:
            seconds = self.per_task.get((node.kind.value, node.region))
            if seconds is not None:
                return seconds
        if self.linear and node.kind.value in self.linear:
            return float(sum(c * x for c, x in zip(self.linear[node.kind.value], task_features(dag, node))))
        if self.flops_per_second is not None:
            region = dag.regions[node.region]
            shards = (dag.meta.microbatches or 1) * _data_shards(dag)
            forward = region.flops / shards / self.flops_per_second
            factor = {Kind.F: 1.0, Kind.B: 2.0, Kind.BI: 1.0, Kind.BW: 1.0, Kind.UPDATE: 0.0}[node.kind]
            return forward * factor + (self.UPDATE if node.kind == Kind.UPDATE else 0.0)
        base = getattr(self, node.kind.value)
        return base * self.per_region.get(node.region, 1.0)

    def comm(self, node: Node, group: int) -> float:
        if group <= 1 and node.kind not in (Kind.SEND, Kind.RECV):
            return 0.0
        share = {Kind.ALL_REDUCE: 2 * (group - 1) / group, Kind.ALL_GATHER: (group - 1) / group,
                 Kind.REDUCE_SCATTER: (group - 1) / group, Kind.ALL_TO_ALL: (group - 1) / group}
        volume = node.bytes * share.get(node.kind, 1.0)
        return self.latency_by_kind.get(node.kind.value, self.latency) + volume * self.seconds_per_byte


def task_features(dag: DAG, node: Node) -> tuple[float, float, float, float]:
    """What a calibrated profile's coefficients multiply: 1, the region's ops, the forward FLOPs
    of one microbatch on one data shard, the region's parameter bytes."""
    region = dag.regions[node.region]
    shards = (dag.meta.microbatches or 1) * _data_shards(dag)
    return 1.0, float(region.ops), region.flops / shards, float(region.param_bytes)


def _data_shards(dag: DAG) -> int:
    grid = dag.meta.grid
    return 1 if grid is None else grid.data_shards
