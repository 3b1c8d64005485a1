"""``piper launch``: a host framework's own trainer on N Ray actors, one per rank.

    piper launch --nproc 2 [--address HOST:PORT] [--timeout 600] -- --config llama3_debugmodel_pp2_1f1b \\
        --parallelism.pipeline_engine=piper [any other torchtitan.train flag]
    piper launch --nproc 2 --host megatron -- --pipeline-model-parallel-size 2 --num-layers 4 ... \\
        --pipeline-engine=piper [any other pretrain_gpt argument]

``--host torchtitan`` (the default) runs ``torchtitan.train``; ``--host megatron`` runs the
Megatron adapter's ``pretrain_gpt`` entry (:class:`~piper_plugin.adapters.megatron.launch.MegatronRank`),
its arguments checked here before Ray starts. The rest below holds for both.

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
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence, TextIO

from piper_plugin import UsageError, WorkerFailed, start_ray
from piper_plugin.adapters.torchtitan import config_names
from piper_plugin.adapters.torchtitan.launch import train_main

__all__ = ["add_launch_parser", "run_launch", "launch", "titan_argv", "TitanRank", "PIPER_MODULE"]

PIPER_MODULE = "piper_plugin.adapters.torchtitan"
_EXAMPLE = "piper launch --nproc 2 -- --config llama3_debugmodel_pp2_1f1b --parallelism.pipeline_engine=piper"
_POLL_S = 0.5  # how often the driver collects output
_GRACE_S = 3.0  # after a failure, how long to wait for other ranks' results (to name the earliest)


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
                               help="join an existing Ray cluster (started with RAY_AUTH_MODE=disabled ray start "
                                    "--head) instead of starting a local one")
    launch_parser.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                               help="stop the job when no rank prints a line for S seconds (default: 600)")
    launch_parser.add_argument("--host", choices=("torchtitan", "megatron"), default="torchtitan",
                               help="whose trainer runs: torchtitan.train (default), or the Megatron adapter's "
                                    "pretrain_gpt entry (Megatron-LM's arguments after --)")
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


def _flag_value(argv: Sequence[str], *names: str) -> str | None:
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
    module = _flag_value(args, "--module")
    if module is None:
        args = ["--module", PIPER_MODULE, *args]
    config = _flag_value(args, "--config")
    if config is None:
        raise UsageError("--config is missing after --: name a config function, e.g. -- --config "
                         "llama3_debugmodel_pp2_1f1b")
    if module in (None, PIPER_MODULE):
        problem = config_names.unknown(config)
        if problem:
            raise UsageError(f"--config {config!r}: {problem}")
    engine = _flag_value(args, "--parallelism.pipeline_engine", "--parallelism.pipeline-engine")
    choices = _engine_choices() if module in (None, PIPER_MODULE) else ()
    if engine is not None and choices and engine not in choices:
        raise UsageError(f"--parallelism.pipeline_engine {engine!r} is not an engine: use one of {', '.join(choices)}")
    return args


def run_launch(args: argparse.Namespace) -> int:
    if args.nproc is None:
        raise UsageError(f"--nproc is missing: pass the number of ranks, e.g. {_EXAMPLE}")
    if getattr(args, "host", "torchtitan") == "megatron":
        from piper_plugin.adapters.megatron.launch import MegatronRank, megatron_argv

        launch(args.nproc, megatron_argv(args.titan_args, args.nproc), address=args.address, timeout_s=args.timeout,
               rank_cls=MegatronRank)
        return 0
    argv = titan_argv(args.titan_args)
    launch(args.nproc, argv, address=args.address, timeout_s=args.timeout)
    return 0


# -- the actor -----------------------------------------------------------------------------------
class _Capture:
    """Routes file descriptors 1 and 2 through a pipe: every line is kept for :meth:`take` and
    still written to the original stdout (Ray's worker log)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._saved: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        self._saved = (os.dup(1), os.dup(2))
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True, name="piper-capture")
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for raw in pipe:
                try:
                    os.write(self._saved[0], raw)
                except OSError:
                    pass
                with self._lock:
                    self._lines.append(raw.decode(errors="replace").rstrip("\r\n"))

    def stop(self) -> None:
        """Restore fds 1 and 2; the pipe then reaches EOF and every line is in :meth:`take`."""
        if self._saved is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        self._reader.join(timeout=5)

    def take(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


class TitanRank:
    """One rank: ``where`` (node, and a free port for the rendezvous), ``run`` (the trainer),
    ``drain`` (output lines since the last call; answers while ``run`` is busy)."""

    program = "torchtitan.train"

    def __init__(self) -> None:
        self._capture = _Capture()

    def main(self, argv: list[str]) -> None:
        """The trainer, in this process (errors and SystemExit propagate)."""
        train_main(argv)

    def where(self) -> tuple[str, str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, env: dict[str, str], argv: list[str], cwd: str) -> dict[str, Any]:
        os.environ.update(env)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        self._capture.start()
        result: dict[str, Any] = {"ok": True}
        try:
            self.main(argv)
        except SystemExit as exc:  # tyro's argument errors exit; --help exits 0
            if exc.code not in (None, 0):
                result = {"ok": False, "error": f"{self.program} exited with status {exc.code}",
                          "traceback": traceback.format_exc()}
        except BaseException as exc:  # noqa: BLE001 - reported to the driver with its traceback
            lines = traceback.format_exception_only(type(exc), exc)
            result = {"ok": False, "error": lines[-1].strip() if lines else repr(exc),
                      "traceback": traceback.format_exc()}
        finally:
            self._capture.stop()
        result["time"] = time.time()
        return result

    def drain(self) -> list[str]:
        return self._capture.take()


# -- the driver ----------------------------------------------------------------------------------
def _layout(places: list[tuple[str, str, int]]) -> tuple[list[int], dict[int, dict[str, str]]]:
    """Actor order by rank (ranks of one node contiguous, nodes in order of first appearance) and
    each rank's torch.distributed env."""
    nodes: dict[str, list[int]] = {}
    for actor, (node, _, _) in enumerate(places):
        nodes.setdefault(node, []).append(actor)
    order = [actor for members in nodes.values() for actor in members]
    first = places[order[0]]
    single_node = len(nodes) == 1
    common = {"WORLD_SIZE": str(len(places)), "MASTER_ADDR": "127.0.0.1" if single_node else first[1],
              "MASTER_PORT": str(first[2]), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if single_node:
        common["GLOO_SOCKET_IFNAME"] = "lo"
    envs = {}
    for rank, actor in enumerate(order):
        members = nodes[places[actor][0]]
        envs[rank] = {**common, "RANK": str(rank), "LOCAL_RANK": str(members.index(actor)),
                      "LOCAL_WORLD_SIZE": str(len(members))}
    return order, envs


class _Forwarder:
    """Keeps one ``drain`` call in flight per rank and prints what comes back, prefixed."""

    def __init__(self, actors: list, out: TextIO) -> None:
        self.actors, self.out = actors, out
        self.inflight: dict[int, Any] = {}
        self.last_line = time.monotonic()

    def poll(self, wait_s: float = 0.0) -> None:
        import ray

        for rank, actor in enumerate(self.actors):
            if rank not in self.inflight:
                self.inflight[rank] = actor.drain.remote()
        refs = {ref: rank for rank, ref in self.inflight.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in done:
            rank = refs[ref]
            del self.inflight[rank]
            try:
                lines = ray.get(ref)
            except ray.exceptions.RayError:  # a dead actor: its run() result reports it
                continue
            for line in lines:
                self.out.write(f"(rank {rank}) {line}\n")
            if lines:
                self.out.flush()
                self.last_line = time.monotonic()

    def flush(self, wait_s: float = 2.0) -> None:
        """Collect the answers in flight, then ask every rank once more (a returned rank answers all)."""
        self.poll(wait_s)
        self.poll(wait_s)


def launch(nproc: int, argv: Sequence[str], *, address: str | None = None, timeout_s: float = 600.0,
           start_timeout_s: float | None = None, out: TextIO | None = None, rank_cls: type = TitanRank) -> None:
    """Run ``torchtitan.train`` with ``argv`` on ``nproc`` Ray actors of ``rank_cls`` (a TitanRank
    subclass may replace ``run``); raises WorkerFailed. ``timeout_s`` bounds every silence of all
    ranks, ``start_timeout_s`` (default ``timeout_s``) the actors' placement and start."""
    out = out or sys.stdout
    owned = start_ray(address, num_cpus=max(2, os.cpu_count() or 2))
    import ray

    cpus = min(1.0, float(ray.cluster_resources().get("CPU", 1.0)) / nproc)
    cls = ray.remote(num_cpus=cpus, max_concurrency=2)(rank_cls)
    actors = [cls.remote() for _ in range(nproc)]
    try:
        refs = [a.where.remote() for a in actors]
        start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        done, _ = ray.wait(refs, num_returns=nproc, timeout=start_timeout_s)
        if len(done) < nproc:
            raise WorkerFailed(None, f"only {len(done)} of {nproc} actors started within {start_timeout_s:.0f}s "
                                     f"(--timeout); the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs")
        try:
            places = ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise WorkerFailed(None, f"an actor failed to start: {str(exc).strip().splitlines()[0]}") from None
        order, envs = _layout(places)
        actors = [actors[i] for i in order]  # index = rank
        cwd = os.getcwd()
        runs = {a.run.remote(envs[rank], list(argv), cwd): rank for rank, a in enumerate(actors)}
        _wait(runs, _Forwarder(actors, out), timeout_s)
    finally:
        for actor in actors:
            ray.kill(actor)
        if owned:
            ray.shutdown()


def _wait(runs: dict, forward: _Forwarder, timeout_s: float) -> None:
    """Until every rank returned: forward output, and fail on the first failure or a silent stall."""
    import ray

    failures: list[tuple[float, int, str, str]] = []
    failed_at = None
    while runs:
        done, _ = ray.wait(list(runs), num_returns=len(runs), timeout=_POLL_S)
        forward.poll(_POLL_S / 2)
        for ref in done:
            rank = runs.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:
                result = {"ok": False, "time": time.time(), "traceback": "",
                          "error": f"actor died: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"}
            if not result["ok"]:
                failures.append((result["time"], rank, result["error"], result["traceback"]))
                failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        if failures and (not runs or now - failed_at > _GRACE_S):
            break
        if runs and not failures and now - forward.last_line > timeout_s:
            raise WorkerFailed(min(runs.values()), f"no output from any rank for {timeout_s:.0f}s (--timeout); "
                                                   f"ranks {sorted(runs.values())} still running")
    forward.flush()  # the last lines (a failed rank's own error output among them)
    if failures:
        _, rank, error, details = min(failures)
        raise WorkerFailed(rank, error, details)
