"""Overlap blocks in plans and timelines (``piper_plugin.overlap_report``), and the scheduler's
ordering of an overlap block's exchanges: each rank's all-to-alls follow its compute, so with
exchanges that take time, DualPipeV with expert parallelism hides each member's all-to-all
under the other member's compute (simulated here; measured in ``test_torchtitan_ep.py``)."""
import pickle

import pytest
import torch

from piper_plugin import Schedule, block_overlap, build_plan, capture, overlap_blocks, simulate
from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe, stages_needed
from piper_plugin.scheduler.cost import CostModel


def test_block_overlap_counts_each_second_once():
    blocks = [[{"stage": 0, "mb": 1, "pass": "F", "compute": ["a0", "a1"], "comm": ["x"]},
               {"stage": 3, "mb": 0, "pass": "B", "compute": ["b0", "b1"], "comm": ["y"]}]]
    timeline = [("compute", "a0", 0.0, 1.0), ("ep", "x", 1.0, 3.0), ("compute", "b0", 1.0, 2.0),
                ("compute", "b1", 1.5, 2.5),  # overlaps b0: counted once
                ("compute", "a1", 3.0, 4.0), ("ep", "y", 2.5, 4.0)]
    (f, b), = block_overlap(blocks, timeline)
    assert (f["comm_s"], f["hidden_s"]) == (2.0, 1.5)
    assert (b["comm_s"], b["hidden_s"]) == (1.5, 1.0)  # a1 from 3.0; its own b1 does not count


def _moe_schedule(recipe: str) -> Schedule:
    """The toy MoE annotated for ``recipe`` on pp 2 x ep 2, no directive applied yet."""
    stages = stages_needed(recipe, 2)
    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-moe"](stages=stages, layers=stages)
    tokens, targets = lm_batch(cfg, 16)
    return Schedule(capture(model, lm_loss, (tokens,), targets), pp=2, dp=1, ep=2)


def _moe_plan(recipe: str):
    sch = _moe_schedule(recipe)
    return build_plan(apply_recipe(sch, recipe, microbatches=4).dag, sch.grid)


@pytest.fixture(scope="module")
def dualpipev():
    return _moe_plan("dualpipev")


def test_each_ranks_exchanges_follow_its_compute(dualpipev):
    plan = dualpipev
    for rank, rank_plan in enumerate(plan.ranks):
        position = {key: i for i, key in enumerate(rank_plan.streams["compute"])}
        producers = [max(position[p] for p in plan.dag.data_pred[key] if p in position)
                     for key in rank_plan.streams["ep"]]
        assert producers == sorted(producers), rank


def test_dualpipev_hides_each_members_exchange_under_the_other(dualpipev):
    plan = pickle.loads(pickle.dumps(dualpipev))  # as the TorchTitan adapter writes it next to its traces
    assert plan.dag.meta.overlaps
    result = simulate(plan, CostModel(F=1, B=2, BI=1, BW=1, latency=0.5))  # an exchange: half a forward
    for rank in range(plan.grid.world_size):
        blocks = overlap_blocks(plan, rank)
        assert blocks and all(len(block) == 2 for block in blocks)
        timeline = [(stream, key, s, e) for r, stream, key, s, e in result.timeline if r == rank]
        members = [m for block in block_overlap(blocks, timeline) for m in block]
        assert members and all(m["hidden_s"] > 0 for m in members if m["comm_s"] > 0), (rank, members)


def test_without_overlap_blocks_there_is_nothing_to_report():
    plan = _moe_plan("1f1b")
    assert not plan.dag.meta.overlaps
    assert all(overlap_blocks(plan, rank) == [] for rank in range(plan.grid.world_size))


def _pairs_plan(recipe: str, pairs: str):
    """``recipe`` (toy MoE, pp 2 x ep 2, 8 microbatches) with the given overlap pairing."""
    from piper_plugin.recipes import orders, pipeline

    sch = _moe_schedule(recipe)
    chunks = 2 if recipe == "interleaved-1f1b" else 1
    pipeline._prepare(sch, recipe, chunks, "loop", 8, 0, None, False)
    actions = orders.interleaved_1f1b(2, 2, 8) if chunks == 2 else orders.one_f_one_b(2, 8)
    return build_plan(pipeline._apply_orders(sch, actions, False, overlap_pairs=pairs).dag, sch.grid)


@pytest.mark.parametrize("latency", [0.25, 1.0])
def test_block_choices_of_the_1f1b_recipes_pay_off_in_simulation(latency):
    """With exchanges of a quarter to one forward, interleaved 1F1B's backward/forward blocks
    (its recipe's choice with EP) shorten the step; the same blocks lengthen plain 1F1B's (whose
    recipe makes none)."""
    cost = CostModel(F=1, B=2, BI=1, BW=1, latency=latency)
    step = {(recipe, pairs): simulate(_pairs_plan(recipe, pairs), cost).step_time
            for recipe in ("interleaved-1f1b", "1f1b") for pairs in ("", "BF")}
    assert step["interleaved-1f1b", "BF"] < step["interleaved-1f1b", ""]
    assert step["1f1b", "BF"] > step["1f1b", ""]
