"""``piper calibrate --host``: a cost profile of a TorchTitan config or a Megatron model measured
through its adapter, from the step traces its jobs write; with it the adapters' ``--piper.profile``
/ ``--piper-profile`` predict the step of schedules the calibration never ran, against their
measured steps. Also: the step trace's layout, the FLOPs the host programs carry, and the one-line
errors of the command.

The calibrations here fork their jobs' ranks from the TorchTitan zygote of :mod:`titan_fork`
(``run_host_job_forked``: torchrun's environment, without ~6 s of imports per job); torchrun
itself starts the jobs of ``test_torchtitan_parity``'s issue command and ``test_titan_launch``."""
from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import torch

from piper_plugin import StepTrace, capture, compile_program, read_step_traces, recipes, simulate
from piper_plugin import calibrate_host
from piper_plugin.cli import main
from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss

BOUNDS = (0.75, 1.33)  # predicted / measured step, on a shared 2-core machine
# One job of a few measured steps can sit in a slow stretch of the machine whole: in fresh-clone
# suites a calibration job measured 0.54-0.66 of its prediction (80 ms where it measures 35-60 ms
# alone; 0.98 s where its twin ran 0.6 s) while the others of its calibration held 0.9-1.2. Each
# job is held to twice its prediction either way, the median of a calibration's jobs to BOUNDS.
JOB_BOUNDS = (0.5, 2.0)
MEMORY_BOUNDS = (0.9, 1.1)  # predicted / measured peak transient bytes of each rank (the goal)
PREDICTED = re.compile(r"predicted with cost profile \S+: step ([\d.]+) ms")
PREDICTED_PEAKS = re.compile(r"peak transient per rank ([\d. /]+) MiB \((\w+) region memory\)")


def _check_peaks(log: str, trace, name: str) -> None:
    """The predicted line's peak transient memory per rank (from memory the profile measured)
    against the peaks the run's meters measured."""
    found = PREDICTED_PEAKS.search(log)
    assert found and found[2] == "measured", (name, log[-2000:])
    predicted = [float(x) * 2 ** 20 for x in found[1].split(" / ")]
    measured = read_step_traces(trace).peak_transient
    assert sorted(measured) == list(range(len(predicted))), (name, measured)
    for rank, mib in enumerate(predicted):
        ratio = mib / measured[rank]
        assert MEMORY_BOUNDS[0] < ratio < MEMORY_BOUNDS[1], (name, rank, mib, measured[rank])


@pytest.fixture
def forked_jobs(monkeypatch):
    """``piper calibrate --host`` runs its jobs with forked ranks (:func:`run_host_job_forked`)."""
    from titan_fork import run_host_job_forked

    monkeypatch.setattr(calibrate_host, "run_host_job", run_host_job_forked)
    return run_host_job_forked


def _piper(capsys, *argv) -> subprocess.CompletedProcess:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def _toy_plan():
    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-lm"](stages=2, layers=2)
    tokens, targets = lm_batch(cfg, 8)
    program = capture(model, lm_loss, (tokens,), targets)
    return compile_program(program, lambda p: recipes.load("1f1b").schedule(
        p, pp=2, dp=1, ep=1, microbatches=2, zero=0, chunks=1)).plan


def test_a_step_trace_reads_back_each_steps_slowest_process(tmp_path):
    plan = _toy_plan()
    traces = [StepTrace(tmp_path, plan, plan_rank=r, process_rank=r) for r in (0, 1)]
    for seconds in ((0.5, 0.7), (0.4, 0.3), (0.2, 0.25)):
        for trace, s in zip(traces, seconds):
            trace.record([("compute", f"{trace.plan_rank}F0", 0.0, s)], s)
    traced = read_step_traces(tmp_path)
    assert traced.step_seconds == [0.7, 0.4, 0.25]
    assert traced.median_step(1) == pytest.approx(0.325)
    assert traced.timelines == {0: [("compute", "0F0", 0.0, 0.2)], 1: [("compute", "1F0", 0.0, 0.25)]}
    assert traced.plan.hash() == plan.hash()
    with pytest.raises(ValueError, match="not more than the 3 left out"):
        traced.median_step(3)
    traces[0].record([], 0.1)  # one process a step ahead: not one step's trace
    with pytest.raises(ValueError, match=r"stopped at steps \[3, 4\]"):
        read_step_traces(tmp_path)
    with pytest.raises(ValueError, match="no plan.pkl"):
        read_step_traces(tmp_path / "elsewhere")


