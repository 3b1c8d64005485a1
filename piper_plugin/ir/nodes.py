"""Nodes of the global training DAG and their compact printable form.

A node is a compute chunk (F, B, BI, BW, UPDATE of one region for one microbatch) or a
communication op (SEND, RECV and the collectives). Its printable key, e.g. ``2F0``,
``1.1BI3``, ``0SEND1@F>1``, ``2ALL_REDUCE@b0``, is unique in a DAG and parses back
(`parse_key`), so plans and test failures stay readable.

Key grammar: ``<region><KIND>[<microbatch>][@<qualifier>]`` where region is ``<stage>`` or
``<stage>.<segment>``; nodes without a microbatch are per-step (UPDATE, step-level
reductions).
"""
from __future__ import annotations

import functools

import enum
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Kind", "Node", "COMPUTE", "COLLECTIVES", "P2P", "parse_key", "format_key"]


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    UPDATE = "UPDATE"
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALL_REDUCE"
    ALL_GATHER = "ALL_GATHER"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_TO_ALL = "ALL_TO_ALL"

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset({Kind.F, Kind.B, Kind.BI, Kind.BW, Kind.UPDATE})
P2P = frozenset({Kind.SEND, Kind.RECV})
COLLECTIVES = frozenset({Kind.ALL_REDUCE, Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL})

# Longest kind names first so "BI" is not read as "B" followed by garbage.
_KINDS = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_KEY_RE = re.compile(rf"^(?P<region>\d+(?:\.\d+)?)(?P<kind>{_KINDS})(?P<mb>\d+)?(?:@(?P<qual>.+))?$")


def format_key(region: str, kind: Kind, microbatch: int | None, qual: str = "") -> str:
    key = f"{region}{kind.value}{'' if microbatch is None else microbatch}"
    return f"{key}@{qual}" if qual else key


def weight_pass_key(node: "Node") -> str:
    """The key of the BW that pairs with the BI (or B) ``node``: same region, microbatch, qualifier."""
    return format_key(node.region, Kind.BW, node.microbatch, node.qual)


def parse_key(key: str) -> tuple[str, Kind, int | None, str]:
    """Inverse of :func:`format_key`: ``"1.1BI3"`` -> ``("1.1", Kind.BI, 3, "")``."""
    match = _KEY_RE.match(key)
    if not match:
        raise ValueError(
            f"{key!r} is not a node name; expected <stage>[.<segment>]<KIND>[<microbatch>][@qual], "
            f"e.g. 2F0, 1.1BI3, 0SEND1@F>1"
        )
    mb = match["mb"]
    return match["region"], Kind(match["kind"]), None if mb is None else int(mb), match["qual"] or ""


@dataclass(eq=False)
class Node:
    """One task of the global DAG.

    ``devices`` are global ranks: a compute node on several devices runs SPMD on each (one
    data shard per replica); a collective's devices are its group; SEND/RECV have one device
    and ``peer`` names the matching node on the other side. ``bytes`` is the payload of a comm
    node (per rank). ``params`` names the parameter bucket a node touches (UPDATE, ZeRO comm).
    """

    kind: Kind
    region: str
    stage: int
    microbatch: int | None = None
    qual: str = ""
    devices: tuple[int, ...] = ()
    stream: str = "compute"
    tags: dict[str, Any] = field(default_factory=dict)
    peer: str | None = None
    bytes: int = 0
    bucket: int | None = None
    phase: str | None = None  # which pass it serves: "F"/"B" (per microbatch) or "step"
    axis: str | None = None  # collectives: the rank-grid axis that forms their groups

    @property
    def per_microbatch(self) -> bool:
        if self.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW):
            return True
        return self.phase in ("F", "B")

    @functools.cached_property
    def key(self) -> str:
        """The printable key; kind, region, microbatch and qual never change after creation."""
        return format_key(self.region, self.kind, self.microbatch, self.qual)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __repr__(self) -> str:
        return self.key

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "stage": self.stage, "devices": list(self.devices),
                               "stream": self.stream}
        for name in ("tags", "peer", "bytes", "bucket", "phase", "axis"):
            value = getattr(self, name)
            if value not in (None, {}, 0):
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Node":
        region, kind, mb, qual = parse_key(data["key"])
        return cls(kind=kind, region=region, stage=data["stage"], microbatch=mb, qual=qual,
                   devices=tuple(data["devices"]), stream=data["stream"], tags=data.get("tags", {}),
                   peer=data.get("peer"), bytes=data.get("bytes", 0), bucket=data.get("bucket"),
                   phase=data.get("phase"), axis=data.get("axis"))
