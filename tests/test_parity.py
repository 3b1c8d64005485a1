"""Invariant 1: a schedule never changes the result (reference executor vs one device).

Every recipe over pp and microbatches, and with data parallelism at each ZeRO level, is fuzzed in
``test_fuzz_strategies.py`` (each recipe pinned at pp=4 and at pp=2 x dp=2 with ZeRO-3); here:
expert parallelism, dp x ep, ZeRO-3 buckets and tied embeddings."""
import pytest
import torch

from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe, stages_needed
from parity import check_parity

RECIPES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"]


def _check_parity(recipe, pp, m, dp=1, ep=1, zero=0, moe=False, tie=False, bucket_bytes=None):
    stages = stages_needed(recipe, pp)
    torch.manual_seed(0)
    model, cfg = (build_toy_moe if moe else build_toy_lm)(stages=stages, layers=stages)
    if tie:
        cfg.tie_embeddings = True
        model = type(model)(cfg, stages=stages)
    batch = lm_batch(cfg, 2 * m * dp * ep, torch.Generator().manual_seed(1))
    return check_parity(model, lm_loss, batch,
                        lambda s: apply_recipe(s, recipe, microbatches=m, zero=zero, bucket_bytes=bucket_bytes),
                        pp=pp, dp=dp, ep=ep)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_parallel_moe_matches_single_device(recipe):
    _check_parity(recipe, 2, 4, ep=2, moe=True)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_moe_dp_times_ep_matches_single_device(zero):
    _check_parity("1f1b", 2, 4, dp=2, ep=2, zero=zero, moe=True)


def test_zero3_buckets_match_single_device():
    _check_parity("1f1b", 2, 4, dp=2, zero=3, bucket_bytes=4096)


@pytest.mark.parametrize("recipe", ["1f1b", "dualpipev"])
def test_tied_embeddings_match_single_device(recipe):
    _check_parity(recipe, 2, 4, dp=2, zero=0, tie=True)
