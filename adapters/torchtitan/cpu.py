"""The CPU path for TorchTitan: device "cpu" + gloo, SDPA attention, fp32, offline assets.

Each fix is the smallest one shown necessary on torch 2.14.1 + torchtitan 0.3.0 (see
HOST_FRAMEWORKS.md); none edits a TorchTitan file:

* ``use_cpu_device`` re-points the ``device_type`` / ``device_module`` copies TorchTitan's
  modules bound at import to "cpu" and a torch.cpu-based module (``set_device`` runs first
  thing in ``Trainer.__init__``, so this must happen before it); its memory stats are the rank
  process's peak RSS, reset after each logged step (so ``memory:`` is that step's peak RSS);
* ``use_sdpa_attention`` swaps every FlexAttention / VarlenAttention config in the model config
  tree for ``CpuAttention``, TorchTitan's SDPA plus sliding windows and the ``out_transform``
  (attention sink) epilogue (Flex has no CPU backward, Varlen is CUDA only; causal over the
  whole sequence, not per document);
* ``uneven_all_to_all_on_gloo`` lets expert-parallel token dispatch send each peer its own
  number of tokens (gloo's list ``all_to_all`` wants equal chunks);
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

__all__ = ["ASSETS", "DATASET", "use_cpu_device", "sum_reductions_on_gloo", "return_freed_buffers",
           "use_sdpa_attention", "offline_assets", "register_dataset", "apply_cpu_fixes", "refuse_cuda_only_flags", "on_cpu",
           "peak_rss_bytes", "status_bytes", "reset_peak_rss", "cpu_attention", "uneven_all_to_all_on_gloo"]

import piper_plugin as _piper
from piper_plugin.adapters.torchtitan.flags import FlagError

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


def status_bytes(field: str) -> int | None:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in
    bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``VmHWM``): since the last
    :func:`reset_peak_rss`, or since the process started where the reset is unavailable."""
    peak = status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; never reset


def reset_peak_rss() -> bool:
    """Restart the peak RSS from the current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``).
    Returns False where that is not possible (the peak then keeps counting from process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


last_peak_rss = 0  # the peak RSS TorchTitan's memory monitor read last (its ``memory:`` figure)


def _memory_stats() -> dict[str, int]:
    """TorchTitan's memory monitor reads peaks here and resets them after every logged step, so
    on CPU its ``memory:`` figure is the rank process's peak RSS over that step (all of the
    process's memory, not only tensors: Python, libraries, allocator slack included)."""
    global last_peak_rss
    peak = last_peak_rss = peak_rss_bytes()
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
    mod.reset_peak_memory_stats = lambda *a, **k: reset_peak_rss()
    mod.empty_cache = lambda *a, **k: None
    mod.is_available = lambda: True
    return mod


def return_freed_buffers() -> bool:
    """glibc keeps large freed buffers in per-thread arenas once its dynamic mmap threshold has
    grown, so a rank whose stream threads free and regather parameter-sized buffers every
    microbatch (ZeRO-3) grows its RSS step after step (measured: 5.2 -> 6.5 GiB over 4 steps of
    qwen3_moe_debug, then killed for memory; flat at 3.6 GiB with this). A fixed 64 KiB threshold
    returns every large buffer to the system when it is freed. True when it took effect."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return False


def use_cpu_device() -> None:
    """Make TorchTitan pick device "cpu" (backend gloo) wherever it bound the device at import,
    and have freed large buffers go back to the system (:func:`return_freed_buffers`)."""
    return_freed_buffers()
    uneven_all_to_all_on_gloo()
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


def _cpu_attention_class():
    """``CpuAttention``: TorchTitan's SDPA inner attention plus what Flex/Varlen give a model
    that SDPA drops: a causal sliding window and the ``out_transform(out, lse)`` epilogue
    (GPT-OSS's attention sinks). Maskless: causal over the whole sequence, not per document."""
    import math

    import torch.nn.functional as F
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class CpuAttention(ScaledDotProductAttention):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            window: int = -1
            """Keys a query may look back at besides itself (-1: unlimited), as Varlen's ``window_size[0]``."""

        def __init__(self, config: "CpuAttention.Config") -> None:
            super().__init__(config)
            self.window = config.window

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                    is_causal=True, out_transform=None, **kwargs):  # argument names: TorchTitan's sharding keys
            q, k, v = q_BLNH, k_BLNH, v_BLNH
            seq = q.shape[1]
            windowed = 0 <= self.window < seq - 1
            if out_transform is None and not windowed:
                return super().forward(q, k, v, attention_masks=attention_masks, scale=scale,
                                       enable_gqa=enable_gqa, is_causal=is_causal)
            if attention_masks is not None or not is_causal:
                raise ValueError("CpuAttention is causal and maskless (the CPU path builds no attention masks)")
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, L, H)
            if k.shape[1] != q.shape[1]:  # grouped-query attention
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
            pos = torch.arange(seq, device=q.device)
            allowed = pos[None, :] <= pos[:, None]
            if windowed:
                allowed &= pos[None, :] >= pos[:, None] - self.window
            scores = scores.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(scores.float(), dim=-1)  # (B, N, L)
            out = (F.softmax(scores.float(), dim=-1).to(v.dtype) @ v).transpose(1, 2)  # (B, L, N, H)
            return out if out_transform is None else out_transform(out, lse.transpose(1, 2))

    return CpuAttention


