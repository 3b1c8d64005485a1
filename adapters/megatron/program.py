"""Megatron model chunks as Piper module regions: one region per pipeline stage, no tracing.

Megatron builds each rank's model chunks for their stages itself (``pre_process`` /
``post_process``, ``vp_stage``): chunk ``k`` of pipeline rank ``r`` is stage ``k * pp + r``.
A stage's forward is the user's ``forward_step_func`` on that chunk, after
``set_input_tensor`` hands it the previous stage's hidden state, as Megatron's schedules do:

    stage 0:    (batch)          -> h0
    stage s:    (h{s-1}, batch)  -> h{s}
    last stage: (h{S-2}, batch)  -> loss   (the loss function's loss, scaled as Megatron does)

``batch`` is a :class:`Microbatch`: which microbatch this is, and the feed that gives the
user's function that microbatch's item of its data iterator, whatever order the plan runs
microbatches in. Only the hidden states cross ranks.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from piper_plugin import Program, Region

__all__ = ["MegatronProgram", "MegatronStageChunk", "LocalChunks", "Microbatch", "DataFeed", "StageRun",
           "build_program", "hidden_name", "set_aux_loss_scales", "INPUTS"]

INPUTS = ("batch",)


def hidden_name(stage: int) -> str:
    return f"h{stage}"


class DataFeed:
    """One model chunk's data iterator, read lazily in order: item ``i`` is the ``i``-th item the
    iterator yields, however the plan orders the microbatches."""

    def __init__(self, iterator: Iterator | None):
        self.iterator = iterator
        self.items: dict[int, Any] = {}
        self._read = 0

    def item(self, index: int) -> Any:
        while self._read <= index:
            self.items[self._read] = next(self.iterator)
            self._read += 1
        return self.items.pop(index)

    def for_microbatch(self, index: int) -> Iterator | None:
        return None if self.iterator is None else _OneItem(self, index)


class _OneItem:
    """What ``forward_step_func`` reads for one microbatch: that microbatch's item, once."""

    def __init__(self, feed: DataFeed, index: int):
        self.feed, self.index, self.done = feed, index, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise RuntimeError("forward_step_func read its data iterator twice in one microbatch; the Piper engine "
                               "gives each microbatch one item of the iterator, as Megatron's schedules read it")
        self.done = True
        return self.feed.item(self.index)


@dataclass(frozen=True)
class Microbatch:
    """The ``batch`` input of every stage region: microbatch ``index`` of the step."""

    index: int


@dataclass
class StageRun:
    """What one call of the forward-backward function gives every stage chunk."""

    forward_step_func: Callable[..., Any]
    feeds: dict[int, DataFeed]          # stage -> its chunk's data
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    cp_size: int
    first_val_step: bool | None
    store: dict[int, Any]               # microbatch -> what the last stage's loss function reported
    num_tokens: dict[int, torch.Tensor]  # microbatch -> its token count (3-tuple loss functions)


class MegatronStageChunk(nn.Module):
    """Stage ``stage`` of the pipeline: Megatron's ``forward_step`` (and, on the last stage, its
    loss scaling) around the user's ``forward_step_func`` on the model chunk."""

    def __init__(self, chunk: nn.Module, stage: int, last: bool):
        from megatron.core.utils import get_attr_wrapped_model

        super().__init__()
        self.chunk, self.stage, self.last = chunk, stage, last
        self.run: StageRun | None = None
        # what Megatron's forward_step looks up through the wrappers on every call, once
        object.__setattr__(self, "_set_input_tensor", get_attr_wrapped_model(chunk, "set_input_tensor"))
        object.__setattr__(self, "_config", get_attr_wrapped_model(chunk, "config"))

    def forward(self, *args) -> tuple[torch.Tensor, ...]:
        from megatron.core.pipeline_parallel.schedules import set_current_microbatch

        run, config, (*hidden, mb) = self.run, self._config, args
        index = mb.index
        # Megatron's check_first_val_step: only a forward-only call may say it is not the first
        first = index == 0 and (not run.forward_only or run.first_val_step is None or run.first_val_step)
        if first and hasattr(self.chunk, "set_is_first_microbatch"):
            self.chunk.set_is_first_microbatch()
        set_current_microbatch(self.chunk, index)
        self._set_input_tensor([hidden[0] if hidden else None])
        autocast = (torch.autocast("cuda", dtype=config.autocast_dtype) if config.enable_autocast
                    else contextlib.nullcontext())
        with autocast:
            output, loss_func = run.forward_step_func(run.feeds[self.stage].for_microbatch(index), self.chunk)
        if not self.last:
            return (output,)
        return (self._loss(output, loss_func, config, run, index),)

    def _loss(self, output, loss_func, config, run: StageRun, index: int) -> torch.Tensor:
        """Megatron's ``forward_step_calc_loss`` on the last stage, in its order of in-place ops
        (a loss function may report the very tensor it returns as its loss), then the gradient
        scale its ``backward_step`` applies."""
        if loss_func is None:
            run.store[index] = output
            return output
        if run.collect_non_loss_data:
            run.store[index] = loss_func(output, non_loss_data=True)
            return output
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            run.num_tokens[index] = num_tokens
            if not config.calculate_per_token_loss:
                loss /= torch.clamp(num_tokens, min=1)
                loss /= run.num_microbatches
        else:
            loss, reduced = outputs
            loss *= run.cp_size
            loss /= run.num_microbatches
        run.store[index] = reduced
        if not run.forward_only and config.grad_scale_func is not None:
            loss = config.grad_scale_func(loss)
        return loss


