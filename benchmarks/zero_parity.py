"""PP x ZeRO inside TorchTitan, every cell: Piper's ZeRO 1-3 x schedule x model against TorchTitan.

Each cell is a real ``torchtitan.train`` job on 4 ranks (pipeline 2 x
``data_parallel_shard_degree`` 2) under the Piper engine with ``--piper.zero L`` and a pipeline
schedule, compared with one job of TorchTitan's own engine with FSDP on the same config, seed,
data and batch: its 1F1B run. A schedule never changes the result, so one reference per model
serves every schedule (TorchTitan's own DualPipeV is not one: with the chunked loss it drops a
gradient, docs/torchtitan.md). Per cell: the worst relative difference over the steps of the
loss and of the grad norm (both as TorchTitan logs them), and whether both are within the
tolerance. Too long for the test suite (about 20 jobs); ``tests/test_torchtitan_zero.py`` runs a
subset of the cells.

    python -m benchmarks.zero_parity --out benchmarks/results/zero_parity.md
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from piper_plugin.adapters.torchtitan import run_titan

from benchmarks._common import code_version, command_line, markdown_table, write_result

MODELS = {"llama3": ("llama3_debugmodel_pp2_1f1b", 4), "deepseek_v3": ("deepseek_v3_debugmodel_pp2_1f1b", 2)}
SCHEDULES = ("1F1B", "Interleaved1F1B", "DualPipeV")


def worst_relative(reference: dict[int, float], run: dict[int, float]) -> float:
    """The largest |run - reference| / |reference| over the reference's steps (inf if a step is missing)."""
    if sorted(run) != sorted(reference) or not reference:
        return float("inf")
    return max(abs(run[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in reference)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--zero", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/zero_parity.md"))
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()  # before the runs: they run the code as it is now
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero_parity_") as tmp:
        for model in args.models:
            config, batch = MODELS[model]
            base = ["--debug.seed", "42", "--training.seq_len", "32", "--training.local_batch_size", str(batch),
                    "--parallelism.data_parallel_shard_degree", "2"]
            reference = run_titan(config, "torch", dump_folder=Path(tmp) / f"{model}-torch", nproc=4,
                                  steps=args.steps, extra=base, timeout_s=1200)
            if not reference.ok:
                raise SystemExit(f"{model}: TorchTitan's run failed:\n{reference.tail()}")
            for schedule in args.schedules:
                for zero in args.zero:
                    run = run_titan(config, "piper", dump_folder=Path(tmp) / f"{model}-{schedule}-{zero}", nproc=4,
                                    steps=args.steps, timeout_s=1200,
                                    extra=[*base, "--parallelism.pipeline_parallel_schedule", schedule,
                                           "--piper.zero", str(zero)])
                    loss = worst_relative(reference.losses, run.losses) if run.ok else float("inf")
                    norm = worst_relative(reference.grad_norms, run.grad_norms) if run.ok else float("inf")
                    row = dict(model=model, schedule=schedule, zero=zero, loss=loss, grad_norm=norm,
                               ok=run.ok and max(loss, norm) <= args.tolerance,
                               error="" if run.ok else run.tail().strip().splitlines()[-1][:160])
                    rows.append(row)
                    print(f"{model} {schedule} ZeRO-{zero}: loss {loss:.2e} grad norm {norm:.2e} "
                          f"{'ok' if row['ok'] else 'FAIL ' + row['error']}", flush=True)
    table = markdown_table(["model", "schedule", "ZeRO", "loss", "grad norm", "within"],
                           [[r["model"], r["schedule"], r["zero"], f"{r['loss']:.1e}", f"{r['grad_norm']:.1e}",
                             "yes" if r["ok"] else f"NO {r['error']}"] for r in rows])
    write_result(args.out, "zero_parity.md", (
        f"# PP x ZeRO inside TorchTitan: Piper's ZeRO against TorchTitan's FSDP, every cell\n\n"
        f"Command: `{command_line('zero_parity', args, parser)}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, gloo, 4 ranks "
        f"started by torchrun with 1 torch thread each; {version}\n\n"
        f"Worst relative difference over {args.steps} steps from TorchTitan's own engine with FSDP (its 1F1B "
        f"run of the same config, seed and data; pp 2 x data_parallel_shard_degree 2), tolerance "
        f"{args.tolerance:g}.\n\n{table}\n"))
    return rows


if __name__ == "__main__":
    main()
