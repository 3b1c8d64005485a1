"""BI + BW (runtime/split_backward.py) give exactly one full backward's gradients."""
import pytest
import torch
import torch.nn as nn

from piper_plugin.autograd.split_backward import backward_input


def _check(fn, inputs, weights):
    """Run ``fn`` twice: once for a full autograd.grad, once split; compare every gradient."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    wanted = [t for t in inputs if t.requires_grad]
    expected = torch.autograd.grad([out], wanted + weights, [grad], allow_unused=True)
    for w in weights:
        w.grad = None
    out = fn(*inputs)
    got, pending = backward_input([out], [grad], wanted)
    assert all(w.grad is None for w in weights), "BI must not touch weight gradients"
    for g, e in zip(got, expected[:len(wanted)]):
        torch.testing.assert_close(g, e)
    pending.run()
    for w, e in zip(weights, expected[len(wanted):]):
        if e is None:
            assert w.grad is None
        else:
            torch.testing.assert_close(w.grad, e, rtol=1e-5, atol=1e-6)


def test_transformer_layer_with_input():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    _check(layer, [x], list(layer.parameters()))


def test_first_stage_without_float_inputs_runs_all_weights_in_bw():
    torch.manual_seed(0)
    embed, proj = nn.Embedding(10, 8), nn.Linear(8, 8)
    tokens = torch.randint(0, 10, (3, 4))
    _check(lambda t: proj(embed(t)).tanh(), [tokens], [embed.weight, *proj.parameters()])


def test_weight_used_on_both_sides_of_an_input_path_is_counted_once():
    """A tied weight reaches the graph at two frontier nodes, one below the other."""
    torch.manual_seed(0)
    w, b = torch.randn(6, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    _check(lambda x: ((x @ w + b).tanh() @ w.t()).sin() * b, [x], [w, b])


def test_output_branch_that_reaches_no_input():
    torch.manual_seed(0)
    w, v = torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    _check(lambda x: (x @ w) + v.exp(), [x], [w, v])


def test_unused_weight_gets_no_gradient():
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    _check(lambda x: used(x).relu(), [x], [*used.parameters(), *unused.parameters()])


@pytest.mark.parametrize("n_inputs", [1, 2])
def test_several_inputs_and_shared_subexpressions(n_inputs):
    torch.manual_seed(0)
    a, b = nn.Linear(5, 5), nn.LayerNorm(5)
    xs = [torch.randn(3, 5, requires_grad=True) for _ in range(n_inputs)]

    def fn(*xs):
        h = sum(a(x) for x in xs)
        return b(h) * h + a(b(h))

    _check(fn, xs, [*a.parameters(), *b.parameters()])


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its runs (a stand-in for input-side work)."""

    runs = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Counted.runs += 1
        return g


def test_bw_runs_no_input_side_work():
    torch.manual_seed(0)
    l1, l2 = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = l2(_Counted.apply(l1(_Counted.apply(x))).relu())
    _Counted.runs = 0
    _, pending = backward_input([out], [torch.ones_like(out)], [x])
    assert _Counted.runs == 2
    pending.run()
    assert _Counted.runs == 2, "BW re-ran input-side nodes"
    assert all(p.grad is not None for p in [*l1.parameters(), *l2.parameters()])


@pytest.mark.parametrize("recipe", ["zb-h1", "dualpipev"])
def test_split_backward_releases_every_saved_activation(recipe):
    """After each step no activation is left in any rank's meter: a retained graph must not be
    kept alive by the meter's own hold on saved outputs."""
    from benchmarks._common import lm_config, lm_job
    from piper_plugin.compiler import compile_job
    from reference_executor import ReferenceExecutor

    job = lm_job(lm_config(dim=16, layers=4, heads=2, ffn=32, seq=8, vocab=64), recipe=recipe, pp=2,
                 microbatches=4, batch=8)
    program, _, plan, _ = compile_job(job)
    ex = ReferenceExecutor(plan, program, job.build_model(), job.loss_fn, job.optimizer_fn)
    data = iter(job.data_fn(0))
    for _ in range(2):
        ex.step(*next(data))
        assert [state.meter.current for state in ex.states] == [0, 0]


class _LinearFunction(torch.autograd.Function):
    """A linear layer as one Function of input and weight (as Megatron writes its layers): its
    backward returns both gradients in one call whatever is asked of it."""

    forwards = backwards = 0

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        _LinearFunction.forwards += 1
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        _LinearFunction.backwards += 1
        rows = g.flatten(0, -2)
        return g @ weight, rows.T @ x.flatten(0, -2), rows.sum(0) if ctx.has_bias else None


class _FunctionLinear(nn.Linear):
    def forward(self, x):
        return _LinearFunction.apply(x, self.weight, self.bias)


