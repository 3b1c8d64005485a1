"""StreamRunner: the compute stream runs on the caller's thread, P2P streams are posted by whoever
finishes their dependencies, other streams run on helper threads;
cross-stream dependencies hold, and a failure on any stream ends the step with its traceback."""
import threading
import time

import pytest

import dataclasses

from piper_plugin.runtime.streams import Continue, RunnerConfig, StreamRunner, TaskFailed
from piper_plugin.scheduler.plan import RankPlan
from piper_plugin.scheduler.posting import POST_BUDGET


def _runner(plan: RankPlan, execute, *, timeout_s: float, inline: str | None = None, posted=(), sizes=None,
            post_budget: int = POST_BUDGET, **kw) -> StreamRunner:
    """A runner over ``plan`` completed as the scheduler's lowering would complete it."""
    plan = dataclasses.replace(plan, inline=inline, posted=tuple(posted), post_bytes=dict(sizes or {}))
    return StreamRunner(plan, execute, RunnerConfig(timeout_s=timeout_s, post_budget=post_budget), **kw)


def _plan() -> RankPlan:
    # compute: f0 -> f1 (f1 needs the message r0 brought); comm: r0, then s1 after f1
    streams = {"compute": ["f0", "f1"], "p2p": ["r0", "s1"]}
    deps = {"f0": (), "f1": ("f0", "r0"), "r0": (), "s1": ("f1",)}
    return RankPlan(rank=0, streams=streams, deps=deps)


def test_compute_stream_runs_on_the_callers_thread():
    ran: dict[str, int] = {}
    order: list[str] = []

    def execute(key: str) -> None:
        if key == "r0":
            time.sleep(0.05)  # the message arrives late: f1 must wait for it
        ran[key] = threading.get_ident()
        order.append(key)

    _runner(_plan(), execute, timeout_s=10, inline="compute").run_step()
    me = threading.get_ident()
    assert ran["f0"] == ran["f1"] == me
    assert ran["r0"] == ran["s1"] != me
    assert order.index("r0") < order.index("f1") < order.index("s1")


@pytest.mark.parametrize("failing", ["r0", "f0"])
def test_a_failure_on_either_stream_ends_the_step(failing):
    def execute(key: str) -> None:
        if key == failing:
            raise ValueError(f"bad {key}")

    start = time.monotonic()
    with pytest.raises(TaskFailed, match=f"task {failing}.*bad {failing}") as info:
        _runner(_plan(), execute, timeout_s=30, inline="compute").run_step()
    assert "Traceback" in info.value.details
    assert time.monotonic() - start < 5  # the other stream stopped at its next wait, not at the timeout


def test_a_missing_message_times_out_naming_the_wait():
    def execute(key: str) -> None:
        if key == "r0":
            time.sleep(3)

    with pytest.raises(TaskFailed, match="f1 waits for r0|waited more than 1s for r0"):
        _runner(_plan(), execute, timeout_s=1, inline="compute").run_step()


def _p2p_plan() -> RankPlan:
    # compute f0..f2; posted receives r0..r2 (f_i reads r_i); posted sends s0..s2 (s_i after f_i)
    streams = {"compute": ["f0", "f1", "f2"], "recv": ["r0", "r1", "r2"], "send": ["s0", "s1", "s2"]}
    deps = {"f0": ("r0",), "f1": ("f0", "r1"), "f2": ("f1", "r2"), "r0": (), "r1": ("r0",), "r2": ("r1",),
            "s0": ("f0",), "s1": ("s0", "f1"), "s2": ("s1", "f2")}
    return RankPlan(rank=0, streams=streams, deps=deps)


def test_posted_streams_run_on_no_thread_of_their_own():
    """SENDs go out on the thread that made their payload, right after it; RECVs are posted up
    to ``post_ahead`` ahead and each completes on its consumer's thread just before it."""
    events: list[tuple[str, str, int]] = []
    outstanding = []

    def execute(key: str):
        events.append(("run", key, threading.get_ident()))
        if key.startswith("r"):
            outstanding.append(key)
            assert len(outstanding) <= 2, f"{outstanding} posted at once"

            def complete(seconds: float) -> None:
                assert seconds > 0
                outstanding.remove(key)
                events.append(("complete", key, threading.get_ident()))
            return complete
        return None

    runner = _runner(_p2p_plan(), execute, timeout_s=10, inline="compute", posted={"recv", "send"})
    runner.run_step()
    me = threading.get_ident()
    assert {thread for _, _, thread in events} == {me}
    seq = [f"{what[0]}:{key}" for what, key, _ in events]
    for i in range(3):
        assert seq.index(f"c:r{i}") < seq.index(f"r:f{i}") < seq.index(f"r:s{i}")
        if i < 2:  # the send goes out before the next chunk starts
            assert seq.index(f"r:s{i}") < seq.index(f"r:f{i + 1}")
    assert seq.index("r:r1") < seq.index("r:f0")  # posted ahead of its consumer
    assert {s for s, *_ in runner.timeline} == {"compute", "recv", "send"}


