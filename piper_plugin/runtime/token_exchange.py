"""The ALL_TO_ALL nodes of a routed expert region: uneven, data-dependent splits.

Forward (``F.in`` dispatch, ``F.out`` combine): the producing region hands over ``(tokens,
counts)``, rows grouped by destination member in group order and ``counts`` (``n x g`` int64)
whose ``g`` entries per member sum to the rows that member gets. An even all-to-all of the
counts tells each member what it receives; the rows then move with per-member splits (a member
may send or get none). The node delivers the rows and the counts it received under the same
value names and keeps both splits for its backward (``B.in`` / ``B.out``), which sends the
rows' gradient back along the reverse splits.

Invariant: a backward exchange of value ``v`` for microbatch ``m`` uses the splits of the
forward exchange of ``v`` for ``m`` on this rank, so every member's gradient rows line up with
the rows it sent; a member with no gradient for its rows sends zeros (every member takes part).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from piper_plugin.ir.nodes import Node
from piper_plugin.runtime.rank_state import RankState

__all__ = ["TokenExchanges"]


class TokenExchanges:
    """One rank's routed all-to-alls and the splits their backwards need."""

    def __init__(self) -> None:
        # (value, microbatch) -> (rows sent per member, rows received per member, row shape, dtype)
        self._splits: dict[tuple[str, int], tuple[list[int], list[int], tuple[int, ...], torch.dtype]] = {}

    def run(self, state: RankState, node: Node, members: tuple[int, ...], group) -> None:
        region = state.dag.regions[node.region]
        n = len(members)
        box = state.take(node.key)
        if node.phase == "F":
            tokens_name, counts_name = region.inputs if node.qual == "F.in" else region.outputs
            tokens, counts = box[tokens_name].contiguous(), box[counts_name].contiguous()
            got_counts = torch.empty_like(counts)
            dist.all_to_all_single(got_counts, counts, group=group)
            sent = counts.view(n, -1).sum(dim=1).tolist()
            got = got_counts.view(n, -1).sum(dim=1).tolist()
            rows = tokens.new_empty((sum(got), *tokens.shape[1:]))
            dist.all_to_all_single(rows, tokens, output_split_sizes=got, input_split_sizes=sent, group=group)
            self._splits[(tokens_name, node.microbatch)] = (sent, got, tuple(tokens.shape[1:]), tokens.dtype)
            state.deliver(node.key, {tokens_name: rows, counts_name: got_counts})
        else:
            name = f"grad:{region.inputs[0] if node.qual == 'B.in' else region.outputs[0]}"
            sent, got, shape, dtype = self._splits.pop((name.removeprefix("grad:"), node.microbatch))
            grad = box.get(name)
            if grad is None:  # no gradient reached these rows: the peers still expect ours
                grad = torch.zeros((sum(got), *shape), dtype=dtype, device=state.device)
            rows = grad.new_empty((sum(sent), *shape))
            dist.all_to_all_single(rows, grad.contiguous(), output_split_sizes=sent, input_split_sizes=got,
                                   group=group)
            state.deliver(node.key, {name: rows})
        state.finished(node.key)
