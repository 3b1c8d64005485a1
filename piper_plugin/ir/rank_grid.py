"""One grid of ranks, pp x dp x ep, from which every group is derived.

``rank(pp, dp, ep) = (pp * dp_size + dp) * ep_size + ep``. A pipeline rank's *slice* holds
``dp * ep`` ranks; each of them owns one data shard (``dp * ep_size + ep``). Dense parameters
are replicated over the whole slice (axis ``data``); experts sharded over ``ep`` are replicated
over ``dp`` only (axis ``dp``); all-to-all runs within ``ep`` groups.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankGrid", "AXES"]

AXES = ("data", "dp", "ep", "pp")


@dataclass(frozen=True)
class RankGrid:
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def data_shards(self) -> int:
        return self.dp * self.ep

    def rank(self, pp: int, dp: int = 0, ep: int = 0) -> int:
        return (pp * self.dp + dp) * self.ep + ep

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, ep) of ``rank``."""
        return rank // (self.dp * self.ep), (rank // self.ep) % self.dp, rank % self.ep

    def slice(self, pp: int) -> tuple[int, ...]:
        start = pp * self.dp * self.ep
        return tuple(range(start, start + self.dp * self.ep))

    def data_shard(self, rank: int) -> int:
        _, d, e = self.coords(rank)
        return d * self.ep + e

    def peer(self, rank: int, pp: int) -> int:
        """The rank in pipeline slice ``pp`` with the same (dp, ep) coordinates as ``rank``."""
        _, d, e = self.coords(rank)
        return self.rank(pp, d, e)

    def groups(self, axis: str, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Partition ``ranks`` into the communicator groups of ``axis``."""
        if axis not in AXES:
            raise ValueError(f"unknown grid axis {axis!r}; one of {AXES}")
        varying = {"data": (1, 2), "pp": (0,), "dp": (1,), "ep": (2,)}[axis]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in sorted(ranks):
            c = list(self.coords(r))
            for index in varying:
                c[index] = -1
            buckets.setdefault(tuple(c), []).append(r)
        return [tuple(g) for g in buckets.values()]

    def group_size(self, axis: str, ranks: tuple[int, ...]) -> int:
        """Members of each of ``axis``'s groups over ``ranks`` (the groups are of one size)."""
        return len(self.groups(axis, ranks)[0])

    def to_json(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep}
