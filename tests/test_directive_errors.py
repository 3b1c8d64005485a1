"""Invariant 3: a directive that cannot apply fails at once, naming itself, its filter and why."""
import pytest
import torch

from piper_plugin import annotate_modules, capture
from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.schedule import Schedule
from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss, toy_sequential
from piper_plugin.recipes import apply_recipe


def _program(stages=2, moe=False, batch=8):
    with torch.device("meta"):
        model, cfg = (build_toy_moe if moe else build_toy_lm)(stages=stages, layers=stages)
    x, y = lm_batch(cfg, batch)
    return capture(model, lm_loss, (x,), y)


@pytest.fixture(scope="module")
def lm():
    return _program()


@pytest.fixture(scope="module")
def moe():
    return _program(moe=True)


def _placed(program, pp=2, dp=1, ep=1):
    sch = Schedule(program, pp=pp, dp=dp, ep=ep)
    stages = sorted({r.stage for r in program.regions.values()})
    for s in stages:
        sch.place(f"PP={s}", rank=s * pp // len(stages))
    return sch


def expect_error(fn, *words):
    with pytest.raises(DirectiveError) as info:
        fn()
    text = str(info.value)
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    return text


def test_unknown_tag(lm):
    expect_error(lambda: Schedule(lm, pp=2).place("STAGE=0", rank=0), "place('STAGE=0')", "unknown tag 'STAGE'", "Fix")


def test_filter_matches_nothing(lm):
    expect_error(lambda: Schedule(lm, pp=2).place("PP=7", rank=0), "place('PP=7')", "matches no region", "PP=0")


def test_region_already_placed(lm):
    sch = Schedule(lm, pp=2).place("PP=0", rank=0)
    expect_error(lambda: sch.place("PP=*", rank=1), "place('PP=*')", "region 0 is already placed")


def test_rank_out_of_range(lm):
    expect_error(lambda: Schedule(lm, pp=2).place("PP=1", rank=2), "place('PP=1')", "rank 2 is out of range for pp=2", "0..1")


def test_negative_rank(lm):
    expect_error(lambda: Schedule(lm, pp=2).place("PP=1", rank=-1), "out of range")


def test_unplaced_regions_before_split(lm):
    sch = Schedule(lm, pp=2).place("PP=0", rank=0)
    expect_error(lambda: sch.split(2), "split", "regions ['1'] are not placed", "place every region")


def test_split_not_dividing_batch(lm):
    expect_error(lambda: _placed(lm).split(3), "split(3)", "batch 8 is not divisible by 3 microbatches")


def test_split_with_data_parallel_shards(lm):
    expect_error(lambda: _placed(lm, dp=2).replicate("*").split(8), "split(8)", "x 2 data shards")


def test_split_twice(lm):
    sch = _placed(lm).split(2)
    expect_error(lambda: sch.split(4), "split(4)", "already split")


def test_place_after_split(lm):
    sch = _placed(lm).split(2)
    expect_error(lambda: sch.place("PP=0", rank=0), "place('PP=0')", "placement is closed")


def test_replicate_bad_zero_level(lm):
    expect_error(lambda: _placed(lm, dp=2).replicate("*", zero=4), "replicate('*')", "zero=4 is not a ZeRO level", "0, 1, 2 or 3")


def test_replicate_bad_bucket(lm):
    expect_error(lambda: _placed(lm, dp=2).replicate("*", bucket_bytes=0), "bucket_bytes=0 must be a positive int")


def test_zero3_of_a_weight_two_regions_of_one_rank_read():
    """Tied embeddings with both stages on one pipeline rank: ZeRO-3 would free the weight
    between its two readers (found by test_fuzz_strategies); ZeRO-2 keeps it whole."""
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=2, layers=2, tie_embeddings=True)
    x, y = lm_batch(cfg, 8)
    program = capture(model, lm_loss, (x,), y)
    sch = Schedule(program, pp=1, dp=2).place("*", rank=0)
    expect_error(lambda: sch.replicate("*", zero=3), "replicate('*')", "also reads on the same pipeline rank",
                 "use zero=2 or lower")
    Schedule(program, pp=1, dp=2).place("*", rank=0).replicate("*", zero=2)


