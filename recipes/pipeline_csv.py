"""Read ``torch.distributed.pipelining``'s action CSV as an order overlay on a Schedule.

Row ``r`` is pipeline rank ``r``'s compute actions (``{stage}{F|B|I|W}{mb}``; an OVERLAP_F_B
group is read as its two compute actions, in order; communication, resharding and
gradient-reduction actions are left to the plan). Each becomes the node of that stage, kind
and microbatch (``I`` the input-gradient pass BI, ``W`` the weight pass BW; ``B`` a full backward, or BI then BW where the schedule's
split made the backward two passes), chained per rank by ``order_per_rank``. The placement,
replication and split come from the schedule it is applied to: the CSV only orders.
"""
from __future__ import annotations

import csv
import io
import re

from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.schedule import Schedule

__all__ = ["order_from_pipeline_csv"]

_COMPUTE = re.compile(r"(\d+)(F|B|I|W)(\d+)")
_NOT_COMPUTE = re.compile(r"SEND_|RECV_|UNSHARD|RESHARD|REDUCE_GRAD")
_KIND = {"F": "F", "I": "BI", "W": "BW"}


def order_from_pipeline_csv(sch: Schedule, text: str) -> Schedule:
    """Apply the CSV's per-rank compute order to ``sch`` (placed, replicated and split)."""
    split_backward = any(n.kind.value == "BI" for n in sch.dag.nodes.values())
    rows = [row for row in csv.reader(io.StringIO(text))]
    if len(rows) != sch.grid.pp:
        raise DirectiveError("order_from_pipeline_csv", f"{len(rows)} rows",
                             f"the CSV has {len(rows)} rows and the schedule {sch.grid.pp} pipeline ranks",
                             "write one row per pipeline rank")
    chains: dict[int, list[list[str]]] = {}
    for rank, row in enumerate(rows):
        chain = chains.setdefault(rank, [])
        for cell in row:
            if _NOT_COMPUTE.search(cell):
                continue
            for stage, kind, mb in _COMPUTE.findall(cell):  # an OVERLAP_F_B cell holds two
                if kind == "B" and split_backward:
                    chain += [[f"stage={stage},kind=BI,mb={mb}"], [f"stage={stage},kind=BW,mb={mb}"]]
                elif kind in "IW" and not split_backward:
                    raise DirectiveError("order_from_pipeline_csv", cell,
                                         "the CSV splits backwards (I and W) and the schedule's split() did not",
                                         "split(microbatches=..., split_backward=True) before applying it")
                else:
                    chain.append([f"stage={stage},kind={_KIND.get(kind, kind)},mb={mb}"])
    return sch.order_per_rank(chains)  # recorded as order_per_rank: a trace replays it as such
