"""Megatron-LM's own ``examples/run_simple_mcore_train_loop.py``, a client nobody here wrote,
runs the same under Piper's drop-in as under Megatron's engine.

The example is vendored unmodified (tests/clients/megatron_lm/, see its README). Each run
starts 2 gloo ranks on the CPU (a fork server, as :mod:`forkserver_ranks`) that call
``apply_cpu_fixes()`` and run the example as ``__main__`` with pipeline size 2 (the textual
adaptations below, applied to a copy at run time): once as it is (Megatron's
``get_forward_backward_func``), once after ``piper_plugin.adapters.megatron.install()``, called
before the example runs its ``from megatron.core.pipeline_parallel.schedules import
get_forward_backward_func``. Both runs must print the same ``Iteration i: Losses reduced: [...]``
lines (the last pipeline stage; every digit) for all 5 iterations, leave the same gradients on
every parameter of both stages, and save and load their checkpoint.

The example never changes its weights: Megatron's DDP accumulates gradients into each
parameter's ``main_grad`` and leaves ``.grad`` None, so its ``torch.optim.Adam`` steps over no
gradient (upstream behaviour, kept). Its losses therefore test the forward and the data path;
the gradients (``main_grad``, summed over the 5 iterations, as the example never zeroes them)
test the backward.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import re
import socket
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent / "clients" / "megatron_lm" / "run_simple_mcore_train_loop.py"
EXAMPLE_SHA256 = "62b8df07025555f882a409e6c0401d6787711c53abc6a504458a463b28c06ef4"  # NVIDIA/Megatron-LM@00caa53
WORLD = 2
TIMEOUT_S = 120.0
SEED = 1234

# The run-time adaptations of the example's text: (old, new, why). Each ``old`` must occur
# exactly once in the vendored file, so a changed upstream file fails loudly here. Nothing
# else is changed; what apply_cpu_fixes() already covers on the CPU is left as it is:
# ``torch.cuda.set_device(local_rank)`` (a no-op there), ``torch.device("cuda")`` and every
# ``.to(device)`` (a CUDA device argument means the CPU under its torch function mode).
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    ('torch.distributed.init_process_group(backend="nccl",',
     'torch.distributed.init_process_group(backend="gloo",',
     "no NCCL on a CPU: gloo"),
    ("initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)",
     "initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)",
     "the example is written for tensor parallelism 2; the drop-in is a pipeline engine: pp=2"),
    ("model_parallel_cuda_manual_seed(123)",
     "model_parallel_cuda_manual_seed(123, inference_rng_tracker=True)",
     "Megatron's RNG tracker keeps torch.cuda generator states (torch.cuda.get_rng_state: no "
     "NVIDIA driver, and apply_cpu_fixes() does not answer it); its inference tracker keeps none "
     "(fork() is a no-op), so dropout draws from the CPU generator, as tests/megatron_job.py does"),
    ("        pipeline_dtype=torch.float32,\n    )",
     "        pipeline_dtype=torch.float32,\n"
     "        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),\n    )",
     "with pp=2 each rank builds num_layers / config.pipeline_model_parallel_size layers (and "
     "numbers them by it); the example's config leaves it 1, so each rank would build both layers"),
    ("        max_sequence_length=_SEQUENCE_LENGTH,\n    )",
     "        max_sequence_length=_SEQUENCE_LENGTH,\n"
     "        pre_process=parallel_state.is_pipeline_first_stage(),\n"
     "        post_process=parallel_state.is_pipeline_last_stage(),\n    )",
     "with pp=2 each rank builds only its own stage: the embedding on the first, the output "
     "layer and loss on the last"),
    ('metdata_path={"library": "null-text"}',
     'metadata_path={"library": "null"}',
     "two things stop the example's tokenizer before any training: an upstream typo (the keyword "
     "is metadata_path, at the vendored commit too; misspelt it lands in **kwargs and "
     "from_pretrained fails: TypeError('stat: path should be string, ... not NoneType')), and "
     "the installed megatron-core 0.16.1 names the null tokenizer library 'null' (the vendored "
     "commit, newer, 'null-text'); either way a NullTokenizer of vocab_size 64"),
    ("DataLoader(datasets[0], batch_size=8, shuffle=True)",
     "DataLoader(datasets[0], batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))",
     "with pp=2 the first stage reads a batch's tokens and the last its labels, each from its own "
     "DataLoader, whose shuffle draws from the global generator after the rank built its stage: "
     "the ranks would shuffle differently (tokens of one sample, labels of another); a seeded "
     "generator of its own gives both ranks the same order"),
    ("            num_microbatches=1,",
     "            num_microbatches=2,",
     "one microbatch leaves nothing to pipeline: 2 microbatches (of the example's 8 sequences "
     "each) per iteration, so both stages work at once in 1F1B"),
]

# Not a text change: megatron.core.datasets.utils.compile_helpers() runs ``make`` in the
# installed megatron/core/datasets, but the megatron-core wheel ships no Makefile there (nor
# is pybind11 installed): make fails, and compile_helpers() calls sys.exit(1) on rank 0 while
# rank 1 waits in the barrier. The wheel ships the helpers already built (helpers_cpp*.so),
# so each rank replaces compile_helpers, before the example imports it, with an import of
# that prebuilt extension.
#
# Nor is this: the checkpoint save at the example's end (dist_checkpointing's torch_dist
# strategy) writes from forked worker processes that log their memory use with psutil, which
# megatron-core does not require and which is not installed here: the workers die before
# marking their task done and the rank waits for them forever. Without psutil each rank
# replaces megatron's _process_memory() (read only for that debug log line) by a 0.
#
# And, for time only: that strategy hands its write results over a queue it makes, the first
# time, in a spawned multiprocessing Manager (a fresh interpreter that imports torch and
# Megatron: ~8 s of a 2-core machine, per rank). The example saves synchronously
# (execute_sync), in the rank's own process, so each rank gives it a plain queue.Queue first.


def adapted_source(source: str, substitutions=SUBSTITUTIONS) -> str:
    for old, new, why in substitutions:
        count = source.count(old)
        assert count == 1, f"the example has {count} occurrences of {old!r} (for: {why}); was it changed upstream?"
        source = source.replace(old, new)
    return source


def _prebuilt_helpers() -> None:
    import megatron.core.datasets.helpers_cpp  # noqa: F401 - the extension the wheel ships


def _rank(rank: int, port: int, engine: str, workdir: str, script: str, out) -> None:
    """One rank: the example run as ``__main__`` from ``script`` (its adapted text), in ``workdir``
    (where it saves its checkpoint), with ``engine`` ("megatron" or "piper"); puts
    ``(rank, report)`` with its stdout (and the error, if any) on ``out``."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "GLOO_SOCKET_IFNAME": "lo",
                       "PIPER_MEGATRON_DEVICE": "cpu"})  # the CPU path even where there is a GPU
    stdout = io.StringIO()
    report: dict = {}
    try:
        import runpy

        import torch

        torch.set_num_threads(1)
        # the example never seeds torch's CPU generator (model_parallel_cuda_manual_seed seeds
        # CUDA's and the RNG tracker's), which initialises the weights (use_cpu_initialization)
        # and draws dropout here; this torch seeds it from entropy in every process: one seed
        # for both runs, on every rank
        torch.manual_seed(SEED)
        # the example prints tensors: all their digits, not torch's default 4 decimals
        torch.set_printoptions(precision=10)
        os.chdir(workdir)
        from piper_plugin.adapters import megatron as adapter

        adapter.apply_cpu_fixes()
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = _prebuilt_helpers
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if not filesystem_async.HAVE_PSUTIL:
            filesystem_async._process_memory = lambda: 0
        filesystem_async._results_queue = queue.Queue()
        if engine == "piper":
            adapter.install()
        with contextlib.redirect_stdout(stdout):
            names = runpy.run_path(script, run_name="__main__")
        func = names["forward_backward_func"]  # the engine the example got: a function, or Piper's callable
        kind = func if hasattr(func, "__qualname__") else type(func)
        report["engine"] = f"{kind.__module__}.{kind.__qualname__}"
        # what the backward left: Megatron's DDP accumulates each gradient into the parameter's
        # main_grad (and leaves .grad None), which the example never zeroes: the sum over all
        # 5 iterations of every parameter's gradient on this rank
        report["grads"] = {name: p.main_grad.detach().clone().numpy()
                           for name, p in names["gpt_model"].named_parameters()}
    except BaseException as exc:  # noqa: BLE001 - the test sees the rank's error
        import traceback

        report["error"] = f"rank {rank} ({engine}): {exc!r}\n{traceback.format_exc()}"
    report["stdout"] = stdout.getvalue()
    out.put((rank, report))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(engine: str, workdir: Path, source: str, timeout_s: float = TIMEOUT_S) -> dict[int, dict]:
    """The example on ``WORLD`` gloo ranks; its reports by rank. Ranks still alive at the end
    (one waiting for a peer that failed) are terminated."""
    workdir.mkdir()
    script = workdir / EXAMPLE.name
    script.write_text(source)
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, engine, str(workdir), str(script), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < WORLD:
            try:
                rank, report = out.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(WORLD)) - set(reports))
                dead = [r for r in missing if procs[r].exitcode is not None]
                assert not dead, f"{engine} run: ranks {dead} exited ({[procs[r].exitcode for r in dead]}) unreported"
                assert time.monotonic() < deadline, \
                    f"{engine} run: no report from ranks {missing} within {timeout_s:.0f} s; got {reports}"
                continue
            reports[rank] = report
            assert "error" not in report, report["error"] + "\nstdout:\n" + report["stdout"]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return reports