def set_aux_loss_scales(config, num_microbatches: int, cp_size: int, device: torch.device,
                        grad_scale: float = 1.0) -> None:
    """The scale MoE (and multi-token prediction) auxiliary losses start their backward from.
    Megatron's schedules set it after every forward to the same value for the whole step; it is
    set once, before the step. ``grad_scale``: the factor the plan's own loss gradient carries
    (under Piper's ZeRO, 1 / data-parallel size: the plan sums what Megatron's DDP averages)."""
    if getattr(config, "num_moe_experts", None) is not None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = config.grad_scale_func(torch.ones(1, device=device)) if config.grad_scale_func else torch.ones(1, device=device)
        MoEAuxLossAutoScaler.set_loss_scale(grad_scale * (scale if config.calculate_per_token_loss
                                                          else scale * cp_size / num_microbatches))
    if getattr(config, "mtp_num_layers", None) is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        scale = config.grad_scale_func(torch.ones(1, device=device)) if config.grad_scale_func else torch.ones(1, device=device)
        MTPLossAutoScaler.set_loss_scale(grad_scale * (scale if config.calculate_per_token_loss
                                                       else scale / num_microbatches))


class LocalChunks(nn.Module):
    """This rank's model chunks under ``stages.<s>`` (parameter names as the program has them)."""

    def __init__(self, chunks: dict[int, nn.Module]):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(chunks.items())})


ACTIVATIONS_PER_LAYER = 17  # hidden states a transformer layer keeps for its backward (estimate)


class MegatronProgram(Program):
    """A Program whose chunks are Megatron model chunks run by the user's ``forward_step_func``."""

    def instantiate(self, model: nn.Module, loss_fn: Callable[..., Any]) -> dict[str, nn.Module]:
        last = max(r.stage for r in self.regions.values())
        return {s: MegatronStageChunk(chunk, int(s), int(s) == last) for s, chunk in model.stages.items()}


