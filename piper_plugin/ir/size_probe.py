"""Sizes of every value of a traced model, from one run on fake or meta tensors.

No real weights are touched: a model on the meta device runs on meta tensors (with repeated
identical ops reused, so many equal layers cost one run), any other model on fake tensors.
Each node's matrix-product FLOPs (linear layers, matmuls, attention, convolutions) are counted
from its arguments' and output's shapes (2 per multiply-add; attention and convolutions by
:mod:`torch.utils.flop_counter`'s formulas); other ops count 0.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter

__all__ = ["probe_sizes"]


class _SizeProbe(fx.Interpreter):
    """Runs the graph on fake/meta tensors and records each node's output size in bytes.

    With ``memo`` (meta tensors only), an op already run on arguments of the same metadata
    (shape, stride, dtype, ...) and the same other arguments is not run again: its output
    metadata is reused (:func:`_memo_key`). A model's repeated layers then cost one run.
    """

    def __init__(self, gm: fx.GraphModule, memo: bool = False):
        super().__init__(gm)
        self.nbytes: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.views: set[str] = set()  # outputs that alias an input's storage: no new memory
        self.flops: dict[str, int] = {}  # node -> forward FLOPs of its matrix products
        self.memo: dict[Any, Any] | None = {} if memo else None

    def run_node(self, n: fx.Node) -> Any:
        key = self._memo_key(n) if self.memo is not None else None
        spec = self.memo.get(key) if key is not None else None
        if spec is not None:
            out, is_view = _build(spec[0]), spec[1]
        else:
            out = super().run_node(n)
            is_view = _aliases_input(self, n, out)
            if key is not None:
                try:
                    self.memo[key] = (_spec(out), is_view)
                except _Uncacheable:
                    pass
        if is_view:
            self.views.add(n.name)
        self.nbytes[n.name] = sum(t.numel() * t.element_size() for t in _tensors(out))
        if isinstance(out, torch.Tensor):
            self.shapes[n.name] = tuple(out.shape)
            flops = _matmul_flops(self, n, out)
            if flops:
                self.flops[n.name] = flops
        return out

    def _memo_key(self, n: fx.Node) -> Any:
        if n.op == "call_module":
            target = _module_key(self.module.get_submodule(n.target))
        elif n.op in ("call_function", "call_method") and _pure(n.op, n.target):
            target = n.target
        else:
            return None
        if target is None or "out" in n.kwargs or n.kwargs.get("inplace") is True:
            return None
        try:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return n.op, target, _freeze(args), _freeze(kwargs)
        except _Uncacheable:
            return None


_MATMULS = {torch.matmul, operator.matmul, torch.mm, torch.bmm, F.linear, torch.addmm, torch.baddbmm}
_MATMUL_METHODS = {"matmul", "__matmul__", "mm", "bmm"}


def _matmul_flops(probe: _SizeProbe, n: fx.Node, out: torch.Tensor) -> int:
    """Forward FLOPs of node ``n``'s matrix products (0 for anything else)."""
    if n.op == "call_module":
        module = probe.module.get_submodule(n.target)
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            return 0
        args, _ = probe.fetch_args_kwargs_from_env(n)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return 0
        if isinstance(module, nn.Linear):
            return 2 * x.numel() * module.out_features
        if isinstance(module, nn.modules.conv._ConvNd):
            return flop_counter.conv_flop_count(list(x.shape), list(module.weight.shape), list(out.shape),
                                                transposed=isinstance(module, nn.modules.conv._ConvTransposeNd))
        return 0
    if n.op == "call_function" and n.target in _MATMULS or n.op == "call_method" and n.target in _MATMUL_METHODS:
        args, _ = probe.fetch_args_kwargs_from_env(n)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if n.target in (torch.addmm, torch.baddbmm):
            tensors = tensors[1:]
        if n.target is F.linear:  # (x, weight[out, in]): every output element is one dot of length in
            return 2 * out.numel() * tensors[1].shape[-1] if len(tensors) > 1 else 0
        return 2 * out.numel() * tensors[0].shape[-1] if len(tensors) > 1 and tensors[0].dim() else 0
    if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
        args, _ = probe.fetch_args_kwargs_from_env(n)
        q, k, v = (a for a in args[:3])
        return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
    return 0


