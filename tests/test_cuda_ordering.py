"""The runtime's CUDA path orders device work as the plan says (checked on a model of CUDA
streams and events, tests/fake_cuda.py): every dependency, also across streams and through a
message, finishes on the device before its dependent starts, and the caller's work queued
before the step (the batch copy) finishes before any task."""
import torch

from fake_cuda import FakeCuda
from piper_plugin.runtime.streams import StreamRunner
from piper_plugin.scheduler.plan import RankPlan


def _plan() -> RankPlan:
    # r0 is a received message read by two streams (f1 on compute, g1 on a side stream);
    # s1 sends what f1 and g1 made
    streams = {"compute": ["f0", "f1"], "side": ["g1"], "recv": ["r0"], "send": ["s1"]}
    deps = {"f0": (), "r0": (), "f1": ("f0", "r0"), "g1": ("r0",), "s1": ("f1", "g1")}
    return RankPlan(rank=0, streams=streams, deps=deps)


def _execute(cuda: FakeCuda, comm, step: int):
    """Compute runs on the current stream; a message runs on the communicator's own stream
    after the current one (as a NCCL op is issued), and a receive's completion makes the
    current stream wait for it (as ``Work.wait``)."""

    def execute(key: str):
        op = f"{key}@{step}"
        if key[0] not in "rs":
            cuda.current_stream().enqueue(op)
            return None
        comm.wait_stream(cuda.current_stream())
        comm.enqueue(op)
        if key[0] == "s":
            return None

        def complete(seconds: float) -> None:
            cuda.current_stream().wait_stream(comm)

        return complete

    return execute


def test_every_dependency_is_ordered_on_the_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    comm = cuda.new_stream()
    plan = _plan()
    for step in range(20):  # which consumer of r0 runs its completion varies from step to step
        runner = StreamRunner(0, plan, _execute(cuda, comm, step), timeout_s=10, device=torch.device("cuda", 0),
                              inline="compute", posted=["send", "recv"])
        cuda.default.enqueue(f"batch@{step}")  # the caller's work before the step
        runner.run_step()
        for key, deps in plan.deps.items():
            after = f"{key}@{step}"
            assert cuda.ordered(f"batch@{step}", after), f"step {step}: {key} may start before the batch copy"
            for dep in deps:
                assert cuda.ordered(f"{dep}@{step}", after), f"step {step}: {key} may start before {dep} finished"


def test_the_model_sees_an_unordered_pair(monkeypatch):
    """The check above can fail: two streams with no event between them are unordered."""
    cuda = FakeCuda(monkeypatch)
    a, b = cuda.new_stream(), cuda.new_stream()
    a.enqueue("x")
    b.enqueue("y")
    assert not cuda.ordered("x", "y")
    b.wait_stream(a)
    b.enqueue("z")
    assert cuda.ordered("x", "z") and not cuda.ordered("z", "x")
