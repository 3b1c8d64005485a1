"""What a rank reports as kept memory is what the simulator plans for it: parameters, gradients
and optimizer state at every ZeRO level (gradients counted by size: UPDATE frees them each step)."""
import functools

import pytest

from benchmarks._common import lm_config, lm_job
from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.launch.processes import run_forked

pytestmark = pytest.mark.slow


def _kept(worker) -> int:
    worker.step()
    return worker.kept_bytes()


def _schedule(zero, program):
    return apply_recipe(Schedule(program, pp=2, dp=2), "1f1b", microbatches=2, zero=zero)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_kept_bytes_match_the_simulated_static_memory(zero):
    job = lm_job(lm_config(dim=32, layers=2, heads=2, ffn=64, seq=8, vocab=64), recipe="1f1b", pp=2,
                 microbatches=2, batch=8)
    job.steps, job.schedule_fn = 1, functools.partial(_schedule, zero)
    program, _, plan, simulated = compile_job(job)
    kept = run_forked(job, program, plan, body=_kept)
    for rank, got in kept.items():
        planned = sum(simulated.static_bytes[rank].values())
        assert got == pytest.approx(planned, rel=0.02), (rank, got, simulated.static_bytes[rank])
