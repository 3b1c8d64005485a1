"""Data-parallel symmetry: the scheduler builds one plan per class of dp replicas and the
simulator runs one replica per class; both must give exactly what building and simulating every
rank gives. Random strategies (the fuzzer's, at dp=2, with and without expert parallelism) are
simulated twice, collapsed and rank by rank, under unit costs (many ties) and the CPU profile
(a long probe of 300 draws found no difference)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from piper_plugin.api.schedule import Schedule
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin import capture
from piper_plugin.recipes import apply_recipe
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.plan import build_plan
from piper_plugin.scheduler.simulate import DeadlockError, simulate
from piper_plugin.scheduler.symmetry import representatives
from test_fuzz_strategies import _plan, strategies

COSTS = [CostModel(), CostModel.cpu_default()]


def _rank_by_rank(plan):
    return dataclasses.replace(plan, representative=list(range(len(plan.ranks))))


def _same(collapsed, full) -> None:
    assert collapsed.step_time == full.step_time
    assert collapsed.busy == full.busy
    assert collapsed.per_rank_peak == full.per_rank_peak
    assert sorted(collapsed.timeline) == sorted(full.timeline)


def _check(spec: dict) -> None:
    plan = _plan(spec)
    assume(plan is not None)
    rep = plan.representative
    assert len(set(rep)) == plan.grid.world_size // 2  # each class: the two dp replicas
    for r, rank_plan in enumerate(plan.ranks):
        other = plan.ranks[rep[r]]
        assert rank_plan.rank == r and rank_plan.streams == other.streams and rank_plan.deps == other.deps
    for cost in COSTS:
        _same(simulate(plan, cost), simulate(_rank_by_rank(plan), cost))


_SETTINGS = dict(deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
_DP2 = strategies().map(lambda spec: {**spec, "dp": 2})


@settings(max_examples=4, **_SETTINGS)
@given(_DP2)
def test_collapsed_simulation_equals_every_rank_simulated_fast(spec):
    _check(spec)


@pytest.mark.slow
@settings(max_examples=20, **_SETTINGS)
@given(_DP2)
def test_collapsed_simulation_equals_every_rank_simulated(spec):
    _check(spec)


def _schedule(dp: int = 2):
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=2, layers=2)
    x, y = lm_batch(cfg, 4 * dp)
    sch = Schedule(capture(model, lm_loss, (x,), y), pp=2, dp=dp)
    apply_recipe(sch, "1f1b", microbatches=4, zero=3)
    return sch


def test_a_region_on_one_replica_only_is_not_collapsed():
    sch = _schedule()
    region = next(iter(sch.dag.meta.placement))
    for node in sch.dag.nodes.values():
        if node.region == region and node.devices:
            node.devices = node.devices[:1]
            break
    assert representatives(sch.dag, sch.grid) == list(range(4))


def test_an_edited_replica_plan_is_simulated_rank_by_rank():
    sch = _schedule()
    plan = build_plan(sch.dag, sch.grid)
    assert plan.representative == [0, 0, 2, 2]
    stream = plan.ranks[0].streams["dp"]
    stream[0], stream[1] = stream[1], stream[0]  # rank 0 alone: its replica's copy is unchanged
    assert plan.ranks[1].streams["dp"] != stream
    with pytest.raises(DeadlockError, match="rank 0 dp"):
        simulate(plan)
