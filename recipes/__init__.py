"""Recipes: schedules written only with directives (installed as ``piper_plugin.recipes``).

``load(name | file.py | trace.json)`` is the one way to get a recipe; the built-in ones are
also plain functions on a :class:`Schedule` (``one_f_one_b(sch, microbatches=4)``).
"""
from piper_plugin.recipes.load import Recipe, RecipeError, load
from piper_plugin.recipes.orders import stages_of_rank
from piper_plugin.recipes.pipeline_csv import order_from_pipeline_csv
from piper_plugin.recipes.pipeline import (
    RECIPES, apply_recipe, dualpipev, gpipe, interleaved_1f1b, one_f_one_b, stages_needed, zb_h1,
)

__all__ = ["load", "Recipe", "RecipeError", "RECIPES", "apply_recipe", "stages_needed", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zb_h1", "dualpipev", "stages_of_rank",
           "order_from_pipeline_csv"]
