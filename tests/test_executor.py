"""A host drives Piper's per-rank Executor with the published API only, as TorchTitan's adapter
does: its own optimizer over its own parameters (``optimizer_fn=None``), microbatches it cut
itself, forward-only eval, and state it saves and restores. Each rank checks itself against
plain PyTorch on the same model and data."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import piper_plugin as piper
from forkserver_ranks import run_ranks
from piper_plugin.models import ToyLM, ToyLMConfig, lm_batch, lm_loss

CFG = ToyLMConfig(n_layers=4)
M = 4


def _batch(seed: int):
    return lm_batch(CFG, 8, torch.Generator().manual_seed(seed))


def _model(recipe: str) -> ToyLM:
    return ToyLM(CFG, stages=piper.recipes.load(recipe).stages(2))


def _compiled(recipe: str) -> piper.Compiled:
    *inputs, target = _batch(0)
    return piper.compile(lambda: _model(recipe), lm_loss, inputs, target,
                         lambda program: piper.recipes.load(recipe).schedule(program, pp=2, microbatches=M))


def _executor(compiled: piper.Compiled, rank: int, model: torch.nn.Module, optimizer_fn=None) -> piper.Executor:
    program = compiled.program
    micro = {name: t.chunk(M)[0] for name, t in zip(program.input_names, _batch(0))}
    with torch.device("meta"):
        meta = copy.deepcopy(model).to("meta")
    specs = piper.probe_values(program, meta, lm_loss, micro)
    return piper.Executor(compiled.plan, program, rank, model, lm_loss, specs=specs, optimizer_fn=optimizer_fn,
                          config=piper.ExecutorConfig(timeout_s=30))


def _host_rank(rank: int, port: int, recipe: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        compiled = _compiled(recipe)
        torch.manual_seed(0)
        model = _model(recipe)
        reference = copy.deepcopy(model)
        before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
        executor = _executor(compiled, rank, model)  # the host steps its own optimizer
        batch = _batch(1)
        names = compiled.program.input_names
        microbatches = {name: list(t.chunk(M)) for name, t in zip(names, batch)}
        losses = executor.step(microbatches=microbatches)
        *inputs, target = batch
        lm_loss(reference(*inputs), target).backward()
        ref_grads = dict(reference.named_parameters())
        report = {"losses": len(losses), "grad": 0.0, "same_params": True, "local": 0}
        for name, p in model.named_parameters():
            report["same_params"] &= before[name][0] is p
            if p.numel():  # a parameter of this rank's regions (the others were let go)
                report["local"] += 1
                report["same_params"] &= before[name][1] == p.data_ptr()
                err = ((p.grad - ref_grads[name].grad).norm() / ref_grads[name].grad.norm()).item()
                report["grad"] = max(report["grad"], err)
        eval_losses = executor.eval(microbatches)
        with torch.no_grad():
            ref_eval = [lm_loss(reference(*[microbatches[n][mb] for n in names[:-1]]), microbatches[names[-1]][mb])
                        for mb in range(M)]
        report["eval"] = max((abs(a.item() - b.item()) / b.item() for a, b in zip(eval_losses, ref_eval)), default=0.0)
        report["eval_count"] = len(eval_losses)
        saved = executor.state_dict()  # the host's optimizer keeps its own state: nothing of it here
        executor.load_state_dict(saved)
        report["restored"] = saved["optimizers"] and all(o == {} for o in saved["optimizers"].values())
        out.put((rank, report))
    except BaseException as exc:  # noqa: BLE001 - report it to the test
        out.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def _resume_rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        compiled = _compiled("1f1b")
        torch.manual_seed(0)
        adam = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
        executor = _executor(compiled, rank, _model("1f1b"), optimizer_fn=adam)
        feed = lambda seed: dict(zip(compiled.program.input_names, _batch(seed)))  # noqa: E731
        executor.step(batch=feed(1))
        saved = copy.deepcopy(executor.state_dict())
        executor.step(batch=feed(2))
        after = executor.state_dict()["params"]
        executor.step(batch=feed(3))  # moves on, then goes back
        executor.load_state_dict(saved)
        executor.step(batch=feed(2))
        again = executor.state_dict()["params"]
        same = all(torch.equal(after[k], again[k]) for k in after) and set(after) == set(again)
        moved = any(not torch.equal(saved["params"][k], after[k]) for k in after)
        bad = dict(saved, rank=1 - rank)
        try:
            executor.load_state_dict(bad)
            refused = False
        except ValueError as exc:
            refused = "rank" in str(exc)
        out.put((rank, {"same": same, "moved": moved, "refused": refused}))
    except BaseException as exc:  # noqa: BLE001
        out.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def _run(target, *args) -> dict:
    return run_ranks(target, 2, *args, timeout_s=120)


@pytest.mark.parametrize("recipe", ["1f1b", "dualpipev"])
def test_a_host_steps_its_own_optimizer_and_evaluates(recipe):
    results = _run(_host_rank, recipe)
    for rank, report in results.items():
        assert isinstance(report, dict), f"rank {rank}: {report}"
        assert report["same_params"], f"rank {rank}: the host's parameters were replaced or moved"
        assert report["local"] > 0 and report["grad"] < 1e-5, (rank, report)
    last = [r for r in results.values() if r["losses"]]
    assert len(last) == 1 and last[0]["losses"] == M and last[0]["eval_count"] == M
    assert last[0]["eval"] < 1e-5
    assert all(r["restored"] for r in results.values())


@pytest.mark.slow
def test_state_dict_resumes_a_rank_exactly_and_refuses_another_rank():
    results = _run(_resume_rank)
    for rank, report in results.items():
        assert report == {"same": True, "moved": True, "refused": True}, f"rank {rank}: {report}"
