"""Logical streams: the compute stream on the caller's thread, a host thread for every other
stream, an event per task another stream waits for; on a GPU also one CUDA stream per logical
stream.

The stream with the most compute tasks runs on the calling thread, as the host framework's
own engine would run it: its thread-local state (grad mode, autocast, meshes) holds, and its
allocations come from the main malloc arena. A helper thread's arena unmaps a heap as soon as
it is empty, so activations allocated there page-fault afresh every step (measured: about 16k
faults and +19% forward time per step on a TorchTitan stage). Every other stream gets a helper
thread. A task waits only for its dependencies on *other* streams (same-stream order is the list
order); torch ops and gloo release the GIL, so communication on one thread overlaps compute on
another. On a GPU each thread issues work on its own CUDA stream, and a CUDA event is recorded
and waited on only where a dependency crosses streams. The first failure aborts the step: every
stream stops at its next wait and the caller gets the original exception with the rank and task
named. Waits are bounded by ``timeout_s``.
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Callable

import torch

from piper_plugin.scheduler.plan import Plan, RankPlan

__all__ = ["StreamRunner", "TaskFailed", "compute_stream"]


def compute_stream(plan: Plan, rank: int) -> str | None:
    """The stream of ``rank`` with the most compute tasks (the one the caller's thread runs)."""
    streams = plan.ranks[rank].streams
    return max(streams, key=lambda s: sum(plan.dag.nodes[k].is_compute for k in streams[s]), default=None)


class TaskFailed(RuntimeError):
    """A task raised or a wait timed out; ``details`` holds the original traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message + ("\n" + details if details else ""))
        self.details = details


class StreamRunner:
    def __init__(self, rank: int, plan: RankPlan, execute: Callable[[str], None], timeout_s: float,
                 describe: Callable[[str], str] = lambda key: "", device: torch.device = torch.device("cpu"),
                 inline: str | None = None):
        self.rank, self.plan, self.execute, self.timeout_s = rank, plan, execute, timeout_s
        self.describe, self.device = describe, device
        self.cross = {k: tuple(d for d in deps if not self._same_stream(k, d)) for k, deps in plan.deps.items()}
        self.timeline: list[tuple[str, str, float, float]] = []
        self.cuda = device.type == "cuda"
        self.cuda_streams = {s: torch.cuda.Stream(device) for s in plan.streams} if self.cuda else {}
        self.crossed = {d for deps in self.cross.values() for d in deps}  # tasks that need an event
        self.inline = inline if inline in plan.streams else None  # runs on the caller's thread

    def _same_stream(self, a: str, b: str) -> bool:
        return self._stream_of(a) == self._stream_of(b)

    def _stream_of(self, key: str) -> str:
        if not hasattr(self, "_streams"):
            self._streams = {k: s for s, keys in self.plan.streams.items() for k in keys}
        return self._streams[key]

    def run_step(self) -> None:
        done = {k: threading.Event() for k in self.crossed}  # only what another stream waits for
        abort = threading.Event()
        failure: list[TaskFailed] = []
        deadline = time.monotonic() + self.timeout_s
        timeline: list[tuple[str, str, float, float]] = []
        heads: dict[str, tuple[str, ...]] = {}  # what each stream is doing; words only on a timeout

        def say(head: tuple[str, ...]) -> str:
            if head[0] == "wait":
                return f"{head[1]} waits for {head[2]}{self.describe(head[2])}"
            if head[0] == "run":
                detail = self.describe(head[1])  # comm names its peers; compute names nobody
                return f"in {head[1]}{detail}" if detail else f"computing {head[1]}"
            return "finished"

        def report() -> str:
            return "; ".join(f"{s}: {say(h)}" for s, h in sorted(heads.items()))

        threads_per_op = torch.get_num_threads()
        cuda_events: dict[str, torch.cuda.Event] = {}

        def run(stream: str, keys: list[str]) -> None:
            key = ""
            previous_stream = None
            if stream != self.inline:
                torch.set_num_threads(threads_per_op)  # OpenMP's setting is per thread: carry it over
            if self.cuda:
                torch.cuda.set_device(self.device)
                previous_stream = torch.cuda.current_stream(self.device)
                torch.cuda.set_stream(self.cuda_streams[stream])
            try:
                for key in keys:
                    for dep in self.cross[key]:
                        heads[stream] = ("wait", key, dep)
                        while not done[dep].wait(0.05):
                            if abort.is_set():
                                return
                            if time.monotonic() > deadline:
                                raise TimeoutError(f"waited more than {self.timeout_s:.0f}s for {dep}"
                                                   f"{self.describe(dep)}; streams: {report()}")
                    if self.cuda:
                        for dep in self.cross[key]:
                            torch.cuda.current_stream().wait_event(cuda_events[dep])
                    heads[stream] = ("run", key)
                    start = time.perf_counter()
                    self.execute(key)
                    timeline.append((stream, key, start, time.perf_counter()))
                    if self.cuda and key in self.crossed:
                        cuda_events[key] = torch.cuda.Event()
                        cuda_events[key].record()
                    if key in done:
                        done[key].set()
                heads[stream] = ("done",)
            except BaseException as exc:  # noqa: BLE001 - reported with its traceback
                if not abort.is_set():
                    failure.append(TaskFailed(f"rank {self.rank}: task {key}{self.describe(key)} on stream {stream!r} "
                                              f"failed: {exc!r}",
                                              traceback.format_exc()))
                abort.set()
            finally:
                if previous_stream is not None:
                    torch.cuda.set_stream(previous_stream)

        threads = [threading.Thread(target=run, args=item, daemon=True, name=f"piper-{self.rank}-{item[0]}")
                   for item in self.plan.streams.items() if item[0] != self.inline]
        for t in threads:
            t.start()
        if self.inline is not None:  # its waits watch the deadline and the other streams' failures
            run(self.inline, self.plan.streams[self.inline])
        # Then the caller only watches: a thread stuck in a collective cannot hide another's failure.
        while not abort.is_set():
            alive = [t for t in threads if t.is_alive()]  # one snapshot: a thread may end in between
            if not alive:
                break
            alive[0].join(0.02)
            if time.monotonic() > deadline + 1 and not abort.is_set():
                abort.set()
                failure.append(TaskFailed(f"rank {self.rank}: step did not finish within {self.timeout_s:.0f}s"))
        if failure:
            raise failure[0]
        for cuda_stream in self.cuda_streams.values():
            cuda_stream.synchronize()
        self.timeline = timeline
