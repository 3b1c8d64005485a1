"""The shipped Megatron-style entry, ``piper_plugin.adapters.megatron.pretrain_gpt``, end to end:
the same job under ``--pipeline-engine=megatron`` and ``=piper`` logs the same losses; a run
saved at iteration 5 and loaded again logs iterations 6-10 as the uninterrupted run did; bad
arguments end in one ``piper: error:`` line before any rank starts (the catalogue: ``test_bad_input.py``).

Ranks are forked gloo processes calling the entry's ``pretrain`` (what ``torchrun -m`` runs);
one test runs the issue's own ``torchrun`` command.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forkserver_ranks import run_ranks

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--seed", "7"]


def _rank(rank: int, port: int, world: int, argv: list[str], cache: str, out) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "PIPER_CACHE": cache,
                       "OMP_NUM_THREADS": "1"})
    import contextlib
    import io

    log = io.StringIO()
    try:
        from piper_plugin.adapters.megatron.pretrain_gpt import pretrain

        with contextlib.redirect_stdout(log):
            report = {"losses": pretrain(argv), "validation": _validation(log.getvalue()), "log": log.getvalue()}
    except BaseException as exc:  # noqa: BLE001 - the test shows the rank's error
        import traceback

        report = {"error": f"rank {rank}: {exc!r}\n{traceback.format_exc()}"}
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out.put((rank, report))


def _validation(log: str) -> dict[str, float]:
    """Megatron-LM's ``validation loss at <where> | lm loss value: <v> | ...`` lines, by where."""
    import re

    return {m[1]: float(m[2]) for m in re.finditer(r" validation loss at (.*?) \| lm loss value: (\S+) \|", log)}


def _losses(world: int, argv: list[str], cache) -> list[float]:
    return _run(world, argv, cache)[0]


def _run(world: int, argv: list[str], cache) -> tuple[list[float], dict[str, float]]:
    """The losses and the validation results the reporting rank logs."""
    reports = run_ranks(_rank, world, world, argv, str(cache), timeout_s=300)
    errors = [r["error"] for r in reports.values() if "error" in r]
    assert not errors, errors[0]
    holders = [r for _, r in sorted(reports.items()) if r["losses"]]  # the last stage's ranks
    return holders[-1]["losses"], holders[-1]["validation"]


def _both(world: int, argv: list[str], cache) -> tuple[list[float], list[float]]:
    return (_losses(world, argv + ["--pipeline-engine=megatron"], cache),
            _losses(world, argv + ["--pipeline-engine=piper"], cache))


@pytest.mark.slow
def test_piper_engine_logs_megatrons_losses_1f1b(tmp_path):
    megatron, piper = _both(2, BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                       "--train-iters", "4"], tmp_path)
    assert len(piper) == 4 and piper == megatron  # dropout 0.1 included: same order of forwards per stage
    assert piper[-1] < piper[0]


@pytest.mark.slow
def test_piper_engine_interleaved(tmp_path):
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    megatron, piper = _both(2, BASE + no_dropout + ["--pipeline-model-parallel-size", "2",
                                                    "--virtual-pipeline-model-parallel-size", "2",
                                                    "--global-batch-size", "8", "--train-iters", "3"], tmp_path)
    assert piper == pytest.approx(megatron, rel=1e-5, abs=0)


