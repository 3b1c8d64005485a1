"""Invariant 1 on real processes: forked gloo ranks train exactly like one device."""
import functools

import pytest
import torch

from piper_plugin.api.schedule import Schedule
from piper_plugin.models import ToyLM, ToyLMConfig, ToyMoELM
from piper_plugin.recipes import apply_recipe, stages_needed
from parity import check_distributed_parity

RECIPES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"]


def _schedule(recipe, pp, dp, ep, m, zero, program, bucket_bytes=None):
    return apply_recipe(Schedule(program, pp=pp, dp=dp, ep=ep), recipe, microbatches=m, zero=zero,
                        bucket_bytes=bucket_bytes)


def _model(cls, cfg, stages):
    return cls(cfg, stages=stages)


def _check_parity(recipe, pp, dp=1, ep=1, zero=0, moe=False):
    m = max(4, 2 * pp) if recipe == "dualpipev" else 4
    stages = stages_needed(recipe, pp)
    cfg = ToyLMConfig(n_layers=stages)
    model_fn = functools.partial(_model, ToyMoELM if moe else ToyLM, cfg, stages)
    check_distributed_parity(model_fn, cfg, 2 * m * dp * ep,
                             functools.partial(_schedule, recipe, pp, dp, ep, m, zero))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_match_single_device(recipe):
    _check_parity(recipe, pp=2)


@pytest.mark.slow
@pytest.mark.parametrize("recipe,pp,dp,zero", [
    ("gpipe", 4, 1, 0), ("1f1b", 2, 2, 3), ("interleaved-1f1b", 2, 2, 1), ("zb-h1", 4, 1, 0),
    ("dualpipev", 2, 2, 2)])
def test_four_ranks_match_single_device(recipe, pp, dp, zero):
    _check_parity(recipe, pp=pp, dp=dp, zero=zero)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_rows_that_do_not_split_evenly_over_the_replicas(zero):
    """A vocabulary of 63 rows over dp=2: the bucket's gathers and reduce-scatters go through
    the rank-major layout (one padded block per member) instead of per parameter in place."""
    cfg = ToyLMConfig(n_layers=2, vocab=63)
    check_distributed_parity(functools.partial(_model, ToyLM, cfg, 2), cfg, 16,
                             functools.partial(_schedule, "1f1b", 2, 2, 1, 4, zero))


@pytest.mark.slow
def test_zero0_replicas_tied_embeddings_and_several_buckets_per_stage():
    """ZeRO-0 over dp=2 (each replica's gradients and parameters compared: a replica that kept
    its own numbers would fail), the embedding tied to the head (one weight read by the first and
    the last stage, on different ranks) and 4 KiB buckets (several per stage), on 4 ranks."""
    from piper_plugin.compiler import compile_job
    from piper_plugin.runtime.job import Job
    from parity import adamw, lm_data
    from piper_plugin.models import lm_loss

    cfg = ToyLMConfig(n_layers=2, tie_embeddings=True)
    schedule = functools.partial(_schedule, "1f1b", 2, 2, 1, 4, 0, bucket_bytes=4096)
    plan = compile_job(Job(functools.partial(_model, ToyLM, cfg, 2), lm_loss, lm_data(cfg, 16), schedule, adamw))[2]
    buckets: dict[str, set] = {}
    for node in plan.dag.nodes.values():
        if node.kind.value == "ALL_REDUCE" and node.bucket is not None:
            buckets.setdefault(node.region, set()).add(node.bucket)
    assert buckets and all(len(b) > 1 for b in buckets.values()), buckets
    check_distributed_parity(functools.partial(_model, ToyLM, cfg, 2), cfg, 16, schedule)


@pytest.mark.slow
def test_moe_over_data_times_expert_parallel_ranks():
    """dp=2 x ep=2 on 4 ranks, ZeRO-0: dense gradients reduced over all four, each expert's over
    its replica pair; every replica compared."""
    cfg = ToyLMConfig(n_layers=1)
    check_distributed_parity(functools.partial(_model, ToyMoELM, cfg, 1), cfg, 16,
                             functools.partial(_schedule, "1f1b", 1, 2, 2, 4, 0))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_with_expert_parallelism_on_four_ranks(recipe):
    _check_parity(recipe, pp=2, ep=2, moe=True)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_on_two_ranks(recipe):
    _check_parity(recipe, pp=2, moe=True)


