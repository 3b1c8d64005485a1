"""``--parallelism.tensor_parallel_degree`` under the Piper engine: TorchTitan's TP inside each stage.

TorchTitan's ``parallelize_fn`` keeps applying tensor (and sequence) parallelism to every stage
on its ``tp`` mesh, as under its own engine. A Piper plan rank is then a TP group: every member
runs the same per-rank plan on its local shards, each over its own communicators (the copies of
the plan are ordered (data-parallel replica, TP coordinate), :func:`plan_copies`), so a stage's
output goes to the same TP coordinate of the next stage, as TorchTitan's own pipelining sends it.

Refused before any rank computes, each in one line naming the flag: a degree that does not divide
the model's attention heads or the sequence (under sequence parallelism), degrees whose product
is not the world size, and the combinations the engine does not run yet (TP with Piper's ZeRO,
TP with expert parallelism).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from piper_plugin import plan_copies as copies_of_plan

from piper_plugin.adapters.torchtitan.flags import FlagError

__all__ = ["check_tensor_parallel", "check_tensor_parallel_config", "check_world_size", "plan_copies"]

_HEAD_FIELDS = ("n_heads", "n_kv_heads", "num_heads", "num_kv_heads", "num_attention_heads")


def _fields(config: Any, path: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every field of a dataclass tree (lists and tuples walked)."""
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for f in dataclasses.fields(config):
            value = getattr(config, f.name, None)
            name = f"{path}.{f.name}" if path else f.name
            yield name, value
            yield from _fields(value, name, seen)
    elif isinstance(config, (list, tuple)):
        for i, value in enumerate(config):
            yield from _fields(value, f"{path}[{i}]", seen)


def check_tensor_parallel_config(config: Any) -> None:
    """What the TP degree must divide, checked on the trainer's config before any rank starts:
    every attention head count of the model and, under sequence parallelism, the sequence."""
    par = config.parallelism
    tp = par.tensor_parallel_degree
    if tp <= 1:
        return
    fix = f"set --parallelism.tensor_parallel_degree to one of"
    heads = {(name.rsplit(".", 1)[-1], value) for name, value in _fields(config.model_spec.model)
             if name.rsplit(".", 1)[-1] in _HEAD_FIELDS and isinstance(value, int) and value > 0}
    for field, count in sorted(heads):
        if count % tp:
            divisors = [d for d in range(1, count + 1) if all(c % d == 0 for _, c in heads)]
            raise FlagError(f"--parallelism.tensor_parallel_degree {tp} does not divide the model's {count} attention "
                            f"heads ({field}): each TP rank computes heads / degree of them; {fix} {divisors}")
    seq = config.training.seq_len
    if par.enable_sequence_parallel and seq % tp:
        raise FlagError(f"--parallelism.tensor_parallel_degree {tp} with sequence parallelism does not divide "
                        f"--training.seq_len {seq} (each TP rank holds seq_len / degree positions between "
                        f"layers); set --training.seq_len to a multiple of {tp}")


def check_world_size(config: Any, world: int) -> None:
    """The parallel degrees multiply to the world size (``data_parallel_shard_degree`` -1: the rest)."""
    par = config.parallelism
    named = [("pipeline_parallel_degree", par.pipeline_parallel_degree),
             ("data_parallel_replicate_degree", par.data_parallel_replicate_degree),
             ("tensor_parallel_degree", par.tensor_parallel_degree),
             ("context_parallel_degree", par.context_parallel_degree)]
    product = 1
    for _, degree in named:
        product *= degree
    shard = par.data_parallel_shard_degree
    fits = world % product == 0 if shard == -1 else product * shard == world
    if not fits:
        said = " x ".join(f"{flag.removesuffix('_degree')} {degree}" for flag, degree in named if degree != 1) or "1"
        shard_said = "" if shard == -1 else f" x data_parallel_shard {shard}"
        raise FlagError(f"--parallelism degrees {said}{shard_said} make {product * max(shard, 1)} ranks but the job has "
                        f"{world}: launch that many ranks (--nproc_per_node / piper launch --nproc), or change a "
                        f"degree (--parallelism.data_parallel_shard_degree -1 takes the ranks left)")


def check_tensor_parallel(tp: int, zero: int | None, ep: int) -> None:
    """The TP layouts the Piper engine runs: TorchTitan's TP in every stage over pipeline x
    ``data_parallel_replicate`` ranks."""
    if tp <= 1:
        return
    if zero is not None:
        raise FlagError(f"--parallelism.tensor_parallel_degree {tp} with --parallelism.data_parallel_shard_degree > 1: "
                        f"the Piper engine's ZeRO does not yet shard tensor-parallel shards; use "
                        f"--parallelism.data_parallel_replicate_degree for data parallelism with TP, or "
                        f"--parallelism.pipeline_engine torch")
    if ep > 1:
        raise FlagError(f"--parallelism.tensor_parallel_degree {tp} with --parallelism.expert_parallel_degree {ep}: "
                        f"the Piper engine does not yet run expert parallelism with TP; set one of them to 1 or use "
                        f"--parallelism.pipeline_engine torch")


def plan_copies(parallel_dims) -> list[list[int]]:
    """The copies of the plan (:func:`piper_plugin.plan_copies`, a collective) from TorchTitan's
    meshes: each ``data_parallel_replicate`` replica and each TP coordinate runs the plan over its
    own ``pp`` group (TorchTitan's replicate wrapper all-reduces the replicas' gradients)."""
    def local(name: str, degree: int) -> int:
        return parallel_dims.get_mesh(name).get_local_rank() if degree > 1 else 0

    return copies_of_plan(local("dp_replicate", parallel_dims.dp_replicate), local("tp", parallel_dims.tp),
                          parallel_dims.get_mesh("pp").get_local_rank())
