"""Backward working memory: what capture's size probe (fake tensors, the example batch) gives
the simulator is what real tensors of a microbatch allocate (same measure, real kernels)."""
from __future__ import annotations

import pytest
import torch

from piper_plugin import capture
from piper_plugin.ir.activations import region_memory
from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss


def _compare(build, k: int):
    """(region, pass, probed on a batch of 8 read at 1/k, real on 8/k rows) for every region and
    pass (whole, input gradients, what they keep, weight gradients)."""
    torch.manual_seed(0)
    model, cfg = build(stages=2, layers=2)
    tokens, targets = lm_batch(cfg, 8)
    with torch.device("meta"):
        meta, _ = build(stages=2, layers=2)
    program = capture(meta, lm_loss, (tokens,), targets)
    micro = (tokens[: 8 // k], targets[: 8 // k])
    real = region_memory(program, model, lm_loss, micro, fake=False)
    rows = []
    for name, region in program.regions.items():
        for part in ("full", "inputs", "kept", "weights"):
            rows.append((name, part, getattr(region.backward, part).at(1 / k),
                         getattr(real[name].backward, part).at(1.0)))
    assert any(probed > 0 for name, part, probed, _ in rows if part == "full")
    return rows


@pytest.mark.parametrize("k", [1, 4])
def test_probed_backward_memory_matches_real_tensors_of_a_microbatch(k):
    """The toy LM's memory scales with the batch, or not at all (parameter-sized gradients): the
    probe read at 1/k equals a real run on 1/k of the rows, within 2% + 4 KiB."""
    for row in _compare(build_toy_lm, k):
        _, _, probed, measured = row
        assert abs(probed - measured) <= 0.02 * measured + 4096, row


def test_probed_backward_memory_bounds_a_superlinear_moe():
    """The toy MoE dispatches over a capacity of one slot per token (tokens x experts x tokens):
    exact at the probed batch; at a quarter of it the probe's linear reading is an upper bound."""
    for row in _compare(build_toy_moe, 1):
        _, _, probed, measured = row
        assert abs(probed - measured) <= 0.02 * measured + 4096, row
    rows = _compare(build_toy_moe, 4)
    assert all(probed >= measured - 4096 for _, _, probed, measured in rows), rows
    assert any(probed > 1.2 * measured for _, _, probed, measured in rows), "no superlinear part seen"
