"""``piper`` console commands.

    piper plan --recipe 1f1b --pp 4 --microbatches 8 [--trace t.json --png t.png --json plan.json]
    piper train --recipe 1f1b --pp 2 --microbatches 4 --steps 30 [--metrics m.jsonl --trace DIR]
    piper tune --ranks 2 [--memory-cap 64MiB --out best.json]

``plan`` captures a toy model on the meta device, applies a recipe (or a recipe file), compiles
per-rank plans, simulates one step and prints the grid, the bubble next to its textbook value
and per-rank memory. ``train`` (:mod:`piper_plugin.cli_train`) runs the same schedule on real
ranks and trains the toy LM on the shipped text. ``tune`` (:mod:`piper_plugin.cli_tune`) searches
strategies by simulation and writes the best as a recipe file. Host adapters add their own subcommands
(``piper launch``: TorchTitan) through the ``piper_plugin.commands`` entry-point group; this
module imports no adapter.

Exit status: 0 done; 2 (``EXIT_USAGE``) a user error: a bad flag, a recipe that cannot apply
(e.g. too few microbatches), a bad or unwritable file; 1 (``EXIT_ERROR``) a run that failed
(a rank failed, ranks disagreed on the plan); 130 interrupted. Every error is one line
``piper: error: <reason>`` on stderr, never a traceback of ours (a failed rank's own traceback
follows its error line).
"""
from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Sequence

from piper_plugin.cli_args import ArgumentParser, Strategy, UsageError, add_strategy_args, resolve_strategy

