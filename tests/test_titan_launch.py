"""``piper launch``: TorchTitan's trainer on Ray actors (one per rank) on the session's Ray.

The job must train exactly as the same arguments under torchrun, a failing rank must end the job
naming that rank with its traceback and leave no actor alive, a silent job must end after
``--timeout``, and bad command lines must end in one ``piper: error:`` line naming the flag.
"""
import datetime
import os
import re
import subprocess
import sys
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


def llama3_says_its_rendezvous_port():
    """The drop-in 1F1B config; rank 0 prints the port of the TCP store it serves (MASTER_PORT)."""
    from piper_plugin.adapters.torchtitan.config_registry import llama3_debugmodel_pp2_1f1b

    if os.environ.get("RANK") == "0":
        print(f"rendezvous port {os.environ['MASTER_PORT']}", flush=True)
    return llama3_debugmodel_pp2_1f1b()


def _watch_listeners(wide: set, polled: list, done: threading.Event) -> None:
    """Until ``done``: every non-loopback listening (address, port) of the session's Ray processes
    and everything below them (its workers: the rank actors)."""
    import ipaddress

    import ray
    from listening import listening, loopback, process_tree

    roots = [info.process.pid for infos in ray._private.worker._global_node.all_processes.values() for info in infos]
    while not done.wait(0.3):
        pids = set().union(*(process_tree(root) for root in roots))
        wide.update((ip, port) for _, ip, port in listening(pids) if not loopback(ipaddress.ip_address(ip)))
        polled[0] += 1


def _live_rank_actors() -> list[str]:
    import ray

    return [actor_id for actor_id, info in ray._private.state.actors().items()
            if info.get("ActorClassName", "").endswith("TitanRank") and info.get("State") != "DEAD"]


