"""Plan export: text grid, Chrome trace, timeline picture (piper_plugin/scheduler/export.py)."""
from __future__ import annotations

import json

import pytest
import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe, stages_needed
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.export import chrome_trace, plan_grid_text, timeline_png
from piper_plugin.scheduler.plan import build_plan
from piper_plugin.scheduler.simulate import simulate


def _plan(recipe: str, pp: int = 2, m: int = 4, dp: int = 1, zero: int = 0):
    stages = stages_needed(recipe, pp, 2)
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=stages, layers=max(stages, 2))
    tokens, targets = lm_batch(cfg, m * dp * 2)
    sch = Schedule(capture(model, lm_loss, (tokens,), targets), pp=pp, dp=dp)
    apply_recipe(sch, recipe, microbatches=m, zero=zero)
    return build_plan(sch.dag, sch.grid)


@pytest.fixture(scope="module")
def one_f_one_b():
    plan = _plan("1f1b")
    return plan, simulate(plan, CostModel.uniform())


@pytest.fixture(scope="module")
def zero3():
    plan = _plan("zb-h1", dp=2, zero=3)
    return plan, simulate(plan, CostModel.uniform())


def _compute_keys(plan) -> set[str]:
    return {k for r in range(plan.grid.world_size) for k in plan.compute_sequence(r)}


def _cells(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[1:]]


def test_grid_lists_every_compute_key_in_task_order(one_f_one_b):
    plan, _ = one_f_one_b
    text = plan_grid_text(plan)
    keys = _compute_keys(plan)
    assert keys and all(k in text for k in keys)
    rows = _cells(text)
    assert rows[0] == ["step", "00", "0F0", "1F0"]  # k-th compute task of each rank
    assert len(rows) == max(len(plan.compute_sequence(r)) for r in range(2))


def test_grid_aligns_uniform_costs_to_time_slots(one_f_one_b):
    plan, result = one_f_one_b
    text = plan_grid_text(plan, result)
    assert all(k in text for k in _compute_keys(plan))
    rows = {r[0]: r[1:] for r in _cells(text)}
    assert rows["t=0"] == ["0F0"]  # rank 1 idles while rank 0 runs the first forward
    assert rows["t=1"] == ["0F1", "1F0"]
    assert rows["t=2"] == ["1B0"] and rows["t=3"][-1] == "|"  # B takes 2 slots
    assert f"t={result.step_time:g}" in rows  # zero-time UPDATE ends the step


def test_grid_falls_back_to_task_order_for_non_uniform_costs(one_f_one_b):
    plan, _ = one_f_one_b
    result = simulate(plan, CostModel(F=1.0, B=2.3, BI=1.1, BW=1.2, latency=0.37))
    text = plan_grid_text(plan, result)
    assert text.splitlines()[1].startswith("step 00")
    assert all(k in text for k in _compute_keys(plan))


def test_grid_merges_identical_replicas(zero3):
    plan, result = zero3
    text = plan_grid_text(plan, result)
    assert text.splitlines()[0].split() == ["ranks", "0-1", "ranks", "2-3"]
    assert all(k in text for k in _compute_keys(plan))
    assert "BI" in text and "BW" in text


def test_chrome_trace_has_one_complete_event_per_task(zero3):
    plan, result = zero3
    trace = json.loads(json.dumps(chrome_trace(plan, result)))  # valid JSON
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(result.timeline)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    for event, (rank, stream, key, start, end) in zip(complete, result.timeline):
        assert (event["name"], event["pid"]) == (key, rank)
        assert names[(rank, event["tid"])] == stream == event["args"]["stream"]
        assert event["ts"] == pytest.approx(start * 1e6) and event["dur"] == pytest.approx((end - start) * 1e6)
        assert event["args"]["kind"] == plan.node(key).kind.value
        assert event["args"]["microbatch"] == plan.node(key).microbatch
    kinds = {e["args"]["kind"] for e in complete}
    assert {"F", "BI", "BW", "ALL_GATHER", "REDUCE_SCATTER", "SEND", "RECV"} <= kinds


def test_timeline_png_is_written(zero3, tmp_path):
    plan, result = zero3
    path = timeline_png(plan, result, tmp_path / "t.png", title="zb-h1 test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_picture_kinds_stay_apart_and_boxes_carry_full_keys():
    """Every compute fill (kind x first/later chunk) is far from every other (DualPipeV draws all
    ten); a box shows its full key where it fits, else its microbatch, else nothing."""
    from itertools import combinations

    from piper_plugin.ir.nodes import Kind
    from piper_plugin.scheduler.export import _CHUNK_LIGHTER, KIND_COLORS, _lighter, box_label

    def rgb(color):
        return [int(color[i:i + 2], 16) for i in (1, 3, 5)]

    fills = [_lighter(KIND_COLORS[k], _CHUNK_LIGHTER * c)
             for k in (Kind.F, Kind.B, Kind.BI, Kind.BW, Kind.UPDATE) for c in (0, 1)]
    for a, b in combinations(fills, 2):
        assert sum((x - y) ** 2 for x, y in zip(rgb(a), rgb(b))) ** 0.5 > 60, (a, b)
    assert box_label("1.1BI3", 3, width_px=60, char_px=5) == "1.1BI3"
    assert box_label("1.1BI3", 3, width_px=20, char_px=5) == "3"
    assert box_label("1.1BI3", 3, width_px=5, char_px=5) == ""
