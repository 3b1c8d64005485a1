"""Megatron's linear layers with a backward that splits into input and weight passes.

Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` run one autograd Function that
computes the input gradient and the weight gradient in one call. Piper runs some backwards
split (input gradients first, weight gradients later: :mod:`piper_plugin.autograd.split_backward`),
and with that Function such a split runs the whole call twice, so the plans ran Megatron's
stages unsplit. :class:`SplitLinear` is the same layer's arithmetic, whose backward computes
only the gradients the running autograd pass will use: a full backward all of them, an
input pass the input's, a weight pass the weight's and the bias'. In a split's input pass it
hands the weight and bias gradients' work to the pass (``defers_weight_grads``,
:mod:`piper_plugin.autograd.deferred_weights`), so the weight pass runs just those kernels.

Invariants:
- :func:`install_split_linears` routes a layer's calls to :class:`SplitLinear` only where
  Megatron's Function accumulates nothing itself: no fused gradient accumulation, no deferred
  weight-gradient buffer, a trainable weight. Every other call runs Megatron's own. Its
  tensor-parallel communication (the input gradient all-reduced, or under sequence parallelism
  the input all-gathered and its gradient reduce-scattered) is SplitLinear's too, in the input
  pass only: a deferred weight pass computes locally, on the gathered input its input pass held.
- :class:`SplitLinear` computes Megatron's kernels on Megatron's tensors in Megatron's order
  (forward ``input @ weight.T + bias``; backward ``grad @ weight``, then the weight gradient on
  the 2-D views ``grad.T @ input`` and the bias gradient ``grad.sum(0)``), with Megatron's
  collectives: its results equal Megatron's Function's bit for bit, split or not.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge

from piper_plugin.autograd import deferred_weight_grads, will_execute

__all__ = ["SplitLinear", "install_split_linears", "stage_backward_splits"]

_MARK = "_piper_split_linear"


class SplitLinear(torch.autograd.Function):
    """``input @ weight.T (+ bias)``, with Megatron's tensor-parallel communication: under
    sequence parallelism the input is all-gathered over ``tp_group`` first; in backward the
    input gradient is all-reduced (``allreduce_dgrad``) or reduce-scattered (sequence parallel)
    over it. Its backward returns only the gradients the autograd engine will execute in the
    current pass (``backward_splits``: split_backward's mark for a Function whose weight pass
    does not repeat its input pass), and in a split's input pass that cleared this node it
    defers the weight and bias gradients to the weight pass, holding what they need (the
    gathered input under sequence parallelism: the weight pass communicates nothing)."""

    backward_splits = True
    defers_weight_grads = True

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, input, weight, bias, allreduce_dgrad=False, sequence_parallel=False, tp_group=None):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = _gathered(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        # the nodes the gradients of input, weight and bias go to (None: no gradient); the
        # engine says which will run
        nodes = ([node for node, _ in ctx.next_functions] + [None] * 3)[:3]
        wanted = [node is not None and will_execute(node) for node in nodes]
        store = deferred_weight_grads(ctx)
        defer = store is not None and not (wanted[1] or wanted[2])  # a split's input pass: BW computes them
        weights_now = wanted[1] or (ctx.use_bias and wanted[2])
        # Megatron's order and overlap: the input's all-gather runs under the input-gradient product,
        # the input gradient's reduction under the weight-gradient products
        total_input, gather = input, None
        if ctx.sequence_parallel and (defer or weights_now):
            total_input, gather = _gathered(input, ctx.tp_group, async_op=True)
        grad_input = grad_output.matmul(weight) if wanted[0] else None
        if gather is not None:
            gather.wait()
        reduction = None
        if grad_input is not None and ctx.allreduce_dgrad:
            reduction = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if grad_input is not None and ctx.sequence_parallel:
            from megatron.core.tensor_parallel.layers import dist_reduce_scatter_func

            shard = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            reduction = dist_reduce_scatter_func(shard, grad_input, group=ctx.tp_group, async_op=True)
            grad_input = shard
        rest = (None, None, None)  # allreduce_dgrad, sequence_parallel, tp_group
        if defer:
            # one gradient per existing edge: _weight_grads gives None exactly where there is none
            store.defer([GradientEdge(*ctx.next_functions[i]) for i in (1, 2) if nodes[i] is not None],
                        lambda: [g for g in _weight_grads(grad_output, total_input, nodes[1] is not None,
                                                          nodes[2] is not None) if g is not None],
                        holds=[grad_output, total_input])
            weight_grads = (None, None)
        else:
            weight_grads = _weight_grads(grad_output, total_input, wanted[1], ctx.use_bias and wanted[2])
        if reduction is not None:
            reduction.wait()
        return (grad_input, *weight_grads, *rest)


def _gathered(input: torch.Tensor, tp_group, async_op: bool = False):
    """``input`` all-gathered along its first (sequence) dimension over ``tp_group``, into a tensor
    of its own (Megatron gathers into a shared buffer the next layer reuses; a deferred weight
    pass holds this one); with ``async_op``, (tensor, work to wait for)."""
    from megatron.core.tensor_parallel.layers import dist_all_gather_func

    out = torch.empty((input.shape[0] * tp_group.size(), *input.shape[1:]), dtype=input.dtype, device=input.device)
    work = dist_all_gather_func(out, input.contiguous(), group=tp_group, async_op=async_op)
    return (out, work) if async_op else out


def _weight_grads(grad_output, input, weight: bool, bias: bool) -> tuple:
    """The weight and the bias gradient, each if asked for (else None): Megatron's kernels on
    its 2-D views (``grad.T @ input``, then ``grad.sum(0)``)."""
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    if not (weight or bias):
        return None, None
    grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, input)
    return grad_2d.t().matmul(input_2d) if weight else None, grad_2d.sum(dim=0) if bias else None


def _forward_impl(original, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                  sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **rest):
    """A layer's ``_forward_impl``: :class:`SplitLinear` where Megatron's Function would do its
    arithmetic and its tensor-parallel communication only (module doc), else Megatron's own."""
    if gradient_accumulation_fusion or grad_output_buffer is not None or not weight.requires_grad or rest:
        return original(input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                        grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                        tp_group=tp_group, **rest)
    if (allreduce_dgrad or sequence_parallel) and tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    return SplitLinear.apply(input, weight, bias, bool(allreduce_dgrad), bool(sequence_parallel), tp_group)


