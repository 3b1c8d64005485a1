"""A/B: Piper's drop-in ``get_forward_backward_func`` vs Megatron-Core's own schedules.

One Megatron-Core GPT (the ``pretrain_gpt`` entry's model, DDP, optimizer and data: Megatron's
``GPTDataset`` over the shipped corpus) on 2 gloo ranks. Each round forks fresh ranks that hold
one model per engine (built from the same seed: the same weights where both use Megatron's
layout) and alternate steps megatron, piper, piper, megatron, ..., so the machine's drift hits
both alike. A step is timed on every rank from a
common barrier to the end of the optimizer step; its time is the slowest rank's.
Reported per schedule: median step time of each engine, the ratio Piper / Megatron, and the
cycle ratio (median over megatron-piper-piper-megatron cycles of Piper's two steps over
Megatron's two). Correctness is the tests' job (tests/test_megatron_parity.py); here the two
engines' losses on their first steps are shown side by side as a sanity check.

    python -m benchmarks.megatron_ab                      # the published table
    python -m benchmarks.megatron_ab --layers 4 --hidden 64 --rounds 1 --steps 2
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    code_version, command_line, fmt_ms, machine_line, markdown_table, median, run_ranks, wait_for_quiet, write_result,
)

__all__ = ["main", "build_parser", "SCHEDULES"]

# schedule -> (Megatron's arguments, Piper's arguments); Megatron picks its schedule from the
# virtual size. "dualpipev-moe": Piper's DualPipeV (its V) against Megatron's interleaved
# schedule, on a MoE model (the paper's comparison).
_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
_V = ["--virtual-pipeline-model-parallel-size", "2"]
SCHEDULES: dict[str, tuple[list[str], list[str]]] = {
    "1f1b": ([], []),
    "interleaved": (_V, _V),
    "dualpipev-moe": (_V + _MOE, _V + _MOE + ["--pipeline-engine", "piper", "--piper-recipe", "dualpipev"]),
}
ENGINES = ("megatron", "piper")


def _entry_argv(args: argparse.Namespace, schedule: str, engine: str) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
            str(args.heads), "--seq-length", str(args.seq), "--micro-batch-size", str(args.micro_batch),
            "--global-batch-size", str(args.global_batch), "--train-iters", str(1000), "--lr", "1e-4",
            "--pipeline-model-parallel-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", str(args.seed), *SCHEDULES[schedule][ENGINES.index(engine)],
            *(["--tensor-model-parallel-size", str(args.tp), "--sequence-parallel"] if args.tp > 1 else [])]


def _alternating(rank: int, world: int, *, argvs: dict[str, list[str]], warmup: int, steps: int) -> dict[str, Any]:
    """In a forked rank: each engine's model (built from the same seed), then alternate engines
    step by step, each stepping its own model."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_forward_backward
    from megatron.core.tensor_parallel import random as mrandom

    from piper_plugin.adapters.megatron import (
        ShippedTokenizer, apply_cpu_fixes, chunk_iterators, build_model, forward_step, get_forward_backward_func,
        parse_args, shipped_corpus, stage_placement, train_dataset,
    )

    parsed = {e: parse_args(argv, world) for e, argv in argvs.items()}
    first = parsed["megatron"]
    apply_cpu_fixes()
    parallel_state.initialize_model_parallel(first.tensor_model_parallel_size, 2,
                                             first.virtual_pipeline_model_parallel_size)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tokenizer = ShippedTokenizer()
    dataset = train_dataset(shipped_corpus(tokenizer), tokenizer, seq_length=first.seq_length,
                            samples=4 * (warmup + steps) * first.global_batch_size, seed=first.seed)
    multiple = 128 * first.tensor_model_parallel_size  # each TP rank holds an equal slice of the vocabulary
    vocab = -(-tokenizer.vocab_size // multiple) * multiple
    models = {}
    for engine, args in parsed.items():
        torch.manual_seed(args.seed)
        placement = (stage_placement(args.piper_recipe, pp=2, stages=2 * (args.virtual_pipeline_model_parallel_size or 1),
                                     microbatches=args.num_microbatches) if engine == "piper" else None)
        chunks, _ = build_model(args, vocab, placement)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, bf16=False, fp16=False,
                                                           clip_grad=1.0), chunks)
        func = get_forward_backward_func(recipe=args.piper_recipe) if engine == "piper" else megatron_forward_backward()
        models[engine] = (chunks, optimizer, func, args)
    consumed = {e: 0 for e in ENGINES}
    record: dict[str, dict[str, list]] = {e: {"times": [], "losses": []} for e in ENGINES}
    order = [e for i in range(warmup + steps) for e in (("megatron", "piper") if i % 2 == 0 else ("piper", "megatron"))]
    for engine in order:
        chunks, optimizer, func, args = models[engine]
        data = chunk_iterators(dataset, chunks, micro_batch_size=args.micro_batch_size, dp_size=1, dp_rank=0,
                               consumed_samples=consumed[engine])
        dist.barrier()
        start = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = func(forward_step_func=forward_step, data_iterator=data,
                       model=chunks, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                       micro_batch_size=args.micro_batch_size, forward_only=False)
        optimizer.step()
        record[engine]["times"].append(time.perf_counter() - start)
        consumed[engine] += args.global_batch_size
        if reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
            record[engine]["losses"].append(float(total[0] / total[1]))
    return {e: {"times": r["times"][warmup:], "losses": r["losses"]} for e, r in record.items()}


