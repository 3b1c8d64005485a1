"""A split backward's cheap weight pass: custom Functions that defer their weight gradients from
BI to BW, and vector weights (norm scales, biases) whose gradients BI computes and BW
accumulates. Either way: one full backward's gradients, no weight touched before BW, each
accumulator's hook run once, in BW."""
import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge

from piper_plugin.autograd import backward_input, deferred_weight_grads, will_execute


class _DeferringLinear(torch.autograd.Function):
    """``x @ W.T + b``; computes only the gradients the running pass executes and, in a split's
    input pass that cleared it, defers W's and b's."""

    backward_splits = True
    defers_weight_grads = True
    backwards = computes = 0

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        _DeferringLinear.backwards += 1
        wanted = [n is not None and will_execute(n) for n, _ in ctx.next_functions]

        def weight_grads():
            _DeferringLinear.computes += 1
            rows = g.flatten(0, -2)
            return rows.T @ x.flatten(0, -2), rows.sum(0)

        grad_x = g @ weight if wanted[0] else None
        store = deferred_weight_grads(ctx)
        if store is not None and not (wanted[1] or wanted[2]):
            store.defer([GradientEdge(*ctx.next_functions[i]) for i in (1, 2)], weight_grads, holds=[g])
            return grad_x, None, None
        gw, gb = weight_grads() if wanted[1] or wanted[2] else (None, None)
        return grad_x, gw if wanted[1] else None, gb if wanted[2] else None


def _layers():
    torch.manual_seed(0)
    first, second, norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)
    return first, second, norm


def _forward(first, second, norm, x, shared: bool = False):
    h = _DeferringLinear.apply(x, first.weight, first.bias)
    h = norm(h).relu()
    if shared:  # the first layer's weight read again outside the Function: that group replays
        h = h + (h @ first.weight).sin()
    return _DeferringLinear.apply(h, second.weight, second.bias).tanh()


def _full_then_split(shared: bool):
    layers = _layers()
    weights = [p for m in layers for p in m.parameters()]
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = _forward(*layers, x, shared)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad([out], [x, *weights], [grad])
    hooked: list[int] = []
    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(lambda _, i=i: hooked.append(i))
    out = _forward(*layers, x, shared)
    _DeferringLinear.backwards = _DeferringLinear.computes = 0
    got, pending = backward_input([out], [grad], [x])
    after_bi = (_DeferringLinear.backwards, _DeferringLinear.computes, list(hooked),
                [w.grad is None for w in weights], pending.recorded_bytes)
    pending.run()
    torch.testing.assert_close(got[0], expected[0])
    for w, e in zip(weights, expected[1:]):
        torch.testing.assert_close(w.grad, e, rtol=1e-6, atol=1e-7)
    return after_bi, (_DeferringLinear.backwards, _DeferringLinear.computes), sorted(hooked), len(weights)


def test_deferring_functions_run_once_and_bw_computes_their_weight_gradients():
    (backwards, computes, hooked, untouched, kept), after_bw, hooked_bw, n = _full_then_split(shared=False)
    assert (backwards, computes) == (2, 0), "BI ran each Function once and deferred its weight work"
    assert hooked == [] and all(untouched), "no weight saw a gradient in BI"
    assert after_bw == (2, 2), "BW computed the deferred work without running the Functions again"
    assert hooked_bw == list(range(n)), "each accumulator's hook ran once, in BW"
    # kept for BW: the two Functions' incoming gradients (2x5x8) and the norm's two vector grads
    assert kept == 4 * (2 * 2 * 5 * 8 + 2 * 8)


def test_a_function_whose_weight_is_read_elsewhere_is_replayed_not_deferred():
    (backwards, computes, hooked, untouched, _), after_bw, hooked_bw, n = _full_then_split(shared=True)
    assert (backwards, computes) == (2, 0) and hooked == [] and all(untouched)
    # the second Function defers; the first shares its weight with a plain matmul: BW replays it
    # (its backward runs again, for the weight alone)
    assert after_bw == (3, 2)
    assert hooked_bw == list(range(n))


def test_a_vector_weight_also_below_an_output_that_reaches_no_input_is_counted_once():
    """BI's call reaches a vector weight from every output; one that also hangs below an output
    whose graph reaches no input (run on its own in BW) is left to BW, or it counts twice."""
    torch.manual_seed(0)
    b = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    outs = lambda: [(x * b).sin(), b.exp() * 2]  # noqa: E731
    grads = [torch.randn(3, 4), torch.randn(4)]
    expected = torch.autograd.grad(outs(), [x, b], grads)
    got, pending = backward_input(outs(), grads, [x])
    assert b.grad is None
    pending.run()
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(b.grad, expected[1])


def test_a_cleared_node_finds_its_store_from_another_thread():
    """On a GPU autograd runs a backward on the device's own thread: the store a BI opened is
    found there too, only for the nodes it cleared, and only while it is open."""
    import threading

    from piper_plugin.autograd import DeferredWeightGrads

    x = torch.randn(2, requires_grad=True)
    cleared, other = (x * 2).grad_fn, (x * 3).grad_fn
    store, seen = DeferredWeightGrads({cleared}), []

    def look():
        seen.append((deferred_weight_grads(cleared), deferred_weight_grads(other)))

    with store:
        worker = threading.Thread(target=look)
        worker.start()
        worker.join()
    look()
    assert seen == [(store, None), (None, None)]
