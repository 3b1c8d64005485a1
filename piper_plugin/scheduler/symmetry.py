"""Data-parallel symmetry: ranks that differ only in their dp coordinate run the same plan.

When every node's devices are closed under permuting the dp coordinate (each node placed on a
(pp, ep) position runs on all dp replicas of it, as ``replicate`` places regions), the DAG is
invariant under that permutation: P2P peers keep the dp coordinate (``RankGrid.peer``) and every
axis's groups map onto groups of the same axis. The replicas of one (pp, ep) position then get
identical per-rank plans, and a simulation whose ties are broken by the global order (never by
rank) gives them identical timelines. The scheduler builds one plan per class and the
simulator runs one representative per class; :func:`representatives` says which.
"""
from __future__ import annotations

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["representatives"]


def representatives(dag: DAG, grid: RankGrid) -> list[int]:
    """Per rank, the rank whose plan and timeline it shares: the dp = 0 replica of its (pp, ep)
    position when the DAG is dp-symmetric, else itself (no collapse)."""
    world = list(range(grid.world_size))
    if grid.dp == 1:
        return world
    rep = [grid.rank(p, 0, e) for p, _, e in map(grid.coords, world)]
    for devices in {node.devices for node in dag.nodes.values()}:
        members = set(devices)
        if any(other not in members for r in devices for other in _replicas(grid, r)):
            return world
    return rep


def _replicas(grid: RankGrid, r: int) -> list[int]:
    p, _, e = grid.coords(r)
    return [grid.rank(p, d, e) for d in range(grid.dp)]
