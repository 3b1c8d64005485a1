"""``piper`` console commands.

    piper plan --recipe 1f1b --pp 4 --microbatches 8 [--trace t.json --png t.png --json plan.json]
    piper train --recipe 1f1b --pp 2 --microbatches 4 --steps 30 [--metrics m.jsonl --trace DIR]

``plan`` captures a toy model on the meta device, applies a recipe (or a recipe file), compiles
per-rank plans, simulates one step and prints the grid, the bubble next to its textbook value
and per-rank memory. ``train`` (:mod:`piper_plugin.cli_train`) runs the same schedule on real
ranks and trains the toy LM on the shipped text. Every user error ends as one line
``piper: error: <reason>`` on stderr and a non-zero exit status, never a traceback of ours
(a failed rank's own traceback follows its error line).
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser"]

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """A bad command line or input; printed as one ``piper: error:`` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit(2)
        raise UsageError(message)


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")


def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """The flags that say what schedule runs (shared by ``plan`` and ``train``)."""
    from piper_plugin.models import TOY_MODELS
    from piper_plugin.recipes import RECIPES

    parser.add_argument("--model", choices=sorted(TOY_MODELS), default="toy-lm", help="toy model (default: toy-lm)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="1f1b", help="schedule recipe (default: 1f1b)")
    parser.add_argument("--recipe-file", type=Path, metavar="FILE",
                        help="replaces --recipe: a .py file defining recipe(sch, microbatches, **kw) "
                             "(and optionally stages(pp, chunks) -> int, default pp), or a JSON trace "
                             "written by Schedule.dumps() (it fixes --pp/--dp/--ep/--microbatches/--zero)")
    parser.add_argument("--pp", type=_positive, metavar="P", help="pipeline ranks (default: 2)")
    parser.add_argument("--dp", type=_positive, metavar="D", help="data-parallel degree (default: 1)")
    parser.add_argument("--ep", type=_positive, metavar="E", help="expert-parallel degree (default: 1)")
    parser.add_argument("--microbatches", "-m", type=_positive, metavar="M", help="microbatches (default: 4)")
    parser.add_argument("--chunks", "-v", type=_positive, default=2, metavar="V",
                        help="stages per rank for interleaved-1f1b (default: 2)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO level (default: 0)")
    parser.add_argument("--batch", type=_positive, metavar="N",
                        help="global batch (default: microbatches x dp x ep x 2)")


def build_parser() -> argparse.ArgumentParser:
    from piper_plugin.cli_train import add_train_parser

    parser = _Parser(prog="piper", description="Piper: programmable distributed training.")
    commands = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    plan = commands.add_parser(
        "plan", help="compile and simulate a schedule, print its per-rank plan",
        description="Capture a toy model, apply a recipe, compile per-rank plans and simulate one step.")
    add_strategy_args(plan)
    plan.add_argument("--cost", choices=("uniform", "cpu"), default="uniform",
                      help="uniform: F=1 B=2 W=1, free comm; cpu: FLOP-based CPU/gloo estimate")
    plan.add_argument("--trace", type=Path, metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    plan.add_argument("--png", type=Path, metavar="FILE", help="write a timeline picture")
    plan.add_argument("--json", type=Path, metavar="FILE", help="write the compiled plan as JSON")
    plan.set_defaults(run=_run_plan)
    add_train_parser(commands)
    from piper_plugin.adapters.torchtitan.ray_launch import add_launch_parser

    add_launch_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return args.run(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except UsageError as exc:
        return _fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:
        print("piper: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _user_errors() as exc:
        return _fail(exc, EXIT_ERROR)


def _fail(exc: BaseException, code: int) -> int:
    """One line ``piper: error: ...``; a failed rank's original traceback follows below it."""
    launch = sys.modules.get("piper_plugin.runtime.launch.processes")  # loaded if anything ran
    message, details = str(exc), ""
    if launch is not None and isinstance(exc, launch.WorkerFailed):
        message = message.split("\n--- original traceback", 1)[0]
        details = (f"--- original traceback of rank {exc.rank} ---\n{exc.details.rstrip()}"
                   if exc.details else "")
    print("piper: error: " + " ".join(message.split()), file=sys.stderr)
    if details:
        print(details, file=sys.stderr)
    return code


def _user_errors() -> tuple[type[BaseException], ...]:
    from piper_plugin.api.errors import DirectiveError
    from piper_plugin.ir.capture import CaptureError
    from piper_plugin.scheduler.plan import PlanError
    from piper_plugin.runtime.launch.processes import WorkerFailed
    from piper_plugin.runtime.launch.spmd import PlanMismatch
    from piper_plugin.scheduler.simulate import DeadlockError

    return (DirectiveError, CaptureError, PlanError, DeadlockError, WorkerFailed, PlanMismatch, OSError, ValueError)


# -- piper plan -------------------------------------------------------------------------------
_PLAN_DEFAULTS = {"pp": 2, "dp": 1, "ep": 1, "microbatches": 4, "zero": 0}  # a JSON trace may fix these


@dataclass
class _Setup:
    """What the schedule is: its name, grid, microbatches and how to apply it."""

    name: str
    pp: int
    dp: int
    ep: int
    microbatches: int
    zero: int
    stages: int
    apply: Callable[[Any], Any]  # Program -> Schedule
    recipe: str | None = None  # a built-in recipe (for the textbook bubble)


def _builtin_setup(args: argparse.Namespace) -> _Setup:
    from piper_plugin.api.schedule import Schedule
    from piper_plugin.recipes import apply_recipe, stages_needed

    def apply(program):
        sch = Schedule(program, pp=args.pp, dp=args.dp, ep=args.ep)
        return apply_recipe(sch, args.recipe, microbatches=args.microbatches, chunks=args.chunks, zero=args.zero)

    return _Setup(args.recipe, args.pp, args.dp, args.ep, args.microbatches, args.zero,
                  stages_needed(args.recipe, args.pp, args.chunks), apply, args.recipe)


def _trace_setup(args: argparse.Namespace) -> _Setup:
    """A JSON trace of directives (Schedule.dumps()): it fixes grid, microbatches and ZeRO."""
    from piper_plugin.api.schedule import Schedule

    path: Path = args.recipe_file
    try:
        data = json.loads(path.read_text())
        grid, directives = data["grid"], data["directives"]
        steps = {name: [d for d in directives if d.get("directive") == name]
                 for name in ("split", "replicate", "place")}
        microbatches = steps["split"][-1]["microbatches"] if steps["split"] else _PLAN_DEFAULTS["microbatches"]
        zero = max([d["zero"] for d in steps["replicate"]], default=0)
        pp_tags = [int(d["regions"].split("=", 1)[1]) for d in steps["place"] if d["regions"].startswith("PP=")]
        setup = _Setup(path.name, grid["pp"], grid.get("dp", 1), grid.get("ep", 1), microbatches, zero,
                       1 + max(pp_tags, default=grid["pp"] - 1), lambda program: Schedule.from_json(program, data))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UsageError(f"recipe file {str(path)!r} is not a Schedule trace ({type(exc).__name__}: {exc})") from None
    for flag in _PLAN_DEFAULTS:
        given, traced = getattr(args, flag), getattr(setup, flag)
        if given is not None and given != traced:
            raise UsageError(f"--{flag} {given} conflicts with the trace {str(path)!r} ({flag}={traced}); "
                             f"drop --{flag} or re-record the trace")
    return setup


def _python_setup(args: argparse.Namespace) -> _Setup:
    """A Python file with ``recipe(sch, microbatches, **kw)`` and optionally ``stages(pp, chunks)``."""
    from piper_plugin.api.schedule import Schedule

    path: Path = args.recipe_file
    where = f"recipe file {str(path)!r}"

    def call(fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except _user_errors():
            raise
        except Exception as exc:  # user code: report it in one line, don't crash
            raise UsageError(f"{where}: {type(exc).__name__}: {exc}") from None

    namespace = call(runpy.run_path, str(path))
    recipe = namespace.get("recipe")
    if not callable(recipe):
        raise UsageError(f"{where} defines no function recipe(sch, microbatches, **kw)")
    stages = call(namespace["stages"], args.pp, args.chunks) if callable(namespace.get("stages")) else args.pp
    if not isinstance(stages, int) or stages < 1:
        raise UsageError(f"{where}: stages(pp, chunks) returned {stages!r}, expected a positive int")

    def apply(program):
        sch = Schedule(program, pp=args.pp, dp=args.dp, ep=args.ep)
        call(recipe, sch, microbatches=args.microbatches, chunks=args.chunks, zero=args.zero)
        return sch

    return _Setup(path.name, args.pp, args.dp, args.ep, args.microbatches, args.zero, stages, apply)


def _setup(args: argparse.Namespace) -> _Setup:
    if args.recipe_file is not None:
        if not args.recipe_file.is_file():
            raise UsageError(f"recipe file {str(args.recipe_file)!r} does not exist")
        if args.recipe_file.suffix == ".json":
            return _trace_setup(args)
    for flag, value in _PLAN_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    return _python_setup(args) if args.recipe_file is not None else _builtin_setup(args)


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from piper_plugin import capture
    from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
    from piper_plugin.scheduler import export
    from piper_plugin.scheduler.cost import CostModel
    from piper_plugin.scheduler.plan import build_plan
    from piper_plugin.scheduler.simulate import simulate

    setup = _setup(args)
    batch = args.batch or setup.microbatches * setup.dp * setup.ep * 2
    layers = max(setup.stages, 2)
    try:
        with torch.device("meta"):
            model, cfg = TOY_MODELS[args.model](stages=setup.stages, layers=layers)
    except ValueError as exc:
        raise UsageError(f"model {args.model}: {exc}") from None
    tokens, targets = lm_batch(cfg, batch)
    program = capture(model, lm_loss, (tokens,), targets)
    sch = setup.apply(program)
    plan = build_plan(sch.dag, sch.grid)
    cost = CostModel.uniform() if args.cost == "uniform" else CostModel.cpu_default()
    result = simulate(plan, cost)

    params = sum(p.numel() for p in model.parameters())
    g = plan.grid
    print(f"model   {args.model}: {layers} layers, {setup.stages} PP stages, {len(sch.dag.regions)} regions, "
          f"{params:,} params")
    print(f"grid    pp={g.pp} dp={g.dp} ep={g.ep} ({g.world_size} ranks), schedule {setup.name}, "
          f"{plan.microbatches} microbatches, batch {batch}, zero {setup.zero}")
    print(f"plan    {sum(len(rp.tasks()) for rp in plan.ranks)} tasks, hash {plan.hash()}\n")
    print(export.plan_grid_text(plan, result if args.cost == "uniform" else None))
    print()
    unit = "units (F=1, B=2, W=1)" if args.cost == "uniform" else "s (cpu estimate)"
    print(f"step time  {result.step_time:.6g} {unit}")
    textbook = _textbook(setup, plan, cost)
    print(f"bubble     {result.bubble_fraction:.1%}" + (f"   textbook {textbook}" if textbook else ""))
    print("\npeak memory per rank")
    print(_memory_table(result))

    time_label = "time (F = 1)" if args.cost == "uniform" else "time (s)"
    title = (f"{setup.name}: pp={g.pp} dp={g.dp} ep={g.ep}, m={plan.microbatches}, "
             f"bubble {result.bubble_fraction:.1%}, step {result.step_time:.4g}")
    if args.trace:
        us = 1e3 if args.cost == "uniform" else 1e6  # a uniform unit shows as 1 ms
        args.trace.write_text(json.dumps(export.chrome_trace(plan, result, us_per_unit=us)))
        print(f"\nwrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.png:
        export.timeline_png(plan, result, args.png, title=title, time_label=time_label)
        print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps(plan.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0


def _textbook(setup: _Setup, plan, cost) -> str:
    from piper_plugin.recipes.textbook import textbook_bubble

    return textbook_bubble(setup.recipe, plan, cost, setup.stages) if setup.recipe else ""


def _human(n: float) -> str:
    from piper_plugin.train_report import human_bytes

    return human_bytes(n)


def _memory_table(result) -> str:
    """Peak bytes per rank; consecutive replicas with equal numbers share a row ("0-1")."""
    head = ("rank", "params", "grads", "optimizer", "transient", "total")
    groups: list[tuple[list[int], tuple[str, ...]]] = []
    for r, (static, transient) in enumerate(zip(result.static_bytes, result.peak_transient_bytes)):
        total = sum(static.values()) + transient
        cells = (*(_human(static[k]) for k in ("params", "grads", "optimizer")), _human(transient), _human(total))
        if groups and groups[-1][1] == cells:
            groups[-1][0].append(r)
        else:
            groups.append(([r], cells))
    rows = [head] + [(str(rs[0]) if len(rs) == 1 else f"{rs[0]}-{rs[-1]}", *cells) for rs, cells in groups]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


if __name__ == "__main__":  # run the imported module's main: its UsageError is the one subcommands raise
    from piper_plugin.cli import main as _imported_main

    sys.exit(_imported_main())
