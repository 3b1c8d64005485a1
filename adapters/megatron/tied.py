"""Tied word embeddings where a recipe builds the stages in its own layout (DualPipeV's V).

Megatron ties the input embedding and the output layer across its pipeline by keeping a copy of
the embedding on the last stage, made equal at start, whose gradient ``finalize_model_grads``
all-reduces with the first stage's over its embedding group (the first and last pipeline
ranks of Megatron's layout). A recipe that builds each stage as a model of its own puts the
first and last stages elsewhere: DualPipeV's V puts both on pipeline rank 0, where Megatron's
reduction pairs the wrong chunks (and its ranks disagree on whether to reduce at all).

Here the two copies live in two chunks of one rank. Invariants:
- the output layer's weight starts as a copy of the embedding's and carries Megatron's tags for
  a duplicate (``shared``: counted once in the gradient norm; ``shared_embedding``: a bucket of
  its own under the distributed optimizer, so both copies shard alike);
- after ``finalize_model_grads`` (with the embedding reduction left out) both copies hold the sum
  of their gradients, so the optimizer applies one update to both and they stay equal.
A layout that puts the first and last stages on different pipeline ranks is refused.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from piper_plugin.adapters.megatron.errors import ArgumentError
from piper_plugin.adapters.megatron.schedule import unwrap_chunk

__all__ = ["check_tied_layout", "tie_output_to_embedding", "tied_finalize"]


def check_tied_layout(recipe: str, placement: dict[int, int]) -> None:
    """Refuse a tied model whose first and last stages this layout puts on different ranks."""
    first, last = placement[0], placement[len(placement) - 1]
    if first != last:
        raise ArgumentError(f"--piper-recipe {recipe} puts the first and last stages on pipeline ranks {first} and "
                            f"{last}; tied embeddings in a recipe's own layout need both on one rank (as "
                            f"DualPipeV's V): add --untie-embeddings-and-output-weights")


def tie_output_to_embedding(models: list[nn.Module]) -> None:
    """Among this rank's stage models (GPTModels, before any wrapping): if it holds the first and
    the last stage, set the output weight to the embedding's values and tag both as Megatron tags
    its copies."""
    copies = _copies(models)
    if copies is None:
        return
    embedding, output = copies
    with torch.no_grad():
        output.copy_(embedding)
    embedding.shared_embedding = True
    output.shared, output.shared_embedding = True, True


def tied_finalize() -> Callable[..., None]:
    """``finalize_model_grads`` for a recipe's own layout: Megatron's, without its embedding
    reductions (no chunk pair of its embedding group holds the copies), then the two copies of
    the tied weight on the rank holding both each get the sum of both gradients (found in the
    chunks at each call: under Piper's ZeRO the parameters are faces made after the build).
    Collective: every rank calls it (it makes one single-rank group per rank, Megatron's way to
    say "no reduction")."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    alone, _ = dist.new_subgroups(group_size=1)
    mpu_groups = None  # Megatron's own groups so, made at the first call that passes none

    def finalize(model: list[nn.Module], num_tokens: torch.Tensor | None = None, pg_collection: Any = None,
                 force_all_reduce: bool | None = False) -> None:
        nonlocal mpu_groups
        if pg_collection is not None:
            groups = _without_embedding_groups(pg_collection, alone)
        else:
            groups = mpu_groups = mpu_groups or _without_embedding_groups(None, alone)
        finalize_model_grads(model, num_tokens, pg_collection=groups, force_all_reduce=force_all_reduce)
        copies = _copies([unwrap_chunk(chunk) for chunk in model])
        if copies is None:
            return
        grads = [_local(_grad(p)) for p in copies]
        if any(g is None for g in grads):
            return  # a frozen embedding
        total = grads[0] + grads[1]
        for g in grads:
            g.copy_(total)

    return finalize


def _copies(models: list[nn.Module]) -> tuple[nn.Parameter, nn.Parameter] | None:
    """(embedding weight, output weight) where these stage models hold both as two parameters."""
    pre = [m for m in models if m.pre_process]
    post = [m for m in models if m.post_process]
    if not pre or not post or post[0].output_layer.weight is None:
        return None
    embedding, output = pre[0].embedding.word_embeddings.weight, post[0].output_layer.weight
    return None if output is embedding else (embedding, output)


def _without_embedding_groups(pg_collection: Any, alone: dist.ProcessGroup) -> Any:
    """The caller's process groups (default: Megatron's) with this rank alone as the embedding
    groups: Megatron reduces over a group of one as over none."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "dp_cp"])
    else:
        pg_collection = copy.copy(pg_collection)
    pg_collection.embd, pg_collection.pos_embd = alone, alone
    return pg_collection


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient Megatron's optimizer reads: DDP's ``main_grad``, else ``grad``."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gradient's local rows (both copies are sharded alike), else the tensor."""
    return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad
