"""Run the real ``torchtitan.train`` entry point under torchrun and read its step lines.

Used by the tests and the A/B benchmark, so both drive exactly what a user types:

    torchrun --standalone --nproc_per_node=2 -m torchtitan.train \\
        --module piper_plugin.adapters.torchtitan --config <fn> --parallelism.pipeline_engine=<e> ...
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["TitanRun", "titan_args", "titan_command", "run_titan", "parse_steps", "train_main"]

_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+(?:e[-+]?\d+)?)\s+grad_norm:\s*([\d.]+(?:e[-+]?\d+)?)"
                   r".*?tps:\s*([\d,]+)")


@dataclass
class TitanRun:
    command: list[str]
    returncode: int
    wall_s: float
    log: str
    losses: dict[int, float] = field(default_factory=dict)  # step -> global loss (last-stage ranks)
    grad_norms: dict[int, float] = field(default_factory=dict)
    tps: dict[int, list[int]] = field(default_factory=dict)  # step -> tokens/s per rank

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def parse_steps(log: str) -> tuple[dict[int, float], dict[int, float], dict[int, list[int]]]:
    losses, norms, tps = {}, {}, {}
    for line in log.splitlines():
        match = _STEP.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if not match:
            continue
        step, loss, norm, rate = int(match[1]), float(match[2]), float(match[3]), int(match[4].replace(",", ""))
        if loss >= 0:  # non-last pipeline stages print -1 (summed over data-parallel replicas: -dp)
            losses[step] = loss
        norms[step] = norm
        tps.setdefault(step, []).append(rate)
    return losses, norms, tps


def titan_args(config: str, engine: str, *, steps: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The arguments after ``-m torchtitan.train``."""
    args = ["--module", "piper_plugin.adapters.torchtitan", "--config", config,
            f"--parallelism.pipeline_engine={engine}", "--metrics.disable_color_printing"]
    if steps is not None:
        args += ["--training.steps", str(steps)]
    return args + list(extra)


def titan_command(config: str, engine: str, *, nproc: int = 2, steps: int | None = None,
                  extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchtitan.train", *titan_args(config, engine, steps=steps, extra=extra)]


def train_main(argv: Sequence[str], threads: int = 1) -> None:
    """In a rank process someone else started: what ``python -m torchtitan.train <argv>`` runs
    (its ``main()``), with ``threads`` torch threads. Errors and ``SystemExit`` propagate."""
    import torch
    from torchtitan.train import main

    torch.set_num_threads(threads)
    sys.argv = ["torchtitan.train", *argv]
    main()


def run_titan(config: str, engine: str, *, dump_folder: str | Path, nproc: int = 2, steps: int | None = None,
              extra: Sequence[str] = (), timeout_s: float = 600, threads: int = 1) -> TitanRun:
    """Run one training job; ``dump_folder`` keeps its outputs (and is the working directory)."""
    dump = Path(dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    # extra goes last: a tyro subcommand there (e.g. ``activation-checkpoint:none``) scopes what follows
    cmd = titan_command(config, engine, nproc=nproc, steps=steps,
                        extra=["--dump_folder", str(dump), *extra])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=dump, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        code, log = 124, (out.decode() if isinstance(out, bytes) else out) + f"\ntimed out after {timeout_s}s"
    run = TitanRun(cmd, code, time.perf_counter() - start, log)
    run.losses, run.grad_norms, run.tps = parse_steps(log)
    return run


def describe(run: TitanRun) -> str:
    return " ".join(shlex.quote(c) for c in run.command)
