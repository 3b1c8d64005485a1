"""The last scheduler pass: complete each rank's plan with how its tasks run.

After it, a :class:`RankPlan` says everything a worker needs and nothing is rediscovered at
start-up: which BI tasks run fused with their BW, which B tasks send input gradients before
computing weight gradients, which stream the caller's thread runs, which streams are posted
(P2P only, sends first) and the bytes each posted task holds. The simulator reads the same
fields, so what it charges is what the runtime does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from piper_plugin.ir.graph import DAG
from piper_plugin.scheduler.backward_passes import fused_backwards, input_grads_first
from piper_plugin.scheduler.posting import post_sizes, posted_streams

if TYPE_CHECKING:
    from piper_plugin.scheduler.plan import RankPlan

__all__ = ["lower_rank_plan", "inline_stream"]


def inline_stream(dag: DAG, rank_plan: "RankPlan") -> str | None:
    """The stream with the most compute tasks: the one the caller's own thread runs."""
    streams = rank_plan.streams
    return max(streams, key=lambda s: sum(dag.nodes[k].is_compute for k in streams[s]), default=None)


def lower_rank_plan(dag: DAG, rank_plan: "RankPlan", *, split_last_backward: bool = True) -> None:
    """Fill ``rank_plan``'s execution fields. ``split_last_backward=False`` runs every B as one
    pass (activation checkpointing may allow only one backward through a region)."""
    rank_plan.fused = frozenset(fused_backwards(dag, rank_plan))
    rank_plan.split_first = frozenset(input_grads_first(dag, rank_plan)) if split_last_backward else frozenset()
    rank_plan.inline = inline_stream(dag, rank_plan)
    rank_plan.posted = tuple(posted_streams(dag, rank_plan))
    rank_plan.post_bytes = post_sizes(dag, rank_plan, rank_plan.posted)
