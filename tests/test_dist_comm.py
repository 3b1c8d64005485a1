"""DistComm keeps a SEND's work and tensor, counted on the rank's meter, only while the message
is in flight."""
import threading

import pytest
import torch

from piper_plugin.runtime.dist_comm import DistComm
from piper_plugin.runtime.memory import MemoryMeter


class _Work:
    def __init__(self, completed: bool, error: Exception | None = None):
        self.completed, self.error, self.waited = completed, error, 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


def _comm() -> DistComm:
    comm = DistComm.__new__(DistComm)  # no process group: only the send bookkeeping is under test
    comm.sends, comm._sends_lock = [], threading.Lock()
    return comm


def _send(comm: DistComm, meter: MemoryMeter, work: _Work, nbytes: int = 16) -> None:
    meter.add(nbytes)  # what the SEND's inbox held, taken counted
    comm._add_send(work, torch.zeros(nbytes // 4), nbytes, meter)


def test_completed_sends_are_let_go_at_the_next_send():
    comm, meter = _comm(), MemoryMeter()
    flying, done = _Work(False), _Work(False)
    _send(comm, meter, flying)
    _send(comm, meter, done)
    assert meter.current == 32  # both in flight as far as the meter knows
    done.completed = True
    _send(comm, meter, _Work(False))  # done is let go here; flying stays
    assert [s[0] for s in comm.sends if s[0] in (done, flying)] == [flying] and done.waited == 1
    assert len(comm.sends) == 2 and meter.current == 32 and meter.peak == 48
    comm.wait_sends()
    assert comm.sends == [] and flying.waited == 1 and meter.current == 0


def test_retire_sends_frees_only_what_completed():
    comm, meter = _comm(), MemoryMeter()
    first, second = _Work(False), _Work(False)
    _send(comm, meter, first, 8)
    _send(comm, meter, second, 24)
    comm.retire_sends()
    assert meter.current == 32 and first.waited == 0
    second.completed = True  # messages may complete out of order (different peers)
    comm.retire_sends()
    assert [s[0] for s in comm.sends] == [first] and second.waited == 1 and meter.current == 8
    first.completed = True
    comm.retire_sends()
    assert comm.sends == [] and meter.current == 0


def test_a_failed_send_raises_when_it_is_let_go():
    comm, meter = _comm(), MemoryMeter()
    _send(comm, meter, _Work(True, RuntimeError("connection reset by rank 1")))
    with pytest.raises(RuntimeError, match="connection reset by rank 1"):
        _send(comm, meter, _Work(False))
