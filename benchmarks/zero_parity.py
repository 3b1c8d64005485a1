"""PP x ZeRO inside TorchTitan, every cell: Piper's ZeRO 1-3 x schedule x model against TorchTitan.

Each cell is a real ``torchtitan.train`` job on 4 ranks (pipeline 2 x
``data_parallel_shard_degree`` 2) under the Piper engine with ``--piper.zero L`` and a pipeline
schedule, compared with one job of TorchTitan's own engine with FSDP on the same config, seed,
data, batch and schedule (the schedule decides the stage split, hence how the seed initialises
the weights). For DualPipeV the reference is TorchTitan's with ``fsdp_reshard_after_forward
never``, and llama3 runs its plain cross-entropy config: TorchTitan's own DualPipeV drops a
gradient with the chunked loss and changes the gradients with reshard ``always``
(docs/torchtitan.md). Per cell: the worst relative difference over the steps of the loss and of
the grad norm (both as TorchTitan logs them: 5 and 4 decimals), and whether both are within the
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


def cell_config(model: str, schedule: str) -> tuple[str, list[str], list[str]]:
    """(config, flags, trailing subcommand flags) of one model and schedule, for both engines."""
    config, _ = MODELS[model]
    flags = ["--parallelism.pipeline_parallel_schedule", schedule]
    if schedule != "DualPipeV":
        return config, flags, []
    flags += ["--parallelism.fsdp_reshard_after_forward", "never"]
    # plain cross-entropy: TorchTitan's split backward drops the chunked loss's norm.weight gradient
    ce_loss = {"llama3": "llama3_debugmodel_ce_loss", "deepseek_v3": "deepseek_v3_debugmodel_ce_loss"}[model]
    return ce_loss, [*flags, "--parallelism.pipeline_parallel_degree", "2"], ["activation-checkpoint:none"]


def worst_relative(reference: dict[int, float], run: dict[int, float]) -> float:
    """The largest |run - reference| / |reference| over the reference's steps (inf if a step is missing)."""
    if sorted(run) != sorted(reference) or not reference:
        return float("inf")
    return max(abs(run[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in reference)


def compare(reference, run, tolerance: float) -> dict:
    """One cell: worst relative loss and grad-norm differences of ``run`` from ``reference``
    (inf where a job failed), whether both are within ``tolerance``, and the failing line."""
    ok = reference.ok and run.ok
    loss = worst_relative(reference.losses, run.losses) if ok else float("inf")
    norm = worst_relative(reference.grad_norms, run.grad_norms) if ok else float("inf")
    failed = reference if not reference.ok else run
    return dict(loss=loss, grad_norm=norm, ok=ok and max(loss, norm) <= tolerance,
                error="" if ok else failed.tail().strip().splitlines()[-1][:160])


def add_parity_args(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every parity matrix takes: steps per job, tolerance, results file."""
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{name}.md"))


def cell_line(row: dict) -> str:
    """A compared cell as the progress line both matrices print."""
    return f"loss {row['loss']:.2e} grad norm {row['grad_norm']:.2e} {'ok' if row['ok'] else 'FAIL ' + row['error']}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--zero", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    add_parity_args(parser, "zero_parity")
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()  # before the runs: they run the code as it is now
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero_parity_") as tmp:
        for model in args.models:
            for schedule in args.schedules:
                config, flags, tail = cell_config(model, schedule)
                # TorchTitan's DualPipeV wants at least as many microbatches as stages (4)
                batch = max(MODELS[model][1], 4) if schedule == "DualPipeV" else MODELS[model][1]
                base = ["--debug.seed", "42", "--training.seq_len", "32", "--training.local_batch_size", str(batch),
                        "--parallelism.data_parallel_shard_degree", "2"]
                reference = run_titan(config, "torch", dump_folder=Path(tmp) / f"{model}-{schedule}-torch", nproc=4,
                                      steps=args.steps, extra=[*base, *flags, *tail], timeout_s=1200)
                for zero in args.zero:
                    run = run_titan(config, "piper", dump_folder=Path(tmp) / f"{model}-{schedule}-{zero}", nproc=4,
                                    steps=args.steps, timeout_s=1200,
                                    extra=[*base, *flags, "--piper.zero", str(zero), *tail])
                    row = dict(model=model, schedule=schedule, zero=zero, **compare(reference, run, args.tolerance))
                    rows.append(row)
                    print(f"{model} {schedule} ZeRO-{zero}: {cell_line(row)}", flush=True)
    table = markdown_table(["model", "schedule", "ZeRO", "loss", "grad norm", "within"],
                           [[r["model"], r["schedule"], r["zero"], f"{r['loss']:.1e}", f"{r['grad_norm']:.1e}",
                             "yes" if r["ok"] else f"NO {r['error']}"] for r in rows])
    write_result(args.out, "zero_parity.md", (
        f"# PP x ZeRO inside TorchTitan: Piper's ZeRO against TorchTitan's FSDP, every cell\n\n"
        f"Command: `{command_line('zero_parity', args, parser)}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, gloo, 4 ranks "
        f"started by torchrun with 1 torch thread each; {version}\n\n"
        f"Worst relative difference over {args.steps} steps from TorchTitan's own engine with FSDP on the "
        f"same config, seed, data and schedule (pp 2 x data_parallel_shard_degree 2; DualPipeV: TorchTitan "
        f"with reshard `never`, plain cross-entropy, local batch at least 4), as TorchTitan logs them (loss 5 decimals, "
        f"grad norm 4), tolerance {args.tolerance:g}.\n\n{table}\n"))
    return rows


if __name__ == "__main__":
    main()
