"""A pipeline-only plan as ``torch.distributed.pipelining``'s action CSV.

One row per pipeline rank, its compute actions in the plan's order, each ``{stage}{type}{mb}``
as torch writes them (``_Action``): ``F`` forward, ``B`` full backward, ``I`` / ``W`` the
input- and weight-gradient passes of a split backward. A BI the plan runs whole (fused with
its weight pass) is one ``B``, and its BW is not written; a B the runtime splits around its
sends is one ``B``; UPDATE is not an action there. torch's own schedule validation and
simulation accept it (``tests/test_pipeline_csv.py``); :func:`piper_plugin.recipes.
order_from_pipeline_csv` reads such a file back as an order overlay.

Invariant: only plans whose grid is pipeline-only (dp = ep = 1) and whose regions are whole
stages (one region per stage) are written; anything else raises ``ValueError`` saying which.
"""
from __future__ import annotations

import csv
import io

from piper_plugin.ir.nodes import Kind, format_key
from piper_plugin.scheduler.plan import Plan

__all__ = ["pipeline_csv"]

_ACTION = {Kind.F: "F", Kind.B: "B", Kind.BI: "I", Kind.BW: "W"}


def pipeline_csv(plan: Plan) -> str:
    """The plan's compute order per pipeline rank as torch's compute-only action CSV."""
    g, dag = plan.grid, plan.dag
    if g.dp * g.ep != 1:
        raise ValueError(f"only pipeline-only plans have a torch.distributed.pipelining CSV; this grid is "
                         f"pp={g.pp} dp={g.dp} ep={g.ep}")
    stages: dict[int, list[str]] = {}
    for name, region in dag.regions.items():
        stages.setdefault(region.stage, []).append(name)
    split = sorted(s for s, names in stages.items() if len(names) > 1)
    if split:
        raise ValueError(f"stage {split[0]} is run as several regions {stages[split[0]]}: torch's actions name "
                         f"whole stages")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in plan.ranks:
        fused_bw = {format_key(dag.nodes[k].region, Kind.BW, dag.nodes[k].microbatch) for k in rank.fused}
        row = []
        for key in rank.streams.get("compute", []):
            node = dag.nodes[key]
            if node.kind not in _ACTION or key in fused_bw:
                continue
            kind = "B" if key in rank.fused else _ACTION[node.kind]
            row.append(f"{node.stage}{kind}{node.microbatch}")
        writer.writerow(row)
    return out.getvalue()
