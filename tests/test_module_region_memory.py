"""Module regions (a host's own model parts, no traced graph) measured by ``region_memory``: what
a forward keeps is every storage its ops made that outlives it, so activation checkpointing
counts as it runs (full: the output alone; selective: what its policy saves, held in the
checkpoint's own frames where autograd's saved-tensor hooks never see it). Figures are exact
byte counts of a small MLP stage, on fake tensors and on real ones alike."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from piper_plugin import Program, Region, region_memory

B, D, H = 8, 16, 32  # rows, model width, hidden width


class Block(nn.Module):
    def __init__(self, ac: str):
        super().__init__()
        self.ac = ac
        self.up, self.mid, self.down = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, D)

    def body(self, x):
        return self.down(torch.relu(self.mid(torch.relu(self.up(x)))))

    def forward(self, x):
        if self.ac == "full":
            return checkpoint(self.body, x, use_reentrant=False)
        if self.ac == "selective":  # keep the ReLUs' outputs, recompute the rest
            def policy(ctx, op, *args, **kwargs):
                keep = op is torch.ops.aten.relu.default
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            return checkpoint(self.body, x, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        return self.body(x)


class Stages(nn.Module):
    def __init__(self, ac: str):
        super().__init__()
        self.first, self.last = Block("none"), Block(ac)


class TwoStages(Program):
    def instantiate(self, model, loss_fn):
        class Last(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = model.last

            def forward(self, h, y):
                return (loss_fn(self.block(h), y),)

        class First(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = model.first

            def forward(self, x):
                return (self.block(x),)
        return {"0": First(), "1": Last()}


def _program(model: nn.Module) -> TwoStages:
    def region(name, params, inputs, outputs):
        return Region(name=name, stage=int(name), index=int(name), tags={"PP": int(name)}, params=params,
                      inputs=inputs, outputs=outputs, value_bytes={}, activation_bytes=0, param_bytes=0, flops=0)
    names = {n: p for n, p in model.named_parameters()}
    regions = {"0": region("0", tuple(n for n in names if n.startswith("first")), ("x",), ("h",)),
               "1": region("1", tuple(n for n in names if n.startswith("last")), ("h", "y"), ("loss",))}
    return TwoStages.from_regions(regions, inputs=("x", "y"), loss_value="loss", loss_region="1", batch_size=B,
                                  param_bytes={n: p.numel() * 4 for n, p in names.items()},
                                  param_shapes={n: tuple(p.shape) for n, p in names.items()},
                                  value_shapes={"h": (B, D)})


def _loss(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("ac, block", [
    ("none", 2 * B * H),       # both ReLUs' outputs (the next op's input and their own backward's)
    ("full", 0),               # nothing: the block is recomputed in backward
    ("selective", 2 * B * H),  # the ReLUs' outputs, held by the checkpoint
])
def test_what_a_forward_keeps_counts_activation_checkpointing(ac, block):
    torch.manual_seed(0)
    model = Stages(ac)
    program = _program(model)
    x, y = torch.randn(B, D), torch.randn(B, D)
    split = ac != "selective"  # selective checkpointing allows one backward through the block
    fake = region_memory(program, model, _loss, (x, y), split=split)
    real = region_memory(program, model, _loss, (x, y), fake=False, split=split)
    assert fake["0"].saved == real["0"].saved == 4 * (2 * B * H + B * D)  # ReLUs and the output h
    # the last stage's block, the loss's difference (its square's input) and the scalar loss
    assert fake["1"].saved == real["1"].saved == 4 * (block + B * D + 1)



def test_ranks_can_share_the_measuring_one_region_each():
    """``measure=``: a region measured alone (the ones before it run forward only, to feed it)
    has the figures it has when every region is measured; the others are absent."""
    torch.manual_seed(0)
    model = Stages("none")
    program = _program(model)
    x, y = torch.randn(B, D), torch.randn(B, D)
    every = region_memory(program, model, _loss, (x, y))
    for name in ("0", "1"):
        alone = region_memory(program, model, _loss, (x, y), measure={name})
        assert alone.keys() == {name}
        assert alone[name] == every[name]


@pytest.mark.parametrize("measure", [None, {"0"}])  # the loss measured, or only run forward to no end
def test_compiled_host_code_runs_eagerly_on_fake_tensors(measure):
    """A host's ``torch.compile``'d loss (TorchTitan's ``--compile.enable``) is never handed fake
    tensors: a compiled kernel (inductor's C++ on a CPU) would read their memory and crash the rank.
    The backend here records what it is called with; the measurement calls it with nothing, and the
    figures are the uncompiled loss's."""
    torch.manual_seed(0)
    model = Stages("none")
    program = _program(model)
    x, y = torch.randn(B, D), torch.randn(B, D)
    seen = []

    def backend(gm, example_inputs):
        seen.append(example_inputs)
        return gm.forward

    compiled = torch.compile(_loss, backend=backend)
    got = region_memory(program, model, compiled, (x, y), measure=measure)
    assert seen == []
    want = region_memory(program, model, _loss, (x, y), measure=measure)
    assert got == want
    compiled(torch.randn(B, D), y)  # the compiled loss itself still compiles outside the measurement
    assert len(seen) == 1
