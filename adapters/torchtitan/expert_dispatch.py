"""Expert-parallel token dispatch under the Piper engine.

TorchTitan's all-to-all dispatcher with its exchanges handed to Piper's plan instead of run in
place: the forward pauses at the dispatch and at the combine (:func:`hand_off`), and Piper's
ALL_TO_ALL nodes move the tokens on the ``ep`` stream while other work runs. Everything else
(routing, the local reorder, the expert-major permutation, scores and scatter-add) is
TorchTitan's own code, so the numbers are those of TorchTitan's engine.

Each hand-off is ``(tokens, counts)``: the rows to send, grouped by destination member, and
``counts`` (``n x g`` int64: for each member, ``g`` row counts that sum to the rows it gets).
The dispatch sends its per-expert counts (``g`` = experts per member) and gets back the rows and
the per-expert counts the other members sent it; the combine sends, per member, the rows that
member sent it and gets back its own tokens' rows.

Installed by TorchTitan's override mechanism on every ``AllToAllTokenDispatcher.Config`` of the
model (:func:`piper_token_dispatch`), so any TorchTitan MoE built from its MoE module takes it.
"""
from __future__ import annotations

import dataclasses

import torch
from torchtitan.config import override
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from piper_plugin import hand_off

__all__ = ["HandOffTokenDispatcher", "piper_token_dispatch", "OVERRIDE"]

OVERRIDE = f"{__name__}.piper_token_dispatch"


class HandOffTokenDispatcher(AllToAllTokenDispatcher):
    """TorchTitan's ``AllToAllTokenDispatcher`` whose exchanges are Piper hand-offs."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def _token_count_exchange(self, num_local_tokens_per_expert_E, pg, ep_size):
        return num_local_tokens_per_expert_E  # travels with the tokens (one hand-off)

    def _sync_token_count_exchange(self, num_local_tokens_per_expert_E, _counts, ep_size):
        global_counts = torch.empty_like(num_local_tokens_per_expert_E)  # filled by the dispatch
        input_splits = num_local_tokens_per_expert_E.view(ep_size, -1).sum(dim=1).tolist()
        output_splits: list[int] = []  # filled by the dispatch
        self._pending = (num_local_tokens_per_expert_E, global_counts, output_splits)
        return global_counts, input_splits, output_splits

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        counts, global_counts, splits = self._pending
        self._pending = None
        tokens, got = hand_off((routed_input_ND, counts), (routed_input_ND,))
        global_counts.copy_(got)
        splits.extend(got.view(len(input_splits), -1).sum(dim=1).tolist())
        return tokens

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        counts = torch.tensor(output_splits, dtype=torch.int64, device=routed_output_RD.device)
        tokens, _ = hand_off((routed_output_RD, counts), (routed_output_RD,))
        return tokens


@override(target=AllToAllTokenDispatcher.Config, exact=True,
          description="Piper: expert all-to-alls as ALL_TO_ALL nodes of the plan.")
def piper_token_dispatch(cfg: AllToAllTokenDispatcher.Config) -> HandOffTokenDispatcher.Config:
    return HandOffTokenDispatcher.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})

