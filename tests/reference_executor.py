"""Reference executor: all ranks of a plan in one process, comm as tensor moves.

Each (rank, stream) runs its tasks in exactly the plan's order. A task runs when it is at
the head of its stream and its local dependencies finished; a RECV also needs its SEND's
message; a collective runs once every member of its group has it at the head of that stream.
If a sweep over all stream heads runs nothing while tasks remain, the plan deadlocks.
This is the proof of correctness before any process exists: parity tests compare its loss,
gradients and parameters with single-device training.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn

from piper_plugin.ir.capture import Program
from piper_plugin.ir.nodes import COLLECTIVES, Kind
from piper_plugin.runtime import comm_ops
from piper_plugin.runtime.compute import run_compute
from piper_plugin.runtime.pieces import stitch
from piper_plugin.runtime.rank_state import OptimizerFn, RankState
from piper_plugin.scheduler.plan import Plan
from piper_plugin.scheduler.simulate import DeadlockError

__all__ = ["ReferenceExecutor", "local_collective"]


def local_collective(node, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs of one collective for members in group order, given their inputs."""
    n = len(inputs)
    if node.kind == Kind.ALL_REDUCE:
        total = torch.stack(inputs).sum(0)
        return [total.clone() for _ in inputs]
    if node.kind == Kind.REDUCE_SCATTER:
        return [c.clone() for c in torch.stack(inputs).sum(0).chunk(n)]
    if node.kind == Kind.ALL_GATHER:
        full = torch.cat(inputs)
        return [full.clone() for _ in inputs]
    if comm_ops.is_dispatch(node):
        return [torch.cat([x.chunk(n, 0)[j] for x in inputs], dim=1) for j in range(n)]
    return [torch.cat([y.chunk(n, 1)[i] for y in inputs], dim=0) for i in range(n)]


class ReferenceExecutor:
    """Runs a compiled plan for real, every rank simulated in this process."""

    def __init__(self, plan: Plan, program: Program, model: nn.Module, loss_fn: Callable,
                 optimizer_fn: OptimizerFn):
        self.plan = plan
        self.states = [RankState(r, plan, program, copy.deepcopy(model), loss_fn, optimizer_fn)
                       for r in range(plan.grid.world_size)]
        self.input_names = [n for n in program.input_names]

    def step(self, *batch: torch.Tensor) -> torch.Tensor:
        """One training step on the global batch (model inputs then target); returns the loss."""
        named = dict(zip(self.input_names, batch))
        for state in self.states:
            state.set_batch(named)
        self._run()
        return torch.stack([loss for s in self.states for loss in s.losses]).sum()

    def _run(self) -> None:
        plan, grid, dag = self.plan, self.plan.grid, self.plan.dag
        heads = {(r, s): 0 for r in range(grid.world_size) for s in plan.ranks[r].streams}
        done: set[tuple[int, str]] = set()
        mailbox: dict[tuple[int, str], dict] = {}
        remaining = sum(len(rp.deps) for rp in plan.ranks)
        while remaining:
            progressed = False
            for (r, stream), i in list(heads.items()):
                keys = plan.ranks[r].streams[stream]
                if i >= len(keys) or heads[(r, stream)] != i:
                    continue
                key = keys[i]
                if any((r, d) not in done for d in plan.ranks[r].deps[key]):
                    continue
                node = dag.nodes[key]
                state = self.states[r]
                if node.kind in COLLECTIVES:
                    group = next(g for g in grid.groups(node.axis, node.devices) if r in g)
                    if not all(self._at_head(heads, m, node.stream, key, done) for m in group):
                        continue
                    outputs = local_collective(node, [comm_ops.payload(self.states[m], node) for m in group])
                    finished = group
                    for m, out in zip(group, outputs):
                        comm_ops.absorb(self.states[m], node, out)
                elif node.kind == Kind.SEND:
                    dst = grid.peer(r, dag.meta.placement[dag.nodes[node.peer].region])
                    mailbox[(dst, node.peer)] = comm_ops.payload(state, node)
                    state.finished(key)
                    finished = (r,)
                elif node.kind == Kind.RECV:
                    if (r, key) not in mailbox:
                        continue
                    comm_ops.absorb(state, node, mailbox.pop((r, key)))
                    finished = (r,)
                else:
                    continued = run_compute(state, node)
                    if continued is not None:  # one process: the rest of a split B runs right away
                        continued.rest()
                    finished = (r,)
                for m in finished:
                    done.add((m, key))
                    heads[(m, node.stream)] += 1
                remaining -= len(finished)
                progressed = True
            if not progressed:
                blocked = [f"rank {r} {s}: {plan.ranks[r].streams[s][i]}" for (r, s), i in heads.items()
                           if i < len(plan.ranks[r].streams[s])]
                raise DeadlockError("reference run is stuck at " + "; ".join(blocked[:12]))

    def _at_head(self, heads, r: int, stream: str, key: str, done) -> bool:
        keys = self.plan.ranks[r].streams.get(stream, [])
        i = heads.get((r, stream), len(keys))
        return i < len(keys) and keys[i] == key and all((r, d) in done for d in self.plan.ranks[r].deps[key])

    # -- inspection for parity tests ----------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, stitched from ZeRO shards and EP slices of all ranks."""
        return stitch([p for s in self.states for p in s.param_pieces()])

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Reduced gradients of the last step (recorded by UPDATE), stitched likewise."""
        return stitch([p for s in self.states for ps in s.grad_pieces.values() for p in ps])