def test_memory_measured_by_a_trace_replaces_the_programs_figures_at_its_stage_count(tmp_path):
    """The meter's windows of one traced step become per-region samples (a task's windows added
    up in turn), fitted as batch part x scale + fixed part; a plan of the measured stage count
    gets them (a copy: the plan itself keeps its own), others stay as they are."""
    from piper_plugin import MemoryMeter, with_measured_memory
    from piper_plugin.measured_memory import fit_memory, memory_samples

    plan = _toy_plan()  # 2 stages, 2 microbatches: each a scale of 1/2
    meter = MemoryMeter()
    meter.add(700)
    trace = StepTrace(tmp_path, plan, plan_rank=0, process_rank=0)
    trace.record([], 0.1, meter)
    traced = read_step_traces(tmp_path)
    assert traced.peak_transient == {0: 700} and traced.windows == {0: []}
    # rank 0: the first forward saves 50 bytes its microbatches share, 0B0 runs split around its
    # sends (two windows: input gradients, keeping 7 bytes, then weight gradients); rank 1 ran one forward
    windows = {0: [("0F0", 0, 150, 150), ("0F1", 0, 100, 100), ("0B0", 0, -60, 30), ("0B0", 1, -40, 50),
                   ("0B1", 0, -150, 20)],
               1: [("1F0", 0, 330, 330)]}
    samples = memory_samples(plan, windows, {0: {"0B0": 7}})
    assert sorted(samples) == [("0", "full", 0.5, 20), ("0", "inputs", 0.5, 30), ("0", "kept", 0.5, 7),
                               ("0", "saved", 0.5, 100), ("0", "shared", 0.5, 50), ("0", "weights", 0.5, 50),
                               ("1", "single", 0.5, 330)]
    more = [("0", "full", 0.25, 15), ("1", "shared", 0.25, 30)]  # 20 = 20 x 1/2 + 10, 15 = 20 x 1/4 + 10
    fitted = fit_memory(samples + more)
    assert fitted == {"0": {"full": [20, 10], "inputs": [60, 0], "kept": [14, 0], "saved": [200, 0],
                            "shared": [50, 0], "weights": [100, 0]},
                      "1": {"saved": [600, 0], "shared": [30, 0]}}  # 330 less the shared 30, at 1/2
    measured = with_measured_memory(plan, {"memory": {"2": fitted}})
    regions = measured.dag.regions
    assert (regions["0"].activation_bytes, regions["1"].activation_bytes) == (200, 600)
    assert regions["0"].shared_activation_bytes == 50
    shared = with_measured_memory(plan, {"memory": {"2": {"0": {"shared": [1 << 20, 0]}}}})
    before, after = simulate(plan).peak_transient_bytes, simulate(shared).peak_transient_bytes
    assert after == [before[0] + (1 << 20), before[1]]  # held once, over every microbatch of stage 0
    assert regions["0"].backward.full.at(0.5) == 20 and regions["0"].backward.kept.at(0.5) == 7
    assert regions["1"].backward == plan.dag.regions["1"].backward
    assert plan.dag.regions["0"].activation_bytes != 200  # the plan itself is untouched
    assert with_measured_memory(plan, {"memory": {"4": fitted}}) is plan


