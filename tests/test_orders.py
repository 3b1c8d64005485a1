"""Tests for recipes/orders.py: completeness, feasibility, bubbles, memory.

``simulate_unit`` is a test-only list scheduler: each rank runs its list
strictly in order, an action starts once the rank is free and its
dependencies (on any rank) have finished; communication is free.
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections import Counter

import pytest

try:
    from piper_plugin.recipes import orders as O
except ImportError:  # recipes/ not installed as piper_plugin.recipes yet
    _path = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "orders.py"
    _spec = importlib.util.spec_from_file_location("_piper_recipes_orders", _path)
    O = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(O)

UNIT = {"F": 1, "B": 2, "BI": 1, "BW": 1}


def simulate_unit(orders, p, v, layout, cost=UNIT, overlap_fb=False):
    """List-schedule ``orders`` and return step_time, busy and bubble_time per rank.

    With ``overlap_fb`` an ``F`` immediately followed by a ``B``/``BI`` of a
    *different* stage on the same rank is one overlapped unit (DualPipe's
    F&B chunk): it starts when both inputs are ready, costs
    ``cost["F&B"]`` (default F + B) and releases both outputs at its end.
    Raises ``RuntimeError`` on deadlock or on an action for a foreign stage.
    """
    S = p * v
    done: dict[tuple, float] = {}  # ("F"|"G"|"W", stage, mb) -> finish time

    def deps(a):
        kind, s, i = a
        if kind == "F":
            return [("F", s - 1, i)] if s > 0 else []
        if kind in ("B", "BI"):
            return [("F", s, i)] + ([("G", s + 1, i)] if s < S - 1 else [])
        return [("I", s, i)]  # BW needs BI

    def produces(a):
        kind, s, i = a
        return {"F": [("F", s, i)], "B": [("G", s, i)],
                "BI": [("G", s, i), ("I", s, i)], "BW": [("W", s, i)]}[kind]

    for r, acts in enumerate(orders):
        for a in acts:
            if O.stage_rank(a[1], p, v, layout) != r:
                raise RuntimeError(f"rank {r} runs {a} of a stage it does not own")
    ptr, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = orders[r]
            while ptr[r] < len(acts):
                unit = acts[ptr[r]:ptr[r] + 1]
                nxt = acts[ptr[r] + 1] if ptr[r] + 1 < len(acts) else None
                if (overlap_fb and unit[0][0] == "F" and nxt is not None
                        and nxt[0] in ("B", "BI") and nxt[1] != unit[0][1]):
                    unit.append(nxt)
                need = [d for a in unit for d in deps(a)]
                if any(d not in done for d in need):
                    break
                c = (cost.get("F&B", cost["F"] + cost[unit[1][0]]) if len(unit) == 2
                     else cost[unit[0][0]])
                clock[r] = max([clock[r]] + [done[d] for d in need]) + c
                busy[r] += c
                for a in unit:
                    for key in produces(a):
                        done[key] = clock[r]
                ptr[r] += len(unit)
                progress = True
    if any(ptr[r] < len(orders[r]) for r in range(p)):
        stuck = {r: orders[r][ptr[r]] for r in range(p) if ptr[r] < len(orders[r])}
        raise RuntimeError(f"deadlock; ranks blocked at {stuck}")
    step = max(clock)
    return {"step_time": step, "busy": busy, "bubble_time": [step - b for b in busy]}


def peak_inflight(acts, release=("B", "BW")):
    """Max number of (stage, mb) activations held: +1 at F, -1 at a release kind."""
    cur = peak = 0
    for kind, _, _ in acts:
        cur += kind == "F"
        cur -= kind in release
        peak = max(peak, cur)
    return peak


def check_complete(orders, p, v, m, layout, split):
    """Each owned (stage, mb) has one F and one B, or one BI and a later BW.

    ``split``: "none" (only B), "all" (only BI + BW) or "mixed" (either).
    """
    assert len(orders) == p
    for r, acts in enumerate(orders):
        owned = O.stages_of_rank(r, p, v, layout)
        assert {a[1] for a in acts} == set(owned), f"rank {r} runs foreign stages"
        c = Counter(acts)
        assert set(c.values()) == {1}, f"rank {r} repeats an action"
        for s in owned:
            for i in range(m):
                assert c[("F", s, i)] == 1
                n_b, n_bi, n_bw = c[("B", s, i)], c[("BI", s, i)], c[("BW", s, i)]
                assert (n_b, n_bi, n_bw) in {
                    "none": [(1, 0, 0)], "all": [(0, 1, 1)],
                    "mixed": [(1, 0, 0), (0, 1, 1)]}[split]
                if n_bi:
                    assert acts.index(("BI", s, i)) < acts.index(("BW", s, i))
        assert all(0 <= a[2] < m and a[0] in ("F", "B", "BI", "BW") for a in acts)


PS = [2, 4, 8]
MS = [4, 8, 16]
GRID = [(p, m) for p in PS for m in MS]


def test_layouts():
    assert [O.stage_rank(s, 4, 2, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [O.stage_rank(s, 4, 2, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert O.stages_of_rank(1, 4, 3, "loop") == [1, 5, 9]
    assert O.stages_of_rank(0, 4, 2, "v") == [0, 7]
    with pytest.raises(ValueError, match="'v' layout needs v == 2, got v=3"):
        O.stage_rank(0, 4, 3, "v")
    with pytest.raises(ValueError, match="stage 8 out of range for p=4, v=2"):
        O.stage_rank(8, 4, 2, "loop")


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe(p, m):
    o = O.gpipe(p, m)
    check_complete(o, p, 1, m, "loop", "none")
    res = simulate_unit(o, p, 1, "loop")
    assert res["bubble_time"] == pytest.approx([(p - 1) * 3] * p)  # (p-1)(F+B)
    assert [peak_inflight(a) for a in o] == [m] * p


@pytest.mark.parametrize("p,m", GRID)
def test_one_f_one_b(p, m):
    o = O.one_f_one_b(p, m)
    check_complete(o, p, 1, m, "loop", "none")
    res = simulate_unit(o, p, 1, "loop")
    assert res["bubble_time"] == pytest.approx([(p - 1) * 3] * p)  # (p-1)(F+B)
    assert [peak_inflight(a) for a in o] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
def test_interleaved_1f1b(p, v, m):
    o = O.interleaved_1f1b(p, v, m)
    check_complete(o, p, v, m, "loop", "none")
    # Per-chunk costs are F/v and B/v of the whole-model costs F=1, B=2.
    cost = {k: c / v for k, c in UNIT.items()}
    res = simulate_unit(o, p, v, "loop", cost=cost)
    assert res["bubble_time"] == pytest.approx([(p - 1) * 3 / v] * p)  # (p-1)(F+B)/v
    assert res["step_time"] == pytest.approx(3 * m + (p - 1) * 3 / v)
    # Megatron memory: warm-up forwards + 1 chunk activations in flight.
    assert [peak_inflight(a) for a in o] == [
        min((v - 1) * p + 2 * (p - r - 1) + 1, v * m) for r in range(p)]


def test_interleaved_requires_divisible_m():
    with pytest.raises(ValueError, match="multiple"):
        O.interleaved_1f1b(4, 2, 6)


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1(p, m):
    o = O.zb_h1(p, m)
    check_complete(o, p, 1, m, "loop", "all")
    res = simulate_unit(o, p, 1, "loop")
    if m >= p:  # (p-1)(F + B - 2W), B = BI + BW = 2, W = 1
        assert res["bubble_time"] == pytest.approx([(p - 1) * (1 + 2 - 2)] * p)
    # Never worse than 1F1B; same peak memory as 1F1B (p on the busiest rank).
    assert max(res["bubble_time"]) <= (p - 1) * 3
    assert max(peak_inflight(a) for a in o) == min(p, m)
    assert [peak_inflight(a, ("BI",)) for a in o] == [min(p - r, m) for r in range(p)]


DPV = [(p, m) for p, m in GRID if m >= 2 * p] + [(3, 6), (3, 7), (4, 9)]


@pytest.mark.parametrize("p,m", DPV)
def test_dualpipev(p, m):
    o = O.dualpipev(p, m)
    check_complete(o, p, 2, m, "v", "mixed")
    assert any(a[0] == "BW" for a in o[0]) and any(a[0] == "B" for a in o[0])
    # Without F/B overlap, F and B of a pair are scheduled independently:
    # idle = (p-1)(F + B - 2W) = p-1 at unit costs -- half the README figure.
    res = simulate_unit(o, p, 2, "v")
    assert res["bubble_time"] == pytest.approx([p - 1] * p, rel=0.01)
    # DualPipe semantics: an F&B pair waits for both inputs and releases both
    # outputs at its end; with F&B = F+B = 3 this gives the README's
    # (PP/2 - 1)(F&B + B - 3W) with PP = 2p *stages*: (p-1)(3+2-3) = 2(p-1).
    res = simulate_unit(o, p, 2, "v", overlap_fb=True)
    assert res["bubble_time"] == pytest.approx([2 * (p - 1)] * p, rel=0.01)
    # With real overlap (F&B < F+B) the README formula is the worst rank's idle.
    cost = dict(UNIT, **{"F&B": 2.4})
    res = simulate_unit(o, p, 2, "v", cost=cost, overlap_fb=True)
    assert max(res["bubble_time"]) == pytest.approx((p - 1) * (2.4 + 2 - 3), rel=0.01)
    # README memory: PP + 1 = 2p + 1 stage activations per device.
    assert [peak_inflight(a) for a in o] == [2 * p + 1] * p


def test_dualpipev_phases():
    p, m = 4, 10
    o = O.dualpipev(p, m)
    # Rank 0 (stages 0 and 7): 6 F0, then F0 F7, then 3 x (BI7 BW7 F7).
    assert o[0][:6] == [("F", 0, i) for i in range(6)]
    assert o[0][6:8] == [("F", 0, 6), ("F", 7, 0)]
    assert o[0][8:11] == [("BI", 7, 0), ("BW", 7, 0), ("F", 7, 1)]
    # Last rank (stages 3 and 4): no step 1/3, step 2 is 4 x F3 F4, main loop next.
    assert o[3][:8] == [a for i in range(4) for a in (("F", 3, i), ("F", 4, i))]
    assert o[3][8:12] == [("F", 3, 4), ("B", 4, 0), ("F", 4, 4), ("B", 3, 0)]
    # Ends with step 8's r+1 deferred BWs.
    assert all(a[0] == "BW" for a in o[3][-4:]) and o[0][-1][0] == "BW"
    with pytest.raises(ValueError, match="2\\*p"):
        O.dualpipev(4, 7)


def test_simulator_detects_deadlock():
    o = O.one_f_one_b(2, 4)
    o[1] = [("B", 1, 0)] + [a for a in o[1] if a != ("B", 1, 0)]  # B before its F
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_unit(o, 2, 1, "loop")
    with pytest.raises(RuntimeError, match="does not own"):
        simulate_unit([o[1], o[0]], 2, 1, "loop")


@pytest.mark.parametrize("fn", [O.gpipe, O.one_f_one_b, O.zb_h1])
def test_invalid_sizes(fn):
    with pytest.raises(ValueError, match="need p >= 1, m >= 1, v >= 1; got p=0, m=4"):
        fn(0, 4)


# --- cross-check against torch.distributed.pipelining's own orders ---------

def _torch_orders(cls, p, m, **attrs):
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    obj = object.__new__(getattr(sched, cls))
    obj._n_microbatches, obj._num_stages, obj.pp_group_size = m, p, p
    for k, val in attrs.items():
        setattr(obj, k, val)
    if hasattr(obj, "_calculate_single_rank_operations"):
        obj.pipeline_order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
        if cls == "ScheduleInterleavedZeroBubble":
            obj.pipeline_order = obj._add_bubbles_to_actions(p * obj.n_local_stages)
        raw = obj.pipeline_order
    else:
        raw = obj._get_pipeline_order()
    names = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
    out = []
    for r in range(p):
        acts = []
        for a in raw[r]:
            for x in (a.sub_actions or (a,)) if a is not None else ():
                kind = x.computation_type.value
                if kind in names:
                    acts.append((names[kind], x.stage_index, x.microbatch_index))
        out.append(acts)
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_matches_torch(p, m):
    assert O.gpipe(p, m) == _torch_orders("ScheduleGPipe", p, m)
    # torch's Schedule1F1B._get_pipeline_order (a descriptive order, not what
    # its step() runs) numbers the last rank's forwards 1..m instead of 0..m-1:
    # renumbered, the last rank's order is compared too
    theirs = _torch_orders("Schedule1F1B", p, m)
    last = [(k, s, i - 1 if k == "F" else i) for k, s, i in theirs[-1]]
    assert sorted(i for k, _, i in theirs[-1] if k == "F") == list(range(1, m + 1))
    assert O.one_f_one_b(p, m) == theirs[:-1] + [last]
    for v in (2, 3):
        assert O.interleaved_1f1b(p, v, m) == _torch_orders(
            "ScheduleInterleaved1F1B", p, m, n_local_stages=v, microbatches_per_round=p)
    assert O.zb_h1(p, m) == _torch_orders(
        "ScheduleInterleavedZeroBubble", p, m, n_local_stages=1, microbatches_per_round=p)
    if m >= 2 * p:
        assert O.dualpipev(p, m) == _torch_orders("ScheduleDualPipeV", p, m)
