"""`piper train --checkpoint / --resume`: a killed job resumes exactly; another strategy resumes
the same loss curve; a checkpoint that was never marked complete is never resumed from.

Losses are read from ``--metrics`` files (full precision), compared with the uninterrupted run
of the same job: bit for bit under the same strategy, within 1e-5 under another.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from piper_plugin.cli import main

JOB = ["--launcher", "fork", "--layers", "4", "--batch", "16", "--seq", "16", "--microbatches", "4"]


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def train(tmp_path: Path, name: str, *argv: str) -> dict[int, float]:
    metrics = tmp_path / f"{name}.jsonl"
    assert main(["train", *JOB, *argv, "--metrics", str(metrics)]) == 0
    return losses(metrics)


@pytest.mark.slow
def test_a_killed_job_resumes_from_its_last_complete_checkpoint_as_if_never_stopped(tmp_path):
    """SIGKILL the whole job (driver and ranks) once its first checkpoint is complete; the newest
    complete checkpoint (a save cut short by the kill stays a partial directory) resumes, and
    the steps after it log exactly the uninterrupted run's losses."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "piper_plugin.cli", "train", *JOB, "--steps", "400", "--checkpoint", str(ckpt),
           "--checkpoint-every", "2"]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step-2" / "piper.json").exists():
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before its first checkpoint"
            time.sleep(0.01)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
    done = sorted(int(d.name.split("-")[1]) for d in ckpt.glob("step-*"))
    assert done and all((ckpt / f"step-{s}" / "piper.json").exists() for s in done)
    last = done[-1]
    resumed = train(tmp_path, "resumed", "--resume", str(ckpt), "--steps", str(last + 3))
    assert sorted(resumed) == [last, last + 1, last + 2]
    whole = train(tmp_path, "whole", "--steps", str(last + 3))
    assert [resumed[s] for s in sorted(resumed)] == [whole[s] for s in sorted(resumed)]


@pytest.mark.slow
def test_resume_under_other_strategies_continues_the_same_loss_curve(tmp_path):
    """Saved at step 3 of pp=2 x dp=2 under ZeRO-3 (1F1B); resumed under gpipe on pp=4 (no ZeRO),
    under interleaved 1F1B with ZeRO-1 over dp=2, and on the MoE toy with experts split over
    ep=2 into ZeRO-2 and back to one rank: steps 4-6 log the uninterrupted run's losses."""
    zero3 = ["--pp", "2", "--dp", "2", "--zero", "3"]
    whole = train(tmp_path, "whole", *zero3, "--steps", "6")
    train(tmp_path, "first", *zero3, "--steps", "3", "--checkpoint", str(tmp_path / "c"))
    for name, strategy in {"gpipe-pp4": ["--recipe", "gpipe", "--pp", "4"],
                           "interleaved-zero1": ["--recipe", "interleaved-1f1b", "--pp", "2", "--dp", "2",
                                                 "--zero", "1"]}.items():
        resumed = train(tmp_path, name, *strategy, "--steps", "6", "--resume", str(tmp_path / "c"))
        assert sorted(resumed) == [3, 4, 5], name
        for step, loss in resumed.items():
            assert loss == pytest.approx(whole[step], rel=1e-5, abs=0), (name, step)

    moe = ["--model", "toy-moe", "--layers", "2"]
    experts = ["--pp", "1", "--dp", "2", "--ep", "2", "--zero", "2"]
    whole = train(tmp_path, "moe-whole", *moe, *experts, "--steps", "4")
    train(tmp_path, "moe-first", *moe, *experts, "--steps", "2", "--checkpoint", str(tmp_path / "m"))
    resumed = train(tmp_path, "moe-pp2", *moe, "--pp", "2", "--steps", "4", "--resume", str(tmp_path / "m"))
    assert sorted(resumed) == [2, 3]
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=1e-5, abs=0), step


_DIE_IN_SAVE = """
import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_save = dcp.save


def save(state_dict, *, checkpoint_id=None, **kwargs):
    if Path(str(checkpoint_id)).name == ".step-4.partial" and dist.get_rank() == 1:
        os._exit(9)  # as under SIGKILL: no exception, no clean-up
    return _save(state_dict, checkpoint_id=checkpoint_id, **kwargs)


dcp.save = save
"""


@pytest.mark.slow
def test_a_rank_killed_while_a_checkpoint_is_written_leaves_it_partial_and_the_job_resumes_before_it(tmp_path):
    """Rank 1 of 2 dies (os._exit, as under SIGKILL) as the step-4 checkpoint's write begins,
    while rank 0 writes its part: the job fails naming the rank, step-4 stays a partial directory
    without the completion mark, and ``--resume`` of the folder continues from step-2 with
    exactly the uninterrupted run's losses. (The fault comes from a ``sitecustomize`` on the
    job's path, so every process of the job, fork server included, has it.)"""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DIE_IN_SAVE)
    ckpt = tmp_path / "ckpt"
    repo = str(Path(__file__).resolve().parents[1])
    job = subprocess.run([sys.executable, "-m", "piper_plugin.cli", "train", *JOB, "--steps", "6", "--checkpoint",
                          str(ckpt), "--checkpoint-every", "2", "--timeout", "20"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), repo])})
    assert job.returncode != 0, "the job went on without rank 1"
    assert "rank 1" in job.stderr, job.stderr[-2000:]
    assert (ckpt / "step-2" / "piper.json").is_file() and not (ckpt / "step-4").exists()
    assert (ckpt / ".step-4.partial").is_dir() and not (ckpt / ".step-4.partial" / "piper.json").exists()
    resumed = train(tmp_path, "resumed", "--resume", str(ckpt), "--steps", "6")
    assert sorted(resumed) == [2, 3, 4, 5]
    whole = train(tmp_path, "whole", "--steps", "6")
    assert [resumed[s] for s in sorted(resumed)] == [whole[s] for s in sorted(resumed)]
