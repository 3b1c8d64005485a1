"""Module-region capture for TorchTitan models: one region per pipeline stage, no tracing.

TorchTitan's decoders are not fx-traceable as a whole (MoE routing, RoPE caches, chunked
loss), but they are built to be sliced: a stage is a copy of the model keeping only its
modules (``tok_embeddings``, ``layers.i``, ``norm``, ``lm_head``), and the model's forward
tolerates the missing ones. Here each stage is one region of Piper's single-device DAG:

    stage 0:       (tokens, kwargs)                    -> h0
    stage s:       (h{s-1}, kwargs)                    -> h{s}
    last stage:    (h{S-2}, kwargs, labels, loss_kwargs) -> loss

``tokens``, ``labels``, ``kwargs`` (the per-microbatch model kwargs, e.g. positions) and
``loss_kwargs`` (``global_valid_tokens``) are model inputs, present on the ranks that need them;
only the hidden states ``h*`` (and their gradients) cross ranks. The DAG is the one
:func:`piper_plugin.capture` would build for the same regions (``Program.from_regions``), so every directive,
recipe, the scheduler and the runtime apply unchanged.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from piper_plugin import Program, Region

__all__ = ["StageProgram", "StageChunk", "build_stage_program", "hidden_name", "INPUTS"]

INPUTS = ("tokens", "kwargs", "labels", "loss_kwargs")


def hidden_name(stage: int) -> str:
    return f"h{stage}"


class StageChunk(nn.Module):
    """One stage's forward (and, on the last stage, the loss) as a Piper chunk.

    Called with the region's inputs in order; returns the region's outputs as a tuple.
    ``part`` is the real model part TorchTitan's optimizer steps (parameters are shared).
    """

    def __init__(self, part: nn.Module, last: bool, loss_fn: Callable[..., Any]):
        super().__init__()
        self.part = part
        self.last = last
        object.__setattr__(self, "_loss_fn", loss_fn)  # not a submodule: it may hold lm_head

    def forward(self, x: torch.Tensor, kwargs: dict[str, Any], labels: torch.Tensor | None = None,
                loss_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, ...]:
        out = self.part(x, **(kwargs or {}))
        if not self.last:
            return (out,)
        loss = self._loss_fn(out, labels, **(loss_kwargs or {}))
        if isinstance(loss, tuple):  # TorchTitan losses return (loss, metrics)
            loss = loss[0]
        return (loss,)


class StageProgram(Program):
    """A Program whose chunks are stage modules instead of fx graphs.

    ``instantiate(model, loss_fn)`` expects ``model`` to be a :class:`LocalStages` holding this
    rank's parts; remote stages get no chunk (the runtime only runs its own regions).
    """

    def instantiate(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> dict[str, nn.Module]:
        last = max(r.stage for r in self.regions.values())
        return {str(s): StageChunk(part, s == last, _bound_loss(loss_fn, part) if s == last else loss_fn)
                for s, part in model.parts()}


def _bound_loss(loss_fn: Callable[..., Any], part: nn.Module) -> Callable[..., Any]:
    """A loss that computes the logits with a head of its own (TorchTitan's ChunkedLossWrapper,
    its stage skipping ``lm_head``) bound to ``part``'s head: the stage that runs it, whatever
    copy of the model that is (the memory probe runs fake copies)."""
    head = getattr(part, "lm_head", None)
    if head is None or not hasattr(loss_fn, "set_lm_head"):
        return loss_fn
    bound = copy.copy(loss_fn)  # not a module: its own attributes
    bound.set_lm_head(head)
    return bound


class LocalStages(nn.Module):
    """This rank's model parts under ``stages.<s>`` (parameter names as the program has them)."""

    def __init__(self, parts: dict[int, nn.Module]):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(parts.items())})

    def parts(self) -> list[tuple[int, nn.Module]]:
        return [(int(s), m) for s, m in self.stages.items()]


def _param_info(part: nn.Module, stage: int) -> dict[str, tuple[tuple[int, ...], int]]:
    return {f"model.stages.{stage}.{n}": (tuple(p.shape), p.numel() * p.element_size())
            for n, p in part.named_parameters()}


def _blocks(part: nn.Module, stage: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The stage's transformer blocks (``layers.<i>``, FSDP's units in TorchTitan), in order:
    (path in its :class:`StageChunk`, parameter names)."""
    layers = getattr(part, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return ()
    # names as the part has them: a block wrapped for activation checkpointing hides its wrapper's
    # prefix from its own named_parameters(), not from its parent's
    names = [n for n, _ in part.named_parameters()]
    return tuple((f"part.layers.{name}", tuple(f"model.stages.{stage}.{n}" for n in names
                                                if n.startswith(f"layers.{name}.")))
                 for name, _ in layers.named_children())


def build_stage_program(parts: Sequence[nn.Module], *, microbatch_size: int, microbatches: int, seq_len: int,
                        hidden_dim: int, dtype: torch.dtype, model_type: str = "",
                        data_shards: int = 1) -> StageProgram:
    """The single-device DAG of ``len(parts)`` stages (parts may live on the meta device).

    Sizes are for the batch of one plan (``microbatch_size * microbatches`` sequences per data
    shard, ``data_shards`` of them when Piper's plan has a data-parallel axis); the hidden state
    between stages is ``[batch, seq_len, hidden_dim]`` of ``dtype``.
    """
    num = len(parts)
    batch = microbatch_size * microbatches * data_shards
    hidden_bytes = batch * seq_len * hidden_dim * torch.finfo(dtype).bits // 8
    regions: dict[str, Region] = {}
    param_bytes: dict[str, int] = {}
    param_shapes: dict[str, tuple[int, ...]] = {}
    for s, part in enumerate(parts):
        info = _param_info(part, s)
        param_bytes.update({n: b for n, (_, b) in info.items()})
        param_shapes.update({n: shape for n, (shape, _) in info.items()})
        inputs = ("tokens" if s == 0 else hidden_name(s - 1), "kwargs")
        if s == num - 1:
            inputs += ("labels", "loss_kwargs")
        outputs = ("loss",) if s == num - 1 else (hidden_name(s),)
        value_bytes = {v: (hidden_bytes if v.startswith("h") else 0) for v in inputs + outputs}
        numel = sum(p.numel() for p in part.parameters())
        regions[str(s)] = Region(
            name=str(s), stage=s, index=s, tags={"PP": s}, params=tuple(info), inputs=inputs, outputs=outputs,
            value_bytes=value_bytes, activation_bytes=hidden_bytes * max(1, len(list(part.children()))),
            param_bytes=sum(b for _, b in info.values()), flops=6 * batch * seq_len * numel,
            blocks=_blocks(part, s))
    return StageProgram.from_regions(
        regions, inputs=INPUTS, loss_value="loss", loss_region=str(num - 1), batch_size=batch,
        param_bytes=param_bytes, param_shapes=param_shapes,
        value_shapes={hidden_name(s): (batch, seq_len, hidden_dim) for s in range(num - 1)}, root_type=model_type)