def _linear_types() -> tuple[type, ...]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _splits(module: nn.Module) -> bool:
    """Whether every call of this Megatron linear layer goes to :class:`SplitLinear` (the
    conditions of :func:`_forward_impl`, read from the layer)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return not (module.gradient_accumulation_fusion
                or (isinstance(module, ColumnParallelLinear) and module.config.defer_embedding_wgrad_compute))


def install_split_linears(chunk: nn.Module) -> None:
    """Route ``chunk``'s Megatron linear layers through :class:`SplitLinear` (once per layer)."""
    for module in chunk.modules():
        if isinstance(module, _linear_types()) and not getattr(module, _MARK, False):
            module._forward_impl = functools.partial(_forward_impl, module._forward_impl)
            setattr(module, _MARK, True)


def stage_backward_splits(chunk: nn.Module) -> bool:
    """Whether ``chunk``'s backward splits without repeating work after
    :func:`install_split_linears`: every module holding a matrix weight (other than an
    embedding table, a lookup) is a linear layer whose every call goes to :class:`SplitLinear`,
    and no activation recomputation (its Function refuses an input-only pass)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    linears, lookups = _linear_types(), (nn.Embedding, VocabParallelEmbedding)
    for module in chunk.modules():
        if getattr(getattr(module, "config", None), "recompute_granularity", None):
            return False  # Megatron's recomputation runs one full backward inside its Function
        if isinstance(module, linears):
            if not (getattr(module, _MARK, False) and _splits(module)):
                return False
        elif any(p.dim() == 2 for p in module.parameters(recurse=False)) and not isinstance(module, lookups):
            return False
    return True
