"""The per-rank executor: one rank's part of a compiled plan, driven step by step by a host.

Piper's own launchers (:class:`~piper_plugin.runtime.worker.Worker`) and host frameworks
(TorchTitan's trainer through its adapter) run this same object. It owns the rank's chunks,
parameter buckets and optimizers (:class:`RankState`), its communicators (:class:`DistComm`)
and its stream runner; the plan it is given is complete (fused or split backwards, posting and
streams were decided when the plan was made), so nothing here depends on the recipe.

Invariants: ``step`` runs exactly the rank's plan once and returns with every send completed;
losses are the loss region's outputs times ``loss_scale`` (default: the full-batch mean, 1 /
(microbatches x data shards)); with ``optimizer_fn=None`` UPDATE tasks leave the gradients in
``param.grad`` for the host's own optimizer; parameters Piper shards (ZeRO >= 1) are then
registered between steps as DTensor faces of this rank's shards with the reduced shard
gradients (:mod:`~piper_plugin.runtime.host_faces`), and a model handed over with DTensor
parameters (sharded by the host before initialisation) is taken over as such. ``eval`` runs forwards only, region by region in
region order, so every rank issues its messages in one global order.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from piper_plugin.ir.capture import Program
from piper_plugin.ir.nodes import COMPUTE
from piper_plugin.runtime.block_gathers import BlockGathers
from piper_plugin.runtime.compute import run_compute
from piper_plugin.runtime.dist_comm import DistComm
from piper_plugin.runtime.host_faces import HostFaces, unwrap_faces
from piper_plugin.runtime.optimizers import HostOptimizer
from piper_plugin.runtime.rank_state import RankState, _Named
from piper_plugin.runtime.streams import Continue, RunnerConfig, StreamRunner
from piper_plugin.runtime.update_gate import FiniteLossGate, update_before_loss
from piper_plugin.runtime.value_specs import ValueSpec
from piper_plugin.scheduler.plan import Plan, PlanError

__all__ = ["Executor", "ExecutorConfig", "HostOptimizer", "PlanMismatch", "check_plan_hash", "check_tensor_parallel_plan",
           "plan_copies"]


class PlanMismatch(RuntimeError):
    pass


def check_plan_hash(plan, replicas: int = 1, tensor_parallel: int = 1) -> None:
    """Every process compiled the same plan, and the job has its ranks once per ``replicas``
    (copies of the plan: data-parallel ones a host framework reduces itself, times the
    ``tensor_parallel`` members of each plan rank's TP group)."""
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan.hash())
    if len(set(hashes)) != 1:
        raise PlanMismatch(f"ranks compiled different plans (hash per rank: {hashes}); run the same code "
                           f"and flags on every rank")
    if tensor_parallel > 1:
        check_tensor_parallel_plan(plan)
    if plan.grid.world_size * replicas != dist.get_world_size():
        data = replicas // tensor_parallel
        copies = (f" x {data} replicas" if data > 1 else "") + (f" x tp {tensor_parallel}" if tensor_parallel > 1 else "")
        raise PlanMismatch(f"the plan needs {plan.grid.world_size} ranks (pp x dp x ep){copies} but the job has "
                           f"{dist.get_world_size()}; set --nproc_per_node accordingly")


