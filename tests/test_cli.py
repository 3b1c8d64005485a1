"""`piper plan`: every recipe, DP x ZeRO, EP, recipe files, outputs and one-line errors."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from piper_plugin import capture
from piper_plugin.api.schedule import Schedule
from piper_plugin.cli import main
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin.recipes import RECIPES, apply_recipe

TEXTBOOK = {  # PIPER.md at p=2, m=4, v=2 with F=1, B=2, W=1
    "gpipe": "(p-1)/(m+p-1) = 1/5 = 20.0%",
    "1f1b": "(p-1)/(m+p-1) = 1/5 = 20.0%",
    "interleaved-1f1b": "(p-1)/(v*m+p-1) = 1/9 = 11.1%",
    "zb-h1": "idle (p-1)(F+B-2W) = 1 per rank = 7.7%",
    "dualpipev": "idle (p-1)(F&B+B-3W), F&B=F+B = 2 per rank = 7.7%",
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def field(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name))


def memory_row(out: str, rank: str) -> list[str]:
    table = out[out.index("peak memory per rank"):].splitlines()[2:]
    return next(row.split() for row in table if row.split()[0] == rank)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_at_pp2(capsys, recipe):
    code, out, err = run(capsys, "--recipe", recipe, "--pp", "2", "--microbatches", "4")
    assert code == 0 and err == ""
    assert f"schedule {recipe}, 4 microbatches, batch 8" in out
    assert "rank 0" in out and "rank 1" in out
    assert re.search(r"^t=0\s+0F0$", out, re.M)  # time-aligned grid, rank 1 idle at t=0
    bubble = field(out, "bubble")
    assert TEXTBOOK[recipe] in bubble
    simulated = float(bubble.split()[1].rstrip("%"))
    assert 0 < simulated < 25
    if recipe in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):  # the simulator meets the textbook
        assert bubble.split()[1] == bubble.split()[-1]
    assert re.match(r"step time\s+\d+ units", field(out, "step time"))
    row = memory_row(out, "0")
    assert len(row) == 11 and row[2] in ("KiB", "MiB")  # rank, 5 x (number, unit)


def test_dp2_zero3_shards_state(capsys):
    code, out0, _ = run(capsys, "--dp", "2", "--zero", "0")
    assert code == 0
    code, out3, err = run(capsys, "--dp", "2", "--zero", "3")
    assert code == 0 and err == ""
    assert "pp=2 dp=2 ep=1 (4 ranks)" in out3 and "zero 3" in out3
    assert "ranks 0-1" in out3.splitlines()[4]  # replicas share a grid column
    full, sharded = memory_row(out0, "0-1"), memory_row(out3, "0-1")
    for col in (1, 3, 5):  # params, grads, optimizer halve over dp=2
        assert sharded[col + 1] == full[col + 1]
        assert float(sharded[col]) == pytest.approx(float(full[col]) / 2, rel=0.02)


def test_toy_moe_with_expert_parallelism(capsys):
    code, out, err = run(capsys, "--model", "toy-moe", "--ep", "2", "--recipe", "gpipe")
    assert code == 0 and err == ""
    assert out.startswith("model   toy-moe") and "ep=2 (4 ranks)" in out and "batch 16" in out
    assert "0.1F0" in out and "1.1B3" in out  # expert regions are their own chunks
    assert TEXTBOOK["gpipe"] in field(out, "bubble")


def test_outputs_are_written(capsys, tmp_path):
    trace, png, plan = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "plan.json"
    code, out, _ = run(capsys, "--recipe", "zb-h1", "--trace", str(trace), "--png", str(png), "--json", str(plan))
    assert code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(plan.read_text())
    assert sum(e["ph"] == "X" for e in events) == len(data["nodes"])  # one span per task of the plan
    assert data["grid"] == {"pp": 2, "dp": 1, "ep": 1} and data["microbatches"] == 4
    assert "0BW3" in data["ranks"][0]["streams"]["compute"]
    assert all(str(p) in out for p in (trace, png, plan))


def test_cpu_cost_model(capsys):
    code, out, _ = run(capsys, "--cost", "cpu")
    assert code == 0
    assert "s (cpu estimate)" in field(out, "step time")
    assert re.search(r"^step 00\s+0F0\s+1F0$", out, re.M)  # task-order grid


RECIPE_PY = '''
def recipe(sch, microbatches, **kw):
    sch.place("PP=0", rank=0)
    sch.place("PP=1", rank=1)
    sch.replicate("*", zero=kw["zero"])
    sch.split(microbatches)
    m = range(microbatches)
    sch.order_per_rank({0: [f"0F{i}" for i in m] + [f"0B{i}" for i in m],
                        1: [k for i in m for k in (f"1F{i}", f"1B{i}")]})
'''


def test_recipe_file_python(capsys, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(RECIPE_PY)
    code, out, err = run(capsys, "--recipe-file", str(path), "--zero", "1")
    assert code == 0 and err == ""
    assert "schedule mine.py" in out and "zero 1" in out
    assert re.search(r"^t=4\s+0B0\s+1F1$", out, re.M)  # rank 0 runs all forwards first
    assert field(out, "bubble").split()[1] == "20.0%"


def test_recipe_file_json_trace_replays_the_recipe(capsys, tmp_path):
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=4, layers=4)
    tokens, targets = lm_batch(cfg, 8)
    sch = Schedule(capture(model, lm_loss, (tokens,), targets), pp=2)
    apply_recipe(sch, "interleaved-1f1b", microbatches=4, chunks=2)
    path = tmp_path / "trace.json"
    path.write_text(sch.dumps())
    code, replayed, err = run(capsys, "--recipe-file", str(path))
    assert code == 0 and err == ""
    code, builtin, _ = run(capsys, "--recipe", "interleaved-1f1b")
    assert field(replayed, "plan") == field(builtin, "plan")  # same tasks, same plan hash
    assert "schedule trace.json" in replayed
    grid = lambda out: out[out.index("\n\n"):out.index("step time")]  # noqa: E731
    assert grid(replayed) == grid(builtin)


def test_unknown_command_is_one_line_error(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("piper: error: ") and "'plan'" in err[0]


def test_host_commands_come_from_entry_points_not_imports(capsys):
    """`piper launch` is the TorchTitan adapter's, registered through piper_plugin.commands;
    no module of the engine's CLI imports an adapter."""
    import ast
    from importlib.metadata import entry_points

    import piper_plugin.cli as cli

    points = {p.name: p.value for p in entry_points(group=cli.COMMANDS_GROUP)}
    assert points.get("launch") == "piper_plugin.adapters.torchtitan.ray_launch:add_launch_parser"
    assert main(["--help"]) == 0
    assert re.search(r"^\s+launch\s+run TorchTitan's trainer", capsys.readouterr().out, re.M)
    for name in ("cli", "cli_train", "cli_args"):
        tree = ast.parse((Path(cli.__file__).parent / f"{name}.py").read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and ".adapters" in m], (name, imported)
        assert "piper_plugin.cli" not in imported, (name, imported)  # cli imports cli_train, not back


