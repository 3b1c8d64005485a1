"""``--save`` / ``--load`` for :mod:`.pretrain_gpt`, in Megatron-LM's legacy ``torch`` layout.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_<7 digits>/mp_rank_<tp 2 digits>_<pp 3 digits>/model_optim_rng.pt    (data-parallel rank 0)
    <dir>/iter_<7 digits>/mp_rank_<tp>_<pp>/distrib_optim_dp<r>.pt (--use-distributed-optimizer)
    <dir>/iter_<7 digits>/mp_rank_<tp>_<pp>/zero_optim_dp<r>.pt    (--piper-zero)
    <dir>/iter_<7 digits>/mp_rank_<tp>_<pp>/rng_dp<r>.pt
    (each tensor-parallel rank saves its own shards; with --expert-model-parallel-size > 1 the
    folders are mp_rank_<tp>_<pp>_<expert rank 3 digits>,
    each model file written by the first data-parallel replica of those experts)

``model_optim_rng.pt`` holds ``model`` (``model0``, ``model1``... with a virtual pipeline),
``optimizer``, ``opt_param_scheduler``, ``iteration``, ``consumed_samples`` and the arguments;
``rng_dp<r>.pt`` each data-parallel rank's random generators. With the distributed optimizer
each data-parallel rank saves the state of its own shard (fp32 training: the shard's main
parameters are views of the model's, saved with it), so a checkpoint loads with the
data-parallel size it was saved with (Megatron's gathered ``save_parameter_state`` fails to load
into torch's Adam, whose per-parameter ``step`` it does not save). The tracker file is written last, after
every rank finished writing: a checkpoint cut short by a failure is never the latest one.
Under ``--piper-zero`` the model is gathered whole and saved in the same layout (any engine
loads it), and each data-parallel rank saves its rows of the optimizer state (:mod:`.zero`).
"""
from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from piper_plugin.adapters.megatron.schedule import ArgumentError, stage_of
from piper_plugin.adapters.megatron.zero import (
    full_model_state, load_full_model_state, load_local_optimizer_state, local_optimizer_state,
)

__all__ = ["save_checkpoint", "load_checkpoint", "TRACKER"]

TRACKER = "latest_checkpointed_iteration.txt"


def _folder(root: str, iteration: int) -> Path:
    """This rank's folder, named as Megatron-LM's legacy checkpoints: by tensor- and
    pipeline-parallel rank, and with expert parallelism also by expert rank (each holds its own
    experts)."""
    from megatron.core import parallel_state

    name = (f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}_"
            f"{parallel_state.get_pipeline_model_parallel_rank():03d}")
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return Path(root) / f"iter_{iteration:07d}" / name


