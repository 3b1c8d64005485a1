"""One loader, one contract, for every way of writing a recipe.

``load(spec)`` takes a built-in recipe name (``1f1b``), a Python file defining
``recipe(sch, *, microbatches, chunks, zero)`` (and optionally ``stages(pp, chunks) -> int``,
default ``pp``), or a JSON trace written by ``Schedule.dumps()``. Each comes back as a
:class:`Recipe`: ``recipe.schedule(program, pp=..., microbatches=...)`` returns the Schedule with
its directives applied. A trace fixes its grid, microbatches and ZeRO level (``Recipe.fixed``);
asking it for other values is an error naming the trace and the value, never a silent override.
"""
from __future__ import annotations

import inspect
import json
import re
import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes.pipeline import RECIPES, apply_recipe, stages_needed

__all__ = ["Recipe", "RecipeError", "load"]

_PP_TAG = re.compile(r"(?:^|,)PP=(\d+)(?:,|$)")  # a place directive naming one stage exactly

# What a JSON trace fixes, and the defaults a caller gets for what it does not pass.
DEFAULTS = {"pp": 2, "dp": 1, "ep": 1, "microbatches": 4, "zero": 0}


class RecipeError(ValueError):
    """A recipe that cannot be loaded or applied; the message names the recipe and the fix."""


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe. ``fixed`` holds what a trace decides (empty for names and files)."""

    name: str
    builtin: bool
    fixed: dict[str, int] = field(default_factory=dict)
    _apply: Callable[..., Schedule] = field(repr=False, default=None)  # type: ignore[assignment]
    _stages: Callable[[int, int], int] = field(repr=False, default=None)  # type: ignore[assignment]

    def stages(self, pp: int, chunks: int = 2) -> int:
        """How many PP stages the model must be annotated with."""
        return self._stages(pp, chunks)

    def settings(self, **given: int | None) -> dict[str, int]:
        """``given`` (pp, dp, ep, microbatches, zero; None = unset) completed by the trace or the
        defaults; a value that contradicts the trace raises RecipeError."""
        out = dict(DEFAULTS)
        for key, value in given.items():
            if value is not None:
                out[key] = value
        for key, traced in self.fixed.items():
            value = given.get(key)
            if value is not None and value != traced:
                raise RecipeError(f"{key} {value} conflicts with the trace {self.name!r} ({key}={traced}); "
                                  f"drop {key} or re-record the trace")
            out[key] = traced
        return out

    def schedule(self, program: Any, *, pp: int | None = None, dp: int | None = None, ep: int | None = None,
                 microbatches: int | None = None, chunks: int = 2, zero: int | None = None,
                 bucket_bytes: int | None = None) -> Schedule:
        """A Schedule over ``program`` with this recipe's directives applied (``bucket_bytes``:
        the size of ZeRO / gradient-reduction buckets, for recipes that take it)."""
        s = self.settings(pp=pp, dp=dp, ep=ep, microbatches=microbatches, zero=zero)
        return self._apply(program, s["pp"], s["dp"], s["ep"], s["microbatches"], chunks, s["zero"], bucket_bytes)


def load(spec: str | Path) -> Recipe:
    """A built-in recipe name, a ``.py`` recipe file or a ``.json`` Schedule trace."""
    text = str(spec)
    if text in RECIPES:
        return _builtin(text)
    path = Path(text)
    if not path.is_file():
        if path.suffix in (".py", ".json") or len(path.parts) > 1:
            raise RecipeError(f"recipe file {text!r} does not exist")
        raise RecipeError(f"recipe {text!r} is neither a built-in recipe ({', '.join(RECIPES)}) nor an existing file")
    if path.suffix == ".json":
        return _trace(path)
    return _python(path)


def _builtin(name: str) -> Recipe:
    def apply(program, pp, dp, ep, microbatches, chunks, zero, bucket_bytes=None):
        sch = Schedule(program, pp=pp, dp=dp, ep=ep)
        return apply_recipe(sch, name, microbatches=microbatches, chunks=chunks, zero=zero, bucket_bytes=bucket_bytes)

    return Recipe(name, True, {}, apply, lambda pp, chunks: stages_needed(name, pp, chunks))


def _trace(path: Path) -> Recipe:
    try:
        data = json.loads(path.read_text())
        grid, directives = data["grid"], data["directives"]
        steps = {name: [d for d in directives if d.get("directive") == name] for name in ("split", "replicate", "place")}
        fixed = {"pp": int(grid["pp"]), "dp": int(grid.get("dp", 1)), "ep": int(grid.get("ep", 1)),
                 "zero": max([int(d["zero"]) for d in steps["replicate"]], default=0)}
        if steps["split"]:  # a trace that never split leaves the count to the caller
            fixed["microbatches"] = int(steps["split"][-1]["microbatches"])
        pp_tags = [int(m.group(1)) for d in steps["place"] for m in [_PP_TAG.search(str(d.get("regions", "")))] if m]
        stages = 1 + max(pp_tags, default=fixed["pp"] - 1)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise RecipeError(f"recipe file {str(path)!r} is not a Schedule trace ({type(exc).__name__}: {exc}); "
                          f"write one with Schedule.dumps()") from None

    def apply(program, pp, dp, ep, microbatches, chunks, zero, bucket_bytes=None):
        if bucket_bytes is not None:
            raise RecipeError(f"recipe file {str(path)!r} is a trace: its buckets are recorded in it; "
                              f"do not pass bucket_bytes ({bucket_bytes}) with it")
        return Schedule.from_json(program, data)

    return Recipe(path.name, False, fixed, apply, lambda pp, chunks: stages)


def _check_signature(where: str, recipe: Callable[..., Any]) -> None:
    """``recipe`` takes the schedule and the keywords every recipe is called with."""
    try:
        inspect.signature(recipe).bind(None, microbatches=1, chunks=1, zero=0)
    except TypeError as exc:
        raise RecipeError(f"{where}: recipe{inspect.signature(recipe)} cannot be called as recipe(sch, "
                          f"microbatches=..., chunks=..., zero=...) ({exc}); define recipe(sch, *, microbatches, "
                          f"chunks=1, zero=0, **kw)") from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass


def _python(path: Path) -> Recipe:
    where = f"recipe file {str(path)!r}"

    def call(fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except (DirectiveError, RecipeError):
            raise
        except Exception as exc:  # the user's code: one line naming the file, not our traceback
            raise RecipeError(f"{where}: {type(exc).__name__}: {exc}") from None

    namespace = call(runpy.run_path, str(path))
    recipe = namespace.get("recipe")
    if not callable(recipe):
        raise RecipeError(f"{where} defines no function recipe(sch, *, microbatches, chunks, zero)")
    _check_signature(where, recipe)
    stages_fn = namespace.get("stages")

    def stages(pp: int, chunks: int) -> int:
        n = call(stages_fn, pp, chunks) if callable(stages_fn) else pp
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RecipeError(f"{where}: stages(pp, chunks) returned {n!r}, expected a positive int")
        return n

    def apply(program, pp, dp, ep, microbatches, chunks, zero, bucket_bytes=None):
        sch = Schedule(program, pp=pp, dp=dp, ep=ep)
        extra = {}
        if bucket_bytes is not None:
            if "bucket_bytes" not in inspect.signature(recipe).parameters:
                raise RecipeError(f"{where}: recipe() takes no bucket_bytes, but bucket_bytes={bucket_bytes} was asked "
                                  f"for; add a bucket_bytes=None keyword and pass it to sch.replicate")
            extra["bucket_bytes"] = bucket_bytes
        call(recipe, sch, microbatches=microbatches, chunks=chunks, zero=zero, **extra)
        return sch

    return Recipe(path.name, False, {}, apply, stages)
