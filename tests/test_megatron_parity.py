"""Piper's drop-in ``get_forward_backward_func`` trains Megatron-Core's GPTModel exactly as
Megatron's own schedules do, and as single-device training does.

Each job trains the same model from the same weights on the same data under both engines
(:mod:`megatron_job`); a single-rank job without a pipeline is the single-device reference.
Compared per parameter: every gradient of the first iteration, every parameter after the last,
and the losses the last stage reports, within 1e-5 relative.
"""
from __future__ import annotations

import numpy as np
import pytest

from megatron_job import run_job

TOL = 1e-5


def _reports(world: int, **scenario) -> dict:
    reports = run_job(world, scenario)
    errors = [r["error"] for r in reports.values() if "error" in r]
    assert not errors, errors[0]
    return reports


def _merged(reports: dict, engine: str, what: str) -> dict[str, np.ndarray]:
    """A global-name -> array view over all ranks (a name on several ranks must agree there)."""
    merged: dict[str, np.ndarray] = {}
    for rank in sorted(reports):
        for name, value in reports[rank][engine][what].items():
            merged.setdefault(name, value)
    return merged


def _losses(reports: dict, engine: str, what: str = "losses") -> list:
    """Per iteration, the reports of the whole global batch: each pipeline's last stage reports
    its own microbatches (in rank order, which is data-parallel order)."""
    pipelines = [reports[rank][engine][what] for rank in sorted(reports) if reports[rank][engine][what]]
    return [[report for pipeline in pipelines for report in pipeline[step]] for step in range(len(pipelines[0]))]


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str, tol: float = TOL) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:5])
    worst = max(((float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-12)), n) for n in want))
    assert worst[0] <= tol, f"{what}: {worst[1]} differs by {worst[0]:.2e} relative"


def _loss_values(losses: list) -> np.ndarray:
    """Every reported loss of every iteration and microbatch, flattened (``lm loss`` reports)."""
    return np.array([v for step in losses for report in step for v in np.ravel(report["lm loss"])])


def _assert_same_training(reports: dict, engine: str, reference: dict, ref_engine: str) -> None:
    """Every gradient of the first iteration and every reported loss of every iteration within
    ``TOL``; within one job (same layout, same reduction order) also every parameter after the
    last iteration. Across layouts parameters are not compared: Adam divides each gradient by
    its running magnitude, so float rounding in near-zero gradients grows past ``TOL``."""
    _assert_close(_merged(reports, engine, "grads"), _merged(reference, ref_engine, "grads"), f"{engine} gradients")
    _assert_losses(_losses(reports, engine), _losses(reference, ref_engine))
    if reports is reference:  # the same trained weights: the evaluation pass reports the same losses
        _assert_losses(_losses(reports, engine, "eval"), _losses(reference, ref_engine, "eval"))
        _assert_close(_merged(reports, engine, "params"), _merged(reference, ref_engine, "params"),
                      f"{engine} parameters")


def _reference(microbatches: int, **scenario) -> dict:
    """Single-device training of the same model on the same global batch."""
    return _reports(1, pp=1, vpp=None, microbatches=microbatches, engines=("megatron",), **scenario)


def _assert_losses(got: list, want: list) -> None:
    a, b = _loss_values(got), _loss_values(want)
    assert a.shape == b.shape and np.allclose(a, b, rtol=TOL, atol=0), (a[:6], b[:6])


def test_1f1b_equals_megatron_and_single_device_training():
    reports = _reports(2, pp=2)
    _assert_same_training(reports, "piper", reports, "megatron")
    assert _losses(reports, "piper") == _losses(reports, "megatron")  # same order of ops: bitwise
    _assert_same_training(reports, "piper", _reference(4), "megatron")
    # the last stage's last backward sends its input gradient before its weight pass (its
    # linear layers split: .linear); the first stage's has nobody to send to
    assert [reports[r]["piper"]["split"] for r in sorted(reports)] == [[], ["1B3"]]
    # every forward step ran under one CPU-layer mode, as under Megatron's engine (two would run
    # each torch call through it twice)
    assert {e: [reports[r][e]["cpu_modes"] for r in sorted(reports)] for e in ("piper", "megatron")} == \
        {"piper": [[1], [1]], "megatron": [[1], [1]]}


