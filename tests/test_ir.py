"""Printable node keys, JSON round trips of nodes, DAGs and directive traces; the validator."""
import json

import pytest
import torch
from hypothesis import given, strategies as st

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.nodes import Kind, Node, format_key, parse_key
from piper_plugin.ir.validate import ValidationError, validate
from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss
from piper_plugin.recipes import RECIPES, apply_recipe, stages_needed

regions = st.builds(lambda s, k: f"{s}" if k is None else f"{s}.{k}", st.integers(0, 99), st.none() | st.integers(0, 9))
quals = st.just("") | st.from_regex(r"[A-Za-z0-9.<>_]{1,8}", fullmatch=True)


@given(regions, st.sampled_from(list(Kind)), st.none() | st.integers(0, 999), quals)
def test_key_round_trip(region, kind, mb, qual):
    assert parse_key(format_key(region, kind, mb, qual)) == (region, kind, mb, qual)


def test_keys_read_like_the_field():
    assert format_key("2", Kind.F, 0) == "2F0"
    assert parse_key("1.1BI3") == ("1.1", Kind.BI, 3, "")
    assert parse_key("0SEND1@F>1") == ("0", Kind.SEND, 1, "F>1")
    with pytest.raises(ValueError, match="not a node name"):
        parse_key("F0")


def test_node_json_round_trip():
    node = Node(Kind.ALL_GATHER, "3", 3, 5, "F.b0", (4, 5), "dp", {"PP": 3}, bytes=96, bucket=0, phase="F", axis="data")
    again = Node.from_json(json.loads(json.dumps(node.to_json())))
    assert again.to_json() == node.to_json() and again.key == "3ALL_GATHER5@F.b0"


def _program(moe=False, stages=2):
    with torch.device("meta"):
        model, cfg = (build_toy_moe if moe else build_toy_lm)(stages=stages, layers=stages)
    x, y = lm_batch(cfg, 16)
    return capture(model, lm_loss, (x,), y)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_trace_replays_to_the_same_dag(recipe):
    program = _program(stages=stages_needed(recipe, 2))
    sch = Schedule(program, pp=2, dp=2)
    apply_recipe(sch, recipe, microbatches=4, zero=3)
    sch.stream("kind=ALL_GATHER", "zero_prefetch")
    text = sch.dumps()
    again = Schedule.from_json(program, json.loads(text))
    assert again.dag.canonical() == sch.dag.canonical()
    assert again.dumps() == text


def test_trace_with_expert_parallelism_replays():
    program = _program(moe=True)
    sch = Schedule(program, pp=2, ep=2)
    apply_recipe(sch, "1f1b", microbatches=2, zero=1)
    assert Schedule.from_json(program, sch.dumps()).dag.canonical() == sch.dag.canonical()


def test_dag_json_is_complete():
    program = _program()
    sch = Schedule(program, pp=2)
    apply_recipe(sch, "1f1b", microbatches=2)
    data = sch.dag.to_json()
    assert len(data["nodes"]) == len(sch.dag)
    assert len(data["data"]) + len(data["temporal"]) == sch.dag.num_edges()


def test_passes_record_meta_on_their_own_copy():
    """Schedule, place, replicate and split write the schedule's DAG meta, never the program's;
    DAG.copy gives the copy its own maps."""
    program = _program()
    captured = program.dag.meta.copy()
    assert captured.param_bytes and captured.loss_region and captured.inputs
    sch = Schedule(program, pp=2, dp=2)
    apply_recipe(sch, "1f1b", microbatches=2, zero=1)
    meta = sch.dag.meta
    assert meta.grid == sch.grid and meta.microbatches == 2 and not meta.split_backward
    assert set(meta.placement) == set(program.regions) and set(meta.replicated) == set(program.regions)
    assert program.dag.meta == captured
    assert program.dag.meta.placement == {} and program.dag.meta.microbatches is None
    copy = sch.dag.copy()
    copy.meta.placement["extra"] = 0
    copy.meta.sharded["extra"] = 2
    assert "extra" not in meta.placement and "extra" not in meta.sharded


def _split_schedule():
    sch = Schedule(_program(), pp=2)
    apply_recipe(sch, "gpipe", microbatches=2)
    return sch


def test_validator_catches_a_missing_peer():
    sch = _split_schedule()
    send = next(n for n in sch.dag if n.kind == Kind.SEND)
    send.peer = "9RECV0@F<8"
    with pytest.raises(ValidationError, match="no matching peer"):
        validate(sch.dag, sch.grid)


def test_validator_catches_a_cycle():
    sch = _split_schedule()
    sch.dag.add_temporal("1B0", "0F0")
    with pytest.raises(ValidationError, match="cycle"):
        validate(sch.dag, sch.grid)


def test_validator_catches_a_lost_activation():
    sch = _split_schedule()
    recv = next(k for k, n in sch.dag.nodes.items() if n.kind == Kind.RECV and n.phase == "F")
    (consumer,) = sch.dag.data_succ[recv]
    sch.dag.remove_data(recv, consumer)
    with pytest.raises(ValidationError, match="needs values"):
        validate(sch.dag, sch.grid)


def test_validator_catches_a_double_reduction():
    sch = Schedule(_program(), pp=2, dp=2)
    apply_recipe(sch, "1f1b", microbatches=2, zero=0)
    sch.dag.add_data("0B0", "1ALL_REDUCE@b0", ("grads",))
    with pytest.raises(ValidationError, match="exactly one"):
        validate(sch.dag, sch.grid)
