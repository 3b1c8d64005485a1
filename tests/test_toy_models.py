"""Tests for the toy models in piper_plugin.models."""
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from piper_plugin.api.annotate import current_tags, module_tags
from piper_plugin.models import (
    TOY_MODELS,
    GroupedExperts,
    MoELayer,
    ToyLM,
    ToyLMConfig,
    ToyMoELM,
    TwoBranch,
    layer_stages,
    lm_batch,
    lm_loss,
    mse_loss,
    toy_sequential,
)

CFG = ToyLMConfig()
B = 3


def _models():
    """(name, model factory, input factory(device), expected output shape)."""
    lm_in = lambda dev: torch.randint(0, CFG.vocab, (B, CFG.seq), device=dev)
    vec_in = lambda dev: torch.randn(B, 16, device=dev)
    return [
        ("toy-lm", lambda: ToyLM(CFG, stages=2), lm_in, (B, CFG.seq, CFG.vocab)),
        ("toy-moe", lambda: ToyMoELM(CFG, stages=2), lm_in, (B, CFG.seq, CFG.vocab)),
        ("two-branch", lambda: TwoBranch(16), vec_in, (B, 16)),
        ("sequential", lambda: toy_sequential((16, 32, 32, 16)), vec_in, (B, 16)),
    ]


MODELS = _models()
IDS = [m[0] for m in MODELS]


@pytest.mark.parametrize("name,make,inp,shape", MODELS, ids=IDS)
def test_forward_shape_and_finite(name, make, inp, shape):
    torch.manual_seed(0)
    out = make()(inp("cpu"))
    assert out.shape == shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,make,inp,shape", MODELS, ids=IDS)
def test_fx_trace_matches_eager(name, make, inp, shape):
    torch.manual_seed(0)
    model = make()
    x = inp("cpu")
    gm = torch.fx.symbolic_trace(model)
    assert any(n.op == "call_module" or n.op == "call_function" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name,make,inp,shape", MODELS, ids=IDS)
def test_meta_device(name, make, inp, shape):
    with torch.device("meta"):
        model = make()
    assert all(p.is_meta for p in model.parameters())
    x = inp("meta")
    out = model(x)
    assert out.is_meta and out.shape == shape
    # The traced graph shape-propagates on meta too.
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    outs = [n for n in gm.graph.nodes if n.op == "output"]
    assert tuple(outs[0].args[0].meta["tensor_meta"].shape) == shape


def test_lm_stages_split_and_errors():
    cfg = ToyLMConfig(n_layers=4)
    assert ToyLM(cfg, stages=4).layer_stage == [0, 1, 2, 3]
    assert layer_stages(5, 2) == [0, 0, 0, 1, 1]
    assert layer_stages(64, 32) == [s for s in range(32) for _ in range(2)]
    with pytest.raises(ValueError, match="stages=5 > n_layers=4"):
        ToyLM(cfg, stages=5)
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        ToyLM(cfg, stages=0)


def test_lm_stage_tags_seen_by_each_layer():
    torch.manual_seed(0)
    model = ToyMoELM(CFG, stages=4)
    seen = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("layer", i), current_tags()))
        layer.mlp.experts.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(("experts", i), current_tags())
        )
    model.embed.register_forward_hook(lambda m, a, o: seen.__setitem__("embed", current_tags()))
    model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("norm", current_tags()))
    model(lm_batch(CFG, 2)[0])
    assert seen["embed"] == {"PP": 0}
    assert seen["norm"] == {"PP": 3}
    for i in range(4):
        assert seen[("layer", i)] == {"PP": i}
        assert seen[("experts", i)] == {"PP": i, "EP": "experts"}
    assert current_tags() == {}


def test_unstaged_lm_has_no_tags():
    model = ToyLM(CFG)
    seen = []
    model.layers[0].register_forward_hook(lambda m, a, o: seen.append(current_tags()))
    model(lm_batch(CFG, 1)[0])
    assert seen == [{}]


def test_tied_embeddings_share_weight():
    torch.manual_seed(0)
    cfg = ToyLMConfig(tie_embeddings=True)
    model = ToyLM(cfg, stages=2)
    assert model.head is None
    assert not any(name.startswith("head") for name, _ in model.named_parameters())
    n_untied = sum(p.numel() for p in ToyLM(ToyLMConfig()).parameters())
    assert n_untied - sum(p.numel() for p in model.parameters()) == cfg.vocab * cfg.dim
    tokens = torch.zeros(1, cfg.seq, dtype=torch.int64)  # only token 0 is embedded
    before = model(tokens)
    with torch.no_grad():
        model.embed.weight[5].add_(1.0)  # row 5 only feeds logit column 5, via the head
    after = model(tokens)
    changed = (after - before).abs().amax(dim=(0, 1))
    assert changed[5] > 0
    assert torch.count_nonzero(changed) == 1
    gm = torch.fx.symbolic_trace(model)
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert any(a.op == "get_attr" and a.target == "embed.weight" for n in linears for a in n.args)


