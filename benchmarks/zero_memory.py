"""PP x ZeRO inside TorchTitan: memory against local batch, batch under a cap, tokens/s.

Four ranks (pipeline 2 x ``data_parallel_shard_degree`` 2) run the same TorchTitan config
through the real ``torchtitan.train`` entry point (torchrun) with every engine and level:

* TorchTitan's own engine with FSDP, ``--parallelism.fsdp_reshard_after_forward`` ``default``
  and ``always``;
* the Piper engine with ``--piper.zero`` 0, 1, 2, 3 (FSDP withheld, Piper's ZeRO).

Four microbatches per step (``pipeline_parallel_microbatch_size`` = local batch / 4); each run
trains ``--steps`` steps. Reported per engine and local batch:

* peak memory per rank: TorchTitan's own ``memory:`` figure of the last step, the largest over
  the ranks. On CPU that is the rank process's peak RSS, reset after every step (the adapter's
  CPU memory monitor), so it includes what every process holds anyway (interpreter, torch,
  TorchTitan): the same for every engine, which makes the comparison under one cap fair. The
  adapter's CPU path has glibc return every large freed buffer to the system at once
  (``cpu.return_freed_buffers``), so the peak RSS follows the tensors alive;
* the largest local batch that fits under a cap: the cap is TorchTitan's default engine's peak
  at the ``--cap-batch`` batch, and every engine's largest swept batch whose peak stays under it;
* tokens/s: the global batch's tokens over the median step time (the interval between the
  last rank's consecutive step lines, steps after the first), and its ratio to TorchTitan's
  engine at the same batch (``reshard always``). Runs of one batch follow each other; four ranks
  share this machine's cores, so ratios compare engines within one invocation only;
* the peak split, measured (``--piper.memory_split``, :mod:`piper_plugin.adapters.torchtitan.resident`)
  on the rank with the largest peak at the largest batch every engine ran: the parameters,
  gradients and optimizer state it keeps (its live tensors after the step), and the transient
  rest (peak - start-up RSS - those), what a step holds only while it runs.

Two models: ``llama3_widemodel`` (TorchTitan's llama3 debug config made parameter-heavy: dim
1024, 16 layers, 210M parameters), where the model state fills a rank, and the stock
``llama3_debugmodel`` (6M parameters), where the interpreter does.

    python -m benchmarks.zero_memory                                  # the published table
    python -m benchmarks.zero_memory --models llama3_debugmodel --batches 4 8 --steps 3
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import code_version, command_line, markdown_table, median, write_result
from piper_plugin.adapters.torchtitan import run_titan

__all__ = ["main", "build_parser", "ENGINES", "peak_memory_gib", "largest_under", "step_seconds", "memory_split",
           "simulated_over_measured"]

# (label, engine, flags)
ENGINES = [
    ("torch FSDP default", "torch", ["--parallelism.fsdp_reshard_after_forward", "default"]),
    ("torch FSDP always", "torch", ["--parallelism.fsdp_reshard_after_forward", "always"]),
    ("piper ZeRO-0", "piper", ["--piper.zero", "0"]),
    ("piper ZeRO-1", "piper", ["--piper.zero", "1"]),
    ("piper ZeRO-2", "piper", ["--piper.zero", "2"]),
    ("piper ZeRO-3", "piper", ["--piper.zero", "3"]),
]
BASELINE = "torch FSDP always"
CAPPED = "torch FSDP default"
_MEMORY = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB")
_PARAMS = re.compile(r"size: ([\d,]+) total parameters")
_STEP = re.compile(r"(\d\d):(\d\d):(\d\d),(\d+) - root - INFO - step:\s*(\d+)\s")
_SIMULATED = re.compile(r"Piper simulated memory: rank (\d+) plan rank \d+ .*? peak ([\d.]+)GiB")
_TENSORS = re.compile(r"Piper memory split: rank (\d+) step (\d+) .*? tensors at peak (-?[\d.]+)GiB")
_SPLIT = re.compile(r"Piper memory split: rank (\d+) step (\d+) params ([\d.]+)GiB grads ([\d.]+)GiB "
                    r"optimizer ([\d.]+)GiB start-up ([\d.]+)GiB peak ([\d.]+)GiB transient (-?[\d.]+)GiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama3_widemodel", "llama3_debugmodel"],
                        help="stock TorchTitan configs; each runs as its drop-in <model>_pp2_1f1b on 4 ranks")
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 8, 16],
                        help="local batch sizes (multiples of 4: four microbatches)")
    parser.add_argument("--seq-len", type=int, default=32, help="short sequences: parameters dominate")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cap-batch", type=int, default=None,
                        help="the batch whose TorchTitan-default peak is the cap (default: the smallest)")
    parser.add_argument("--out", type=Path, default=None, help="markdown result (default benchmarks/results/...)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG plot (default next to the markdown)")
    return parser


def peak_memory_gib(log: str, step: int) -> float | None:
    """The largest ``memory:`` figure any rank printed for ``step``."""
    values = [float(m[2]) for m in _MEMORY.finditer(log) if int(m[1]) == step]
    return max(values) if values else None


def step_seconds(log: str) -> list[float]:
    """Each step's seconds after the first: from the previous step's line to its own (each at
    its last rank's line)."""
    last: dict[int, float] = {}
    for m in _STEP.finditer(log):
        t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + int(m[4]) / 1000
        last[int(m[5])] = max(last.get(int(m[5]), t), t)
    steps = sorted(last)
    return [(last[b] - last[a]) % 86400 for a, b in zip(steps, steps[1:])]


def memory_split(log: str, step: int) -> tuple[float, float, float, float] | None:
    """(params, grads, optimizer, transient) GiB of the rank with the largest peak at ``step``."""
    rows = [m for m in _SPLIT.finditer(log) if int(m[2]) == step]
    if not rows:
        return None
    top = max(rows, key=lambda m: float(m[7]))
    return float(top[3]), float(top[4]), float(top[5]), float(top[8])


def simulated_over_measured(log: str, step: int) -> float | None:
    """The simulator's peak over the measured tensors at the peak (:mod:`...resident`), on the
    rank where the two differ most (relatively) at ``step``; None without both figures."""
    simulated = {int(m[1]): float(m[2]) for m in _SIMULATED.finditer(log)}
    measured = {int(m[1]): float(m[3]) for m in _TENSORS.finditer(log) if int(m[2]) == step}
    ratios = [simulated[r] / measured[r] for r in simulated.keys() & measured.keys() if measured[r] > 0]
    return max(ratios, key=lambda x: abs(x - 1)) if ratios else None


def largest_under(peaks: dict[int, float | None], cap: float) -> int:
    """The largest batch whose peak is at most ``cap`` (0: none)."""
    return max((b for b, p in peaks.items() if p is not None and p <= cap), default=0)


def _run(model: str, label: str, engine: str, flags: list[str], batch: int, args, folder: Path):
    extra = ["--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(batch),
             "--parallelism.pipeline_parallel_microbatch_size", str(batch // 4),
             "--parallelism.data_parallel_shard_degree", "2", "--training.mixed_precision_param", "float32",
             "--debug.seed", "42", "--piper.memory_split", *flags]
    run = run_titan(f"{model}_pp2_1f1b", engine, dump_folder=folder / f"{model}-{label.replace(' ', '_')}-{batch}",
                    nproc=4, steps=args.steps, extra=extra, timeout_s=1200)
    if not run.ok:
        print(f"{model} {label} batch {batch}: failed (exit {run.returncode})\n{run.tail()}", file=sys.stderr)
        return None, None, None, None, None
    seconds = step_seconds(run.log)
    tps = batch * args.seq_len * 2 / median(seconds) if seconds else None  # 2 data-parallel ranks
    params = _PARAMS.search(run.log)
    return (peak_memory_gib(run.log, args.steps), tps, int(params[1].replace(",", "")) if params else None,
            memory_split(run.log, args.steps), simulated_over_measured(run.log, args.steps))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(b % 4 for b in args.batches):
        parser.error("--batches: every local batch must be a multiple of 4 (four microbatches)")
    cap_batch = args.cap_batch or min(args.batches)
    version = code_version()  # before running: the ranks run this code
    sections, figures = [], {}
    with tempfile.TemporaryDirectory(prefix="piper_zero_") as tmp:
        for model in args.models:
            peaks: dict[str, dict[int, float | None]] = {label: {} for label, _, _ in ENGINES}
            rates: dict[str, dict[int, float | None]] = {label: {} for label, _, _ in ENGINES}
            splits: dict[str, dict[int, tuple | None]] = {label: {} for label, _, _ in ENGINES}
            simulated: dict[str, dict[int, float | None]] = {label: {} for label, _, _ in ENGINES}
            params = None
            for batch in args.batches:
                for label, engine, flags in ENGINES:
                    peak, tps, count, split, sim = _run(model, label, engine, flags, batch, args, Path(tmp))
                    peaks[label][batch], rates[label][batch], splits[label][batch] = peak, tps, split
                    simulated[label][batch] = sim
                    params = params or count
                    print(f"{model} batch {batch} {label}: peak {peak} GiB, {tps} tokens/s", flush=True)
            figures[model] = peaks
            cap = peaks[CAPPED].get(cap_batch)
            rows = []
            for label, _, _ in ENGINES:
                row = [label] + [f"{peaks[label][b]:.2f}" if peaks[label][b] is not None else "failed"
                                 for b in args.batches]
                fits = largest_under(peaks[label], cap) if cap is not None else 0
                row.append(f"{fits} ({fits / cap_batch:.1f}x)" if cap is not None else "n/a")
                ratios = [rates[label][b] / rates[BASELINE][b] for b in args.batches
                          if rates[label][b] and rates[BASELINE][b]]
                row.append(f"{median(ratios):.2f}" if ratios else "n/a")
                rows.append(row)
            headers = (["engine"] + [f"peak GiB @ batch {b}" for b in args.batches]
                       + [f"largest batch under {cap:.2f} GiB" if cap else "largest batch", "tokens/s vs always"])
            ran = [b for b in args.batches if all(splits[label].get(b) for label, _, _ in ENGINES)]
            split_batch = max(ran, default=None)
            split_rows = [[label] + [f"{x:.3f}" for x in splits[label][split_batch]] for label, _, _ in ENGINES
                          ] if split_batch else []
            rate_rows = [[label] + [f"{rates[label][b]:.1f}" if rates[label][b] else "n/a" for b in args.batches]
                         for label, _, _ in ENGINES]
            sim_rows = [[label] + [f"{simulated[label][b]:.3f}" if simulated[label].get(b) else "n/a"
                                   for b in args.batches] for label, engine, _ in ENGINES if engine == "piper"]
            split_text = (f"Peak split at batch {split_batch}, measured on the rank with the largest peak (GiB; "
                          f"transient = peak - start-up RSS - kept state):\n\n"
                          f"{markdown_table(['engine', 'params', 'grads', 'optimizer', 'transient'], split_rows)}\n\n"
                          if split_rows else "")
            sections.append(
                f"## {model}_pp2_1f1b, 4 ranks (pp 2 x dp_shard 2), seq {args.seq_len}, "
                f"{params or '?'} parameters\n\n"
                f"Peak memory per rank (largest over ranks, last step), the largest swept batch under the cap "
                f"(TorchTitan default's peak at batch {cap_batch}) and the median tokens/s ratio to TorchTitan "
                f"reshard-always over the batches.\n\n{markdown_table(headers, rows)}\n\n{split_text}"
                f"The simulator's peak per rank over the measured tensors at the peak (the step's peak RSS less "
                f"what the process held besides tensors as the step began), on the rank where they differ most:"
                f"\n\n{markdown_table(['engine'] + [f'batch {b}' for b in args.batches], sim_rows)}\n\n"
                f"Tokens/s (global batch tokens over the median step time):\n\n"
                f"{markdown_table(['engine'] + [f'batch {b}' for b in args.batches], rate_rows)}\n")
    out = write_result(args.out, "zero_memory.md", "")
    plot = args.plot or out.with_suffix(".png")
    _plot(figures, args.batches, plot)
    text = (f"# PP x ZeRO inside TorchTitan: memory, batch under a cap, tokens/s\n\n"
            f"Command: `{command_line('zero_memory', args, parser)}`  \n{_machine(version)}  \n"
            f"Plot: `{plot.name}`. Four ranks share this machine's cores: memory is exact, tokens/s ratios "
            f"compare engines within this run only.\n\n" + "\n".join(sections))
    out.write_text(text)
    print(text)
    return 0


def _machine(version: str) -> str:
    import platform

    import torch

    return (f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
            f"gloo, 4 ranks started by torchrun with 1 torch thread each; {version}")


def _plot(figures: dict[str, dict[str, dict[int, float | None]]], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(6 * len(figures), 4.5), squeeze=False)
    for ax, (model, peaks) in zip(axes[0], figures.items()):
        for label, _, _ in ENGINES:
            points = [(b, peaks[label][b]) for b in batches if peaks[label].get(b) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", linestyle="--" if label.startswith("torch") else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("local batch (4 microbatches)")
        ax.set_ylabel("peak memory per rank (GiB)")
        ax.set_title(f"{model}, pp 2 x dp_shard 2")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
