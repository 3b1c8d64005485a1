"""Tensor parallelism inside TorchTitan's stages, every cell: the Piper engine against TorchTitan's own.

Each cell is a pair of real ``torchtitan.train`` jobs (pipeline 2 x ``tensor_parallel_degree`` 2,
sequence parallel on; 4 ranks, or 8 with ``data_parallel_replicate_degree`` 2) on the same config,
seed, data and schedule, one per engine. Compared per cell: the loss and grad norm of every step
as TorchTitan logs them, and with ``--piper.dump_state`` every gradient (first step) and parameter
(first and last step), whole by name and as each process's local shard by name. DualPipeV runs
the plain cross-entropy configs (TorchTitan's own DualPipeV drops a gradient with the chunked
loss: docs/torchtitan.md). ``tests/test_torchtitan_tp.py`` runs the llama3 1F1B cell (and a
checkpoint resumed across engines) in the suite.

    python -m benchmarks.tp_parity --out benchmarks/results/tp_parity.md
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from piper_plugin.adapters.torchtitan import run_titan, state_differences

from benchmarks._common import code_version, command_line, markdown_table, write_result
from benchmarks.zero_parity import add_parity_args, cell_config, worst_relative

MODELS = {"llama3": 4, "deepseek_v3": 2}  # local batch (DualPipeV takes at least 4)
SCHEDULES = ("1F1B", "Interleaved1F1B", "DualPipeV")


def cells(models: Sequence[str], schedules: Sequence[str], replicate: bool) -> list[tuple[str, str, int]]:
    """(model, schedule, data_parallel_replicate_degree) of every cell asked for."""
    out = [(m, s, 1) for m in models for s in schedules]
    if replicate and "llama3" in models and "1F1B" in schedules:
        out.append(("llama3", "1F1B", 2))
    return out


def run_cell(tmp: Path, model: str, schedule: str, replicas: int, steps: int, tolerance: float) -> dict:
    config, flags, tail = cell_config(model, schedule)
    batch = max(MODELS[model], 4) if schedule == "DualPipeV" else MODELS[model]
    nproc = 4 * replicas
    base = ["--debug.seed", "42", "--training.seq_len", "32", "--training.local_batch_size", str(batch),
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.data_parallel_replicate_degree", str(replicas),
            "--piper.dump_steps", "1", str(steps)]
    runs, dumps = {}, {}
    for engine in ("torch", "piper"):
        folder = tmp / f"{model}-{schedule}-{replicas}-{engine}"
        dumps[engine] = folder / "state"
        runs[engine] = run_titan(config, engine, dump_folder=folder, nproc=nproc, steps=steps, timeout_s=1200,
                                 extra=[*base, *flags, "--piper.dump_state", str(dumps[engine]), *tail])
    reference, run = runs["torch"], runs["piper"]
    if run.ok and "Piper: recipe" not in run.log:  # the flag fell back to TorchTitan's engine
        run.returncode = 1
        run.log += "\nthe Piper engine did not run (no 'Piper: recipe' line)"
    row = dict(model=model, schedule=schedule, ranks=nproc, loss=float("inf"), grad_norm=float("inf"),
               params=float("inf"), grads=float("inf"), ok=False, error="")
    if not (reference.ok and run.ok):
        failed = reference if not reference.ok else run
        row["error"] = failed.tail().strip().splitlines()[-1][:160]
        return row
    row["loss"] = worst_relative(reference.losses, run.losses)
    row["grad_norm"] = worst_relative(reference.grad_norms, run.grad_norms)
    try:
        worst = state_differences(dumps["torch"], dumps["piper"], (1, steps), processes=nproc)
    except ValueError as exc:
        row["error"] = str(exc)[:160]
        return row
    row["params"] = max(worst["params"], worst["local params"])
    row["grads"] = max(worst["grads"], worst["local grads"])
    row["ok"] = max(row["loss"], row["grad_norm"], row["params"], row["grads"]) <= tolerance
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--no-replicate", dest="replicate", action="store_false",
                        help="leave out the 8-rank cell with data_parallel_replicate_degree 2")
    add_parity_args(parser, "tp_parity")
    parser.set_defaults(steps=3)
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()  # before the runs: they run the code as it is now
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp_parity_") as tmp:
        for model, schedule, replicas in cells(args.models, args.schedules, args.replicate):
            row = run_cell(Path(tmp), model, schedule, replicas, args.steps, args.tolerance)
            rows.append(row)
            print(f"{model} {schedule} {row['ranks']} ranks: loss {row['loss']:.1e} grad norm {row['grad_norm']:.1e} "
                  f"params {row['params']:.1e} grads {row['grads']:.1e} {'ok' if row['ok'] else 'FAIL ' + row['error']}",
                  flush=True)
    table = markdown_table(
        ["model", "schedule", "ranks", "loss", "grad norm", "parameters", "gradients", "within"],
        [[r["model"], r["schedule"], r["ranks"], f"{r['loss']:.1e}", f"{r['grad_norm']:.1e}", f"{r['params']:.1e}",
          f"{r['grads']:.1e}", "yes" if r["ok"] else f"NO {r['error']}"] for r in rows])
    write_result(args.out, "tp_parity.md", (
        f"# Tensor parallelism inside TorchTitan's stages: the Piper engine against TorchTitan's own\n\n"
        f"Command: `{command_line('tp_parity', args, parser)}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, gloo, ranks "
        f"started by torchrun with 1 torch thread each; {version}\n\n"
        f"Pipeline 2 x tensor_parallel_degree 2 (sequence parallel on), 8 ranks adding "
        f"data_parallel_replicate_degree 2; seq 32, {args.steps} steps. Worst relative difference from TorchTitan's "
        f"own engine on the same config, seed, data and schedule: loss and grad norm of every step as TorchTitan "
        f"logs them (5 and 4 decimals); parameters after steps 1 and {args.steps} and gradients of those steps, each "
        f"max |piper - torch| / max |torch| per tensor, whole by name and each process's local shard by name. "
        f"DualPipeV: plain cross-entropy configs, local batch 4. Tolerance {args.tolerance:g}.\n\n{table}\n"))
    return rows


if __name__ == "__main__":
    main()