def _wait_no_rank_actors(timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (live := _live_rank_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return live


@pytest.mark.slow
def test_launch_trains_like_torchrun(ray_cluster, tmp_path, monkeypatch, capsys):
    """Also: while it trains, every listening socket of the Ray cluster's processes (GCS, raylet,
    workers, the rank actors and their gloo pairs) is on the loopback but one, the TCP store
    torch.distributed serves on rank 0 at MASTER_PORT, which binds every interface (``::``,
    torch's own behaviour, as under torchrun; docs/cli.md says so)."""
    reference = {}
    # The torchrun reference runs alongside (same seed: bitwise-deterministic whatever the timing).
    thread = threading.Thread(target=lambda: reference.setdefault("run", run_titan(
        "llama3_debugmodel_pp2_1f1b", "piper", dump_folder=tmp_path / "torchrun", steps=3,
        extra=["--training.seq_len", "64", "--debug.seed", "42"], timeout_s=300)))
    thread.start()
    wide, polled, done = set(), [0], threading.Event()
    watcher = threading.Thread(target=_watch_listeners, args=(wide, polled, done))
    watcher.start()
    monkeypatch.chdir(tmp_path)  # the ranks' working directory: TorchTitan's ./outputs lands here
    code = main(["launch", "--nproc", "2", "--timeout", "300", "--", "--module", "test_titan_launch",
                 "--config", "llama3_says_its_rendezvous_port", *ARGS[2:]])
    done.set()
    watcher.join(30)
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
    # TorchTitan's start-up lines that are false here are replaced by one true line each (titan_log.py)
    for false in ("Pipeline Parallel loss is not visible", "Error running lspci", "Peak flops undefined",
                  "Peak FLOPS used for computing MFU", "Applied FSDP to the model\n"):
        assert false not in out, false
    for rank in (0, 1):
        mine = [line for line in out.splitlines() if line.startswith(f"(rank {rank}) ")]
        assert sum("CPU: peak FLOPs unknown, MFU not reported" in line for line in mine) == 1
        assert sum("Applied FSDP to the model at degree 1: no parameter is sharded" in line for line in mine) == 1
        assert all("mfu: N/A" in line for line in mine if "step:" in line)
        assert sum("prints the loss" in line for line in mine) == (rank == 1)
    assert "Piper: rank 1 prints the loss (it holds the last pipeline stage" in out
    port = int(re.search(r"rendezvous port (\d+)", out).group(1))
    assert polled[0] >= 3 and wide == {("::", port)}, (polled, wide, port)


def test_titan_log_filter_says_true_lines_once(monkeypatch):
    """Each rule rewrites its first record and drops repeats; with LOG_RANK set, TorchTitan's
    loss-visibility warning may be right, so it stays."""
    import logging

    from piper_plugin.adapters.torchtitan.titan_log import TitanLogFilter

    def record(msg):
        return logging.LogRecord("root", logging.WARNING, __file__, 1, msg, (), None)

    log_filter = TitanLogFilter(cpu=True)
    warning = record("Pipeline Parallel loss is not visible. Please add rank 1 to LOG_RANK")
    monkeypatch.delenv("LOG_RANK", raising=False)
    assert not log_filter.filter(warning)
    monkeypatch.setenv("LOG_RANK", "0")
    assert log_filter.filter(warning)
    first, second = record("Peak flops undefined for: cpu, fallback to A100"), record("Error running lspci: x")
    assert log_filter.filter(first) and not log_filter.filter(second)
    assert first.getMessage() == "CPU: peak FLOPs unknown, MFU not reported" and first.levelname == "INFO"
    fsdp = record("Applied FSDP to the model")
    assert log_filter.filter(fsdp) and fsdp.getMessage() == "Applied FSDP to the model"  # degree not known yet
    log_filter.fsdp_degree_1 = True
    fsdp = record("Applied FSDP to the model")
    assert log_filter.filter(fsdp) and "at degree 1: no parameter is sharded" in fsdp.getMessage()
    gpu = record("Peak flops undefined for: NVIDIA X, fallback to A100")
    assert TitanLogFilter(cpu=False).filter(gpu) and gpu.getMessage().startswith("Peak flops undefined")


@pytest.mark.slow
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


@pytest.mark.slow
def test_silent_job_stops_after_timeout(ray_cluster, capsys):
    with pytest.raises(WorkerFailed) as info:
        launch(2, ["--config", "unused"], timeout_s=5, start_timeout_s=120, rank_cls=_HangingRank)
    out = capsys.readouterr().out
    assert str(info.value) == "rank 0 failed: no output from any rank for 5s (--timeout); ranks [0, 1] still running"
    assert "(rank 0) rank 0 is up" in out and "(rank 1) rank 1 is up" in out
    assert _wait_no_rank_actors() == []


_UNKNOWN_CONFIG = """
import sys, time
from piper_plugin.cli import build_parser, main
build_parser()  # the parser's own imports (torch) are not what is timed
start = time.process_time()  # CPU time: what the check costs, whatever else the machine runs
code = main(["launch", "--nproc", "2", "--", "--config", "no_such_config", "--training.steps", "3"])
print(f"{time.process_time() - start:.3f}", "ray" in sys.modules, "torchtitan" in sys.modules)
sys.exit(code)
"""


def test_unknown_config_fails_before_ray_listing_what_works():
    """The name is checked in the driver: no Ray, no actor, no TorchTitan import, well under 5 s of CPU time;
    the error lists the stock configs by model and the drop-ins, not the registry's helpers."""
    done = subprocess.run([sys.executable, "-c", _UNKNOWN_CONFIG], capture_output=True, text=True, timeout=120)
    seconds, ray_imported, titan_imported = done.stdout.split()
    assert done.returncode == 2 and float(seconds) < 5 and ray_imported == titan_imported == "False", done
    error, = done.stderr.splitlines()
    assert error.startswith("piper: error: --config 'no_such_config': not a config function")
    assert re.search(r"llama3: llama3_debugmodel, .*; qwen3: .*qwen3_moe_debug", error)
    assert "Piper drop-ins: <stock>_pp2_<schedule> with schedule gpipe, 1f1b, interleaved, dualpipev" in error
    assert "stock_config_fn" not in error and "to_piper_config" not in error


MEGATRON_ARGS = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1",
                 "--pipeline-engine=piper"]


@pytest.mark.slow
def test_launch_runs_the_megatron_entry_on_ray_actors(ray_cluster, tmp_path, monkeypatch, capsys):
    """One launcher for both hosts: ``--host megatron`` runs pretrain_gpt on the actors."""
    monkeypatch.setenv("PIPER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code = main(["launch", "--nproc", "2", "--host", "megatron", "--timeout", "300", "--", *MEGATRON_ARGS])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    logged = [line for line in out.splitlines() if line.startswith("(rank 1) ") and "| lm loss:" in line]
    assert [line.split("iteration")[1].split("/")[0].strip() for line in logged] == ["1", "2", "3"], out[-3000:]
    assert "> pipeline engine: piper" in out
    assert _wait_no_rank_actors() == []

