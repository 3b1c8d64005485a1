"""The simulator reproduces textbook bubbles (uniform costs) and the memory each schedule holds."""
import pytest
import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.graph import BackwardBytes, Rise
from piper_plugin.ir.nodes import Kind
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe, stages_needed
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.plan import build_plan
from piper_plugin.scheduler.posting import POST_AHEAD, POST_BUDGET
from piper_plugin.scheduler.simulate import simulate

F, B, W = 1.0, 2.0, 1.0  # per pipeline stage of a one-chunk schedule; B is the full backward


def _simulate(recipe, p, m, dp=1, zero=0, cost=None, post_budget=POST_BUDGET, backward=None):
    """``backward``: every region's backward working memory set to it (a test pinning other
    parts of memory passes ``BackwardBytes()``, none)."""
    stages = stages_needed(recipe, p)
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=stages, layers=stages)
    x, y = lm_batch(cfg, m * dp)
    sch = Schedule(capture(model, lm_loss, (x,), y), pp=p, dp=dp)
    apply_recipe(sch, recipe, microbatches=m, zero=zero)
    v = stages // p
    if backward is not None:
        for region in sch.dag.regions.values():
            region.backward = backward
    plan = build_plan(sch.dag, sch.grid)
    return plan, simulate(plan, cost or CostModel.uniform(F=F / v, B=B / v, W=W / v), post_budget=post_budget)


def _expected_idle(recipe, p):
    if recipe in ("gpipe", "1f1b"):
        return (p - 1) * (F + B)
    if recipe == "interleaved-1f1b":
        return (p - 1) * (F + B) / 2
    if recipe == "zb-h1":
        return (p - 1) * (F + B - 2 * W)
    # DualPipeV: the README's (PP/2 - 1)(F&B + B - 3W), with PP = 2p stages and per-stage costs
    # (each stage is half a rank's layers here, so per-stage F, B, W are halved), counts an
    # overlapped F&B pair as one unit that waits for both inputs. Without EP the recipe runs a
    # pair as F then B, each waiting for its own input only: half of that idle (p - 1 per-stage
    # units, as recipes/orders.py derives).
    f, b, w = F / 2, B / 2, W / 2
    return (p - 1) * ((f + b) + b - 3 * w) / 2


# m in {8, 16}; DualPipeV needs m >= 2p, so at p=8 it runs 16 and 32 microbatches
BUBBLE_CASES = [(recipe, p, m if recipe != "dualpipev" or m >= 2 * p else 4 * p)
                for recipe in ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"]
                for p in [2, 4, 8] for m in [8, 16]]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, p, m", BUBBLE_CASES)
def test_bubble_matches_textbook_formula(recipe, p, m):
    _, result = _simulate(recipe, p, m)
    expected = _expected_idle(recipe, p)
    for idle in result.idle:
        assert idle == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_gpipe_bubble_fraction(p, m):
    _, result = _simulate("gpipe", p, m)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.01)


def test_gpipe_holds_every_microbatch_and_1f1b_holds_p():
    """Activations of m microbatches vs of p, plus on rank 0 the gradient receives posted
    ``POST_AHEAD`` deep (and the one being consumed) and at most two activations sent but not
    yet let go (a sender notices a message arrived when its next compute task starts).
    Backward working memory is left out (pinned by its own tests)."""
    p, m = 4, 8
    for recipe, units in (("gpipe", m), ("1f1b", p)):
        plan, result = _simulate(recipe, p, m, post_budget=0, backward=BackwardBytes())
        unit = plan.dag.regions["0"].activation_bytes // plan.microbatches
        (grad,) = {n.bytes for n in plan.dag.nodes.values() if n.kind.value == "RECV" and 0 in n.devices}
        (sent,) = {n.bytes for n in plan.dag.nodes.values() if n.kind.value == "SEND" and 0 in n.devices}
        extra = result.peak_transient_bytes[0] - units * unit
        assert 0 <= extra <= (POST_AHEAD + 1) * grad + 2 * sent, recipe


