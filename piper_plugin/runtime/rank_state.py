"""What one rank owns: its chunks, parameter buckets, optimizers and in-flight values.

Values flow along data edges: a finished task *delivers* its outputs into the inbox of each
local successor that reads them (gradients from several consumers add up), and the inbox is
dropped when that successor finishes. Activations a forward saved for its backward live in
``saved`` until the last backward task of that chunk (B, or BW after BI) finishes; gathered
ZeRO-3 buckets live until their last consumer finishes.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from piper_plugin.ir.capture import Program
from piper_plugin.ir.nodes import Kind
from piper_plugin.runtime.buckets import FlatBucket
from piper_plugin.runtime.memory import GradientCount, MemoryMeter
from piper_plugin.runtime.optimizers import ParamList, rebind
from piper_plugin.runtime.pieces import Piece
from piper_plugin.autograd.split_backward import PendingWeightGrads
from piper_plugin.scheduler.plan import Plan

__all__ = ["RankState"]

OptimizerFn = Callable[["ParamList"], torch.optim.Optimizer]


class RankState:
    def __init__(self, rank: int, plan: Plan, program: Program, model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], optimizer_fn: OptimizerFn,
                 mixed_precision: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
                 experts_sharded: bool = False):
        self.rank = rank
        self.mixed_precision = mixed_precision  # (compute, reduce) dtypes of ZeRO >= 1 buckets
        self.plan = plan
        self.dag = plan.dag
        grid = plan.grid
        self.pp, self.dp, self.ep = grid.coords(rank)
        self.shard_index = grid.data_shard(rank)
        placement = self.dag.meta.placement
        self.regions = [r for r, pp in placement.items() if pp == self.pp]
        chunks = program.instantiate(model, loss_fn)
        self.chunks: dict[str, fx.GraphModule] = {r: chunks[r] for r in self.regions}
        named = dict(_Named(model).named_parameters())
        self._names = {id(p): n for n, p in named.items()}
        if not experts_sharded:  # else the host cut every expert region to this rank's experts
            self._shard_experts(named)
        self.input_names = program.input_names
        self.loss_region = program.loss_region
        self.loss_value = program.loss_value
        self.scale = 1.0 / (plan.microbatches * grid.data_shards)
        self.buckets: dict[tuple[str, int], FlatBucket] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._build_buckets(named, optimizer_fn)
        self._drop_foreign(model, named)
        self.device = next(iter(named.values())).device if named else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.inbox: dict[str, dict[str, torch.Tensor]] = {}
        self._succ_cache: dict[str, list[tuple[str, Any]]] = {}
        self._gather_cache: dict[str, list[tuple[str, int]]] = {}
        self._handoff_cache: dict[str, list[tuple[str, int]]] = {}
        self._lock = threading.Lock()
        self.bucket_lock = threading.Lock()  # a bucket's references and its storage change together
        self.saved: dict[tuple[str, int], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.pending_bw: dict[tuple[str, int], PendingWeightGrads] = {}
        self.split_pays: dict[str, bool] = {}  # region -> BI + BW cost no more than one backward
        self.update_gate = None  # a FiniteLossGate: UPDATEs apply only if every loss was finite
        self.autocast: torch.dtype | None = None  # forwards run under torch.autocast in this dtype
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.batch_shapes: tuple = ()  # every microbatch's input shapes, by input name
        self.losses: list[torch.Tensor] = []
        self.grad_pieces: dict[str, list[Piece]] = {}
        self.snapshot_grads = False
        self.fused_backward = plan.ranks[rank].fused
        self.input_grads_first = plan.ranks[rank].split_first
        self.blocks: dict[str, Any] = {}  # region -> its BlockGathers (ZeRO-3 by block), set by the executor
        self.meter = MemoryMeter()
        self.meter.ignore([p for c in self.chunks.values() for p in c.parameters()])
        self.meter.track_working = not self.cuda
        self._handed = GradientCount(self.meter)  # per bucket reduce-scattered per microbatch
        self._count_handed_gradients()

    # -- set-up ----------------------------------------------------------------------------
    def _shard_experts(self, named: dict[str, nn.Parameter]) -> None:
        """Keep this rank's slice of each EP-sharded region's experts."""
        for region, ep in self.dag.meta.sharded.items():
            if region not in self.regions:
                continue
            for name in self.dag.regions[region].params:
                p = named[name]
                size = p.shape[0] // ep
                p.data = p.data[self.ep * size:(self.ep + 1) * size].clone()

    def _build_buckets(self, named: dict[str, nn.Parameter], optimizer_fn: OptimizerFn) -> None:
        """Each region's buckets and its optimizer. ``optimizer_fn`` sees the region's parameters
        as the user wrote them (a :class:`ParamList`: whole shapes, names, ``requires_grad``), so
        its groups and options are the user's; ZeRO >= 1 then rebinds each parameter of each
        group to this rank's shard of it (:func:`~piper_plugin.runtime.optimizers.rebind`)."""
        grid = self.plan.grid
        self._unbucketed: dict[str, dict[str, nn.Parameter]] = {}
        sharded = self.dag.meta.sharded
        for region in self.regions:
            own = self.dag.meta.update_params[region]
            if not own:
                continue
            specs = self.dag.buckets.get(region) or []
            groups_axis = "dp" if region in sharded else "data"
            devices = self.dag.nodes[f"{region}F0"].devices
            group = next(g for g in grid.groups(groups_axis, devices) if self.rank in g)
            optimizer = optimizer_fn(ParamList([named[p] for p in own], [n.removeprefix("model.") for n in own]))
            if not specs or len(group) == 1:  # a single replica: nothing to reduce or shard, params stay as they are
                self._unbucketed[region] = {p: named[p] for p in own}
                specs = []
            shards: dict[int, nn.Parameter] = {}
            for spec in specs:
                zero = spec.zero if len(group) > 1 else 0
                bucket = FlatBucket([named[p] for p in spec.params], zero, len(group), group.index(self.rank),
                                    *self.mixed_precision)
                self.buckets[(region, spec.index)] = bucket
                shards.update({id(p): s for p, s in zip(bucket.params, bucket.shards)})
            if shards:
                rebind(optimizer, shards, region)
            self.optimizers[region] = optimizer

    def _drop_foreign(self, model: nn.Module, named: dict[str, nn.Parameter]) -> None:
        """Keep only this rank's shard: parameters no local region reads become empty."""
        local = {id(p) for c in self.chunks.values() for p in c.parameters()}
        for p in named.values():
            if id(p) not in local:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _count_handed_gradients(self) -> None:
        """A bucket the plan reduce-scatters per microbatch (ZeRO-2/3 not by block) holds each
        microbatch's gradient from its first accumulation until the backward hands it over
        (:meth:`gradients_handed_over`): transient, so the meter counts it (as a block's gradients
        are counted by :class:`~.block_gathers.BlockGathers`)."""
        handed = {(node.region, node.bucket) for node in self.dag.nodes.values()
                  if node.kind == Kind.REDUCE_SCATTER and node.phase == "B" and self.rank in node.devices}
        for key in handed & self.buckets.keys():
            self._handed.watch(key, self.buckets[key].params)

    def gradients_handed_over(self, key: tuple[str, int]) -> None:
        """Bucket ``key``'s gradient went into its reduce-scatter's payload (counted from there)."""
        self.meter.add(-self._handed.take(key))

    def microbatches(self, batch: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """This rank's data shard of the global batch, on its device, cut into microbatches."""
        grid, m = self.plan.grid, self.plan.microbatches
        return {name: list(full.chunk(grid.data_shards)[self.shard_index].to(self.device, non_blocking=True).chunk(m))
                for name, full in batch.items()}

    def set_batch(self, inputs: dict[str, torch.Tensor]) -> None:
        """Feed :meth:`microbatches` of the global batch as this step's inputs."""
        self.inputs = self.microbatches(inputs)
        self.batch_shapes = tuple((name, tuple(tuple(t.shape) for t in mbs)) for name, mbs in self.inputs.items())
        self.losses = []

    def forward_context(self):
        """What a forward runs under: ``torch.autocast`` on this rank's device when the job asks
        for mixed precision (backwards run in the dtypes their forwards chose)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def block_task(self, region: str, kind: str):
        """Context of one of ``region``'s tasks: its ZeRO-3 blocks' hooks serve it, if it has any."""
        blocks = self.blocks.get(region)
        return blocks.task(kind) if blocks is not None else contextlib.nullcontext()

    # -- data flow --------------------------------------------------------------------------
    def deliver(self, key: str, outputs: dict[str, torch.Tensor]) -> None:
        added = 0
        with self._lock:
            for succ, values in self._local_succ(key):
                box = self.inbox.setdefault(succ, {})
                for v in values:
                    if v in outputs:
                        if v in box:
                            box[v] = box[v] + outputs[v]
                        else:
                            box[v] = outputs[v]
                            added += _nbytes(outputs[v])
        if added:
            self.meter.add(added)

    def _local_succ(self, key: str) -> list[tuple[str, Any]]:
        """Successors of ``key`` on this rank with the values they read (cached: the DAG is fixed)."""
        found = self._succ_cache.get(key)
        if found is None:
            found = [(s, vs) for s, vs in self.dag.data_succ[key].items() if self.rank in self.dag.nodes[s].devices]
            self._succ_cache[key] = found
        return found

    def grad_handoffs(self, key: str) -> list[tuple[str, int]]:
        """(reduce-scatter, bucket) of each per-microbatch ZeRO reduction on this rank that takes
        ``key``'s gradients (cached: the DAG is fixed)."""
        found = self._handoff_cache.get(key)
        if found is None:
            found = []
            for succ in self.dag.data_succ[key]:
                target = self.dag.nodes[succ]
                if target.kind == Kind.REDUCE_SCATTER and target.phase == "B" and self.rank in target.devices:
                    found.append((succ, target.bucket))
            self._handoff_cache[key] = found
        return found

    def deliver_to(self, key: str, value: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self.inbox.setdefault(key, {})[value] = tensor
        self.meter.add(_nbytes(tensor))

    def take(self, key: str, counted: bool = False) -> dict[str, torch.Tensor]:
        """``key``'s inbox. The values leave the meter, unless ``counted``: then whoever took
        them subtracts them once they are gone."""
        with self._lock:
            box = self.inbox.pop(key, None)
        if not box:
            return {}
        if self.cuda:  # made on another stream: keep its memory until this one is done
            for t in box.values():
                if isinstance(t, torch.Tensor):
                    t.record_stream(torch.cuda.current_stream(self.device))
        if not counted:
            self.meter.add(-sum(map(_nbytes, box.values())))
        return box

    def finished(self, key: str) -> None:
        """Release gathered ZeRO-3 buckets whose last local consumer was ``key``. On a GPU each
        consumer's stream is recorded on the bucket first: its memory was allocated on the
        gathering stream, which must not reuse it before the consumers' kernels ran."""
        gathers = self._gather_cache.get(key)
        if gathers is None:
            gathers = [(n.region, n.bucket) for n in map(self.dag.nodes.__getitem__, self.dag.data_pred[key])
                       if n.kind == Kind.ALL_GATHER and n.phase in ("F", "B")]
            self._gather_cache[key] = gathers
        for name in gathers:
            bucket = self.buckets[name]
            if self.cuda:
                bucket.flat.record_stream(torch.cuda.current_stream(self.device))
            with self.bucket_lock:  # a gather's absorb (another thread) may be materializing it anew
                bucket.refs -= 1
                if bucket.refs == 0:
                    bucket.release()
                    self.meter.add(-bucket.padded * bucket.flat.element_size())

    def local_consumers(self, key: str) -> int:
        return sum(1 for s in self.dag.data_succ[key] if self.rank in self.dag.nodes[s].devices)

    def unbucketed(self) -> dict[str, nn.Parameter]:
        return {n: p for params in self._unbucketed.values() for n, p in params.items()}

    def snapshot(self, region: str) -> None:
        """Record the reduced gradients UPDATE is about to apply, as host copies (parity checks read them)."""
        self.grad_pieces[region] = self._pieces(region, grads=True)

    def param_pieces(self) -> list[Piece]:
        return [p for region in self.regions for p in self._pieces(region, grads=False)]

    def _held(self) -> dict[str, torch.Tensor]:
        """Views of the parameters this rank keeps between steps: each bucket's flat parameters
        (its ZeRO-3 shard, all it holds then) and each unbucketed parameter."""
        held = {f"bucket:{region}:{index}": (bucket.shard_flat if bucket.shard_flat is not None
                                             else bucket.flat[:bucket.numel])
                for (region, index), bucket in self.buckets.items()}
        held.update({name: p.detach() for name, p in self.unbucketed().items()})
        return held

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """What this rank must keep to resume (:meth:`_held`), as host copies."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self._held().items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Write back what :meth:`checkpoint` returned on this rank of the same plan."""
        with torch.no_grad():
            targets = self._held()
            missing, unknown = sorted(set(targets) - set(saved)), sorted(set(saved) - set(targets))
            if missing or unknown:
                raise ValueError(f"rank {self.rank}: the checkpoint lacks {missing[:3]} and has {unknown[:3]} this plan "
                                 f"does not hold; restore it with the plan and rank that saved it")
            for name, target in targets.items():  # every shape checked before anything is written
                if saved[name].shape != target.shape:
                    raise ValueError(f"rank {self.rank}: checkpoint entry {name!r} has shape {tuple(saved[name].shape)}, "
                                     f"this plan holds {tuple(target.shape)}")
            for name, target in targets.items():
                target.copy_(saved[name].to(target.device))

    def _pieces(self, region: str, grads: bool) -> list[Piece]:
        ep = self.dag.meta.sharded.get(region, 1)
        out = []
        for (r, _), bucket in self.buckets.items():
            if r != region:
                continue
            tag = (self.ep if ep > 1 else 0, ep)
            if bucket.shards:  # one piece per parameter: this member's rows of it
                for p, shard in zip(bucket.params, bucket.shards):
                    t = shard.grad if grads else shard.detach()
                    if t is None:
                        t = torch.zeros_like(shard)
                    out.append(Piece((self._names[id(p)],), (tuple(p.shape),), bucket.index, bucket.n, *tag,
                                     t.detach().flatten().to("cpu", copy=True), self.rank))
                continue
            flat = bucket.flat_grad(take=False) if grads else bucket.flat
            names = tuple(self._names[id(p)] for p in bucket.params)
            out.append(Piece(names, tuple(tuple(p.shape) for p in bucket.params), 0, 1, *tag,
                             flat[:bucket.numel].detach().to("cpu", copy=True), self.rank))
        for name, p in self._unbucketed.get(region, {}).items():
            t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
            out.append(Piece((name,), (tuple(p.shape),), 0, 1, self.ep if ep > 1 else 0, ep,
                             t.detach().flatten().to("cpu", copy=True), self.rank))
        return out


class _Named(nn.Module):
    """Parameter names as capture sees them (the model sits under ``model.``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
