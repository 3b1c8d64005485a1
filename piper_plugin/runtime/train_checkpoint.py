"""Checkpoints of a training job in torch.distributed.checkpoint (DCP) format, strategy-free.

Every rank writes what it holds under names of the model, not of the plan:

* ``model.<fqn>``: each parameter at its global shape. A ZeRO shard (this member's rows), an
  expert slice (this ep rank's experts) or both are DTensor pieces placed ``Shard(0)`` over the
  members' ranks, so DCP records their offsets; a whole parameter is a plain tensor (replicas
  write it once: DCP drops duplicates).
* ``optim.<fqn>:<key>``: each per-parameter optimizer state entry (AdamW's ``exp_avg``,
  SGD's ``momentum_buffer``...), laid out as its parameter when it has the parameter's shape
  (a whole tensor otherwise, e.g. ``step``); non-tensor entries as objects.
* ``rng.<rank>``: each rank's torch RNG state (restored only under the same plan).

So a checkpoint saved under one plan loads under any plan of the same model (other pp, dp,
ep, ZeRO level or recipe): DCP reads each rank's pieces from whatever pieces were written.
Optimizer hyperparameters come from the job's ``optimizer_fn`` and LR schedules are replayed
to the step (:class:`~piper_plugin.runtime.worker.Worker`), the same on every strategy.

Invariant (write, then mark complete): a checkpoint is written into ``.step-<N>.partial`` and
renamed to ``step-<N>`` by rank 0 only after every rank's files and DCP's metadata are written
and ``piper.json`` (the step, the plan's hash, the job's description) is next to them; a
directory without ``piper.json`` is never resumed from.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["save_checkpoint", "load_checkpoint", "complete_checkpoint", "MARK"]

MARK = "piper.json"
_STEP_DIR = re.compile(r"step-(\d+)$")


class _Piece:
    """One parameter as this rank holds it: ``local`` (its storage), the parameter object the
    optimizer steps (``stepped``), and how ``local`` sits in the global parameter."""

    def __init__(self, fqn: str, local: torch.Tensor, stepped: torch.Tensor, global_shape: torch.Size,
                 mesh_ranks: list | None):
        self.fqn, self.local, self.stepped, self.global_shape, self.mesh_ranks = (
            fqn, local, stepped, global_shape, mesh_ranks)

    def view(self, tensor: torch.Tensor, meshes: dict) -> torch.Tensor:
        """``tensor`` (shaped like ``local``) as DCP should see it."""
        if self.mesh_ranks is None:
            return tensor
        key = json.dumps(self.mesh_ranks)
        if key not in meshes:  # a layout only: no communicator is made (DCP talks on the default group)
            meshes[key] = DeviceMesh(tensor.device.type, torch.tensor(self.mesh_ranks, dtype=torch.int),
                                     _init_backend=False)
        mesh = meshes[key]
        return DTensor.from_local(tensor, mesh, [Shard(0)] * mesh.ndim, run_check=False,
                                  shape=self.global_shape,
                                  stride=torch.empty(self.global_shape, device="meta").stride())


def _pieces(executor) -> Iterator[_Piece]:
    """Every parameter this rank keeps between steps (each once per rank)."""
    state, plan = executor.state, executor.plan
    grid, meta, process = plan.grid, plan.dag.meta, executor.comm.process_rank
    pp, dp, ep = grid.coords(state.rank)
    seen: set[int] = set()
    for region in state.regions:
        ep_degree = meta.sharded.get(region, 1)
        devices = plan.dag.nodes[f"{region}F0"].devices
        ep_ranks = sorted(next(g for g in grid.groups("ep", devices) if state.rank in g),
                          key=lambda r: grid.coords(r)[2]) if ep_degree > 1 else None
        axis = "dp" if region in meta.sharded else "data"
        members = next(g for g in grid.groups(axis, devices) if state.rank in g)

        def layout(p: torch.Tensor, rows_sharded: bool):
            shape = torch.Size((p.shape[0] * ep_degree, *p.shape[1:])) if ep_ranks else p.shape
            if ep_ranks and rows_sharded:  # [ep][member]: the expert slice, then this member's rows of it
                ranks = [[process[grid.rank(pp, grid.coords(m)[1], grid.coords(e)[2])] for m in members]
                         for e in ep_ranks]
            elif ep_ranks:
                ranks = [process[e] for e in ep_ranks]
            elif rows_sharded:
                ranks = [process[m] for m in members]
            else:
                ranks = None
            return shape, ranks

        for (r, _), bucket in sorted(state.buckets.items()):
            if r != region:
                continue
            for i, p in enumerate(bucket.params):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = state._names[id(p)].removeprefix("model.")
                if not bucket.shards:
                    yield _Piece(name, p.detach(), p, *layout(p, False))
                elif p.dim() == 0:
                    raise ValueError(f"parameter {name!r} is a scalar sharded by ZeRO: checkpoints shard rows; "
                                     f"keep it out of ZeRO (a region at zero=0) or make it one-dimensional")
                else:
                    yield _Piece(name, bucket.shards[i].detach(), bucket.shards[i], *layout(p, True))
        for name, p in state._unbucketed.get(region, {}).items():
            if id(p) not in seen:
                seen.add(id(p))
                yield _Piece(name.removeprefix("model."), p.detach(), p, *layout(p, False))


def _optimizer_of(executor) -> dict[int, torch.optim.Optimizer]:
    """id(stepped parameter) -> the optimizer stepping it."""
    return {id(p): opt for opt in executor.state.optimizers.values()
            for group in opt.param_groups for p in group["params"]}


def _state_entry(piece: _Piece, value: Any, meshes: dict) -> Any:
    if isinstance(value, torch.Tensor) and value.shape == piece.local.shape:
        return piece.view(value, meshes)
    return value


def save_checkpoint(executor, root: Path, step: int, description: dict[str, Any]) -> Path:
    """Write this rank's part of the checkpoint of ``step`` under ``root`` (a collective over
    the default group); rank 0 marks it complete. Returns the final directory."""
    root = Path(root)
    partial, final = root / f".step-{step}.partial", root / f"step-{step}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a previous attempt that died half way
        partial.mkdir(parents=True)
    dist.barrier()
    meshes: dict = {}
    optimizer_of = _optimizer_of(executor)
    entries: dict[str, Any] = {f"rng.{dist.get_rank()}": torch.get_rng_state()}
    for piece in _pieces(executor):
        entries[f"model.{piece.fqn}"] = piece.view(piece.local, meshes)
        optimizer = optimizer_of.get(id(piece.stepped))
        for key, value in (optimizer.state.get(piece.stepped, {}) if optimizer is not None else {}).items():
            entries[f"optim.{piece.fqn}:{key}"] = _state_entry(piece, value, meshes)
    dcp.save(entries, checkpoint_id=partial)  # returns once every rank wrote and rank 0 wrote the metadata
    if dist.get_rank() == 0:
        mark = {"step": step, "plan": executor.plan.hash(), "world": dist.get_world_size(), **description}
        (partial / MARK).write_text(json.dumps(mark, indent=1, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    dist.barrier()
    return final


def complete_checkpoint(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """``path`` if it is a complete checkpoint, else the complete ``step-<N>`` under it with the
    highest N; with its mark. None when there is none."""
    path = Path(path)
    if (path / MARK).is_file():
        return path, json.loads((path / MARK).read_text())
    steps = sorted((int(m.group(1)), d) for d in path.glob("step-*")
                   if (m := _STEP_DIR.search(d.name)) and (d / MARK).is_file())
    return (steps[-1][1], json.loads((steps[-1][1] / MARK).read_text())) if steps else None


def load_checkpoint(executor, path: Path) -> int:
    """Read this rank's pieces, optimizer state and (same plan only) RNG state from the complete
    checkpoint ``path`` (a collective over the default group); ZeRO-1/2 parameters are then
    gathered whole. Returns the checkpoint's step."""
    path = Path(path)
    mark = json.loads((path / MARK).read_text())
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state_keys: dict[str, list[str]] = {}  # fqn -> its saved optimizer state keys
    for entry in saved:
        if entry.startswith("optim."):
            fqn, key = entry[len("optim."):].rsplit(":", 1)
            state_keys.setdefault(fqn, []).append(key)
    meshes: dict = {}
    entries: dict[str, Any] = {}
    targets: list[tuple[str, _Piece, str]] = []  # (entry, piece, optimizer state key)
    for piece in _pieces(executor):
        name = f"model.{piece.fqn}"
        if name not in saved:
            raise ValueError(f"checkpoint {path} has no parameter {piece.fqn!r}: it was saved from another model")
        saved_shape = tuple(saved[name].size)
        if saved_shape != tuple(piece.global_shape):
            raise ValueError(f"checkpoint {path}: parameter {piece.fqn!r} has shape {saved_shape} there but "
                             f"{tuple(piece.global_shape)} in this model")
        entries[name] = piece.view(piece.local, meshes)
        for key in state_keys.get(piece.fqn, ()):
            entry = f"optim.{piece.fqn}:{key}"
            md = saved[entry]
            if hasattr(md, "size"):  # a tensor: laid out as the parameter when shaped as it
                shaped = tuple(md.size) == saved_shape
                local = torch.empty(piece.local.shape if shaped else md.size, dtype=md.properties.dtype,
                                    device=piece.local.device)
                entries[entry] = piece.view(local, meshes) if shaped else local
            else:
                entries[entry] = None  # an object: DCP puts it here
            targets.append((entry, piece, key))
    same_plan = mark.get("plan") == executor.plan.hash() and mark.get("world") == dist.get_world_size()
    rng = f"rng.{dist.get_rank()}"
    if same_plan and rng in saved:
        entries[rng] = torch.get_rng_state()
    dcp.load(entries, checkpoint_id=path)
    optimizer_of = _optimizer_of(executor)
    with torch.no_grad():
        for entry, piece, key in targets:
            value = entries[entry]
            value = value.to_local() if isinstance(value, DTensor) else value
            optimizer = optimizer_of.get(id(piece.stepped))
            if optimizer is None:
                continue
            optimizer.state[piece.stepped][key] = value
    if same_plan and rng in saved:
        torch.set_rng_state(entries[rng])
    for key, bucket in sorted(executor.state.buckets.items()):
        if bucket.shards and bucket.zero < 3:  # whole parameters from every member's rows
            executor.comm.gather_bucket(key, bucket)
    return int(mark["step"])