@pytest.mark.slow
def test_uneven_layer_split_and_experts_over_data_parallel_ranks(tmp_path):
    """5 layers on 2 stages (Megatron's --decoder-first-pipeline-num-layers), experts split over
    2 data-parallel ranks (pp 2 x dp 2, their all-to-all inside each stage's forward), and
    Piper's ZeRO-2 with experts split over 2 of 4 data-parallel ranks."""
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    megatron, piper = _both(2, BASE + no_dropout + ["--num-layers", "5", "--decoder-first-pipeline-num-layers", "3",
                                                    "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                                    "--train-iters", "3"], tmp_path)
    assert piper == pytest.approx(megatron, rel=1e-5, abs=0)
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
           "--moe-aux-loss-coeff", "0.01"]
    megatron, piper = _both(4, BASE + no_dropout + moe + ["--pipeline-model-parallel-size", "2",
                                                          "--global-batch-size", "8", "--train-iters", "3"], tmp_path)
    assert piper == pytest.approx(megatron, rel=1e-5, abs=0)
    # dp 4 over 2 expert ranks: each expert has 2 replicas, which Piper's ZeRO leaves out of its
    # buckets and ZeroChunk sums over Megatron's expert-data-parallel group (as its DDP does)
    replicated = BASE + no_dropout + moe + ["--pipeline-model-parallel-size", "1", "--num-layers", "2",
                                            "--global-batch-size", "16", "--train-iters", "3"]
    megatron = _losses(4, replicated + ["--pipeline-engine=megatron"], tmp_path)
    zero = _losses(4, replicated + ["--pipeline-engine=piper", "--piper-zero", "2"], tmp_path)
    assert zero == pytest.approx(megatron, rel=1e-5, abs=0)


@pytest.mark.slow
def test_save_then_load_reproduces_the_uninterrupted_run(tmp_path):
    """``--save`` at iteration 5, ``--load`` then logs iterations 6-10 as the run that went on
    did (pp 2 x dp 2, distributed optimizer, LR decaying, gradients clipped, experts split over the
    data-parallel ranks: each expert rank saves and loads its own experts); the run that went on
    logs Megatron's own engine's losses. ``--clip-grad 0.01`` is far below the gradients' norm and
    a large ``--adam-eps`` makes Adam's update follow the gradient, so the clip shows in the losses
    (at 8151177 a run without it differed by more than 0.1%): a clip the Piper engine ignored
    would fail the comparison. Megatron-LM's evaluation (``--eval-interval 5 --eval-iters 1``, the
    documents split 969,30,1): every validation and test result as Megatron's engine logs it, and
    the resumed run's (its validation batches continue after the ones iteration 5 read) as the
    uninterrupted run's."""
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.01", "--adam-eps", "1.0",
                   "--lr", "0.5", "--lr-decay-iters", "10",  # the schedule of the 10-iteration run in all four
                   "--eval-interval", "5", "--eval-iters", "1",
                   "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    megatron, megatron_eval = _run(4, argv + ["--train-iters", "10", "--pipeline-engine=megatron"], tmp_path)
    argv.append("--pipeline-engine=piper")
    whole, whole_eval = _run(4, argv + ["--train-iters", "10"], tmp_path)
    assert whole == pytest.approx(megatron, rel=1e-5, abs=0)
    assert list(whole_eval) == ["iteration 5", "iteration 10", "iteration 10 on validation set",
                                "iteration 10 on test set"]
    assert whole_eval == pytest.approx(megatron_eval, rel=1e-5, abs=0)
    ckpt = tmp_path / "ckpt"
    first = _losses(4, argv + ["--train-iters", "5", "--save", str(ckpt), "--save-interval", "5"], tmp_path)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    rest, rest_eval = _run(4, argv + ["--train-iters", "10", "--load", str(ckpt)], tmp_path)
    assert first == whole[:5]
    assert rest == pytest.approx(whole[5:], rel=1e-6, abs=0)
    assert rest_eval == pytest.approx({k: v for k, v in whole_eval.items() if k != "iteration 5"}, rel=1e-6, abs=0)


@pytest.mark.slow
def test_piper_zero_trains_as_megatrons_ddp_and_resumes_at_another_level(tmp_path):
    """``--piper-zero 2`` (pp 2 x dp 2, dropout on, experts split over the data-parallel ranks)
    logs Megatron's losses and saves the model whole in Megatron's layout; ``--piper-zero 3``
    loads that checkpoint (each rank's optimizer rows) and logs iterations 4-6 as Megatron's
    uninterrupted run; the final models agree per parameter, each expert rank's folder with
    Megatron's."""
    import torch

    argv = BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--lr-decay-iters", "6",
                   "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    megatron = _losses(4, argv + ["--train-iters", "6", "--save", str(tmp_path / "megatron")], tmp_path)
    first = _losses(4, argv + ["--pipeline-engine=piper", "--piper-zero", "2", "--train-iters", "3",
                               "--save", str(tmp_path / "zero")], tmp_path)
    rest = _losses(4, argv + ["--pipeline-engine=piper", "--piper-zero", "3", "--train-iters", "6",
                              "--load", str(tmp_path / "zero"), "--save", str(tmp_path / "zero")], tmp_path)
    assert first + rest == pytest.approx(megatron, rel=1e-5, abs=0)
    folders = sorted(p.name for p in (tmp_path / "megatron" / "iter_0000006").iterdir())
    assert folders == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    for folder in folders:
        want, got = (torch.load(tmp_path / run / "iter_0000006" / folder / "model_optim_rng.pt",
                                weights_only=False)["model"] for run in ("megatron", "zero"))
        assert want.keys() == got.keys()
        for name, value in want.items():
            if isinstance(value, torch.Tensor):  # Adam grows 1e-7 rounding (ZeRO sums per microbatch) near zero
                assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_the_entry_says_one_line_and_exits_2_without_a_traceback():
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "piper_plugin.adapters.megatron.pretrain_gpt", *BASE,
                           "--train-iters", "2", "--pipeline-model-parallel-size", "3"],
                          capture_output=True, text=True, env=env, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("piper: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--pipeline-model-parallel-size 3" in errors[0]


@pytest.mark.slow
def test_dualpipev_builds_its_v_with_tied_or_untied_embeddings(tmp_path):
    """The V puts the first and last stages on rank 0, which holds both copies of a tied
    embedding (exactness: ``test_megatron_parity``); untied, each its own weight. Its checkpoint
    holds the V's stages: loading it under Megatron's layout is refused, naming the recipe."""
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                   "--global-batch-size", "8", "--train-iters", "4", "--pipeline-engine=piper"]
    ckpt = ["--save", str(tmp_path / "ckpt")]
    for untie in ([], ["--untie-embeddings-and-output-weights"]):
        losses = _losses(2, argv + ["--piper-recipe", "dualpipev"] + untie + (ckpt if untie else []), tmp_path)
        assert len(losses) == 4 and losses[-1] < losses[0], (untie, losses)
    reports = run_ranks(_rank, 2, 2, argv + ["--untie-embeddings-and-output-weights", "--train-iters", "6", "--load",
                                             str(tmp_path / "ckpt")], str(tmp_path), timeout_s=300)
    want = {0: "were saved as stages [0, 3], but this run builds stages [0, 2]",
            1: "were saved as stages [1, 2], but this run builds stages [1, 3]"}
    assert all(want[rank] in r.get("error", "") for rank, r in reports.items()), reports


def test_a_tied_embedding_needs_the_first_and_last_stages_on_one_rank():
    from piper_plugin.adapters.megatron import ArgumentError
    from piper_plugin.adapters.megatron.tied import check_tied_layout

    check_tied_layout("dualpipev", {0: 0, 1: 1, 2: 1, 3: 0})
    with pytest.raises(ArgumentError, match="--piper-recipe my_plan.json puts the first and last stages on "
                                            "pipeline ranks 0 and 1.*--untie-embeddings-and-output-weights"):
        check_tied_layout("my_plan.json", {0: 0, 1: 1, 2: 0, 3: 1})


@pytest.mark.slow
def test_activation_recomputation_flags_log_megatrons_losses(tmp_path):
    """Megatron-LM's ``--recompute-granularity full --recompute-method uniform`` under both
    engines (1F1B, pp 2): the same losses (``selective`` gave the same at 4a770ca, checked by
    hand: one row keeps the suite's time)."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    megatron, piper = _both(2, BASE + no_dropout + recompute + ["--pipeline-model-parallel-size", "2",
                                                                "--global-batch-size", "8", "--train-iters", "3"],
                            tmp_path)
    assert len(piper) == 3 and piper == pytest.approx(megatron, rel=1e-5, abs=0)
