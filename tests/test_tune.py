"""``piper tune`` searches strategies by simulation; ``piper calibrate`` measures the cost
profile it simulates with. The search scores every candidate from its own compiled plan, keeps
the memory cap, and writes a recipe file ``piper train`` replays; the profile's fits recover
known coefficients."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections import Counter

import pytest
import torch

from piper_plugin.calibrate import cost_model, fit_compute, fit_messages
from piper_plugin.cli import main
from piper_plugin.compiler import compile_program
from piper_plugin.ir.capture import capture
from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
from piper_plugin.recipes import load
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.tune import OVERLAY_STREAM, candidates, grids, search

BATCH, LAYERS = 16, 4
SEQ = 128  # steps of ~40 ms: compute, not per-task overhead and the machine's jitter, makes them


def _program(stages: int):
    with torch.device("meta"):
        model, cfg = TOY_MODELS["toy-lm"](stages=stages, layers=LAYERS)
    tokens, targets = lm_batch(cfg, BATCH)
    return capture(model, lm_loss, (tokens,), targets)


def _piper(capsys, *argv) -> subprocess.CompletedProcess:
    """``piper <argv>`` in this process (its ranks fork from the fork server, as under the CLI)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def test_grids_are_every_factorisation_of_the_ranks():
    assert sorted(grids(4, experts=False)) == [(1, 4, 1), (2, 2, 1), (4, 1, 1)]
    assert sorted(grids(4, experts=True)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def test_candidates_give_every_data_shard_whole_samples_and_zero_only_with_data_parallelism():
    found = list(candidates(4, 8, experts=False, recipes=["1f1b"], zero_levels=(0, 3), microbatches=(1, 2, 4),
                            chunks=(1, 2)))
    assert found and all(8 % (c.dp * c.ep * c.microbatches) == 0 for c in found)
    assert all(c.zero == 0 for c in found if c.dp * c.ep == 1)
    assert len({(c.pp, c.dp, c.zero, c.microbatches) for c in found}) == len(found)  # 1f1b ignores chunks: once


@pytest.mark.slow
def test_every_score_is_its_own_plans_simulation_and_the_cap_holds():
    cost = CostModel.cpu_default()
    space = dict(recipes=["1f1b", "zb-h1", "interleaved-1f1b"], zero_levels=(0, 3), microbatches=(1, 2, 4, 8))
    every = search(_program, 2, BATCH, experts=False, cost=cost, max_stages=LAYERS, **space)
    cap = sorted(s.peak_bytes for s in every.fitting)[len(every.fitting) // 2]  # half the plans fit
    result = search(_program, 2, BATCH, experts=False, cost=cost, memory_cap=cap, max_stages=LAYERS, **space)
    assert result.fitting and result.over_cap and result.refused
    overlaid = [s for s in every.fitting if s.candidate.stream]  # stream overlays give plans of their own
    assert overlaid and every.no_overlay  # (and one that moves nothing is not scored twice)
    assert len(result.fitting) + len(result.over_cap) == len(every.fitting)
    assert all(s.peak_bytes <= cap for s in result.fitting)
    assert all(s.peak_bytes > cap for s in result.over_cap)
    times = [s.step_time for s in result.fitting]
    assert times == sorted(times)
    for s in result.fitting[:3] + result.over_cap[:2]:  # recompiled alone: the same figures
        c = s.candidate
        recipe = load(c.recipe)

        def schedule(p, c=c, recipe=recipe):
            if c.warmup:
                return c.schedule(p)
            sch = recipe.schedule(p, chunks=c.chunks, pp=c.pp, dp=c.dp, ep=c.ep, microbatches=c.microbatches,
                                  zero=c.zero)
            return sch.stream(c.stream, OVERLAY_STREAM) if c.stream else sch

        _, _, _, sim = compile_program(_program(recipe.stages(c.pp, c.chunks)), schedule, cost=cost)
        assert sim.step_time == s.step_time
        assert max(sum(st.values()) + t for st, t in zip(sim.static_bytes, sim.peak_transient_bytes)) == s.peak_bytes


def test_fits_recover_known_coefficients():
    truth = {"F": [1e-3, 5e-6, 2e-9, 1e-10, 0.0], "B": [2e-3, 1e-5, 4e-9, 0.0, 0.0],
             "UPDATE": [1e-4, 0.0, 0.0, 0.0, 3e-9]}
    samples = []
    for kind, coef in truth.items():
        for ops in (10, 40, 160):
            for flops in (1e5, 1e6, 1e7):
                for activations, param_bytes in ((2e4, 1e5), (5e5, 3e6), (1e6, 1e5)):
                    features = (1.0, float(ops), flops, activations, param_bytes)
                    samples.append((kind, features, sum(c * x for c, x in zip(coef, features))))
    fitted = fit_compute(samples)
    for kind, coef in truth.items():
        assert fitted[kind] == pytest.approx(coef, rel=1e-6, abs=1e-12), kind
    assert fitted["BI"] == pytest.approx([c / 2 for c in truth["B"]])  # never measured: half a backward each
    latency, per_byte = fit_messages([(n, 1e-4 + n * 2e-10) for n in (1 << 10, 1 << 16, 1 << 20)])
    assert (latency, per_byte) == (pytest.approx(1e-4), pytest.approx(2e-10))


@pytest.mark.slow
def test_a_profile_that_is_not_one_names_the_file_and_the_fix(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"compute": {}}))
    with pytest.raises(ValueError, match=r"cost profile .*p.json.* is not one `piper calibrate` wrote.*--out"):
        cost_model(bad)
    run = _piper(capsys, "tune", "--ranks", "2", "--profile", str(bad))
    assert run.returncode == 2 and run.stderr.count("piper: error:") == 1 and "piper calibrate" in run.stderr


