"""TorchTitan's production flags under ``--parallelism.pipeline_engine=piper``: a flag matrix.

Each row is a group of features a TorchTitan user turns on for real runs, through
``torchtitan.train`` on 2 gloo ranks (llama3 debug, pp 2, 3 steps, seed 42, ranks forked by
:mod:`titan_fork`). The Piper engine must give the losses and grad norms of TorchTitan's own
engine within 1e-4 relative, and the artefacts the flags ask for. Rows covered elsewhere:
selective activation checkpointing (the stock configs of ``test_torchtitan_parity``), full
activation checkpointing, bf16 parameters and DCP checkpoints crossing engines
(``test_torchtitan_zero``), validation (``test_torchtitan_parity``'s issue command), DCP save /
resume (``test_torchtitan_checkpoint``); CUDA memory snapshots and CUDA graphs on CPU are
refused by name (``test_torchtitan_flag_errors``). ``--checkpoint.initial_load_path`` has its
own test below (a job that saves, then one per engine and a single-device run that start from it). Interleaved1F1B with compile was checked by hand (it
splits no backward but the last, as 1F1B).

torch.compile runs with ``--compile.backend aot_eager``: AOTAutograd's graphs with donated
buffers, the part that refuses a backward kept for a second pass, without inductor's C++ build
(minutes on this machine); ``benchmarks.compile_ab`` times inductor. TorchTitan's own DualPipeV
fails under compile (its split backward keeps the compiled graph), so Piper's compiled DualPipeV
is checked against TorchTitan's DualPipeV without compile, which computes the same gradients.
"""
from importlib.util import find_spec

import pytest

pytest.importorskip("torchtitan")

from titan_fork import run_titan_forked  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
BASE = ["--debug.seed", "42", "--training.seq_len", "32"]
COMPILE = ["--compile.enable", "--compile.backend", "aot_eager"]
ONE_PASS = "Piper: --compile.enable compiles the model's blocks"


def _close(a: dict, b: dict, rel=1e-4):
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= rel * max(abs(a[k]), 1e-12) for k in a)


def _run(tmp_path, name, config, engine, extra, nproc=2):
    run = run_titan_forked(config, engine, dump_folder=tmp_path / name, steps=STEPS, extra=[*BASE, *extra],
                           timeout_s=600, nproc=nproc)
    assert run.ok, f"{name} ({engine}) failed (exit {run.returncode}):\n{run.tail()}"
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.tail()
    return run


def _same(reference, piper):
    assert _close(reference.losses, piper.losses), (reference.losses, piper.losses)
    assert _close(reference.grad_norms, piper.grad_norms), (reference.grad_norms, piper.grad_norms)


# (row, config, TorchTitan engine's flags, Piper engine's flags, a line the Piper log must hold)
ROWS = [
    ("training-knobs", "llama3_debugmodel_pp2_1f1b",
     # microbatches of 2, gradient accumulation over 2 local batches, clipping that bites, LR
     # warmup then cosine decay; TensorBoard and the profiler on the Piper run
     ["--training.local_batch_size", "8", "--training.global_batch_size", "16",
      "--parallelism.pipeline_parallel_microbatch_size", "2", "--training.max_norm", "0.5",
      "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_type", "cosine",
      "--lr_scheduler.min_lr_factor", "0.1"],
     ["--metrics.enable_tensorboard", "--profiler.enable_profiling", "--profiler.profile_freq", "2",
      "--profiler.profiler_warmup", "0", "--profiler.profiler_active", "1"],
     "Piper: recipe 1f1b, 2 stages on 2 ranks, 4 microbatches"),
    ("compile-1f1b", "llama3_debugmodel_pp2_1f1b", COMPILE, [], ONE_PASS),
    ("compile-dualpipev", "llama3_debugmodel_ce_loss_pp2_dualpipev", ["activation-checkpoint:none"],
     COMPILE, ONE_PASS),
    # TorchTitan's float8 converter in its emulated mode (torchao casts to float8 and back) with LoRA
    # adapters on the attention projections: float8 layers and frozen base weights
    pytest.param("float8-emulated-lora", "llama3_debugmodel_float8_emulate_lora_pp2_1f1b", [], [],
                 "Piper: recipe 1f1b", marks=pytest.mark.skipif(find_spec("torchao") is None,
                                                                 reason="torchao is not installed")),
]


