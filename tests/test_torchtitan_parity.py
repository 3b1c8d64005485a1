"""End to end through the real ``torchtitan.train`` entry point (torchrun, 2 gloo ranks, CPU).

The same config, seed and data run once with TorchTitan's own pipelining
(``--parallelism.pipeline_engine=torch``) and once with Piper's (``=piper``); TorchTitan's data
loader, tokenizer, AdamW, LR schedule, grad clipping and metrics stay in both. The global loss
and grad norm of every step must agree within 1e-4 relative.
"""
import pytest

pytest.importorskip("torchtitan")

from piper_plugin.adapters.torchtitan.launch import run_titan  # noqa: E402

SEED = ["--debug.seed", "42"]


def _pair(tmp_path, config, steps, extra=()):
    runs = {}
    for engine in ("torch", "piper"):
        run = run_titan(config, engine, dump_folder=tmp_path / engine, steps=steps, extra=[*SEED, *extra],
                        timeout_s=400)
        assert run.ok, f"{engine} run failed (exit {run.returncode}):\n{run.tail()}"
        assert sorted(run.losses) == list(range(1, steps + 1)), run.tail()
        runs[engine] = run
    return runs["torch"], runs["piper"]


def _close(a: dict, b: dict, rel=1e-4):
    return all(abs(a[k] - b[k]) <= rel * max(abs(a[k]), 1e-12) for k in a) and a.keys() == b.keys()


def test_llama3_1f1b_piper_matches_torch_for_10_steps(tmp_path):
    torch_run, piper_run = _pair(tmp_path, "llama3_debugmodel_pp2_1f1b", 10, ["--training.seq_len", "128"])
    assert _close(torch_run.losses, piper_run.losses), (torch_run.losses, piper_run.losses)
    assert _close(torch_run.grad_norms, piper_run.grad_norms), (torch_run.grad_norms, piper_run.grad_norms)
    assert piper_run.losses[10] < piper_run.losses[1] - 0.5  # it trains
    assert "Piper: recipe 1f1b, 2 stages on 2 ranks, 4 microbatches" in piper_run.log


def test_deepseek_v3_1f1b_piper_matches_torch_for_10_steps(tmp_path):
    torch_run, piper_run = _pair(tmp_path, "deepseek_v3_debugmodel_pp2_1f1b", 10,
                                 ["--training.seq_len", "32"])
    assert _close(torch_run.losses, piper_run.losses), (torch_run.losses, piper_run.losses)
    assert _close(torch_run.grad_norms, piper_run.grad_norms), (torch_run.grad_norms, piper_run.grad_norms)


def test_issue_command_runs_stock_config_with_the_flag(tmp_path):
    """The command of the issue: a stock config name, only the pp degree and the engine flag
    (the stock llama3_debugmodel uses Interleaved1F1B and selective AC); validation on."""
    run = run_titan("llama3_debugmodel", "piper", dump_folder=tmp_path, steps=2,
                    extra=["--parallelism.pipeline_parallel_degree", "2", "--training.seq_len", "64",
                           "--training.local_batch_size", "4", "--validator.enable",
                           "--validator.freq", "2", "--validator.steps", "1"])
    assert run.ok, run.tail()
    assert sorted(run.losses) == [1, 2], run.tail()
    assert "Piper: recipe interleaved-1f1b, 4 stages on 2 ranks" in run.log
    val = [float(line.split("loss:")[1].split()[0]) for line in run.log.splitlines() if "validate step:" in line]
    assert any(v > 1.0 for v in val), run.tail()  # the last stage's eval loss (Piper's forward-only path)
