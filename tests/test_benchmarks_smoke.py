"""Smoke runs of the benchmarks at tiny sizes: each main runs, prints its command and writes
its table with one row per configuration (the published figures come from the defaults)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``benchmarks`` lives at the repo root

from benchmarks import cuda_check, memory_check, pipelining_ab, task_overhead  # noqa: E402
import pytest

TINY_LM = ["--dim", "32", "--layers", "4", "--heads", "4", "--ffn", "64", "--vocab", "64", "--seq", "8",
           "--batch", "8", "--microbatches", "4"]


def _tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text``, as rows of cells (header and rule left out)."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            tables.append(block[2:])
            block = []
    return tables


def _table_rows(text: str) -> list[list[str]]:
    return _tables(text)[0]


@pytest.mark.slow
def test_pipelining_ab_smoke(tmp_path, capsys):
    out = tmp_path / "ab.md"
    summary = pipelining_ab.main(TINY_LM + ["--rounds", "1", "--warmup", "0", "--steps", "2", "--quiet-wait", "0",
                                           "--split-reps", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("python -m benchmarks.pipelining_ab ")
    text = out.read_text()
    assert "Command: `python -m benchmarks.pipelining_ab" in text
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["gpipe", "1f1b", "interleaved-1f1b", "dualpipev"]
    assert [r[1] for r in rows] == ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleDualPipeV"]
    split = _tables(text)[1]  # the cost of a split backward, three ways
    assert [r[0].split()[0] for r in split] == ["one", "Piper", "torch"]
    for recipe, s in summary.items():
        assert 0 < s["piper_min_s"] <= s["piper_s"] and 0 < s["torch_min_s"] <= s["torch_s"], recipe
        # same weights, same data: both engines see the same loss at every step (the second after an update)
        assert abs(s["piper_loss"] - s["torch_loss"]) <= 1e-5 * abs(s["torch_loss"]), recipe
        assert s["loss_steps"] == 2 and s["loss_gap"] <= 1e-5 * abs(s["torch_loss"]), (recipe, s["loss_gap"])


def test_pipelining_ab_pairs_steps_by_alternation_cycle():
    # each engine runs twice per cycle: steps (0, 1), (2, 3) pair up; an odd warm-up shifts them
    assert pipelining_ab.cycle_ratios([1, 1, 3, 1, 9], [2, 2, 2, 2, 9], warmup=0) == [0.5, 1.0]
    assert pipelining_ab.cycle_ratios([5, 1, 1, 3, 1], [9, 2, 2, 2, 2], warmup=1) == [0.5, 1.0]


@pytest.mark.slow
def test_task_overhead_smoke(tmp_path, capsys):
    out = tmp_path / "overhead.md"
    rows = task_overhead.main(["--microbatches", "4", "--warmup", "1", "--steps", "2",
                               "--round-trips", "1", "--quiet-wait", "0", "--out", str(out)])
    assert capsys.readouterr().out.startswith("python -m benchmarks.task_overhead ")
    table = _table_rows(out.read_text())
    assert [r[0] for r in table] == list(task_overhead.CONFIGS)
    assert all(int(r[1]) == row["tasks"] for r, row in zip(table, rows))
    for r in rows:  # every task of the plan is one of its kinds, and each timing is a step's
        assert sum(r["kinds"].values()) == r["tasks"]
    for r, row in zip(table, rows):  # the overhead columns are the ranks' own measurements
        assert r[5] == f"**{row['runtime'] * 1e6:.0f}** / **{row['runtime_best'] * 1e6:.0f}**"
        assert r[6] == f"**{row['runtime_cpu'] * 1e6:.0f}**"
    # 1 rank, 8 stages, 4 microbatches: F and B per stage and microbatch, one UPDATE per stage;
    # 2 ranks of one stage: a send and a receive per microbatch besides
    assert rows[0]["kinds"] == {"F": 32, "B": 32, "UPDATE": 8}
    assert rows[1]["kinds"] == {"F": 4, "B": 4, "SEND": 4, "RECV": 4, "UPDATE": 1}


@pytest.mark.slow
def test_memory_check_smoke(tmp_path, capsys):
    out = tmp_path / "memory.md"
    rows = memory_check.main(TINY_LM + ["--steps", "1", "--out", str(out)])
    assert capsys.readouterr().out.startswith("python -m benchmarks.memory_check ")
    table = _table_rows(out.read_text())
    expected = [(recipe, str(rank)) for recipe in memory_check.RECIPES for rank in range(2)]
    assert [(r[0], r[1]) for r in table] == expected
    for r in rows:  # byte counts, not timings: deterministic (this tiny model: 0.91-1.01)
        assert 0.85 < r["sim"] / r["measured"] < 1.15 and 0.85 < r["sim_fixed"] / r["measured_fixed"] < 1.15, r
    assert "goal: within 10%" in out.read_text()


@pytest.mark.slow
def test_torchtitan_ab_smoke(tmp_path, capsys):
    """One schedule, one run of the real torchtitan.train alternating the engines (~40 s)."""
    import pytest

    pytest.importorskip("torchtitan")
    from benchmarks import torchtitan_ab

    out = tmp_path / "titan_ab.md"
    summary = torchtitan_ab.main(["--schedules", "1F1B", "--rounds", "1", "--steps", "8", "--warmup", "0",
                                  "--seq", "32", "--batch", "2", "--out", str(out)])
    assert capsys.readouterr().out.startswith("python -m benchmarks.torchtitan_ab ")
    text = out.read_text()
    assert "Command: `python -m benchmarks.torchtitan_ab" in text
    runs, ratios = _tables(text)
    assert [(r[0], r[1]) for r in runs] == [("1F1B", "torch"), ("1F1B", "piper")]
    assert [r[0] for r in ratios] == ["1F1B"]
    s = summary["1F1B"]
    assert s["ratio"] == pytest.approx(s["piper_tps"] / s["torch_tps"]) and s["torch_tps"] > 0
    for engine in ("torch", "piper"):  # a measured peak for each of the two ranks
        assert sorted(s[f"{engine}_mem"]) == [0, 1] and all(m > 2 ** 20 for m in s[f"{engine}_mem"].values())
    assert s["cycles"] == 2 and s["cycle_ratio"] > 0  # steps 1-8 hold two torch-piper-piper-torch cycles
    assert len(s["run_ratios"]) == 1 and s["run_ratio"] == s["run_ratios"][0] > 0
    # one trajectory through both engines: after 8 steps the loss is below the untrained debug
    # model's (~8.1 at step 1 in every run here)
    assert 0 < s["loss"] < 8.0, s["loss"]


def test_zero_memory_reads_peaks_and_caps(capsys):
    """The figures ``benchmarks.zero_memory`` reports, from TorchTitan step lines (its full run
    starts 6 engines x batches TorchTitan jobs: too long for the suite)."""
    pytest.importorskip("torchtitan")
    from benchmarks import zero_memory

    log = ("step:  2  loss:  7.5  grad_norm:  1.5  memory:  0.95GiB(4.0%)  tps: 72\n"
           "step:  3  loss:  7.1  grad_norm:  1.6  memory:  1.01GiB(4.3%)  tps: 72\n"
           "step:  3  loss: -2.0  grad_norm:  1.6  memory:  1.04GiB(4.4%)  tps: 70\n")
    assert zero_memory.peak_memory_gib(log, 3) == 1.04 and zero_memory.peak_memory_gib(log, 4) is None
    assert zero_memory.largest_under({4: 1.0, 8: 1.2, 16: None}, 1.1) == 4
    assert zero_memory.largest_under({4: 1.3}, 1.1) == 0
    args = zero_memory.build_parser().parse_args(["--batches", "4", "8"])
    assert args.batches == [4, 8] and args.models == ["llama3_widemodel", "llama3_debugmodel"]
    steps = ("[titan] 2026-12-02 01:00:00,000 - root - INFO - step:  1  loss: 9\n"
             "[titan] 2026-12-02 01:00:10,500 - root - INFO - step:  2  loss: 8\n"
             "[titan] 2026-12-02 01:00:11,000 - root - INFO - step:  2  loss: 8\n"  # the last rank's line counts
             "[titan] 2026-12-02 01:00:23,000 - root - INFO - step:  3  loss: 7\n")
    assert zero_memory.step_seconds(steps) == [11.0, 12.0]  # steps 2 and 3
    split = ("Piper memory split: rank 0 step 3 params 0.1000GiB grads 0.1000GiB optimizer 0.2000GiB start-up 0.5000GiB "
             "peak 1.2000GiB transient 0.3000GiB\n"
             "Piper memory split: rank 1 step 3 params 0.2000GiB grads 0.2000GiB optimizer 0.4000GiB start-up 0.5000GiB "
             "peak 1.5000GiB transient 0.2000GiB\n")
    assert zero_memory.memory_split(split, 3) == (0.2, 0.2, 0.4, 0.2) and zero_memory.memory_split(split, 2) is None
    with pytest.raises(SystemExit) as exit_:
        zero_memory.main(["--batches", "6"])
    assert exit_.value.code == 2
    assert "--batches: every local batch must be a multiple of 4" in capsys.readouterr().err


def test_zero_memory_compares_the_simulator_with_the_tensors_at_peak():
    """The lines the adapter logs (the simulator's memory per rank, the measured split with the
    tensors at the peak) are the ones ``zero_memory`` reads: the ratio on the rank where the two
    differ most."""
    from types import SimpleNamespace

    from benchmarks import zero_memory
    from piper_plugin.adapters.torchtitan.resident import simulated_memory_line, split_line

    g = 2**30
    result = SimpleNamespace(static_bytes=[{"params": g, "grads": g, "optimizer": 2 * g}] * 2,
                             peak_transient_bytes=[g, g // 2], per_rank_peak=[5 * g, int(4.5 * g)])
    held = {"params": g, "grads": g, "optimizer": 2 * g}
    log = "\n".join([simulated_memory_line(0, 1, result), simulated_memory_line(1, 0, result),
                     split_line(0, 3, held, g, 7 * g, 2 * g), split_line(1, 3, held, g, 8 * g, 2 * g),
                     split_line(1, 2, held, g, 9 * g, 2 * g)])
    # rank 0 (plan rank 1): 4.5 / 5; rank 1 (plan rank 0): 5 / 6, the farther from 1
    assert zero_memory.simulated_over_measured(log, 3) == pytest.approx(5 / 6, rel=1e-3)
    assert zero_memory.simulated_over_measured(log, 4) is None


@pytest.mark.slow
def test_cuda_check_smoke(tmp_path, capsys):
    """The GPU session's script, on gloo: the two-stream rank, a pipeline and ZeRO-3 against one
    device, their timelines, memory against the simulator, the overlap A/B; its exit code
    follows its verdicts."""
    out = tmp_path / "cuda.md"
    code = cuda_check.main(["--device", "cpu", "--steps", "3", "--rounds", "1", "--cases", "1f1b-pp2", "zero3-dp2",
                            "--out", str(out)])
    text = out.read_text()
    assert "Command: `python -m benchmarks.cuda_check --device cpu" in text
    parity, memory = _tables(text)
    assert [(r[0], r[1]) for r in parity] == [("zb-h1 1 rank, BW stream", "compute + wgrad"), ("1f1b 1 rank", "compute"),
                                              ("1f1b-pp2", "compute + p2p:0>1 + p2p:1>0"), ("zero3-dp2", "compute + dp")]
    assert all(float(cell) < 1e-5 for row in parity for cell in row[2:5])
    assert [(r[0], r[1]) for r in memory] == [("zb-h1 1 rank, BW stream", "0"), ("1f1b 1 rank", "0"), ("1f1b-pp2", "0"),
                                              ("1f1b-pp2", "1"), ("zero3-dp2", "0"), ("zero3-dp2", "1")]
    assert all(0 < float(r[2]) < float(r[5]) and 0 < float(r[3]) < float(r[6]) for r in memory)
    assert "own comm stream / one stream" in text and "Piper's step / a plain PyTorch step" in text
    verdicts = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 4 * 3 + 1 and all(v.endswith(("holds", "FAILS")) for v in verdicts)
    assert all(v.endswith("holds") for v in verdicts if v.startswith("- timeline"))  # host time here
    bubbles = [[float(b.rstrip("%")) for b in row[6].split(" / ")] for row in parity]
    assert all(len(b) == 3 and all(0 <= x < 100 for x in b) for b in bubbles)
    assert code == (1 if any(v.endswith("FAILS") for v in verdicts) else 0)


@pytest.mark.slow
def test_float8_check_smoke(tmp_path):
    """torchao's float8 linears (emulated on a CPU) under 1F1B on one rank and DualPipeV on two
    match plain float8 training, step one to the last bit of fp32; the exit code follows."""
    pytest.importorskip("torchao.float8")
    from benchmarks import float8_check

    out = tmp_path / "f8.md"
    code = float8_check.main(["--device", "cpu", "--emulate", "--steps", "3", "--cases", "1f1b 1 rank",
                              "dualpipev 2 ranks", "--out", str(out)])
    text = out.read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| 1f1b", "| dualpipev"))]
    assert [r[0].strip("| ") for r in rows] == ["1f1b 1 rank", "dualpipev 2 ranks"], text
    assert all(float(r[2]) < 1e-5 and float(r[3]) < 1e-5 for r in rows), text  # first step: loss, gradients
    floors = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| plain")}
    assert set(floors["plain float8, run twice"].split(" | ")[1].split()) == {"0.0e+00"}  # a CPU repeats itself
    assert "Piper float8 / plain PyTorch float8" in text
    verdicts = [line for line in text.splitlines() if line.startswith("- parity")]
    assert len(verdicts) == 4 and code == (1 if any(v.endswith("FAILS") for v in verdicts) else 0)


def test_cuda_check_flags_a_timeline_no_stream_could_run():
    """Posted messages may overlap; compute tasks of one stream may not, and no rank's span may
    exceed the step (what misplaced timing events on a GPU would show)."""
    class _Plan:
        def node(self, key):
            return SimpleNamespace(is_compute=not key.startswith("RECV"))

    good = [("compute", "F0", 0.0, 1.0), ("compute", "F1", 1.0, 2.0), ("p2p", "RECV0", 0.5, 3.0),
            ("p2p", "RECV1", 0.6, 3.0)]
    assert cuda_check._timeline_faults(_Plan(), {0: good}, 3.0) == []
    bad = [("compute", "F0", 0.0, 1.0), ("compute", "F1", 0.5, 2.0)]
    faults = cuda_check._timeline_faults(_Plan(), {0: bad}, 1.0)
    assert faults == ["rank 0 compute: F1 starts 500.000 ms before F0 ends",
                      "rank 0: timeline spans 2000.0 ms, the step took 1000.0 ms"]


@pytest.mark.slow
def test_megatron_ab_smoke(tmp_path, capsys):
    """Megatron-Core's engine against Piper's drop-in, alternating in one set of ranks."""
    from benchmarks import megatron_ab

    out = tmp_path / "megatron.md"
    megatron_ab.main(["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--rounds", "1",
                      "--warmup", "1", "--steps", "2", "--quiet-wait", "0", "--out", str(out)])
    text = out.read_text()
    assert "Command: `python -m benchmarks.megatron_ab" in text
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["1f1b", "interleaved", "dualpipev-moe"]
    for row in rows:  # the ratio is the two medians' (to their printed resolution: 0.1 ms each, 0.001 the ratio)
        piper_ms, megatron_ms = float(row[1]), float(row[2])
        slack = piper_ms / megatron_ms * (0.05 / piper_ms + 0.05 / megatron_ms) + 5e-4
        assert float(row[3].strip("*")) == pytest.approx(piper_ms / megatron_ms, abs=slack), row
    for row in rows[:2]:  # same layout, same seed: both engines train alike (step 2 after one update)
        assert row[5] == row[6], row


def test_compile_ab_pairs_each_rounds_jobs_and_reports_both_engines(tmp_path, monkeypatch, capsys):
    """compile_ab over torchtitan_ab's jobs (stood in for here: the real jobs are what
    test_torchtitan_ab_smoke runs): per round an eager and a compiled job, the first of the pair
    alternating; compiled / eager per engine from the same round's two jobs."""
    from benchmarks import compile_ab, torchtitan_ab

    calls = []

    def fake_job(argv):
        flags = next(a.split("=", 1)[1] for a in argv if a.startswith("--extra="))
        calls.append(flags)
        compiled = "--compile.enable" in flags
        rate = {"torch": 200.0 if compiled else 100.0, "piper": 330.0 if compiled else 110.0}
        return {"1F1B": {"torch_tps": rate["torch"], "piper_tps": rate["piper"], "loss": 4.0,
                         "run_ratio": rate["piper"] / rate["torch"]}}

    monkeypatch.setattr(torchtitan_ab, "main", fake_job)
    out = tmp_path / "compile.md"
    summary = compile_ab.main(["--schedules", "1F1B", "--rounds", "2", "--backend", "aot_eager", "--out", str(out)])
    assert calls == ["", "--compile.enable --compile.backend aot_eager"] * 1 + [
        "--compile.enable --compile.backend aot_eager", ""]
    assert summary["1F1B"]["torch_speedup"] == pytest.approx(2.0)
    assert summary["1F1B"]["piper_speedup"] == pytest.approx(3.0)
    assert summary["1F1B"]["compiled"]["ratio"] == pytest.approx(1.65)
    text = out.read_text()
    assert capsys.readouterr().out.startswith("python -m benchmarks.compile_ab ")
    rows, speed = _tables(text)
    assert [(r[0], r[1]) for r in rows] == [("1F1B", "eager"), ("1F1B", "compiled")]
    assert speed == [["1F1B", "**2.000**", "**3.000**"]]
