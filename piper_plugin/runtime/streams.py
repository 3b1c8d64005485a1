"""Logical streams: the compute stream on the caller's thread, P2P streams posted without a
thread, a host thread for every other stream; on a GPU also one CUDA stream per logical stream.

The stream with the most compute tasks runs on the calling thread, as the host framework's
own engine would run it: its thread-local state (grad mode, autocast, meshes) holds, and its
allocations come from the main malloc arena. A helper thread's arena unmaps a heap as soon as
it is empty, so activations allocated there page-fault afresh every step (measured: about 16k
faults and +19% forward time per step on a TorchTitan stage).

A *posted* stream (P2P sends or receives: asynchronous operations) has no thread. Its tasks are
posted strictly in stream order by whichever thread finishes their last dependency (a SEND goes
out right after the chunk that made it, with no thread hand-off; send streams are posted
before receive streams), receives are posted ahead of their consumers as
:mod:`piper_plugin.scheduler.posting` says (``post_ahead`` deep, deeper while their buffers fit
in ``post_budget`` bytes; without ``sizes``, ``post_ahead`` deep) from the end of the caller's
first task on, or earlier by a thread about to wait (a first chunk that needs no message is
not delayed by posting a step's receives: about 0.1 ms each), and
``execute`` returns a *completion* for a task that finishes later: the first task that depends
on it runs the completion on its own thread (waits for the message and delivers it). A task on a
threaded stream may instead return a :class:`Continue`: it counts as done, its messages go out,
then its rest runs before the stream's next task; ``after`` runs host work after each task once
its messages are out. A thread
hand-off per message cost milliseconds of wake-up latency on a loaded CPU; posting keeps the
overlap (the transport moves the bytes) without it.

Every other stream (blocking collectives) gets a helper thread. A task waits only for its
dependencies on *other* streams (same-stream order is the list order); torch ops and gloo
release the GIL, so communication on one thread overlaps compute on another. On a GPU each
thread issues work on its own CUDA stream, and a CUDA event is recorded and waited on only
where a dependency crosses streams; a received value's event is recorded again where its
completion ran (the completion's wait orders that stream after the transfer), so every consumer
waits for the arrival, not the post. Every CUDA stream starts the step behind an event on the
caller's stream (the batch copy and whatever else the caller queued before). The timeline is
host time on a CPU; on a GPU, timing events around each task on its stream (device time).

The first failure aborts the step: every stream stops at its next wait and the caller gets the
original exception with the rank and task named. Waits are bounded by ``timeout_s``.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from piper_plugin.scheduler.plan import RankPlan
from piper_plugin.scheduler.posting import POST_AHEAD, POST_BUDGET

__all__ = ["StreamRunner", "RunnerConfig", "TaskFailed", "Continue"]

Completion = Callable[[float], None]  # called with the seconds left before the step's deadline


class Continue:
    """What a task on a threaded stream returns to finish in two parts: the runner marks the
    task done, posts the messages that enabled, then calls ``rest`` on the same thread before
    the stream's next task. Only for a task whose dependents on other streams need nothing
    ``rest`` makes (e.g. a backward's weight-gradient pass after its input gradients left)."""

    __slots__ = ("rest",)

    def __init__(self, rest: Callable[[], None]):
        self.rest = rest


class TaskFailed(RuntimeError):
    """A task raised or a wait timed out; ``details`` holds the original traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message + ("\n" + details if details else ""))
        self.details = details


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """The stream runner's knobs: every wait's bound and the receive-posting policy
    (:mod:`piper_plugin.scheduler.posting`)."""

    timeout_s: float = 60.0
    post_ahead: int = POST_AHEAD
    post_budget: int = POST_BUDGET


class StreamRunner:
    """Runs one rank's plan, step after step: ``plan`` says which stream the caller's thread
    runs (``inline``), which are posted and how large each posted task is (``post_bytes``;
    empty: the posting policy counts receives only)."""

    def __init__(self, plan: RankPlan, execute: Callable[[str], Completion | None],
                 config: RunnerConfig = RunnerConfig(), *, describe: Callable[[str], str] = lambda key: "",
                 device: torch.device = torch.device("cpu"), after: Callable[[str], None] | None = None):
        self.rank, self.plan, self.execute, self.timeout_s = plan.rank, plan, execute, config.timeout_s
        inline, posted, sizes = plan.inline, plan.posted, plan.post_bytes or None
        post_ahead, post_budget = config.post_ahead, config.post_budget
        self.after = after  # runs after a threaded task, once the messages it enabled are posted
        self.describe, self.device = describe, device
        self.stream_of = {k: s for s, keys in plan.streams.items() for k in keys}
        self.position = {k: i for keys in plan.streams.values() for i, k in enumerate(keys)}
        self.cross = {k: tuple(d for d in deps if self.stream_of[d] != self.stream_of[k])
                      for k, deps in plan.deps.items()}
        self.timeline: list[tuple[str, str, float, float]] = []
        self.cuda = device.type == "cuda"
        self.cuda_streams = {s: torch.cuda.Stream(device) for s in plan.streams} if self.cuda else {}
        self.crossed = {d for deps in self.cross.values() for d in deps}  # tasks that need an event
        self.inline = inline if inline in plan.streams else None  # runs on the caller's thread
        self.post_order = [s for s in posted if s in plan.streams and s != self.inline]  # as given: sends first
        self.posted = set(self.post_order)
        self.post_ahead = max(1, post_ahead)
        self.post_budget = post_budget if sizes is not None else -1  # no sizes: count only
        self.sizes = {k: (sizes or {}).get(k, 0) for s in self.posted for k in plan.streams[s]}  # buffer bytes
        # tasks that get a per-step event: waited for across streams, or posted (waited for when forced)
        self.evented = self.crossed | {k for s in self.posted for k in plan.streams[s]}
        self.active: _Step | None = None  # the step running now, if any

    def run_step(self) -> None:
        step = self.active = _Step(self)
        try:
            step.run()
        finally:
            self.active = None

    def status(self) -> str:
        """What each stream is doing now (callable from another thread, e.g. a stall report)."""
        step = self.active
        if step is None:
            return "between steps"
        return step.report() or "starting a step"


class _Step:
    """One step's run of a :class:`StreamRunner`'s plan (all per-step state lives here)."""

    def __init__(self, runner: StreamRunner):
        self.r = runner
        self.done = {k: threading.Event() for k in runner.evented}
        self.abort = threading.Event()
        self.failure: list[TaskFailed] = []
        self.deadline = time.monotonic() + runner.timeout_s
        self.timeline: list[tuple[str, str, float, float]] = []
        self.heads: dict[str, tuple[str, ...]] = {}  # what each stream is doing; words only on a timeout
        self.cuda_events: dict[str, torch.cuda.Event] = {}
        self.ambient = None  # on a GPU: the caller's stream at step start (its batch copy, ...)
        if runner.cuda:  # also the timeline's origin: its device time is taken as this host time
            self.ambient = torch.cuda.Event(enable_timing=True)
            self.ambient.record(torch.cuda.current_stream(runner.device))
            self.origin = time.perf_counter()
        # posted streams: next index to post, completions not yet run, one lock per stream
        self.next = {s: 0 for s in runner.posted}
        self.outstanding = {s: 0 for s in runner.posted}
        self.outstanding_bytes = {s: 0 for s in runner.posted}
        self.locks = {s: threading.Lock() for s in runner.posted}
        self.pending: dict[str, tuple[threading.Lock, list]] = {}
        self.threads_per_op = torch.get_num_threads()

    # -- words -------------------------------------------------------------------------------
    def say(self, head: tuple[str, ...]) -> str:
        if head[0] == "wait":
            return f"{head[1]} waits for {head[2]}{self.r.describe(head[2])}"
        if head[0] == "run":
            detail = self.r.describe(head[1])  # comm names its peers; compute names nobody
            return f"in {head[1]}{detail}" if detail else f"computing {head[1]}"
        return "finished"

    def report(self) -> str:
        return "; ".join(f"{s}: {self.say(h)}" for s, h in sorted(self.heads.items()))

    def failed(self, key: str, stream: str, exc: BaseException) -> TaskFailed:
        if isinstance(exc, TaskFailed):
            return exc
        return TaskFailed(f"rank {self.r.rank}: task {key}{self.r.describe(key)} on stream {stream!r} failed: {exc!r}",
                          traceback.format_exc())

    # -- waiting -----------------------------------------------------------------------------
    def wait_for(self, stream: str, key: str, dep: str) -> bool:
        """Block until ``dep`` is done (posted, for a posted task); False if the step aborted."""
        if self.r.stream_of[dep] in self.r.posted:
            self.post(self.r.stream_of[dep], upto=dep, waiter=(stream, key))
        self.heads[stream] = ("wait", key, dep)
        event = self.done[dep]
        if not event.is_set() or self._incomplete(dep):  # about to idle: post what the policy allows first
            self.post_all()
        while not event.wait(0.05):
            if self.abort.is_set():
                return False
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"waited more than {self.r.timeout_s:.0f}s for {dep}"
                                   f"{self.r.describe(dep)}; streams: {self.report()}")
        if dep in self.pending:
            self.complete(dep)
        return not self.abort.is_set()

    def complete(self, key: str) -> None:
        """Run a posted task's completion once; other waiters block until it has run."""
        entry = self.pending.get(key)
        if entry is None:
            return
        lock, holder = entry
        with lock:
            if not holder:
                return
            stream, start = self.r.stream_of[key], holder[1]
            try:
                holder[0](max(self.deadline - time.monotonic(), 0.001))
            except BaseException as exc:  # noqa: BLE001 - reported with its traceback
                late = time.monotonic() >= self.deadline
                raise TaskFailed(f"rank {self.r.rank}: task {key}{self.r.describe(key)} on stream {stream!r} "
                                 + (f"waited more than {self.r.timeout_s:.0f}s: " if late else "failed: ")
                                 + repr(exc), traceback.format_exc()) from None
            if self.r.cuda and key in self.r.crossed:  # the message is here only from now on: every
                self.record(key)  # later waiter on another stream waits for this point, not the post
            holder.clear()
            self.timeline.append((stream, key, start, self.stamp()))
        with self.locks[stream]:
            self.outstanding[stream] -= 1
            self.outstanding_bytes[stream] -= self.r.sizes[key]
        self.post(stream)

    # -- posted streams ----------------------------------------------------------------------
    def post(self, stream: str, upto: str | None = None, waiter: tuple[str, str] | None = None) -> None:
        """Post ``stream``'s tasks in order: those whose dependencies are done and, without
        ``upto``, while fewer than ``post_ahead`` completions are outstanding or their bytes
        fit in ``post_budget``; with ``upto``, every task up to it, waiting for their
        dependencies (on ``waiter``'s behalf)."""
        keys = self.r.plan.streams[stream]
        target = self.r.position[upto] + 1 if upto is not None else len(keys)
        while True:
            blocker, posted = None, False
            with self.locks[stream]:
                while self.next[stream] < target:
                    key = keys[self.next[stream]]
                    if (upto is None and self.outstanding[stream] >= self.r.post_ahead
                            and self.outstanding_bytes[stream] + self.r.sizes[key] > self.r.post_budget):
                        break
                    blocker = next((d for d in self.r.cross[key] if not self.done[d].is_set()
                                    or self._incomplete(d)), None)
                    if blocker is not None:
                        break
                    self._post_one(stream, key)
                    self.next[stream] += 1
                    posted = True
            if posted:  # what was posted may free the head of another posted stream
                for other in self.r.post_order:
                    if other != stream:
                        self.post(other)
            if upto is None or blocker is None:
                return
            owner = waiter or (stream, key)
            if not self.wait_for(owner[0], owner[1], blocker):
                return

    def post_all(self) -> None:
        for stream in self.r.post_order:
            self.post(stream)

    def _incomplete(self, key: str) -> bool:
        entry = self.pending.get(key)
        return entry is not None and bool(entry[1])

    def _post_one(self, stream: str, key: str) -> None:
        try:
            if self.r.cuda:
                for dep in self.r.cross[key]:
                    torch.cuda.current_stream().wait_event(self.cuda_events[dep])
            start = self.stamp()
            completion = self.r.execute(key)
        except BaseException as exc:  # noqa: BLE001 - reported with its traceback
            raise self.failed(key, stream, exc) from None
        if completion is not None:
            self.pending[key] = (threading.Lock(), [completion, start])
            self.outstanding[stream] += 1
            self.outstanding_bytes[stream] += self.r.sizes[key]
        else:
            self.timeline.append((stream, key, start, self.stamp()))
        self.signal(key)

    def signal(self, key: str) -> None:
        if self.r.cuda and key in self.r.crossed:
            self.record(key)
        if key in self.done:
            self.done[key].set()

    def stamp(self):
        """Now, for the timeline: the host clock on a CPU; on a GPU a timing event on the current
        stream, read after the step (:meth:`device_timeline`), so a task spans its kernels, not
        the host's issuing of them."""
        if not self.r.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def device_timeline(self) -> list[tuple[str, str, float, float]]:
        """The GPU timeline in host seconds: every event's device time after the step-start
        event, counted from the host time that event was recorded (exact when the caller's
        stream had nothing queued then; otherwise a rank's timeline shifts by that backlog).
        Every event has completed: the step ended with the device synchronized."""
        since = self.ambient.elapsed_time  # milliseconds
        return [(stream, key, self.origin + since(a) / 1e3, self.origin + since(b) / 1e3)
                for stream, key, a, b in self.timeline]

    def record(self, key: str) -> None:
        """Mark ``key``'s work on the current CUDA stream: cross-stream waiters wait for it."""
        event = torch.cuda.Event()
        event.record()
        self.cuda_events[key] = event

    # -- threaded streams --------------------------------------------------------------------
    def run_stream(self, stream: str, keys: list[str], drain: bool = False) -> None:
        key = ""
        previous_stream = None
        if stream != self.r.inline:
            torch.set_num_threads(self.threads_per_op)  # OpenMP's setting is per thread: carry it over
        if self.r.cuda and stream in self.r.cuda_streams:
            torch.cuda.set_device(self.r.device)
            previous_stream = torch.cuda.current_stream(self.r.device)
            torch.cuda.set_stream(self.r.cuda_streams[stream])
            torch.cuda.current_stream().wait_event(self.ambient)  # the caller's work before the step
        try:
            if drain and not keys:  # nothing runs here: receives go out at step start
                self.post_all()
            for key in keys:
                for dep in self.r.cross[key]:
                    if not self.wait_for(stream, key, dep):
                        return
                if self.r.cuda:
                    for dep in self.r.cross[key]:
                        torch.cuda.current_stream().wait_event(self.cuda_events[dep])
                self.heads[stream] = ("run", key)
                start = self.stamp()
                completion = self.r.execute(key)
                rest = None
                if isinstance(completion, Continue):
                    rest, completion = completion.rest, None
                if completion is not None:  # a posting op on a threaded stream: finish it here
                    completion(max(self.deadline - time.monotonic(), 0.001))
                if rest is None:
                    self.timeline.append((stream, key, start, self.stamp()))
                self.signal(key)
                self.post_all()  # e.g. a SEND goes out right after the chunk that made it
                if rest is not None:  # the task's second part, after the messages its first enabled
                    rest()
                    self.timeline.append((stream, key, start, self.stamp()))
                if self.r.after is not None:  # host work that must not delay those messages
                    self.r.after(key)
            if drain:  # the caller posts and completes what is left
                self.drain()
            self.heads[stream] = ("done",)
        except BaseException as exc:  # noqa: BLE001 - reported with its traceback
            if not self.abort.is_set():
                self.failure.append(self.failed(key, stream, exc))
            self.abort.set()
        finally:
            if previous_stream is not None:
                torch.cuda.set_stream(previous_stream)

    def drain(self) -> None:
        for stream in sorted(self.r.posted):
            keys = self.r.plan.streams[stream]
            self.post(stream, upto=keys[-1], waiter=(stream, keys[-1]))
            for key in keys:
                if self.abort.is_set():
                    return
                self.complete(key)

    def run(self) -> None:
        r = self.r
        threads = [threading.Thread(target=self.run_stream, args=item, daemon=True, name=f"piper-{r.rank}-{item[0]}")
                   for item in r.plan.streams.items() if item[0] != r.inline and item[0] not in r.posted]
        for t in threads:
            t.start()
        if r.inline is not None:  # its waits watch the deadline and the other streams' failures
            self.run_stream(r.inline, r.plan.streams[r.inline], drain=True)
        elif r.posted:
            self.run_stream("(caller)", [], drain=True)
        # Then the caller only watches: a thread stuck in a collective cannot hide another's failure.
        while not self.abort.is_set():
            alive = [t for t in threads if t.is_alive()]  # one snapshot: a thread may end in between
            if not alive:
                break
            alive[0].join(0.02)
            if time.monotonic() > self.deadline + 1 and not self.abort.is_set():
                self.abort.set()
                self.failure.append(TaskFailed(f"rank {r.rank}: step did not finish within {r.timeout_s:.0f}s"))
        if self.failure:
            raise self.failure[0]
        if r.cuda:  # the step's results are ready for the host and every stream (timing events too)
            torch.cuda.synchronize(r.device)
        r.timeline = self.device_timeline() if r.cuda else self.timeline