@pytest.mark.slow
def test_interleaved_is_right_where_megatrons_batched_p2p_is_not():
    """Megatron's interleaved schedule with its default ``batch_p2p_comm=True`` trains to other
    numbers on gloo at pp=2 (both neighbours are one peer); with ``False`` it is exact. Piper's
    interleaved plan equals single-device training either way."""
    reference = _reference(4)
    for batched in (False, True):
        reports = _reports(2, pp=2, vpp=2, batch_p2p_comm=batched)
        _assert_same_training(reports, "piper", reference, "megatron")
        if not batched:
            _assert_same_training(reports, "megatron", reference, "megatron")
        else:  # Megatron's own numbers move: a gradient or a loss beyond TOL
            grads = _merged(reports, "megatron", "grads")
            want = _merged(reference, "megatron", "grads")
            worst = max(float(np.abs(grads[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-12)) for n in want)
            a, b = _loss_values(_losses(reports, "megatron")), _loss_values(_losses(reference, "megatron"))
            assert worst > TOL or a.shape != b.shape or not np.allclose(a, b, rtol=TOL, atol=0), worst


@pytest.mark.slow
def test_moe_with_aux_loss_and_legacy_loss_tuple():
    """Routed experts with the load-balancing loss (its backward scale is the schedule's to set),
    and a loss function returning (loss, report), averaged over microbatches."""
    reports = _reports(2, pp=2, moe=True, loss_tuple=2)
    _assert_same_training(reports, "piper", reports, "megatron")
    reference = _reference(4, moe=True, loss_tuple=2)
    _assert_same_training(reports, "piper", reference, "megatron")


@pytest.mark.slow
def test_data_parallel_pipelines_with_the_distributed_optimizer():
    """pp=2 x dp=2, Megatron's DDP and distributed optimizer (ZeRO-1) around Piper's pipeline."""
    reports = _reports(4, pp=2, distributed_optimizer=True)
    _assert_close(_merged(reports, "piper", "params"), _merged(reports, "megatron", "params"), "parameters")
    assert _losses(reports, "piper") == _losses(reports, "megatron")
    _assert_losses(_losses(reports, "piper"), _losses(_reference(8), "megatron"))


@pytest.mark.slow
def test_piper_zero3_in_place_of_megatrons_ddp():
    """pp=2 x dp=2, interleaved, with Piper's ZeRO-3 over the data-parallel ranks instead of
    Megatron's DDP: Megatron's optimizer steps DTensor faces of each rank's rows and the tied
    embedding is reduced by Megatron's ``finalize_model_grads``; every first-iteration gradient
    and every loss as single-device training (against Megatron's engine with its DDP:
    ``test_megatron_entry``). Each rank keeps half the parameter rows between steps and no
    whole parameter."""
    zeroed = _reports(4, zero=3, engines=("piper",), pp=2, vpp=2, layers=4)
    _assert_same_training(zeroed, "piper", _reference(8), "megatron")
    for rank, report in zeroed.items():
        kept = report["zero"]
        assert kept["rows"] <= kept["numel"] // 2 + 64 * 4, (rank, kept)  # ceil(rows / 2) of each parameter
        assert not kept["whole_resident"], rank


@pytest.mark.slow
def test_overlapped_gradient_reduction_starts_once_per_chunk():
    """``overlap_grad_reduce``: each chunk's reduction starts after its last backward on the rank,
    and ``finalize_model_grads`` waits for it (a second start would double the gradients)."""
    reports = _reports(4, pp=2, overlap_grad_reduce=True, steps=2)
    _assert_same_training(reports, "piper", reports, "megatron")


@pytest.mark.slow
def test_four_stages_and_zero_bubble_recipes():
    reports = _reports(4, pp=4, engines=("megatron", "piper", "piper:zb-h1", "piper:gpipe"), steps=2)
    for engine in ("piper", "piper:zb-h1", "piper:gpipe"):
        _assert_same_training(reports, engine, reports, "megatron")
    # ZB-H1's weight passes run apart from their input passes (Megatron's linears split: .linear):
    # rank r holds back its first r of them, so every rank but the first runs split backwards
    held_back = [len(reports[r]["piper:zb-h1"]["split"]) for r in sorted(reports)]
    assert held_back[0] == 0 and all(n > 0 for n in held_back[1:]), held_back


@pytest.mark.slow
def test_dualpipev_with_stages_built_in_its_v_equals_single_device_training():
    """DualPipeV's V (rank 0 holds the first and last stages): each stage built as a model of its
    own by the shipped entry's builder, marked with its stage; MoE with the aux loss; the output
    layer tied to the embedding (Megatron's default), so rank 0 holds both copies: the builder
    makes them equal, each step gives both the summed gradient (the embedding's gradient equals
    the single-device model's one tied weight's), the gradient norm counts the weight once (the
    clipped second step's losses agree), and the copies stay equal."""
    scenario = dict(pp=2, layout="v", tied=True, moe=True, engines=("piper:dualpipev",), steps=2)
    reports = _reports(2, **scenario)
    reference = _reference(4, **{k: v for k, v in scenario.items() if k not in ("pp", "layout", "engines")})
    _assert_same_training(reports, "piper:dualpipev", reference, "megatron")
    norms = [report["piper:dualpipev"]["grad_norms"] for report in reports.values()]
    assert norms[0] == norms[1] and np.allclose(norms[0], reference[0]["megatron"]["grad_norms"], rtol=TOL, atol=0), \
        (norms, reference[0]["megatron"]["grad_norms"])
    assert reports[0]["tied_at_start"] and reports[0]["tied_after"], reports[0].get("tied_at_start")
    assert "tied_at_start" not in reports[1]  # the middle stages' rank holds neither copy


@pytest.mark.slow
def test_dualpipev_with_tied_embeddings_under_piper_zero3():
    """The V over pp 2 x dp 2 with Piper's ZeRO-3: the tied copies are DTensor faces of each
    rank's rows, made after the build; their gradients are summed row by row on both
    data-parallel replicas of the rank holding them."""
    scenario = dict(pp=2, layout="v", tied=True, zero=3, engines=("piper:dualpipev",), steps=2)
    reports = _reports(4, **scenario)
    _assert_same_training(reports, "piper:dualpipev", _reference(8, tied=True, steps=2), "megatron")
    holders = sorted(rank for rank, report in reports.items() if "tied_at_start" in report)
    assert len(holders) == 2 and all(reports[r]["tied_at_start"] and reports[r]["tied_after"] for r in holders)
