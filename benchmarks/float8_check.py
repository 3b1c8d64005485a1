"""Float8 training under Piper's runtime: torchao's ``Float8Linear`` (the module TorchTitan's
``float8`` converter swaps in) trained by Piper's plans against plain PyTorch float8 training.

The toy LM's linear layers whose dimensions are multiples of 16 (float8 GEMMs need that; the
same filter as TorchTitan's converter) become ``Float8Linear`` with dynamic scaling (``--recipe``:
torchao's ``tensorwise`` or ``rowwise``). Each plan trains it under Piper on one device per rank;
the reference is plain PyTorch on the same device with gradients accumulated over the same
microbatches (float8 scales are taken per microbatch, so that is the run a strategy must equal).
Cases: 1F1B on one rank, and zero-bubble H1 with every weight-gradient chunk on a stream of its
own (the backward runs in two passes over the float8 layers: input gradients, then weights).
With two devices (2 GPUs, or CPU ranks on gloo): 1F1B and DualPipeV on two ranks.

On a GPU of compute capability 8.9 or later the GEMMs run in float8 (``torch._scaled_mm``); on
a CPU, ``--emulate`` casts to float8 and back and multiplies in fp32 (torchao's emulation, as
TorchTitan's ``float8.emulate``). The step time of Piper's 1F1B on one rank is set against the
plain float8 step and against Piper's own fp32 step.

    python -m benchmarks.float8_check --emulate --device cpu     # CPU, needs torchao
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import torch
import torch.nn as nn

import piper_plugin as piper
from benchmarks._common import build_lm, code_version, command_line, lm_config, lm_job, markdown_table, write_result
from benchmarks.cuda_check import piper_step_ms, plain_step_ms
from benchmarks.parity_oracle import rel, single_device_errors
from piper_plugin import Schedule
from piper_plugin.recipes import apply_recipe, stages_needed

__all__ = ["main", "build_parser", "float8_lm"]

SIZES = {
    "small": dict(dim=32, layers=4, heads=2, ffn=64, seq=16, vocab=64),
    "gpu": dict(dim=1024, layers=4, heads=8, ffn=4096, seq=512, vocab=4096),
}
CASES = {  # name: (recipe, pp, BW on its own stream)
    "1f1b 1 rank": ("1f1b", 1, False),
    "zb-h1 1 rank, BW stream": ("zb-h1", 1, True),
    "1f1b 2 ranks": ("1f1b", 2, False),
    "dualpipev 2 ranks": ("dualpipev", 2, False),
}


def _float8_filter(module: nn.Module, fqn: str) -> bool:
    """TorchTitan's rule: only linears whose both dimensions are multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_lm(cfg, stages: int | None, recipe: str, emulate: bool) -> nn.Module:
    """The toy LM with its eligible linears swapped for torchao's ``Float8Linear``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True) if emulate else Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(build_lm(cfg, stages), config=config, module_filter_fn=_float8_filter)


def _schedule(program, *, recipe: str, pp: int, microbatches: int, wgrad_stream: bool) -> Schedule:
    sch = apply_recipe(Schedule(program, pp=pp), recipe, microbatches=microbatches)
    if wgrad_stream:
        sch.stream("kind=BW", "wgrad")
    return sch


def _job(args, recipe: str, pp: int, wgrad_stream: bool, float8: bool = True):
    cfg = lm_config(**SIZES[args.size])
    job = lm_job(cfg, recipe=recipe, pp=pp, microbatches=args.microbatches, batch=args.batch)
    if float8:
        job.model_fn = functools.partial(float8_lm, cfg, stages_needed(recipe, pp, 2), args.recipe, args.emulate)
    job.schedule_fn = functools.partial(_schedule, recipe=recipe, pp=pp, microbatches=args.microbatches,
                                        wgrad_stream=wgrad_stream)
    job.steps, job.device, job.capture_grads, job.timeout_s = args.steps, args.device, True, args.timeout
    return job


def _plain_run(job, microbatches: int, device: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each step's loss and gradients (on the host) of ``job``'s model trained the plain way."""
    model = job.build_model().to(device)
    optimizer = job.optimizer_fn(list(model.parameters()))
    data, steps = job.data_fn(job.seed), []
    for _ in range(job.steps):
        loss = 0.0
        for *inputs, target in zip(*(t.to(device).chunk(microbatches) for t in next(data))):
            part = job.loss_fn(model(*inputs), target) / microbatches
            part.backward()
            loss += part.item()
        steps.append((loss, {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters()
                             if p.grad is not None}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps


def _distance(a, b) -> list[tuple[float, float]]:
    """Per step: the loss's relative difference and the worst parameter's gradient one."""
    return [(abs(la - lb) / abs(lb), max(rel(ga[n], gb[n]) for n in gb)) for (la, ga), (lb, gb) in zip(a, b)]


def _environment(device: str) -> tuple[str, int]:
    import torchao

    if device == "cpu":
        return f"torch {torch.__version__}, torchao {torchao.__version__}, CPU (gloo); {code_version()}", 2
    count = torch.cuda.device_count()
    cap = torch.cuda.get_device_capability(0)
    return (f"torch {torch.__version__}, torchao {torchao.__version__}, CUDA {torch.version.cuda}, {count} x "
            f"{torch.cuda.get_device_name(0)} (compute capability {cap[0]}.{cap[1]}); {code_version()}"), count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.float8_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), help="toy LM shapes (default: gpu on cuda, small on cpu)")
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="rowwise",
                   help="torchao's float8 scaling recipe (TorchTitan's default: rowwise; ignored with --emulate)")
    p.add_argument("--emulate", action="store_true", help="torchao's float8 emulation (any device; needed on CPU)")
    p.add_argument("--steps", type=int, default=5, help="steps per run (times from step 3 on)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--cases", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    p.add_argument("--tol", type=float, default=1e-4, help="parity goal, relative")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, help="result file (default: benchmarks/results/float8_check.md)")
    return p


