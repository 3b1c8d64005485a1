"""Megatron's tensor (and sequence) parallelism inside the stages, with the Piper engine running
the pipeline: the shipped entry with Megatron-LM's flags under both engines.

Forked gloo ranks (pipeline 2 x tensor 2, 4 ranks; 8 with data parallel 2), dropout off so both
engines see the same arithmetic: every iteration's loss and grad norm as Megatron-LM's log line
prints them must agree. A checkpoint the Piper engine saved at tp=2 resumes under Megatron's engine
with the iterations the Piper run logged. The argument checks: ``tests/test_bad_input.py`` and the
fast test here.
"""
from __future__ import annotations

import pickle
import re

import pytest

from forkserver_ranks import run_ranks
from test_megatron_entry import _rank  # a rank running the entry's pretrain, its log in the report
from piper_plugin.adapters.megatron.errors import ArgumentError
from piper_plugin.adapters.megatron.arguments import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--seed", "7", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")


def _iterations(world: int, argv: list[str], cache) -> tuple[dict[int, tuple[float, float]], str]:
    """iteration -> (lm loss, grad norm) from the one rank that reports (Megatron-LM's last rank),
    and every rank's log."""
    reports = run_ranks(_rank, world, world, argv, str(cache), timeout_s=300)
    errors = [r["error"] for r in reports.values() if "error" in r]
    assert not errors, errors[0]
    lines = {rank: {int(m[1]): (float(m[2]), float(m[3])) for m in _LINE.finditer(r["log"])}
             for rank, r in reports.items()}
    reporting = [v for _, v in sorted(lines.items()) if v]
    assert len(reporting) == 1, {rank: sorted(v) for rank, v in lines.items()}
    return reporting[0], "".join(r["log"] for _, r in sorted(reports.items()))


def _close(a: dict, b: dict, rel: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(x == pytest.approx(y, rel=rel, abs=0) for k in a for x, y in zip(a[k], b[k]))


def test_tensor_parallel_arguments_are_checked_before_any_rank_starts():
    base = ["--train-iters", "2", "--lr", "1e-3", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--pipeline-model-parallel-size", "2"]
    args = parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 8)
    assert args.data_parallel_size == 2
    with pytest.raises(ArgumentError, match=r"--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"):
        parse_args(base + ["--tensor-model-parallel-size", "3"], 6)
    with pytest.raises(ArgumentError, match=r"--pipeline-model-parallel-size 2 x --tensor-model-parallel-size 2 "
                                            r"does not divide the 6 ranks"):
        parse_args(base + ["--tensor-model-parallel-size", "2"], 6)
    with pytest.raises(ArgumentError, match=r"--sequence-parallel splits the sequence"):
        parse_args(base + ["--sequence-parallel"], 2)
    with pytest.raises(ArgumentError, match=r"does not divide --seq-length 31"):
        parse_args(base + ["--seq-length", "31", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4)
    with pytest.raises(ArgumentError, match=r"Megatron's MoE layers need --sequence-parallel"):
        parse_args(base + ["--tensor-model-parallel-size", "2", *MOE], 4)


@pytest.mark.slow
def test_pp2_tp2_sequence_parallel_1f1b_and_zb_h1_match_megatron_and_a_checkpoint_resumes_under_megatron(tmp_path):
    argv = BASE + ["--global-batch-size", "8", "--train-iters", "4"]
    megatron, _ = _iterations(4, argv + ["--pipeline-engine=megatron"], tmp_path)
    ckpt = tmp_path / "ckpt"
    piper, log = _iterations(4, argv + ["--pipeline-engine=piper", "--save", str(ckpt), "--save-interval", "2"],
                             tmp_path)
    assert "pipeline 2 x tensor 2 (sequence parallel) x data 1" in log, log
    assert sorted(piper) == [1, 2, 3, 4] and _close(piper, megatron), (piper, megatron)
    assert sorted(p.name for p in (ckpt / "iter_0000002").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    # ZB-H1 splits every backward into input and weight passes through SplitLinear's TP communication
    trace = tmp_path / "trace"
    split, _ = _iterations(4, argv + ["--pipeline-engine=piper", "--piper-recipe", "zb-h1", "--piper-trace",
                                      str(trace)], tmp_path)
    assert _close(split, megatron), (split, megatron)
    program = pickle.loads((trace / "program.pkl").read_bytes())  # the plan's stages split their backward
    assert {r.backward_splits for r in program.regions.values()} == {True}
    for rank in range(4):  # and every TP rank of both stages ran its weight passes
        assert re.search(r'"compute", "\dBW\d', (trace / f"rank{rank}.json").read_text()), rank
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # as if the Piper run had stopped there
    resumed, _ = _iterations(4, argv + ["--pipeline-engine=megatron", "--load", str(ckpt)], tmp_path)
    assert sorted(resumed) == [3, 4] and _close(resumed, {k: piper[k] for k in (3, 4)}), (resumed, piper)


@pytest.mark.slow
def test_pp2_tp2_interleaved_moe_matches_megatron(tmp_path):
    argv = BASE + MOE + ["--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                         "--train-iters", "3"]
    megatron, _ = _iterations(4, argv + ["--pipeline-engine=megatron"], tmp_path)
    piper, _ = _iterations(4, argv + ["--pipeline-engine=piper"], tmp_path)
    assert sorted(piper) == [1, 2, 3] and _close(piper, megatron), (piper, megatron)


@pytest.mark.slow
def test_pp2_tp2_dp2_piper_zero2_matches_megatron(tmp_path):
    """8 ranks: Piper's ZeRO-2 over the data-parallel pair of each TP coordinate's local shards
    against Megatron's DDP."""
    argv = BASE + ["--global-batch-size", "16", "--train-iters", "3"]
    megatron, _ = _iterations(8, argv + ["--pipeline-engine=megatron"], tmp_path)
    piper, _ = _iterations(8, argv + ["--pipeline-engine=piper", "--piper-zero", "2"], tmp_path)
    assert sorted(piper) == [1, 2, 3] and _close(piper, megatron), (piper, megatron)