def test_only_a_ranks_last_backward_that_feeds_a_send_goes_input_gradients_first():
    """1F1B on 4 ranks: every rank but the first splits its last backward (BI, send, BW). With
    dp=2 (here ZeRO-2) the gradient reductions wait for that B on another stream: none is split."""
    from benchmarks._common import lm_config, lm_job
    from piper_plugin.compiler import compile_job
    from piper_plugin.scheduler.plan import build_plan

    cfg = lm_config(dim=32, layers=4, heads=2, ffn=64, seq=8, vocab=64)
    _, _, plan, _ = compile_job(lm_job(cfg, recipe="1f1b", pp=4, microbatches=4, batch=8))
    assert [sorted(rp.split_first) for rp in plan.ranks] == [[], ["1B3"], ["2B3"], ["3B3"]]
    program = compile_job(lm_job(cfg, recipe="1f1b", pp=2, microbatches=4, batch=8))[0]
    sch = apply_recipe(Schedule(program, pp=2, dp=2), "1f1b", microbatches=4, zero=2)
    plan = build_plan(sch.dag, sch.grid)
    assert all(not rp.split_first for rp in plan.ranks)


def test_the_comparison_sees_a_wrong_loss_gradient_or_parameter():
    """single_device_errors is what every parity test above asserts on: it must report a
    perturbed loss, gradient piece or parameter piece, naming where."""
    from benchmarks._common import lm_config, lm_job
    from piper_plugin.compiler import compile_job
    from piper_plugin.runtime.launch.processes import run_forked
    from benchmarks.parity_oracle import single_device_errors

    job = lm_job(lm_config(dim=16, layers=2, heads=2, ffn=32, seq=8, vocab=32), recipe="1f1b", pp=2,
                 microbatches=2, batch=4)
    job.steps, job.capture_grads = 2, True
    program, _, plan, _ = compile_job(job)
    metrics: list[dict] = []
    per_rank = run_forked(job, program, plan, on_metrics=metrics.append)
    assert single_device_errors(job, metrics, per_rank).worst() < 1e-5
    for m in metrics:
        if "loss" in m and m["step"] == 1:
            m["loss"] *= 1.01
    # a piece of the first step's gradients (as that step reported it) and of the final parameters
    grad_piece = next(m for m in metrics if m["step"] == 0 and m["rank"] == 0)["grad_pieces"][0]
    param_piece = per_rank[1]["param_pieces"][0]
    grad_piece.flat[0] += 1.0
    param_piece.flat[0] += 1.0
    errors = single_device_errors(job, metrics, per_rank)
    assert errors.loss > 1e-3 and errors.where["loss"].startswith("step 1")
    assert errors.grad > 1e-3 and errors.where["grad"] == f"step 0: {grad_piece.names[0].removeprefix('model.')}"
    assert errors.param > 1e-3 and errors.where["param"] == f"step 1: {param_piece.names[0].removeprefix('model.')}"


class Bf16Boundary(ToyLM):
    """:class:`ToyLM` whose first stage ends in a projection, so under bf16 autocast the
    activation sent to the next rank is bf16 (ToyLM's residual stream stays fp32)."""

    def __init__(self, cfg: ToyLMConfig, stages: int):
        super().__init__(cfg, stages)
        self.proj = torch.nn.Linear(cfg.dim, cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._stage(0):
            h = self.proj(self.layers[0](self.embed(tokens) + self.pos.weight[: tokens.size(1)]))
        with self._stage(1):
            return self.head(self.norm(self.layers[1](h)))


@pytest.mark.slow
@pytest.mark.parametrize("model,recipe,pp,dp,zero", [
    (Bf16Boundary, "1f1b", 2, 1, 0), (ToyLM, "dualpipev", 2, 1, 0), (ToyLM, "1f1b", 2, 2, 3)])
def test_bf16_autocast_equals_single_device_gradient_accumulation(model, recipe, pp, dp, zero):
    """Job(autocast=torch.bfloat16) runs every forward under CPU autocast; the reference is a
    plain loop under autocast accumulating the same microbatches (bf16 rounds each one's
    products). A run that ignored autocast would be off by ~1e-2 (fp32 against bf16)."""
    from piper_plugin.runtime.value_specs import probe_values
    from piper_plugin.models import lm_batch, lm_loss
    from benchmarks.parity_oracle import single_device_errors

    stages = stages_needed(recipe, pp)
    cfg = ToyLMConfig(n_layers=stages)
    model_fn = functools.partial(_model, model, cfg, stages)
    job, program, metrics, per_rank = check_distributed_parity(
        model_fn, cfg, 8 * dp, functools.partial(_schedule, recipe, pp, dp, 1, 4, zero), autocast=torch.bfloat16)
    if model is Bf16Boundary:  # the message crossing ranks is bf16, and sent as such
        tokens, target = lm_batch(cfg, 2)
        specs = probe_values(program, model_fn(), lm_loss, dict(zip(program.input_names, (tokens, target))),
                             autocast=torch.bfloat16)
        crossing = [v for r in program.regions.values() for v in r.inputs if v not in program.input_names]
        assert {specs[v].dtype for v in crossing} == {torch.bfloat16}, {v: specs[v].dtype for v in crossing}
    job.autocast = None  # the same run against fp32 training: autocast really ran
    assert single_device_errors(job, metrics, per_rank, accumulate=4 * dp).grad > 1e-3
