"""TorchTitan adapter: ``--parallelism.pipeline_engine piper`` and the CPU path.

    torchrun --nproc_per_node=2 -m torchtitan.train --module piper_plugin.adapters.torchtitan \\
        --config llama3_debugmodel --parallelism.pipeline_parallel_degree 2 \\
        --parallelism.pipeline_engine=piper

TorchTitan's ConfigManager imports ``piper_plugin.adapters.torchtitan.config_registry``.
``__all__`` is the adapter's face for benchmarks and scripts: running TorchTitan with either
engine (:func:`run_titan`, :func:`titan_command`, :class:`TitanRun`), the drop-in pipeline
configs (``SCHEDULES``: config suffix -> TorchTitan schedule) and the CPU path's facts
(:func:`on_cpu`), and the per-parameter comparison of two runs' ``--piper.dump_state`` folders
(:func:`state_differences`). Names load on first use, so importing the package does not import TorchTitan.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SCHEDULES", "TitanRun", "run_titan", "titan_command", "on_cpu", "state_differences"]

_HOME = {"SCHEDULES": "config_registry", "TitanRun": "launch", "run_titan": "launch", "titan_command": "launch",
         "on_cpu": "cpu", "state_differences": "dump_state"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