def _aliases_input(probe: _SizeProbe, n: fx.Node, out: Any) -> bool:
    if not isinstance(out, torch.Tensor) or n.op not in ("call_function", "call_method"):
        return False
    inputs = [probe.env[a] for a in n.all_input_nodes if isinstance(probe.env.get(a), torch.Tensor)]
    storage = out.untyped_storage()._cdata
    return any(t.untyped_storage()._cdata == storage for t in inputs)


class _Uncacheable(Exception):
    pass


_INPLACE_OPERATORS = frozenset({"iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imod", "imul", "imatmul",
                                "ior", "ipow", "irshift", "isub", "itruediv", "ixor", "setitem", "delitem"})


def _pure(op: str, target: Any) -> bool:
    """Whether the op's output metadata depends only on its arguments' (no in-place, no state)."""
    if op == "call_method":
        return isinstance(target, str) and not target.endswith("_")  # add_, resize_, __setitem__
    name = getattr(target, "__name__", "") or ""
    module = getattr(target, "__module__", "") or ""
    if name.endswith("_"):
        return False
    if module in ("_operator", "operator"):
        return name not in _INPLACE_OPERATORS
    if module == "builtins":
        return target in (getattr, len)
    return (module == "torch" or module.startswith("torch.")) and not module.startswith("torch._ops")


def _module_key(m: nn.Module) -> Any:
    """A hashable description of a built-in torch.nn leaf module, or None."""
    import torch.nn.modules.module as _mod
    if (not type(m).__module__.startswith("torch.nn.") or m._modules or m._forward_hooks
            or m._forward_pre_hooks or _mod._global_forward_hooks or _mod._global_forward_pre_hooks
            or getattr(m, "inplace", False)):
        return None
    try:
        attrs = tuple(sorted((k, _freeze(v)) for k, v in vars(m).items() if not k.startswith("_")))
        tensors = _freeze((tuple(m._parameters.items()), tuple(m._buffers.items())))
    except _Uncacheable:
        return None
    return type(m), attrs, tensors


_ATOMS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _freeze(value: Any) -> Any:
    """Hashable metadata of an op argument; tensors by shape, stride, offset, dtype, device."""
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, nn.Parameter) or value.layout != torch.strided:
            raise _Uncacheable
        return ("T", type(value), tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                value.device, value.requires_grad)
    if value is None or value is Ellipsis or type(value) in _ATOMS:
        return type(value), value  # typed: 1, 1.0 and True are equal keys but give other dtypes
    if isinstance(value, (tuple, list)):  # fx's immutable_list, torch.Size, ...
        return type(value), tuple(_freeze(v) for v in value)
    if isinstance(value, dict):  # fx's immutable_dict
        return type(value), tuple((k, _freeze(v)) for k, v in value.items())
    if type(value) is slice:
        return slice, _freeze(value.start), _freeze(value.stop), _freeze(value.step)
    raise _Uncacheable


def _spec(value: Any) -> Any:
    """What :func:`_build` needs to make an output of the same metadata."""
    if isinstance(value, torch.Tensor):
        if (type(value) is not torch.Tensor or value.layout != torch.strided or value.storage_offset()
                or value.requires_grad or not value.is_meta):
            raise _Uncacheable
        return "T", tuple(value.shape), value.stride(), value.dtype
    if type(value) in (tuple, list):
        return type(value), tuple(_spec(v) for v in value)
    if type(value) is torch.Size:
        return "S", tuple(value)
    if type(value) in (bool, int, float):
        return "V", value
    raise _Uncacheable  # None (a side effect?) and anything else: run it every time


def _build(spec: Any) -> Any:
    tag = spec[0]
    if tag == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    if tag == "S":
        return torch.Size(spec[1])
    if tag == "V":
        return spec[1]
    return tag(_build(v) for v in spec[1])


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _fake_inputs(model: nn.Module, inputs: Sequence[Any]) -> tuple[Any, FakeTensorMode | None]:
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        return tuple(torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
                     for t in inputs), None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs), mode


def probe_sizes(gm: fx.GraphModule, model: nn.Module, args: Sequence[Any]) -> "_SizeProbe":
    """Run ``gm`` once; the probe's ``nbytes`` and ``shapes`` are keyed by node name."""
    fake_args, mode = _fake_inputs(model, args)
    probe = _SizeProbe(gm, memo=mode is None)
    if mode is None:
        with torch.no_grad():  # sizes only: no autograd graph, so outputs can be memoised
            probe.run(*fake_args)
    else:
        with mode:
            probe.run(*fake_args)
    return probe
