"""One forward, its backward in pieces: a forward that pauses (to send a value off the rank and
take back another, as an expert-parallel all-to-all does) is cut there into pieces whose
backwards run on their own, in between other work.

A piece ends at each pause (its roots: the values handed out) and at the end of the forward
(its roots: the forward's outputs); a value handed back is a fresh leaf. Later code also reads,
without a pause, what earlier pieces computed (a residual, routing scores): while the forward
runs under :meth:`GraphPieces.forward`, every op that reads a tensor an earlier piece made (and
that needs a gradient) reads a *proxy* instead, a leaf of the reading piece standing for it.
So no autograd edge leads from one piece into another: each piece is a graph of its own.

Invariant: running :meth:`GraphPieces.backward` for every piece, last to first, gives every leaf
(parameter, forward input, handed-back value) exactly the gradient of one full backward through
the uncut forward, accumulated into ``.grad``, and runs each autograd node once: piece ``j``
starts from its roots' gradients plus, for each of its tensors a later piece read, the gradient
that reached the proxy.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

__all__ = ["GraphPieces"]

_TAG = "_piper_piece"


class _ReadThroughProxies(TorchFunctionMode):
    def __init__(self, pieces: "GraphPieces"):
        super().__init__()
        self.pieces = pieces

    def __torch_function__(self, func, types, args=(), kwargs=None):
        pieces = self.pieces
        kwargs = kwargs or {}
        if pieces.index:
            args, kwargs = tree_map_only(torch.Tensor, pieces._read, (args, kwargs))
        out = func(*args, **kwargs)
        tree_map_only(torch.Tensor, pieces._made, out)
        return out


class GraphPieces:
    """The pieces of one forward, in forward order (see the module docstring)."""

    def __init__(self) -> None:
        self.index = 0  # the piece the forward is in
        self._roots: list[list[torch.Tensor]] = []
        # per reading piece: id(tensor of an earlier piece) -> (that tensor, its piece, the proxy)
        self._proxies: list[dict[int, tuple[torch.Tensor, int, torch.Tensor]]] = [{}]

    def __len__(self) -> int:
        return len(self._roots)

    @contextlib.contextmanager
    def forward(self) -> Iterator["GraphPieces"]:
        """Run the forward (all its pieces, on this thread) inside this block."""
        with _ReadThroughProxies(self):
            yield self

    def _made(self, t: torch.Tensor) -> None:
        if t.requires_grad and getattr(t, _TAG, None) is None:
            setattr(t, _TAG, (self, self.index))

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        tag = getattr(t, _TAG, None)
        if tag is None or tag[0] is not self or tag[1] == self.index or not t.requires_grad:
            return t
        seen = self._proxies[self.index]
        entry = seen.get(id(t))
        if entry is None:
            proxy = t.detach().requires_grad_()
            setattr(proxy, _TAG, (self, self.index))
            entry = seen[id(t)] = (t, tag[1], proxy)
        return entry[2]

    def roots(self, j: int) -> list[torch.Tensor]:
        """What piece ``j`` handed out (the order :meth:`backward` takes their gradients in)."""
        return list(self._roots[j])

    def end_piece(self, roots: Sequence[torch.Tensor]) -> int:
        """Close the current piece with ``roots`` (what it hands out); returns its index."""
        j = self.index
        self._roots.append(list(roots))
        self.index += 1
        self._proxies.append({})
        return j

    def backward(self, j: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Piece ``j``'s backward, ``grads`` matching the roots given to :meth:`end_piece`
        (None: no gradient); every later piece's backward must have run. Leaves accumulate
        into ``.grad``; the piece's graph is freed."""
        roots = self._roots[j]
        if len(grads) != len(roots):
            raise ValueError(f"piece {j} has {len(roots)} roots but got {len(grads)} gradients")
        outs, out_grads = [], []
        for t, g in zip(roots, grads):
            if g is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                outs.append(t)
                out_grads.append(g)
        for later in self._proxies[j + 1:]:
            for key in [k for k, (_, piece, _) in later.items() if piece == j]:
                t, _, proxy = later.pop(key)
                if proxy.grad is not None:
                    outs.append(t)
                    out_grads.append(proxy.grad)
        if outs:
            torch.autograd.backward(outs, out_grads)
        self._roots[j] = []
