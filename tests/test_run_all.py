"""benchmarks.run_all: it lists every benchmark of the project, and its report reads the results
files' tables the way each benchmark writes them."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import run_all  # noqa: E402


def test_every_benchmark_with_a_command_line_is_run():
    with_main = set()
    for path in (ROOT / "benchmarks").glob("*.py"):
        tree = ast.parse(path.read_text())
        if path.stem != "run_all" and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            with_main.add(path.stem)
    assert with_main == {b.name for b in run_all.BENCHES}


def test_tables_and_ratios_read_the_benchmarks_own_columns():
    texts = {
        "pipelining_ab": "| schedule | ratio Piper/torch |\n|---|---|\n| 1f1b | **0.800** |\n",
        "torchtitan_ab": ("| schedule | engine | median tokens/s |\n|---|---|---|\n| 1F1B | torch | 100 |\n"
                          "| 1F1B | piper | 110 |\n"),
        "compile_ab": "| schedule | stages | piper / torch |\n|---|---|---|\n| 1F1B | eager | **1.103** |\n",
        "memory_check": "| schedule | rank | simulated KiB | measured KiB |\n|---|---|---|---|\n| 1f1b | 0 | 90 | 100 |\n",
        "tune_ab": ("| plan | median (ms) | median |\n|---|---|---|\n| gpipe pp=2 m=4 | 40.0 | **1.10** |\n\n"
                    "calibrate  1f1b pp=2 dp=1 m=2 zero=0: predicted 60.0 ms, measured 52.0 ms\n"),
        "ep_overlap": ("| engine | schedule | bubble measured | bubble simulated |\n|---|---|---|---|\n"
                       "| piper | DualPipeV | 50% | 30% |\n| torch | DualPipeV |  |  |\n"),
    }
    ratios = dict(run_all.host_ratios(texts))
    assert ratios["pipelining_ab: 1f1b"] == pytest.approx(1.25)  # a step time ratio, turned into throughput
    assert ratios["torchtitan_ab: 1F1B"] == pytest.approx(1.1)
    assert ratios["compile_ab: 1F1B eager"] == pytest.approx(1.103)
    assert run_all.memory_pairs(texts) == [("1f1b r0", 90.0, 100.0)]
    assert run_all.predictions(texts) == [("step 1f1b pp=2 dp=1 m=2 zero=0", 60.0, 52.0),
                                          ("step gpipe pp=2 m=4", pytest.approx(44.0), 40.0),
                                          ("bubble % DualPipeV", 30.0, 50.0)]


def test_a_benchmark_this_machine_cannot_run_is_listed_with_why(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "missing", lambda need: "no CUDA device here" if need == "cuda" else None)
    bench = next(b for b in run_all.BENCHES if b.name == "cuda_check")
    result = run_all.run(bench, tmp_path, timeout=5)
    assert result["status"] == "skipped: no CUDA device here" and "benchmarks.cuda_check" in result["command"]
