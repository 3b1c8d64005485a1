"""A failing rank stops the whole job within the timeout, named, with its traceback; no hang,
no process left behind."""
import functools
import multiprocessing
import re
import time

import pytest
import torch

from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import WorkerFailed, run_forked
import faulty


def _schedule(program, dp=1):
    return apply_recipe(Schedule(program, pp=2, dp=dp), "1f1b", microbatches=4)


# Hang guards, not speed checks: a job whose error did not reach every rank would end only at
# the ranks' timeout (120 s; a stalled rank sleeps 120 s), against about 3 s when it does, so the
# bound of 40 s leaves a loaded machine 10x room and still tells the two apart.
HANG = 40


def _job(fault, call, timeout_s=120.0, dp=1, rank=1, **options):
    """TwoStage on pp=2 x dp (stage 1 on ``rank``, which carries the fault), SGD, 4 steps."""
    return Job(functools.partial(faulty.TwoStage, fault=fault, rank=rank, call=call), faulty.mse, faulty.data,
               functools.partial(_schedule, dp=dp), functools.partial(torch.optim.SGD, lr=0.1), steps=4,
               timeout_s=timeout_s, **options)


def _fail(fault, call, timeout_s=120.0, dp=1, rank=1, **options):
    job = _job(fault, call, timeout_s, dp, rank, **options)
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
    assert elapsed < HANG


@pytest.mark.slow
def test_killed_rank_stops_the_job():
    error, elapsed = _fail("die", call=3)
    assert error.rank == 1 and "died" in str(error)
    assert elapsed < HANG


@pytest.mark.slow
def test_stalled_rank_hits_the_timeout():
    error, elapsed = _fail("stall", call=2, timeout_s=3.0)
    assert any(w in str(error) for w in ("waited more than 3s", "Timed out waiting 3000ms", "no progress"))
    assert error.rank == 1 or "from rank 1" in str(error)  # the stalled rank, or whom rank 0 waited for
    assert elapsed < HANG  # the 3 s timeout ended it, not the stalled rank's 120 s sleep


# on 4 ranks (pp=2 x dp=2; ranks 2 and 3 hold stage 1) the fault sits on the second replica's: rank 3
FOUR = {"dp": 2, "rank": 3}


@pytest.mark.slow
@pytest.mark.parametrize("fault,call,timeout_s,expected", [
    ("raise", 6, 120.0, "boom inside the stage-1 chunk"), ("die", 3, 120.0, "died"),
    ("stall", 2, 3.0, "waited more than 3s")])
def test_on_four_ranks_a_failing_rank_stops_the_job_named(fault, call, timeout_s, expected):
    error, elapsed = _fail(fault, call, timeout_s, **FOUR)
    if fault == "stall":
        assert any(w in str(error) for w in (expected, "Timed out waiting 3000ms", "no progress")), str(error)
        # the stalled rank itself, the peer that waited for its message, or a collective it belongs to
        # (whose waiting member cannot tell which member is late): rank 3 is named either way
        assert error.rank == 3 or "rank 3" in str(error) or re.search(r"ranks \[[\d, ]*\b3\]", str(error)), str(error)
    else:
        assert error.rank == 3 and expected in str(error)
    assert elapsed < HANG


def test_a_nan_loss_stops_the_job_by_default_naming_the_step():
    error, elapsed = _fail("nan", call=6, **FOUR)  # call 1 is the shape probe: step 2's first microbatch
    assert error.rank in (2, 3) and "step 2: the loss is nan" in str(error) and "--on-nan skip" in str(error)
    assert elapsed < HANG


@pytest.mark.slow
def test_a_nan_loss_skips_that_step_on_every_rank_and_training_goes_on_as_without_it():
    """--on-nan skip on 4 ranks: step 2's loss turns NaN on rank 3 alone; every rank reports the
    step skipped, and the parameters after 4 steps are single-device SGD's over batches 1, 3, 4
    (batch 2 consumed, never applied)."""
    from piper_plugin.runtime.pieces import stitch

    job = _job("nan", 6, capture_grads=True, on_nonfinite_loss="skip", **FOUR)
    program, _, plan, _ = compile_job(job)
    metrics = []
    per_rank = run_forked(job, program, plan, on_metrics=metrics.append)
    assert {m["rank"] for m in metrics if m.get("skipped")} == {0, 1, 2, 3}
    assert all(m["step"] == 1 for m in metrics if m.get("skipped"))
    got = stitch([p for r in per_rank.values() for p in r["param_pieces"]])

    torch.manual_seed(job.seed)
    model = faulty.TwoStage()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in zip(range(4), faulty.data(job.seed)):
        if i == 1:
            continue
        optimizer.zero_grad()
        faulty.mse(model(x), y).backward()
        optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_skipping_refuses_a_plan_whose_update_comes_before_a_loss():
    from piper_plugin.runtime.update_gate import update_before_loss

    job = _job(None, 1)
    program, _, plan, _ = compile_job(job)
    assert update_before_loss(plan, program.loss_region) is None
    rank_plan = next(rp for rp in plan.ranks if any(plan.dag.nodes[k].region == program.loss_region
                                                    for k in rp.streams.get("compute", [])))
    keys = rank_plan.streams["compute"]
    update = next(k for k in keys if plan.dag.nodes[k].kind.name == "UPDATE")
    keys.remove(update)
    keys.insert(0, update)  # an order no recipe makes: the update first
    assert update_before_loss(plan, program.loss_region)[0] == update


def test_the_root_cause_of_timed_out_waits_is_the_wait_on_the_silent_rank():
    """Ranks time out at their own pace: rank 0 (in a collective with rank 1) may report before
    rank 1 (waiting for a message from the stalled rank 3). The job names rank 1's wait, whose
    rank said nothing; a rank's own error or one stuck computing beats any wait."""
    from piper_plugin.runtime.launch.processes import root_cause

    collective = (0, "rank 0: task 0ALL_REDUCE@b0 (a collective with ranks [0, 1]) on stream 'dp' "
                     "waited more than 3s: TimeoutError()", "")
    on_three = (1, "TimeoutError('waited more than 3s for 1RECV@s1 (a message from rank 3); streams: ...')", "")
    assert root_cause([collective, on_three]) == on_three
    assert root_cause([collective]) == collective  # rank 1 said nothing yet: the best lead so far
    own = (2, "ValueError('boom')", "Traceback ...")
    assert root_cause([collective, on_three, own]) == own
    busy = (3, "TimeoutError('waited more than 3s: rank 3 still computing 3F@m1')", "")
    assert root_cause([collective, busy]) == busy
    assert root_cause([]) is None


def test_a_message_whose_dtype_differs_from_its_probe_is_named_by_the_sender():
    """The receiver allocates from the probe's spec; a value sent in another dtype would make
    gloo abort the receiving process with no word of why. The sender names value and dtypes."""
    job = Job(faulty.ShiftingDtype, faulty.mse, faulty.data, _schedule, functools.partial(torch.optim.SGD, lr=0.1),
              steps=2, timeout_s=20.0)
    program, _, plan, _ = compile_job(job)
    with pytest.raises(WorkerFailed) as info:
        run_forked(job, program, plan)
    assert info.value.rank == 0, str(info.value)
    assert re.search(r"would send \S+ as torch\.bfloat16 \(2, 8\) but its receiver expects torch\.float32 \(2, 8\)",
                     str(info.value)), str(info.value)
    assert multiprocessing.active_children() == []