def test_moe_default_capacity_drops_nothing():
    torch.manual_seed(0)
    layer = MoELayer(CFG.dim, CFG.ffn, CFG.n_experts, CFG.top_k, capacity=None)
    x = torch.randn(40, CFG.dim)
    dispatch, combine = layer.route(x)
    assert dispatch.shape == combine.shape == (40, CFG.n_experts, 40)
    torch.testing.assert_close(combine.sum(dim=(1, 2)), torch.ones(40))
    assert torch.equal(dispatch.sum(dim=(1, 2)), torch.full((40,), float(CFG.top_k)))
    assert dispatch.sum(dim=0).max() <= 1  # each (expert, slot) holds at most one token


def test_moe_matches_per_token_reference():
    torch.manual_seed(0)
    layer = MoELayer(CFG.dim, CFG.ffn, CFG.n_experts, CFG.top_k, capacity=None)
    x = torch.randn(2, 5, CFG.dim)
    y = layer(x)
    tokens = x.flatten(0, 1)
    probs = F.softmax(layer.router(tokens), dim=-1)
    gates, idx = probs.topk(CFG.top_k, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True)
    w1, w2 = layer.experts.w1, layer.experts.w2
    ref = torch.stack([
        sum(gates[t, k] * (F.gelu(tokens[t] @ w1[idx[t, k]]) @ w2[idx[t, k]]) for k in range(CFG.top_k))
        for t in range(tokens.size(0))
    ])
    torch.testing.assert_close(y, ref.view_as(x))


def test_moe_small_capacity_drops_tokens():
    torch.manual_seed(0)
    layer = MoELayer(CFG.dim, CFG.ffn, CFG.n_experts, CFG.top_k, capacity=2)
    dispatch, combine = layer.route(torch.randn(16, CFG.dim))
    assert dispatch.shape == (16, CFG.n_experts, 2)
    assert dispatch.sum(dim=0).max() <= 1
    assert torch.equal(dispatch.sum(), torch.tensor(float(CFG.n_experts * 2)))  # all slots full
    assert (combine.sum(dim=(1, 2)) < 1 - 1e-6).any()  # some tokens lost weight
    assert (combine.sum(dim=(1, 2)) <= 1 + 1e-6).all()


def test_grouped_experts_params_have_expert_dim():
    experts = GroupedExperts(4, 8, 12)
    assert experts.w1.shape == (4, 8, 12) and experts.w2.shape == (4, 12, 8)
    assert all(p.shape[0] == 4 for p in experts.parameters())
    assert experts(torch.randn(4, 5, 8)).shape == (4, 5, 8)
    assert experts.w1.std() < 0.05


def test_two_branch_tags_and_skip():
    torch.manual_seed(0)
    model = TwoBranch(16)
    seen = {}
    for name in ("stem", "branch_a", "branch_b", "head"):
        getattr(model, name).register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, current_tags()))
    x = torch.randn(B, 16)
    out = model(x)
    assert seen == {
        "stem": {"PP": 0},
        "branch_a": {"PP": 1, "branch": "a"},
        "branch_b": {"PP": 2, "branch": "b"},
        "head": {"PP": 3},
    }
    s = model.stem(x)
    expected = model.head(torch.cat([model.branch_a(s), model.branch_b(s)], -1)) + s
    torch.testing.assert_close(out, expected)


def test_sequential_structure_and_stage_tags():
    plain = toy_sequential((16, 32, 32, 16))
    assert isinstance(plain, torch.nn.Sequential)
    assert [type(m).__name__ for m in plain] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert all(module_tags(m) == {} for m in plain)
    staged = toy_sequential((16, 32, 32, 16), stages=2)
    assert [module_tags(m).get("PP") for m in staged] == [0, 0, 0, 0, 1]


def test_data_helpers_and_losses():
    g = torch.Generator().manual_seed(0)
    tokens, targets = lm_batch(CFG, 4, g)
    assert tokens.shape == targets.shape == (4, CFG.seq)
    assert tokens.dtype == targets.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert tokens.min() >= 0 and tokens.max() < CFG.vocab
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(lm_batch(CFG, 4, g2)[0], tokens)  # deterministic given the generator
    logits = torch.zeros(4, CFG.seq, CFG.vocab)
    torch.testing.assert_close(lm_loss(logits, targets), torch.log(torch.tensor(float(CFG.vocab))))
    assert mse_loss(torch.ones(3), torch.zeros(3)).item() == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["toy-lm", "toy-moe"])
def test_registry_builds_with_more_layers(name):
    with torch.device("meta"):
        model, cfg = TOY_MODELS[name](stages=32, layers=64)
    assert cfg.n_layers == 64 and len(model.layers) == 64
    assert model.layer_stage[0] == 0 and model.layer_stage[-1] == 31
    out = model(torch.zeros(2, cfg.seq, dtype=torch.int64, device="meta"))
    assert out.shape == (2, cfg.seq, cfg.vocab)
    model2, cfg2 = TOY_MODELS[name](None)
    assert cfg2 == ToyLMConfig() and model2.stages is None
    assert isinstance(model2, ToyMoELM if name == "toy-moe" else ToyLM)