def test_a_split_that_would_repeat_a_custom_function_is_seen():
    torch.manual_seed(0)
    plain, fused = nn.Linear(4, 4), nn.Linear(4, 4)
    fused.__class__ = _FunctionLinear
    x = torch.randn(2, 4, requires_grad=True)
    from piper_plugin.autograd.split_backward import weight_pass_repeats_work

    assert not weight_pass_repeats_work([plain(x).relu()], [x])
    assert weight_pass_repeats_work([plain(fused(x).relu())], [x])
    assert not weight_pass_repeats_work([fused(torch.randn(2, 4))], [x]), "no input below: nothing splits"


@pytest.mark.parametrize("recipe", ["1f1b", "zb-h1", "dualpipev"])
def test_a_backward_whose_split_repeats_a_custom_function_runs_once_and_trains_the_same(recipe):
    """1F1B on 2 ranks splits the last stage's last backward to send its input gradients first;
    zero-bubble and DualPipeV split backwards into BI and BW tasks. With every linear layer a
    custom Function a split would run each layer's backward twice, so each such B or BI runs as
    one pass (its BW has nothing left): each Function's backward once per forward, and the same
    parameters after two steps as with plain linear layers (where the splits happen)."""
    from benchmarks._common import lm_config, lm_job
    from piper_plugin.compiler import compile_job
    from reference_executor import ReferenceExecutor

    job = lm_job(lm_config(dim=16, layers=4, heads=2, ffn=32, seq=8, vocab=64), recipe=recipe, pp=2,
                 microbatches=4, batch=8)
    program, _, plan, _ = compile_job(job)
    assert any(rp.split_first for rp in plan.ranks) or any(n.kind.name == "BI" for n in plan.dag.nodes.values()), \
        "the plan splits no backward: the test shows nothing"
    model = job.build_model()
    swapped = [m for m in model.modules() if type(m) is nn.Linear]
    assert swapped
    results = []
    for function_layers in (False, True):
        for m in swapped:
            m.__class__ = _FunctionLinear if function_layers else nn.Linear
        ex = ReferenceExecutor(plan, program, model, job.loss_fn, job.optimizer_fn)
        _LinearFunction.forwards = _LinearFunction.backwards = 0
        data = iter(job.data_fn(0))
        for _ in range(2):
            ex.step(*next(data))
        if function_layers:
            assert _LinearFunction.backwards == _LinearFunction.forwards > 0
        results.append([p.detach().clone() for s in ex.states for c in s.chunks.values() for p in c.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["1f1b", "zb-h1", "dualpipev"])
def test_a_region_whose_backward_does_not_split_is_planned_and_run_as_one_pass(recipe, monkeypatch):
    """``Region.backward_splits=False`` (a compiled region: one call yields input and weight
    gradients) makes the plan run each of its BI tasks whole and split no B; the simulator
    charges such a BI a whole backward and its BW nothing; the runtime never splits it and
    trains exactly as the plan that splits."""
    import dataclasses

    from benchmarks._common import lm_config, lm_job
    from piper_plugin.compiler import compile_job, compile_program
    from piper_plugin.ir.nodes import Kind
    from piper_plugin.runtime import compute
    from piper_plugin.scheduler.cost import CostModel
    from piper_plugin.scheduler.simulate import simulate
    from reference_executor import ReferenceExecutor

    job = lm_job(lm_config(dim=16, layers=4, heads=2, ffn=32, seq=8, vocab=64), recipe=recipe, pp=2,
                 microbatches=4, batch=8)
    splits = compile_job(job)
    assert any(rp.split_first for rp in splits.plan.ranks) or any(
        n.kind == Kind.BI and k not in splits.plan.ranks[r].fused
        for r in range(2) for k, n in splits.plan.dag.nodes.items() if k in splits.plan.ranks[r].deps), \
        "the plan splits no backward: the test shows nothing"
    program = compile_job(job).program
    for name, region in list(program.dag.regions.items()):
        program.dag.regions[name] = dataclasses.replace(region, backward_splits=False)
    whole = compile_program(program, job.schedule_fn)
    nodes = whole.plan.dag.nodes
    for rp in whole.plan.ranks:
        assert not rp.split_first
        assert {k for k in rp.deps if nodes[k].kind == Kind.BI} == set(rp.fused)
    cost = CostModel(F=1.0, B=3.0, BI=1.0, BW=2.0)
    durations = {(r, key): end - start for r, _, key, start, end in simulate(whole.plan, cost).timeline}
    kinds = {nodes[key].kind for _, key in durations}
    if Kind.BI in kinds:
        assert {d for (_, key), d in durations.items() if nodes[key].kind == Kind.BI} == {3.0}
        assert {d for (_, key), d in durations.items() if nodes[key].kind == Kind.BW} == {0.0}

    def no_split(*args, **kwargs):
        raise AssertionError("a region whose backward does not split was split")

    results = []
    for compiled, patch in ((splits, False), (whole, True)):
        if patch:
            monkeypatch.setattr(compute, "backward_input", no_split)
        ex = ReferenceExecutor(compiled.plan, compiled.program, job.build_model(), job.loss_fn, job.optimizer_fn)
        data = iter(job.data_fn(0))
        for _ in range(2):
            ex.step(*next(data))
        results.append([p.detach().clone() for s in ex.states for c in s.chunks.values() for p in c.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
