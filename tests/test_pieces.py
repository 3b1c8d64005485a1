"""Stitching pieces whole: every data-parallel replica of a piece is compared, none stands in
for another unchecked (a replica that diverged fails every parity check that stitches)."""
import pytest
import torch

from piper_plugin.runtime.pieces import Piece, stitch


def _piece(rank: int, flat: torch.Tensor, slot: int = 0, n: int = 1, shape=(2, 3)) -> Piece:
    return Piece(("model.w",), (shape,), slot, n, 0, 1, flat, rank)


def test_equal_replicas_stitch_to_the_tensor():
    w = torch.arange(6.0)
    whole = stitch([_piece(0, w.clone()), _piece(1, w.clone())])
    assert torch.equal(whole["w"], w.view(2, 3))


def test_a_replica_that_differs_is_named():
    w = torch.arange(6.0)
    other = w.clone()
    other[5] += 1e-3
    with pytest.raises(ValueError, match=r"replicas of model.w \(slot 0\) differ: rank 0 and rank 1 by 2.00e-04 relative"):
        stitch([_piece(0, w), _piece(1, other)])


def test_the_last_replica_is_compared_too():
    """Three replicas, the third off: a dict keyed by slot would have kept only it."""
    w = torch.ones(6)
    with pytest.raises(ValueError, match="rank 0 and rank 2"):
        stitch([_piece(0, w), _piece(1, w.clone()), _piece(2, w * 2)])


def test_shards_of_one_parameter_are_not_replicas():
    """ZeRO slots 0 and 1 hold different rows: stitched, not compared."""
    whole = stitch([_piece(0, torch.zeros(3), slot=0, n=2), _piece(1, torch.ones(3), slot=1, n=2)])
    assert torch.equal(whole["w"], torch.tensor([[0.0, 0, 0], [1, 1, 1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_piece_pickles_by_value(dtype):
    """What a rank sends through a queue is a copy: nothing is left to fetch from a rank that exited."""
    import pickle

    piece = _piece(3, torch.arange(6.0).to(dtype))
    back = pickle.loads(pickle.dumps(piece))
    assert back.flat.dtype == dtype and torch.equal(back.flat, piece.flat) and back.rank == 3
    assert back.flat.untyped_storage().data_ptr() != piece.flat.untyped_storage().data_ptr()
