"""Pieces of parameters and gradients as one rank holds them, and how to stitch them whole.

A piece is a flat tensor covering ``names`` (in bucket order, each of ``shapes``): the whole
bucket, or (``n`` > 1, one name) member ``slot``'s rows of one parameter cut into ``n`` chunks
of ``ceil(rows / n)`` rows along dim 0; for EP-sharded experts, the slice ``ep_index`` of
``ep`` along the expert dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Piece", "stitch", "expected_flat"]


@dataclass
class Piece:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slot: int
    n: int
    ep_index: int
    ep: int
    flat: torch.Tensor
    rank: int = -1

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


def stitch(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """Whole tensors by name (without the ``model.`` prefix) from every rank's pieces."""
    groups: dict[tuple, dict[int, Piece]] = {}
    for p in pieces:
        groups.setdefault((p.names, p.ep_index), {})[p.slot] = p
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for (names, ep_index), parts in groups.items():
        first = next(iter(parts.values()))
        flat = torch.cat([parts[i].flat for i in sorted(parts)]) if first.n > 1 else first.flat
        offset = 0
        for name, shape in zip(names, first.shapes):
            size = int(torch.Size(shape).numel())
            slices.setdefault(name, {})[ep_index] = flat[offset:offset + size].view(shape)
            offset += size
    return {name.removeprefix("model."): torch.cat([s[i] for i in sorted(s)]) if len(s) > 1 else next(iter(s.values()))
            for name, s in slices.items()}


def expected_flat(piece: Piece, whole: dict[str, torch.Tensor]) -> torch.Tensor:
    """What ``piece`` must hold, cut from whole single-device tensors (for parity checks)."""
    parts = []
    for name in piece.names:
        t = whole[name.removeprefix("model.")]
        if piece.ep > 1:
            t = t.chunk(piece.ep)[piece.ep_index]
        parts.append(t.flatten())
    flat = torch.cat(parts)
    if piece.n == 1:
        return flat
    (shape,) = piece.shapes
    rows = shape[0] if shape else 1
    chunk = -(-rows // piece.n)
    per_row = flat.numel() // rows if rows else 0
    lo = min(rows, piece.slot * chunk)
    hi = min(rows, lo + chunk)
    return flat[lo * per_row:hi * per_row]