@pytest.mark.parametrize("row, config, both, piper_only, expect", ROWS,
                         ids=[getattr(r, "values", r)[0] for r in ROWS])
def test_flag_row_matches_torchtitan(tmp_path, row, config, both, piper_only, expect):
    tail = [f for f in both if f.startswith("activation-checkpoint:")]  # a tyro subcommand goes last
    both = [f for f in both if f not in tail]
    reference = _run(tmp_path, "torch", config, "torch", [*both, *tail])
    piper = _run(tmp_path, "piper", config, "piper", [*both, *piper_only, *tail])
    assert expect in piper.log, piper.tail()
    _same(reference, piper)
    if row == "training-knobs":
        dump = tmp_path / "piper"
        assert any((dump / "tb").rglob("events.out.tfevents.*")), sorted(p.name for p in dump.rglob("*"))
        assert any((dump / "profiling").rglob("*trace*.json*")), sorted(str(p) for p in dump.rglob("*"))
        assert "gradient accumulation steps 2" in piper.log, piper.tail()


def test_initial_load_path_starts_both_engines_and_one_device_from_the_same_weights(tmp_path):
    """``--checkpoint.initial_load_path``: a fresh job starts from another job's DCP checkpoint
    (model only, TorchTitan's default). Saved by TorchTitan's engine at step 2, loaded by each
    engine: the same losses and grad norms, and not those of a start from the seed. Loaded also by
    single-device training (1 rank, no pipeline, the whole batch at once): the Piper engine's
    losses, grad norms and, per parameter, its gradients and parameters equal that run's, under
    1F1B and under DualPipeV with the stock chunked loss."""
    from test_torchtitan_zero import assert_same_state, dump_flags

    config = "llama3_debugmodel_pp2_1f1b"
    source = _run(tmp_path, "source", config, "torch", ["--checkpoint.enable", "--checkpoint.interval", "2"])
    step2 = tmp_path / "source" / "checkpoint" / "step-2"
    assert step2.is_dir(), sorted(str(p) for p in (tmp_path / "source").rglob("*"))[:40]
    load = ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", str(step2)]
    reference = _run(tmp_path, "torch", config, "torch", load)
    piper = _run(tmp_path, "piper", config, "piper", [*load, *dump_flags(tmp_path / "piper", 1, STEPS)])
    single = _run(tmp_path, "single", config, "torch", [*load, "--parallelism.pipeline_parallel_degree", "1",
                                                        *dump_flags(tmp_path / "single", 1, STEPS)], nproc=1)
    # DualPipeV with the stock chunked loss, where TorchTitan's own split backward drops the last
    # stage's norm.weight gradient of a split microbatch (test_torchtitan_parity): Piper's is exact
    dualpipev = _run(tmp_path, "dualpipev", config, "piper", [
        *load, "--parallelism.pipeline_parallel_schedule", "DualPipeV", *dump_flags(tmp_path / "dualpipev", 1, STEPS),
        "activation-checkpoint:none"])
    assert "Piper: recipe dualpipev, 4 stages on 2 ranks" in dualpipev.log, dualpipev.tail()
    _same(reference, piper)
    _same(single, piper)
    _same(single, dualpipev)
    for run in ("piper", "dualpipev"):
        assert_same_state(tmp_path / "single" / "state", tmp_path / run / "state", steps=(1, STEPS))
    assert abs(piper.losses[1] - source.losses[1]) > 1e-3 * source.losses[1], (piper.losses, source.losses)
