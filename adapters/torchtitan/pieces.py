"""A TorchTitan MoE stage under expert parallelism, as pieces of one forward.

With ``expert_parallel_degree > 1`` each routed-expert layer of a stage hands its tokens off
twice (:mod:`.expert_dispatch`: dispatch, combine), so a stage with ``K`` such layers runs as
``2K + 1`` regions of Piper's DAG, ``<s>.0`` to ``<s>.<2K>``: dense pieces (even) and expert
pieces (odd, tagged ``EP="experts"``, holding that layer's grouped experts), joined by
``(tokens, counts)`` values that the ``shard`` directive routes through ALL_TO_ALL nodes.
One forward of the stage runs on a thread of its own (:class:`PausedForward`) and each piece's
task advances it to its next hand-off; each piece's backward runs alone
(:class:`~piper_plugin.autograd.graph_pieces.GraphPieces`).

Every dense parameter belongs to the first piece ``<s>.0``: the pieces' backwards run last to
first, so a stage's dense gradients for a microbatch are complete when ``<s>.0``'s backward
ends, where the plan reduces them (ZeRO 1-2). Invariant: a stage's forward hands off exactly
``2K`` times, the plan's pieces; anything else stops the step naming the stage.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.nn as nn

from piper_plugin import PausedForward

__all__ = ["routed_layers", "piece_name", "PausedStage", "PieceChunk", "tokens_name", "counts_name"]


def routed_layers(part: nn.Module) -> list[tuple[str, ...]]:
    """Per routed-expert layer of ``part`` in forward order: its grouped experts' parameter
    names (as ``part`` names them)."""
    from torchtitan.models.common.moe import RoutedExperts

    layers = []
    for name, module in part.named_modules():
        if isinstance(module, RoutedExperts):
            prefix = f"{name}.inner_experts."
            layers.append(tuple(prefix + n for n, _ in module.inner_experts.named_parameters()))
    return layers


def piece_name(stage: int, piece: int) -> str:
    return f"{stage}.{piece}"


def tokens_name(stage: int, piece: int) -> str:
    """The token rows piece ``piece`` of ``stage`` hands to the next piece."""
    return f"t{stage}.{piece}"


def counts_name(stage: int, piece: int) -> str:
    return f"c{stage}.{piece}"


class PausedStage:
    """One stage's forward per microbatch, advanced piece by piece; ``context`` (set per step)
    re-enters the caller's TorchTitan meshes on the forward's thread."""

    def __init__(self, stage: int, chunk: nn.Module, pieces: int, timeout_s: float = 300.0):
        self.stage, self.chunk, self.pieces, self.timeout_s = stage, chunk, pieces, timeout_s
        self.context: Callable[[], ContextManager[None]] | None = None
        self._runs: dict[int, PausedForward] = {}

    def forward(self, piece: int, microbatch: int, args: Sequence[Any]) -> tuple:
        if piece == 0:
            run = PausedForward(lambda: self.chunk(*args), timeout_s=self.timeout_s, context=self.context)
            self._runs[microbatch] = run
            done, value = run.run()
        else:
            done, value = self._runs[microbatch].run(tuple(args))
        if done != (piece == self.pieces - 1):
            raise RuntimeError(f"stage {self.stage}: its forward {'ended' if done else 'handed tokens off'} in piece "
                               f"{piece} of {self.pieces}, but the plan has {self.pieces - 1} hand-offs (two per "
                               f"routed-expert layer): a layer that routes conditionally cannot be planned")
        return tuple(value)

    def backward(self, piece: int, microbatch: int, outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        run = self._runs[microbatch]
        given = {id(t): g for t, g in zip(outs, grads)}
        run.pieces.backward(piece, [given.get(id(t)) for t in run.pieces.roots(piece)])
        if piece == 0:
            del self._runs[microbatch]


class PieceChunk(nn.Module):
    """Piece ``piece`` of a :class:`PausedStage` as a region's chunk (parameters: the stage's)."""

    def __init__(self, stage: PausedStage, piece: int):
        super().__init__()
        self.stage_chunk = stage.chunk
        object.__setattr__(self, "paused", stage)  # shared by the stage's pieces, not a submodule
        self.piece = piece

    def forward_piece(self, microbatch: int, args: Sequence[Any]) -> tuple:
        return self.paused.forward(self.piece, microbatch, args)

    def backward_piece(self, microbatch: int, outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        self.paused.backward(self.piece, microbatch, outs, grads)
