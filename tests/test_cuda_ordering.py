"""The runtime's CUDA path orders device work as the plan says (checked on a model of CUDA
streams and events, tests/fake_cuda.py): every dependency, also across streams and through a
message, finishes on the device before its dependent starts, and the caller's work queued
before the step (the batch copy) finishes before any task."""
import pytest
import torch

from fake_cuda import FakeCuda
from piper_plugin.runtime.streams import RunnerConfig, StreamRunner
from piper_plugin.scheduler.plan import RankPlan


def _plan() -> RankPlan:
    # r0 is a received message read by two streams (f1 on compute, g1 on a side stream);
    # s1 sends what f1 and g1 made
    streams = {"compute": ["f0", "f1"], "side": ["g1"], "recv": ["r0"], "send": ["s1"]}
    deps = {"f0": (), "r0": (), "f1": ("f0", "r0"), "g1": ("r0",), "s1": ("f1", "g1")}
    return RankPlan(rank=0, streams=streams, deps=deps, inline="compute", posted=("send", "recv"))


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


def _check_order(cuda: FakeCuda, plan: RankPlan, step: int, who: str) -> None:
    """Every task of ``step`` is ordered after the caller's batch copy and after each dependency."""
    for key, deps in plan.deps.items():
        after = f"{key}@{step}"
        assert cuda.ordered(f"batch@{step}", after), f"{who}step {step}: {key} may start before the batch copy"
        for dep in deps:
            assert cuda.ordered(f"{dep}@{step}", after), f"{who}step {step}: {key} may start before {dep} finished"

def test_every_dependency_is_ordered_on_the_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    comm = cuda.new_stream()
    plan = _plan()
    for step in range(20):  # which consumer of r0 runs its completion varies from step to step
        runner = StreamRunner(plan, _execute(cuda, comm, step), RunnerConfig(timeout_s=10),
                              device=torch.device("cuda", 0))
        cuda.default.enqueue(f"batch@{step}")  # the caller's work before the step
        runner.run_step()
        _check_order(cuda, plan, step, "")


def test_the_gpu_timeline_is_device_time(monkeypatch):
    """On a GPU a task's timeline entry spans its kernels on the device, not the host's issuing
    of them (microseconds here): f0 takes 3 units, then f1 2 after it and after r0 arrived (1
    unit of transfer), g1 4 on its own stream after r0; the origin is the step-start event."""
    cuda = FakeCuda(monkeypatch)
    comm = cuda.new_stream()
    took = {"f0": 3.0, "f1": 2.0, "g1": 4.0, "r0": 1.0, "s1": 0.5}

    def execute(key: str):
        if key[0] not in "rs":
            cuda.current_stream().enqueue(key, took[key])
            return None
        comm.wait_stream(cuda.current_stream())
        comm.enqueue(key, took[key])
        if key[0] == "s":
            return None
        return lambda seconds: cuda.current_stream().wait_stream(comm)

    runner = StreamRunner(_plan(), execute, RunnerConfig(timeout_s=10), device=torch.device("cuda", 0))
    cuda.default.enqueue("batch", 5.0)  # queued before the step: the origin is where it ends
    runner.run_step()
    span = {key: (start, end) for _, key, start, end in runner.timeline}
    origin = span["f0"][0]
    assert span["f0"][1] - origin == pytest.approx(3.0)
    assert min(start for start, _ in span.values()) == pytest.approx(origin)
    for key in ("f1", "g1"):
        assert span[key][1] - span[key][0] == pytest.approx(took[key])
        assert span[key][0] >= span["r0"][1] - 1e-9  # after the message's arrival on its stream
    assert span["f1"][0] >= span["f0"][1] - 1e-9
    assert span["r0"][1] - span["r0"][0] >= took["r0"] - 1e-9
    assert span["s1"][0] >= max(span["f1"][1], span["g1"][1]) - 1e-9


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


def _recipe_plan(recipe: str, pp: int, dp: int, ep: int, zero: int):
    from piper_plugin import capture
    from piper_plugin.api.schedule import Schedule
    from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
    from piper_plugin.recipes import apply_recipe, stages_needed
    from piper_plugin.scheduler.plan import build_plan

    stages = stages_needed(recipe, pp)
    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-moe" if ep > 1 else "toy-lm"](stages=stages, layers=stages)
    tokens, targets = lm_batch(cfg, 4 * dp * ep * 2)
    sch = Schedule(capture(model, lm_loss, (tokens,), targets), pp=pp, dp=dp, ep=ep)
    return build_plan(apply_recipe(sch, recipe, microbatches=4, zero=zero).dag, sch.grid)


def _comm_execute(cuda: FakeCuda, plan, comm: dict, step: int):
    """Compute on the current stream; every comm node on its communicator's stream (one per
    logical stream) after the current one; a RECV completes later, a collective at once (the
    current stream waits for it, as NCCL's blocking collectives do)."""
    from piper_plugin.ir.nodes import COMPUTE, Kind

    def execute(key: str):
        node = plan.dag.nodes[key]
        op = f"{key}@{step}"
        if node.kind in COMPUTE:
            cuda.current_stream().enqueue(op)
            return None
        stream = comm.setdefault(node.stream, cuda.new_stream())
        stream.wait_stream(cuda.current_stream())
        stream.enqueue(op)
        if node.kind == Kind.SEND:
            return None
        if node.kind == Kind.RECV:
            return lambda seconds: cuda.current_stream().wait_stream(stream)
        cuda.current_stream().wait_stream(stream)
        return None

    return execute


@pytest.mark.slow
@pytest.mark.parametrize("recipe,pp,dp,ep,zero", [
    ("1f1b", 2, 1, 1, 0), ("interleaved-1f1b", 2, 1, 1, 0), ("zb-h1", 2, 1, 1, 0), ("dualpipev", 2, 1, 1, 0),
    ("1f1b", 2, 2, 1, 3), ("zb-h1", 1, 2, 1, 2), ("dualpipev", 2, 1, 2, 0)])
def test_every_recipe_rank_is_ordered_on_the_device(monkeypatch, recipe, pp, dp, ep, zero):
    """The same on every rank of real recipe plans (P2P posted, collectives on their threads)."""
    plan = _recipe_plan(recipe, pp, dp, ep, zero)
    for rank, rank_plan in enumerate(plan.ranks):
        cuda = FakeCuda(monkeypatch)
        comm: dict = {}
        for step in range(2):
            runner = StreamRunner(rank_plan, _comm_execute(cuda, plan, comm, step), RunnerConfig(timeout_s=30),
                                  device=torch.device("cuda", 0))
            cuda.default.enqueue(f"batch@{step}")
            runner.run_step()
            _check_order(cuda, rank_plan, step, f"rank {rank} ")