_CPU_ATTENTION: list[type] = []


def cpu_attention() -> type:
    """The ``CpuAttention`` class (built once: its Config must stay one class for isinstance)."""
    if not _CPU_ATTENTION:
        _CPU_ATTENTION.append(_cpu_attention_class())
    return _CPU_ATTENTION[0]


def _window_of(node: Any) -> int | None:
    size = getattr(node, "sliding_window_size", None) if not isinstance(node, type) else None
    return size if isinstance(size, int) else None


def _replace_attention(node: Any, seen: set[int], window: int | None, cls: type) -> Any:
    """A copy-free walk of a config tree replacing Flex / Varlen inner-attention configs with
    ``cls.Config``; a window comes from Varlen's ``window_size`` or the enclosing attention
    config's ``sliding_window_size`` (how GPT-OSS / muse_glimmer declare it for Flex)."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    if isinstance(node, VarlenAttention.Config):
        return cls.Config(window=node.window_size[0])
    if isinstance(node, FlexAttention.Config):
        return cls.Config(window=window - 1 if window else -1)
    if id(node) in seen:
        return node
    seen.add(id(node))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        inner = _window_of(node) or window
        for f in dataclasses.fields(node):
            value = getattr(node, f.name, None)
            new = _replace_attention(value, seen, inner, cls)
            if new is not value:
                object.__setattr__(node, f.name, new)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            new = _replace_attention(value, seen, window, cls)
            if new is not value:
                node[i] = new
    elif isinstance(node, dict):
        for k, value in list(node.items()):
            new = _replace_attention(value, seen, window, cls)
            if new is not value:
                node[k] = new
    return node


def use_sdpa_attention(model_config: Any) -> Any:
    """Swap FlexAttention / VarlenAttention (no CPU backward / CUDA only) for ``CpuAttention``,
    an SDPA subclass, everywhere in ``model_config`` (in place; returned)."""
    return _replace_attention(model_config, set(), None, cpu_attention())


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


def sum_reductions_on_gloo(model_parts: list[Any]) -> None:
    """FSDP reduces with ``PREMUL_SUM``, which gloo lacks: reduce with a plain sum (TorchTitan
    divides nothing there: its loss is already over the global token count)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


class _GlooDist(types.ModuleType):
    """``torch.distributed`` whose list ``all_to_all`` also takes chunks of different sizes on
    gloo (gloo's own refuses them: ``invalid tensor size``), as one ``all_to_all_single`` over the
    flattened chunks with per-peer split sizes, which gloo runs. Everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        dist = torch.distributed
        shapes = {t.shape for t in [*output_tensor_list, *input_tensor_list]}
        if len(shapes) <= 1 or async_op or dist.get_backend(group) != "gloo":
            return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        sizes = [t.numel() for t in output_tensor_list]
        send = torch.cat([t.reshape(-1) for t in input_tensor_list])
        recv = send.new_empty(sum(sizes))
        dist.all_to_all_single(recv, send, output_split_sizes=sizes,
                               input_split_sizes=[t.numel() for t in input_tensor_list], group=group)
        for out, got in zip(output_tensor_list, recv.split(sizes)):
            out.copy_(got.view(out.shape))
        return None


def uneven_all_to_all_on_gloo() -> None:
    """TorchTitan's expert-parallel token dispatch (spmd_types' uneven all-to-all) calls the list
    ``all_to_all`` with as many tokens per peer as routing sent there; route it through
    :class:`_GlooDist` by spmd_types' own hook for another ``dist`` (``set_dist``)."""
    try:
        from spmd_types import _dist
    except ImportError:  # an spmd_types without the hook: nothing calls it then
        return
    if not isinstance(_dist.dist, _GlooDist):
        _dist.set_dist(_GlooDist("torch.distributed"))


def refuse_cuda_only_flags(config: Any) -> None:
    """Flags whose feature exists only on CUDA end a CPU run before its trainer starts, naming
    the flag (a :class:`FlagError`), instead of failing deep inside each rank."""
    if config.profiler.enable_memory_snapshot:
        raise FlagError("--profiler.enable_memory_snapshot records the CUDA caching allocator's history "
                        "(torch.cuda.memory._record_memory_history) and this run is on CPU: drop the flag "
                        "(--profiler.enable_profiling still traces CPU time), or run on a GPU")
    if not config.training.disable_cuda_graphs:  # the CPU configs turn them off: only a flag turns them on
        raise FlagError("--training.no-disable-cuda-graphs asks for CUDA graph capture of the forward+backward "
                        "step and this run is on CPU, where there is no CUDA graph: drop the flag, or run on a GPU")


def apply_cpu_fixes(config: Any) -> Any:
    """The config side of the CPU path: SDPA, fp32 params, no CUDA graphs, offline assets."""
    if config.model_spec is not None:
        use_sdpa_attention(config.model_spec.model)
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    offline_assets(config)
    return config
