"""A failing rank stops the whole job within the timeout, named, with its traceback; no hang,
no process left behind."""
import functools
import multiprocessing
import time

import pytest
import torch

from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import WorkerFailed, run_forked
import faulty


def _schedule(program):
    return apply_recipe(Schedule(program, pp=2), "1f1b", microbatches=4)


def _fail(fault, call, timeout_s=20.0):
    job = Job(functools.partial(faulty.TwoStage, fault=fault, rank=1, call=call), faulty.mse, faulty.data,
              _schedule, functools.partial(torch.optim.SGD, lr=0.1), steps=4, timeout_s=timeout_s)
    program, _, plan, _ = compile_job(job)
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_forked(job, program, plan)
    elapsed = time.monotonic() - start
    assert multiprocessing.active_children() == []
    return info.value, elapsed


def test_exception_in_a_chunk_names_the_rank_and_keeps_the_traceback():
    error, elapsed = _fail("raise", call=6)  # second step
    assert error.rank == 1
    assert "boom inside the stage-1 chunk" in str(error)
    assert "faulty.py" in error.details and "Traceback" in error.details
    assert elapsed < 20


@pytest.mark.slow
def test_killed_rank_stops_the_job():
    error, elapsed = _fail("die", call=3)
    assert error.rank == 1 and "died" in str(error)
    assert elapsed < 20


@pytest.mark.slow
def test_stalled_rank_hits_the_timeout():
    error, elapsed = _fail("stall", call=2, timeout_s=3.0)
    assert any(w in str(error) for w in ("waited more than 3s", "Timed out waiting 3000ms", "no progress"))
    assert error.rank == 1 or "from rank 1" in str(error)  # the stalled rank, or whom rank 0 waited for
    assert elapsed < 3.0 + 10