def test_receives_within_the_budget_hold_their_buffers_from_step_start():
    """Rank 0 of GPipe posts every gradient receive at step start when they fit the budget, so
    its peak (idle between its last forward and its first backward) holds all m of them next
    to m activations; ``POST_AHEAD`` deep, two. Its last two forward messages are held then too:
    a sender lets go of a message that arrived when its next compute task starts, and F6's
    arrived as F7 started, F7's after it. No backward working memory (its own tests)."""
    p, m = 4, 8
    plan, deep = _simulate("gpipe", p, m, backward=BackwardBytes())
    _, shallow = _simulate("gpipe", p, m, post_budget=0, backward=BackwardBytes())
    unit = plan.dag.regions["0"].activation_bytes // plan.microbatches
    (grad,) = {n.bytes for n in plan.dag.nodes.values() if n.kind.value == "RECV" and 0 in n.devices}
    (sent,) = {n.bytes for n in plan.dag.nodes.values() if n.kind.value == "SEND" and 0 in n.devices}
    assert m * grad <= POST_BUDGET
    assert deep.peak_transient_bytes[0] == m * unit + m * grad + 2 * sent
    assert shallow.peak_transient_bytes[0] == m * unit + POST_AHEAD * grad + 2 * sent


def test_posted_streams_list_send_streams_first():
    """After a chunk its SEND goes out before more receives are posted (the runner posts the
    streams in this order); a middle rank of 1F1B has a send and a receive stream each way."""
    plan, _ = _simulate("1f1b", 4, 8)
    for rank in range(4):
        streams = plan.ranks[rank].posted
        sends = [any(plan.dag.nodes[k].kind.value == "SEND" for k in plan.ranks[rank].streams[s]) for s in streams]
        assert any(sends) and sends == sorted(sends, reverse=True)  # by name, p2p:0>1 (a receive) came first
        assert len(streams) == (2 if rank in (0, 3) else 4)


def test_zero_levels_shrink_static_memory():
    params = []
    for zero in range(4):
        plan, result = _simulate("1f1b", 2, 4, dp=2, zero=zero)
        params.append(result.static_bytes[0])
    full = params[0]["params"]
    assert params[1]["optimizer"] == pytest.approx(full, rel=0.01)  # 2 states / 2 ranks
    assert params[0]["optimizer"] == 2 * full
    assert params[2]["grads"] == pytest.approx(full / 2, rel=0.01)
    assert params[3]["params"] == pytest.approx(full / 2, rel=0.01)
    assert params[1]["params"] == params[2]["params"] == full


@pytest.mark.slow
@pytest.mark.parametrize("recipe,p", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 2)])
def test_zero3_holds_one_gathered_copy_of_a_bucket(recipe, p):
    """Gathers of one bucket for several microbatches overlap (the dp stream runs ahead); the
    runtime keeps one copy while any is in use, so ZeRO-3's transient peak exceeds ZeRO-2's by
    at most the rank's full parameters twice: the copy, and while a gather runs its rank-major
    receive buffer (it was 2-3 copies when each gather was charged, and more per microbatch)."""
    full = _simulate(recipe, p, 8, dp=2, zero=0)[1].static_bytes
    zero2 = _simulate(recipe, p, 8, dp=2, zero=2)[1].peak_transient_bytes
    zero3 = _simulate(recipe, p, 8, dp=2, zero=3)[1].peak_transient_bytes
    for rank, (two, three) in enumerate(zip(zero2, zero3)):
        assert 0 < three - two <= 2 * full[rank]["params"] * 1.01, rank  # padding to the group size


def test_comm_cost_lengthens_the_step():
    _, free = _simulate("1f1b", 2, 4, dp=2)
    _, slow = _simulate("1f1b", 2, 4, dp=2, cost=CostModel(latency=0.5))
    assert slow.step_time > free.step_time


def test_measured_task_times_drive_the_simulation():
    """``measured_costs`` gives each (kind, region) its mean time in a timeline: fed the
    timeline of a simulation, simulating again reproduces it; means keep each rank's total."""
    from types import SimpleNamespace

    from piper_plugin.train_report import measured_costs

    plan, _ = _simulate("1f1b", 2, 4)
    uniform = simulate(plan, CostModel.uniform(F=1e-3, B=3e-3))
    again = simulate(plan, measured_costs(plan, uniform))
    assert again.step_time == pytest.approx(uniform.step_time)
    assert again.bubble_fraction == pytest.approx(uniform.bubble_fraction)
    forwards = sorted(k for k in plan.ranks[0].deps if plan.dag.nodes[k].kind.value == "F")
    timeline = [(0, "compute", k, 0.0, 1.0 if i % 2 else 3.0) for i, k in enumerate(forwards)]
    costs = measured_costs(plan, SimpleNamespace(timeline=timeline))
    assert costs.per_task == {("F", plan.dag.nodes[forwards[0]].region): pytest.approx(2.0)}


