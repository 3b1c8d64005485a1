"""Backward working memory: what capture's size probe (fake tensors, the example batch) gives
the simulator is what real tensors of a microbatch allocate (same measure, real kernels)."""
from __future__ import annotations

import pytest
import torch

from piper_plugin import capture
from piper_plugin.ir.activations import _forward, _split_backward, _whole_backward
from piper_plugin.models import build_toy_lm, build_toy_moe, lm_batch, lm_loss
from piper_plugin.runtime.working_memory import WorkingMemory


def _real(program, model, batch, name):
    """The region's backward memory on real tensors of ``batch`` (regions before it run first)."""
    chunks = program.instantiate(model, lm_loss)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    env = dict(zip(program.input_names, batch))
    for region_name, region in program.regions.items():
        chunk = chunks[region_name]

        def forward(tracker, region=region, chunk=chunk):
            args = [env[v] if v in program.input_names else env[v].detach().requires_grad_(env[v].is_floating_point())
                    for v in region.inputs]
            outs, saved = _forward(chunk, args, params, tracker)
            return args, outs, saved

        if region_name == name:
            weights = [p for p in chunk.parameters() if p.requires_grad]
            tracker = WorkingMemory(record=True)
            _, outs, _ = forward(tracker)
            full = _whole_backward(tracker, outs, weights)
            return _split_backward(forward, full, weights)
        with torch.no_grad():
            outs = chunk(*[env[v] for v in region.inputs])
        env.update(zip(region.outputs, outs))
    raise KeyError(name)


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
    rows = []
    for name, region in program.regions.items():
        real = _real(program, model, micro, name)
        for part in ("full", "inputs", "kept", "weights"):
            rows.append((name, part, getattr(region.backward, part).at(1 / k), getattr(real, part).at(1.0)))
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
