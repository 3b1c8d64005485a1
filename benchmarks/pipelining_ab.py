"""A/B: Piper vs torch.distributed.pipelining (TorchTitan's engine) on the same pipeline.

Both engines run the same toy LM (same seed, so the same weights), split into the same
stages on the same ranks (loop layout; V layout for DualPipeV), the same microbatches, the
same seeded batches and AdamW. Each step is timed on every rank from a common barrier to the
end of the optimizer step; a step's time is the slowest rank's. Each round forks fresh ranks that
hold both engines and alternate steps torch, piper, piper, torch, ..., so the machine's drift
(tens of percent between runs here) hits both alike.
Reported: the median step time of each engine over all rounds, the ratio Piper / torch, and
the loss of step 1 of both and the largest difference between their losses over every step of
every round (both engines see the same batches from the same weights: they compute the same thing).

    python -m benchmarks.pipelining_ab                       # the published table
    python -m benchmarks.pipelining_ab --dim 32 --layers 4 --seq 16 --batch 4 --steps 2
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn as nn

from benchmarks._common import (
    ALTERNATION, ForeignLoad, alternating_rank, code_version, command_line, fmt_ms, lm_config, lm_job, machine_line,
    markdown_table, median, run_ranks, slowest_rank_times, total_cpu_times, wait_for_quiet, write_result,
)
from piper_plugin.models import ToyLM, ToyLMConfig, layer_stages
from piper_plugin.recipes import stages_needed

__all__ = ["main", "build_parser", "SCHEDULES", "TorchStageModule"]

# Piper recipe -> (torch schedule class, stage layout)
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "loop"),
    "1f1b": ("Schedule1F1B", "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


class TorchStageModule(nn.Module):
    """One pipeline stage of a :class:`ToyLM`, sharing the full model's modules (same weights).

    Stage 0 holds the embeddings, the last stage the final norm and head, each stage the
    layers :func:`layer_stages` gives it: exactly the regions Piper's capture cuts.
    """

    def __init__(self, model: ToyLM, stage: int, num_stages: int):
        super().__init__()
        first, last = stage == 0, stage == num_stages - 1
        owner = layer_stages(model.cfg.n_layers, num_stages)
        self.embed = model.embed if first else None
        self.pos = model.pos if first else None
        self.layers = nn.ModuleList(layer for layer, s in zip(model.layers, owner) if s == stage)
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos.weight[: x.size(1)] if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.head(self.norm(h))
        return h


def backward_split_cost(cfg: ToyLMConfig, args: argparse.Namespace) -> dict[str, float]:
    """Seconds (median of ``args.split_reps``) of one backward of a middle stage, three ways.

    The stage is stage 1 of the 2 x 2 split DualPipeV uses, on one microbatch: ``full`` is one
    ``torch.autograd.backward``; ``piper`` is what ``runtime/compute.py`` runs for BI then BW
    (:func:`piper_plugin.autograd.backward_input`, then the pending weight
    gradients' ``run``); ``torch`` is ``stage_backward_input`` then ``stage_backward_weight`` of
    ``torch.distributed.pipelining``. Both keep the gradients reaching each weight's op in BI, so
    BW only runs the last hop.
    """
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from piper_plugin.autograd import backward_input

    num_stages = stages_needed("dualpipev", args.pp, args.chunks)
    torch.manual_seed(args.seed)
    stage = TorchStageModule(ToyLM(cfg, num_stages), 1, num_stages)
    params = list(stage.parameters())
    micro = max(1, args.batch // args.microbatches)

    def once(how: str) -> float:
        x = torch.randn(micro, cfg.seq, cfg.dim, requires_grad=True)
        y = stage(x)
        g = torch.randn_like(y)
        start = time.perf_counter()
        if how == "full":
            torch.autograd.backward([y], [g])
        elif how == "piper":
            _, pending = backward_input([y], [g], [x])
            pending.run()
        else:
            _, groups = stage_backward_input([y], [g], [x], iter(params))
            stage_backward_weight(iter(params), groups)
        elapsed = time.perf_counter() - start
        stage.zero_grad(set_to_none=True)
        return elapsed

    ways = ("full", "piper", "torch")
    for how in ways:  # warm-up
        once(how)
    times: dict[str, list[float]] = {how: [] for how in ways}
    for _ in range(args.split_reps):
        for how in ways:  # interleaved, so drift hits all three alike
            times[how].append(once(how))
    return {how: median(ts) for how, ts in times.items()}


def _losses(results: dict[int, dict[str, Any]]) -> list[float]:
    """The loss of every step, from the rank holding the last stage."""
    return next(r["losses"] for r in results.values() if r["losses"][0] is not None)


def loss_gap(piper: dict[int, dict[str, Any]], torch_: dict[int, dict[str, Any]]) -> tuple[float, int]:
    """The largest |Piper loss - torch loss| over the steps of one round, and how many steps."""
    a, b = _losses(piper), _losses(torch_)
    if len(a) != len(b):
        raise RuntimeError(f"the engines ran {len(a)} and {len(b)} steps")
    return max(abs(x - y) for x, y in zip(a, b)), len(a)


def _job(cfg: ToyLMConfig, args: argparse.Namespace, recipe: str):
    return lm_job(cfg, recipe=recipe, pp=args.pp, microbatches=args.microbatches, batch=args.batch,
                  chunks=args.chunks, seed=args.seed, lr=args.lr, timeout_s=args.timeout)


def run_alternating(cfg: ToyLMConfig, args: argparse.Namespace, recipe: str) -> dict[str, dict[int, dict[str, Any]]]:
    """Both engines in the same forked ranks, steps alternating (engine -> rank -> results)."""
    schedule, layout = SCHEDULES[recipe]
    job = _job(cfg, args, recipe)
    compiled = job.compile()
    fn = functools.partial(alternating_rank, job=job, program=compiled.program, plan=compiled.plan,
                           stage_module=TorchStageModule,
                           schedule=schedule, layout=layout, num_stages=stages_needed(recipe, args.pp, args.chunks),
                           warmup=args.warmup, steps=args.steps)
    per_rank = run_ranks(args.pp, fn, timeout_s=args.timeout)
    return {engine: {rank: r[engine] for rank, r in per_rank.items()} for engine in ("piper", "torch")}


def cycle_ratios(piper: list[float], torch_: list[float], warmup: int) -> list[float]:
    """Piper / torch time of each complete alternation cycle: :data:`ALTERNATION` runs each
    engine twice per cycle, so an engine's steps ``2i`` and ``2i + 1`` (counted with the
    ``warmup`` steps already dropped) share one."""
    first = warmup % 2  # an odd warm-up leaves the first measured step alone in its cycle
    return [(piper[i] + piper[i + 1]) / (torch_[i] + torch_[i + 1])
            for i in range(first, min(len(piper), len(torch_)) - 1, 2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipelining_ab", description=__doc__.split("\n")[0])
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (forked processes)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--chunks", type=int, default=2, help="stages per rank for interleaved-1f1b")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--rounds", type=int, default=3, help="alternating A/B rounds per engine")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stalled run fails")
    p.add_argument("--split-reps", type=int, default=20,
                   help="repetitions of the backward-split measurement (0: skip it)")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for other processes to go quiet (0: never)")
    p.add_argument("--quiet-below", type=float, default=0.3,
                   help="cores of other load under which a run counts as quiet")
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/pipelining_ab.md)")
    return p


def _quiet_cell(s: dict[str, Any]) -> str:
    n_piper, n_torch = s["quiet_runs"]
    if not (n_piper and n_torch):
        return f"n/a ({n_piper} / {n_torch} quiet runs)"
    return (f"{fmt_ms(s['piper_quiet_s'])} / {fmt_ms(s['torch_quiet_s'])} ({n_piper} / {n_torch}), "
            f"**{s['piper_quiet_s'] / s['torch_quiet_s']:.3f}**")


def _load(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{sum(known) / len(known):.2f}" if known else "n/a"


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    code_version()  # the engine as imported now, before any rank forks
    cfg = lm_config(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, seq=args.seq, vocab=args.vocab)
    command = command_line("pipelining_ab", args, parser)
    print(command, flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for recipe in args.schedules:
        times: dict[str, list[float]] = {"piper": [], "torch": []}
        cpu: dict[str, list[float]] = {"piper": [], "torch": []}
        rounds: dict[str, list[float]] = {"piper": [], "torch": []}
        foreign: dict[str, list[float | None]] = {"piper": [], "torch": []}
        quiet: dict[str, list[float]] = {"piper": [], "torch": []}  # steps of runs with little other load
        quiet_runs: dict[str, int] = {"piper": 0, "torch": 0}
        cycles: list[float] = []
        loss: dict[str, float | None] = {}
        gaps: list[float] = []
        compared = 0
        for r in range(args.rounds):
            if args.quiet_wait > 0:
                wait_for_quiet(args.quiet_wait, args.quiet_below)
            with ForeignLoad() as load:
                both = run_alternating(cfg, args, recipe)
                for results in both.values():
                    load.add_own(results)
            gap, steps = loss_gap(both["piper"], both["torch"])
            gaps.append(gap)
            compared += steps
            cycles += cycle_ratios(slowest_rank_times(both["piper"]), slowest_rank_times(both["torch"]),
                                   args.warmup)
            for engine, results in both.items():
                step_times, cpu_times = slowest_rank_times(results), total_cpu_times(results)
                times[engine] += step_times
                cpu[engine] += cpu_times
                rounds[engine].append(median(step_times))
                foreign[engine].append(load.cores)
                if load.cores is not None and load.cores < args.quiet_below:
                    quiet[engine] += step_times
                    quiet_runs[engine] += 1
                loss.setdefault(engine, _losses(results)[0])
                other = "n/a" if load.cores is None else f"{load.cores:.2f}"
                print(f"  {recipe:17s} round {r} {engine:5s} median {fmt_ms(median(step_times))} ms "
                      f"(steps {' '.join(fmt_ms(t) for t in step_times)}; other processes {other} cores)", flush=True)
        piper_s, torch_s = median(times["piper"]), median(times["torch"])
        summary[recipe] = {"piper_s": piper_s, "torch_s": torch_s, "ratio": piper_s / torch_s,
                           "piper_min_s": min(times["piper"]), "torch_min_s": min(times["torch"]),
                           "ratio_min": min(times["piper"]) / min(times["torch"]),
                           "cycle_ratio": median(cycles) if cycles else float("nan"), "cycles": len(cycles),
                           "piper_cpu_s": median(cpu["piper"]), "torch_cpu_s": median(cpu["torch"]),
                           "piper_quiet_s": median(quiet["piper"]), "torch_quiet_s": median(quiet["torch"]),
                           "quiet_runs": (quiet_runs["piper"], quiet_runs["torch"]),
                           "piper_rounds": rounds["piper"], "torch_rounds": rounds["torch"],
                           "piper_load": _load(foreign["piper"]), "torch_load": _load(foreign["torch"]),
                           "piper_loss": loss["piper"], "torch_loss": loss["torch"],
                           "loss_gap": max(gaps), "loss_steps": compared}
    rows = [[recipe, SCHEDULES[recipe][0], fmt_ms(s["piper_s"]), fmt_ms(s["torch_s"]), f"**{s['ratio']:.3f}**",
             f"{s['cycle_ratio']:.3f} ({s['cycles']})",
             fmt_ms(s["piper_min_s"]), fmt_ms(s["torch_min_s"]), f"{s['ratio_min']:.3f}",
             f"{fmt_ms(s['piper_cpu_s'])} / {fmt_ms(s['torch_cpu_s'])}", _quiet_cell(s),
             " / ".join(fmt_ms(t) for t in s["piper_rounds"]), " / ".join(fmt_ms(t) for t in s["torch_rounds"]),
             f"{s['piper_load']} / {s['torch_load']}",
             f"{s['piper_loss']:.6f}", f"{s['torch_loss']:.6f}", f"{s['loss_gap']:.1e} ({s['loss_steps']})"]
            for recipe, s in summary.items()]
    table = markdown_table(["schedule", "torch class", "Piper median ms", "torch median ms", "ratio Piper/torch",
                            "cycle ratio (cycles)",
                            "Piper best ms", "torch best ms", "ratio of bests",
                            "CPU ms/step, all ranks (Piper / torch)",
                            f"quiet runs only (other load < {args.quiet_below} cores): Piper / torch ms (runs), ratio",
                            "Piper round medians",
                            "torch round medians", "other load, cores (Piper / torch runs)", "step-1 loss Piper",
                            "step-1 loss torch", "largest loss diff, every step (steps)"], rows)
    print(table)
    split_text: list[str] = []
    if args.split_reps > 0:
        split = backward_split_cost(cfg, args)
        split_table = markdown_table(
            ["backward of stage 1 (of 4), one microbatch", "ms (median)", "vs one full backward"],
            [["one full backward (B)", fmt_ms(split["full"]), "1.00"],
             ["Piper BI + BW (`runtime/compute.py`)", fmt_ms(split["piper"]), f"{split['piper'] / split['full']:.2f}"],
             ["torch `stage_backward_input` + `stage_backward_weight`", fmt_ms(split["torch"]),
              f"{split['torch'] / split['full']:.2f}"]])
        print(split_table)
        split_text = ["## Cost of a split backward", "",
                      "Piper's `dualpipev` recipe splits backwards into BI + BW (`split_backward=True`); a BI followed "
                      "directly by its own BW runs as one full backward, so only the backwards the schedule separates "
                      "pay the split, as in torch's ScheduleDualPipeV. Measured in this process (1 thread):", "",
                      split_table, ""]
    with torch.device("meta"):
        params = sum(p.numel() for p in ToyLM(cfg).parameters())
    text = "\n".join([
        "# Piper vs torch.distributed.pipelining: step time", "",
        f"Command: `{command}`", "",
        f"Machine: {machine_line()}.", "",
        f"Model: toy LM dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, ffn {cfg.ffn}, vocab {cfg.vocab}, "
        f"seq {cfg.seq} ({params / 1e6:.2f}M params); global batch {args.batch}, {args.microbatches} microbatches, "
        f"{args.pp} ranks; AdamW; same seed (same weights) and the same batches for both engines. Per round: "
        f"freshly forked ranks each hold both engines (own model copy, optimizer and batches) and alternate steps "
        f"{', '.join(ALTERNATION)}, ... until each engine ran {args.warmup} warm-up + {args.steps} timed steps; "
        f"{args.rounds} rounds. Neighbouring steps of the two engines see the same machine, which separate runs "
        f"here do not. Step time = slowest rank, from a barrier to the end of the optimizer step. "
        f"Medians and bests over all timed steps of all rounds. Cycle ratio: median over the "
        f"{'-'.join(ALTERNATION)} cycles of Piper's two steps over torch's two, each pair from one stretch of "
        f"machine time. 'CPU ms/step' = median over steps of the CPU time "
        f"of all rank processes together (every thread): the work each engine does, which contention from other "
        f"processes changes far less than wall time. 'Other load' = cores that processes outside "
        f"this benchmark kept busy during the runs (machine CPU time from /proc/stat minus this benchmark's), "
        f"averaged over the runs; before each run the benchmark waits up to {args.quiet_wait:.0f} s for that "
        f"load to fall under {args.quiet_below} cores. The quiet-runs column uses only runs during which it "
        f"stayed under that.", "",
        table, "",
        *split_text,
    ])
    path = write_result(args.out, "pipelining_ab.md", text)
    print(f"wrote {path}")
    return summary


if __name__ == "__main__":
    main()
