"""DistComm keeps a SEND's work and tensor only while the message is in flight."""
import threading

import pytest
import torch

from piper_plugin.runtime.dist_comm import DistComm


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


def test_completed_sends_are_let_go_at_the_next_send():
    comm = _comm()
    done, flying = _Work(True), _Work(False)
    comm._add_send(done, torch.zeros(4))
    comm._add_send(flying, torch.zeros(4))
    comm._add_send(_Work(False), torch.zeros(4))  # done is let go here; flying stays
    assert [w for w, _ in comm.sends if w in (done, flying)] == [flying] and done.waited == 1
    assert len(comm.sends) == 2
    comm.wait_sends()
    assert comm.sends == [] and flying.waited == 1


def test_a_failed_send_raises_when_it_is_let_go():
    comm = _comm()
    comm._add_send(_Work(True, RuntimeError("connection reset by rank 1")), torch.zeros(4))
    with pytest.raises(RuntimeError, match="connection reset by rank 1"):
        comm._add_send(_Work(False), torch.zeros(4))
