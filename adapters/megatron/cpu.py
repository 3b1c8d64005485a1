"""The CPU path for Megatron-Core: its CUDA-only spots answered on the CPU, applied only
without a GPU (on a GPU nothing here runs).

Megatron-Core 0.16.1 imports and builds models on a CPU-only torch (local layer spec, no
Transformer Engine), but running them touches CUDA in a few kinds of places
(HOST_FRAMEWORKS.md): tensors made with ``device="cuda"`` or ``torch.cuda.current_device()``
(schedules, p2p buffers, the global memory buffer, optimizer, clipping, MoE utilities),
``Tensor.cuda()``, streams, ``torch.cuda.synchronize()``, and checks that a parameter's
``type()`` is ``'torch.cuda.FloatTensor'``. None of it edits a Megatron file:

* :class:`CudaOnCpu`, a torch function mode, turns a CUDA device argument into ``"cpu"``,
  ``Tensor.cuda()`` into the tensor itself and answers ``Tensor.type()`` with the CUDA type
  name of the same dtype (the only thing those checks read). Modes are per thread:
  :func:`cpu_context` enters it on a thread that runs Megatron code (Piper's compute stream);
* :func:`apply_cpu_fixes` enters it on the calling thread and makes ``torch.cuda``'s
  device, stream, event and synchronize calls answer for the CPU, sets the MoE utilities'
  missing Transformer Engine GEMM to None (its own fallback), and lets
  ``torch.distributed.all_to_all_single`` take split sizes as tensors (Megatron's expert
  dispatch passes them so; gloo's binding wants lists of ints), and gives Megatron's RNG tracker a
  generator standing in for the GPU's (``torch.cuda`` seeding and state calls, and the
  tracker's own getter and setter), so ``model_parallel_cuda_manual_seed`` runs as on a GPU
  (CPU ops keep drawing from the CPU generator).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Callable, ContextManager

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["on_cpu", "apply_cpu_fixes", "cpu_context", "CudaOnCpu"]

_applied = threading.Lock()
_state: dict[str, Any] = {"applied": False}


def on_cpu() -> bool:
    """True when there is no GPU (or PIPER_MEGATRON_DEVICE=cpu forces the CPU path)."""
    forced = os.environ.get("PIPER_MEGATRON_DEVICE", "")
    if forced:
        return forced == "cpu"
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an index: a CUDA device


def _cuda_type_name(t: torch.Tensor) -> str:
    name = torch.Tensor.type.__get__(t)()  # e.g. 'torch.FloatTensor'
    return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)


class CudaOnCpu(TorchFunctionMode):
    """CUDA device arguments mean the CPU; ``.cuda()`` is the tensor itself; ``.type()`` names
    the CUDA type of the tensor's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]) and not isinstance(args[1], int):
            args = (args[0], "cpu", *args[2:])
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream on the CPU: everything runs in program order already."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def cpu_context() -> Callable[[], ContextManager]:
    """A factory of contexts that run Megatron code on the CPU on the current thread
    (a no-op context with a GPU, or on a thread where the mode is already active: two would
    run every torch call through the mode twice)."""
    if not on_cpu():
        return contextlib.nullcontext
    return _mode_on_this_thread


def _mode_on_this_thread() -> ContextManager:
    from torch.overrides import _get_current_function_mode_stack

    if any(isinstance(mode, CudaOnCpu) for mode in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return CudaOnCpu()


def apply_cpu_fixes() -> bool:
    """Make Megatron-Core run on the CPU in this process (its calling thread); idempotent.
    Returns whether the CPU path is in use."""
    if not on_cpu():
        return False
    with _applied:
        if not _state["applied"]:
            cuda = torch.cuda
            # "cpu", not an index: Megatron passes it as a device, also where no mode is active
            # (a custom autograd Function's backward runs outside the caller's torch function modes)
            cuda.current_device = lambda: "cpu"
            cuda.synchronize = lambda *a, **k: None
            cuda.set_device = lambda *a, **k: None
            cuda.Stream, cuda.Event = _Stream, _Event
            cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
            cuda.stream = lambda *a, **k: contextlib.nullcontext()
            _split_sizes_as_lists()
            _cpu_generator_as_device_generator()
            _torch_norm_under_sequence_parallel()
            try:
                from megatron.core.transformer.moe import moe_utils
                if not hasattr(moe_utils, "te_general_gemm"):
                    moe_utils.te_general_gemm = None
            except ImportError:
                pass
            _state["applied"] = True
    if not getattr(_thread_mode, "mode", None):
        _thread_mode.mode = CudaOnCpu()
        _thread_mode.mode.__enter__()
    return True


_thread_mode = threading.local()


def _torch_norm_under_sequence_parallel() -> None:
    """Megatron's torch norm (the local spec's without apex or Transformer Engine, as here)
    refuses ``--sequence-parallel``; its fused norms take it and mark their weights
    ``sequence_parallel``, so ``finalize_model_grads`` sums their gradients over the
    tensor-parallel ranks (each saw its slice of the sequence). The same here for the torch
    norm: the arithmetic is the norm's own, only the mark is added."""
    try:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:
        return
    original = WrappedTorchNorm.__new__

    def build(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = build


def _cpu_generator_as_device_generator() -> None:
    """A generator of its own stands in for the GPU's: Megatron's RNG tracker seeds, forks and
    restores it as on a GPU; CPU ops (dropout) keep drawing from the CPU generator."""
    device = torch.Generator()
    cuda = torch.cuda
    cuda.get_rng_state = lambda device_="cuda": device.get_state()
    cuda.set_rng_state = lambda new_state, device_="cuda": device.set_state(new_state)
    cuda.manual_seed = lambda seed: device.manual_seed(int(seed))
    try:
        from megatron.core.tensor_parallel import random as megatron_random
    except ImportError:
        return
    megatron_random._get_cuda_rng_state = lambda *a, **k: device.get_state()
    megatron_random._set_cuda_rng_state = lambda new_state, *a, **k: device.set_state(new_state)


def _split_sizes_as_lists() -> None:
    import functools

    import torch.distributed as dist

    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single
