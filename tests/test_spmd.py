"""Launch mode SPMD: ranks that compiled different plans stop before step 1, naming the hashes."""
import multiprocessing as mp
import os

import torch.distributed as dist

from piper_plugin.api.schedule import Schedule
from piper_plugin.models import ToyLM, ToyLMConfig, lm_loss
from piper_plugin.recipes import apply_recipe
from piper_plugin.compiler import compile_job
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.launch.processes import free_port
from piper_plugin.runtime.executor import PlanMismatch, check_plan_hash
from parity import adamw, lm_data

CFG = ToyLMConfig(n_layers=2)


def _compile(recipe):
    job = Job(lambda: ToyLM(CFG, stages=2), lm_loss, lm_data(CFG, 8),
              lambda p: apply_recipe(Schedule(p, pp=2), recipe, microbatches=4), adamw)
    return compile_job(job)[2]


def _rank(rank, port, recipes, out):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        check_plan_hash(_compile(recipes[rank]))
        out.put((rank, "ok"))
    except PlanMismatch as exc:
        out.put((rank, str(exc)))
    dist.destroy_process_group()


def _run(recipes):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, recipes, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    return results


def test_same_plan_passes_the_hash_check():
    assert _run(["1f1b", "1f1b"]) == {0: "ok", 1: "ok"}


def test_different_plans_are_caught_before_step_one():
    results = _run(["1f1b", "gpipe"])
    for message in results.values():
        assert "ranks compiled different plans" in message
    assert _compile("1f1b").hash() in results[0] and _compile("gpipe").hash() in results[0]


def test_a_cuda_job_gets_nccl_bound_to_its_gpu(monkeypatch):
    """--device cuda in any launch mode: NCCL with the rank's device bound (communicators are
    created with their groups, in one order on every rank); a CPU job gets gloo."""
    import torch

    from piper_plugin.runtime.worker import init_distributed

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    init_distributed(torch.device("cuda", 1), 5.0, rank=1, world_size=2)
    init_distributed(torch.device("cpu"), 5.0, rank=0, world_size=2)
    (_, gpu), (nccl, gpu_kw), (gloo, cpu_kw) = calls
    assert gpu == torch.device("cuda", 1) and nccl == "nccl" and gpu_kw["device_id"] == gpu
    assert gloo == "gloo" and "device_id" not in cpu_kw
    assert gpu_kw["timeout"].total_seconds() == 5.0 and gpu_kw["rank"] == 1