def plan_copies(replica: int, tp_coordinate: int, pipeline_rank: int) -> list[list[int]]:
    """Process ranks of every copy of a pipeline-only plan, from each process's (data replica,
    TP coordinate, pipeline rank) in its host's meshes (a collective over the world): the copies
    ordered (replica, TP coordinate), TP fastest, each listing its processes by pipeline rank.
    What ``ExecutorConfig.replicas`` takes with ``tensor_parallel``."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (replica, tp_coordinate, pipeline_rank))
    where = {coords: process for process, coords in enumerate(everyone)}
    replicas, tp, pp = (max(c[i] for c in everyone) + 1 for i in range(3))
    if len(where) != replicas * tp * pp:
        raise ValueError(f"the processes' (replica, TP coordinate, pipeline rank) do not form a grid: {everyone}")
    return [[where[(r, t, p)] for p in range(pp)] for r in range(replicas) for t in range(tp)]


def check_tensor_parallel_plan(plan) -> None:
    """A plan whose ranks are TP groups runs each rank's compute on one logical stream: the host's
    TP collectives inside the compute are issued in the plan's order on every member (two compute
    threads could issue them in different orders and deadlock). Raises :class:`PlanError`."""
    for rank, rank_plan in enumerate(plan.ranks):
        streams = sorted(name for name, keys in rank_plan.streams.items()
                         if any(plan.dag.nodes[k].is_compute for k in keys))
        if len(streams) > 1:
            raise PlanError(f"rank {rank} computes on streams {', '.join(streams)}, but under tensor parallelism a "
                            f"rank's compute runs on one stream (the TP collectives inside it must keep one order on "
                            f"every member); drop the stream directives that move compute nodes")


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """The runtime's knobs for one rank.

    ``loss_scale``: the gradient each microbatch's loss starts from (None: 1 / (microbatches x
    data shards), the mean over the global batch; 1.0 when the host's loss is already
    normalised). ``track_saved_memory``: count saved activations on the CPU memory meter (a host
    that reports memory itself turns it off). ``capture_grads``: keep host copies of the reduced
    gradients each UPDATE applies (parity checks). ``replicas``: process ranks of every
    replica of the plan, each ordered by plan rank, when a host runs several copies of one plan
    (data parallelism outside Piper); None: the plan's ranks are the process ranks.
    ``param_dtype`` / ``reduce_dtype``: mixed precision for regions replicated with ZeRO >= 1
    (FSDP's policy): compute and all-gather in ``param_dtype``, keep the shards (the master
    weights) in the parameters' dtype, reduce gradients in ``reduce_dtype``; None: as is.
    ``experts_sharded``: the host hands over every expert-sharded region's parameters already cut
    to this rank's experts (as plain tensors or DTensors); False: whole, Piper keeps its slice.
    ``autocast``: every forward (the loss's too) runs under ``torch.autocast`` on the rank's device
    in this dtype, as a single-device loop wrapping model and loss in autocast does; parameters,
    gradients, reductions and optimizer state keep their own dtypes. None: no autocast.
    ``skip_nonfinite_loss``: a step whose loss is NaN or infinite on any microbatch of any rank
    applies no update anywhere (:mod:`.update_gate`; every rank of the world builds it).
    """

    timeout_s: float = 60.0
    loss_scale: float | None = None
    track_saved_memory: bool = True
    capture_grads: bool = False
    replicas: tuple[tuple[int, ...], ...] | None = None
    tensor_parallel: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    experts_sharded: bool = False
    skip_nonfinite_loss: bool = False
    autocast: torch.dtype | None = None

    def runner(self) -> RunnerConfig:
        """The stream runner's knobs: the posting policy stays the one the simulator modelled."""
        return RunnerConfig(timeout_s=self.timeout_s)


def _expert_ids(plan: Plan, model: nn.Module) -> set[int]:
    """Ids of the parameters of the plan's expert-sharded regions (the host split them already)."""
    names = {n for region in plan.dag.meta.sharded for n in plan.dag.regions[region].params}
    return {id(p) for n, p in _Named(model).named_parameters() if n in names}


class Executor:
    """Rank ``rank`` of ``plan``, over ``model`` (the whole model or, for module regions, what
    ``program.instantiate`` expects). A collective to construct: every rank builds its
    communicators now, in one order. ``specs`` give the shape of every value that crosses ranks
    for one microbatch (:func:`~piper_plugin.runtime.value_specs.probe_values`)."""

    def __init__(self, plan: Plan, program: Program, rank: int, model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], *, specs: Mapping[str, ValueSpec],
                 optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                 config: ExecutorConfig = ExecutorConfig(), after_task: Callable[[str], None] | None = None):
        self.plan, self.program, self.rank, self.config = plan, program, rank, config
        self.specs = dict(specs)
        # the host steps its optimizer over faces of Piper's shards: DTensor parameters it made
        # for them are taken over; any other DTensor parameters (e.g. FSDP's at degree 1) stay its own
        placement, me = plan.dag.meta.placement, plan.grid.coords(rank)[0]
        hosted = optimizer_fn is None and any(zero >= 1 and placement[region] == me
                                              for region, zero in plan.dag.meta.replicated.items())
        keep = _expert_ids(plan, model) if hosted and config.experts_sharded else set()  # the host's experts
        adopted = unwrap_faces(model, keep=keep) if hosted else {}
        self.state = RankState(rank, plan, program, model, loss_fn, optimizer_fn or HostOptimizer,
                               mixed_precision=(config.param_dtype, config.reduce_dtype),
                               experts_sharded=config.experts_sharded)
        self.state.snapshot_grads = config.capture_grads
        self.state.autocast = config.autocast
        if config.loss_scale is not None:
            self.state.scale = config.loss_scale
        self.state.meter.track_saved = config.track_saved_memory
        self.device = self.state.device
        replicas = [list(r) for r in config.replicas] if config.replicas else None
        if replicas and len(replicas) > config.tensor_parallel and optimizer_fn is not None and any(
                b.n > 1 for b in self.state.buckets.values()):
            raise ValueError("replicas of a plan that replicates regions sum their gradients after the step: "
                             "the host steps the optimizer (optimizer_fn=None), or run one replica with a "
                             "data-parallel degree covering all")
        check_plan_hash(plan, replicas=len(replicas) if replicas else 1, tensor_parallel=config.tensor_parallel)
        self.comm = DistComm(plan, rank, self.specs, config.timeout_s, self.device, replicas=replicas,
                             tensor_parallel=config.tensor_parallel)
        self._install_blocks(config.timeout_s)
        self._compute_context: Callable[[], ContextManager] | None = None
        self.runner = StreamRunner(plan.ranks[rank], self._execute, config.runner(), describe=self._describe,
                                   device=self.device, after=after_task)
        self._eval_group = None  # made on first eval (a collective over the replica's ranks)
        self.faces = (HostFaces(model, self.state.buckets, self.comm.bucket_group, adopted, self.device.type)
                      if hosted else None)
        self.gate = self._gate(program) if config.skip_nonfinite_loss else None
        self.state.update_gate = self.gate

    def _gate(self, program: Program) -> FiniteLossGate:
        blocked = update_before_loss(self.plan, program.loss_region)
        if blocked is not None:
            raise ValueError(f"skipping steps with a non-finite loss holds every UPDATE until all losses are known, "
                             f"but in this plan {blocked[1]} can only run after {blocked[0]}: order the updates "
                             f"after the last forward, or stop on a non-finite loss instead")
        group = dist.new_group(backend="gloo")  # every rank of the world: replicas skip together
        return FiniteLossGate(group, program.loss_region in self.state.regions, self.plan.microbatches,
                              self.config.timeout_s)

    def _install_blocks(self, timeout_s: float) -> None:
        """ZeRO-3 by block: hooks on the blocks of this rank's regions that have them."""
        state, dag = self.state, self.plan.dag
        for region in state.regions:
            specs = [b for b in dag.buckets.get(region, ()) if b.block is not None]
            if not specs:
                continue
            chunk = state.chunks[region]
            try:
                modules = [chunk.get_submodule(b.block) for b in specs]
            except AttributeError as err:
                raise ValueError(f"region {region} declares block {err} that its chunk does not have") from None
            state.blocks[region] = BlockGathers(
                region, modules, [state.buckets[(region, b.index)] for b in specs],
                self.comm.bucket_group((region, specs[0].index)), state.meter, state.bucket_lock, timeout_s,
                state.cuda)

    # -- one training step -------------------------------------------------------------------
    def step(self, *, batch: Mapping[str, torch.Tensor] | None = None,
             microbatches: Mapping[str, Sequence[Any]] | None = None,
             compute_context: Callable[[], ContextManager] | None = None) -> list[torch.Tensor]:
        """Run the rank's plan once on ``batch`` (the global batch by input name: this rank takes
        its data shard and cuts it into microbatches) or on ``microbatches`` (per input name, one
        value per microbatch, already this rank's). ``compute_context`` wraps every compute task
        (a host's thread-local state, e.g. its device meshes). Returns this rank's losses, one
        per microbatch of the loss region (none on ranks without it)."""
        state = self.state
        if (batch is None) == (microbatches is None):
            raise ValueError("Executor.step takes exactly one of batch= (the global batch) or microbatches=")
        if batch is not None:
            microbatches = self.shard(batch)
        self._check_microbatches(microbatches)
        state.inputs = {name: list(values) for name, values in microbatches.items()}
        state.losses = []
        state.batch_shapes = tuple((name, tuple(tuple(getattr(v, "shape", ())) for v in values))
                                   for name, values in state.inputs.items())
        state.meter.begin_step(state.batch_shapes)
        self._compute_context = compute_context
        if self.faces is not None:
            self._faces_out()
        if self.gate is not None:
            self.gate.begin_step()
        try:
            self.runner.run_step()
            if self.gate is not None:
                self.gate.end_step()
            self.comm.wait_sends()
            if self.comm.replica_group is not None:
                self._sum_over_replicas()
        finally:
            self._compute_context = None
            state.inputs = {}  # the step's inputs are let go with it
            if self.faces is not None:
                self.faces.faces_in()
        return list(state.losses)

    def _sum_over_replicas(self) -> None:
        """The plan's reduced gradients summed over its replicas, bucket by bucket in one order
        on every rank (buckets of one member only: the host's own wrapper reduces those)."""
        group = self.comm.replica_group
        for _, bucket in sorted(self.state.buckets.items()):
            if bucket.n > 1:
                bucket.sum_over_replicas(lambda t: dist.all_reduce(t, group=group))

    def _faces_out(self) -> None:
        """Before a step under a host optimizer over faces: the host may have written the shards
        since the last gather (a step, or a checkpoint loaded before the first one): ZeRO-1/2
        gather them whole again. It took their gradients."""
        self.faces.new_step()
        self.faces.refresh(self.comm.gather_bucket)
        self.faces.compute_in()

    def shard(self, batch: Mapping[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """This rank's data shard of the global ``batch``, on its device, cut into microbatches
        (what ``step(batch=...)`` runs; a host may cut it before it starts timing a step)."""
        return self.state.microbatches(dict(batch))

    def _check_microbatches(self, microbatches: Mapping[str, Sequence[Any]]) -> None:
        m = self.plan.microbatches
        for name, values in microbatches.items():
            if len(values) != m:
                raise ValueError(f"the plan has {m} microbatches but input {name!r} has {len(values)}")

    def _execute(self, key: str):
        node = self.plan.dag.nodes[key]
        if node.kind not in COMPUTE:
            return self.comm.run(self.state, node)  # a RECV returns its completion
        self.comm.retire_sends()  # messages that arrived free their buffers before this task's own
        context = self._compute_context
        if context is None:
            return run_compute(self.state, node)
        with context():
            result = run_compute(self.state, node)
        if isinstance(result, Continue):  # a B that sent its input gradients first: its rest too
            rest = result.rest

            def in_context() -> None:
                with context():
                    rest()
            return Continue(in_context)
        return result

    def _describe(self, key: str) -> str:
        """Who a blocked task waits for, for timeout messages."""
        node, dag, grid = self.plan.dag.nodes[key], self.plan.dag, self.plan.grid
        if node.peer is not None:
            other = grid.peer(self.rank, dag.meta.placement[dag.nodes[node.peer].region])
            return f" (a message from rank {other})" if node.kind.value == "RECV" else f" (rank {other})"
        if node.axis is not None:
            group = next(g for g in grid.groups(node.axis, node.devices) if self.rank in g)
            return f" (a collective with ranks {list(group)})"
        return ""

    # -- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def eval(self, microbatches: Mapping[str, Sequence[Any]]) -> list[torch.Tensor]:
        """Forward only: each microbatch's loss on the ranks holding the loss region (unscaled).

        Regions run in region order, each on its own rank; a value another rank needs is sent as
        soon as it is made (never blocking) and received when its consumer runs, so every rank
        walks one global order and nothing can wait in a cycle."""
        dag = self.plan.dag
        self._check_microbatches(microbatches)
        if dag.meta.sharded:
            raise ValueError(f"eval runs plans whose regions hold whole parameters; regions {sorted(dag.meta.sharded)} "
                             f"are expert-sharded: evaluate with a plan without shard()")
        if self._eval_group is None:
            self._eval_group = self._eval_groups()
        if self.faces is not None:  # the host may have written the shards since they were gathered
            self.faces.refresh(self.comm.gather_bucket)
        gathered = [(key, b) for key, b in self.state.buckets.items() if b.zero == 3]
        for key, bucket in gathered:  # ZeRO-3: the whole parameters for the evaluation, in bucket order
            self.comm.gather_bucket(key, bucket)
        if self.faces is not None:
            self.faces.compute_in()
        try:
            return self._eval(microbatches)
        finally:
            if self.faces is not None:
                self.faces.faces_in()
            for _, bucket in gathered:
                bucket.release()

    def _eval(self, microbatches: Mapping[str, Sequence[Any]]) -> list[torch.Tensor]:
        state, dag, grid = self.state, self.plan.dag, self.plan.grid
        placement, me = dag.meta.placement, grid.coords(self.rank)[0]
        regions = sorted(dag.regions.values(), key=lambda r: r.index)
        producer = {v: r.name for r in regions for v in r.outputs}
        consumers = {v: sorted({placement[r.name] for r in regions if v in r.inputs} - {placement[producer[v]]})
                     for v in producer}
        tags = {v: i for i, v in enumerate(sorted(producer))}
        losses: list[torch.Tensor] = []
        sends = []
        for mb in range(self.plan.microbatches):
            values: dict[str, Any] = {}
            for region in regions:
                if placement[region.name] != me:
                    continue
                args = []
                for v in region.inputs:
                    if v in values:
                        args.append(values[v])
                    elif v in microbatches:
                        args.append(microbatches[v][mb])
                    else:  # kept: another region of this rank may read it too
                        values[v] = self._eval_recv(v, placement[producer[v]], tags[v])
                        args.append(values[v])
                with state.forward_context():
                    outputs = dict(zip(region.outputs, state.chunks[region.name](*args)))
                values.update(outputs)
                for v, t in outputs.items():
                    for pp in consumers[v]:
                        if isinstance(t, torch.Tensor) and self.specs[v].is_tensor:
                            dst = self.comm.process_rank[grid.peer(self.rank, pp)]
                            sends.append(dist.isend(t.contiguous(), dst=dst, group=self._eval_group, tag=tags[v]))
                if region.name == state.loss_region:
                    losses.append(outputs[state.loss_value].detach())
        for work in sends:
            work.wait()
        return losses

    def _eval_groups(self):
        """This replica's group for eval messages. A collective: every process creates every
        replica's group, in replica order (``new_group`` needs all processes, same lists)."""
        world = self.plan.grid.world_size
        replicas = [list(r) for r in self.config.replicas] if self.config.replicas else [list(range(world))]
        mine = None
        for replica in replicas:
            group = dist.new_group(sorted(replica), timeout=timedelta(seconds=self.config.timeout_s))
            if replica == self.comm.process_rank:
                mine = group
        return mine

    def _eval_recv(self, value: str, pp: int, tag: int) -> Any:
        spec = self.specs[value]
        if not spec.is_tensor:
            return spec.constant
        buf = spec.empty(self.device)
        src = self.comm.process_rank[self.plan.grid.peer(self.rank, pp)]
        dist.recv(buf, src=src, group=self._eval_group, tag=tag)
        return buf

    # -- state for checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What this rank needs to resume: its parameters as it holds them (whole, or its ZeRO-3
        shard) and each region's optimizer state. Valid for the same plan and rank."""
        return {"plan": self.plan.hash(), "rank": self.rank, "params": self.state.checkpoint(),
                "optimizers": {r: o.state_dict() for r, o in self.state.optimizers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank of the same plan."""
        if (state["plan"], state["rank"]) != (self.plan.hash(), self.rank):
            raise ValueError(f"this state is rank {state['rank']} of plan {state['plan']}, but this executor is rank "
                             f"{self.rank} of plan {self.plan.hash()}: resume with the schedule that saved it")
        self.state.restore(state["params"])
        for region, opt_state in state["optimizers"].items():
            self.state.optimizers[region].load_state_dict(opt_state)
