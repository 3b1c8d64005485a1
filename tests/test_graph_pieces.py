"""GraphPieces: a forward paused at hand-off points, its backward run piece by piece, last to
first, gives every leaf the gradients of one full backward through the uncut graph."""
import pytest
import torch

from piper_plugin.autograd.graph_pieces import GraphPieces


def _weights(seed: int, n: int = 5, dim: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(dim, dim, generator=g) / dim**0.5).requires_grad_() for _ in range(n)]


def _forward(x, w, hand_off, variant: int):
    """A stage with two hand-offs (like an MoE layer's dispatch and combine). Later code reads
    earlier tensors directly (residual, scores), a weight is used on both sides of a hand-off,
    and ``b`` is computed before the first hand-off but only read after the second."""
    a = x @ w[0]
    b = torch.tanh(x * 3.0) if variant else x.sum(-1, keepdim=True)  # not below the first root
    scores = torch.softmax(a @ w[1], dim=-1)
    sent = hand_off(torch.relu(a) @ w[1], "dispatch")  # piece 0 ends
    expert = torch.sigmoid(sent @ w[2]) @ w[3]  # the expert side: reads only what it was sent
    back = hand_off(expert, "combine")  # piece 1 ends
    y = back * scores + a @ w[0] + b  # piece 2: reads piece 0's tensors and w[0] again
    if variant == 2:
        y = y + (w[4] * 0).sum()  # a weight whose gradient is zero
    return (y ** 2).mean(), y


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_pieces_backward_equals_one_backward(variant):
    x_ref = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w_ref = _weights(0)
    loss, _ = _forward(x_ref, w_ref, lambda t, _: t * 1.0, variant)  # no cut: one graph
    loss.backward()

    x = x_ref.detach().clone().requires_grad_()
    w = _weights(0)
    pieces, handed = GraphPieces(), []

    def hand_off(t, _):
        pieces.end_piece([t])
        leaf = t.detach().requires_grad_()  # what the peer sends back, a fresh leaf
        handed.append(leaf)
        return leaf

    with pieces.forward():
        loss, _ = _forward(x, w, hand_off, variant)
        last = pieces.end_piece([loss])
    assert (len(pieces), last) == (3, 2)
    pieces.backward(2, [torch.ones(())])
    pieces.backward(1, [handed[1].grad])  # the combine's gradient travels back to the expert side
    pieces.backward(0, [handed[0].grad])
    for got, want in zip([x, *w], [x_ref, *w_ref]):
        if want.grad is None:
            assert got.grad is None or not got.grad.any()
        else:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_each_piece_runs_its_own_nodes_once():
    """Piece 2's backward does not run piece 0's nodes (they would run twice, or fail: freed)."""
    x = torch.randn(3, 6).requires_grad_()
    w = _weights(1)
    pieces, handed, calls = GraphPieces(), [], []

    def hand_off(t, name):
        t.register_hook(lambda g: calls.append(name))
        pieces.end_piece([t])
        handed.append(t.detach().requires_grad_())
        return handed[-1]

    with pieces.forward():
        loss, _ = _forward(x, w, hand_off, 1)
        pieces.end_piece([loss])
    pieces.backward(2, [torch.ones(())])
    assert x.grad is None and calls == []  # nothing of piece 0 ran, the hand-off roots untouched
    pieces.backward(1, [handed[1].grad])
    pieces.backward(0, [handed[0].grad])
    assert "dispatch" in calls and x.grad is not None


def test_wrong_number_of_gradients_is_refused():
    pieces = GraphPieces()
    t = torch.randn(2, requires_grad=True) * 2
    pieces.end_piece([t])
    with pytest.raises(ValueError, match="piece 0 has 1 roots but got 2"):
        pieces.backward(0, [torch.ones(2), torch.ones(2)])


def test_a_paused_forward_stops_at_each_hand_off_and_its_pieces_give_one_backward():
    from piper_plugin.runtime.paused_forward import PausedForward, hand_off

    x_ref = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    w_ref = _weights(3)
    loss, _ = _forward(x_ref, w_ref, lambda t, _: t * 1.0, 1)
    loss.backward()

    x = x_ref.detach().clone().requires_grad_()
    w = _weights(3)
    forward = PausedForward(lambda: _forward(x, w, lambda t, name: hand_off((name, t), (t,)), 1)[0], timeout_s=30)
    handed = []
    done, value = forward.run()
    while not done:  # each pause hands out (name, tensor); the peer's reply is a fresh leaf
        name, t = value
        handed.append(t.detach().requires_grad_())
        done, value = forward.run(handed[-1])
    assert [len(forward.pieces), done] == [3, True] and value.shape == ()
    forward.pieces.backward(2, [torch.ones(())])
    forward.pieces.backward(1, [handed[1].grad])
    forward.pieces.backward(0, [handed[0].grad])
    for got, want in zip([x, *w], [x_ref, *w_ref]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_a_failing_paused_forward_raises_its_own_error_and_a_stray_hand_off_is_refused():
    from piper_plugin.runtime.paused_forward import HandOffError, PausedForward, hand_off

    def broken():
        hand_off("first", ())
        raise KeyError("inside the expert layer")

    forward = PausedForward(broken, timeout_s=30)
    assert forward.run() == (False, "first")
    with pytest.raises(KeyError, match="inside the expert layer"):
        forward.run(None)
    with pytest.raises(HandOffError, match="outside a Piper paused forward"):
        hand_off(torch.ones(1))
