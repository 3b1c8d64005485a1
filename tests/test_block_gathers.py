"""ZeRO by block: module regions that declare their blocks reduce (ZeRO-2 and 3) and gather and
free (ZeRO-3) them one at a time inside the chunk. Four forked gloo ranks (pp=2 x dp=2) train a toy decoder cut as a host
cuts its stages (embedding, blocks ``layers.<i>``, norm and head), with param groups and a
frozen parameter inside a block, against plain PyTorch on one device, parameter by parameter;
and as a block's forward starts, at most the next one of its stage's three is gathered too (its
prefetch; 1F1B and interleaved)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import piper_plugin as piper
from forkserver_ranks import run_ranks
from piper_plugin.ir.nodes import Kind
from piper_plugin.adapters.torchtitan.program import LocalStages, build_stage_program, hidden_name

V, D, SEQ, BATCH, M, STEPS = 64, 32, 8, 16, 4, 3


class Block(nn.Module):
    def __init__(self, hidden: int = 2 * D):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    """One stage: the embedding on the first, norm and head on the last, blocks between."""

    def __init__(self, first: bool, last: bool, layers: list[int]):
        super().__init__()
        self.embed = nn.Embedding(V, D) if first else None
        # block 2's rows do not split evenly over two ranks: its collectives go through the
        # bucket's padded layout, the others' straight through the parameters
        self.layers = nn.ModuleDict({str(i): Block(2 * D + 1 if i == 2 else 2 * D) for i in layers})
        self.norm = nn.LayerNorm(D) if last else None
        self.head = nn.Linear(D, V) if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def _parts(stages: int) -> list[Stage]:
    torch.manual_seed(0)
    parts = [Stage(s == 0, s == stages - 1, [3 * s, 3 * s + 1, 3 * s + 2]) for s in range(stages)]
    parts[0].layers["1"].norm.weight.requires_grad_(False)  # frozen, inside a block
    return parts


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _optimizer(named) -> torch.optim.Optimizer:
    # eps well above the smallest gradients: AdamW would turn their float32 rounding into whole steps
    vectors = [p for _, p in named if p.ndim < 2]
    rest = [p for _, p in named if p.ndim >= 2]
    return torch.optim.AdamW([{"params": vectors, "weight_decay": 0.0}, {"params": rest, "lr": 2e-2}],
                             lr=1e-2, weight_decay=0.1, eps=1e-4)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def _reference(stages: int) -> dict[str, torch.Tensor]:
    parts = _parts(stages)
    model = nn.Sequential(*parts)
    optimizer = _optimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad])
    for step in range(STEPS):
        tokens, labels = _batch(step)
        _loss(model(tokens), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {f"model.stages.{n}": p.detach().clone() for n, p in model.named_parameters()}


def _schedule(recipe: str, blocks: bool, zero: int = 3):
    def apply(program):
        sch = piper.recipes.load(recipe).schedule(program, pp=2, dp=2, microbatches=M, zero=zero)
        if blocks:
            return sch
        trace = sch.to_json()  # the same directives with whole-stage gathers
        for step in trace["directives"]:
            if step["directive"] == "replicate":
                step["blocks"] = False
        return piper.Schedule.from_json(program, trace)
    return apply


def _rank(rank: int, port: int, recipe: str, blocks: bool, zero: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        stages = piper.recipes.load(recipe).stages(2)
        parts = _parts(stages)
        program = build_stage_program(parts, microbatch_size=BATCH // 2 // M, microbatches=M, seq_len=SEQ,
                                      hidden_dim=D, dtype=torch.float32, data_shards=2)
        plan = piper.compile_program(program, _schedule(recipe, blocks, zero)).plan
        pp_rank = plan.grid.coords(rank)[0]
        local = {int(r) for r, where in plan.dag.meta.placement.items() if where == pp_rank}
        model = LocalStages({s: parts[s] for s in local})
        specs = {hidden_name(s): piper.ValueSpec((BATCH // 2 // M, SEQ, D), torch.float32) for s in range(stages - 1)}
        executor = piper.Executor(plan, program, rank, model, _loss, specs=specs,
                                  optimizer_fn=lambda params: _optimizer(params.named()),
                                  config=piper.ExecutorConfig(timeout_s=60))
        state = executor.state
        at_once = [0]  # the most block buckets gathered (or being gathered) as a block's forward starts
        for gathers in state.blocks.values():
            for module in gathers.modules:
                def count(module, args, of=gathers):
                    if of.mode == "F":
                        at_once[0] = max(at_once[0], sum(b.materialized for b in of.buckets))
                module.register_forward_pre_hook(count)
        grads_at_once = [0]  # the most bytes of full-size gradients alive at once (ZeRO-2 reduces them away)
        in_blocks = [q for gathers in state.blocks.values() for b in gathers.buckets for q in b.params]
        uncounted = [0]  # the most bytes of blocks' gradients alive beyond what the meter counts as transient
        blocks_at_once = [0]  # the most bytes of blocks' gradients alive at once
        def grown(p):
            alive = sum(q.grad.nbytes for q in model.parameters() if q.grad is not None)
            grads_at_once[0] = max(grads_at_once[0], alive)
            blocks = sum(q.grad.untyped_storage().nbytes() for q in in_blocks if q.grad is not None)
            blocks_at_once[0] = max(blocks_at_once[0], blocks)
            uncounted[0] = max(uncounted[0], blocks - (state.meter.current - state.meter.saved))
        ranks = plan.ranks[rank]  # whether this rank runs a BI apart from its weight pass
        split = any(plan.dag.nodes[k].kind == Kind.BI and k not in ranks.fused for k in ranks.streams["compute"])
        region_blocks = min(sum(q.numel() * q.element_size() for b in gathers.buckets for q in b.params
                                if q.requires_grad) for gathers in state.blocks.values()) if state.blocks else 0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(grown)
        half = plan.grid.data_shard(rank)
        for step in range(STEPS):
            tokens, labels = (t.chunk(2)[half].chunk(M) for t in _batch(step))
            executor.step(microbatches={"tokens": list(tokens), "labels": list(labels), "kwargs": [{}] * M,
                                        "loss_kwargs": [{}] * M})
        peak = state.meter.peak
        for key, bucket in state.buckets.items():  # the whole parameters, gathered from the shards
            if bucket.zero == 3:
                executor.comm.gather_bucket(key, bucket)
        params = {f"model.{n}": p.detach().tolist() for n, p in model.named_parameters()}  # no shared memory
        out.put((rank, {"params": params, "blocks": sorted(state.blocks), "at_once": at_once[0], "peak": peak,
                         "grads_at_once": grads_at_once[0], "uncounted": uncounted[0],
                         "blocks_at_once": blocks_at_once[0], "region_blocks": region_blocks, "split": split}))
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback
        out.put((rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def _train(recipe: str, blocks: bool, zero: int = 3) -> dict:
    results = run_ranks(_rank, 4, recipe, blocks, zero)
    errors = [r["error"] for r in results.values() if "error" in r]
    assert not errors, "\n".join(errors)
    for r in results.values():
        r["params"] = {n: torch.tensor(v) for n, v in r["params"].items()}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("recipe", ["1f1b", "interleaved-1f1b", "dualpipev"])
def test_zero_by_block_matches_single_device(recipe, zero):
    stages = piper.recipes.load(recipe).stages(2)
    reference = _reference(stages)
    results = _train(recipe, blocks=True, zero=zero)
    seen = {}
    for r in results.values():
        assert r["blocks"], "no region reduced by block"
        assert r["uncounted"] <= 0, r["uncounted"]  # the meter counts every block gradient torch holds
        if r["split"]:  # a weight pass reduces as it ends: all its region's block gradients at once
            assert r["blocks_at_once"] >= r["region_blocks"], [(q["blocks_at_once"], q["region_blocks"]) for q in results.values()]
        seen.update(r["params"])
        if zero == 3 and recipe != "dualpipev":  # a split backward keeps the blocks gathered from BI to BW
            assert r["at_once"] <= 2, r["at_once"]  # the block and the next one, prefetched; of 3
    assert seen.keys() == reference.keys()
    for name, want in reference.items():
        err = (seen[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
        assert err < 1e-5, (name, err)
    frozen = "model.stages.0.layers.1.norm.weight"
    assert torch.equal(seen[frozen], reference[frozen])


@pytest.mark.slow
def test_blocks_lower_the_peak_below_whole_buckets():
    """ZeRO-3, same plan, same numbers: the meter's peak per rank is lower by block (at most a
    block and the next gathered) than with whole buckets (the stage gathered for the task)."""
    by_block, whole = _train("1f1b", blocks=True), _train("1f1b", blocks=False)
    for rank in by_block:
        assert by_block[rank]["peak"] < whole[rank]["peak"], (rank, by_block[rank]["peak"], whole[rank]["peak"])
        for name, p in by_block[rank]["params"].items():
            assert torch.allclose(p, whole[rank]["params"][name], rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_zero2_blocks_never_hold_a_stages_gradients_at_once():
    """ZeRO-2, same plan, same numbers: by block, a block's full-size gradients are reduced away
    as the next block's backward begins, so fewer gradient bytes are alive at once than with
    whole buckets (the stage's, until its reduce-scatter). The meter's peak is not compared:
    with whole buckets it depends on how many microbatches' payloads wait on the communication
    thread at once (timing), by block it does not. What torch holds of the blocks' gradients
    is always inside what the meter counts beside the saved activations."""
    by_block, whole = _train("1f1b", blocks=True, zero=2), _train("1f1b", blocks=False, zero=2)
    for rank in by_block:
        held, stage = by_block[rank]["grads_at_once"], whole[rank]["grads_at_once"]
        assert held < 0.6 * stage, (rank, held, stage)
        assert by_block[rank]["uncounted"] <= 0, (rank, by_block[rank]["uncounted"])
        for name, p in by_block[rank]["params"].items():
            assert torch.allclose(p, whole[rank]["params"][name], rtol=1e-5, atol=1e-7), name


def test_simulated_transient_holds_blocks_not_stages(zero=3):
    """The simulator's transient peak per rank, from the same directives: by block (a forward
    two blocks, a backward four) below whole-stage gathers (the stage, twice over a 1F1B)."""
    parts = _parts(2)
    program = build_stage_program(parts, microbatch_size=BATCH // 2 // M, microbatches=M, seq_len=SEQ,
                                  hidden_dim=D, dtype=torch.float32, data_shards=2)
    by_block = piper.compile_program(program, _schedule("1f1b", True, zero)).simulation.peak_transient_bytes
    whole = piper.compile_program(program, _schedule("1f1b", False, zero)).simulation.peak_transient_bytes
    assert all(b < w for b, w in zip(by_block, whole)), (by_block, whole)


@pytest.mark.parametrize("recipe", ["zb-h1", "dualpipev"])
def test_a_simulated_weight_pass_holds_every_blocks_gradient(recipe):
    """At ZeRO-2 by block a weight pass reduces its blocks only as it ends (what torch holds in
    ``test_zero_by_block_matches_single_device``), so with blocks far larger than the activations
    a rank that runs a BI apart from its BW peaks above all of its stage's three blocks'
    gradients; the others hold two (the block and the one whose reduce-scatter is in flight)."""
    stages = piper.recipes.load(recipe).stages(2)
    parts = _parts(stages)
    for part in parts:
        for name in list(part.layers):
            part.layers[name] = Block(1024)
    block = sum(p.numel() * 4 for p in parts[0].layers["0"].parameters())
    program = build_stage_program(parts, microbatch_size=BATCH // 2 // M, microbatches=M, seq_len=SEQ,
                                  hidden_dim=D, dtype=torch.float32, data_shards=2)
    compiled = piper.compile_program(program, _schedule(recipe, True, zero=2))
    plan, peaks = compiled.plan, compiled.simulation.peak_transient_bytes
    for rank, peak in enumerate(peaks):
        ranks = plan.ranks[rank]
        split = any(plan.dag.nodes[k].kind == Kind.BI and k not in ranks.fused for k in ranks.streams["compute"])
        assert (3 * block < peak < 3.3 * block) if split else (2 * block < peak < 2.3 * block), (rank, peak / block)
    assert any(peak > 3 * block for peak in peaks)


def test_blocks_of_a_checkpoint_wrapped_stage_carry_the_stages_parameter_names():
    """A block wrapped for activation checkpointing hides the wrapper's prefix from its own
    named_parameters(); its block must still name the parameters as its stage does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parts = _parts(2)
    for name, block in list(parts[0].layers.items()):
        parts[0].layers[name] = checkpoint_wrapper(block)
    program = build_stage_program(parts, microbatch_size=2, microbatches=M, seq_len=SEQ, hidden_dim=D,
                                  dtype=torch.float32, data_shards=2)
    region = program.regions["0"]
    in_blocks = [p for _, names in region.blocks for p in names]
    assert in_blocks == [p for p in region.params if ".layers." in p] and "_checkpoint_wrapped_module" in in_blocks[0]
