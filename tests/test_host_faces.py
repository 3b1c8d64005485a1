"""A host that steps its own optimizer over Piper's ZeRO shards, as TorchTitan's trainer does:
the parameters it sees between steps are DTensor faces of this rank's shards (whole names and
shapes, reduced gradients), so its param groups, gradient clipping (exact global norm over PP x
DP) and state dict work unchanged. Four forked ranks (pp=2 x dp=2) against plain PyTorch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import piper_plugin as piper
from forkserver_ranks import run_ranks
from piper_plugin.models import ToyLM, ToyLMConfig, lm_batch, lm_loss

CFG = ToyLMConfig(n_layers=4)
M = 4
STEPS = 3
MAX_NORM = 0.05  # small enough that every step clips


def _batch(seed: int):
    return lm_batch(CFG, 16, torch.Generator().manual_seed(seed))


def _optimizer(named) -> torch.optim.Optimizer:
    """The host's: groups by shape (no weight decay for vectors) and by name (embedding lr)."""
    embed = [p for n, p in named if n.startswith("embed")]
    vectors = [p for n, p in named if not n.startswith("embed") and p.ndim < 2]
    rest = [p for n, p in named if not n.startswith("embed") and p.ndim >= 2]
    return torch.optim.AdamW([{"params": embed, "lr": 5e-3}, {"params": vectors, "weight_decay": 0.0},
                              {"params": rest}], lr=1e-2, weight_decay=0.1)


def _host_rank(rank: int, port: int, recipe: str, zero: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        stages = piper.recipes.load(recipe).stages(2)
        *inputs, target = _batch(0)
        compiled = piper.compile(lambda: ToyLM(CFG, stages=stages), lm_loss, inputs, target,
                                 lambda p: piper.recipes.load(recipe).schedule(p, pp=2, dp=2, microbatches=M, zero=zero))
        grid = compiled.plan.grid
        torch.manual_seed(0)
        model = ToyLM(CFG, stages=stages)
        reference = copy.deepcopy(model)
        micro = {n: t.chunk(2)[0].chunk(M)[0] for n, t in zip(compiled.program.input_names, _batch(0))}
        with torch.device("meta"):
            meta = copy.deepcopy(model).to("meta")
        specs = piper.probe_values(compiled.program, meta, lm_loss, micro)
        executor = piper.Executor(compiled.plan, compiled.program, rank, model, lm_loss, specs=specs,
                                  optimizer_fn=None, config=piper.ExecutorConfig(timeout_s=60))
        named = [(n, p) for n, p in model.named_parameters() if p.numel()]  # this rank's stages
        faces = sum(isinstance(p, DTensor) for _, p in named)
        optimizer = _optimizer(named)
        ref_optimizer = _optimizer(list(reference.named_parameters()))
        pp_groups = [dist.new_group([r for r in range(4) if grid.coords(r)[1] == d]) for d in range(2)]
        pp_group = pp_groups[grid.coords(rank)[1]]
        losses, ref_losses, norms, ref_norms = [], [], [], []
        for step in range(STEPS):
            batch = dict(zip(compiled.program.input_names, _batch(step + 1)))
            mine = executor.step(batch=batch)
            if mine:
                losses.append(torch.stack(mine).sum().item())
            grads = [p.grad for _, p in named if p.grad is not None]
            local = torch.nn.utils.get_total_norm(grads)
            local = local.full_tensor() if isinstance(local, DTensor) else local  # over the dp shards
            total = local ** 2
            dist.all_reduce(total, group=pp_group)  # over the pipeline stages
            total = total.sqrt()
            torch.nn.utils.clip_grads_with_norm_([p for _, p in named], MAX_NORM, total)
            optimizer.step()
            optimizer.zero_grad()
            norms.append(total.item())
            *x, y = _batch(step + 1)
            half = grid.coords(rank)[1]
            if mine:  # this replica's microbatches: its half of the batch, scaled by 1 / data shards
                with torch.no_grad():
                    ref_losses.append(lm_loss(reference(x[0].chunk(2)[half]), y.chunk(2)[half]).item() / 2)
            ref = lm_loss(reference(*x), y)
            ref.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item())
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        eval_batch = dict(zip(compiled.program.input_names, _batch(99)))
        eval_losses = executor.eval(executor.shard(eval_batch))  # ZeRO-3 shards gathered whole for it
        with torch.no_grad():
            *x, y = _batch(99)
            half = grid.coords(rank)[1]
            mb = [lm_loss(reference(xs), ys).item()
                  for xs, ys in zip(x[0].chunk(2)[half].chunk(M), y.chunk(2)[half].chunk(M))]
        eval_err = max((abs(a.item() - b) / b for a, b in zip(eval_losses, mb)), default=0.0)
        ref_params = dict(reference.named_parameters())
        state = model.state_dict()
        param_err = 0.0
        with torch.no_grad():
            for name, p in named:
                whole = p.full_tensor() if isinstance(p, DTensor) else p
                param_err = max(param_err, ((whole - ref_params[name]).norm() / ref_params[name].norm()).item())
                saved = state[name]
                assert (saved.full_tensor() if isinstance(saved, DTensor) else saved).shape == ref_params[name].shape
        loss_err = max((abs(a - b) / b for a, b in zip(losses, ref_losses)), default=0.0)
        norm_err = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        out.put((rank, {"faces": faces, "local": len(named), "losses": len(losses), "loss": loss_err,
                        "eval": eval_err, "evals": len(eval_losses),
                        "norm": norm_err, "param": param_err}))
    except BaseException:  # noqa: BLE001 - report it to the test
        import traceback
        out.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run(*args) -> dict:
    return run_ranks(_host_rank, 4, *args)


def _check(recipe: str, zero: int) -> None:
    results = _run(recipe, zero)
    for rank, report in results.items():
        assert isinstance(report, dict), f"rank {rank}: {report}"
        assert report["faces"] == report["local"] > 0, (rank, report)
        assert report["norm"] < 1e-5 and report["param"] < 1e-5, (rank, report)
        assert report["loss"] < 1e-5 and report["eval"] < 1e-5, (rank, report)
        assert report["evals"] == (M if report["losses"] else 0), (rank, report)
    assert sum(r["losses"] > 0 for r in results.values()) == 2  # the last stage, on both replicas


@pytest.mark.slow  # 4 ranks, 12 s: the fast tier's invariant-8 checks are test_optimizer_view and test_executor
def test_a_host_optimizer_steps_zero3_shards_through_faces():
    _check("1f1b", 3)


@pytest.mark.slow
@pytest.mark.parametrize("recipe,zero", [("1f1b", 1), ("1f1b", 2), ("interleaved-1f1b", 3), ("dualpipev", 2)])
def test_a_host_optimizer_steps_shards_through_faces(recipe, zero):
    _check(recipe, zero)
