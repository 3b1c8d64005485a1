"""Plans interoperate with ``torch.distributed.pipelining``: a pipeline-only Piper plan written as
torch's action CSV passes torch's own schedule validation and its comms-and-compute simulation
(no deadlock), and the CSV read back as an order overlay on the same placement gives the same
per-rank order, hence the same grid."""
from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from piper_plugin.api.schedule import Schedule
from piper_plugin.compiler import compile_program
from piper_plugin.ir.capture import capture
from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
from piper_plugin.recipes import load, order_from_pipeline_csv
from piper_plugin.scheduler.export import plan_grid_text
from piper_plugin.scheduler.pipeline_csv import pipeline_csv

PP, M = 2, 4


def _compiled(recipe: str, chunks: int = 2, dp: int = 1):
    r = load(recipe)
    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-lm"](stages=r.stages(PP, chunks), layers=4)
    tokens, targets = lm_batch(cfg, 8 * dp)
    program = capture(model, lm_loss, (tokens,), targets)
    return program, compile_program(program, lambda p: r.schedule(p, pp=PP, dp=dp, microbatches=M, zero=0,
                                                                  chunks=chunks))


def _torch_actions(text: str) -> dict[int, list]:
    return {rank: [torch_schedules._Action.from_str(a) for a in line.split(",")]
            for rank, line in enumerate(text.strip().splitlines())}


@pytest.mark.parametrize("recipe", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b",
                                    pytest.param("interleaved-1f1b", marks=pytest.mark.slow),
                                    pytest.param("zb-h1", marks=pytest.mark.slow), "dualpipev"])
def test_a_plan_as_torch_csv_validates_simulates_and_reads_back_to_the_same_grid(recipe):
    program, compiled = _compiled(recipe)
    plan = compiled.plan
    text = pipeline_csv(plan)
    stages = len(program.regions)
    actions = _torch_actions(text)
    assert sum(len(a) for a in actions.values()) >= 2 * stages * M  # every F and every backward
    stage_to_rank = torch_schedules._validate_schedule(actions, PP, stages, M)  # torch's own check
    assert stage_to_rank == {s: plan.dag.meta.placement[name] for s, name in enumerate(program.regions)}
    with_comms = torch_schedules._add_send_recv(actions, lambda s: stage_to_rank[s], stages)
    torch_schedules._simulate_comms_compute(with_comms, lambda s: stage_to_rank[s], stages)  # raises on deadlock

    trace = json.loads(compiled.schedule.dumps())  # the same placement, replication and split; no order
    trace["directives"] = [d for d in trace["directives"] if not d["directive"].startswith("order")]
    again = compile_program(program, lambda p: order_from_pipeline_csv(Schedule.from_json(p, trace), text)).plan
    for mine, theirs in zip(plan.ranks, again.ranks):
        assert mine.streams["compute"] == theirs.streams["compute"], mine.rank
    assert plan_grid_text(again) == plan_grid_text(plan)


def test_what_has_no_csv_says_why():
    _, compiled = _compiled("1f1b", dp=2)
    with pytest.raises(ValueError, match="only pipeline-only plans.*pp=2 dp=2"):
        pipeline_csv(compiled.plan)