def test_megatron_stages_carry_flops_and_activations_that_scale_with_their_layers():
    from piper_plugin.adapters.megatron.program import build_program

    def layer(i: int) -> list:
        return [(f"decoder.layers.{i}.self_attention.linear_qkv.weight", (192, 64), 0),
                (f"decoder.layers.{i}.mlp.linear_fc1.weight", (256, 64), 0),
                (f"decoder.layers.{i}.input_layernorm.weight", (64,), 0)]

    params = {0: [("embedding.word_embeddings.weight", (128, 64), 0), *layer(0)],
              1: [*layer(1), *layer(2), ("output_layer.weight", (128, 64), 0)]}
    program = build_program(params, microbatch_size=2, microbatches=2, hidden_shape=(32, 2, 64), dtype=torch.float32)
    first, last = program.regions["0"], program.regions["1"]
    tokens = 32 * 4
    per_layer = 2 * tokens * (192 * 64 + 256 * 64) + 4 * tokens * 32 * 64
    assert first.matmul_flops == per_layer  # the embedding lookup: none
    assert last.matmul_flops == 2 * per_layer + 2 * tokens * 128 * 64
    hidden = 32 * 4 * 64 * 4
    logits = tokens * 128 * 4  # the output layer's (vocab 128 per token)
    assert (first.activation_bytes, last.activation_bytes) == (18 * hidden, 35 * hidden + logits)
    # with the head count: each layer's attention probabilities too (heads x seq^2 per sample)
    heads = build_program(params, microbatch_size=2, microbatches=2, hidden_shape=(32, 2, 64), dtype=torch.float32,
                          attention_heads=4, model_type="GPTModel")
    probabilities = 4 * 32 * 32 * 4 * 4
    assert heads.regions["0"].activation_bytes == 18 * hidden + probabilities
    assert heads.regions["1"].activation_bytes == 35 * hidden + 2 * probabilities + logits
    assert not first.backward_splits and not last.backward_splits  # Megatron's linears: one-call backwards


def test_host_calibration_errors_are_one_line(capsys, tmp_path):
    out = str(tmp_path / "p.json")
    cases = [
        (("--host", "nosuch", "--out", out, "--", "--config", "x"), "--host 'nosuch': no adapter registered"),
        (("--host", "torchtitan", "--out", out), "put the host's training arguments after --"),
        (("--out", out, "--", "--config", "llama3_debugmodel_pp2_1f1b"), "go after --host NAME --"),
        (("--host", "torchtitan", "--out", out, "--", "--config", "llama3_debugmodel_pp2_1f1b", "--piper.recipe",
          "gpipe"), "--piper.recipe: piper calibrate sets it"),
        (("--host", "torchtitan", "--out", out, "--", "--config", "llama3_debugmdel_pp2_1f1b"), "did you mean"),
        (("--host", "megatron", "--out", out, "--", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
          "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3"),
         "--global-batch-size is missing"),
        (("--host", "megatron", "--steps", "2", "--out", out, "--", "--num-layers", "4"), "--steps 2"),
    ]
    for argv, message in cases:
        result = _piper(capsys, "calibrate", *argv)
        assert result.returncode == 2, (argv, result.stderr)
        assert result.stderr.count("piper: error:") == 1 and message in result.stderr, (argv, result.stderr)


def test_jobs_that_all_fail_end_in_one_line_and_the_first_output(capsys, tmp_path, monkeypatch):
    import piper_plugin.calibrate_host as calibrate_host

    runs = []
    monkeypatch.setattr(calibrate_host, "run_host_job", lambda *a, **k: runs.append(a) or (3, "warming up\nboom"))
    result = _piper(capsys, "calibrate", "--host", "megatron", "--out", str(tmp_path / "p.json"), "--",
                    *MEGATRON)
    assert result.returncode == 1 and result.stderr.count("piper: error:") == 1, result.stderr
    assert "no calibration job of --host megatron ran" in result.stderr and "boom" in result.stderr
    assert len(runs) == 2 * 7  # every job, each once more
    assert not (tmp_path / "p.json").exists()


