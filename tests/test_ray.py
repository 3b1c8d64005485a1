"""Launch mode Ray: the driver compiles once, actors train; parity, user optimizer and LR
scheduler, and a failing actor stopping the job — on one Ray cluster for the session."""
import contextlib
import functools
import subprocess
import time

import pytest
import torch

from listening import listening, loopback, process_tree
from piper_plugin.api.schedule import Schedule
from piper_plugin.models import ToyLM, ToyLMConfig, lm_loss
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import WorkerFailed
from piper_plugin.runtime.launch.ray_actors import run_ray
from parity import lm_data
import faulty

pytestmark = pytest.mark.slow

CFG = ToyLMConfig(n_layers=2)


def _model():
    return ToyLM(CFG, stages=2)


def _schedule(program):
    return apply_recipe(Schedule(program, pp=2), "1f1b", microbatches=4)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_ray_training_uses_the_users_optimizer_and_scheduler(ray_cluster):
    job = Job(_model, lm_loss, lm_data(CFG, 8), _schedule, _sgd, steps=3, lr_scheduler_fn=_step_lr)
    program, _, plan, _ = compile_job(job)
    metrics = []
    run_ray(job, program, plan, on_metrics=metrics.append)
    torch.manual_seed(0)
    reference = _model()
    optimizer = _sgd(list(reference.parameters()))
    scheduler = _step_lr(optimizer)
    data = job.data_fn(0)
    for step in range(3):
        tokens, target = next(data)
        loss = lm_loss(reference(tokens), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        got = [m["loss"] for m in metrics if m["step"] == step and "loss" in m]
        assert got and abs(got[0] - loss.item()) < 1e-5 * loss.item()


def _rank_actors() -> list[str]:
    """Processes of live rank actors (Ray names an actor's process after its class)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if "ray::RankActor" in line]


@pytest.mark.parametrize("fault,call,timeout_s,expected", [
    ("raise", 2, 120, "rank 1: task 1F0 on stream 'compute' failed: RuntimeError('boom inside the stage-1 chunk')"),
    ("die", 3, 120, "actor died"),
    ("stall", 2, 4, "(a message from rank 1)"),  # rank 0's own timeout names whom it waited for
])
def test_ray_actor_failure_stops_the_job(ray_cluster, fault, call, timeout_s, expected):
    """Raise inside a chunk, die mid-step, stall past the 4 s timeout: the job stops naming the
    rank, and no rank actor is left. The time bound is a hang guard: an error that reached no
    other rank would end at the 120 s timeout (a stalled rank sleeps 120 s), against seconds."""
    job = Job(functools.partial(faulty.TwoStage, fault=fault, rank=1, call=call), faulty.mse, faulty.data,
              lambda p: apply_recipe(Schedule(p, pp=2), "gpipe", microbatches=2),
              functools.partial(torch.optim.SGD, lr=0.1), steps=3, timeout_s=timeout_s)
    program, _, plan, _ = compile_job(job)
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_ray(job, program, plan)
    message = str(info.value).splitlines()[0]
    assert expected in message, message
    assert info.value.rank == (0 if fault == "stall" else 1)
    assert time.monotonic() - start < 60  # starting two actors included
    deadline = time.monotonic() + 10  # ray.kill returns before the processes are gone
    while _rank_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rank_actors() == []


def test_the_driver_asks_stalled_actors_what_they_do(ray_cluster):
    """Past its patience the driver names each stalled rank's state; a dead actor says nothing."""
    import ray

    from piper_plugin.runtime.launch.ray_actors import RankActor, _statuses

    cls = ray.remote(num_cpus=0, max_concurrency=2)(RankActor)
    alive, dead = cls.remote(), cls.remote()
    ray.get(alive.endpoint.remote(True), timeout=60)  # started, as a stalled rank's actor is
    ray.kill(dead)
    try:
        assert _statuses([alive, dead], [0, 1]) == "rank 0: setting up; rank 1: no answer"
    finally:
        ray.kill(alive)


@pytest.mark.slow
def test_the_console_script_trains_on_a_quiet_local_ray_listening_on_the_loopback_only(tmp_path):
    """The console script with the default launcher (a local Ray it starts itself): it trains
    and reports every step, Ray says nothing, and while it trains every listening socket of the
    driver and everything below it (GCS, raylet, workers, agents) is on the loopback address."""
    import ipaddress
    import json
    import os
    import shutil

    from test_train_cli import step_lines

    steps, metrics = 60, tmp_path / "m.jsonl"
    piper = shutil.which("piper") or pytest.skip("console script not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([piper, "train", "--pp", "2", "--microbatches", "4", "--steps", str(steps),
                            "--metrics", str(metrics)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out = []
        for line in job.stdout:  # "step      3/60  loss ..."
            out.append(line)
            if line.split("/")[0].split() == ["step", "3"]:
                break
        sockets = listening(process_tree(job.pid))
        assert job.poll() is None, "the run ended before its sockets were listed"
        assert len(sockets) >= 5, f"found too few listening sockets to tell anything: {sockets}"
        wide = [(pid, open(f"/proc/{pid}/comm").read().strip(), ip) for pid, ip, _ in sockets
                if not loopback(ipaddress.ip_address(ip))]
        assert not wide, f"listening beyond the loopback: {wide}"
        rest, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
        job.wait(30)
    stdout = "".join(out) + rest
    assert job.returncode == 0, err[-3000:]
    assert "(2 ranks, ray)" in stdout and len(step_lines(stdout)) == steps, stdout[-2000:]
    assert "Traceback" not in err and "Started a local Ray instance" not in err, err[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2 * steps and {r["rank"] for r in rows if "loss" in r} == {1}


@contextlib.contextmanager
def _ray_head(tmp_path, env: dict):
    """A Ray head started as a user starts one (``ray start --head``, on the loopback, in ``env``);
    yields its address; the head and everything it started are killed after."""
    import os
    import shutil
    import socket
    import tempfile

    from piper_plugin.runtime.launch.processes import free_port

    port = free_port()
    ray_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    log = tmp_path / f"head{port}.log"
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", ray_dir], env={**env, "RAY_USAGE_STATS_ENABLED": "0"},
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # the GCS port answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        if head.poll() is None:
            os.killpg(head.pid, 9)  # the head and every process it started (a graceful stop drains for ~30 s)
        head.wait(60)
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.mark.slow
def test_address_joins_a_token_authenticated_cluster_and_a_wrong_token_is_one_line(tmp_path):
    """A cluster started as the docs say (``RAY_AUTH_MODE=token ray start --head`` with a
    generated token, here on the loopback): ``piper train --address`` with the token trains on
    it; with a wrong token the job ends in seconds with one ``piper: error:`` line naming the
    fix, before any rank starts; joining without a token is refused the same way. And a cluster
    started without authentication (``RAY_AUTH_MODE=disabled``): the job trains on it and Piper
    says once that it accepted the driver without a token, with the token recipe."""
    import os
    import secrets
    import sys

    token = secrets.token_hex(32)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with _ray_head(tmp_path, {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}) as address, \
            _ray_head(tmp_path, {**clean, "RAY_AUTH_MODE": "disabled"}) as open_address:
        train = [sys.executable, "-m", "piper_plugin.cli", "train", "--steps", "2", "--address", address]
        start = time.monotonic()
        good = subprocess.run(train, env={**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
                              capture_output=True, text=True, timeout=180)
        assert good.returncode == 0, good.stderr[-3000:]
        assert "step 2/2" in good.stdout and "without a token" not in good.stderr
        print(f"joined and trained: {time.monotonic() - start:.1f} s")
        start = time.monotonic()  # both refused drivers at once (each mostly waits for Ray's retries), and
        # the job on the cluster without authentication
        unauthenticated = subprocess.Popen(train[:-1] + [open_address], env=clean, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        refused = {name: subprocess.Popen(train, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for name, env in {"wrong": {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                                     "missing": {**clean, "HOME": str(tmp_path)}}.items()}  # no token file there
        for name, job in refused.items():
            out, err = job.communicate(timeout=120)
            bad = subprocess.CompletedProcess(train, job.returncode, out, err)
            errors = [line for line in bad.stderr.splitlines() if line.startswith("piper: error:")]
            assert bad.returncode == 2 and len(errors) == 1, (name, bad.stderr[-3000:])
            assert f"Ray address {address}: the cluster there did not accept this driver" in errors[0], name
            assert "RAY_AUTH_MODE=token" in errors[0] and "RAY_AUTH_TOKEN" in errors[0], errors[0]
            assert "step 1/" not in bad.stdout, name  # no rank trained
            print(name, f"{time.monotonic() - start:.1f} s")
            assert time.monotonic() - start < 60, name
        out, err = unauthenticated.communicate(timeout=180)
        assert unauthenticated.returncode == 0 and "step 2/2" in out, err[-3000:]
        warnings = [line for line in err.splitlines() if "accepted this driver without a token" in line]
        assert len(warnings) == 1, err[-3000:]
        assert warnings[0].startswith("piper: warning:") and "RAY_AUTH_MODE=token" in warnings[0]

