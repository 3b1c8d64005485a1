"""Region annotations: tags on parts of an ordinary PyTorch model.

Two front ends produce the same thing, a set of tags on each traced op:

* ``annotate(**tags)`` is a context manager used inside ``forward``; in eager code it
  costs a list push/pop and changes nothing.
* ``annotate_modules(model, {pattern: tags})`` tags submodules by name (fnmatch
  patterns over fully qualified module names) for code that cannot be edited.

Invariant: tags nest; an inner annotation adds to (and may override) the outer tags.
"""
from __future__ import annotations

import contextlib
import fnmatch
import threading
from typing import Any, Iterator, Mapping

import torch.nn as nn

__all__ = ["annotate", "annotate_modules", "current_tags", "module_tags"]

_state = threading.local()
_MODULE_TAGS_ATTR = "_piper_module_tags"


def _stack() -> list[dict[str, Any]]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def _check_tags(tags: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not tags:
        raise ValueError(f"{where}: give at least one tag, e.g. PP=0 or EP='experts'")
    out = {}
    for key, value in tags.items():
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            raise TypeError(
                f"{where}: tag {key}={value!r} must be an int or a str (e.g. PP=0, EP='experts')"
            )
        out[str(key)] = value
    return out


@contextlib.contextmanager
def annotate(**tags: Any) -> Iterator[None]:
    """Tag every op run inside the block, e.g. ``with piper.annotate(PP=1): h = block(h)``."""
    checked = _check_tags(tags, "piper.annotate")
    stack = _stack()
    stack.append(checked)
    try:
        yield
    finally:
        stack.pop()


def current_tags() -> dict[str, Any]:
    """The merged tags of the enclosing ``annotate`` blocks (outermost first)."""
    merged: dict[str, Any] = {}
    for frame in _stack():
        merged.update(frame)
    return merged


def annotate_modules(model: nn.Module, patterns: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Tag submodules whose qualified name matches an fnmatch pattern.

    ``annotate_modules(model, {"layers.[0-1]": {"PP": 0}, "layers.*.moe.experts": {"EP": "experts"}})``.
    Several patterns may match one module; their tags merge in the order given. A pattern that
    matches nothing is an error naming the pattern, so a typo never silently leaves a region out.
    """
    names = [name for name, _ in model.named_modules() if name]
    for pattern, tags in patterns.items():
        checked = _check_tags(tags, f"annotate_modules pattern {pattern!r}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            sample = ", ".join(names[:8])
            raise KeyError(
                f"annotate_modules: pattern {pattern!r} matches no submodule of "
                f"{type(model).__name__}; module names look like: {sample}"
            )
        for name in hits:
            module = model.get_submodule(name)
            merged = dict(getattr(module, _MODULE_TAGS_ATTR, {}))
            merged.update(checked)
            setattr(module, _MODULE_TAGS_ATTR, merged)
    return model


def module_tags(module: nn.Module) -> dict[str, Any]:
    """Tags set on ``module`` by :func:`annotate_modules` (empty if none)."""
    return dict(getattr(module, _MODULE_TAGS_ATTR, {}))