def build_program(params: dict[int, list[tuple[str, tuple[int, ...], int]]], *, microbatch_size: int,
                  microbatches: int, hidden_shape: tuple[int, ...], dtype: torch.dtype,
                  model_type: str = "", attention_heads: int = 0, replicas: int = 1,
                  backward_splits: dict[int, bool] | None = None) -> MegatronProgram:
    """The single-device DAG of the pipeline's stages, from every stage's parameters
    ``(name in its chunk, shape, bytes)`` (gathered from the ranks that hold them). Sizes are
    for the plan's batch, ``microbatch_size * microbatches * replicas`` sequences: ``replicas``
    is the data-parallel size when the plan itself spans it (Piper's ZeRO; its data axis splits
    the batch into shards of Megatron's per-replica batch), 1 when Megatron's DDP keeps data
    parallelism outside the plan. ``hidden_shape`` is one microbatch's hidden state between
    stages (Megatron's ``[seq, batch, hidden]``). ``backward_splits``: per stage, whether its
    backward splits without repeating work (:func:`.linear.stage_backward_splits`, read from the
    chunk); a stage it leaves out splits only if it holds no linear layer."""
    num = len(params)
    if sorted(params) != list(range(num)):
        raise ValueError(f"stages {sorted(params)} are not 0..{num - 1}")
    numel_hidden = 1
    for d in hidden_shape:
        numel_hidden *= d
    samples = microbatch_size * microbatches * replicas  # the plan's batch
    hidden_bytes = numel_hidden * microbatches * replicas * torch.finfo(dtype).bits // 8
    tokens = hidden_shape[0] * samples
    regions: dict[str, Region] = {}
    param_bytes: dict[str, int] = {}
    param_shapes: dict[str, tuple[int, ...]] = {}
    for s in range(num):
        names = tuple(f"model.stages.{s}.{n}" for n, _, _ in params[s])
        for full, (_, shape, nbytes) in zip(names, params[s]):
            param_bytes[full], param_shapes[full] = nbytes, tuple(shape)
        inputs = (("batch",) if s == 0 else (hidden_name(s - 1), "batch"))
        outputs = ("loss",) if s == num - 1 else (hidden_name(s),)
        numel = sum(_numel(shape) for _, shape, _ in params[s])
        regions[str(s)] = Region(
            name=str(s), stage=s, index=s, tags={"PP": s}, params=names, inputs=inputs, outputs=outputs,
            value_bytes={v: (hidden_bytes if v.startswith("h") else 0) for v in inputs + outputs},
            activation_bytes=_activation_bytes(params[s], hidden_bytes, hidden_shape, attention_heads,
                                               torch.finfo(dtype).bits // 8, last=s == num - 1),
            param_bytes=sum(b for _, _, b in params[s]),
            flops=6 * tokens * numel, matmul_flops=_matmul_flops(params[s], tokens, hidden_shape),
            backward_splits=(backward_splits or {}).get(s, not _custom_linears(params[s])))
    return MegatronProgram.from_regions(
        regions, inputs=INPUTS, loss_value="loss", loss_region=str(num - 1),
        batch_size=samples, param_bytes=param_bytes, param_shapes=param_shapes,
        value_shapes={hidden_name(s): (hidden_shape[0], samples, *hidden_shape[2:])
                      for s in range(num - 1)},
        root_type=model_type)


def _activation_bytes(params: list[tuple[str, tuple[int, ...], int]], hidden_bytes: int, hidden_shape,
                      heads: int, itemsize: int, last: bool) -> int:
    """What a stage's forward keeps, estimated (Megatron's stages are not probed; ``piper
    calibrate --host megatron`` measures it): per transformer layer (a distinct ``layers.<i>``
    among its parameters) ~17 hidden states (the inputs of its norms, projections and MLP, the
    attention's q, k, v and output, the MLP's 4x-wide hidden counted as 4) and, with ``heads``
    given, the attention probabilities the local spec's unfused attention keeps (heads x
    sequence^2 per sample); on the last stage the logits (the vocabulary from its output layer,
    or the word embeddings it shares); and the stage's output."""
    layers = {m.group(1) for name, _, _ in params if (m := re.search(r"layers\.(\d+)\.", name))}
    seq, hidden = hidden_shape[0], hidden_shape[-1]
    samples = hidden_bytes // (seq * hidden * itemsize)  # the program's batch, in sequences
    probabilities = heads * seq * seq * samples * itemsize
    vocab = [shape[0] for name, shape, _ in params if len(shape) == 2 and (
        name.endswith("output_layer.weight") or name.endswith("word_embeddings.weight"))]
    logits = vocab[0] * seq * samples * itemsize if last and vocab else 0
    per_layer = hidden_bytes * ACTIVATIONS_PER_LAYER + probabilities
    return hidden_bytes + per_layer * max(len(layers), 1) + logits


def _custom_linears(params: list[tuple[str, tuple[int, ...], int]]) -> bool:
    """Whether a stage holds Megatron's linear layers (any 2-D weight outside the embeddings):
    custom autograd Functions that compute the input and the weight gradient in one call, so
    without the chunk to read (:func:`.linear.stage_backward_splits`) the stage's backward is
    taken not to split (``Region.backward_splits``; the plan runs a BI of it whole)."""
    return any(len(shape) == 2 and "embedding" not in name for name, shape, _ in params)


def _matmul_flops(params: list[tuple[str, tuple[int, ...], int]], tokens: int, hidden_shape) -> int:
    """A stage's forward matrix-product FLOPs for ``tokens`` tokens, from its parameters (Megatron's
    stages are not probed): 2 per token per element of each weight matrix outside the embeddings
    (a lookup: no FLOPs), and each attention layer's scores and weighted sum (``linear_qkv``:
    4 x sequence x hidden per token). An estimate: a MoE layer's experts count whole."""
    seq, hidden = hidden_shape[0], hidden_shape[-1]
    flops = 0
    for name, shape, _ in params:
        if len(shape) == 2 and "embedding" not in name:
            flops += 2 * tokens * _numel(shape)
        if name.endswith("linear_qkv.weight"):
            flops += 4 * tokens * seq * hidden
    return flops


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
