"""``piper launch``: a host framework's own trainer on N Ray actors, one per rank.

    piper launch --nproc 2 [--address HOST:PORT] [--timeout 600] -- --config llama3_debugmodel_pp2_1f1b \\
        --parallelism.pipeline_engine=piper [any other torchtitan.train flag]
    piper launch --nproc 2 --host megatron -- --pipeline-model-parallel-size 2 --num-layers 4 ... \\
        --pipeline-engine=piper [any other pretrain_gpt argument]

``--host torchtitan`` (the default) runs ``torchtitan.train``; any other host is an adapter
that registered itself in the ``piper_plugin.hosts`` entry-point group (the Megatron adapter's
``pretrain_gpt``, as ``megatron``): a module with ``host_argv(args, nproc)`` (checks what
followed ``--`` before Ray starts) and ``rank_class`` (a :class:`~piper_plugin.HostRank`). The
actors and the driver are the engine's (:func:`~piper_plugin.launch_host`); the rest below holds
for every host.

Invariants:

* the command line (``--nproc``, the engine, the ``--config`` name for Piper's module) is checked
  before Ray or any actor starts; an unknown config name lists the ones that exist;
* every actor runs ``torchtitan.train.main()`` in-process with ``sys.argv`` = the arguments after
  ``--`` (plus ``--module piper_plugin.adapters.torchtitan`` unless one is given), the
  torch.distributed env torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT: a free port on rank 0's node; ranks of one node are contiguous),
  the driver's working directory when it exists there, and 1 torch thread;
* each rank's stdout/stderr (file descriptors 1 and 2, so C++ output too) reaches the driver's
  stdout as ``(rank R) <line>``, and still lands in Ray's worker log;
* the job ends when every rank returned; a failing rank (exception, non-zero exit, dead actor)
  ends it with :class:`WorkerFailed` naming the earliest failure and its traceback; no output
  from any rank for ``--timeout`` seconds ends it too; either way every actor is killed, and a
  Ray started here is shut down.
"""
from __future__ import annotations

import argparse
import ast
from importlib.metadata import entry_points
from pathlib import Path
from typing import Sequence, TextIO

from piper_plugin import HostRank, UsageError, launch_host
from piper_plugin.adapters.torchtitan import config_names
from piper_plugin.adapters.torchtitan.launch import train_main

__all__ = ["add_launch_parser", "run_launch", "launch", "titan_argv", "flag_value", "TitanRank", "PIPER_MODULE"]

PIPER_MODULE = "piper_plugin.adapters.torchtitan"
_EXAMPLE = "piper launch --nproc 2 -- --config llama3_debugmodel_pp2_1f1b --parallelism.pipeline_engine=piper"
HOSTS = "piper_plugin.hosts"  # entry-point group: other adapters' trainers for --host


# -- command line --------------------------------------------------------------------------------
def _nproc(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks; pass --nproc N with N >= 1 "
                                         f"(one Ray actor per rank)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def add_launch_parser(commands) -> argparse.ArgumentParser:
    """The ``piper launch`` subcommand (registered through the ``piper_plugin.commands`` entry point)."""
    launch_parser = commands.add_parser(
        "launch", help="run TorchTitan's trainer (torchtitan.train) on N Ray actors, one per rank",
        description="Run torchtitan.train on N Ray actors (a quiet local Ray, or --address). Everything "
                    f"after -- goes to TorchTitan unchanged; --module {PIPER_MODULE} is added unless given. "
                    "Each rank's output reaches this terminal prefixed (rank R); TorchTitan writes its logs, "
                    "checkpoints and traces to --dump_folder, ./outputs of this directory unless given. "
                    f"Example: {_EXAMPLE}")
    launch_parser.__class__ = _LaunchParser  # extras mean TorchTitan flags given without "--"
    launch_parser.add_argument("--nproc", type=_nproc, metavar="N", help="number of ranks (Ray actors); required")
    launch_parser.add_argument("--address", metavar="HOST:PORT",
                               help="join an existing Ray cluster (start it with token authentication: `ray "
                                    "get-auth-token --generate`, then RAY_AUTH_MODE=token ray start --head; set "
                                    "RAY_AUTH_MODE=token here too) instead of starting a local one")
    launch_parser.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                               help="stop the job when no rank prints a line for S seconds (default: 600)")
    launch_parser.add_argument("--host", choices=("torchtitan", *sorted(_hosts())), default="torchtitan",
                               help="whose trainer runs: torchtitan.train (default), or another adapter's "
                                    "(megatron: its pretrain_gpt entry, Megatron-LM's arguments after --)")
    launch_parser.add_argument("titan_args", nargs=argparse.REMAINDER, metavar="-- TORCHTITAN_ARGS",
                               help="the arguments of python -m torchtitan.train (or of pretrain_gpt)")
    launch_parser.set_defaults(run=run_launch)
    return launch_parser


