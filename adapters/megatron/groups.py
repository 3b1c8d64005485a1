"""Megatron's process groups as a Piper plan sees them: the hidden state's shape between stages,
the tensor- and data-parallel sizes, and which process runs each plan rank.

Invariant: every function that gathers (:func:`plan_processes`, :func:`pipelines`) is a
collective over the whole world, called by every rank in the same order.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from piper_plugin import plan_copies

from piper_plugin.adapters.megatron.errors import ArgumentError

__all__ = ["hidden_shape", "tensor_parallel", "tensor_parallel_rank", "data_parallel", "plan_processes", "pipelines"]


def hidden_shape(config, seq_length, decoder_seq_length, micro_batch_size, pg_collection) -> tuple[int, ...]:
    """One microbatch's hidden state between stages, as Megatron's ``get_tensor_shapes``."""
    from megatron.core import parallel_state

    cp = pg_collection.cp.size() if pg_collection is not None else parallel_state.get_context_parallel_world_size()
    tp = tensor_parallel(pg_collection)
    seq = (decoder_seq_length or seq_length) // cp
    if config.sequence_parallel:
        seq //= tp
    return (seq, micro_batch_size, config.hidden_size)


def tensor_parallel(pg_collection) -> int:
    from megatron.core import parallel_state

    return pg_collection.tp.size() if pg_collection is not None else parallel_state.get_tensor_model_parallel_world_size()


def data_parallel(zero: int | None, chunks: list[nn.Module], pg_collection) -> tuple[int, int]:
    """(size, rank) of the plan's data-parallel axis: Megatron's data-parallel group under
    Piper's ZeRO, else (1, 0) (Megatron's DDP reduces across the pipelines)."""
    if zero is None:
        return 1, 0
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    if any(isinstance(c, DistributedDataParallel) for c in chunks):
        raise ArgumentError(f"--piper-zero {zero}: the model chunks are in Megatron's DistributedDataParallel, whose "
                            f"gradient buffers would reduce them again; wrap each chunk in "
                            f"piper_plugin.adapters.megatron.ZeroChunk instead")
    group = (pg_collection.dp if pg_collection is not None and hasattr(pg_collection, "dp")
             else parallel_state.get_data_parallel_group())
    dp = dist.get_world_size(group)
    if dp < 2:
        raise ArgumentError(f"--piper-zero {zero} with one data-parallel rank: ZeRO shards over the data-parallel "
                            f"ranks; launch more ranks than --pipeline-model-parallel-size, or drop --piper-zero")
    return dp, dist.get_rank(group)


def tensor_parallel_rank(pg_collection) -> int:
    from megatron.core import parallel_state

    return pg_collection.tp.rank() if pg_collection is not None else parallel_state.get_tensor_model_parallel_rank()


def plan_processes(plan, pp_rank: int, dp_rank: int, tp_rank: int = 0, tp: int = 1) -> list[list[int]]:
    """Process rank of every plan rank, one list per TP coordinate (a collective): plan rank
    (pipeline rank p, data shard d) of TP coordinate t is the process at Megatron's pipeline
    rank p, data-parallel rank d and tensor-parallel rank t."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pp_rank, dp_rank, tp_rank))
    where = {coords: process for process, coords in enumerate(everyone)}
    return [[where[(plan.grid.coords(r)[0], plan.grid.data_shard(r), t)] for r in range(plan.grid.world_size)]
            for t in range(tp)]


def pipelines(pp_rank: int, tp_rank: int) -> list[list[int]]:
    """Process ranks of every pipeline (each a copy of the plan), by pipeline rank, the pipelines
    ordered (data-parallel replica, TP coordinate) (:func:`piper_plugin.plan_copies`, a collective)."""
    from megatron.core import parallel_state

    return plan_copies(parallel_state.get_data_parallel_rank(), tp_rank, pp_rank)