def _backward_memory_only(recipe, p, m, backward):
    """A plan whose only transient memory is ``backward`` (activations and messages zeroed),
    its simulation, and per rank its compute tasks in the order they ran."""
    plan, _ = _simulate(recipe, p, m, backward=backward)
    for region in plan.dag.regions.values():
        region.activation_bytes = 0
    for node in plan.dag.nodes.values():
        node.bytes = 0
    result = simulate(plan, CostModel.uniform(F=F, B=B, W=W))
    order = [[key for r, _, key, _, _ in sorted(result.timeline, key=lambda t: t[3])
              if r == rank and plan.dag.nodes[key].is_compute] for rank in range(p)]
    return plan, result, order


@pytest.mark.parametrize("recipe", ["gpipe", "1f1b"])
def test_a_backward_holds_its_working_memory_while_it_runs(recipe):
    """One backward runs at a time on a rank: its working memory (per microbatch) is the peak."""
    p, m, per_microbatch = 2, 4, 1000
    _, result, _ = _backward_memory_only(recipe, p, m, BackwardBytes(full=Rise.of(per_microbatch * m)))
    assert result.peak_transient_bytes == [per_microbatch] * p


def test_an_input_gradient_pass_keeps_what_it_recorded_until_its_weight_pass():
    """Zero-bubble: each BI not run whole (its BW does not follow at once) leaves ``kept`` bytes
    until its BW finished; a B the runtime splits (input gradients first) holds them inside
    itself. The peak is the most outstanding at once, counted from each rank's task order."""
    p, m, kept = 2, 8, 1000
    plan, result, order = _backward_memory_only("zb-h1", p, m, BackwardBytes(inputs=Rise.of(kept * m), kept=Rise.of(kept * m)))
    most = []
    for rank, keys in enumerate(order):
        fused, split = plan.ranks[rank].fused, plan.ranks[rank].split_first
        outstanding = high = 0
        for key in keys:
            kind = plan.dag.nodes[key].kind
            rises = (kind == Kind.BI and key not in fused) or key in split
            high = max(high, outstanding + rises)
            if kind == Kind.BI and key not in fused:
                outstanding += 1
            elif kind == Kind.BW and any(plan.dag.nodes[k].kind == Kind.BI and k not in fused and
                                         plan.dag.nodes[k].microbatch == plan.dag.nodes[key].microbatch and
                                         plan.dag.nodes[k].region == plan.dag.nodes[key].region for k in keys):
                outstanding -= 1
        assert outstanding == 0
        most.append(high)
    assert max(most) >= 2  # the weight passes really are deferred past later input passes
    assert result.peak_transient_bytes == [kept * h for h in most]


def test_communication_that_costs_cpu_holds_the_compute():
    """``comm_cpu_share`` 1: a collective's time is also its rank's compute time, so a gradient
    reduction overlapping the backward no longer hides; 0 keeps it hidden (a NIC's case)."""
    plan, _ = _simulate("interleaved-1f1b", 1, 1, dp=2)
    base = dict(F=1.0, B=2.0, BI=1.0, BW=1.0)
    hidden = simulate(plan, CostModel(**base, latency=0.5))
    held = simulate(plan, CostModel(**base, latency=0.5, comm_cpu_share=1.0))
    reductions = sum(e - s for r, _, k, s, e in held.timeline if r == 0 and plan.dag.nodes[k].kind == Kind.ALL_REDUCE)
    assert reductions > 0 and held.busy == hidden.busy  # compute time is compute only
    assert held.step_time > hidden.step_time
    assert held.step_time <= hidden.step_time + reductions + 1e-9


