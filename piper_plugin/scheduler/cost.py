"""Cost model for the simulator: compute time per chunk kind, alpha-beta communication.

``uniform`` gives every region the same F / B / BI / BW time (textbook formulas); ``from_flops``
derives compute time from each region's FLOPs for one microbatch of one data shard;
``per_task`` sets the time of a (kind, region) outright (measured times, for one).
Collective time follows ring algorithms: all-reduce moves 2(n-1)/n of the buffer, all-gather,
reduce-scatter and all-to-all (n-1)/n. ``comm_cpu_share`` of a communication task's time also
holds its rank's compute unit (communication that costs CPU, as gloo's on a CPU); with ``cores``
all ranks' compute tasks share that many units (more ranks than cores on one machine).
``step_overhead`` is added to the step once, outside every task (memory does not see it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, Node

__all__ = ["CostModel", "task_features", "TASK_FEATURES"]


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
    # share of each message's / collective's time its rank's compute unit is held too (0: a
    # DMA engine or NIC moves it; a CPU with gloo copies and reduces on the cores that compute)
    comm_cpu_share: float = 0.0
    # compute units the ranks share (a machine's cores when it runs more ranks than it has, one
    # process per rank); None: every rank its own
    cores: int | None = None
    # seconds a step takes beyond its tasks' makespan: the runtime's work before the first task
    # starts and after the last ends (a calibrated profile measures it; the step time adds it)
    step_overhead: float = 0.0
    flops_per_second: float | None = None  # if set, compute time comes from region FLOPs
    per_region: dict[str, float] = field(default_factory=dict)  # multiplier per region
    per_task: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, region) -> seconds, first
    # kind -> seconds per each of :data:`TASK_FEATURES`: a calibrated profile (:mod:`piper_plugin.calibrate`), second
    linear: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def uniform(cls, F: float = 1.0, B: float = 2.0, W: float | None = None, comm: float = 0.0) -> "CostModel":
        """F, full backward B = BI + BW (BW = W, default B/2), and a fixed per-comm latency."""
        w = B / 2 if W is None else W
        return cls(F=F, B=B, BI=B - w, BW=w, latency=comm)

    @classmethod
    def cpu_default(cls) -> "CostModel":
        """Rough figures of this project's 2-core CPU with gloo (for pictures, not promises)."""
        return cls(flops_per_second=2e10, latency=2e-4, seconds_per_byte=1e-9, UPDATE=0.0)

    @property
    def measures_whole_backward(self) -> bool:
        """A calibrated profile knows what one whole backward (B) costs, which is less than its
        split halves BI + BW together: a BI run as the whole backward is charged that."""
        return bool(self.linear) and "B" in self.linear and not self.per_task

    def compute(self, dag: DAG, node: Node, kind: str | None = None) -> float:
        """Seconds (or units) of ``node``; ``kind``: as if it were a task of that kind instead
        (a BI run as the whole backward: ``"B"``)."""
        kind = kind or node.kind.value
        if self.per_task:
            seconds = self.per_task.get((kind, node.region))
            if seconds is not None:
                return seconds
        if self.linear and kind in self.linear:
            return float(sum(c * x for c, x in zip(self.linear[kind], task_features(dag, node))))
        if self.flops_per_second is not None:
            region = dag.regions[node.region]
            shards = (dag.meta.microbatches or 1) * _data_shards(dag)
            forward = region.flops / shards / self.flops_per_second
            factor = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0, "UPDATE": 0.0}[kind]
            return forward * factor + (self.UPDATE if kind == Kind.UPDATE.value else 0.0)
        base = getattr(self, kind)
        return base * self.per_region.get(node.region, 1.0)

    def comm(self, node: Node, group: int) -> float:
        if group <= 1 and node.kind not in (Kind.SEND, Kind.RECV):
            return 0.0
        share = {Kind.ALL_REDUCE: 2 * (group - 1) / group, Kind.ALL_GATHER: (group - 1) / group,
                 Kind.REDUCE_SCATTER: (group - 1) / group, Kind.ALL_TO_ALL: (group - 1) / group}
        volume = node.bytes * share.get(node.kind, 1.0)
        return self.latency_by_kind.get(node.kind.value, self.latency) + volume * self.seconds_per_byte


TASK_FEATURES = ("per task", "per op", "per forward matmul FLOP of the microbatch",
                 "per activation byte of the microbatch", "per parameter byte")


def task_features(dag: DAG, node: Node) -> tuple[float, ...]:
    """What a calibrated profile's coefficients multiply (:data:`TASK_FEATURES`): 1, the region's
    ops, the forward FLOPs of its matrix products for one microbatch on one data shard (its
    ``flops`` where they were not counted), the activations it keeps for that microbatch (the
    memory-bound work), its parameter bytes."""
    region = dag.regions[node.region]
    shards = (dag.meta.microbatches or 1) * _data_shards(dag)
    flops = region.matmul_flops or region.flops
    return 1.0, float(region.ops), flops / shards, region.activation_bytes / shards, float(region.param_bytes)


def _data_shards(dag: DAG) -> int:
    grid = dag.meta.grid
    return 1 if grid is None else grid.data_shards
