"""Recipes: schedules written only with directives (installed as ``piper_plugin.recipes``)."""
from piper_plugin.recipes.pipeline import (
    RECIPES, apply_recipe, dualpipev, gpipe, interleaved_1f1b, one_f_one_b, stages_needed, zb_h1,
)

__all__ = ["RECIPES", "apply_recipe", "stages_needed", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "dualpipev"]