@pytest.mark.slow
def test_nothing_under_the_cap_is_one_line_naming_the_smallest_plan(capsys):
    run = _piper(capsys, "tune", "--ranks", "2", "--layers", "4", "--memory-cap", "1KiB")
    assert run.returncode == 2, run.stderr
    (line,) = [l for l in run.stderr.splitlines() if l.startswith("piper: error:")]
    assert "no plan fits --memory-cap 1.0 KiB" in line and "the smallest plan needs" in line


@pytest.mark.slow
def test_calibrate_then_tune_writes_a_recipe_file_that_trains(tmp_path, capsys):
    """The whole loop on 2 forked ranks: a measured profile, a search with it (the profile's
    sizes), the best plan's file replayed by ``piper train`` (its grid and microbatches come from
    the file), and the profile's predictions of two recipes against their measured steps."""
    profile, best = tmp_path / "profile.json", tmp_path / "best.json"
    cal = _piper(capsys, "calibrate", "--ranks", "2", "--layers", str(LAYERS), "--batch", str(BATCH),
                 "--seq", str(SEQ), "--out", str(profile))
    assert cal.returncode == 0, cal.stderr[-3000:]
    data = json.loads(profile.read_text())
    assert set(data["compute"]) == {"F", "B", "BI", "BW", "UPDATE"} and data["tasks_measured"] > 50
    assert data["latency_s"] > 0 < data["collective_latency_s"] and all(c >= 0 for cs in data["compute"].values() for c in cs)
    assert len(data["jobs"]) >= 8 and 0 <= data["comm_cpu_share"] <= 1
    # ~10% here on a quiet machine; a lost term or unit moves the median of the jobs. One job's 6
    # measured steps (~0.25 s) can sit in a slow stretch whole: in a fresh-clone suite the 1-microbatch
    # data-parallel job measured 51 ms against 34-37 ms alone (predicted 35 ms), and with an idle local
    # Ray beside it 50 ms; each job is held to twice its prediction either way
    per_job = [(job["job"], round(job["predicted_step_s"] / job["measured_step_s"], 3)) for job in data["jobs"]]
    assert 0.75 < statistics.median(r for _, r in per_job) < 1.33, per_job
    assert all(0.5 < r < 2.0 for _, r in per_job), per_job
    tune = _piper(capsys, "tune", "--ranks", "2", "--profile", str(profile), "--out", str(best))
    assert tune.returncode == 0, tune.stderr[-3000:]
    assert f"{LAYERS} layers, batch {BATCH}, seq {SEQ}, 2 ranks" in tune.stdout
    first = next(l for l in tune.stdout.splitlines() if l.split()[:1] == ["1"])
    model = ["--layers", str(LAYERS), "--batch", str(BATCH), "--seq", str(SEQ), "--launcher", "fork"]
    train = _piper(capsys, "train", "--recipe-file", str(best), *model, "--steps", "2")
    assert train.returncode == 0, train.stderr[-3000:]
    trace = json.loads(best.read_text())
    grid = trace["grid"]
    assert f"pp={grid['pp']} dp={grid.get('dp', 1)}" in first
    assert "step 2/2" in train.stdout
    for recipe in ("1f1b", "dualpipev"):  # benchmarks/tune_ab.py measures every recipe, in rounds
        strategy = ["--recipe", recipe, "--pp", "2", "--microbatches", "4"]
        plan = _piper(capsys, "plan", *strategy, "--profile", str(profile))
        predicted = float(next(l for l in plan.stdout.splitlines() if l.startswith("step time")).split()[2])
        ratios = []  # a run that misses runs once more (a slow stretch misses once, a wrong prediction twice)
        for attempt in ("", "_again"):
            metrics = tmp_path / f"{recipe}{attempt}.jsonl"
            run = _piper(capsys, "train", *strategy, *model, "--steps", "8", "--metrics", str(metrics))
            assert run.returncode == 0, run.stderr[-3000:]
            per_step: dict[int, float] = {}
            for line in metrics.read_text().splitlines():
                m = json.loads(line)
                per_step[m["step"]] = max(per_step.get(m["step"], 0.0), m["step_time_s"])
            ratios.append(predicted / statistics.median(t for s, t in per_step.items() if s >= 2))
            if 0.7 < ratios[-1] < 1.4:
                break
        assert 0.7 < ratios[-1] < 1.4, (recipe, predicted, ratios)


