"""``--parallelism.pipeline_engine=alternate``: both engines on the same stages, step by step.

For A/B measurement in one process. Steps follow the pattern torch, piper, piper, torch
(repeated), so a slow drift of the machine and the order of the two cancel over every four
steps. Both engines drive the very same stage modules, data, optimizer and LR schedule; each
step is one whole training step of one engine, so the loss curve is that of either engine
(they compute the same gradients). A line per step names the engine that ran it, and
:func:`engine_of_step` gives the same answer to tools reading TorchTitan's step lines.

Only stage layouts both engines share can alternate: the Piper recipe's placement must give
this rank the stages TorchTitan's schedule gives it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torchtitan.distributed.pipeline_parallel import (
    _build_get_mesh_callback, _build_pipeline_schedule, _get_pp_rank_to_stage_indices_mapping,
)
from torchtitan.tools.logging import logger

__all__ = ["AlternatingSchedule", "engine_of_step", "torch_schedule"]

_PATTERN = ("torch", "piper", "piper", "torch")


def engine_of_step(step: int) -> str:
    """The engine that runs TorchTitan's step ``step`` (counted from 1)."""
    return _PATTERN[(step - 1) % len(_PATTERN)]


def torch_schedule(parts: dict[int, nn.Module], *, parallel_dims, parallelism, training, device: torch.device,
                   loss_fn):
    """TorchTitan's own schedule over ``parts`` (stage index -> module), built as ``pipeline_llm``
    builds it, after checking that TorchTitan would give this rank exactly these stages."""
    pp_mesh = parallel_dims.get_mesh("pp")
    num_stages = parallelism.pipeline_parallel_degree * len(parts)
    ours = _get_pp_rank_to_stage_indices_mapping(pp_mesh.get_local_rank(), pp_mesh.size(),
                                                 parallelism.pipeline_parallel_schedule, num_stages)
    if sorted(ours) != sorted(parts):
        raise ValueError(
            f"--parallelism.pipeline_engine=alternate: TorchTitan's {parallelism.pipeline_parallel_schedule} puts "
            f"stages {sorted(ours)} on this rank but the Piper recipe puts {sorted(parts)} here; alternate needs "
            f"the same layout (drop --piper.recipe or pick a schedule with the recipe's layout)")
    get_mesh = _build_get_mesh_callback(parallel_dims)
    stages = [PipelineStage(parts[s], s, num_stages, device, group=pp_mesh.get_group("pp"), get_mesh=get_mesh)
              for s in ours]
    return _build_pipeline_schedule(parallelism=parallelism, local_batch_size=training.local_batch_size,
                                    stages=stages, loss_fn=loss_fn)


class AlternatingSchedule:
    """Runs each ``step`` on the engine :func:`engine_of_step` names; ``eval`` on Piper's."""

    def __init__(self, torch_engine, piper_engine):
        self.engines = {"torch": torch_engine, "piper": piper_engine}
        self.steps = 0

    def step(self, *args, **kwargs):
        self.steps += 1
        engine = engine_of_step(self.steps)
        logger.info(f"Piper A/B: step {self.steps} runs on the {engine} engine")
        return self.engines[engine].step(*args, **kwargs)

    def eval(self, *args, **kwargs):
        return self.engines["piper"].eval(*args, **kwargs)
