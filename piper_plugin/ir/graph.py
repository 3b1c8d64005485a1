"""The global training DAG: nodes, data edges and temporal edges.

Invariants kept by every method here:
* node keys are unique; an edge's endpoints exist;
* a data edge carries the names of the values that flow along it (activations forward,
  their gradients backward); a temporal edge carries none and only orders;
* ``regions`` (the captured model's chunks) and ``buckets`` are metadata shared by all
  rewrites of one DAG and never change after capture / replicate;
* ``meta`` (:class:`DagMeta`) holds what capture and the passes recorded; ``copy`` gives the
  copy its own maps, so a pass writing the copy's never changes the original's.
"""
from __future__ import annotations

import gc
import heapq
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from piper_plugin.ir.meta import DagMeta
from piper_plugin.ir.nodes import Node

__all__ = ["DAG", "Region", "BackwardBytes", "Rise", "Bucket", "CycleError", "gc_paused", "rows_split_evenly"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a pass builds or walks a large DAG.

    Such passes allocate hundreds of thousands of small containers and no reference cycles
    to reclaim, so collections triggered by the allocation count only re-scan every live
    object (torch's included) again and again. Reference counting still frees memory; the
    collector resumes (if it was on) when the block ends.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class CycleError(ValueError):
    """Raised when edges would make the DAG cyclic; ``cycle`` lists node keys."""

    def __init__(self, cycle: list[str]):
        self.cycle = cycle
        shown = " -> ".join(cycle[:12]) + (" -> ..." if len(cycle) > 12 else "")
        super().__init__(f"cycle: {shown}")


@dataclass(frozen=True)
class Rise:
    """A high-water mark above a starting level, for any batch: a batch ``scale`` times the
    probed one reaches ``max(batch part x scale + fixed part)`` over ``levels`` (the fixed part
    is parameter-sized gradients, the same whatever the batch)."""

    levels: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, batch: int, fixed: int = 0) -> "Rise":
        return cls(((batch, fixed),))

    def at(self, scale: float) -> int:
        return max((int(batch * scale) + fixed for batch, fixed in self.levels), default=0)


@dataclass(frozen=True)
class BackwardBytes:
    """Working memory of one region's backward, as probed on the example batch: what its
    kernels allocate beyond the saved activations (gradients between its ops, temporaries, the
    gradients it returns), as a rise above the level at its start. ``full``: one whole
    backward (B); ``inputs``: the input-gradient pass (BI); ``kept``: what BI leaves alive for
    BW (the gradients recorded at the weight side); ``weights``: BW's rise above its start."""

    full: Rise = Rise()
    inputs: Rise = Rise()
    kept: Rise = Rise()
    weights: Rise = Rise()


@dataclass
class Region:
    """A chunk of the model: a maximal run of ops with one tag set (see capture).

    ``value_bytes`` are sizes for the example batch the model was captured with;
    ``activation_bytes`` estimates what one forward of the region keeps for backward,
    ``backward`` what its backward allocates on top (both for that batch). ``blocks``: for a
    region run as a module, its sequential submodules ``(path in the chunk, parameter names)``,
    in forward order, each using only its own parameters (FSDP's units): ZeRO-3 may gather
    and reduce them one at a time inside the chunk. ``backward_splits=False``: the region's
    backward computes input and weight gradients in one call (a compiled graph, a custom
    autograd Function over its weights), so a BI of it runs the whole backward and its BW
    nothing; the plan lowers it so (:mod:`piper_plugin.scheduler.backward_passes`). ``ops``: the
    operations its traced graph runs (0: not known, a module region); a calibrated cost model
    charges each task a time per op (:mod:`piper_plugin.calibrate`). ``flops``: forward FLOPs
    of the batch as 2 x samples x parameters (a size, for FLOP-rate cost models; hosts give
    their own); ``matmul_flops``: the forward FLOPs of its matrix products (linear layers,
    matmuls, attention, convolutions) counted from the traced shapes of the example batch (0:
    not counted, a module region): what a calibrated cost model scales compute time with
    (an embedding lookup costs no FLOPs, attention's grow with the sequence squared).
    ``shared_activation_bytes``: what the region's forwards save once for every microbatch's
    graph alive on a rank (a cache they share, such as rotary tables): saved by a forward when
    none of the region's activations are held, let go when the last are (measured by a host's
    traced steps, else 0).
    """

    name: str
    stage: int
    index: int
    tags: dict[str, Any]
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    value_bytes: dict[str, int]
    activation_bytes: int
    param_bytes: int
    flops: int = 0
    backward: BackwardBytes = field(default_factory=BackwardBytes)
    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    backward_splits: bool = True
    ops: int = 0
    matmul_flops: int = 0
    shared_activation_bytes: int = 0


@dataclass
class Bucket:
    """Parameters of one region reduced / sharded together (replicate's bucket option).
    ``block``: the region block (module path) whose parameters these are, gathered and reduced
    inside the chunk as the block runs (ZeRO-3 by block); None: by the plan's own nodes."""

    region: str
    index: int
    params: tuple[str, ...]
    numel: int
    group: tuple[int, ...]
    zero: int
    block: str | None = None


def rows_split_evenly(shapes, n: int) -> bool:
    """Every parameter (by shape) has rows and as many per member of ``n``: a ZeRO bucket's
    rank-major layout is then each parameter's own, and its collectives need no layout copy."""
    return all(len(shape) and shape[0] % n == 0 for shape in shapes)


@dataclass
class DAG:
    nodes: dict[str, Node] = field(default_factory=dict)
    data_succ: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    data_pred: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    temporal_succ: dict[str, set[str]] = field(default_factory=dict)
    temporal_pred: dict[str, set[str]] = field(default_factory=dict)
    regions: dict[str, Region] = field(default_factory=dict)
    buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    batch_size: int = 1
    meta: DagMeta = field(default_factory=DagMeta)

    # -- construction -------------------------------------------------------------------
    def add(self, node: Node, key: str | None = None) -> Node:
        """Add ``node``; ``key``, if given, must be ``node.key`` (saves recomputing it)."""
        if key is None:
            key = node.key
        if key in self.nodes:
            raise ValueError(f"node {key} already exists")
        self.nodes[key] = node
        self.data_succ[key] = {}
        self.data_pred[key] = {}
        self.temporal_succ[key] = set()
        self.temporal_pred[key] = set()
        return node

    def remove(self, key: str) -> None:
        for succ in list(self.data_succ[key]):
            del self.data_pred[succ][key]
        for pred in list(self.data_pred[key]):
            del self.data_succ[pred][key]
        for succ in self.temporal_succ[key]:
            self.temporal_pred[succ].discard(key)
        for pred in self.temporal_pred[key]:
            self.temporal_succ[pred].discard(key)
        for table in (self.data_succ, self.data_pred, self.temporal_succ, self.temporal_pred, self.nodes):
            del table[key]

    def add_data(self, src: str, dst: str, values: Iterable[str] = ()) -> None:
        succ = self.data_succ[src]
        old = succ.get(dst)
        merged = tuple(dict.fromkeys(tuple(values) if old is None else old + tuple(values)))
        succ[dst] = merged
        self.data_pred[dst][src] = merged

    def remove_data(self, src: str, dst: str) -> tuple[str, ...]:
        values = self.data_succ[src].pop(dst)
        del self.data_pred[dst][src]
        return values

    def add_temporal(self, src: str, dst: str) -> None:
        if src == dst:
            raise CycleError([src, dst])
        self.temporal_succ[src].add(dst)
        self.temporal_pred[dst].add(src)

    # -- queries --------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def preds(self, key: str) -> Iterator[str]:
        yield from self.data_pred[key]
        yield from self.temporal_pred[key]

    def succs(self, key: str) -> Iterator[str]:
        yield from self.data_succ[key]
        yield from self.temporal_succ[key]

    def num_edges(self) -> int:
        return sum(map(len, self.data_succ.values())) + sum(map(len, self.temporal_succ.values()))

    def topological_order(self, priority: dict[str, Any] | None = None) -> list[str]:
        """Kahn's order; ties go to the smaller ``priority`` (default: insertion order).

        Raises :class:`CycleError` naming one cycle if the DAG has one.
        """
        if not priority:
            return self.ranked_order(list(self.nodes))
        # Ready nodes pop by (priority, key); ranking every node once by that pair gives the
        # same order with plain integer heap entries.
        return self.ranked_order(sorted(self.nodes, key=lambda k: (priority[k], k)))

    def ranked_order(self, ranking: list[str]) -> list[str]:
        """Kahn's order; among ready nodes the one earliest in ``ranking`` (every node once) goes first.

        Raises :class:`CycleError` naming one cycle if the DAG has one.
        """
        data_succ, temporal_succ = self.data_succ, self.temporal_succ
        data_pred, temporal_pred = self.data_pred, self.temporal_pred
        index = {key: i for i, key in enumerate(ranking)}
        indegree = {key: len(data_pred[key]) + len(temporal_pred[key]) for key in ranking}
        heap = [i for i, key in enumerate(ranking) if not indegree[key]]  # ascending: a heap
        push, pop = heapq.heappush, heapq.heappop
        order: list[str] = []
        append = order.append
        while heap:
            key = ranking[pop(heap)]
            append(key)
            for succ in data_succ[key]:
                left = indegree[succ] - 1
                indegree[succ] = left
                if not left:
                    push(heap, index[succ])
            for succ in temporal_succ[key]:
                left = indegree[succ] - 1
                indegree[succ] = left
                if not left:
                    push(heap, index[succ])
        if len(order) != len(self.nodes):
            raise CycleError(self._find_cycle({k for k in self.nodes if indegree[k] > 0}))
        return order

    def is_acyclic(self) -> bool:
        """Whether the DAG has no cycle (a linear pass, no ordering among ready nodes)."""
        data_succ, temporal_succ = self.data_succ, self.temporal_succ
        indegree = {key: len(self.data_pred[key]) + len(self.temporal_pred[key]) for key in self.nodes}
        ready = [key for key, deg in indegree.items() if not deg]
        seen = 0
        while ready:
            key = ready.pop()
            seen += 1
            for succ in data_succ[key]:
                left = indegree[succ] - 1
                indegree[succ] = left
                if not left:
                    ready.append(succ)
            for succ in temporal_succ[key]:
                left = indegree[succ] - 1
                indegree[succ] = left
                if not left:
                    ready.append(succ)
        return seen == len(self.nodes)

    def _find_cycle(self, candidates: set[str]) -> list[str]:
        """A cycle among ``candidates`` (nodes left with positive in-degree)."""
        start = next(iter(candidates))
        seen: dict[str, int] = {}
        path: list[str] = []
        key = start
        while key not in seen:
            seen[key] = len(path)
            path.append(key)
            key = next(p for p in self.preds(key) if p in candidates)
        cycle = path[seen[key]:] + [key]
        return list(reversed(cycle))

    def copy(self) -> "DAG":
        return DAG(
            nodes=dict(self.nodes),
            data_succ={k: dict(v) for k, v in self.data_succ.items()},
            data_pred={k: dict(v) for k, v in self.data_pred.items()},
            temporal_succ={k: set(v) for k, v in self.temporal_succ.items()},
            temporal_pred={k: set(v) for k, v in self.temporal_pred.items()},
            regions=self.regions, buckets=dict(self.buckets), batch_size=self.batch_size,
            meta=self.meta.copy(),
        )

    # -- serialisation ----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Nodes and edges (regions are metadata of the captured model, not serialised)."""
        return {
            "nodes": [node.to_json() for node in self.nodes.values()],
            "data": [[s, d, list(v)] for s, succ in self.data_succ.items() for d, v in succ.items()],
            "temporal": sorted([s, d] for s, succ in self.temporal_succ.items() for d in succ),
        }

    def canonical(self) -> dict[str, Any]:
        """Order-independent form used to compare two DAGs for equality."""
        data = self.to_json()
        return {"nodes": sorted(data["nodes"], key=lambda n: n["key"]),
                "data": sorted(data["data"]), "temporal": data["temporal"]}
