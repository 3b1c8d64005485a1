"""Overlap blocks in a measured timeline: did one member's communication run under another's compute?

An overlap block (``order`` with ``{"overlap": [...]}``, DualPipeV's forward/backward pairs)
holds several *members*, each one stage's pass over one microbatch (its forward pieces, or its
backward pieces). :func:`overlap_blocks` lists, for one rank of a plan, every block's members
with their compute tasks and the communication tasks of the same stage, microbatch and pass
(expert all-to-alls, pipeline messages). :func:`block_overlap` reads a measured timeline
(``(stream, task, start, end)``, as ``Executor.runner.timeline`` records it) against them: per
member, the seconds its communication took and how many of them ran while another member of
its block computed on that rank. Readers only: JSON-ready inputs and outputs.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from piper_plugin.train_report import covered_seconds

__all__ = ["overlap_blocks", "block_overlap"]


def overlap_blocks(plan, rank: int, kinds: Iterable[str] = ("ALL_TO_ALL",)) -> list[list[dict[str, Any]]]:
    """The overlap blocks of plan rank ``rank``: per block, its members as ``{"stage", "mb",
    "pass", "compute": [task keys], "comm": [task keys]}``, ``comm`` holding this rank's tasks of
    the ``kinds`` given (node kind names) that serve the member's stage, microbatch and pass."""
    tasks = plan.ranks[rank].tasks()
    mine = set(tasks)
    comm_of: dict[tuple[int, int | None, str | None], list[str]] = {}
    kinds = set(kinds)
    for key in tasks:
        node = plan.node(key)
        if node.kind.value in kinds:
            comm_of.setdefault((node.stage, node.microbatch, node.phase), []).append(key)
    blocks = []
    for block in plan.dag.meta.overlaps:
        members: dict[tuple[int, int | None, str], dict[str, Any]] = {}
        for key in block:
            if key not in mine:
                continue
            node = plan.node(key)
            phase = "F" if node.kind.value == "F" else "B"
            member = members.setdefault((node.stage, node.microbatch, phase), {
                "stage": node.stage, "mb": node.microbatch, "pass": phase, "compute": [],
                "comm": list(comm_of.get((node.stage, node.microbatch, phase), []))})
            member["compute"].append(key)
        if len(members) > 1:
            blocks.append(list(members.values()))
    return blocks


def block_overlap(blocks: Sequence[Sequence[dict[str, Any]]],
                  timeline: Iterable[Sequence[Any]]) -> list[list[dict[str, Any]]]:
    """Per block and member: ``{"stage", "mb", "pass", "comm_s", "hidden_s"}``, ``comm_s`` the
    seconds of the member's communication tasks, ``hidden_s`` the part of them during which a
    compute task of another member of the block ran (intervals intersected, each second
    counted once)."""
    spans: dict[str, tuple[float, float]] = {key: (start, end) for _, key, start, end in timeline}
    out = []
    for block in blocks:
        rows = []
        for member in block:
            others = sorted(spans[k] for m in block if m is not member for k in m["compute"] if k in spans)
            comm = [spans[k] for k in member["comm"] if k in spans]
            rows.append({"stage": member["stage"], "mb": member["mb"], "pass": member["pass"],
                         "comm_s": sum(e - s for s, e in comm),
                         "hidden_s": sum(covered_seconds(s, e, others) for s, e in comm)})
        out.append(rows)
    return out
