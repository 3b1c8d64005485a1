"""Invariant 1 on real processes: forked gloo ranks train exactly like one device."""
import functools

import pytest

from piper_plugin.api.schedule import Schedule
from piper_plugin.models import ToyLM, ToyLMConfig, ToyMoELM
from piper_plugin.recipes import apply_recipe, stages_needed
from parity import check_distributed_parity

RECIPES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"]


def _schedule(recipe, pp, dp, ep, m, zero, program):
    return apply_recipe(Schedule(program, pp=pp, dp=dp, ep=ep), recipe, microbatches=m, zero=zero)


def _model(cls, cfg, stages):
    return cls(cfg, stages=stages)


def _check_parity(recipe, pp, dp=1, ep=1, zero=0, moe=False):
    m = max(4, 2 * pp) if recipe == "dualpipev" else 4
    stages = stages_needed(recipe, pp)
    cfg = ToyLMConfig(n_layers=stages)
    model_fn = functools.partial(_model, ToyMoELM if moe else ToyLM, cfg, stages)
    check_distributed_parity(model_fn, cfg, 2 * m * dp * ep,
                             functools.partial(_schedule, recipe, pp, dp, ep, m, zero))


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_match_single_device(recipe):
    _check_parity(recipe, pp=2)


@pytest.mark.parametrize("recipe,pp,dp,zero", [
    ("gpipe", 4, 1, 0), ("1f1b", 2, 2, 3), ("interleaved-1f1b", 2, 2, 1), ("zb-h1", 4, 1, 0),
    ("dualpipev", 2, 2, 2)])
def test_four_ranks_match_single_device(recipe, pp, dp, zero):
    _check_parity(recipe, pp=pp, dp=dp, zero=zero)


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_with_expert_parallelism_on_four_ranks(recipe):
    _check_parity(recipe, pp=2, ep=2, moe=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_on_two_ranks(recipe):
    _check_parity(recipe, pp=2, moe=True)
