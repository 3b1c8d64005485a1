"""torch.distributed backend: communicators from the plan's rank grid, one op per comm node.

Every rank creates the same groups in the same order (``new_group`` is collective): one per
P2P direction and replica pair (``p2p:a>b`` for the ranks sharing dp/ep coordinates) and one
per (logical stream, axis, member set) of the collectives. A communicator therefore belongs to
exactly one logical stream, so streams running on their own threads never share one.

A host framework may run the same plan once per data-parallel replica: ``replicas[i][r]`` is
then the process rank of plan rank ``r`` in replica ``i``. Every process creates every replica's
communicators (in replica order), keeps its own, and addresses peers by process rank; plan
ranks stay what the plan, its state and its streams use. ``replica_group`` joins one plan
rank's copies across the replicas (ZeRO shards' gradients are summed over it after a step).

Under tensor parallelism a plan rank is a TP group: every member runs the same plan on its
local shards. The copies are then ordered (data-parallel replica, TP coordinate), TP fastest
(``tensor_parallel`` of them per replica); each TP coordinate has its own communicators, so a
message goes to the same TP coordinate of its peer and Piper's collectives (ZeRO buckets, the
expert exchange) run over ranks of one TP coordinate; ``replica_group`` joins only the copies
of one TP coordinate (different coordinates hold different shards and never sum).
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from piper_plugin.ir.nodes import COLLECTIVES, Kind, Node
from piper_plugin.runtime import comm_ops
from piper_plugin.runtime.group_collectives import GroupCollectives, all_gather_into, reduce_scatter_into
from piper_plugin.runtime.rank_state import RankState
from piper_plugin.runtime.token_exchange import TokenExchanges
from piper_plugin.runtime.value_specs import ValueSpec
from piper_plugin.scheduler.plan import Plan

__all__ = ["DistComm", "communicator_specs", "block_regions"]


def communicator_specs(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """(stream, ranks) of every communicator the plan needs, in one deterministic order."""
    grid, dag = plan.grid, plan.dag
    specs: set[tuple[str, tuple[int, ...]]] = set()
    for node in dag.nodes.values():
        if node.kind == Kind.SEND:
            dst_pp = dag.meta.placement[dag.nodes[node.peer].region]
            for r in node.devices:
                specs.add((node.stream, tuple(sorted((r, grid.peer(r, dst_pp))))))
        elif node.kind in COLLECTIVES:
            for group in grid.groups(node.axis, node.devices):
                specs.add((node.stream, group))
    for region, axis, devices in block_regions(plan):
        for group in grid.groups(axis, devices):
            specs.add((block_stream(region), group))
    return sorted(specs)


def block_stream(region: str) -> str:
    """The communicator name of a region's ZeRO-3 blocks (used inside its chunk only)."""
    return f"blocks:{region}"


def block_regions(plan: Plan) -> list[tuple[str, str, tuple[int, ...]]]:
    """(region, replica axis, devices) of every region with ZeRO-3 buckets by block."""
    dag = plan.dag
    return [(region, "dp" if region in dag.meta.sharded else "data", buckets[0].group)
            for region, buckets in sorted(dag.buckets.items()) if any(b.block is not None for b in buckets)]