class _LaunchParser(argparse.ArgumentParser):
    """Errors raise UsageError (one ``piper: error:`` line); leftovers are TorchTitan flags without --."""

    def error(self, message: str) -> None:
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            raise UsageError(f"unrecognized arguments {' '.join(extras)}: TorchTitan's arguments go after --, "
                         f"e.g. {_EXAMPLE}")
        return namespace, extras


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name V`` / ``--name=V`` in ``argv`` (None if absent)."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _engine_choices() -> tuple[str, ...]:
    """The ``Literal`` choices of ``pipeline_engine`` in trainer.py, read from its source (importing
    TorchTitan costs ~10 s); empty when the source does not have that shape (then TorchTitan checks)."""
    try:
        tree = ast.parse(Path(__file__).with_name("trainer.py").read_text())
    except (OSError, SyntaxError):
        return ()
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "pipeline_engine" and isinstance(node.annotation, ast.Subscript)):
            inner = node.annotation.slice
            items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items):
                return tuple(e.value for e in items)
    return ()


def titan_argv(titan_args: Sequence[str]) -> list[str]:
    """Validate what followed ``--`` and return torchtitan.train's argv (``--module`` added)."""
    args = list(titan_args)
    if args and args[0] == "--":
        args = args[1:]
    elif args:
        raise UsageError(f"unexpected argument {args[0]!r}: TorchTitan's arguments go after --, e.g. {_EXAMPLE}")
    if not args:
        raise UsageError(f"no TorchTitan arguments: put them after --, e.g. {_EXAMPLE}")
    module = flag_value(args, "--module")
    if module is None:
        args = ["--module", PIPER_MODULE, *args]
    config = flag_value(args, "--config")
    if config is None:
        raise UsageError("--config is missing after --: name a config function, e.g. -- --config "
                         "llama3_debugmodel_pp2_1f1b")
    if module in (None, PIPER_MODULE):
        problem = config_names.unknown(config)
        if problem:
            raise UsageError(f"--config {config!r}: {problem}")
    engine = flag_value(args, "--parallelism.pipeline_engine", "--parallelism.pipeline-engine")
    choices = _engine_choices() if module in (None, PIPER_MODULE) else ()
    if engine is not None and choices and engine not in choices:
        raise UsageError(f"--parallelism.pipeline_engine {engine!r} is not an engine: use one of {', '.join(choices)}")
    return args


def run_launch(args: argparse.Namespace) -> int:
    if args.nproc is None:
        raise UsageError(f"--nproc is missing: pass the number of ranks, e.g. {_EXAMPLE}")
    host = getattr(args, "host", "torchtitan")
    if host != "torchtitan":
        adapter = _hosts()[host].load()
        launch_host(args.nproc, adapter.host_argv(args.titan_args, args.nproc), adapter.rank_class,
                    address=args.address, timeout_s=args.timeout)
        return 0
    argv = titan_argv(args.titan_args)
    launch(args.nproc, argv, address=args.address, timeout_s=args.timeout)
    return 0


def _hosts() -> dict:
    """Registered hosts other than TorchTitan: name -> entry point (loaded only when chosen)."""
    return {e.name: e for e in entry_points(group=HOSTS)}


# -- the actor -----------------------------------------------------------------------------------
class TitanRank(HostRank):
    """One rank running ``torchtitan.train``."""

    program = "torchtitan.train"

    def main(self, argv: list[str]) -> None:
        train_main(argv)


def launch(nproc: int, argv: Sequence[str], *, address: str | None = None, timeout_s: float = 600.0,
           start_timeout_s: float | None = None, out: TextIO | None = None, rank_cls: type = TitanRank) -> None:
    """Run ``torchtitan.train`` with ``argv`` on ``nproc`` Ray actors of ``rank_cls`` (a TitanRank
    subclass may replace ``run``); raises WorkerFailed (:func:`piper_plugin.launch_host`)."""
    launch_host(nproc, argv, rank_cls, address=address, timeout_s=timeout_s, start_timeout_s=start_timeout_s,
                out=out)