def _refusal(args) -> str | None:
    """Why this machine cannot run the check as asked, or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao's float8 does not import here ({exc}): pip install -e '.[float8]'"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return "--device cuda: no GPU here; use --device cpu --emulate"
        if not args.emulate and torch.cuda.get_device_capability(0) < (8, 9):
            return "float8 GEMMs need compute capability 8.9 or later: add --emulate"
    elif not args.emulate:
        return "--device cpu has no float8 GEMMs: add --emulate"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.size = args.size or ("gpu" if args.device == "cuda" else "small")
    why = _refusal(args)
    if why:
        parser.error(why)
    env, devices = _environment(args.device)
    rows, verdicts, cases_run = [], {}, []
    for case in args.cases:
        recipe, pp, wgrad = CASES[case]
        if pp > devices:
            print(f"{case}: not run ({devices} device here)", flush=True)
            continue
        job = _job(args, recipe, pp, wgrad)
        result = piper.run(job, launcher="fork")
        e = single_device_errors(job, result.metrics, result.per_rank, accumulate=args.microbatches,
                                 device="cuda" if args.device == "cuda" else "cpu")
        first = e.steps[0]
        cases_run.append((case, e))
        later = [m["step_time_s"] for m in result.metrics if m["step"] >= min(2, job.steps - 1)]
        streams = sorted({s for rp in result.plan.ranks for s in rp.streams})
        rows.append([case, " + ".join(streams), f"{first.get('loss', 0.0):.1e}", f"{first.get('grad', 0.0):.1e}",
                     f"{e.loss:.1e}", f"{e.grad:.1e} ({e.where.get('grad', '')})", f"{e.param:.1e}",
                     f"{statistics.median(later) * 1e3:.1f}"])
        print(f"{case}: first step loss {first.get('loss', 0.0):.1e} grad {first.get('grad', 0.0):.1e}; all steps "
              f"loss {e.loss:.1e} grad {e.grad:.1e} ({e.where.get('grad')}) param {e.param:.1e}", flush=True)
    device = "cuda" if args.device == "cuda" else "cpu"
    plain = _job(args, "1f1b", 1, False)
    runs = [_plain_run(plain, args.microbatches, device) for _ in range(2)]
    fp32 = _plain_run(_job(args, "1f1b", 1, False, float8=False), args.microbatches, device)
    floors = {"plain float8, run twice": _distance(runs[1], runs[0]),
              "plain float8 against plain fp32": _distance(runs[0], fp32)}
    floor_rows = [[name, " ".join(f"{g:.1e}" for _, g in d), f"{max(x for x, _ in d):.1e}"] for name, d in floors.items()]
    print("\n".join(" | ".join(r) for r in floor_rows), flush=True)
    own = max(g for _, g in floors["plain float8 against plain fp32"])
    spread = floors["plain float8, run twice"][0][1]  # on a GPU plain float8 does not repeat itself bitwise
    for case, e in cases_run:
        first = e.steps[0]
        verdicts[f"first step {case}"] = max(first.get("loss", 0.0), first.get("grad", 0.0)) <= max(args.tol, 2 * spread)
        verdicts[f"all steps {case}"] = e.grad < own
    one_rank = _job(args, "1f1b", 1, False)
    piper_ms, plain_ms = piper_step_ms(one_rank), plain_step_ms(one_rank, args.microbatches)
    fp32_ms = piper_step_ms(_job(args, "1f1b", 1, False, float8=False))
    timing = (f"One rank, 1F1B over {args.microbatches} microbatches, medians from step 3 on: Piper float8 / plain "
              f"PyTorch float8 {piper_ms / plain_ms:.3f} ({piper_ms:.1f} vs {plain_ms:.1f} ms); Piper float8 / "
              f"Piper fp32 {piper_ms / fp32_ms:.3f} ({fp32_ms:.1f} ms fp32)")
    print(timing, flush=True)
    how = "emulated (cast to float8 and back, fp32 GEMMs)" if args.emulate else f"float8 GEMMs, {args.recipe} scaling"
    text = "\n\n".join([
        "# Float8 training under Piper", env, f"Command: `{command_line('float8_check', args, parser)}`",
        f"torchao Float8Linear, {how}. Relative errors against plain PyTorch float8 training on the same "
        f"device with gradients accumulated over the same {args.microbatches} microbatches: the first step's loss "
        f"and gradients (same parameters, same batch; goal < {args.tol:g}, or at most twice what plain float8 "
        "differs from itself run twice, where that is more: on a GPU it is not bitwise repeatable), then the "
        "worst over every step's "
        "loss, gradients and the parameters after it (goal: gradients closer to plain float8 than plain float8 "
        "is to fp32: a float8 cast turns a last-bit difference of fp32 into a whole float8 step, so runs whose "
        "parameters differ in their last bits drift apart).",
        markdown_table(["case", "logical streams", "first step: loss", "gradients", "all steps: loss",
                        "gradients (worst)", "parameters", "median step ms"], rows),
        "Plain PyTorch against itself and against fp32 on the same device (each step's worst gradient; the loss "
        "at its worst step):",
        markdown_table(["runs", "gradients, each step", "loss"], floor_rows),
        "## Step time", timing,
        "## Verdicts", "\n".join(f"- parity, {name}: {'holds' if ok else 'FAILS'}" for name, ok in verdicts.items()),
    ]) + "\n"
    path = write_result(args.out, "float8_check.md", text)
    print(f"wrote {path}")
    return 0 if verdicts and all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
