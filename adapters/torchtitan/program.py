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

from piper_plugin.adapters.torchtitan.pieces import (
    PausedStage, PieceChunk, counts_name, piece_name, routed_layers, tokens_name,
)

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
        chunks: dict[str, nn.Module] = {}
        for s, part in model.parts():
            chunk = StageChunk(part, s == last, _bound_loss(loss_fn, part) if s == last else loss_fn)
            pieces = sorted(int(n.split(".")[1]) for n, r in self.regions.items() if r.stage == s and "." in n)
            if not pieces:
                chunks[str(s)] = chunk
                continue
            paused = PausedStage(s, chunk, len(pieces))
            chunks.update({piece_name(s, j): PieceChunk(paused, j) for j in pieces})
        return chunks


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
    """Shape and bytes of each parameter as this rank holds it (a TP DTensor: its local shard)."""
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in part.named_parameters()}
    return {f"model.stages.{stage}.{n}": (tuple(t.shape), t.numel() * t.element_size()) for n, t in local.items()}


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
                        data_shards: int = 1, routed: bool = False, expert_shards: int = 1,
                        compiled: bool = False) -> StageProgram:
    """The single-device DAG of ``len(parts)`` stages (parts may live on the meta device).

    Sizes are for the batch of one plan (``microbatch_size * microbatches`` sequences per data
    shard, ``data_shards`` of them when Piper's plan has a data-parallel axis); the hidden state
    between stages is ``[batch, seq_len, hidden_dim]`` of ``dtype``. ``routed``: stages with
    routed-expert layers run as pieces around their token hand-offs (:mod:`.pieces`);
    ``expert_shards``: the parts hold ``1 / expert_shards`` of each layer's experts (the host
    split them over the ep axis), recorded as the whole layer's shapes and bytes. ``compiled``:
    every part runs as compiled graphs (``--compile.enable`` with ``model``), whose backward
    yields input and weight gradients in one call, so no region's backward splits.
    """
    num = len(parts)
    batch = microbatch_size * microbatches * data_shards
    hidden_bytes = batch * seq_len * hidden_dim * torch.finfo(dtype).bits // 8
    regions: dict[str, Region] = {}
    param_bytes: dict[str, int] = {}
    param_shapes: dict[str, tuple[int, ...]] = {}
    routed_regions: list[str] = []
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
        stage = Region(
            name=str(s), stage=s, index=s, tags={"PP": s}, params=tuple(info), inputs=inputs, outputs=outputs,
            value_bytes=value_bytes, activation_bytes=hidden_bytes * max(1, len(list(part.children()))),
            param_bytes=sum(b for _, b in info.values()), flops=6 * batch * seq_len * numel,
            blocks=_blocks(part, s), backward_splits=not compiled)
        layers = routed_layers(part) if routed else []
        for name in (f"model.stages.{s}.{n}" for layer in layers for n in layer):
            shape, nbytes = info[name]
            info[name] = ((shape[0] * expert_shards, *shape[1:]), nbytes * expert_shards)
            param_shapes[name], param_bytes[name] = info[name]
        if not layers:
            regions[str(s)] = stage
            continue
        for piece in _pieces(stage, layers, s, info, batch * seq_len, hidden_bytes):
            regions[piece.name] = piece
            if "EP" in piece.tags:
                routed_regions.append(piece.name)
    return StageProgram.from_regions(
        regions, inputs=INPUTS, loss_value="loss", loss_region=next(n for n, r in regions.items() if "loss" in r.outputs),
        batch_size=batch, param_bytes=param_bytes, param_shapes=param_shapes,
        value_shapes={hidden_name(s): (batch, seq_len, hidden_dim) for s in range(num - 1)}, root_type=model_type,
        routed=routed_regions)


def _pieces(stage: Region, layers: list[tuple[str, ...]], s: int, info: dict, tokens: int,
            hidden_bytes: int) -> list[Region]:
    """``stage`` as ``2K + 1`` pieces around its ``K`` routed-expert layers' hand-offs: every
    dense parameter in the first piece, each layer's experts in its expert piece; compute and
    activations split evenly (an estimate), hand-offs sized as the hidden state."""
    prefix = f"model.stages.{s}."
    experts = [tuple(prefix + n for n in layer) for layer in layers]
    expert_names = {n for layer in experts for n in layer}
    dense = tuple(n for n in stage.params if n not in expert_names)
    count = 2 * len(layers) + 1
    out: list[Region] = []
    for j in range(count):
        inputs = stage.inputs if j == 0 else (tokens_name(s, j - 1), counts_name(s, j - 1))
        outputs = stage.outputs if j == count - 1 else (tokens_name(s, j), counts_name(s, j))
        params = dense if j == 0 else experts[j // 2] if j % 2 else ()
        value_bytes = {v: stage.value_bytes.get(v, hidden_bytes if v.startswith("t") else 8 * tokens)
                       for v in inputs + outputs}
        out.append(Region(
            name=piece_name(s, j), stage=s, index=stage.index, tags={**stage.tags, **({"EP": "experts"} if j % 2 else {})},
            params=params, inputs=inputs, outputs=outputs, value_bytes=value_bytes,
            activation_bytes=stage.activation_bytes // count, param_bytes=sum(info[n][1] for n in params),
            flops=stage.flops // count, backward_splits=stage.backward_splits))
    return out