def test_rounds_take_each_jobs_median_over_them_and_skip_a_failed_job(capsys, tmp_path, monkeypatch):
    """``--rounds 3``: the jobs alternate round by round; a job's step is the median of its rounds'
    medians (a slow stretch over a whole round of one job is outvoted), and a job that failed
    twice in the first round is not run again."""
    import piper_plugin.calibrate as calibrate

    plan, runs, fitted = _toy_plan(), [], []

    def job(program, argv, nproc, cwd):
        trace = argv[argv.index("--piper-trace") + 1]
        runs.append(trace.rsplit("/", 1)[1])
        if "zb-h1" in trace:
            return 3, "boom"
        slow = 0.5 if trace.endswith("_r0") else 0.1  # the first round ran through a slow stretch
        for rank in (0, 1):
            writer = StepTrace(trace, plan, plan_rank=rank, process_rank=rank)
            for seconds in (0.9, 0.9, slow, slow, slow):
                writer.record([], seconds)
        return 0, ""

    def fit(samples, steps_measured, messages, **_):
        fitted.extend(steps_measured)
        return {"jobs": [{"job": n, "measured_step_s": s, "predicted_step_s": s} for n, _, s in steps_measured]}

    monkeypatch.setattr(calibrate_host, "run_host_job", job)
    monkeypatch.setattr(calibrate, "measure_messages", lambda nproc: {"p2p": []})
    monkeypatch.setattr(calibrate, "fit_profile", fit)
    result = _piper(capsys, "calibrate", "--host", "megatron", "--rounds", "3", "--steps", "5", "--out",
                    str(tmp_path / "p.json"), "--", *MEGATRON)
    assert result.returncode == 0, result.stderr
    assert [(name, step) for name, _, step in fitted] == [(name, 0.1) for name in
                                                          ("1f1b m=1", "1f1b m=4", "1f1b m=8",
                                                           "interleaved-1f1b m=4 v=2", "interleaved-1f1b m=8 v=2")]
    per_round = [r for r in runs if not r.startswith("zb-h1")]
    assert [r.rsplit("_r", 1)[1] for r in per_round] == [str(k) for k in range(3) for _ in range(5)]  # alternating
    assert sorted(r for r in runs if r.startswith("zb-h1")) == ["zb-h1_m4_v1_r0"] * 2 + ["zb-h1_m8_v1_r0"] * 2
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["rounds"] == 3 and [j["job"] for j in profile["failed_jobs"]] == ["zb-h1 m=4", "zb-h1 m=8"]
    toy = _piper(capsys, "calibrate", "--rounds", "2", "--out", str(tmp_path / "t.json"))
    assert toy.returncode == 2 and "--rounds 2: rounds are for --host calibrations" in toy.stderr


def test_a_host_profile_is_refused_by_the_toy_commands(capsys, tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"host": "torchtitan", "model": "torchtitan: --config x"}))
    result = _piper(capsys, "plan", "--profile", str(path))
    assert result.returncode == 2 and "pass it to the host's --piper.profile" in result.stderr


def _check_predictions(profile: dict, step_bounds: tuple[float, float] = JOB_BOUNDS) -> None:
    """Every calibration job's predicted step within ``step_bounds`` of its measured one, the
    median of those ratios within :data:`BOUNDS`, and its peaks per rank within
    :data:`MEMORY_BOUNDS` of the measured ones."""
    every = [(j["job"], round(j["predicted_step_s"] / j["measured_step_s"], 3), j["measured_step_s"])
             for j in profile["jobs"]]  # shown with any failure: one job's miss against the others'
    assert BOUNDS[0] < statistics.median(ratio for _, ratio, _ in every) < BOUNDS[1], every
    for job, (_, ratio, _) in zip(profile["jobs"], every):
        assert step_bounds[0] < ratio < step_bounds[1], (job, every)
        for predicted, measured in zip(job["predicted_peak_transient_bytes"], job["measured_peak_transient_bytes"],
                                       strict=True):
            assert MEMORY_BOUNDS[0] < predicted / measured < MEMORY_BOUNDS[1], job


def _predicted_as_run(trace: Path, name: str, run_once: Callable[[Path], str]) -> None:
    """``run_once(trace folder)`` runs a plan the profile predicts and returns its log: the
    predicted step within :data:`BOUNDS` of the traced steps' median (4 steps: a run that misses
    runs once more, into another folder, and that run must hold; a wrong prediction misses twice,
    a slow stretch of the machine once), its peaks within :data:`MEMORY_BOUNDS` of its meter's."""
    ratios = []
    for attempt in (trace, trace.with_name(f"{trace.name}_again")):
        log = run_once(attempt)
        ratios.append(float(PREDICTED.search(log)[1]) / 1e3 / read_step_traces(attempt).median_step(2))
        _check_peaks(log, attempt, name)
        if BOUNDS[0] < ratios[-1] < BOUNDS[1]:
            break
    print(f"{name}: predicted / measured step {ratios}")
    assert BOUNDS[0] < ratios[-1] < BOUNDS[1], (name, ratios)


