"""What a TorchTitan stage keeps for its backward, what its backward allocates and its forward's
matrix-product FLOPs, measured.

A stage program's regions are modules, not traced graphs, so the compiler has only an estimate
of their activations. Here every stage runs on fake tensors of the plan's batch
(:func:`piper_plugin.region_memory`: no memory is used, no parameter is read), as a copy of the
stage before TorchTitan's SPMD wrapping with TorchTitan's activation checkpointing applied, as
it will run. The ranks share the work (region ``i`` is measured by rank ``i`` modulo the world
size) and exchange the figures, so all compile the same plan from the same numbers.
Invariant: where a stage cannot be measured (an op fake tensors cannot run) every rank keeps
the estimate and the log says why. torch.compile is not applied to the copies: a compiled
stage is measured as it runs eagerly.
"""
from __future__ import annotations

import copy
import os
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.tools.logging import logger

from piper_plugin import region_memory
from piper_plugin.adapters.torchtitan.program import LocalStages, StageProgram

__all__ = ["measure_stage_memory", "apply_stage_memory"]


def measure_stage_memory(program: StageProgram, parts: Sequence[nn.Module], loss_fn: Callable[..., Any], *,
                         ac_config: Any, dump_folder: str, seq_len: int, split: bool) -> dict[str, Any]:
    """Per region: (bytes a forward keeps, its backward's working memory) for the plan's batch,
    from copies of ``parts`` (every stage, unwrapped, any device) with ``ac_config`` applied;
    ``split``: the plan may split a stage's backward. Empty where a stage cannot be measured."""
    copies = [copy.deepcopy(part) for part in parts]
    if hasattr(loss_fn, "set_lm_head") and getattr(copies[-1], "lm_head", None) is not None:
        copies[-1]._skip_lm_head = True  # the loss applies the head, chunk by chunk, as TorchTitan sets it up
    if ac_config is not None:
        for part in copies:
            ac_config.build(dump_folder=dump_folder).apply(part)
    batch = program.dag.batch_size  # the plan's: the simulator scales it to a microbatch
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs = (tokens, {}, tokens.clone(), {"global_valid_tokens": torch.tensor(float(batch * seq_len))})
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
    mine = {name for i, name in enumerate(program.regions) if i % world == rank}
    try:
        measured = region_memory(program, LocalStages(dict(enumerate(copies))), loss_fn, inputs, split=split,
                                 measure=mine)
        found: Any = {name: (m.saved, m.backward, m.matmul_flops) for name, m in measured.items()}
    except Exception as exc:  # noqa: BLE001 - an op fake tensors cannot run: keep the estimate
        frames = traceback.extract_tb(exc.__traceback__)  # the innermost outside torch itself
        where = next((f for f in reversed(frames) if f"{os.sep}torch{os.sep}" not in f.filename), frames[-1])
        found = f"{type(exc).__name__} in {where.name} ({where.filename}:{where.lineno}): {exc}"
    everyone = [found]
    if shared:  # every rank gets every rank's figures (or its reason), in rank order
        everyone = [None] * world
        dist.all_gather_object(everyone, found)
    failed = [(r, why) for r, why in enumerate(everyone) if isinstance(why, str)]
    if failed:
        r, why = failed[0]
        logger.warning(f"Piper: stage memory not measured (on rank {r}: {why}); the simulator estimates "
                       f"activations from the hidden state")
        return {}
    return {name: figures for part in everyone for name, figures in part.items()}


def apply_stage_memory(program: StageProgram, measured: dict[str, Any]) -> None:
    """Set each measured region's ``activation_bytes``, ``backward`` and ``matmul_flops``; a stage
    run as pieces (:mod:`.pieces`) gets its whole stage's memory on its first piece and its FLOPs
    split evenly over the pieces (estimates)."""
    for name, (saved, backward, flops) in measured.items():
        pieces = [r for n, r in program.regions.items() if n.startswith(f"{name}.")]
        region = program.regions.get(name) or program.regions[f"{name}.0"]
        region.activation_bytes = saved
        region.backward = backward
        for piece in pieces or [region]:
            piece.matmul_flops = flops // max(len(pieces), 1)