def _cycle_ratios(piper: Sequence[float], megatron: Sequence[float]) -> list[float]:
    """Steps alternate m p | p m | m p ...: step i of both engines share a stretch of time."""
    return [p / m for p, m in zip(piper, megatron)]


def run_schedule(args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    cycles: list[float] = []
    losses: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        wait_for_quiet(args.quiet_wait)
        argvs = {e: _entry_argv(args, schedule, e) for e in ENGINES}
        fn = functools.partial(_alternating, argvs=argvs, warmup=args.warmup, steps=args.steps)
        results = run_ranks(2 * args.tp, fn, timeout_s=args.timeout)
        slowest = {e: [max(ts) for ts in zip(*(r[e]["times"] for r in results.values()))] for e in ENGINES}
        for e in ENGINES:
            times[e] += slowest[e]
        cycles += _cycle_ratios(slowest["piper"], slowest["megatron"])
        losses = losses or {e: next(r[e]["losses"][:2] for r in results.values() if r[e]["losses"]) for e in ENGINES}
    return {"times": times, "cycles": cycles, "losses": losses}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron_ab", description=__doc__.split("\n")[0])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tp", type=int, default=1, choices=[1, 2],
                   help="tensor-model-parallel size inside each stage (2: with --sequence-parallel, 4 ranks)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    parser = build_parser()
    args = parser.parse_args(argv)
    version = code_version()
    rows = []
    for schedule in args.schedules:
        got = run_schedule(args, schedule)
        piper, megatron = median(got["times"]["piper"]), median(got["times"]["megatron"])
        rows.append([schedule, fmt_ms(piper), fmt_ms(megatron), f"**{piper / megatron:.3f}**",
                     f"{statistics.median(got['cycles']):.3f} ({len(got['cycles'])})",
                     " / ".join(f"{x:.4f}" for x in got["losses"]["megatron"]),
                     " / ".join(f"{x:.4f}" for x in got["losses"]["piper"])])
        print(rows[-1], flush=True)
    tensor = ("x tensor 2 with sequence parallelism (4 ranks on 2 cores: a rank waiting on a message lends its core "
              "to another, so the ratio shows engine overhead under that sharing, not what a schedule gains with a "
              "core per rank) " if args.tp > 1 else "")
    text = "\n".join([
        "# Piper vs Megatron-Core's schedules: step time", "",
        f"Command: `{command_line('megatron_ab', args, parser)}`", "",
        f"Machine: {machine_line()} ({version} when the run started).", "",
        f"Model: Megatron-Core GPTModel (local layer spec), {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, seq {args.seq}, the shipped corpus through Megatron's GPTDataset; pipeline 2 "
        f"{tensor}"
        f"(interleaved: 2 model chunks per rank), global batch {args.global_batch} in microbatches of "
        f"{args.micro_batch}; Megatron's DDP and Adam. Per round: freshly forked ranks hold one model per "
        f"engine (same seed) and alternate the engines step by step (m p, p m, ...), {args.warmup} warm-up + {args.steps} timed steps "
        f"each; {args.rounds} rounds. Step time = slowest rank, barrier to end of optimizer step. Losses: each "
        f"engine's first two steps, a sanity check only (parity is tested in tests/test_megatron_parity.py; "
        f"dualpipev-moe: Piper's DualPipeV with its stages built in its V, against Megatron's interleaved "
        f"schedule, 2 chunks per rank, 4 experts, top-2, tied embeddings; different layouts initialise "
        f"differently).", "",
        markdown_table(["schedule", "Piper median ms", "Megatron median ms", "ratio Piper/Megatron",
                        "paired-step ratio (pairs)", "Megatron losses (its first 2 steps)", "Piper losses (its first 2 steps)"],
                       rows), ""])
    path = write_result(args.out, "megatron_ab_tp2.md" if args.tp > 1 else "megatron_ab.md", text)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
