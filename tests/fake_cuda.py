"""An ordering model of torch.cuda streams and events, for checking the runtime's CUDA path on a CPU.

Each stream is a queue of named operations. A stream's *frontier* says how many operations of
every other stream are ordered before its next one; ``wait_event`` merges an event's frontier
(transitively, since an event carries its stream's frontier) into the waiting stream. The current
stream is per thread, as in torch. :meth:`FakeCuda.ordered` answers whether one operation must
finish before another starts, which is all a GPU guarantees.
"""
from __future__ import annotations

import threading

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name
        self.ops: list[str] = []
        self.frontier: dict[str, int] = {}

    def wait_event(self, event: "FakeEvent") -> None:
        with self.cuda.lock:
            for stream, count in {**event.frontier, event.stream: event.position}.items():
                if stream != self.name:
                    self.frontier[stream] = max(self.frontier.get(stream, 0), count)

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.cuda)
        event.record(other)
        self.wait_event(event)

    def enqueue(self, op: str) -> None:
        with self.cuda.lock:
            self.cuda.where[op] = (self.name, len(self.ops), dict(self.frontier))
            self.ops.append(op)

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda = cuda
        self.stream, self.position, self.frontier = "", 0, {}

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        with self.cuda.lock:
            self.stream, self.position, self.frontier = stream.name, len(stream.ops), dict(stream.frontier)


class FakeCuda:
    """Patches ``torch.cuda``'s stream API (``monkeypatch``) with this model."""

    def __init__(self, monkeypatch):
        self.lock = threading.RLock()
        self.where: dict[str, tuple[str, int, dict[str, int]]] = {}
        self.default = FakeStream(self, "default")
        self.local = threading.local()
        self.count = 0
        for name, value in {"Stream": self.new_stream, "Event": lambda: FakeEvent(self),
                            "current_stream": self.current_stream, "set_stream": self.set_stream,
                            "set_device": lambda device: None}.items():
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