def _check_jobs(profile: dict) -> None:
    assert not profile["failed_jobs"], profile["failed_jobs"]
    recipes_run = {job["job"].split()[0] for job in profile["jobs"]}
    assert recipes_run == {"1f1b", "zb-h1", "interleaved-1f1b"} and {"F", "B", "BI", "BW"} <= set(profile["compute"])
    assert any(job["job"].endswith("v=2") for job in profile["jobs"])  # stages of another size
    _check_predictions(profile)
    assert profile["memory"].keys() == profile["programs"].keys()  # every stage count's regions measured


@pytest.mark.slow
def test_torchtitan_profile_predicts_and_tunes_schedules_it_never_ran(capsys, tmp_path, forked_jobs):
    """Calibrated on llama3_debugmodel_pp2_1f1b (1F1B and ZB-H1 on its 2 stages, interleaved 1F1B on
    4), the profile predicts GPipe; ``piper tune`` with it searches the host's own programs and
    writes a plan that TorchTitan runs by the printed command, its step as predicted."""
    from titan_fork import run_titan_forked

    from piper_plugin.adapters.torchtitan.calibration import job_argv

    path, best = tmp_path / "tt.json", tmp_path / "best.json"
    user = ["--config", "llama3_debugmodel_pp2_1f1b"]
    result = _piper(capsys, "calibrate", "--host", "torchtitan", "--steps", "5", "--out", str(path), "--", *user)
    assert result.returncode == 0, result.stderr
    profile = json.loads(path.read_text())
    assert profile["host"] == "torchtitan" and profile["host_args"] == user and profile["grid"]["pp"] == 2
    assert sorted(profile["programs"]) == ["2", "4"]
    _check_jobs(profile)
    tuned = _piper(capsys, "tune", "--profile", str(path), "--out", str(best))
    assert tuned.returncode == 0, tuned.stderr
    first = re.search(r"^\s*1  (\S+) pp=2 dp=1 ep=1 zero=0 m=(\d+)( v=2)?", tuned.stdout, re.M)
    assert first, tuned.stdout
    command = re.search(r"run it with torchrun --nproc_per_node=2 -m torchtitan.train (.*) \(and the run", tuned.stdout)[1]
    stages = 4 if first[1] in ("dualpipev", "interleaved-1f1b") else 2
    assert command.split() == job_argv(user, 2, recipe=str(best), microbatches=int(first[2]), chunks=stages // 2)
    tuned_flags = command.split()[2:-len(user)]  # between --module M and the user's flags: the plan's
    runs = {"gpipe": ["--piper.recipe", "gpipe"], "tuned": tuned_flags}
    for name, extra in runs.items():
        def run_once(trace, extra=extra):
            run = run_titan_forked("llama3_debugmodel_pp2_1f1b", "piper", dump_folder=trace.with_name(f"{trace.name}_dump"),
                                   steps=6, extra=[*extra, "--piper.trace", str(trace), "--piper.trace_memory",
                                                   "--piper.profile", str(path)])
            assert run.ok, run.tail()
            return run.log

        _predicted_as_run(tmp_path / name, f"{name} ({first[0].strip()})" if name == "tuned" else name, run_once)


MEGATRON = ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--global-batch-size", "8", "--lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.slow
def test_megatron_profile_predicts_dualpipev_and_tunes(capsys, tmp_path, forked_jobs):
    """Calibrated with 1F1B, ZB-H1 and interleaved 1F1B, the profile predicts DualPipeV's V (never
    run; tied embeddings, whose two copies the V puts on rank 0); ``piper tune`` with it writes a
    trace the entry runs by the printed command (the entry reads the trace's placement before it
    builds the chunks), its step as predicted."""
    path, best = tmp_path / "meg.json", tmp_path / "best.json"
    result = _piper(capsys, "calibrate", "--host", "megatron", "--steps", "5", "--out", str(path), "--", *MEGATRON)
    assert result.returncode == 0, result.stderr
    _check_jobs(json.loads(path.read_text()))
    tuned = _piper(capsys, "tune", "--profile", str(path), "--out", str(best))
    assert tuned.returncode == 0, tuned.stderr
    command = re.search(r"-m piper_plugin.adapters.megatron.pretrain_gpt (.*) \(and the run", tuned.stdout)[1]
    runs = {"dualpipev": [*MEGATRON, "--micro-batch-size", "1", "--pipeline-engine", "piper",
                          "--virtual-pipeline-model-parallel-size", "2", "--piper-recipe", "dualpipev"],
            "tuned": command.split()}
    first = next(line for line in tuned.stdout.splitlines() if line.split()[:1] == ["1"])
    for name, argv in runs.items():
        def run_once(trace, name=name, argv=argv):
            code, log = forked_jobs("piper_plugin.adapters.megatron.pretrain_gpt", [
                *argv, "--train-iters", "6", "--piper-trace", str(trace), "--piper-trace-memory", "--piper-profile",
                str(path)], 2, tmp_path)
            assert code == 0, (name, log[-3000:])
            return log

        _predicted_as_run(tmp_path / name, f"{name} ({' '.join(first.split())})" if name == "tuned" else name,
                          run_once)


MEGATRON_DP = ["--pipeline-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "16", "--lr", "1e-3",
               "--piper-zero", "2"]


@pytest.mark.slow
def test_megatron_profile_on_a_data_parallel_grid_predicts_each_jobs_peak(capsys, tmp_path, forked_jobs):
    """Pipeline 1 x data-parallel 2 under Piper's ZeRO-2, calibrated at 1-8 microbatches: each
    microbatch's gradient reduce-scatter runs while the next forward saves its activations, and
    every job's predicted peak per rank is within 10% of its meter's (the forward's activations
    rise over its span: counted whole from its start, the 4- and 8-microbatch jobs came out ~45%
    and ~75% high); the jobs' median step ratio within the step bounds."""
    path = tmp_path / "dp.json"  # 10 steps measured: this model's steps (35-190 ms) have slow stretches of
    # half a second (55-67 ms against 35 ms for 1 microbatch); 3 steps' median caught one in CI
    result = _piper(capsys, "calibrate", "--host", "megatron", "--steps", "12", "--out", str(path), "--",
                    *MEGATRON_DP)
    assert result.returncode == 0, result.stderr
    profile = json.loads(path.read_text())
    assert profile["grid"] == {"pp": 1, "dp": 2, "ep": 1} and not profile["failed_jobs"], profile["failed_jobs"]
    assert {int(j["job"].split("m=")[1].split()[0]) for j in profile["jobs"]} == {1, 4, 8}
    # identical work, 1F1B and ZB-H1 at one stage and 4 or 8 microbatches, measured up to 1.47x apart
    # within one calibration (118 against 80 ms; 188 against 145), and the 1-microbatch job (the first
    # run) 80 ms in one CI suite where it measures 35-60 ms alone (0.54 of its prediction, the other
    # jobs 0.89-0.92): JOB_BOUNDS
    _check_predictions(profile)


def _host_profile(tmp_path, host: str, host_args: list[str], programs: dict, grid: dict) -> str:
    """A host profile as ``piper calibrate --host`` writes it, with hand-set costs: each task 1 ms
    plus 1 ns per parameter byte, messages 100 us and 1 GB/s."""
    from piper_plugin.calibrate_host import pack_programs
    from piper_plugin.scheduler.cost import TASK_FEATURES

    per_task = [1e-3, 0.0, 0.0, 0.0, 1e-9]
    assert len(per_task) == len(TASK_FEATURES)
    profile = {"model": f"{host}: test", "host": host, "host_args": host_args, "ranks": 2, "grid": grid,
               "features": list(TASK_FEATURES), "compute": {k: per_task for k in ("F", "B", "BI", "BW", "UPDATE")},
               "latency_s": 1e-4, "collective_latency_s": 1e-4, "seconds_per_byte": 1e-9,
               "programs": pack_programs(programs)}
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_a_host_profile_on_a_data_parallel_grid_tunes_the_zero_level(capsys, tmp_path):
    """A Megatron profile of pipeline 1 x data-parallel 2 under Piper's ZeRO: ``piper tune``
    searches ZeRO 1-3 on that grid (the program's batch is the global one: Megatron's per-replica
    batch times the replicas) and prints the entry's command with the chosen level."""
    from piper_plugin.adapters.megatron.program import build_program

    params = {0: [("embedding.word_embeddings.weight", (256, 64), 256 * 64 * 4),
                  ("decoder.layers.0.mlp.linear_fc1.weight", (256, 64), 256 * 64 * 4),
                  ("output_layer.weight", (256, 64), 256 * 64 * 4)]}
    program = build_program(params, microbatch_size=1, microbatches=8, hidden_shape=(64, 1, 64),
                            dtype=torch.float32, replicas=2)
    assert program.dag.batch_size == 16
    path = _host_profile(tmp_path, "megatron", MEGATRON_DP, {1: program}, {"pp": 1, "dp": 2, "ep": 1})
    best = tmp_path / "best.json"
    tuned = _piper(capsys, "tune", "--profile", path, "--out", str(best), "--top", "20")
    assert tuned.returncode == 0, tuned.stderr
    assert "grid pp=1 x dp=2 x ep=1, ZeRO levels 1, 2, 3" in tuned.stdout, tuned.stdout
    listed = re.findall(r"^\s*\d+  \S+ pp=1 dp=2 ep=1 zero=(\d) m=(\d+)", tuned.stdout, re.M)
    assert {z for z, _ in listed} == {"1", "2", "3"}, tuned.stdout
    zero, m = listed[0]
    command = re.search(r"-m piper_plugin.adapters.megatron.pretrain_gpt (.*) \(and the run", tuned.stdout)[1].split()
    assert command[command.index("--micro-batch-size") + 1] == str(8 // int(m))  # per replica
    assert command[len(command) - 1 - command[::-1].index("--piper-zero") + 1] == zero  # the last one counts
    from piper_plugin.adapters.megatron.schedule import stage_placement

    assert stage_placement(str(best), pp=1, stages=1, microbatches=int(m)) == {0: 0}  # the entry reads the trace


def test_torchtitan_tuned_command_replaces_the_users_zero_level():
    from piper_plugin.adapters.torchtitan import calibration

    user = ["--config", "llama3_debugmodel_pp2_1f1b", "--parallelism.data_parallel_shard_degree", "2",
            "--piper.zero=3", "--training.mixed_precision_param", "float32"]
    assert calibration.tunable_zero(user, 4) == (0, 1, 2, 3)
    argv = calibration.job_argv(user, 4, recipe="best.json", microbatches=4, chunks=1, zero=1)
    assert [a for a in argv if a.startswith("--piper.zero")] == ["--piper.zero"]
    assert argv[argv.index("--piper.zero") + 1] == "1"
    assert calibration.tunable_zero(["--config", "llama3_debugmodel_pp2_1f1b"], 2) == (0,)
    assert "--piper.zero" not in calibration.job_argv(["--config", "llama3_debugmodel_pp2_1f1b"], 2,
                                                      recipe="b.json", microbatches=4, chunks=1, zero=0)


def test_a_steps_collectives_and_its_time_outside_tasks_are_read_from_its_timelines():
    """A collective's time runs from its last member's start to its first member's end; the
    step's overhead is its seconds less its tasks' span over every process (never below 0)."""
    from piper_plugin.calibrate import collective_samples, step_outside_tasks
    from piper_plugin.ir.nodes import Kind

    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-lm"](stages=1, layers=2)
    tokens, targets = lm_batch(cfg, 8)
    plan = compile_program(capture(model, lm_loss, (tokens,), targets), lambda p: recipes.load("1f1b").schedule(
        p, pp=1, dp=2, ep=1, microbatches=2, zero=2, chunks=1)).plan
    (scatter, *_) = sorted(k for k, n in plan.dag.nodes.items() if n.kind == Kind.REDUCE_SCATTER)
    first = plan.ranks[0].streams["compute"][0]
    timelines = [[("compute", first, 1.0, 1.5), ("dp", scatter, 2.0, 2.9)],
                 [("compute", first, 1.1, 1.6), ("dp", scatter, 2.2, 2.6)]]
    ((moved, seconds),) = collective_samples(plan, timelines)
    assert seconds == pytest.approx(0.4) and moved == plan.dag.nodes[scatter].bytes / 2  # ring: (n - 1) / n
    assert step_outside_tasks(2.5, timelines) == pytest.approx(0.6)
    assert step_outside_tasks(1.0, timelines) == 0.0
