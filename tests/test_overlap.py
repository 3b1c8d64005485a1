"""Streams are real: ZeRO-3 gathers and reduce-scatters on their own stream overlap compute,
measured side by side against the same plan with every task on one stream.

Each variant's best step is compared: other load on a shared host only ever lengthens steps
(one CI run saw the streamed variant's median at 1.4x its usual), so the best of three rounds
is what each plan can do; undisturbed, the streamed plan takes about 0.8x the single stream.
When three rounds do not show it, up to three more run (a clean-clone CI run once saw every
streamed run of three slowed, best 0.98x); a plan that never overlaps still fails."""
import functools
import statistics
import time

import pytest
import torch

from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import run_forked
import emulated

pytestmark = pytest.mark.slow


def _schedule(one_stream, program):
    sch = apply_recipe(Schedule(program, pp=1, dp=2), "1f1b", microbatches=4, zero=3)
    if one_stream:
        sch.stream("*", "compute")
    return sch


def _step_times(worker, steps=4):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        worker.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def _step_times_of(one_stream: bool) -> list[float]:
    """The step times of one run: per step, the slowest rank's."""
    job = Job(emulated.Wide, emulated.mse, emulated.data, functools.partial(_schedule, one_stream),
              functools.partial(torch.optim.SGD, lr=0.01), steps=4)
    program, _, plan, _ = compile_job(job)
    assert {s for rp in plan.ranks for s in rp.streams} == ({"compute"} if one_stream else {"compute", "dp"})
    out = run_forked(job, program, plan, body=_step_times)
    return [max(per_rank) for per_rank in zip(*out.values())]


def test_comm_stream_overlaps_compute():
    streams, single = [], []
    for rounds in range(1, 7):  # alternate A/B: three rounds, up to three more while a busy host hides it
        streams += _step_times_of(False)
        single += _step_times_of(True)
        if rounds >= 3 and min(streams) < 0.95 * min(single):
            break
    assert min(streams) < 0.95 * min(single), (
        f"own comm stream best {min(streams):.3f}s (median {statistics.median(streams):.3f}s) vs one stream "
        f"best {min(single):.3f}s (median {statistics.median(single):.3f}s)")
