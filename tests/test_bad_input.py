"""The bad-input catalogue: every command line a user can get wrong ends, before Ray or any rank
starts and within 5 s of CPU time, with exit status 2 and one ``piper: error:`` line (no traceback) that
names the offending flag, file or value and what to do instead.

Covered: ``piper plan`` and ``piper train`` (toy models, recipes, recipe files in Python and
as JSON traces), ``piper launch`` for TorchTitan and for Megatron, and the Megatron entry's own
arguments. Directive errors inside recipes are pinned in ``test_directive_errors.py``; flags a
TorchTitan trainer refuses while it builds (on its ranks) in ``test_torchtitan_flag_errors.py``.
"""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from piper_plugin.cli import main

SECONDS = 5.0

TITAN = ["--config", "llama3_debugmodel_pp2_1f1b", "--parallelism.pipeline_engine=piper", "--training.steps", "3"]
MEGATRON = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--pipeline-engine=piper"]

# checkpoint directories a case names: one that died before it was marked complete, one marked
# complete at step 3 of a 2-layer toy LM (its mark is all the checks before any rank starts read)
DIRS = {
    "ckpt-partial": {".step-5.partial/.metadata": "", "step-4/.metadata": ""},
    "ckpt-lm": {"step-3/piper.json": '{"step": 3, "plan": "0", "world": 2, "job": {"model": "toy-lm", '
                                     '"layers": 2, "seq": 32, "batch": 8, "seed": 0, "lr": 0.003}}'},
}
# files a case names by their file name; written into the test's folder
FILES = {
    "boom.py": "raise RuntimeError('boom')\n",
    "rank.py": "def recipe(sch, microbatches, **kw):\n    sch.place('PP=0', rank=7)\n",
    "norecipe.py": "x = 1\n",
    "syntax.py": "def recipe(sch, *, microbatches, chunks, zero)\n    pass\n",
    "signature.py": "def recipe(sch):\n    pass\n",
    "broken.json": '{"grid": ',
    "notrace.json": '{"grid": {"pp": 2}}',
}

