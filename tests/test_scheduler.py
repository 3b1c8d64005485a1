"""Invariant 2: plans are deadlock-free by construction and checked before running."""
import pytest
import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.nodes import COLLECTIVES, Kind
from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss
from piper_plugin.recipes import RECIPES, apply_recipe, stages_needed
from piper_plugin.scheduler.plan import build_plan
from piper_plugin.scheduler.simulate import DeadlockError, simulate


def _plan(recipe="1f1b", pp=2, dp=1, ep=1, m=4, zero=0, moe=False):
    stages = stages_needed(recipe, pp)
    with torch.device("meta"):
        model, cfg = (build_toy_moe if moe else build_toy_lm)(stages=stages, layers=stages)
    x, y = lm_batch(cfg, 2 * m * dp * ep)
    sch = Schedule(capture(model, lm_loss, (x,), y), pp=pp, dp=dp, ep=ep)
    apply_recipe(sch, recipe, microbatches=m, zero=zero)
    return build_plan(sch.dag, sch.grid)


CASES = [(r, 4, 1, 1, 8, 0, False) for r in sorted(RECIPES)] + [
    ("interleaved-1f1b", 2, 2, 1, 4, 3, False), ("dualpipev", 2, 2, 1, 4, 2, False),
    ("zb-h1", 2, 1, 2, 4, 1, True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-pp{c[1]}-dp{c[2]}-ep{c[3]}-z{c[5]}")
def plan(request):
    return _plan(*request.param)


def test_p2p_sends_and_receives_match_in_order(plan):
    dag, grid = plan.dag, plan.grid
    for rank, rp in enumerate(plan.ranks):
        for stream, keys in rp.streams.items():
            sends = [k for k in keys if dag.nodes[k].kind == Kind.SEND]
            if not sends:
                continue
            dst = grid.peer(rank, dag.meta.placement[dag.nodes[dag.nodes[sends[0]].peer].region])
            recvs = [k for k in plan.ranks[dst].streams[stream] if dag.nodes[k].kind == Kind.RECV]
            assert [dag.nodes[k].peer for k in sends] == recvs


def test_collectives_issued_in_the_same_order_by_every_member(plan):
    dag, grid = plan.dag, plan.grid
    for rank, rp in enumerate(plan.ranks):
        for stream, keys in rp.streams.items():
            for key in keys:
                node = dag.nodes[key]
                if node.kind not in COLLECTIVES:
                    continue
                group = next(g for g in grid.groups(node.axis, node.devices) if rank in g)
                mine = [k for k in keys if dag.nodes[k].kind in COLLECTIVES and set(group) <= set(dag.nodes[k].devices)]
                for other in group:
                    theirs = [k for k in plan.ranks[other].streams[stream]
                              if dag.nodes[k].kind in COLLECTIVES and set(group) <= set(dag.nodes[k].devices)]
                    assert mine == theirs
                break


def test_every_plan_simulates_to_completion(plan):
    result = simulate(plan)
    assert len(result.timeline) == sum(len(rp.deps) for rp in plan.ranks)


def test_plan_hash_is_deterministic():
    assert _plan("interleaved-1f1b", dp=2, zero=3).hash() == _plan("interleaved-1f1b", dp=2, zero=3).hash()
    assert _plan("1f1b").hash() != _plan("gpipe").hash()


def test_collectives_in_different_orders_deadlock():
    plan = _plan("1f1b", dp=2, zero=3)
    stream = plan.ranks[0].streams["dp"]
    stream[0], stream[1] = stream[1], stream[0]  # rank 0 now disagrees with rank 1
    with pytest.raises(DeadlockError, match="rank 0 dp"):
        simulate(plan)


def test_stream_order_against_dependencies_deadlocks():
    plan = _plan("gpipe")
    compute = plan.ranks[1].streams["compute"]
    compute.insert(0, compute.pop(compute.index("1B0")))  # backward before its forward
    with pytest.raises(DeadlockError, match="blocked stream heads"):
        simulate(plan)


def test_zero3_regathers_and_reshards_every_microbatch():
    plan = _plan("1f1b", dp=2, m=4, zero=3)
    gathers = [k for k in plan.ranks[0].tasks() if plan.dag.nodes[k].kind == Kind.ALL_GATHER]
    scatters = [k for k in plan.ranks[0].tasks() if plan.dag.nodes[k].kind == Kind.REDUCE_SCATTER]
    assert len(gathers) == 2 * 4 and len(scatters) == 4  # F and B of each microbatch; one RS per B


def test_zero3_gather_is_prefetched_one_chunk_ahead():
    """The gather for chunk k waits for chunk k-2, so it overlaps chunk k-1."""
    plan = _plan("1f1b", dp=2, m=4, zero=3)
    compute = plan.compute_sequence(0)
    for key in plan.ranks[0].streams["dp"]:
        node = plan.dag.nodes[key]
        if node.kind != Kind.ALL_GATHER:
            continue
        consumer = next(s for s in plan.dag.data_succ[key])
        waits_for = [p for p in plan.dag.temporal_pred[key] if plan.dag.nodes[p].is_compute]
        if compute.index(consumer) > 1:
            assert waits_for == [compute[compute.index(consumer) - 2]]


def test_plan_export_lists_every_task():
    plan = _plan("zb-h1", dp=2, zero=2)
    data = plan.to_json()
    assert sum(len(k) for r in data["ranks"] for k in r["streams"].values()) == sum(len(rp.deps) for rp in plan.ranks)
    assert set(data["nodes"]) == set(plan.dag.nodes)


@pytest.mark.slow
def test_plan_hash_does_not_depend_on_the_process():
    """SPMD ranks compile independently; Python's per-process hash seed must not leak in."""
    import os
    import subprocess
    import sys

    code = ("import torch; from test_scheduler import _plan; "
            "print(_plan('dualpipev', dp=2, zero=3).hash())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.path.dirname(__file__)))
             for seed in ("1", "2")]  # both at once: each spends most of its time importing torch
    hashes = {proc.communicate(timeout=120)[0].strip().splitlines()[-1] for proc in procs}
    assert len(hashes) == 1 and _plan("dualpipev", dp=2, zero=3).hash() in hashes
