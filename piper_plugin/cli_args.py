"""What every ``piper`` subcommand parses with: the usage error, a parser that raises it,
value parsers, the strategy flags ``plan`` and ``train`` share and what they resolve to.

Invariants: nothing here prints or exits (``piper_plugin.cli.main`` turns :class:`UsageError`
into one ``piper: error:`` line and exit status 2); importing this module imports no torch.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["UsageError", "ArgumentParser", "int_at_least", "positive_int", "positive_float",
           "add_strategy_args", "Strategy", "resolve_strategy"]


class UsageError(Exception):
    """A bad command line or input file; printed as one ``piper: error:`` line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str) -> None:
        raise UsageError(message)


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``; ``what`` describes it in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")


def check_seq(seq: int) -> None:
    """A sequence length the shipped corpus can fill (what the toy models train on)."""
    from piper_plugin.data.text import token_stream

    tokens = len(token_stream())
    if seq >= tokens:
        raise UsageError(f"--seq {seq} is longer than the shipped corpus ({tokens} tokens)")


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """The flags that say what schedule runs (shared by ``plan`` and ``train``)."""
    from piper_plugin.models import TOY_MODELS
    from piper_plugin.recipes import RECIPES

    parser.add_argument("--model", choices=sorted(TOY_MODELS), default="toy-lm", help="toy model (default: toy-lm)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="1f1b", help="schedule recipe (default: 1f1b)")
    parser.add_argument("--recipe-file", type=Path, metavar="FILE",
                        help="replaces --recipe: a .py file defining recipe(sch, *, microbatches, chunks, zero) "
                             "(and optionally stages(pp, chunks) -> int, default pp), or a JSON trace "
                             "written by Schedule.dumps() (it fixes --pp/--dp/--ep/--microbatches/--zero)")
    parser.add_argument("--pp", type=positive_int, metavar="P", help="pipeline ranks (default: 2)")
    parser.add_argument("--dp", type=positive_int, metavar="D", help="data-parallel degree (default: 1)")
    parser.add_argument("--ep", type=positive_int, metavar="E", help="expert-parallel degree (default: 1)")
    parser.add_argument("--microbatches", "-m", type=positive_int, metavar="M", help="microbatches (default: 4)")
    parser.add_argument("--chunks", "-v", type=positive_int, default=2, metavar="V",
                        help="stages per rank for interleaved-1f1b (default: 2)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO level (default: 0)")
    parser.add_argument("--batch", type=positive_int, metavar="N",
                        help="global batch (default: microbatches x dp x ep x 2)")


@dataclass
class Strategy:
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


def resolve_strategy(args: argparse.Namespace) -> Strategy:
    """The schedule ``--recipe`` / ``--recipe-file`` names, through ``recipes.load`` (one loader
    for the CLI, the adapters and users); a trace fixes the flags it recorded."""
    from piper_plugin.recipes import RecipeError, load

    try:
        recipe = load(str(args.recipe_file) if args.recipe_file is not None else args.recipe)
        s = recipe.settings(pp=args.pp, dp=args.dp, ep=args.ep, microbatches=args.microbatches, zero=args.zero)
        stages = recipe.stages(s["pp"], args.chunks)
    except RecipeError as exc:
        raise UsageError(str(exc)) from None
    chunks = args.chunks

    def apply(program):
        try:
            return recipe.schedule(program, chunks=chunks, **s)
        except RecipeError as exc:
            raise UsageError(str(exc)) from None

    return Strategy(recipe.name, s["pp"], s["dp"], s["ep"], s["microbatches"], s["zero"], stages, apply,
                  recipe.name if recipe.builtin else None)
