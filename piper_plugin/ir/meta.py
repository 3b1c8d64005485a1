"""Typed metadata of a DAG: what capture and each directive pass record beside nodes and edges.

Invariants:
* every field is written by exactly one pass or module (named in its comment) and only read
  elsewhere;
* an unset scalar is ``None``; an unset map is empty;
* map values are immutable (ints, strs, tuples), so :meth:`DagMeta.copy` copying each map one
  level deep isolates the copy: a pass writing a map of one never changes the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["DagMeta"]


@dataclass
class DagMeta:
    # capture (ir/capture.py: capture() for traced regions, Program.from_regions for module regions)
    param_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each parameter, by parameter name."""
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Shape of each parameter, by parameter name."""
    value_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Shape of each value on the example batch, by value (fx node) name."""
    loss_region: str | None = None
    """The region that computes the loss."""
    inputs: tuple[str, ...] = ()
    """Names of the model's input values, in call order."""
    routed: tuple[str, ...] = ()
    """Expert regions fed routed token rows (Program.from_regions): each takes and returns
    ``(tokens, counts)``, counts per member of the ep group, so their all-to-alls move uneven,
    data-dependent splits."""

    # place (passes/place.py)
    placement: dict[str, int] = field(default_factory=dict)
    """Pipeline rank of each placed region."""
    update_params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per region: the parameters its UPDATE owns (set when placement closes)."""
    ties: dict[str, str] = field(default_factory=dict)
    """Per tie all-reduce node key: the tied parameter it sums."""

    # shard (passes/shard.py)
    sharded: dict[str, int] = field(default_factory=dict)
    """EP degree of each expert-sharded region."""

    # replicate (passes/replicate.py)
    replicated: dict[str, int] = field(default_factory=dict)
    """ZeRO level each replicated region runs at (0 over a group of one replica)."""

    # split (passes/split.py)
    microbatches: int | None = None
    """Microbatch count; None until the DAG is split."""
    split_backward: bool = False
    """Whether split turned each B into BI and BW."""

    # Schedule (api/schedule.py)
    grid: RankGrid | None = None
    """The rank grid the schedule targets; None on a captured, unscheduled DAG."""
    overlaps: tuple[tuple[str, ...], ...] = ()
    """Overlap blocks ordered by ``order`` / ``order_per_rank``: each block's compute node keys
    (issued together, so one member's communication can run under another's compute)."""

    def copy(self) -> "DagMeta":
        """A copy whose maps are new objects (their values are immutable, so shared)."""
        return DagMeta(**{f.name: _copied(getattr(self, f.name)) for f in fields(self)})


def _copied(value):
    return dict(value) if isinstance(value, dict) else value