__all__ = ["main", "build_parser", "COMMANDS_GROUP", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
COMMANDS_GROUP = "piper_plugin.commands"  # entry points: fn(subparsers) adds one subcommand


def build_parser() -> argparse.ArgumentParser:
    """``plan`` and ``train``, then each installed ``piper_plugin.commands`` entry point's subcommand."""
    from piper_plugin.cli_train import add_train_parser
    from piper_plugin.cli_tune import add_calibrate_parser, add_tune_parser

    parser = ArgumentParser(prog="piper", description="Piper: programmable distributed training.")
    commands = parser.add_subparsers(dest="command", metavar="<command>", parser_class=ArgumentParser)
    plan = commands.add_parser(
        "plan", help="compile and simulate a schedule, print its per-rank plan",
        description="Capture a toy model, apply a recipe, compile per-rank plans and simulate one step.")
    add_strategy_args(plan)
    plan.add_argument("--cost", choices=("uniform", "cpu"), default="uniform",
                      help="uniform: F=1 B=2 W=1, free comm; cpu: FLOP-based CPU/gloo estimate")
    plan.add_argument("--profile", type=Path, metavar="FILE.json",
                      help="replaces --cost: a cost profile `piper calibrate` measured; the plan is of the model "
                           "and sizes it was measured on (--batch may change the batch), its step in seconds: "
                           "what `piper train` of that plan should take here")
    plan.add_argument("--trace", type=Path, metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    plan.add_argument("--png", type=Path, metavar="FILE", help="write a timeline picture")
    plan.add_argument("--json", type=Path, metavar="FILE", help="write the compiled plan as JSON")
    plan.set_defaults(run=_run_plan)
    add_train_parser(commands)
    add_calibrate_parser(commands)
    add_tune_parser(commands)
    _add_plugin_commands(commands)
    return parser


def _add_plugin_commands(commands) -> None:
    """Each entry point of :data:`COMMANDS_GROUP` once (an editable install may list one twice);
    one that fails to load is named on stderr and skipped, so the other commands still work."""
    seen: set[str] = set()
    for point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name):
        if point.name in seen:
            continue
        seen.add(point.name)
        try:
            add_parser = point.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break `piper plan`
            print(f"piper: warning: command {point.name!r} ({point.value}) did not load: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        add_parser(commands)


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
    except _run_failures() as exc:
        return _fail(exc, EXIT_ERROR)
    except _user_errors() as exc:
        return _fail(exc, EXIT_USAGE)


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


def _run_failures() -> tuple[type[BaseException], ...]:
    """A run that started and failed (exit 1)."""
    from piper_plugin.runtime.executor import PlanMismatch
    from piper_plugin.runtime.launch.processes import WorkerFailed

    return (WorkerFailed, PlanMismatch)


def _user_errors() -> tuple[type[BaseException], ...]:
    """What the user's flags, recipe or files caused (exit 2)."""
    from piper_plugin.api.errors import DirectiveError
    from piper_plugin.ir.capture import CaptureError
    from piper_plugin.scheduler.plan import PlanError
    from piper_plugin.scheduler.simulate import DeadlockError

    return (DirectiveError, CaptureError, PlanError, DeadlockError, OSError, ValueError)


# -- piper plan -------------------------------------------------------------------------------
def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from piper_plugin.compiler import compile_program
    from piper_plugin.ir.capture import capture
    from piper_plugin.models import TOY_MODELS, lm_batch, lm_loss
    from piper_plugin.scheduler import export
    from piper_plugin.calibrate import cost_model
    from piper_plugin.cli_tune import profile_sizes
    from piper_plugin.data.text import vocab_size
    from piper_plugin.scheduler.cost import CostModel

    setup = resolve_strategy(args)
    sizes = profile_sizes(args.profile) if args.profile is not None else {}
    if args.profile is not None:  # the model `piper train` builds, at the profile's sizes
        if sizes.get("model", args.model) != args.model:
            raise UsageError(f"--model {args.model}: the profile {args.profile} was measured on {sizes['model']}; "
                             f"pass --model {sizes['model']}, or calibrate {args.model} (piper calibrate --model "
                             f"{args.model})")
        layers = sizes.get("layers", max(setup.stages, 2))
        if setup.stages > layers:
            raise UsageError(f"{setup.stages} stages but the profile's model has {layers} layers: calibrate with "
                             f"--layers {setup.stages} or more, or use fewer stages")
        extra = {"vocab": vocab_size(), "seq": sizes.get("seq", 32)}
        batch = args.batch or sizes.get("batch") or setup.microbatches * setup.dp * setup.ep * 2
    else:
        layers, extra = max(setup.stages, 2), {}
        batch = args.batch or setup.microbatches * setup.dp * setup.ep * 2
    try:
        with torch.device("meta"):
            model, cfg = TOY_MODELS[args.model](stages=setup.stages, layers=layers, **extra)
    except ValueError as exc:
        raise UsageError(f"model {args.model}: {exc}") from None
    tokens, targets = lm_batch(cfg, batch)
    if args.profile is not None:
        cost = cost_model(args.profile)
    else:
        cost = CostModel.uniform() if args.cost == "uniform" else CostModel.cpu_default()
    uniform = args.cost == "uniform" and args.profile is None
    _, sch, plan, result = compile_program(capture(model, lm_loss, (tokens,), targets), setup.apply, cost=cost)

    params = sum(p.numel() for p in model.parameters())
    g = plan.grid
    print(f"model   {args.model}: {layers} layers, {setup.stages} PP stages, {len(sch.dag.regions)} regions, "
          f"{params:,} params")
    print(f"grid    pp={g.pp} dp={g.dp} ep={g.ep} ({g.world_size} ranks), schedule {setup.name}, "
          f"{plan.microbatches} microbatches, batch {batch}, zero {setup.zero}")
    print(f"plan    {sum(len(rp.tasks()) for rp in plan.ranks)} tasks, hash {plan.hash()}\n")
    print(export.plan_grid_text(plan, result if uniform else None))
    print()
    unit = ("units (F=1, B=2, W=1)" if uniform else f"s (profile {args.profile})" if args.profile is not None
            else "s (cpu estimate)")
    print(f"step time  {result.step_time:.6g} {unit}")
    textbook = _textbook(setup, plan, cost)
    print(f"bubble     {result.bubble_fraction:.1%}" + (f"   textbook {textbook}" if textbook else ""))
    print("\npeak memory per rank")
    print(_memory_table(result))

    time_label, time_scale = ("time (F = 1)", 1.0) if uniform else ("time (ms)", 1e3)
    title = (f"{setup.name}: pp={g.pp} dp={g.dp} ep={g.ep}, m={plan.microbatches}, "
             f"bubble {result.bubble_fraction:.1%}, step {result.step_time * time_scale:.4g}"
             + ("" if uniform else " ms"))
    if args.trace:
        us = 1e3 if uniform else 1e6  # a uniform unit shows as 1 ms
        args.trace.write_text(json.dumps(export.chrome_trace(plan, result, us_per_unit=us)))
        print(f"\nwrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.png:
        export.timeline_png(plan, result, args.png, title=title, time_label=time_label, time_scale=time_scale)
        print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps(plan.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0


def _textbook(setup: Strategy, plan, cost) -> str:
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


if __name__ == "__main__":
    sys.exit(main())