def _profile(tmp_path, **sizes):
    """A profile as `piper calibrate` writes one, with made-up figures."""
    from piper_plugin.scheduler.cost import TASK_FEATURES

    coef = {"F": [1e-4, 2e-6, 1e-9, 1e-10, 0.0], "B": [2e-4, 4e-6, 2e-9, 2e-10, 0.0],
            "BI": [1e-4, 2e-6, 1e-9, 1e-10, 0.0], "BW": [1e-4, 2e-6, 1e-9, 1e-10, 0.0],
            "UPDATE": [1e-4, 0.0, 0.0, 0.0, 1e-9]}
    data = {"model": "toy-lm", "layers": 4, "batch": 16, "seq": 64, "ranks": 2, "features": list(TASK_FEATURES),
            "compute": coef, "latency_s": 2e-4, "collective_latency_s": 1e-3, "seconds_per_byte": 1e-9,
            "comm_cpu_share": 0.5, **sizes}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path, data


def test_plan_with_a_profile_predicts_the_model_it_was_measured_on(tmp_path, capsys):
    """`piper plan --profile`: the plan of the profile's model and sizes (what `piper train`
    builds from the shipped text), simulated with the profile, in seconds."""
    from piper_plugin.data.text import vocab_size
    from piper_plugin.models import build_toy_lm

    path, data = _profile(tmp_path)
    run = _piper(capsys, "plan", "--recipe", "1f1b", "--pp", "2", "-m", "4", "--profile", str(path))
    assert run.returncode == 0, run.stderr
    line = next(l for l in run.stdout.splitlines() if l.startswith("step time"))
    step = line.split()
    assert line.endswith(f" s (profile {path})")
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=2, layers=4, vocab=vocab_size(), seq=64)
    tokens, targets = lm_batch(cfg, 16)
    _, _, _, sim = compile_program(capture(model, lm_loss, (tokens,), targets),
                                   lambda p: load("1f1b").schedule(p, pp=2, dp=1, ep=1, microbatches=4, zero=0, chunks=1),
                                   cost=cost_model(data))
    assert float(step[2]) == pytest.approx(sim.step_time, rel=1e-5)
    wrong = _piper(capsys, "plan", "--model", "toy-moe", "--profile", str(path))
    assert wrong.returncode == 2 and "--model toy-moe: the profile" in wrong.stderr and "pass --model toy-lm" in wrong.stderr
    old, _ = _profile(tmp_path, features=["per task", "per op", "per forward FLOP of the microbatch", "per parameter byte"])
    stale = _piper(capsys, "plan", "--profile", str(old))
    assert stale.returncode == 2 and stale.stderr.count("piper: error:") == 1 and "piper calibrate --out" in stale.stderr


