"""``piper launch``: TorchTitan's trainer on Ray actors (one per rank) on the session's Ray.

The job must train exactly as the same arguments under torchrun, a failing rank must end the job
naming that rank with its traceback and leave no actor alive, a silent job must end after
``--timeout``, and bad command lines must end in one ``piper: error:`` line naming the flag.
"""
import datetime
import os
import re
import threading
import time

import pytest

from piper_plugin.adapters.torchtitan.launch import parse_steps, run_titan
from piper_plugin.adapters.torchtitan.ray_launch import TitanRank, launch
from piper_plugin.cli import main
from piper_plugin.runtime.launch.processes import WorkerFailed

ARGS = ["--config", "llama3_debugmodel_pp2_1f1b", "--parallelism.pipeline_engine=piper", "--training.steps", "3",
        "--training.seq_len", "64", "--debug.seed", "42"]


# Config functions for ``--module test_titan_launch`` (the ray_cluster fixture puts tests/ on the
# actors' PYTHONPATH). They run in each rank's actor when TorchTitan parses its arguments.
def llama3_fails_on_rank_1():
    """The drop-in 1F1B config; rank 1 raises at step 2 (rank 0 then waits on it in the pipeline)."""
    from piper_plugin.adapters.torchtitan.config_registry import llama3_debugmodel_pp2_1f1b
    from piper_plugin.adapters.torchtitan.trainer import PiperTrainer

    if os.environ.get("RANK") == "1":
        original = PiperTrainer.train_step

        def train_step(self, *args, **kwargs):
            if self.step == 2:
                raise RuntimeError("injected failure on rank 1 at step 2")
            return original(self, *args, **kwargs)

        PiperTrainer.train_step = train_step
    return llama3_debugmodel_pp2_1f1b()


def _live_rank_actors() -> list[str]:
    import ray

    return [actor_id for actor_id, info in ray._private.state.actors().items()
            if info.get("ActorClassName", "").endswith("TitanRank") and info.get("State") != "DEAD"]


def _wait_no_rank_actors(timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (live := _live_rank_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return live


def test_launch_trains_like_torchrun(ray_cluster, tmp_path, monkeypatch, capsys):
    reference = {}
    # The torchrun reference runs alongside (same seed: bitwise-deterministic whatever the timing).
    thread = threading.Thread(target=lambda: reference.setdefault("run", run_titan(
        "llama3_debugmodel_pp2_1f1b", "piper", dump_folder=tmp_path / "torchrun", steps=3,
        extra=["--training.seq_len", "64", "--debug.seed", "42"], timeout_s=300)))
    thread.start()
    monkeypatch.chdir(tmp_path)  # the ranks' working directory: TorchTitan's ./outputs lands here
    code = main(["launch", "--nproc", "2", "--timeout", "300", "--", *ARGS])
    thread.join(timeout=310)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    losses, _, _ = parse_steps(out)
    run = reference["run"]
    assert run.ok, run.tail()
    assert sorted(run.losses) == sorted(losses) == [1, 2, 3]
    for step, loss in run.losses.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)
    assert losses[3] < losses[1]
    for rank in (0, 1):  # every rank's log lines reached the driver, prefixed
        assert any(line.startswith(f"(rank {rank}) ") and "step:  3" in line for line in out.splitlines())
    assert (tmp_path / "outputs" / "structured_logs").is_dir()
    assert _wait_no_rank_actors() == []


def test_failing_rank_stops_the_job(ray_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["launch", "--nproc", "2", "--timeout", "120", "--", "--module", "test_titan_launch",
                 "--config", "llama3_fails_on_rank_1", "--training.steps", "3", "--training.seq_len", "64"])
    ended = datetime.datetime.now()
    out, err = capsys.readouterr()
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("piper: error:")]
    assert errors == ["piper: error: rank 1 failed: RuntimeError: injected failure on rank 1 at step 2"], err[-3000:]
    assert "--- original traceback of rank 1 ---" in err and "in train_step" in err
    # rank 0, blocked on rank 1, was not waited for (gloo's own timeout there is 100 s)
    stamps = re.findall(r"^\(rank 1\) \[titan\] (\S+ \S+) ", out, flags=re.M)
    last_log = datetime.datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f")
    assert (ended - last_log).total_seconds() < 30, (stamps[-1], ended)
    assert _wait_no_rank_actors() == []


class _HangingRank(TitanRank):
    """Prints one line, then hangs as a rank stuck in a collective would."""

    def run(self, env, argv, cwd):
        self._capture.start()
        print(f"rank {env['RANK']} is up", flush=True)
        time.sleep(120)  # then returns "ok": a driver that did not stop the job fails the test
        return {"ok": True, "time": time.time()}


def test_silent_job_stops_after_timeout(ray_cluster, capsys):
    with pytest.raises(WorkerFailed) as info:
        launch(2, ["--config", "unused"], timeout_s=5, start_timeout_s=120, rank_cls=_HangingRank)
    out = capsys.readouterr().out
    assert str(info.value) == "rank 0 failed: no output from any rank for 5s (--timeout); ranks [0, 1] still running"
    assert "(rank 0) rank 0 is up" in out and "(rank 1) rank 1 is up" in out
    assert _wait_no_rank_actors() == []


@pytest.mark.parametrize("argv, expected", [
    (["--nproc", "0", "--", *ARGS], "argument --nproc: '0' is not a number of ranks; pass --nproc N with N >= 1"),
    (["--", *ARGS], "--nproc is missing: pass the number of ranks"),
    (["--nproc", "2"], "no TorchTitan arguments: put them after --"),
    (["--nproc", "2", "--"], "no TorchTitan arguments: put them after --"),
    (["--nproc", "2", *ARGS], "TorchTitan's arguments go after --"),
    (["--nproc", "2", "--", "--training.steps", "3"], "--config is missing after --"),
    (["--nproc", "2", "--", "--config", "llama3_debugmodel_pp2_1f1b", "--parallelism.pipeline_engine", "pipr"],
     "--parallelism.pipeline_engine 'pipr' is not an engine: use one of torch, piper"),
    (["--nproc", "2", "--address", "127.0.0.1:1", "--", *ARGS], "--address 127.0.0.1:1: cannot reach a Ray cluster"),
])
def test_bad_command_lines_end_in_one_line(argv, expected, capsys):
    code = main(["launch", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("piper: error: ") and expected in lines[0], err
