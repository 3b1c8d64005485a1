"""An ordering model of torch.cuda streams and events, for checking the runtime's CUDA path on a CPU.

Each stream is a queue of named operations. A stream's *frontier* says how many operations of
every other stream are ordered before its next one; ``wait_event`` merges an event's frontier
(transitively, since an event carries its stream's frontier) into the waiting stream. The current
stream is per thread, as in torch. :meth:`FakeCuda.ordered` answers whether one operation must
finish before another starts, which is all a GPU guarantees.

Device time: an operation given a ``duration`` starts once everything ordered before it ended
(as soon as possible, as if the device had room for every stream) and runs that long; an event
holds the time its stream reached it, and ``elapsed_time`` (milliseconds) is read from those,
only between events made with ``enable_timing=True``, as on a GPU.
"""
from __future__ import annotations

import threading

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name
        self.ops: list[str] = []
        self.ends: list[float] = []  # device time each operation ends
        self.frontier: dict[str, int] = {}
        cuda.streams[name] = self

    def wait_event(self, event: "FakeEvent") -> None:
        with self.cuda.lock:
            for stream, count in {**event.frontier, event.stream: event.position}.items():
                if stream != self.name:
                    self.frontier[stream] = max(self.frontier.get(stream, 0), count)

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.cuda)
        event.record(other)
        self.wait_event(event)

    def reached(self) -> float:
        """Device time at which this stream's next operation may start."""
        streams = self.cuda.streams
        ends = [self.ends[-1]] if self.ends else []
        ends += [streams[s].ends[n - 1] for s, n in self.frontier.items() if n > 0]
        return max(ends, default=0.0)

    def enqueue(self, op: str, duration: float = 0.0) -> None:
        with self.cuda.lock:
            self.cuda.where[op] = (self.name, len(self.ops), dict(self.frontier))
            self.ends.append(self.reached() + duration)
            self.ops.append(op)


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False):
        self.cuda, self.timing = cuda, enable_timing
        self.stream, self.position, self.frontier, self.time = "", 0, {}, 0.0

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        with self.cuda.lock:
            self.stream, self.position, self.frontier = stream.name, len(stream.ops), dict(stream.frontier)
            self.time = stream.reached()

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        return (end.time - self.time) * 1e3


class FakeCuda:
    """Patches ``torch.cuda``'s stream API (``monkeypatch``) with this model."""

    def __init__(self, monkeypatch):
        self.lock = threading.RLock()
        self.streams: dict[str, FakeStream] = {}
        self.where: dict[str, tuple[str, int, dict[str, int]]] = {}
        self.default = FakeStream(self, "default")
        self.local = threading.local()
        self.count = 0
        for name, value in {"Stream": self.new_stream, "Event": lambda **kw: FakeEvent(self, **kw),
                            "current_stream": self.current_stream, "set_stream": self.set_stream,
                            "set_device": lambda device: None, "synchronize": lambda device=None: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def new_stream(self, device=None) -> FakeStream:
        with self.lock:
            self.count += 1
            return FakeStream(self, f"s{self.count}")

    def current_stream(self, device=None) -> FakeStream:
        return getattr(self.local, "stream", self.default)

    def set_stream(self, stream: FakeStream) -> None:
        self.local.stream = stream

    def ordered(self, before: str, after: str) -> bool:
        """Whether operation ``before`` finishes before ``after`` starts on the device."""
        stream_b, index_b, _ = self.where[before]
        stream_a, index_a, frontier_a = self.where[after]
        if stream_a == stream_b:
            return index_b < index_a
        return frontier_a.get(stream_b, 0) > index_b
