"""The memory meter: saved activations measured through hooks, then replayed once steps agree."""
from __future__ import annotations

import torch
import torch.nn as nn

from piper_plugin.runtime.memory import MemoryMeter

SHAPES = (("x", ((4, 8),)),)


def _counting(meter: MemoryMeter) -> list[int]:
    """Count the meter's pack-hook calls (the hooks the replay must leave out)."""
    calls = [0]
    pack = meter._pack

    def counted(t):
        calls[0] += 1
        return pack(t)

    meter._pack = counted
    return calls


def _step(meter: MemoryMeter, layer: nn.Module, shapes=SHAPES, rows: int = 4, leak: list | None = None):
    """One forward window and one backward window; returns (bytes after F, after B, step peak)."""
    meter.begin_step(shapes)
    x = torch.randn(rows, 8, requires_grad=True)
    with meter.window("F0", saves=True):
        y = layer(torch.tanh(x)).relu().sum()
    after_f = meter.current
    if leak is not None:  # a graph kept past its backward window: released outside any window
        leak.append(y)
    with meter.window("B0"):
        y.backward(retain_graph=leak is not None)
        del y
    return after_f, meter.current, meter.peak


def test_replayed_steps_reach_the_measured_values_without_hooks():
    meter, layer = MemoryMeter(), nn.Linear(8, 8)
    meter.ignore(list(layer.parameters()))
    calls = _counting(meter)
    seen = []
    for _ in range(4):
        before = calls[0]
        seen.append((_step(meter, layer), calls[0] - before))
    (measured, hooks0), (again, hooks1), (replayed, hooks2), (_, hooks3) = seen
    assert hooks0 > 0 and hooks1 > 0, "the first two steps are measured"
    assert hooks2 == 0 and hooks3 == 0, "agreeing steps must be replayed without hooks"
    assert measured == again == replayed
    after_f, after_b, peak = measured
    # the backward's working memory (gradients of tanh's output and of x, 4 x 8 floats each, at
    # least) comes on top of what the forward saved, and is gone by the backward's end
    assert after_f > 0 and after_b == 0 and peak >= after_f + 2 * 4 * 8 * 4


def test_new_batch_shapes_are_measured_again():
    meter, layer = MemoryMeter(), nn.Linear(8, 8)
    meter.ignore(list(layer.parameters()))
    calls = _counting(meter)
    for _ in range(3):
        small = _step(meter, layer)
    before = calls[0]
    big = _step(meter, layer, shapes=(("x", ((16, 8),)),), rows=16)
    assert calls[0] > before, "unseen shapes must be measured"
    assert big[0] > small[0]
    before = calls[0]
    assert _step(meter, layer) == small and calls[0] == before, "known shapes replay what they agreed on"


def test_a_release_outside_any_window_keeps_measuring():
    meter, layer = MemoryMeter(), nn.Linear(8, 8)
    meter.ignore(list(layer.parameters()))
    calls = _counting(meter)
    for _ in range(4):
        leak: list = []
        before = calls[0]
        _step(meter, layer, leak=leak)
        leak.clear()  # the graph (and what it saved) goes here, between windows
        assert calls[0] > before
        assert meter.current == 0


def test_an_untracked_meter_has_no_windows():
    meter, layer = MemoryMeter(), nn.Linear(8, 8)
    meter.track_saved = False
    calls = _counting(meter)
    for _ in range(3):
        assert _step(meter, layer) == (0, 0, 0)
    assert calls[0] == 0


