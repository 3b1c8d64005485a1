"""Parameter buckets: the unit of gradient reduction and ZeRO sharding on one rank.

A bucket views its parameters as slices of one flat buffer padded to a multiple of the group
size. ``zero`` decides what stays resident:

* 0: full params, full grads, optimizer over the params themselves;
* 1, 2: full params, optimizer over this rank's shard (a flat ``nn.Parameter`` viewing its slice
  of the buffer: the update lands in the params, no second copy);
* 3: only the shard; ``materialize`` refills the flat buffer (same storage, so autograd's saved
  references stay valid), ``release`` frees it once its last consumer finished.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["FlatBucket"]


class FlatBucket:
    def __init__(self, params: list[nn.Parameter], zero: int, group_size: int, index_in_group: int):
        self.params = params
        self.zero = zero
        self.n = group_size
        self.index = index_in_group
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // self.n) * self.n
        self.shard_numel = self.padded // self.n
        dtype = params[0].dtype
        self.flat = torch.zeros(self.padded, dtype=dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                self.flat[offset:offset + p.numel()].copy_(p.detach().flatten())
                p.data = self.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        lo = self.index * self.shard_numel
        own = self.flat[lo:lo + self.shard_numel]  # ZeRO-1/2: the optimizer updates it in place
        self.shard = nn.Parameter(own.clone() if zero == 3 else own) if zero >= 1 else None
        self.refs = 0
        if zero == 3:
            self.release()

    # -- parameters -----------------------------------------------------------------------
    @property
    def materialized(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def allocate(self) -> torch.Tensor:
        """Give the flat buffer its storage back (same storage object) and return it."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.flat.element_size())
        return self.flat

    def materialize(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.allocate().copy_(full)

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def shard_data(self) -> torch.Tensor:
        return self.shard.detach()

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.params) if self.shard is None else [self.shard]

    # -- gradients --------------------------------------------------------------------------
    def flat_grad(self, take: bool = True) -> torch.Tensor:
        """This rank's accumulated gradient as one padded flat tensor (``take`` clears p.grad)."""
        out = torch.zeros(self.padded, dtype=self.flat.dtype, device=self.flat.device)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                out[offset:offset + p.numel()] = p.grad.flatten()
            if take:
                p.grad = None
            offset += p.numel()
        return out

    def set_grad(self, flat: torch.Tensor) -> None:
        """Write a full reduced gradient back into the parameters' ``.grad``."""
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def add_shard_grad(self, shard_grad: torch.Tensor) -> None:
        if self.shard.grad is None:
            self.shard.grad = shard_grad.clone()
        else:
            self.shard.grad.add_(shard_grad)