def test_calibration_samples_a_fused_input_gradient_pass_as_a_whole_backward():
    """A BI the plan runs as one whole backward is a B sample; its BW, which does nothing, none."""
    from piper_plugin.calibrate import task_samples

    _, _, plan, _ = compile_program(_program(4), lambda p: load("dualpipev").schedule(
        p, pp=2, dp=1, ep=1, microbatches=4, zero=0, chunks=2))
    fused = plan.ranks[0].fused
    assert fused
    timeline = [("compute", k, 0.0, 1.0) for k in plan.ranks[0].deps if plan.node(k).is_compute]
    kinds = Counter(kind for kind, _, _ in task_samples(plan, {0: timeline}))
    total = Counter(plan.node(k).kind.value for k in plan.ranks[0].deps if plan.node(k).is_compute)
    assert kinds["B"] == len(fused) and kinds["BI"] == total["BI"] - len(fused)
    assert kinds["BW"] == total["BW"] - len(fused) and kinds["F"] == total["F"]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_extra_warmup_holds_more_forwards_and_ends_in_gpipe(p, m):
    """1F1B with k more forwards in flight: a valid order (it simulates, each (stage, mb) once),
    rank r holds min(p - r + k, m) activations at its peak, and k = m - 1 is GPipe's order."""
    from piper_plugin.recipes.orders import gpipe, one_f_one_b

    for k in range(m):
        orders = one_f_one_b(p, m, extra_warmup=k)
        for r, acts in enumerate(orders):
            assert sorted(acts) == sorted(one_f_one_b(p, m)[r])
            held = peak = 0
            for kind, _, _ in acts:
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            assert peak == min(p - r + k, m)
    assert one_f_one_b(p, m, extra_warmup=m - 1) == gpipe(p, m)
    with pytest.raises(ValueError, match="extra_warmup"):
        one_f_one_b(p, m, extra_warmup=-1)


def test_the_tuner_searches_order_overlays_and_writes_one_that_replays(tmp_path):
    """Order overlays are candidates of their own (1f1b with a pipeline only); a scored one's
    trace, replayed through load(), compiles to the same plan."""
    cands = list(candidates(2, BATCH, experts=False, recipes=["1f1b", "gpipe"], zero_levels=(0,),
                            microbatches=(1, 4), chunks=(1,), warmups=(0, 1, 2)))
    overlaid = [c for c in cands if c.warmup]
    assert overlaid and all(c.recipe == "1f1b" and c.pp == 2 and c.microbatches == 4 for c in overlaid)
    assert {c.warmup for c in overlaid} == {1, 2} and "order[warm-up+1]" in overlaid[0].label()
    result = search(_program, 2, BATCH, experts=False, cost=CostModel.uniform(comm=0.3), recipes=["1f1b", "gpipe"],
                    zero_levels=(0,), microbatches=(8,), chunks=(1,), streams=(None,))
    scored = {s.candidate.warmup: s for s in result.fitting if s.candidate.recipe == "1f1b" and s.candidate.pp == 2}
    gpipe = next(s for s in result.fitting if s.candidate.recipe == "gpipe" and s.candidate.pp == 2)
    assert set(scored) == {0, 1, 2}
    assert scored[0].peak_bytes < scored[1].peak_bytes < scored[2].peak_bytes < gpipe.peak_bytes  # one more each
    # with message latency, two forwards ahead beat 1F1B's step at less memory than GPipe's
    assert scored[2].step_time < scored[0].step_time
    path = tmp_path / "w2.json"
    path.write_text(scored[2].schedule.dumps())
    replayed = compile_program(_program(2), lambda p: load(str(path)).schedule(p))
    direct = compile_program(_program(2), scored[2].candidate.schedule)
    assert replayed.plan.hash() == direct.plan.hash()