class DistComm:
    def __init__(self, plan: Plan, rank: int, specs: dict[str, ValueSpec], timeout_s: float,
                 device: torch.device = torch.device("cpu"), replicas: list[list[int]] | None = None,
                 tensor_parallel: int = 1):
        self.plan, self.rank, self.specs, self.device = plan, rank, specs, device
        world = plan.grid.world_size
        replicas = replicas or [list(range(world))]
        if any(len(r) != world for r in replicas):
            raise ValueError(f"every replica must list {world} process ranks (one per plan rank): {replicas}")
        if tensor_parallel < 1 or len(replicas) % tensor_parallel:
            raise ValueError(f"{len(replicas)} copies of the plan are not a whole number of tensor-parallel groups "
                             f"of {tensor_parallel}")
        me = dist.get_rank()
        mine = [r for r in replicas if r[rank] == me]
        if len(mine) != 1:
            raise ValueError(f"process rank {me} is not plan rank {rank} of exactly one replica in {replicas}")
        self.process_rank = mine[0]  # plan rank -> process rank, in this process's replica
        self.groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        # (work, tensor, bytes, meter): a SEND never blocks its stream (buffered, as simulated); its
        # message stays on its rank's meter until the send completed and was let go
        self.sends: list = []
        self._sends_lock = threading.Lock()  # sends go out from several streams' threads
        timeout = timedelta(seconds=timeout_s)
        self.wait_limit = None if device.type == "cuda" else timeout  # NCCL's watchdog bounds GPU waits
        self._ops: dict[tuple[str, tuple[int, ...]], GroupCollectives] = {}  # per communicator
        self._bucket_ops: dict[tuple[str, int], GroupCollectives] = {}  # per bucket, outside the plan
        self.exchanges = TokenExchanges()  # routed expert regions' all-to-alls
        for replica in replicas:
            for stream, ranks in communicator_specs(plan):
                group = dist.new_group([replica[r] for r in ranks], timeout=timeout, use_local_synchronization=False)
                if replica is mine[0] and rank in ranks:
                    self.groups[(stream, ranks)] = group
        # each plan rank's copies across the replicas: the host's data parallelism around the plan's
        self.replica_group: dist.ProcessGroup | None = None
        self.tp_coordinate = replicas.index(mine[0]) % tensor_parallel
        if len(replicas) > tensor_parallel:
            for coordinate in range(tensor_parallel):
                copies = replicas[coordinate::tensor_parallel]
                for r in range(world):
                    group = dist.new_group([replica[r] for replica in copies], timeout=timeout,
                                           use_local_synchronization=False)
                    if r == rank and coordinate == self.tp_coordinate:
                        self.replica_group = group
        self._bucket_groups = {(node.region, node.bucket): self._group(node)[1] for node in plan.dag.nodes.values()
                               if node.kind in (Kind.REDUCE_SCATTER, Kind.ALL_GATHER) and rank in node.devices}
        for region, axis, devices in block_regions(plan):
            if rank in devices:
                members = next(g for g in plan.grid.groups(axis, devices) if rank in g)
                for b in plan.dag.buckets[region]:
                    if b.block is not None:
                        self._bucket_groups[(region, b.index)] = self.groups[(block_stream(region), members)]

    def wait_sends(self) -> None:
        with self._sends_lock:
            sends, self.sends = self.sends, []
        for work, _, nbytes, meter in sends:
            work.wait()
            meter.add(-nbytes)

    def retire_sends(self) -> None:
        """Let go of the sends that completed (their ``wait`` returns at once, or raises their
        error): a step holds only the messages still in flight, not every one it sent. Cheap
        enough to call before every compute task (a flag check per send in flight)."""
        if not self.sends:
            return
        in_flight, done = [], []
        with self._sends_lock:
            for sent in self.sends:
                (done if sent[0].is_completed() else in_flight).append(sent)
            self.sends = in_flight
        for work, _, nbytes, meter in done:
            meter.add(-nbytes)
            work.wait()

    def _add_send(self, work, tensor: torch.Tensor, nbytes: int, meter) -> None:
        """Keep ``work`` and its tensor, counted as ``nbytes`` on ``meter``, until it completes."""
        self.retire_sends()
        with self._sends_lock:
            self.sends.append((work, tensor, nbytes, meter))

    def _check_spec(self, state: RankState, node: Node, name: str, value: torch.Tensor) -> None:
        """The receiver allocates from the probed spec: a message of another shape or dtype
        would corrupt the stream (gloo aborts the process), so the sender names it instead."""
        spec = self.specs.get(name.removeprefix("grad:"))
        if spec is not None and spec.is_tensor and (tuple(value.shape) != spec.shape or value.dtype != spec.dtype):
            raise RuntimeError(f"rank {state.rank}: {node.key} would send {name} as {value.dtype} {tuple(value.shape)} "
                               f"but its receiver expects {spec.dtype} {spec.shape} (probed on one microbatch, without "
                               f"gradients, before the job started): a value that crosses ranks keeps the shape and "
                               f"dtype of that probe; run mixed precision through Job(autocast=...), which the probe "
                               f"sees, not through casts that depend on grad mode or on the data")

    def channel(self, node: Node) -> tuple[int, dist.ProcessGroup]:
        """The other side of a SEND / RECV: its process rank and the pair's communicator."""
        dag = self.plan.dag
        peer = self.plan.grid.peer(self.rank, dag.meta.placement[dag.nodes[node.peer].region])
        return self.process_rank[peer], self.groups[(node.stream, tuple(sorted((self.rank, peer))))]

    def bucket_group(self, key: tuple[str, int]) -> dist.ProcessGroup:
        """The communicator of ZeRO bucket ``key`` (region, index)'s collectives on this rank."""
        return self._bucket_groups[key]

    def gather_bucket(self, key: tuple[str, int], bucket) -> None:
        """Gather bucket ``key``'s whole parameters into ``bucket`` (a :class:`FlatBucket`) over
        its group, outside the plan (a host's step or an eval; every member calls it in the same
        bucket order)."""
        if key not in self._bucket_ops:
            self._bucket_ops[key] = GroupCollectives(self._bucket_groups[key], bucket.index, bucket.n)
        self._gather_into(self._bucket_ops[key], bucket)

    def _gather_into(self, ops: GroupCollectives, bucket) -> None:
        """``bucket``'s whole parameters from every member's shard: on gloo as pairwise exchanges
        straight into them where its rows split evenly, else through one rank-major buffer."""
        if ops.pairwise and bucket.in_place:
            works, _ = ops.gather_bucket(bucket)
            ops.finish(works, self.wait_limit)
            return
        shard = bucket.shard_data().contiguous()
        out = shard.new_empty(shard.numel() * bucket.n)
        ops.finish(ops.gather(out, shard), self.wait_limit)
        bucket.materialize(out)

    def _group(self, node: Node) -> tuple[tuple[int, ...], dist.ProcessGroup]:
        members = next(g for g in self.plan.grid.groups(node.axis, node.devices) if self.rank in g)
        return members, self.groups[(node.stream, members)]

    def _group_ops(self, node: Node) -> GroupCollectives:
        members, group = self._group(node)
        key = (node.stream, members)
        if key not in self._ops:
            self._ops[key] = GroupCollectives(group, members.index(self.rank), len(members))
        return self._ops[key]

    def _bucket_collective(self, state: RankState, node: Node, ops: GroupCollectives) -> None:
        """A bucket's REDUCE_SCATTER or step ALL_GATHER as pairwise exchanges (gloo): from the
        gradients and into the parameters where the bucket's rows split evenly, else through
        one rank-major buffer; no copy of the payload inside the backend."""
        bucket = state.buckets[(node.region, node.bucket)]
        if node.kind == Kind.ALL_GATHER:  # the step's: ZeRO-1/2 parameters anew from the stepped shards
            self._gather_into(ops, bucket)
            state.finished(node.key)
            return
        if node.phase == "step" and bucket.in_place:
            works, out, sources = ops.reduce_bucket(bucket)
        else:
            sources = comm_ops.payload(state, node).contiguous()  # a microbatch's handed-over gradient, or the step's
            out = sources.new_empty(sources.numel() // ops.n)
            works = ops.reduce_scatter(out, sources)
        ops.finish(works, self.wait_limit)
        del works, sources  # the gradients and messages go before the result is kept
        comm_ops.absorb(state, node, out)

    def run(self, state: RankState, node: Node) -> Callable[[float], None] | None:
        """Issue ``node``'s operation. SENDs are asynchronous (let go by :meth:`retire_sends` once
        done, by :meth:`wait_sends` at the latest);
        a RECV is posted and returns its completion (wait for the message, then deliver it,
        within the seconds it is given); collectives block. A ZeRO-3 gather lays the gathered
        shards out into the bucket's parameters when no copy is held (:func:`comm_ops.gather_target`)."""
        dag = self.plan.dag
        if node.kind == Kind.SEND:
            dst, group = self.channel(node)
            values = state.take(node.key, counted=True)  # counted until the message is out
            for name in sorted(values):
                value = values[name]
                if isinstance(value, torch.Tensor):
                    self._check_spec(state, node, name, value)
                    tensor = value.contiguous()
                    work = dist.isend(tensor, dst=dst, group=group)
                    self._add_send(work, tensor, value.numel() * value.element_size(), state.meter)
            state.finished(node.key)
        elif node.kind == Kind.RECV:
            src, group = self.channel(node)
            out, works = {}, []
            for name in sorted(v for vs in dag.data_pred[node.key].values() for v in vs):
                spec = self.specs[name.removeprefix("grad:")]
                if not spec.is_tensor:
                    out[name] = spec.constant
                    continue
                out[name] = spec.empty(self.device)
                works.append(dist.irecv(out[name], src=src, group=group))
            in_flight = sum(t.numel() * t.element_size() for t in out.values() if isinstance(t, torch.Tensor))
            state.meter.add(in_flight)  # the buffers exist from now on

            on_gpu = self.device.type == "cuda"

            def complete(seconds: float) -> None:
                # On a GPU the consumer's stream waits for the message on the device: a timeout
                # would block this thread until it arrived. NCCL's watchdog ends a rank whose
                # message never comes once the group's timeout (the job's) has passed.
                for work in works:
                    if on_gpu:
                        work.wait()
                    else:
                        work.wait(timedelta(seconds=seconds))
                state.meter.add(-in_flight)  # delivered: counted in the inboxes from here
                comm_ops.absorb(state, node, out)

            return complete
        elif node.kind == Kind.ALL_TO_ALL and node.region in dag.meta.routed:  # uneven, data-dependent splits
            self.exchanges.run(state, node, *self._group(node))
        elif node.kind == Kind.ALL_GATHER and node.phase in ("F", "B"):  # ZeRO-3: into the bucket
            ops = self._group_ops(node)
            shard = comm_ops.payload(state, node)
            out = shard.new_empty(shard.numel() * ops.n)
            ops.finish(ops.gather(out, shard.contiguous()), self.wait_limit)
            if comm_ops.gather_target(state, node):  # no copy held yet: the gathered parameters go in
                state.buckets[(node.region, node.bucket)].materialize(out)
            state.finished(node.key)
        elif node.kind in (Kind.REDUCE_SCATTER, Kind.ALL_GATHER) and (ops := self._group_ops(node)).pairwise:
            self._bucket_collective(state, node, ops)
        else:
            members, group = self._group(node)
            comm_ops.absorb(state, node, _collective(node, comm_ops.payload(state, node), len(members), group))


def _collective(node: Node, x: torch.Tensor, n: int, group) -> torch.Tensor:
    if node.kind == Kind.ALL_REDUCE:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x
    if node.kind == Kind.REDUCE_SCATTER:
        out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
        reduce_scatter_into(out, x.contiguous(), group=group)
        return out
    if node.kind == Kind.ALL_GATHER:
        out = torch.empty(x.numel() * n, dtype=x.dtype, device=x.device)
        all_gather_into(out, x.contiguous(), group=group)
        return out
    x = x.contiguous()  # gradients from autograd.grad may come permuted
    if comm_ops.is_dispatch(node):  # [E, C, D] -> [E/n, n*C, D]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, group=group)
        e, c = x.shape[0] // n, x.shape[1]
        return out.view(n, e, c, *x.shape[2:]).transpose(0, 1).reshape(e, n * c, *x.shape[2:])
    e, c = x.shape[0], x.shape[1] // n  # combine: [E/n, n*C, D] -> [E, C, D]
    send = x.view(e, n, c, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty(send.shape, dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send, group=group)
    return out.reshape(n * e, c, *x.shape[2:])
