"""Piper's package layout (metadata and dependencies: pyproject.toml).

``adapters/`` and ``recipes/`` are top-level folders that install as
``piper_plugin.adapters`` and ``piper_plugin.recipes``.
"""
from setuptools import find_packages, setup

engine = find_packages(include=["piper_plugin", "piper_plugin.*"])
adapters = ["piper_plugin.adapters" + p[len("adapters"):] for p in find_packages(include=["adapters", "adapters.*"])]
recipes = ["piper_plugin.recipes" + p[len("recipes"):] for p in find_packages(include=["recipes", "recipes.*"])]

setup(
    packages=engine + adapters + recipes,
    package_data={"piper_plugin.data": ["assets/*.json", "assets/*.jsonl"]},
    package_dir={"piper_plugin.adapters": "adapters", "piper_plugin.recipes": "recipes"},
)
