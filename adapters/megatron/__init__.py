"""Piper under Megatron-Core: a drop-in ``get_forward_backward_func``.

In a Megatron training script::

    from piper_plugin.adapters.megatron import get_forward_backward_func
    forward_backward = get_forward_backward_func()      # Megatron's signature and contract

or, for code that looks the function up in Megatron itself, call :func:`install` before it
does: ``megatron.core.pipeline_parallel(.schedules).get_forward_backward_func`` (and every
module that imported that name) then return Piper's. Without a GPU, :func:`install` and
:func:`get_forward_backward_func` also apply the CPU path (:mod:`.cpu`).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from piper_plugin.adapters.megatron.arguments import parse_args
from piper_plugin.adapters.megatron.cpu import apply_cpu_fixes, on_cpu
from piper_plugin.adapters.megatron.data import (
    PretrainingBatches, ShippedTokenizer, chunk_iterators, shipped_corpus, train_dataset,
)
from piper_plugin.adapters.megatron.pretrain_gpt import build_model, forward_step, pretrain
from piper_plugin.adapters.megatron.schedule import (
    DEFAULT_TIMEOUT_S, ArgumentError, PiperForwardBackward, stage_placement,
)
from piper_plugin.adapters.megatron.zero import ZeroChunk

# the adapter's face: the drop-in, and the entry's parts (for benchmarks and users' own loops)
__all__ = ["get_forward_backward_func", "install", "uninstall", "ArgumentError", "PiperForwardBackward",
           "ZeroChunk", "apply_cpu_fixes", "on_cpu", "stage_placement", "parse_args", "build_model", "forward_step", "pretrain",
           "ShippedTokenizer", "shipped_corpus", "train_dataset", "PretrainingBatches", "chunk_iterators"]

_installed: dict[str, Any] = {}


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None, *,
                              recipe: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                              zero: int | None = None, trace: str | None = None,
                              profile: str | None = None, trace_memory: bool = False) -> PiperForwardBackward:
    """Megatron's ``get_forward_backward_func``, answered by Piper for every pipeline size.

    ``pp_size`` / ``vp_size`` are accepted for Megatron's signature; the plan's stages come from
    the model chunks the function is called with (``len(model)`` per rank x the pipeline group).
    ``recipe``: a Piper recipe name, file or trace (default ``1f1b``; ``interleaved-1f1b`` with
    several chunks per rank); a wrong one is refused at the first call, naming it. ``zero``
    (1, 2, 3): Piper's ZeRO over the data-parallel ranks, the chunks in :class:`ZeroChunk` and
    :meth:`PiperForwardBackward.prepare` called before the optimizer is built. ``trace``,
    ``trace_memory`` and ``profile``: :class:`PiperForwardBackward`'s."""
    apply_cpu_fixes()
    return PiperForwardBackward(recipe=recipe or _installed.get("recipe"), timeout_s=timeout_s, zero=zero,
                                trace=trace, profile=profile, trace_memory=trace_memory)


def install(recipe: str | None = None) -> None:
    """Make Megatron's own ``get_forward_backward_func`` (in ``megatron.core.pipeline_parallel``,
    its ``schedules`` module, and any module that imported it by name) return Piper's."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    apply_cpu_fixes()
    original = _installed.get("original", schedules.get_forward_backward_func)
    _installed.update(original=original, recipe=recipe)

    def piper_get_forward_backward_func(pp_size=None, vp_size=None):
        return get_forward_backward_func(pp_size, vp_size, recipe=_installed.get("recipe"))

    piper_get_forward_backward_func.__doc__ = get_forward_backward_func.__doc__
    _installed["replacement"] = piper_get_forward_backward_func
    _rebind(original, piper_get_forward_backward_func)
    pipeline_parallel.get_forward_backward_func = piper_get_forward_backward_func
    schedules.get_forward_backward_func = piper_get_forward_backward_func


def uninstall() -> None:
    """Undo :func:`install`: Megatron's own function everywhere again."""
    if "original" in _installed:
        _rebind(_installed["replacement"], _installed["original"])
        _installed.clear()


def _rebind(old: Callable, new: Callable) -> None:
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for name, value in list(names.items()):
            if value is old and name == "get_forward_backward_func":
                setattr(module, name, new)