def test_a_task_with_two_windows_replays_each_once():
    """A backward split around its sends (input gradients, then weight gradients) opens two
    windows under one task: the first keeps the graph, the second frees it. Replayed steps
    must free it once, so every step starts where the first did."""
    meter, layer = MemoryMeter(), nn.Linear(8, 8)
    meter.ignore(list(layer.parameters()))
    calls = _counting(meter)
    seen = []
    for _ in range(5):
        meter.begin_step(SHAPES)
        start, before = meter.current, calls[0]
        x = torch.randn(4, 8, requires_grad=True)
        with meter.window("F0", saves=True):
            y = layer(torch.tanh(x)).relu().sum()
        with meter.window("B0"):  # input gradients; the graph stays for the weight gradients
            torch.autograd.grad(y, x, retain_graph=True)
        with meter.window("B0"):  # weight gradients; the graph goes
            y.backward(inputs=list(layer.parameters()))
            del y
        seen.append((start, meter.current, meter.peak, calls[0] - before))
    assert all(hooks == 0 for *_, hooks in seen[2:]), "agreeing steps must be replayed"
    assert [s[:3] for s in seen] == [seen[0][:3]] * 5, seen
    assert seen[0][0] == seen[0][1] == 0 and seen[0][2] > 0


def test_working_memory_counts_what_ops_make_until_it_is_freed():
    """New storages count from the op that made them until freed; views and in-place results
    are not new; a tensor handed to other accounting is forgotten."""
    from piper_plugin.autograd.working_memory import WorkingMemory

    kept = torch.ones(1000)
    with WorkingMemory() as w:
        a = kept + 1  # 4000 bytes
        b = a * 2  # 8000 live
        del a
        c = b.view(-1).add_(1)  # a view, in place: nothing new
        d = b + 1  # a was freed before this op: 8000 live again
        high_so_far = w.high
        w.forget(d)  # counted elsewhere from here
        e = b - 1
    assert high_so_far == 8000 and w.live == 8000 and w.rise == 8000
    del b, c, d, e
    assert w.settle() == 0


def test_a_first_gradient_is_kept_state_not_working_memory():
    """A step's first backward makes each parameter's .grad (kept state, counted as gradients);
    later ones make a temporary and add it in. Either way the backward's working memory is the
    same: a new .grad leaves the working count once accumulated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 64))
    x = torch.randn(64, 8)
    rises = []
    for grads_exist in (False, True):
        meter = MemoryMeter()
        meter.ignore(list(model.parameters()))
        model.zero_grad(set_to_none=not grads_exist)
        if grads_exist:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        meter.begin_step(SHAPES)
        with meter.window("F0", saves=True):
            y = model(x).sum()
        start = meter.current
        with meter.window("B0"):
            y.backward()
            del y
        rises.append(meter.peak - start)
    # the widest moment: the gradient reaching tanh and tanh's own (64 x 512 floats each), while
    # the last layer's weight gradient (512 x 64 floats) is no longer working memory
    assert rises[0] == rises[1] >= 2 * 64 * 512 * 4
    assert rises[0] < 3 * 64 * 512 * 4


def test_a_replayed_window_reaches_what_others_added_inside_it():
    """What other code adds while a backward window runs (a block's gradient, counted from its
    accumulation until its reduce-scatter ends, inside the task) sits on top of the window's
    working memory; a replayed step has no op-by-op count, yet reaches the same peak. The
    window's own rise, which profiles read, leaves that addition out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 8))
    meter = MemoryMeter()
    meter.ignore(list(model.parameters()))
    first = model[2].weight  # the first gradient of the backward: added, then released at its end
    first.register_post_accumulate_grad_hook(lambda p: meter.add(p.grad.nbytes))
    calls = _counting(meter)
    seen = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        meter.begin_step(SHAPES)
        before = calls[0]
        x = torch.randn(32, 8)
        with meter.window("F0", saves=True):
            y = model(x).sum()
        with meter.window("B0"):
            y.backward()
            del y
            meter.add(-first.grad.nbytes)
        seen.append((meter.peak, meter.windows()[("B0", 0)], calls[0] - before))
    assert seen[2][2] == 0 and seen[3][2] == 0, "agreeing steps must be replayed"
    assert len({peak for peak, *_ in seen}) == 1, seen
    rise = seen[0][1][1]
    alone = MemoryMeter()  # the same steps with nothing added inside the window
    alone.ignore(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    alone.begin_step(SHAPES)
    with alone.window("F0", saves=True):
        y = model(torch.randn(32, 8)).sum()
    with alone.window("B0"):
        y.backward()
        del y
    assert alone.windows()[("B0", 0)][1] == rise
