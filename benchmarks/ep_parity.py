"""Expert parallelism inside TorchTitan, every schedule: Piper's engine against TorchTitan's own.

Each cell is a real ``torchtitan.train`` job on 4 ranks (pipeline 2 x
``data_parallel_shard_degree`` 2 x ``expert_parallel_degree`` 2: each rank holds half of every
MoE layer's experts) of the deepseek_v3 debug model on plain cross-entropy, under the Piper
engine (``--piper.zero 2`` for the dense part: MoE stages as pieces around their token
hand-offs, the all-to-alls as the plan's ALL_TO_ALL nodes) and under TorchTitan's own engine
(FSDP with reshard ``never``, its all-to-all dispatcher), same seed, data and schedule. With 2
tokens per microbatch and top-3 routing over 8 experts, at least 2 experts of every MoE layer
get no token in every microbatch. Per cell: the worst relative difference over the steps of the
loss and of the grad norm (as TorchTitan logs them: 5 and 4 decimals) and whether both are
within the tolerance. ``tests/test_torchtitan_ep.py`` runs two of the cells.

    python -m benchmarks.ep_parity --out benchmarks/results/ep_parity.md
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
from benchmarks.zero_parity import add_parity_args, cell_line, compare

CONFIG = "deepseek_v3_debugmodel_ce_loss"
SCHEDULES = ("1F1B", "Interleaved1F1B", "DualPipeV")


def cell_flags(schedule: str, seq_len: int = 2) -> list[str]:
    """Both engines' flags for one schedule (the tyro subcommand last)."""
    return ["--debug.seed", "42", "--training.seq_len", str(seq_len), "--training.local_batch_size", "4",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
            "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
            "--parallelism.fsdp_reshard_after_forward", "never"]


def run_cell(schedule: str, steps: int, folder: Path, seq_len: int = 2, config: str = CONFIG):
    """(TorchTitan's run, Piper's run) of one schedule."""
    flags, tail = cell_flags(schedule, seq_len), ["activation-checkpoint:none"]
    reference = run_titan(config, "torch", dump_folder=folder / f"{schedule}-torch", nproc=4, steps=steps,
                          extra=[*flags, *tail], timeout_s=1200)
    piper = run_titan(config, "piper", dump_folder=folder / f"{schedule}-piper", nproc=4, steps=steps,
                      extra=[*flags, "--piper.zero", "2", *tail], timeout_s=1200)
    return reference, piper


def run_control(schedule: str, steps: int, folder: Path, seq_len: int, config: str):
    """(TorchTitan with experts over 2 ranks, TorchTitan with every expert on every rank): the
    same engine, mathematically the same step; how far it moves is the model's own numerical
    sensitivity to the expert layout, the scale to read Piper's difference against."""
    flags, tail = cell_flags(schedule, seq_len), ["activation-checkpoint:none"]
    whole = list(flags)
    whole[whole.index("--parallelism.expert_parallel_degree") + 1] = "1"
    split = run_titan(config, "torch", dump_folder=folder / f"{schedule}-torch-ep2", nproc=4, steps=steps,
                      extra=[*flags, *tail], timeout_s=1200)
    replicated = run_titan(config, "torch", dump_folder=folder / f"{schedule}-torch-ep1", nproc=4, steps=steps,
                           extra=[*whole, *tail], timeout_s=1200)
    return split, replicated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--seq-len", type=int, default=2)
    parser.add_argument("--config", default=CONFIG, help="any TorchTitan MoE config (e.g. qwen3_moe_debug)")
    parser.add_argument("--control", action="store_true",
                        help="per schedule also compare TorchTitan's engine with itself, experts over 2 ranks "
                             "against experts on every rank (expert_parallel_degree 1)")
    add_parity_args(parser, "ep_parity")
    return parser


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()  # before the runs: they run the code as it is now
    rows = []
    with tempfile.TemporaryDirectory(prefix="ep_parity_") as tmp:
        for schedule in args.schedules:
            row = dict(schedule=schedule, **compare(*run_cell(schedule, args.steps, Path(tmp), args.seq_len, args.config),
                                                    args.tolerance))
            rows.append(row)
            print(f"{schedule}: {cell_line(row)}", flush=True)
            if args.control:
                row = dict(schedule=f"{schedule}: TorchTitan ep 2 vs ep 1",
                           **compare(*run_control(schedule, args.steps, Path(tmp), args.seq_len, args.config),
                                     args.tolerance))
                rows.append(row)
                print(f"{row['schedule']}: {cell_line(row)}", flush=True)
    table = markdown_table(["schedule", "loss", "grad norm", "within"],
                           [[r["schedule"], f"{r['loss']:.1e}", f"{r['grad_norm']:.1e}",
                             "yes" if r["ok"] else f"NO {r['error']}"] for r in rows])
    write_result(args.out, "ep_parity.md", (
        f"# Expert parallelism inside TorchTitan: Piper's engine against TorchTitan's, every schedule\n\n"
        f"Command: `{command_line('ep_parity', args, parser)}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, gloo, 4 ranks "
        f"started by torchrun with 1 torch thread each; {version}\n\n"
        f"Worst relative difference over {args.steps} steps from TorchTitan's own engine on {args.config} (pp 2 x "
        f"data_parallel_shard_degree 2 x expert_parallel_degree 2; Piper ZeRO-2 for the dense part, TorchTitan FSDP "
        f"with reshard `never`; {args.seq_len} tokens per microbatch"
        f"{', top-3 of 8 experts: experts left empty in every microbatch' if args.config == CONFIG else ''}), "
        f"as TorchTitan logs them (loss 5 decimals, grad norm 4), tolerance {args.tolerance:g}"
        f"{'; a control row compares TorchTitan with itself, expert_parallel_degree 2 against 1 (mathematically the same step)' if args.control else ''}"
        f".\n\n{table}\n"))
    return rows


if __name__ == "__main__":
    main()
