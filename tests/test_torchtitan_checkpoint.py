"""TorchTitan checkpointing with ``--parallelism.pipeline_engine=piper`` (2 gloo ranks, CPU; ranks
forked by :mod:`titan_fork`).

An uninterrupted 10-step run saves a DCP checkpoint every 5 steps. A second run whose checkpoint
folder holds only that run's ``step-5`` (as if the first had stopped there) resumes from it and
trains steps 6-10; its losses and grad norms must equal the uninterrupted run's within 1e-4
relative. That needs the model parts, AdamW state, LR schedule, data-loader position and step
counter all restored, with Piper's schedule running on the loaded parameters.
"""
import shutil

import pytest

pytest.importorskip("torchtitan")

from titan_fork import run_titan_forked  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = "llama3_debugmodel_pp2_1f1b"
FLAGS = ["--debug.seed", "42", "--training.seq_len", "32", "--training.local_batch_size", "4",
         "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.folder", "checkpoint"]


def _close(a: dict, b: dict, rel=1e-4):
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= rel * max(abs(a[k]), 1e-12) for k in a)


def test_resume_from_step_5_reproduces_steps_6_to_10(tmp_path):
    full = run_titan_forked(CONFIG, "piper", dump_folder=tmp_path / "full", steps=10, extra=FLAGS, timeout_s=600)
    assert full.ok, full.tail()
    assert sorted(full.losses) == list(range(1, 11)), full.tail()
    assert "Piper: recipe 1f1b, 2 stages on 2 ranks, 4 microbatches" in full.log, full.tail()
    saved = tmp_path / "full" / "checkpoint" / "step-5"
    assert saved.is_dir(), f"no checkpoint at {saved}:\n{full.tail()}"
    print(f"uninterrupted run with checkpoints: {full.wall_s:.1f} s")

    resume_dir = tmp_path / "resumed"
    shutil.copytree(saved, resume_dir / "checkpoint" / "step-5")
    resumed = run_titan_forked(CONFIG, "piper", dump_folder=resume_dir, steps=10, extra=FLAGS, timeout_s=600)
    assert resumed.ok, resumed.tail()
    print(f"resumed run: {resumed.wall_s:.1f} s")
    assert "Loading the checkpoint from" in resumed.log and "step-5" in resumed.log, resumed.tail()
    assert sorted(resumed.losses) == list(range(6, 11)), resumed.tail()  # it started after step 5

    later = {s: full.losses[s] for s in range(6, 11)}
    assert _close(later, resumed.losses), (later, resumed.losses)
    later_norms = {s: full.grad_norms[s] for s in range(6, 11)}
    assert _close(later_norms, resumed.grad_norms), (later_norms, resumed.grad_norms)
