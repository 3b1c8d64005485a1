"""Capture: regions, data edges, tied weights and the single-device DAG."""
import pytest
import torch
import torch.nn as nn

import piper_plugin as piper
from piper_plugin.ir.capture import CaptureError
from piper_plugin.models import (TwoBranch, build_toy_lm, build_toy_moe, lm_batch, lm_loss, mse_loss,
                                 toy_sequential)


def _edges(program, kind="F"):
    dag = program.dag
    return {(s[:-1], d[:-1]) for s, succ in dag.data_succ.items() for d in succ
            if s.endswith(kind) and d.endswith(kind)}


def test_transformer_regions_and_residual_stream():
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=4)
    x, y = lm_batch(cfg, 4)
    program = piper.capture(model, lm_loss, (x,), y)
    assert list(program.regions) == ["0", "1", "2", "3"]
    assert _edges(program) == {("0", "1"), ("1", "2"), ("2", "3")}
    assert program.loss_region == "3"
    assert all(p.startswith("model.layers.1.") for p in program.regions["1"].params)
    assert program.regions["1"].value_bytes[program.regions["1"].inputs[0]] == 4 * cfg.seq * cfg.dim * 4


def test_two_branches_are_independent_and_skip_edge_exists():
    model = TwoBranch(dim=8)
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    program = piper.capture(model, mse_loss, (x,), t)
    edges = _edges(program)
    assert {("0", "1"), ("0", "2"), ("1", "3"), ("2", "3"), ("0", "3")} <= edges
    assert ("1", "2") not in edges and ("2", "1") not in edges
    assert program.regions["1"].tags == {"PP": 1, "branch": "a"}


def test_sequential_annotated_by_module_name():
    model = toy_sequential((8, 16, 16, 8))
    piper.annotate_modules(model, {"0": {"PP": 0}, "1": {"PP": 0}, "2": {"PP": 1}, "3": {"PP": 1}, "4": {"PP": 1}})
    program = piper.capture(model, mse_loss, (torch.randn(2, 8),), torch.randn(2, 8))
    assert list(program.regions) == ["0", "1"]
    assert program.regions["0"].params == ("model.0.weight", "model.0.bias")
    assert program.regions["1"].params == ("model.2.weight", "model.2.bias", "model.4.weight", "model.4.bias")


def test_tied_weight_is_shared_by_first_and_last_region():
    model, cfg = build_toy_lm(stages=2)
    cfg.tie_embeddings = True
    model = type(model)(cfg, stages=2)
    x, y = lm_batch(cfg, 2)
    program = piper.capture(model, lm_loss, (x,), y)
    assert program.tied == {"model.embed.weight": ("0", "1")}


def test_moe_experts_are_their_own_regions_inside_stages():
    with torch.device("meta"):
        model, cfg = build_toy_moe(stages=2)
    x, y = lm_batch(cfg, 2)
    program = piper.capture(model, lm_loss, (x,), y)
    experts = [r for r in program.regions.values() if r.tags.get("EP") == "experts"]
    assert len(experts) == cfg.n_layers and all("PP" in r.tags for r in experts)
    assert all(program.dag.meta.param_shapes[p][0] == cfg.n_experts for r in experts for p in r.params)


def test_chunks_reproduce_the_model_bit_for_bit():
    torch.manual_seed(0)
    model, cfg = build_toy_lm(stages=3, layers=3)
    x, y = lm_batch(cfg, 2)
    program = piper.capture(model, lm_loss, (x,), y)
    chunks = program.instantiate(model, lm_loss)
    values = {"tokens": x, "target": y}
    for name, region in program.regions.items():
        values.update(zip(region.outputs, chunks[name](*[values[v] for v in region.inputs])))
    assert torch.equal(values[program.loss_value], lm_loss(model(x), y))


def test_capture_without_annotations_fails():
    with pytest.raises(CaptureError, match="no annotated region"):
        piper.capture(toy_sequential((4, 4)), mse_loss, (torch.randn(2, 4),), torch.randn(2, 4))


def test_capture_of_data_dependent_control_flow_explains_itself():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with piper.annotate(PP=0):
                h = self.lin(x)
                return h if h.sum() > 0 else -h

    with pytest.raises(CaptureError, match="control flow"):
        piper.capture(Branchy(), mse_loss, (torch.randn(2, 4),), torch.randn(2, 4))


def test_region_without_pipeline_stage_is_rejected():
    class NoStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with piper.annotate(EP="experts"):
                return self.lin(x)

    with pytest.raises(CaptureError, match="without an integer PP stage"):
        piper.capture(NoStage(), mse_loss, (torch.randn(2, 4),), torch.randn(2, 4))


def test_annotate_rejects_bad_tag_values():
    with pytest.raises(TypeError, match="must be an int or a str"):
        with piper.annotate(PP=1.5):
            pass


class _Products(nn.Module):
    """An embedding (no FLOPs), a linear layer, a matmul, attention and a convolution, each in
    a region of its own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 12)
        self.other = nn.Parameter(torch.randn(12, 6))
        self.conv = nn.Conv1d(6, 4, kernel_size=3)

    def forward(self, tokens):
        with piper.annotate(PP=0):
            h = self.embed(tokens)  # [B, T, 8]
        with piper.annotate(PP=1):
            h = self.proj(h)  # [B, T, 12]
        with piper.annotate(PP=2):
            h = h @ self.other  # [B, T, 6]
            q = h.unsqueeze(1)  # [B, 1, T, 6]
            h = nn.functional.scaled_dot_product_attention(q, q, q).squeeze(1)
        with piper.annotate(PP=3):
            return self.conv(h.transpose(1, 2)).mean(dim=(1, 2))


def test_matrix_product_flops_are_counted_from_the_traced_shapes():
    batch, seq = 3, 10
    tokens = torch.randint(0, 50, (batch, seq))
    program = piper.capture(_Products(), mse_loss, (tokens,), torch.zeros(batch))
    flops = {name: r.matmul_flops for name, r in program.regions.items()}
    attention = 2 * batch * seq * seq * 6 * 2  # scores and weighted values, 2 FLOPs per multiply-add
    assert flops == {"0": 0, "1": 2 * batch * seq * 8 * 12, "2": 2 * batch * seq * 12 * 6 + attention,
                     "3": 2 * batch * (seq - 2) * 4 * 6 * 3}
