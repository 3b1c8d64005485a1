"""The forked-rank harness of the TorchTitan tests reports a failing job as torchrun would."""
import pytest

pytest.importorskip("torchtitan")

from titan_fork import run_titan_forked  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_bad_flag_fails_the_job_with_the_trainer_message(tmp_path):
    run = run_titan_forked("llama3_debugmodel_pp2_1f1b", "piper", dump_folder=tmp_path, steps=1,
                           extra=["--parallelism.pipeline_engine_typo", "x"], timeout_s=120)
    assert not run.ok and run.returncode != 124, run.tail()
    assert "pipeline_engine_typo" in run.log, run.tail()
    assert not run.losses