def _writes_model() -> bool:
    """The rank that writes its folder's model file: the first replica of its experts (with no
    expert parallelism, data-parallel rank 0)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_rank() == 0


def _model_keys(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{k}" for k in range(len(chunks))]


def save_checkpoint(args: argparse.Namespace, iteration: int, consumed_samples: int, chunks: list, optimizer,
                    scheduler) -> None:
    from megatron.core import parallel_state

    dp_rank, writer = parallel_state.get_data_parallel_rank(), _writes_model()
    folder = _folder(args.save, iteration)
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    zero = getattr(args, "piper_zero", None)
    if args.use_distributed_optimizer:  # this rank's shard of the optimizer state, as its own file
        torch.save(_shard_states(optimizer), folder / f"distrib_optim_dp{dp_rank:03d}.pt")
    if zero:  # this rank's rows of the optimizer state
        torch.save([local_optimizer_state(inner) for inner in _inner_optimizers(optimizer)],
                   folder / f"zero_optim_dp{dp_rank:03d}.pt")
    torch.save(_rng_state(), folder / f"rng_dp{dp_rank:03d}.pt")  # each rank's own generators (dropout)
    if zero:  # gathering the faces whole is a collective: every data-parallel rank takes part
        models = {key: full_model_state(_module(chunk)) for key, chunk in zip(_model_keys(chunks), chunks)}
    if writer:
        state: dict[str, Any] = models if zero else {key: _module(chunk).state_dict_for_save_checkpoint()
                                                     for key, chunk in zip(_model_keys(chunks), chunks)}
        state.update(stages=_stages(chunks),
                     optimizer=None if args.use_distributed_optimizer or zero else optimizer.state_dict(),
                     opt_param_scheduler=scheduler.state_dict(),
                     iteration=iteration, consumed_samples=consumed_samples, args=vars(args),
                     checkpoint_version=3.0)
        partial = folder / f"model_optim_rng.pt.{os.getpid()}"
        torch.save(state, partial)
        os.replace(partial, folder / "model_optim_rng.pt")
    dist.barrier()  # every rank wrote its part: now (and only now) it is the latest
    if dist.get_rank() == 0:
        tracker = Path(args.save) / TRACKER
        tracker.with_suffix(".tmp").write_text(str(iteration))
        os.replace(tracker.with_suffix(".tmp"), tracker)
    dist.barrier()


def load_checkpoint(args: argparse.Namespace, chunks: list, optimizer, scheduler) -> tuple[int, int]:
    """(iteration, consumed samples) of the latest checkpoint under ``args.load``; (0, 0) when
    the folder has none yet (a fresh run that will save there)."""
    from megatron.core import parallel_state

    tracker = Path(args.load) / TRACKER
    if not tracker.exists():
        if Path(args.load).exists() and any(Path(args.load).iterdir()) and args.load != args.save:
            raise ArgumentError(f"--load {args.load}: no {TRACKER} there (not a checkpoint folder, or no checkpoint "
                                f"finished); point it at the folder --save wrote")
        return 0, 0
    iteration = int(tracker.read_text().strip())
    folder = _folder(args.load, iteration)
    if not (folder / "model_optim_rng.pt").exists():
        raise ArgumentError(f"--load {args.load}: iteration {iteration} has no {folder.name}/model_optim_rng.pt (saved "
                            f"with another --pipeline-model-parallel-size or --expert-model-parallel-size); load "
                            f"with the sizes it was saved with")
    state = torch.load(folder / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    saved = state.get("args", {})
    for name in ("num_layers", "hidden_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "num_experts", "expert_model_parallel_size"):
        if saved.get(name) != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise ArgumentError(f"--load {args.load}: the checkpoint was saved with {flag} {saved.get(name)}, "
                                f"this run has {getattr(args, name)}; use the same {flag}")
    stages = _stages(chunks)
    if "stages" in state and state["stages"] != stages:
        raise ArgumentError(f"--load {args.load}: this pipeline rank's chunks were saved as stages {state['stages']}, "
                            f"but this run builds stages {stages} here (a recipe with another layout: "
                            f"--piper-recipe {args.piper_recipe or 'left out'}); load with the recipe it was saved with")
    zero = getattr(args, "piper_zero", None)
    for key, chunk in zip(_model_keys(chunks), chunks):
        if zero:
            load_full_model_state(_module(chunk), state[key])
        else:
            _module(chunk).load_state_dict(state[key], strict=True)
    if zero:
        _load_rows(args, folder, "zero_optim", "--piper-zero", optimizer, load_local_optimizer_state)
    elif state.get("optimizer") is None and not args.use_distributed_optimizer:
        raise ArgumentError(f"--load {args.load}: the checkpoint's optimizer state is sharded (saved with "
                            f"--piper-zero or --use-distributed-optimizer); load it with the same flag")
    elif args.use_distributed_optimizer:
        _load_rows(args, folder, "distrib_optim", "--use-distributed-optimizer", optimizer,
                   lambda inner, saved: inner.load_state_dict(saved))
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _set_rng_state(torch.load(folder / f"rng_dp{parallel_state.get_data_parallel_rank():03d}.pt", weights_only=False))
    return iteration, state["consumed_samples"]


def _load_rows(args: argparse.Namespace, folder: Path, stem: str, flag: str, optimizer, load) -> None:
    """This data-parallel rank's own optimizer file (``<stem>_dp<r>.pt``), one state per inner optimizer."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    path = folder / f"{stem}_dp{dp_rank:03d}.pt"
    if not path.exists():
        raise ArgumentError(f"--load {args.load}: no optimizer state for data-parallel rank {dp_rank} (saved with "
                            f"another data-parallel size or without {flag}); load with the layout it was saved with")
    for inner, saved in zip(_inner_optimizers(optimizer), torch.load(path, weights_only=False)):
        load(inner, saved)


def _stages(chunks: list) -> list[int]:
    """The pipeline stage each of this rank's chunks is (Megatron's layout, or a recipe's own)."""
    from megatron.core import parallel_state

    pp, pp_rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    return [stage_of(chunk, k, pp, pp_rank) for k, chunk in enumerate(chunks)]


def _module(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under a Megatron optimizer (one per chained optimizer): with the
    distributed optimizer each steps this rank's shard of the main parameters."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _shard_states(optimizer) -> list[dict[str, Any]]:
    return [inner.state_dict() for inner in _inner_optimizers(optimizer)]


def _rng_state() -> dict[str, Any]:
    return {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