@pytest.mark.slow
def test_console_script():
    exe = Path(sys.executable).with_name("piper")
    exe = str(exe) if exe.exists() else shutil.which("piper")
    if exe is None:
        pytest.skip("the piper console script is not installed (pip install -e .)")
    proc = subprocess.run([exe, "plan", "--recipe", "1f1b", "--pp", "4", "--microbatches", "8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "bubble     27.3%   textbook (p-1)/(m+p-1) = 3/11 = 27.3%" in proc.stdout
    assert "rank 3" in proc.stdout


def test_a_trace_fixes_its_flags_and_a_contradicting_flag_is_named(capsys, tmp_path):
    """``--recipe-file trace.json`` goes through ``recipes.load``: the trace's grid and
    microbatches hold; a flag that contradicts them is a one-line error naming both values."""
    with torch.device("meta"):
        model, cfg = build_toy_lm(stages=2, layers=2)
    tokens, targets = lm_batch(cfg, 8)
    sch = Schedule(capture(model, lm_loss, (tokens,), targets), pp=2)
    apply_recipe(sch, "1f1b", microbatches=4)
    path = tmp_path / "t.json"
    path.write_text(sch.dumps())
    code, out, err = run(capsys, "--recipe-file", str(path), "--microbatches", "4")
    assert code == 0 and "4 microbatches" in out
    code, out, err = run(capsys, "--recipe-file", str(path), "--pp", "4")
    assert code == 2 and "pp 4 conflicts with the trace 't.json' (pp=2)" in err