PLAN = [
    (["--recipe", "nope"], "argument --recipe: invalid choice"),
    (["--pp", "0"], "argument --pp: must be a positive integer, got 0"),
    (["--pp", "two"], "argument --pp: 'two' is not an integer"),
    (["--dp", "-2"], "argument --dp: must be a positive integer, got -2"),
    (["--microbatches", "-1"], "argument --microbatches"),
    (["--microbatches", "3", "--batch", "8"], "batch 8 is not divisible by 3 microbatches"),
    (["--recipe", "dualpipev", "--microbatches", "2"], "dualpipev needs at least 2*p microbatches"),
    (["--recipe", "interleaved-1f1b", "--microbatches", "3"], "multiple of the number of pipeline ranks"),
    (["--zero", "4"], "argument --zero: invalid choice"),
    (["--model", "toy-moe", "--ep", "3"], "not divisible by ep=3"),
    (["--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
    (["--recipe-file", "missing.py"], "does not exist"),
    (["--recipe-file", "boom.py"], "RuntimeError: boom"),
    (["--recipe-file", "rank.py"], "place('PP=0'): rank 7 is out of range"),
    (["--recipe-file", "norecipe.py"], "defines no function recipe"),
    (["--recipe-file", "syntax.py"], "syntax.py': SyntaxError"),
    (["--recipe-file", "signature.py"], "define recipe(sch, *, microbatches, chunks=1, zero=0, **kw)"),
    (["--recipe-file", "broken.json"], "is not a Schedule trace"),
    (["--recipe-file", "notrace.json"], "is not a Schedule trace (KeyError: 'directives')"),
    (["--recipe-file", "lm-trace.json", "--model", "toy-moe"], "recorded on another model than this one"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

TRAIN = [
    (["--nproc", "3"], "--nproc 3 does not match the schedule's pp x dp x ep = 2 x 1 x 1 = 2 ranks"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--recipe", "nope"], "argument --recipe: invalid choice: 'nope'"),
    (["--launcher", "fork", "--address", "127.0.0.1:6379"], "--address joins a Ray cluster; it needs --launcher ray"),
    (["--address", "127.0.0.1:1"], "Ray address 127.0.0.1:1: cannot reach a Ray cluster there"),
    (["--launcher", "fork", "--batch", "9"], "split(4): batch 9 is not divisible by 4 microbatches"),
    (["--launcher", "spmd"], "--launcher spmd runs inside torchrun"),
    (["--launcher", "mpi"], "argument --launcher: invalid choice: 'mpi'"),
    (["--timeout", "0"], "argument --timeout: must be a positive number"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--recipe-file", "signature.py", "--launcher", "fork"], "signature.py"),
    (["--layers", "1"], "--layers 1: the schedule has 2 stages, at least one layer each"),
    (["--checkpoint-every", "2"], "--checkpoint-every saves into --checkpoint DIR; give that too"),
    (["--checkpoint", "boom.py"], "is a file; it names a directory"),
    (["--resume", "ckpt-partial"], "no complete checkpoint there"),
    (["--resume", "nowhere"], "no complete checkpoint there"),
    (["--resume", "ckpt-lm", "--layers", "4"], "the checkpoint trained --layers 2, not 4; drop --layers"),
    (["--resume", "ckpt-lm", "--model", "toy-moe"], "the checkpoint trained --model toy-lm, not toy-moe"),
    (["--resume", "ckpt-lm", "--steps", "3"], "is at step 3 already"),
    (["--on-nan", "ignore"], "argument --on-nan: invalid choice: 'ignore'"),
]
if not torch.cuda.is_available():
    TRAIN.append((["--device", "cuda", "--launcher", "fork"], "--device cuda needs one GPU per rank: 2 rank(s) here but 0"))

LAUNCH = [
    (["--nproc", "0", "--", *TITAN], "argument --nproc: '0' is not a number of ranks; pass --nproc N with N >= 1"),
    (["--", *TITAN], "--nproc is missing: pass the number of ranks"),
    (["--nproc", "2"], "no TorchTitan arguments: put them after --"),
    (["--nproc", "2", *TITAN], "TorchTitan's arguments go after --"),
    (["--nproc", "2", "--", "--training.steps", "3"], "--config is missing after --"),
    (["--nproc", "2", "--", "--config", "llama3_debugmodel_pp2_1f1b", "--parallelism.pipeline_engine", "pipr"],
     "--parallelism.pipeline_engine 'pipr' is not an engine: use one of torch, piper"),
    (["--nproc", "2", "--", "--config", "llama3_debugmodl_pp2_1f1b"],
     "the drop-in needs a stock config named 'llama3_debugmodl', and there is none (did you mean llama3_debugmodel"),
    (["--nproc", "2", "--", "--config", "no_such_config"], "--config 'no_such_config': not a config function"),
    (["--nproc", "2", "--address", "127.0.0.1:1", "--", *TITAN], "Ray address 127.0.0.1:1: cannot reach a Ray cluster"),
    (["--nproc", "2", "--timeout", "-1", "--", *TITAN], "--timeout"),
    (["--nproc", "2", "--host", "megatron"], "no pretrain_gpt arguments: put them after --"),
    (["--nproc", "3", "--host", "megatron", "--", *MEGATRON], "--pipeline-model-parallel-size 2 does not divide the 3 ranks"),
    (["--nproc", "2", "--host", "megatron", "--", *MEGATRON, "--num-layers", "3"],
     "--num-layers 3 does not split evenly over 2 stages"),
    (["--nproc", "2", "--host", "deepspeed", "--", *MEGATRON], "argument --host: invalid choice: 'deepspeed'"),
    (["--nproc", "2", "--host", "megatron", "--", *MEGATRON, "--data-path", "/no/such/corpus"],
     "--data-path /no/such/corpus: no /no/such/corpus.bin / /no/such/corpus.idx"),
]

ENTRY = [
    (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3 does not divide the 2 ranks"),
    (["--pipeline-model-parallel-size", "x"], "argument --pipeline-model-parallel-size: invalid int value: 'x'"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "5"], "--num-layers 5 does not split evenly"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "5", "--decoder-first-pipeline-num-layers", "5"],
     "leaves 0 layers for 1 middle stages"),
    (["--global-batch-size", "7"], "--global-batch-size 7 is not a multiple"),
    (["--piper-recipe", "1f1b"], "add --pipeline-engine=piper"),
    (["--piper-trace-memory", "--pipeline-engine=piper"], "--piper-trace-memory records into the step trace: add "
                                                          "--piper-trace DIR"),
    (["--expert-model-parallel-size", "2"], "without --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 exceeds --num-experts 4"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"),
    (["--sequence-parallel"], "--sequence-parallel splits the sequence over the tensor-parallel ranks"),
    (["--bf16"], "--bf16: this entry builds float32 models"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--pipeline-engine", "deepspeed"], "invalid choice: 'deepspeed'"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be a positive integer"),
    (["--hidden-size", "-64"], "--hidden-size -64: must be a positive integer"),
    (["--hidden-size", "66"], "--hidden-size 66 is not a multiple of --num-attention-heads"),
    (["--save-interval", "5"], "--save-interval without --save"),
    (["--data-parallel-size", "4"], "--data-parallel-size 4"),
    (["--data-path", "/no/such/corpus"], "--data-path /no/such/corpus: no /no/such/corpus.bin"),
    (["--tokenizer-file", "/no/such/tokenizer.json"], "--tokenizer-file /no/such/tokenizer.json: no such file"),
    (["--piper-zero", "2"], "--piper-zero 2 is Piper's ZeRO inside Piper's plan; add --pipeline-engine=piper"),
    (["--piper-zero", "4", "--pipeline-engine=piper"], "--piper-zero 4: the level is 1, 2 or 3"),
    (["--piper-zero", "3", "--pipeline-engine=piper", "--pipeline-model-parallel-size", "2"],
     "--piper-zero 3 with data-parallel size 1"),
    (["--piper-zero", "2", "--pipeline-engine=piper", "--use-distributed-optimizer"],
     "drop --use-distributed-optimizer"),
    (["--eval-interval", "5"], "--eval-interval 5 without --eval-iters"),
    (["--eval-iters", "2", "--split", "100,0,0"], "--eval-iters 2 with --split 100,0,0: no document is for validation"),
    (["--split", "90,10"], "--split 90,10: give three non-negative weights"),
]
ENTRY_BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2"]

CASES = ([("plan", a, m) for a, m in PLAN] + [("train", a, m) for a, m in TRAIN]
         + [("launch", a, m) for a, m in LAUNCH] + [("megatron", a, m) for a, m in ENTRY])


def _files(folder: Path) -> dict[str, Path]:
    paths = {}
    for name, text in FILES.items():
        paths[name] = folder / name
        paths[name].write_text(text)
    for name, content in DIRS.items():
        paths[name] = folder / name
        for relative, text in content.items():
            (paths[name] / relative).parent.mkdir(parents=True, exist_ok=True)
            (paths[name] / relative).write_text(text)
    paths["lm-trace.json"] = folder / "lm-trace.json"  # a trace recorded on the toy LM (4 stages)
    paths["lm-trace.json"].write_text(_lm_trace())
    return paths


def _lm_trace() -> str:
    from piper_plugin import Schedule, capture
    from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
    from piper_plugin.recipes import apply_recipe

    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=4, layers=4)
    tokens, targets = lm_batch(cfg, 8)
    sch = Schedule(capture(model, lm_loss, (tokens,), targets), pp=2)
    apply_recipe(sch, "interleaved-1f1b", microbatches=4, chunks=2)
    return sch.dumps()


def _run(command: str, argv: list[str], monkeypatch) -> int:
    if command == "megatron":
        from piper_plugin.adapters.megatron.pretrain_gpt import main as entry

        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        return entry(ENTRY_BASE + argv)  # a repeated argument: the last one counts
    return main([command, *argv])


def test_the_catalogue_is_large_and_distinct():
    assert len(CASES) >= 40
    assert len({(c, tuple(a)) for c, a, _ in CASES}) == len(CASES)


def _tiered(cases):
    """The first two lines of each command stay in the fast tier; the rest are ``slow``."""
    seen: dict[str, int] = {}
    out = []
    for command, argv, message in cases:
        seen[command] = seen.get(command, 0) + 1
        marks = () if seen[command] <= 2 else (pytest.mark.slow,)
        out.append(pytest.param(command, argv, message, marks=marks, id=f"{command}:{' '.join(argv)[-40:]}"))
    return out


@pytest.mark.parametrize("command, argv, message", _tiered(CASES))
def test_bad_input_ends_in_one_line_before_anything_starts(command, argv, message, tmp_path, capsys, monkeypatch):
    files = _files(tmp_path) if any(a in FILES or a in DIRS or a.endswith(".json") for a in argv) else {}
    capsys.readouterr()
    argv = [str(files[a]) if a in files else str(tmp_path / a) if a.endswith((".py", ".json")) or a == "nowhere"
            else a for a in argv]
    start, wall = time.process_time(), time.monotonic()  # CPU time: what the checks cost, however busy the machine
    code = _run(command, argv, monkeypatch)
    elapsed, waited = time.process_time() - start, time.monotonic() - wall
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("piper: error: ") and message in lines[0], err
    assert elapsed < SECONDS, f"{elapsed:.1f} s of CPU time before the error"
    assert waited < 60, f"{waited:.0f} s before the error: something waited (a hang guard, not a speed check)"
    assert not multiprocessing.active_children(), "a rank process was started"
    assert not _ray_started(), "Ray was started"


def _ray_started() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
