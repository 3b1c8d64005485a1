"""StreamRunner: the compute stream runs on the caller's thread, the others on helper threads;
cross-stream dependencies hold, and a failure on any stream ends the step with its traceback."""
import threading
import time

import pytest

from piper_plugin.runtime.streams import StreamRunner, TaskFailed
from piper_plugin.scheduler.plan import RankPlan


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

    StreamRunner(0, _plan(), execute, timeout_s=10, inline="compute").run_step()
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
        StreamRunner(0, _plan(), execute, timeout_s=30, inline="compute").run_step()
    assert "Traceback" in info.value.details
    assert time.monotonic() - start < 5  # the other stream stopped at its next wait, not at the timeout


def test_a_missing_message_times_out_naming_the_wait():
    def execute(key: str) -> None:
        if key == "r0":
            time.sleep(3)

    with pytest.raises(TaskFailed, match="f1 waits for r0|waited more than 1s for r0"):
        StreamRunner(0, _plan(), execute, timeout_s=1, inline="compute").run_step()
