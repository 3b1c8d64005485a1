"""Megatron-LM's evaluation for :mod:`.pretrain_gpt`: ``--eval-iters`` global batches of the
validation (or test) split, forward only, every ``--eval-interval`` iterations and after the last.

Invariants, as Megatron-LM's ``evaluate`` and ``evaluate_and_print_results``:
- the chunks run in eval mode (no dropout) under ``torch.no_grad`` with the step's microbatch
  count, then go back to train mode;
- a split's batches continue from where its last evaluation stopped; resumed at iteration ``i``
  the validation split starts after ``(i // eval_interval) * eval_iters`` global batches;
- the reported value of a key is its sum over every microbatch of every batch, a
  ``[loss sum, tokens]`` report divided through; its perplexity is ``exp(min(20, value))``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from piper_plugin.adapters.megatron.data import chunk_iterators

__all__ = ["SplitEvaluation", "result_lines"]


class SplitEvaluation:
    """One split's evaluations: the batches it has read so far and how to run one."""

    def __init__(self, dataset: Any, args: Any, *, dp: int, dp_rank: int, consumed_batches: int = 0):
        self.dataset, self.args, self.dp, self.dp_rank = dataset, args, dp, dp_rank
        self.consumed = consumed_batches * args.global_batch_size

    def run(self, forward_backward: Callable[..., list], forward_step: Callable, chunks: list) -> dict[str, float]:
        """``--eval-iters`` forward-only batches; per key the value this rank's reports give (empty
        on ranks whose engine reports nothing: every rank but a pipeline's last stage)."""
        args = self.args
        totals: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                for _ in range(args.eval_iters):
                    data = chunk_iterators(self.dataset, chunks, micro_batch_size=args.micro_batch_size,
                                           dp_size=self.dp, dp_rank=self.dp_rank, consumed_samples=self.consumed)
                    reports = forward_backward(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                               num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                                               micro_batch_size=args.micro_batch_size, forward_only=True)
                    self.consumed += args.global_batch_size
                    for report in reports:
                        for key, value in report.items():
                            totals[key] = totals.get(key, 0) + value.detach().double()
        finally:
            for chunk in chunks:
                chunk.train()
        return {key: float(t[0] / t[1]) if t.numel() == 2 else float(t) / (args.eval_iters * args.num_microbatches)
                for key, t in totals.items()}


def result_lines(where: str, values: dict[str, float]) -> list[str]:
    """Megatron-LM's framed ``validation loss at ...`` block (``where``: e.g. "iteration 10",
    "iteration 20 on validation set")."""
    text = f" validation loss at {where} | "
    for key, value in values.items():
        text += f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]
