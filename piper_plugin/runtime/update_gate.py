"""Skipping a step whose loss is not finite: every rank holds its UPDATEs until all agree.

Each step a thread on every rank joins one all-reduce (MAX over a gloo group of the plan's
ranks) of a flag: 1 on a rank holding the loss region once one of its microbatch losses is
NaN or infinite, 0 elsewhere. Ranks with the loss region join once their last loss is known;
the others at once. An UPDATE asks :meth:`FiniteLossGate.allows` and waits for the verdict, so
either every rank applies the step or none does (gradients are dropped, as if the step never
ran); everything before the UPDATEs runs untouched.

Invariant (checked when the executor is built, :func:`update_before_loss`): no loss forward is
reachable from an UPDATE through the plan's edges and every rank's stream order, so holding the
UPDATEs until every loss is known cannot deadlock.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from piper_plugin.ir.nodes import Kind
from piper_plugin.scheduler.plan import Plan

__all__ = ["FiniteLossGate", "update_before_loss"]


def update_before_loss(plan: Plan, loss_region: str) -> tuple[str, str] | None:
    """An (UPDATE, loss forward) pair where the forward can only run after the UPDATE, or None."""
    dag = plan.dag
    after: dict[str, set[str]] = {}  # stream order on every rank
    for rank_plan in plan.ranks:
        for keys in rank_plan.streams.values():
            for a, b in zip(keys, keys[1:]):
                after.setdefault(a, set()).add(b)
    for start in (k for k, n in dag.nodes.items() if n.kind == Kind.UPDATE):
        seen, frontier = {start}, [start]
        while frontier:
            key = frontier.pop()
            node = dag.nodes[key]
            if node.kind == Kind.F and node.region == loss_region:
                return start, key
            for nxt in (*dag.succs(key), *after.get(key, ())):
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
    return None


class FiniteLossGate:
    """One rank's side of the per-step agreement (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, holds_loss: bool, losses_per_step: int, timeout_s: float):
        self.group, self.holds_loss, self.expected, self.timeout_s = group, holds_loss, losses_per_step, timeout_s
        self.skipped = False  # the last verdict
        self._bad = False
        self._known = threading.Event()
        self._verdict = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._seen = 0
        self._active = False  # between begin_step and end_step (an eval's forwards are not counted)

    def begin_step(self) -> None:
        """Start this step's agreement (its thread waits for this rank's losses, if it holds any)."""
        self.end_step()
        self._bad, self._seen, self._error = False, 0, None
        self._known.clear()
        self._verdict.clear()
        if not self.holds_loss:
            self._known.set()
        self._active = True
        self._thread = threading.Thread(target=self._agree, name="piper-update-gate", daemon=True)
        self._thread.start()

    def loss(self, value: torch.Tensor) -> None:
        """A microbatch loss of this rank (called by the loss region's forward)."""
        if not self._active:
            return
        self._bad = self._bad or not bool(torch.isfinite(value.detach()).all())
        self._seen += 1
        if self._seen == self.expected:
            self._known.set()

    def _agree(self) -> None:
        try:
            if not self._known.wait(self.timeout_s):
                raise TimeoutError(f"the step's losses were not all known within {self.timeout_s:.0f}s")
            flag = torch.tensor([1 if self._bad else 0], dtype=torch.int32)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait(timedelta(seconds=self.timeout_s))
            self.skipped = bool(flag.item())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the UPDATE's stream
            self._error = exc
        finally:
            self._verdict.set()

    def allows(self) -> bool:
        """Whether this step's UPDATEs apply (every loss of every rank finite); blocks for the verdict."""
        if not self._verdict.wait(self.timeout_s) or self._error is not None:
            raise TimeoutError(f"no agreement on whether the step's losses are finite within {self.timeout_s:.0f}s"
                               + (f": {self._error!r}" if self._error is not None else ""))
        return not self.skipped

    def end_step(self) -> None:
        """Wait for this step's agreement to end (a step without UPDATEs still joins it)."""
        self._active = False
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
            self._thread = None
            if self._error is not None:
                raise TimeoutError(f"no agreement on whether the step's losses are finite: {self._error!r}")
