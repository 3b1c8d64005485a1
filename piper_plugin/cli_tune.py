"""``piper calibrate`` and ``piper tune``: measure a cost profile; search strategies by
simulation with it and write the best as a recipe file.

    piper calibrate --ranks 2 --out profile.json          # ~1 minute of short jobs on forked ranks
    piper calibrate --host torchtitan --out p.json -- --config llama3_debugmodel_pp2_1f1b  # through an adapter
    piper tune --ranks 2 --profile profile.json [--memory-cap 64MiB] [--top 10] [--out best.json]

Prints the plans that fit the cap, fastest first (predicted step time and peak memory of the
fullest rank), how many candidates did not apply and why, and writes the first one's directives
as a Schedule trace: ``piper train --recipe-file best.json`` and ``piper plan --recipe-file``
replay it (:mod:`piper_plugin.tune`).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from piper_plugin.cli_args import UsageError, check_seq, positive_int

__all__ = ["add_tune_parser", "run_tune", "add_calibrate_parser", "run_calibrate", "parse_bytes", "profile_sizes"]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """``64MiB``, ``1.5GiB``, ``500MB``, ``1048576``: bytes (an argparse ``type``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 64MiB, 1.5GiB, 500MB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def add_tune_parser(commands) -> argparse.ArgumentParser:
    from piper_plugin.models import TOY_MODELS

    tune = commands.add_parser(
        "tune", help="search recipes x grids x ZeRO x microbatches by simulation; write the best as a recipe file",
        description="Compile and simulate every built-in recipe on every pp x dp x ep grid of the ranks, at each "
                    "ZeRO level, microbatch count and chunks per rank, for one model and global batch; print the "
                    "fastest plans under the memory cap and write the first as a Schedule trace.")
    tune.add_argument("--model", choices=sorted(TOY_MODELS), default="toy-lm", help="toy model (default: toy-lm)")
    tune.add_argument("--ranks", type=positive_int, metavar="N",
                      help="ranks to plan for (required, unless --profile is a host's: its grid)")
    tune.add_argument("--memory-cap", type=parse_bytes, metavar="BYTES",
                      help="simulated peak per rank at most this (e.g. 64MiB); default: no cap")
    tune.add_argument("--layers", type=positive_int, metavar="L",
                      help="model layers, the same for every candidate (default: the profile's, else 8); a plan "
                           "needs at most L stages")
    tune.add_argument("--batch", type=positive_int, metavar="N", help="global batch (default: the profile's, else 16)")
    tune.add_argument("--seq", type=positive_int, metavar="T", help="sequence length (default: the profile's, else 32)")
    tune.add_argument("--profile", type=Path, metavar="FILE.json",
                      help="a cost profile `piper calibrate` measured (replaces --cost)")
    tune.add_argument("--cost", choices=("cpu", "uniform"), default="cpu",
                      help="without --profile: cpu, a FLOP-based CPU/gloo estimate (default; it knows no runtime "
                           "overhead: small models get microbatch counts too high); uniform: F=1 B=2 W=1, free comm")
    tune.add_argument("--top", type=positive_int, default=10, metavar="K", help="plans to print (default: 10)")
    tune.add_argument("--out", type=Path, metavar="FILE.json", help="write the best plan's Schedule trace here")
    tune.set_defaults(run=run_tune)
    return tune


def add_calibrate_parser(commands) -> argparse.ArgumentParser:
    from piper_plugin.models import TOY_MODELS

    cal = commands.add_parser(
        "calibrate", help="measure a cost profile (task times by kind, message latency and bandwidth) for tune",
        description="Run short jobs of the model on forked ranks and time messages between them; fit per task "
                    "kind seconds per task, per op, per FLOP and per parameter byte, and the messages' latency "
                    "and bandwidth; write the profile (JSON) that `piper tune --profile` reads.")
    cal.add_argument("--model", choices=sorted(TOY_MODELS), default="toy-lm", help="toy model (default: toy-lm)")
    cal.add_argument("--ranks", type=positive_int, default=2, metavar="N", help="ranks (default: 2)")
    cal.add_argument("--layers", type=positive_int, default=8, metavar="L", help="model layers (default: 8)")
    cal.add_argument("--batch", type=positive_int, default=16, metavar="N", help="global batch (default: 16)")
    cal.add_argument("--seq", type=positive_int, default=32, metavar="T", help="sequence length (default: 32)")
    cal.add_argument("--steps", type=positive_int, default=8, metavar="N",
                     help="steps per calibration job, the first 2 left out of its median (default: 8)")
    cal.add_argument("--rounds", type=positive_int, default=1, metavar="R",
                     help="with --host: run the calibration jobs R times over, alternating them, each job's "
                          "step the median of its rounds' (a shared machine's slow stretches land on one round "
                          "of a job, not on all its steps; default: 1)")
    cal.add_argument("--link", metavar="RATE",
                     help="measure over an emulated link of this rate (tc's form: 100mbit, 1gbit): the jobs and "
                          "message timings run in a private network namespace whose loopback is rate-limited "
                          "(root, unshare and tc)")
    cal.add_argument("--host", metavar="NAME",
                     help="calibrate a host framework's model through its adapter (torchtitan, megatron): the "
                          "arguments after -- are the host's training command (torchtitan.train's, or "
                          "pretrain_gpt's); its calibration jobs run it under torchrun on --ranks ranks with the "
                          "Piper engine, several recipes and microbatch counts, each with a step trace")
    cal.add_argument("--out", type=Path, required=True, metavar="FILE.json", help="where the profile goes")
    cal.add_argument("host_args", nargs=argparse.REMAINDER, metavar="-- HOST_ARGS",
                     help="with --host: the host's training arguments, e.g. -- --config llama3_debugmodel_pp2_1f1b")
    cal.set_defaults(run=run_calibrate)
    return cal


def profile_sizes(path: Path) -> dict:
    """The model and sizes a cost profile was measured on (``model``, ``layers``, ``batch``,
    ``seq``; what it lacks is absent)."""
    from piper_plugin.calibrate import read_profile

    try:
        data = read_profile(path)
    except ValueError as exc:
        raise UsageError(f"--profile: {exc}") from None
    if "host" in data:
        flag = "--piper-profile" if data["host"] == "megatron" else "--piper.profile"
        raise UsageError(f"--profile {path}: it was measured on --host {data['host']} ({data.get('model')}); "
                         f"a host's plans are its adapter's: pass it to the host's {flag}")
    return _sizes(data)


def _sizes(data: dict) -> dict:
    return {k: data[k] for k in ("model", "layers", "batch", "seq") if k in data}


def inside_link_or_rerun(rate: str, again: list[str]) -> int | None:
    """Inside an emulated link of ``rate``: None (go on). Outside: ``piper <again>`` re-run inside
    one; its exit status."""
    from piper_plugin.runtime.launch.emulated_link import (
        inside_link, link_bits_per_second, python_module_argv, run_in_emulated_link)

    try:
        link_bits_per_second(rate)
    except ValueError as exc:
        raise UsageError(f"--link: {exc}") from None
    if inside_link() == rate:
        return None
    try:
        return run_in_emulated_link(rate, python_module_argv("piper_plugin.cli", again))
    except RuntimeError as exc:
        raise UsageError(f"--link {rate}: {exc}") from None


def run_calibrate(args: argparse.Namespace) -> int:
    from piper_plugin.calibrate import calibrate

    if args.ranks < 2:
        raise UsageError("--ranks 1: calibrating messages needs 2 ranks or more")
    host_args = list(args.host_args or [])
    if host_args and host_args[0] == "--":
        host_args = host_args[1:]
    if args.host is not None or host_args:
        return _run_host_calibration(args, host_args)
    if args.rounds != 1:
        raise UsageError(f"--rounds {args.rounds}: rounds are for --host calibrations; a toy model's jobs run once "
                         f"(raise --steps for a longer median)")
    if args.link is not None:
        code = inside_link_or_rerun(args.link, [
            "calibrate", "--model", args.model, "--ranks", str(args.ranks), "--layers", str(args.layers), "--batch",
            str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--link", args.link, "--out",
            str(args.out.resolve())])
        if code is not None:
            return code
    if args.steps < 3:
        raise UsageError(f"--steps {args.steps}: a calibration job needs 3 steps or more (its first 2 are left out)")
    check_seq(args.seq)
    profile = calibrate(model=args.model, ranks=args.ranks, layers=args.layers, batch=args.batch, seq=args.seq,
                        steps=args.steps)
    if args.link is not None:
        profile["link"] = args.link
    args.out.write_text(json.dumps(profile, indent=1))
    kinds = ", ".join(f"{k} {c[0] * 1e3:.2f} ms + {c[1] * 1e6:.1f} us/op" for k, c in profile["compute"].items())
    print(f"profile    {kinds}")
    print(f"wrote {args.out}: piper tune --ranks {args.ranks} --profile {args.out} (its model: {args.model}, "
          f"{args.layers} layers, batch {args.batch}, seq {args.seq})")
    return 0


def _run_host_calibration(args: argparse.Namespace, host_args: list[str]) -> int:
    """``piper calibrate --host NAME [--ranks N] [--steps S] --out P -- <host arguments>``."""
    from piper_plugin.calibrate_host import HostJobsFailed, calibrate_host

    if args.host is None:
        raise UsageError(f"unrecognized arguments {' '.join(host_args)}: a host's arguments go after --host NAME --, "
                         f"e.g. piper calibrate --host torchtitan --out p.json -- --config llama3_debugmodel_pp2_1f1b")
    if not host_args:
        raise UsageError(f"--host {args.host}: put the host's training arguments after --, e.g. -- --config "
                         f"llama3_debugmodel_pp2_1f1b")
    if args.link is not None:
        code = inside_link_or_rerun(args.link, [
            "calibrate", "--host", args.host, "--ranks", str(args.ranks), "--steps", str(args.steps), "--rounds",
            str(args.rounds), "--link", args.link, "--out", str(args.out.resolve()), "--", *host_args])
        if code is not None:
            return code
    try:
        profile = calibrate_host(args.host, host_args, nproc=args.ranks, steps=args.steps, rounds=args.rounds)
    except HostJobsFailed as exc:
        print(f"piper: error: {exc}", file=sys.stderr)
        print(exc.details, file=sys.stderr)
        return 1
    if args.link is not None:
        profile["link"] = args.link
    args.out.write_text(json.dumps(profile, indent=1))
    flag = "--piper-profile" if args.host == "megatron" else "--piper.profile"
    print(f"wrote {args.out}: add {flag} {args.out} to the host's command to see each plan's predicted step")
    return 0


def _print_result(result, args: argparse.Namespace, seconds: bool) -> None:
    """The refusals, then the plans under the cap fastest first (a UsageError when none is)."""
    from piper_plugin.train_report import human_bytes

    for reason, count in sorted(result.refused.items(), key=lambda kv: -kv[1]):
        print(f"        {count:4d} x {reason}")
    if not result.fitting:
        smallest = result.over_cap[0] if result.over_cap else None
        hint = (f"; the smallest plan needs {human_bytes(smallest.peak_bytes)} per rank ({smallest.candidate.label()})"
                if smallest else "")
        raise UsageError(f"no plan fits --memory-cap {human_bytes(args.memory_cap or 0)}{hint}: raise the cap, "
                         f"add ranks or lower --batch")
    scale = 1e3 if seconds else 1.0
    rows = [("#", "plan", f"step ({'ms' if seconds else 'units'})", "bubble", "peak/rank")]
    for i, s in enumerate(result.fitting[:args.top], 1):
        rows.append((str(i), s.candidate.label(), f"{s.step_time * scale:.4g}", f"{s.bubble:.1%}",
                     human_bytes(s.peak_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if result.over_cap:
        print(f"\n{len(result.over_cap)} plans above the cap (smallest: {human_bytes(result.over_cap[0].peak_bytes)})")


def _run_host_tune(args: argparse.Namespace, data: dict) -> int:
    """``piper tune --profile P`` of a host profile: every built-in recipe, microbatch count,
    stage layout the calibration ran, ZeRO level the host runs there (its ``tunable_zero``) and
    overlay on the host's own grid, simulated over the host's programs the profile keeps;
    ``--out`` writes the best as a trace, and the host command that runs it is printed."""
    from piper_plugin.calibrate import cost_model
    from piper_plugin.calibrate_host import host_module, unpack_programs
    from piper_plugin.measured_memory import with_measured_memory
    from piper_plugin.recipes import load as load_recipe
    from piper_plugin.tune import search

    programs = {n: with_measured_memory(p, data) for n, p in unpack_programs(data).items()}
    if not programs:
        raise UsageError(f"--profile {args.profile}: it keeps no program of the host's model (an older "
                         f"calibration); run piper calibrate --host {data['host']} again")
    grid = tuple(int(data["grid"][k]) for k in ("pp", "dp", "ep"))
    batch = next(iter(programs.values())).dag.batch_size

    def build(stages: int):
        if stages not in programs:
            raise ValueError(f"no program of N stages was calibrated (the host ran {sorted(programs)})")
        return programs[stages]

    module = host_module(data["host"])
    tunable = getattr(module, "tunable_recipes", None)  # optional: what the host runs for these arguments
    levels = getattr(module, "tunable_zero", None)  # optional: the ZeRO levels the host runs on this grid
    zero_levels = tuple(levels(data["host_args"], data["ranks"])) if levels else (0,)
    result = search(build, grid[0] * grid[1] * grid[2], batch, experts=False, cost=cost_model(data),
                    memory_cap=args.memory_cap, grid=grid, zero_levels=zero_levels,
                    recipes=tunable(data["host_args"], data["ranks"]) if tunable else None)
    scored = len(result.fitting) + len(result.over_cap)
    print(f"tune    {data['model']}, grid pp={grid[0]} x dp={grid[1]} x ep={grid[2]}, ZeRO levels "
          f"{', '.join(map(str, zero_levels))}, batch {batch}, stage counts {sorted(programs)}, profile "
          f"{args.profile}: {scored} distinct plans simulated, {sum(result.refused.values())} did not apply")
    _print_result(result, args, seconds=True)
    best = result.fitting[0]
    if args.out:
        args.out.write_text(best.schedule.dumps())
        cand = best.candidate
        stages = load_recipe(cand.recipe).stages(cand.pp, cand.chunks)
        zero = {"zero": cand.zero} if levels else {}  # a host without tunable_zero keeps its own flags
        command = module.job_argv(data["host_args"], data["ranks"], recipe=str(args.out), microbatches=cand.microbatches,
                                  chunks=stages // cand.pp, **zero)
        print(f"\nwrote {args.out}: run it with torchrun --nproc_per_node={data['ranks']} -m {module.program} "
              f"{shlex.join(command)} (and the run's length: --training.steps / --train-iters)")
    return 0


def run_tune(args: argparse.Namespace) -> int:
    import torch

    from piper_plugin.calibrate import cost_model
    from piper_plugin.data.text import vocab_size
    from piper_plugin.ir.capture import capture
    from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
    from piper_plugin.scheduler.cost import CostModel
    from piper_plugin.tune import search

    sizes: dict = {}
    if args.profile is not None:
        from piper_plugin.calibrate import read_profile

        try:
            data = read_profile(args.profile)
        except ValueError as exc:
            raise UsageError(f"--profile: {exc}") from None
        if "host" in data:
            return _run_host_tune(args, data)
        sizes = _sizes(data)
    if args.ranks is None:
        raise UsageError("--ranks is missing: the number of ranks to plan for, e.g. --ranks 2")
    layers, batch = args.layers or sizes.get("layers", 8), args.batch or sizes.get("batch", 16)
    seq = args.seq or sizes.get("seq", 32)
    check_seq(seq)
    experts = args.model == "toy-moe"

    def build_program(stages: int):
        with torch.device("meta"):
            model, cfg = TOY_MODELS[args.model](stages=stages, layers=layers, vocab=vocab_size(), seq=seq)
        tokens, targets = lm_batch(cfg, batch)
        return capture(model, lm_loss, (tokens,), targets)

    if args.profile is not None:
        cost, cost_name = cost_model(args.profile), f"profile {args.profile}"
        measured_on = (sizes.get("model"), sizes.get("layers"), sizes.get("batch"), sizes.get("seq"))
        if measured_on != (args.model, layers, batch, seq):
            print(f"tune    note: the profile was measured on {measured_on[0]}, {measured_on[1]} layers, batch "
                  f"{measured_on[2]}, seq {measured_on[3]}; its figures are used as measured")
    else:
        cost, cost_name = (CostModel.cpu_default() if args.cost == "cpu" else CostModel.uniform()), args.cost
    result = search(build_program, args.ranks, batch, experts=experts, cost=cost, memory_cap=args.memory_cap,
                    max_stages=layers)
    scored = len(result.fitting) + len(result.over_cap)
    print(f"tune    {args.model}, {layers} layers, batch {batch}, seq {seq}, {args.ranks} ranks, cost {cost_name}: "
          f"{scored} distinct plans simulated ({result.duplicates} candidates gave a plan already seen, "
          f"{result.no_overlay} stream overlays found nothing to move), {sum(result.refused.values())} did not apply")
    _print_result(result, args, seconds=args.profile is not None or args.cost == "cpu")
    best = result.fitting[0]
    if args.out:
        args.out.write_text(best.schedule.dumps())
        print(f"\nwrote {args.out}: piper train --recipe-file {args.out} --layers {layers} --batch {batch} --seq {seq}"
              + (f" --model {args.model}" if args.model != "toy-lm" else ""))
    return 0