def test_replicate_twice(lm):
    sch = _placed(lm, dp=2).replicate("PP=0")
    expect_error(lambda: sch.replicate("*"), "region 0 is already replicated")


def test_missing_replicate_is_caught(lm):
    expect_error(lambda: _placed(lm, dp=2).split(2), "split", "not reduced over its 2 replicas", "replicate")


def test_order_before_split(lm):
    expect_error(lambda: _placed(lm).order("0F", "1F"), "order", "not split yet", "split(microbatches=N)")


def test_order_creating_cycle(lm):
    sch = _placed(lm).split(2)
    expect_error(lambda: sch.order("1F0", "0F0"), "order", "cycle", "0F0", "1F0")
    assert sch.dag.topological_order()  # the failed order left the DAG as it was


def test_order_unknown_node(lm):
    expect_error(lambda: _placed(lm).split(2).order("0F9", "1F0"), "order", "matches no node")


def test_order_per_rank_stray_node(lm):
    sch = _placed(lm).split(2)
    expect_error(lambda: sch.order_per_rank({0: ["0F0", "1F0"]}), "node 1F0 is not on pipeline rank 0")


def test_stream_matches_nothing(lm):
    expect_error(lambda: _placed(lm).split(2).stream("kind=ALL_REDUCE", "dp_comm"), "stream('kind=ALL_REDUCE')", "matches no node")


def test_stream_moves_a_send_with_its_receive(lm):
    sch = _placed(lm).split(2).stream("kind=SEND", "wire")
    assert {n.stream for n in sch.dag if n.kind.value in ("SEND", "RECV")} == {"wire"}


def test_stream_name_is_checked(lm):
    expect_error(lambda: _placed(lm).split(2).stream("kind=F", ""), "stream('kind=F')", "stream name '' is invalid")


def test_shard_without_ep(moe):
    expect_error(lambda: _placed(moe).shard("EP=experts"), "shard('EP=experts')", "ep=1", "--ep 2")


def test_shard_non_expert_region(moe):
    expect_error(lambda: _placed(moe, ep=2).shard("region=0.0"), "shard('region=0.0')", "leading expert dimension")


def test_shard_degree_mismatch(moe):
    expect_error(lambda: _placed(moe, ep=2).shard("EP=experts", degree=4), "degree 4 differs from the grid's ep=2")


def test_replicate_expert_before_shard(moe):
    expect_error(lambda: _placed(moe, ep=2).replicate("*"), "expert region", "apply shard('EP=...') before replicate")


def test_recipe_stage_count_mismatch(lm):
    expect_error(lambda: apply_recipe(Schedule(lm, pp=4), "1f1b", microbatches=4), "1f1b", "2 PP stages", "pp x chunks = 4")


def test_interleaved_microbatches_not_multiple_of_pp():
    program = _program(stages=4, batch=6)
    expect_error(lambda: apply_recipe(Schedule(program, pp=2), "interleaved-1f1b", microbatches=3), "interleaved-1f1b")


def test_unknown_recipe(lm):
    expect_error(lambda: apply_recipe(Schedule(lm, pp=2), "2f2b", microbatches=2), "unknown recipe", "1f1b")


def test_annotate_modules_pattern_typo():
    model = toy_sequential()
    with pytest.raises(KeyError, match="pattern 'lyr.0' matches no submodule"):
        annotate_modules(model, {"lyr.0": {"PP": 0}})


def test_grid_rejects_zero_pp(lm):
    with pytest.raises(ValueError, match="--pp must be a positive integer"):
        Schedule(lm, pp=0)
