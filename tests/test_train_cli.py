"""`piper train`: real ranks learn, per-step lines, metrics file, measured trace, one-line errors.

Most tests use ``--launcher fork`` (2 ranks start in ~2 s). The two ``*_slow`` tests run the
console script in a subprocess with the default Ray launcher (~20 s: ray.init plus actors) and
under torchrun (``--launcher spmd``); deselect them with ``-k "not slow"``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from piper_plugin.cli import main

KEYS = {"step", "rank", "step_time_s", "tokens_per_s", "peak_memory_bytes", "transient_peak_bytes"}
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+(\S+)\s+step\s+([\d.]+) ms\s+([\d,]+) tokens/s\s+peak mem (.+)$")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_lines(out: str) -> list[re.Match]:
    return [m for m in map(STEP_LINE.match, out.splitlines()) if m]


def test_fork_1f1b_learns_and_reports_every_step(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--launcher", "fork", "--recipe", "1f1b", "--pp", "2", "--microbatches", "4",
                           "--steps", "10", "--metrics", str(metrics))
    assert code == 0, err
    rows = read_jsonl(metrics)
    assert len(rows) == 10 * 2  # steps x ranks
    assert {(r["step"], r["rank"]) for r in rows} == {(s, r) for s in range(10) for r in range(2)}
    for row in rows:
        assert KEYS <= row.keys()
        assert ("loss" in row) == (row["rank"] == 1)  # only the last stage holds the loss
        assert 0 < row["transient_peak_bytes"] < row["peak_memory_bytes"]  # activations come and go
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert losses[9] < losses[0]

    lines = step_lines(out)
    assert [int(m[1]) for m in lines] == list(range(1, 11)) and all(m[2] == "10" for m in lines)
    for m in lines:  # loss of the step; slowest rank's time; global tokens / slowest time
        reports = [r for r in rows if r["step"] == int(m[1]) - 1]
        assert float(m[3]) == pytest.approx(losses[int(m[1]) - 1], abs=1e-4)
        assert float(m[4]) == pytest.approx(max(r["step_time_s"] for r in reports) * 1e3, abs=0.06)
        tokens = int(m[5].replace(",", ""))
        assert tokens == pytest.approx(min(r["tokens_per_s"] for r in reports), abs=1)
        assert tokens == pytest.approx(8 * 32 / max(r["step_time_s"] for r in reports), abs=1)  # batch 8 x seq 32
    assert f"loss     {losses[0]:.4f} (step 1) -> {losses[9]:.4f} (step 10)" in out
    assert re.search(r"^step     median [\d.]+ ms", out, re.M)
    assert f"wrote    {metrics} (20 lines: steps x ranks)" in out


@pytest.mark.slow
def test_dp_zero_reports_all_ranks(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--launcher", "fork", "--pp", "2", "--dp", "2", "--zero", "2", "--nproc", "4",
                           "--steps", "2", "--metrics", str(metrics))
    assert code == 0, err
    rows = read_jsonl(metrics)
    assert len(rows) == 2 * 4
    last_stage = {r["rank"] for r in rows if "loss" in r}
    assert len(last_stage) == 2  # both data-parallel replicas of the last stage report the global loss
    assert len({r["loss"] for r in rows if r["step"] == 0 and "loss" in r}) == 1
    assert len(step_lines(out)) == 2 and "(4 ranks, fork)" in out


@pytest.mark.slow
def test_trace_writes_measured_trace_and_pictures(capsys, tmp_path):
    out_dir = tmp_path / "trace"
    code, out, err = train(capsys, "--launcher", "fork", "--steps", "2", "--trace", str(out_dir))
    assert code == 0, err
    trace = json.loads((out_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert min(e["ts"] for e in spans) == 0 and all(e["dur"] >= 0 for e in spans)
    assert {e["args"]["kind"] for e in spans} >= {"F", "B", "UPDATE", "SEND", "RECV"}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "compute" in threads and any(t.startswith("p2p") for t in threads)
    assert trace["otherData"]["source"].startswith("measured")
    for name in ("timeline.png", "simulated.png"):
        assert (out_dir / name).read_bytes()[:8] == PNG_MAGIC
    bubble = next(line for line in out.splitlines() if line.startswith("bubble"))
    measured = float(re.search(r"measured ([\d.]+)%", bubble)[1])
    assert 0 < measured < 100 and trace["otherData"]["bubble_fraction"] == pytest.approx(measured / 100, abs=6e-4)
    assert "simulated 20.0%" in bubble  # 1F1B, p=2, m=4
    lines = out.splitlines()
    calibrated = lines[lines.index(bubble) + 1]
    found = re.search(r"task times: bubble ([\d.]+)%, step ([\d.]+) ms vs ([\d.]+) ms measured", calibrated)
    assert found, calibrated
    assert 0 < float(found[1]) < 100 and float(found[3]) == pytest.approx(trace["otherData"]["step_time_s"] * 1e3, abs=0.06)


def test_failed_rank_prints_its_traceback(capsys, monkeypatch):
    from piper_plugin import training

    real = training.toy_job

    def toy_job(*args, **kwargs):  # ranks get this job by value, so the failure travels with it
        job = real(*args, **kwargs)
        build = job.model_fn

        def model_fn():
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() == 1:
                raise RuntimeError("injected failure")
            return build()

        job.model_fn = model_fn
        return job

    monkeypatch.setattr(training, "toy_job", toy_job)
    code, out, err = train(capsys, "--launcher", "fork", "--steps", "3")
    assert code == 1
    first, *rest = err.splitlines()
    assert first == "piper: error: rank 1 failed: RuntimeError('injected failure')"
    assert rest[0] == "--- original traceback of rank 1 ---" and rest[1].startswith("Traceback")
    assert rest[-1] == "RuntimeError: injected failure"


def _console(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([*argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_spmd_under_torchrun_slow(tmp_path):
    """SLOW (~12 s): every torchrun rank runs the command; rank 0 gathers and prints."""
    metrics = tmp_path / "m.jsonl"
    done = _console(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "piper_plugin.cli",
                    "train", "--launcher", "spmd", "--steps", "2", "--metrics", str(metrics), "--trace",
                    str(tmp_path / "t"), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(step_lines(done.stdout)) == 2 and done.stdout.count("train    ") == 1
    assert len(read_jsonl(metrics)) == 4
    assert (tmp_path / "t" / "timeline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_autocast_bf16_trains_as_a_plain_autocast_loop(capsys, tmp_path):
    """--autocast bf16: every step's loss equals a plain loop's under CPU autocast that
    accumulates the same 4 microbatches (bf16 rounds each microbatch's products)."""
    from benchmarks.parity_oracle import single_device_errors
    from piper_plugin.training import toy_job

    metrics = tmp_path / "m.jsonl"
    code, out, err = train(capsys, "--launcher", "fork", "--steps", "3", "--autocast", "bf16",
                           "--metrics", str(metrics))
    assert code == 0, err
    job = toy_job(None, stages=2, layers=2, batch=8, seq=32, steps=3, autocast=torch.bfloat16)
    errors = single_device_errors(job, read_jsonl(metrics), {}, accumulate=4)
    assert errors.loss < 1e-5, errors
