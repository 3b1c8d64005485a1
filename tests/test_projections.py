"""benchmarks.projections: its FLOP count per region against the textbook formulas, and one
projected strategy whose simulated step is checked by hand."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import projections  # noqa: E402
from piper_plugin import capture  # noqa: E402
from piper_plugin.models import lm_batch, lm_loss  # noqa: E402

SIZES = dict(dim=32, n_layers=4, n_heads=4, ffn=64, vocab=128, seq=16)


def test_region_flops_follow_the_matmul_and_attention_formulas():
    model, cfg = projections._build(False, SIZES, 2)
    x, y = lm_batch(cfg, 4)
    program = capture(model, lm_loss, (x,), y)
    samples, d, t, f, v = 3, 32, 16, 64, 128
    tokens = samples * t
    per_layer = 2 * tokens * (3 * d * d + d * d + 2 * d * f)  # qkv, proj, fc1, fc2
    attention = 2 * 2 * samples * t * t * d  # scores and their product with values
    flops = projections.region_flops(model, cfg, program, samples)
    assert sorted(flops) == ["0", "1"]
    first, last = flops["0"], flops["1"]
    assert first[0] == pytest.approx(2 * (per_layer + attention), rel=0.01)
    assert last[0] == pytest.approx(2 * (per_layer + attention) + 2 * tokens * d * v, rel=0.01)
    assert first[2] == per_layer * 2  # weight gradients: one matmul per weight, the forward's size
    assert last[2] == per_layer * 2 + 2 * tokens * d * v
    for f_, bi, bw in flops.values():  # a backward is twice the forward
        assert bi + bw == pytest.approx(2 * f_, rel=0.01)


@pytest.mark.slow
def test_a_projection_charges_the_profile_and_counts_tokens():
    r = projections.project(False, SIZES, "1f1b", 2, 2, 1, 1, 2)
    assert r["microbatches"] == 4
    assert r["tokens_per_gpu"] == pytest.approx(2 * 4 * 2 * 16 / r["step"] / 4)
    model, cfg = projections._build(False, SIZES, 2)
    x, y = lm_batch(cfg, 16)
    flops = projections.region_flops(model, cfg, capture(model, lm_loss, (x,), y), 2)
    rate = projections.GPU["peak_flops"] * projections.GPU["efficiency"]
    busiest = max(4 * sum(per_region) / rate for per_region in flops.values())  # 4 microbatches per stage
    assert busiest < r["step"] < 2 * busiest + 1e-3  # plus messages at 10 us each, the pipeline's fill
    assert 0 < r["bubble"] < 1 and r["peak"] > 0
