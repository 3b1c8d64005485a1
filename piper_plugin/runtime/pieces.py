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

    def __reduce__(self):
        """Pickled by value (a numpy copy): torch's multiprocessing pickler would share the
        tensor's storage through its sender, which a rank may have left by the time it is read."""
        flat = self.flat.detach().cpu().contiguous().reshape(-1)
        return _piece, (self.names, self.shapes, self.slot, self.n, self.ep_index, self.ep,
                        flat.view(torch.uint8).numpy(), flat.dtype, self.rank)


def _piece(names, shapes, slot, n, ep_index, ep, raw, dtype, rank) -> Piece:
    return Piece(names, shapes, slot, n, ep_index, ep, torch.from_numpy(raw).view(dtype), rank)


def stitch(pieces: list[Piece], rtol: float = 1e-5) -> dict[str, torch.Tensor]:
    """Whole tensors by name (without the ``model.`` prefix) from every rank's pieces.

    Data-parallel replicas hold the same piece (same names, slot and expert slice); every copy
    is compared with the first, and copies that differ by more than ``rtol`` (relative to the
    first's largest magnitude) raise :class:`ValueError` naming the ranks: no replica stands in
    for another unchecked."""
    groups: dict[tuple, dict[int, Piece]] = {}
    for p in pieces:
        first = groups.setdefault((p.names, p.ep_index), {}).setdefault(p.slot, p)
        if first is not p:
            _same_replica(first, p, rtol)
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


def _same_replica(a: Piece, b: Piece, rtol: float) -> None:
    if a.flat.shape != b.flat.shape:
        raise ValueError(f"replicas of {a.names[0]}... (slot {a.slot}) have shapes {tuple(a.flat.shape)} on rank "
                         f"{a.rank} and {tuple(b.flat.shape)} on rank {b.rank}")
    scale = float(a.flat.abs().max()) if a.flat.numel() else 0.0
    gap = float((a.flat - b.flat).abs().max()) if a.flat.numel() else 0.0
    if gap > rtol * max(scale, 1e-12):
        raise ValueError(f"replicas of {', '.join(a.names)} (slot {a.slot}) differ: rank {a.rank} and rank {b.rank} "
                         f"by {gap / max(scale, 1e-12):.2e} relative")


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
