"""``piper train``: run a schedule on real ranks and train the toy LM on the shipped text.

    piper train --recipe 1f1b --pp 2 --microbatches 4 --steps 30 [--metrics m.jsonl] [--trace DIR]
    piper train ... --checkpoint ckpt --checkpoint-every 10; piper train ... --resume ckpt --steps 60

The strategy flags are those of ``piper plan``. Ranks start as Ray actors (default; a quiet
local Ray, or an existing cluster with ``--address``), as forked local processes
(``--launcher fork``, fastest to start) or inside processes torchrun started
(``--launcher spmd``; every rank runs this command, rank 0 prints and writes the files).
One line per step once every rank reported it; a summary at the end; ``--trace`` writes the
measured last step as a Chrome trace and a picture next to the simulator's picture.
``--checkpoint`` saves every rank's state in torch.distributed.checkpoint format; ``--resume``
continues it under any strategy of the same model, data and batch
(:mod:`~piper_plugin.runtime.train_checkpoint`): what the job trains (model, layers, seq, batch,
seed, lr) comes from the checkpoint unless given, and must then agree with it.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

from piper_plugin.cli_args import (
    UsageError, add_strategy_args, check_seq, int_at_least, positive_float, positive_int, resolve_strategy,
)

__all__ = ["add_train_parser", "run_train"]

_natural = int_at_least(0, ">= 0")


def add_train_parser(commands) -> argparse.ArgumentParser:
    """The ``train`` subcommand; its strategy flags resolve as ``piper plan``'s do
    (:func:`~piper_plugin.cli_args.resolve_strategy`)."""
    from piper_plugin.training import LAUNCHERS

    train = commands.add_parser(
        "train", help="train the toy LM with a schedule on real ranks (Ray, forked processes or torchrun)",
        description="Run a schedule on pp x dp x ep ranks and train the toy LM on the shipped text: "
                    "one line per step, a summary, optionally a metrics file and the measured trace.")
    add_strategy_args(train)
    train.add_argument("--steps", type=positive_int, default=20, metavar="N",
                       help="training steps in all, a resumed run's included (default: 20)")
    train.add_argument("--lr", type=positive_float, help=f"AdamW learning rate (default: {_DEFAULTS['lr']:g})")
    train.add_argument("--seed", type=_natural, help=f"model init and data order seed (default: {_DEFAULTS['seed']})")
    train.add_argument("--seq", type=positive_int, metavar="T", help=f"sequence length (default: {_DEFAULTS['seq']})")
    train.add_argument("--layers", type=positive_int, metavar="L",
                       help="transformer layers, at least one per stage (default: the stages, at least 2); "
                            "fix it to resume under another --pp")
    train.add_argument("--on-nan", choices=("stop", "skip"), default="stop",
                       help="a step whose loss is NaN or infinite: stop the job naming it (default), or skip "
                            "it: no rank applies its update")
    train.add_argument("--autocast", choices=("bf16",),
                       help="mixed precision: every forward and the loss under torch.autocast in bf16 on the "
                            "ranks' device; parameters, gradients and AdamW state stay fp32 (default: fp32)")
    train.add_argument("--checkpoint", type=Path, metavar="DIR",
                       help="save DIR/step-<N> (torch.distributed.checkpoint) after the last step and every "
                            "--checkpoint-every steps")
    train.add_argument("--checkpoint-every", type=positive_int, metavar="N", help="also save every N steps")
    train.add_argument("--resume", type=Path, metavar="PATH",
                       help="continue from PATH (a step-<N> directory, or the newest complete one in it) under "
                            "this command's strategy; --steps counts from the start of the run")
    train.add_argument("--nproc", type=positive_int, metavar="N",
                       help="number of ranks; must equal pp x dp x ep (a check, it sets nothing)")
    train.add_argument("--launcher", choices=LAUNCHERS, default="ray",
                       help="ray: one actor per rank (default); fork: local processes; "
                            "spmd: inside torchrun (every rank runs this command)")
    train.add_argument("--address", metavar="HOST:PORT",
                       help="join an existing Ray cluster (start it with token authentication: `ray get-auth-token "
                            "--generate`, then RAY_AUTH_MODE=token ray start --head; set RAY_AUTH_MODE=token here too) "
                            "instead of starting a local one")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="cpu: gloo between ranks; cuda: one GPU per rank (LOCAL_RANK), NCCL, one CUDA "
                            "stream per logical stream (default: cpu)")
    train.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                       help="seconds without progress before the job is stopped (default: 60)")
    train.add_argument("--metrics", type=Path, metavar="FILE.jsonl",
                       help="write one JSON object per step and rank (step from 0, rank, loss on the "
                            "ranks holding the loss, step_time_s, tokens_per_s, peak_memory_bytes, "
                            "transient_peak_bytes)")
    train.add_argument("--trace", type=Path, metavar="DIR",
                       help="write DIR/trace.json (measured last step, Chrome/Perfetto), DIR/timeline.png "
                            "(measured) and DIR/simulated.png")
    train.set_defaults(run=run_train)
    return train


_DEFAULTS = {"seq": 32, "lr": 3e-3, "seed": 0}
_JOB_FLAGS = {"model": "--model", "layers": "--layers", "seq": "--seq", "batch": "--batch", "seed": "--seed",
              "lr": "--lr"}


def _resumed(args: argparse.Namespace) -> tuple[Path, dict[str, Any]] | None:
    """The complete checkpoint ``--resume`` names, with its mark (found before any rank starts)."""
    from piper_plugin.runtime.train_checkpoint import MARK, complete_checkpoint

    if args.resume is None:
        return None
    found = complete_checkpoint(args.resume) if args.resume.is_dir() else None
    if found is None:
        raise UsageError(f"--resume {str(args.resume)!r}: no complete checkpoint there (a step-<N> directory "
                         f"holding {MARK}, as --checkpoint writes); name one, or the directory given to --checkpoint")
    path, mark = found
    if mark["step"] >= args.steps:
        raise UsageError(f"--steps {args.steps}: the checkpoint {str(path)!r} is at step {mark['step']} already; "
                         "--steps counts from the start of the run, ask for more")
    return found


def _job_flags(args: argparse.Namespace, setup, resumed) -> dict[str, Any]:
    """What the job trains: given flags, else the checkpoint's, else the defaults; a given flag
    that disagrees with the checkpoint is an error naming it."""
    saved = resumed[1].get("job", {}) if resumed else {}
    defaults = {**_DEFAULTS, "model": args.model, "layers": max(setup.stages, 2),
                "batch": setup.microbatches * setup.dp * setup.ep * 2}
    flags = {}
    for key, flag in _JOB_FLAGS.items():
        given = getattr(args, key)
        if resumed and given is not None and key in saved and given != saved[key]:
            raise UsageError(f"--resume: the checkpoint trained {flag} {saved[key]}, not {given}; drop {flag} or "
                             f"pass {flag} {saved[key]}")
        flags[key] = given if given is not None else saved.get(key, defaults[key])
    if flags["layers"] < setup.stages:
        raise UsageError(f"--layers {flags['layers']}: the schedule has {setup.stages} stages, at least one layer "
                         f"each; use --layers {setup.stages} or more")
    return flags


def _check(args: argparse.Namespace, setup) -> int:
    world = setup.pp * setup.dp * setup.ep
    if args.nproc is not None and args.nproc != world:
        raise UsageError(f"--nproc {args.nproc} does not match the schedule's pp x dp x ep = "
                         f"{setup.pp} x {setup.dp} x {setup.ep} = {world} ranks")
    if args.trace is not None and args.trace.exists() and not args.trace.is_dir():
        raise UsageError(f"--trace {str(args.trace)!r} is a file; it names a directory (created if missing)")
    if args.checkpoint_every is not None and args.checkpoint is None:
        raise UsageError("--checkpoint-every saves into --checkpoint DIR; give that too")
    if args.checkpoint is not None and args.checkpoint.exists() and not args.checkpoint.is_dir():
        raise UsageError(f"--checkpoint {str(args.checkpoint)!r} is a file; it names a directory (created if missing)")
    if args.address and args.launcher != "ray":
        raise UsageError(f"--address joins a Ray cluster; it needs --launcher ray, not {args.launcher}")
    if args.launcher == "spmd":
        env_world = os.environ.get("WORLD_SIZE")
        if env_world is None:
            raise UsageError("--launcher spmd runs inside torchrun: torchrun --nproc_per_node "
                             f"{world} -m piper_plugin.cli train --launcher spmd ...")
        if int(env_world) != world:
            raise UsageError(f"torchrun started {env_world} ranks but the schedule needs pp x dp x ep = {world}; "
                             f"use --nproc_per_node {world}")
    if args.device == "cuda" and not (args.launcher == "ray" and args.address):  # ranks on this machine
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        needed = 1 if args.launcher == "spmd" else world  # under torchrun: this process's LOCAL_RANK
        if have < needed:
            raise UsageError(f"--device cuda needs one GPU per rank: {needed} rank(s) here but {have} GPU(s); "
                             "use --device cpu, or --address of a Ray cluster with GPUs")
    return world


def run_train(args: argparse.Namespace) -> int:
    import torch

    from piper_plugin.scheduler.simulate import simulate
    from piper_plugin.train_report import Progress, measured_costs, measured_result, write_trace
    from piper_plugin.training import run, toy_job

    setup = resolve_strategy(args)
    world = _check(args, setup)
    resumed = _resumed(args)
    flags = _job_flags(args, setup, resumed)
    check_seq(flags["seq"])
    model, batch, layers, seq, lr, seed = (flags[k] for k in ("model", "batch", "layers", "seq", "lr", "seed"))
    described = {"job": flags, "strategy": {"recipe": setup.name, "pp": setup.pp, "dp": setup.dp, "ep": setup.ep,
                                            "zero": setup.zero, "microbatches": setup.microbatches}}
    job = toy_job(setup.apply, model=model, stages=setup.stages, layers=layers, batch=batch, seq=seq,
                  steps=args.steps, lr=lr, seed=seed, timeout_s=args.timeout, device=args.device,
                  checkpoint_dir=str(args.checkpoint) if args.checkpoint else None,
                  checkpoint_every=args.checkpoint_every, resume_from=str(resumed[0]) if resumed else None,
                  first_step=resumed[1]["step"] if resumed else 0, description=described,
                  on_nonfinite_loss=args.on_nan, autocast=torch.bfloat16 if args.autocast == "bf16" else None)
    spmd = args.launcher == "spmd"
    leader = not spmd or int(os.environ.get("RANK", "0")) == 0
    say = print if leader else (lambda *a, **k: None)

    previous_term = _term_as_interrupt()
    metrics_file = None
    try:
        if leader and args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
        if leader and args.metrics:
            args.metrics.parent.mkdir(parents=True, exist_ok=True)
            metrics_file = args.metrics.open("w")
        where = f"Ray cluster {args.address}" if args.address else args.launcher
        say(f"train    {model}, {layers} layers in {setup.stages} stages, schedule {setup.name}: "
            f"pp={setup.pp} dp={setup.dp} ep={setup.ep} ({world} ranks, {where}), {setup.microbatches} "
            f"microbatches, zero {setup.zero}")
        say(f"data     shipped text, batch {batch} x seq {seq} = {batch * seq:,} tokens/step, "
            f"{args.steps} steps, AdamW lr {lr:g}, seed {seed}", flush=True)
        if resumed:
            was = resumed[1].get("strategy", {})
            say(f"resume   {resumed[0]} (step {resumed[1]['step']}; saved under "
                f"{' '.join(f'{k}={v}' for k, v in was.items())})", flush=True)
        progress = Progress(world, args.steps, metrics_file=metrics_file, first_step=job.first_step)
        on_metrics = _gathering(progress, leader) if spmd else progress
        owned = spmd and not _initialized()  # this command makes torchrun's process group: it ends it too
        with warnings.catch_warnings():  # forked ranks inherit the filter
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
            result = run(job, launcher=args.launcher, address=args.address, on_metrics=on_metrics)
        timelines = _timelines(result, spmd)
        if owned:
            _end_process_group()
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    if not leader:
        return 0
    for line in progress.summary():
        print(line)
    plan, simulated = result.plan, result.simulated
    if plan is None:  # spmd: every rank compiled its own; compile the same plan here for the report
        from piper_plugin.compiler import compile_job

        _, _, plan, simulated = compile_job(job)
    measured = measured_result(plan, timelines)
    calibrated = simulate(plan, measured_costs(plan, measured))
    print(f"bubble   measured {measured.bubble_fraction:.1%} (last step, 1 - compute / step span, mean over "
          f"ranks)   simulated {simulated.bubble_fraction:.1%} (F=1 B=2 W=1, free comm)")
    print(f"         simulated with the last step's task times: bubble {calibrated.bubble_fraction:.1%}, step "
          f"{calibrated.step_time * 1e3:.1f} ms vs {measured.step_time * 1e3:.1f} ms measured (the rest: "
          f"messages, waits, runtime)")
    if args.metrics:
        print(f"wrote    {args.metrics} ({world * len(progress.done)} lines: steps x ranks)")
    if args.trace:
        paths = write_trace(args.trace, plan, measured, simulated, setup.name)
        print(f"wrote    {paths[0]} (open in https://ui.perfetto.dev), {paths[1]} (measured), {paths[2]}")
    return 0


def _term_as_interrupt():
    """SIGTERM stops the job like Ctrl-C does: the launcher's cleanup kills every rank."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _gathering(progress, leader: bool):
    """Under torchrun each process sees its own rank's metrics: gather them on rank 0 per step."""
    import torch.distributed as dist

    def on_metrics(metrics: dict[str, Any]) -> None:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, metrics)  # between steps: no stream thread uses the group
        if leader:
            for m in every:
                progress(m)

    return on_metrics


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _end_process_group() -> None:
    """Every rank is done with collectives, then each destroys its groups: a rank that simply
    exits leaves its communicators' threads to the interpreter's teardown."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _timelines(result, spmd: bool) -> dict[int, list]:
    if not spmd:
        return {r: final["timeline"] for r, final in result.per_rank.items()}
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, result.per_rank[0]["timeline"])
    return dict(enumerate(every))
