"""order: temporal edges between groups of nodes, one chain per call or per rank.

Every node of group k precedes every node of group k+1. An *overlap* group (two or more
nodes issued together, e.g. DualPipeV's forward of one microbatch with the backward of
another) behaves as one block: each member waits for all inputs of the group and the
group's consumers wait for all members. The pass adds edges only; it never removes a data
dependency, so a cycle means the requested order contradicts the model or an earlier order.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from piper_plugin.ir.graph import DAG

__all__ = ["chain", "overlap_block"]


def chain(dag: DAG, groups: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """Temporal edges group[k] -> group[k+1]; returns the edges added (for roll-back)."""
    added = []
    for before, after in zip(groups, groups[1:]):
        for a in before:
            for b in after:
                if b not in dag.temporal_succ[a] and b not in dag.data_succ[a]:
                    dag.add_temporal(a, b)
                    added.append((a, b))
    return added


def overlap_block(dag: DAG, members: Iterable[str]) -> list[tuple[str, str]]:
    """Make ``members`` start together and finish together (block semantics)."""
    group = set(members)
    inner = _inner_comm(dag, group)
    block = group | inner
    inputs = {p for m in block for p in dag.preds(m) if p not in block}
    outputs = {s for m in block for s in dag.succs(m) if s not in block}
    added = []
    for m in group:
        for p in inputs:
            if m not in dag.temporal_succ[p] and m not in dag.data_succ[p]:
                dag.add_temporal(p, m)
                added.append((p, m))
        for s in outputs:
            if s not in dag.temporal_succ[m] and s not in dag.data_succ[m]:
                dag.add_temporal(m, s)
                added.append((m, s))
    return added


def _inner_comm(dag: DAG, group: set[str]) -> set[str]:
    """Comm nodes between two members (e.g. an expert all-to-all inside one stage's chunks)."""
    inner: set[str] = set()
    frontier = [s for m in group for s in dag.succs(m) if s not in group and not dag.nodes[s].is_compute]
    while frontier:
        key = frontier.pop()
        if key in inner or not any(s in group for s in dag.succs(key)):
            continue
        inner.add(key)
    return inner


def roll_back(dag: DAG, edges: list[tuple[str, str]]) -> None:
    for a, b in edges:
        dag.temporal_succ[a].discard(b)
        dag.temporal_pred[b].discard(a)