def test_a_task_that_shared_a_core_is_charged_the_core_time_it_had():
    from piper_plugin.trace_samples import _core_seconds

    spans = [(0.0, 3.0), (0.0, 3.0), (1.0, 2.0)]  # three ranks computing over [1, 2], two cores
    assert _core_seconds(0.0, 3.0, spans, cores=2) == pytest.approx(1.0 + 2 / 3 + 1.0)
    assert _core_seconds(1.0, 2.0, spans, cores=2) == pytest.approx(2 / 3)
    assert _core_seconds(0.0, 3.0, spans, cores=4) == pytest.approx(3.0)


@pytest.mark.slow
def test_calibrate_on_four_ranks_sharing_two_cores(tmp_path, capsys):
    """Four ranks on this machine's two cores: the profile names the cores, its tasks are charged
    the core time they had, and the simulator's ranks share that many cores. The pipeline jobs
    (pp=4) are predicted as the two-rank calibration's are (the median within 0.75-1.33, each
    within 0.5-2). The data-parallel jobs (dp=4) are predicted short: 0.56-0.86 in every run so far.
    In a dp=4 step the four ranks' process CPU fills only 72-91% of the two cores, and one ring
    all-reduce among four processes takes 9-11 ms where the jobs' collectives take 2.7 ms at the
    median. The ring waits for each process to be scheduled, a cost no per-collective time
    carries (docs/cli.md). This test pins that direction, a bounded under-prediction."""
    profile = tmp_path / "four.json"
    cal = _piper(capsys, "calibrate", "--ranks", "4", "--layers", str(LAYERS), "--batch", str(BATCH),
                 "--seq", str(SEQ), "--out", str(profile))
    assert cal.returncode == 0, cal.stderr[-3000:]
    data = json.loads(profile.read_text())
    cpus = os.cpu_count()
    assert data["ranks"] == 4 and data["cores"] == (cpus if cpus < 4 else None)
    ratios = {job["job"]: round(job["predicted_step_s"] / job["measured_step_s"], 3) for job in data["jobs"]}
    print(ratios)
    pipeline = [r for job, r in ratios.items() if "pp=4" in job]
    data_parallel = [r for job, r in ratios.items() if "dp=4" in job]
    assert len(pipeline) == 5 and len(data_parallel) == 4, ratios
    assert 0.75 < statistics.median(pipeline) < 1.33 and all(0.5 < r < 2.0 for r in pipeline), ratios
    if data["cores"]:
        assert all(0.35 < r < 1.1 for r in data_parallel), ratios


@pytest.mark.slow
def test_calibrate_over_an_emulated_link_measures_its_rate(tmp_path, capsys):
    """`--link 1gbit`: the calibration runs in a private network namespace whose loopback is
    limited to 1 Gbit/s (root, tc), so the messages' bytes/s is the link's, not the loopback's."""
    profile = tmp_path / "link.json"
    cal = _piper(capsys, "calibrate", "--ranks", "2", "--layers", "2", "--batch", "2", "--steps", "3",
                 "--link", "1gbit", "--out", str(profile))  # batch 2: 4 of the 9 jobs, the same messages
    assert cal.returncode == 0, cal.stderr[-3000:]
    data = json.loads(profile.read_text())
    assert data["link"] == "1gbit"
    assert 0.6 * 125e6 < 1 / data["seconds_per_byte"] < 1.2 * 125e6, data["seconds_per_byte"]  # the loopback: GB/s


def test_a_link_rate_tc_cannot_read_is_one_line(tmp_path, capsys):
    run = _piper(capsys, "calibrate", "--link", "fast", "--out", str(tmp_path / "p.json"))
    assert run.returncode == 2 and run.stderr.count("piper: error:") == 1
    assert "--link: link rate 'fast': write it as tc does, e.g. 100mbit or 1gbit" in run.stderr
