"""Textbook bubbles of the pipeline recipes (PIPER.md's reference formulas), for reports.

p = pipeline ranks, m = microbatches, v = stages per rank; F, B (full backward) and W (its
weight half) are one microbatch's mean stage costs under the cost model used.
"""
from __future__ import annotations

from piper_plugin.ir.nodes import Kind

__all__ = ["textbook_bubble", "stage_costs"]


def stage_costs(plan, cost) -> tuple[float, float, float]:
    """Mean over stages of one microbatch's F, full B (= BI + BW) and W (= BW) time."""
    per: dict[int, dict[str, float]] = {}
    for node in plan.dag.nodes.values():
        if node.is_compute and node.microbatch == 0:
            d = per.setdefault(node.stage, {"F": 0.0, "B": 0.0, "W": 0.0})
            t = cost.compute(plan.dag, node)
            d["F" if node.kind == Kind.F else "B"] += t
            d["W"] += t if node.kind == Kind.BW else 0.0
    n = max(len(per), 1)
    return tuple(sum(d[k] for d in per.values()) / n for k in "FBW")  # type: ignore[return-value]


def textbook_bubble(name: str, plan, cost, stages: int) -> str:
    """The PIPER.md reference value for recipe ``name``, stated with its formula ("" if none)."""
    p, m = plan.grid.pp, plan.microbatches
    if name in ("gpipe", "1f1b"):
        return f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {(p - 1) / (m + p - 1):.1%}"
    if name == "interleaved-1f1b":
        v = stages // p
        return f"(p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1} = {(p - 1) / (v * m + p - 1):.1%}"
    if name not in ("zb-h1", "dualpipev"):
        return ""
    F, B, W = stage_costs(plan, cost)
    if name == "zb-h1":
        idle, busy, formula = (p - 1) * (F + B - 2 * W), m * (F + B), "(p-1)(F+B-2W)"
    else:  # p stages-pairs on p ranks: PIPER.md's (P/2-1) with P = 2p stages; F&B = F+B here
        idle, busy, formula = (p - 1) * ((F + B) + B - 3 * W), 2 * m * (F + B), "(p-1)(F&B+B-3W), F&B=F+B"
    fraction = idle / (idle + busy) if idle + busy else 0.0
    return f"idle {formula} = {idle:.4g} per rank = {fraction:.1%}"