def test_a_continued_task_posts_its_sends_before_its_rest_and_after_hooks_follow():
    """A task returning Continue is done for its dependents first: its SEND goes out, then its
    rest runs on the same thread before the next task; ``after`` sees the task once both ran."""
    seq: list[str] = []

    def execute(key: str):
        seq.append("r:" + key)
        if key == "f1":
            return Continue(lambda: seq.append("rest:f1"))
        return (lambda seconds: None) if key.startswith("r") else None

    runner = _runner(_p2p_plan(), execute, timeout_s=10, inline="compute", posted={"recv", "send"},
                          after=lambda key: seq.append("after:" + key))
    runner.run_step()
    assert seq.index("r:s1") < seq.index("rest:f1") < seq.index("after:f1") < seq.index("r:f2")
    assert seq.index("after:f0") < seq.index("r:f1")


def test_receives_that_fit_the_byte_budget_are_posted_at_once():
    """With sizes, the posting budget lets every small receive go out at step start; a
    receive past ``post_ahead`` that does not fit waits until a consumer completes one."""
    sizes = {"r0": 10, "r1": 10, "r2": 10}
    for budget, expected in ((30, ["r0", "r1", "r2", "c0"]), (25, ["r0", "r1", "c0", "r2"])):
        seq: list[str] = []

        def execute(key: str):
            seq.append(key)
            return (lambda seconds, key=key: seq.append("c" + key[1:])) if key.startswith("r") else None

        _runner(_p2p_plan(), execute, timeout_s=10, inline="compute", posted={"recv", "send"},
                     post_budget=budget, sizes=sizes).run_step()
        assert seq[:4] == expected, (budget, seq)


def test_a_first_chunk_that_needs_no_message_runs_before_receives_are_posted():
    """Posting a step's receives takes time (about 0.1 ms each under gloo): a first chunk that
    needs none (the first stage's F) runs at once; its SEND goes out before the receives."""
    streams = {"compute": ["f0", "f1"], "recv": ["r0", "r1"], "send": ["s0", "s1"]}
    deps = {"f0": (), "f1": ("f0", "r0"), "r0": (), "r1": ("r0",), "s0": ("f0",), "s1": ("s0", "f1")}
    seq: list[str] = []

    def execute(key: str):
        seq.append(key)
        return (lambda seconds: None) if key.startswith("r") else None

    _runner(RankPlan(rank=0, streams=streams, deps=deps), execute, timeout_s=10, inline="compute",
                 posted=["send", "recv"]).run_step()
    assert seq[:4] == ["f0", "s0", "r0", "r1"], seq


def test_a_thread_about_to_wait_posts_receives_first():
    """A chunk waiting for one message posts every receive the policy allows before it waits."""
    seq: list[str] = []

    def execute(key: str):
        seq.append(key)
        return (lambda seconds, key=key: seq.append("c" + key[1:])) if key.startswith("r") else None

    _runner(_p2p_plan(), execute, timeout_s=10, inline="compute", posted=["send", "recv"]).run_step()
    assert seq[:3] == ["r0", "r1", "c0"], seq  # post_ahead 2, no sizes: two deep


def test_a_failed_completion_names_the_receive():
    def execute(key: str):
        if key == "r1":
            def complete(seconds: float) -> None:
                raise ConnectionError("peer closed")
            return complete
        return (lambda seconds: None) if key.startswith("r") else None

    with pytest.raises(TaskFailed, match="task r1 on stream 'recv' failed: ConnectionError"):
        _runner(_p2p_plan(), execute, timeout_s=10, inline="compute", posted={"recv", "send"}).run_step()


def test_a_completion_past_the_deadline_is_a_timeout():
    def execute(key: str):
        if key == "r0":
            def complete(seconds: float) -> None:
                time.sleep(seconds)  # a transport waits at most what it is given, then raises
                raise RuntimeError("timed out waiting for recv")
            return complete
        return None

    start = time.monotonic()
    with pytest.raises(TaskFailed, match="task r0 on stream 'recv' waited more than 1s"):
        _runner(_p2p_plan(), execute, timeout_s=1, inline="compute", posted={"recv", "send"}).run_step()
    assert time.monotonic() - start < 10  # a hang guard: the 1 s deadline, not a longer default, ended it


def test_status_says_what_each_stream_does_while_a_step_runs():
    """Another thread (a driver asking a stalled rank) sees each stream's head mid-step."""
    release = threading.Event()
    plan = RankPlan(rank=0, streams={"compute": ["f0", "f1"], "side": ["g0"]},
                    deps={"f0": (), "f1": ("f0", "g0"), "g0": ()})
    def execute(key: str) -> None:
        if key == "g0":
            release.wait(10)

    runner = _runner(plan, execute, timeout_s=10, inline="compute")
    assert runner.status() == "between steps"
    failed: list[BaseException] = []

    def run() -> None:
        try:
            runner.run_step()
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    step = threading.Thread(target=run)
    step.start()
    deadline = time.monotonic() + 10
    while "f1 waits for g0" not in runner.status() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.status() == "compute: f1 waits for g0; side: computing g0"
    release.set()
    step.join(10)
    assert not failed and runner.status() == "between steps"