def test_a_calibrated_profile_charges_a_fused_backward_as_one_whole_backward():
    """Where the plan runs a BI as the whole backward (its BW right after it), a profile that
    measured whole backwards charges that BI a B and its BW nothing; other cost models keep
    BI + BW."""
    plan, _ = _simulate("dualpipev", 2, 4)
    fused = {k for rp in plan.ranks for k in rp.fused}
    assert fused
    features = 5
    linear = {"F": (1e-3,) + (0.0,) * (features - 1), "B": (1.5e-3,) + (0.0,) * (features - 1),
              "BI": (1e-3,) + (0.0,) * (features - 1), "BW": (1e-3,) + (0.0,) * (features - 1),
              "UPDATE": (0.0,) * features}
    result = simulate(plan, CostModel(linear=linear))
    spans = {k: e - s for _, _, k, s, e in result.timeline}
    for key in fused:
        node = plan.dag.nodes[key]
        bw = next(k for k in spans if plan.dag.nodes[k].kind == Kind.BW and plan.dag.nodes[k].region == node.region
                  and plan.dag.nodes[k].microbatch == node.microbatch)
        assert spans[key] == pytest.approx(1.5e-3) and spans[bw] == 0.0
    split = [k for k, d in spans.items() if plan.dag.nodes[k].kind == Kind.BI and k not in fused]
    assert split and all(spans[k] == pytest.approx(1e-3) for k in split)
    uniform = simulate(plan, CostModel.uniform(F=1.0, B=2.0, W=1.0))  # BI 1 + BW 1, fused or not
    halves = {k: e - s for _, _, k, s, e in uniform.timeline}
    for key in fused:
        node = plan.dag.nodes[key]
        bw = next(k for k in halves if plan.dag.nodes[k].kind == Kind.BW and plan.dag.nodes[k].region == node.region
                  and plan.dag.nodes[k].microbatch == node.microbatch)
        assert (halves[key], halves[bw]) == (pytest.approx(1.0), pytest.approx(1.0))


def test_ranks_that_share_fewer_cores_take_turns():
    """``cores`` below the rank count: at most that many compute tasks at once. Four data-parallel
    ranks on two cores take twice one rank's compute; with a core each nothing changes."""
    plan, _ = _simulate("1f1b", 1, 1, dp=4)
    own = simulate(plan, CostModel(F=1.0, B=2.0, BI=1.0, BW=1.0))
    assert own.step_time == pytest.approx(3.0)
    shared = simulate(plan, CostModel(F=1.0, B=2.0, BI=1.0, BW=1.0, cores=2))
    assert shared.step_time == pytest.approx(6.0) and shared.busy == own.busy
    assert simulate(plan, CostModel(F=1.0, B=2.0, BI=1.0, BW=1.0, cores=4)).step_time == pytest.approx(3.0)
    running = sorted((s, +1) for _, _, k, s, e in shared.timeline if plan.dag.nodes[k].is_compute) + \
        sorted((e, -1) for _, _, k, s, e in shared.timeline if plan.dag.nodes[k].is_compute)
    level = peak = 0
    for _, step in sorted(running, key=lambda x: (x[0], x[1])):
        level += step
        peak = max(peak, level)
    assert peak == 2


def test_a_forwards_activations_rise_over_its_span():
    """pp=1 x dp=2 at ZeRO-2: each microbatch's gradient (G) waits for its reduce-scatter, which
    also holds G while it runs, beside the next forward (1 s). The forward saves its activations
    (A per microbatch) as it runs: a reduce-scatter of 0.5 s ends half-way through it, at A/2 +
    2G (counting A from the forward's start gave A + 2G); one of 2 s outlasts it and ends half-way
    through the next backward (2 s), whose own gradient has risen to G/2 by then: A + 2.5G."""
    from piper_plugin.ir.graph import BackwardBytes

    peaks = {}
    for latency in (0.5, 2.0):
        cost = CostModel(F=1.0, B=2.0, latency_by_kind={Kind.REDUCE_SCATTER.value: latency})
        plan, result = _simulate("1f1b", 1, 4, dp=2, zero=2, cost=cost, backward=BackwardBytes())
        peaks[latency] = result.peak_transient_bytes
    (region,) = plan.dag.regions.values()
    activations = region.activation_bytes // 8  # 4 microbatches x 2 data shards
    gradient = sum(b.numel * 4 for b in plan.dag.buckets[region.name])
    assert 2 * gradient > activations / 2  # the reduce-scatter's end is the peak, not the forward's
    assert peaks[0.5] == [activations // 2 + 2 * gradient] * 2
    assert peaks[2.0] == [activations + 2 * gradient + gradient // 2] * 2
