"""The CPU path for TorchTitan: device "cpu" + gloo, SDPA attention, fp32, offline assets.

Each fix is the smallest one shown necessary on torch 2.14.1 + torchtitan 0.3.0 (see
HOST_FRAMEWORKS.md); none edits a TorchTitan file:

* ``use_cpu_device`` re-points the ``device_type`` / ``device_module`` copies TorchTitan's
  modules bound at import to "cpu" and a torch.cpu-based module (``set_device`` runs first
  thing in ``Trainer.__init__``, so this must happen before it);
* ``use_sdpa_attention`` swaps every FlexAttention config in the model config tree for SDPA
  (FlexAttention has no CPU backward; SDPA masks causally, not per document);
* ``offline_assets`` points the tokenizer and the data loader at the BPE tokenizer and corpus
  shipped in ``piper_plugin/data/assets`` (registered as the dataset ``piper_corpus``).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["ASSETS", "DATASET", "use_cpu_device", "use_sdpa_attention", "offline_assets",
           "register_dataset", "apply_cpu_fixes", "on_cpu"]

import piper_plugin as _piper

ASSETS = Path(_piper.__file__).resolve().parent / "data" / "assets"
DATASET = "piper_corpus"

# Modules that bound ``device_type`` / ``device_module`` by name at import.
_DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims",
                   "torchtitan.components.metrics", "torchtitan.models.common.token_dispatcher",
                   "torchtitan.tools.profiler")


def on_cpu() -> bool:
    """True when there is no accelerator (or PIPER_TITAN_DEVICE=cpu forces the CPU path)."""
    forced = os.environ.get("PIPER_TITAN_DEVICE", "")
    if forced:
        return forced == "cpu"
    return not torch.cuda.is_available()


class _Props:
    """What the memory monitor reads: host RAM as the device capacity."""

    name = "cpu"

    @property
    def total_memory(self) -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 1 << 34


def _memory_stats() -> dict[str, int]:
    """The process's peak resident set size stands in for device memory peaks."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
            "num_ooms": 0}


def _cpu_device_module() -> types.ModuleType:
    """torch.cpu plus the few calls TorchTitan's memory monitor and trainer make."""
    mod = types.ModuleType("piper_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: 0
    mod.device_count = lambda: 1
    mod.set_device = lambda device: None
    mod.synchronize = lambda *a, **k: None
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_device_properties = lambda *a, **k: _Props()
    mod.memory_stats = lambda *a, **k: _memory_stats()
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.empty_cache = lambda *a, **k: None
    mod.is_available = lambda: True
    return mod


def use_cpu_device() -> None:
    """Make TorchTitan pick device "cpu" (backend gloo) wherever it bound the device at import."""
    module = _cpu_device_module()
    for name in _DEVICE_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional component that fails to import on CPU
            continue
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    metrics = sys.modules.get("torchtitan.components.metrics")
    if metrics is not None and hasattr(metrics, "DeviceMemoryMonitor"):
        # its __init__ default argument captured "cuda:0" at import
        init = metrics.DeviceMemoryMonitor.__init__
        if init.__defaults__ and str(init.__defaults__[0]).startswith("cuda"):
            init.__defaults__ = ("cpu:0",)


def _replace_flex(node: Any, seen: set[int]) -> Any:
    """A copy-free walk of a config tree replacing FlexAttention configs with SDPA ones."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    if isinstance(node, FlexAttention.Config):
        return ScaledDotProductAttention.Config()
    if id(node) in seen:
        return node
    seen.add(id(node))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name, None)
            new = _replace_flex(value, seen)
            if new is not value:
                object.__setattr__(node, f.name, new)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            new = _replace_flex(value, seen)
            if new is not value:
                node[i] = new
    elif isinstance(node, dict):
        for k, value in list(node.items()):
            new = _replace_flex(value, seen)
            if new is not value:
                node[k] = new
    return node


def use_sdpa_attention(model_config: Any) -> Any:
    """Swap FlexAttention for SDPA everywhere in ``model_config`` (in place; returned)."""
    return _replace_flex(model_config, set())


def register_dataset(name: str = DATASET, path: Path | str | None = None) -> None:
    """Register a local JSONL text corpus (one {"text": ...} per line) as a TorchTitan dataset."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    text_datasets.DATASETS[name] = DatasetConfig(
        path=str(path or ASSETS / "corpus.jsonl"),
        loader=lambda p: load_dataset("json", data_files=str(p), split="train"),
        sample_processor=lambda sample: sample["text"],
    )


def offline_assets(config: Any) -> Any:
    """Point the tokenizer and the text data loader at Piper's shipped assets (offline)."""
    register_dataset()
    config.hf_assets_path = str(ASSETS)
    loader = config.dataloader
    if hasattr(loader, "dataset"):
        loader.dataset = DATASET
        if hasattr(loader, "dataset_path"):
            loader.dataset_path = str(ASSETS / "corpus.jsonl")
    validator = getattr(config, "validator", None)
    vloader = getattr(validator, "dataloader", None)
    if vloader is not None and hasattr(vloader, "dataset"):
        vloader.dataset = DATASET
        if hasattr(vloader, "dataset_path"):
            vloader.dataset_path = str(ASSETS / "corpus.jsonl")
    return config


def apply_cpu_fixes(config: Any) -> Any:
    """The config side of the CPU path: SDPA, fp32 params, no CUDA graphs, offline assets."""
    if config.model_spec is not None:
        use_sdpa_attention(config.model_spec.model)
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    offline_assets(config)
    return config