_ITERATION = re.compile(r"^Iteration (\d+): Losses reduced: (.*)$", re.M)
_LOSS = re.compile(r"'lm loss': tensor\(([-+0-9.e]+)")


def printed_losses(stdout: str) -> dict[int, str]:
    """Iteration -> the losses it printed, as printed."""
    return {int(i): losses for i, losses in _ITERATION.findall(stdout)}


def test_the_vendored_example_is_verbatim_and_its_adaptations_apply():
    import hashlib

    text = EXAMPLE.read_bytes()
    assert hashlib.sha256(text).hexdigest() == EXAMPLE_SHA256, "the vendored example was changed; keep it verbatim"
    compile(adapted_source(text.decode()), str(EXAMPLE), "exec")


@pytest.mark.slow
def test_megatron_lm_example_runs_the_same_under_piper(tmp_path):
    import numpy as np

    source = adapted_source(EXAMPLE.read_text())
    megatron = run_example("megatron", tmp_path / "megatron", source)
    piper = run_example("piper", tmp_path / "piper", source)

    # each run used the engine it names
    assert {r["engine"] for r in megatron.values()} == {"megatron.core.pipeline_parallel.schedules."
                                                         "forward_backward_pipelining_without_interleaving"}
    assert {r["engine"] for r in piper.values()} == {"piper_plugin.adapters.megatron.schedule.PiperForwardBackward"}

    for reports in (megatron, piper):
        for rank, report in reports.items():
            assert "Successfully loaded the model" in report["stdout"], (rank, report["stdout"])
    # the first stage reports no losses; the last stage one per microbatch, 5 iterations
    assert printed_losses(megatron[0]["stdout"]) == printed_losses(piper[0]["stdout"]) == {i: "[]" for i in range(5)}
    want, got = printed_losses(megatron[1]["stdout"]), printed_losses(piper[1]["stdout"])
    assert sorted(want) == list(range(5)), megatron[1]["stdout"]
    for i in range(5):
        assert len(_LOSS.findall(want[i])) == 2, want[i]
    assert got == want, f"piper printed\n{got}\nmegatron printed\n{want}"

    # the same gradients on every parameter of both stages (each rank holds its own stage)
    for rank in range(WORLD):
        mine, theirs = piper[rank]["grads"], megatron[rank]["grads"]
        assert sorted(mine) == sorted(theirs) and mine, (rank, sorted(mine), sorted(theirs))
        assert any(np.any(g != 0) for g in theirs.values()), f"rank {rank}: no gradient at all"
        differ = [name for name in theirs if not np.array_equal(mine[name], theirs[name])]
        assert not differ, f"rank {rank}: piper's gradients differ from megatron's on {differ}"
