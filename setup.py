"""Piper: programmable distributed training for TorchTitan and Megatron-Core.

``adapters/`` and ``recipes/`` are top-level folders that install as
``piper_plugin.adapters`` and ``piper_plugin.recipes``.
"""
from setuptools import find_packages, setup

engine = find_packages(include=["piper_plugin", "piper_plugin.*"])
adapters = ["piper_plugin.adapters" + p[len("adapters"):] for p in find_packages(include=["adapters", "adapters.*"])]
recipes = ["piper_plugin.recipes" + p[len("recipes"):] for p in find_packages(include=["recipes", "recipes.*"])]

setup(
    name="piper-plugin",
    version="0.1.0",
    description="Programmable distributed-training engine: annotations, directives, one training DAG",
    python_requires=">=3.10",
    packages=engine + adapters + recipes,
    package_data={"piper_plugin.data": ["assets/*.json", "assets/*.jsonl"]},
    package_dir={"piper_plugin.adapters": "adapters", "piper_plugin.recipes": "recipes"},
    install_requires=[
        "torch==2.14.1",
        "torchtitan==0.3.0",
        "megatron-core==0.16.1",
        "ray[default]>=2.60,<3",
        "tyro>=1.0",
        "cloudpickle>=2",
        "matplotlib>=3.8",
    ],
    # float8: torchao for the float8 rows (TorchTitan then imports it in every rank: slower tests)
    extras_require={"test": ["pytest>=8", "hypothesis>=6"], "float8": ["torchao==0.18.0"]},
    entry_points={
        "console_scripts": ["piper=piper_plugin.cli:main"],
        # host adapters' `piper` subcommands: fn(subparsers) adds one (the engine imports no adapter)
        "piper_plugin.commands": ["launch = piper_plugin.adapters.torchtitan.ray_launch:add_launch_parser"],
        # trainers `piper launch --host NAME` runs: a module with host_argv(args, nproc) and rank_class
        "piper_plugin.hosts": ["megatron = piper_plugin.adapters.megatron.launch"],
        # `piper calibrate --host NAME`: a module with program, calibration_jobs(argv, nproc) and job_argv
        "piper_plugin.calibration": ["torchtitan = piper_plugin.adapters.torchtitan.calibration",
                                     "megatron = piper_plugin.adapters.megatron.calibration"],
    },
)
