"""The Megatron adapter's one error kind: an argument the Piper engine cannot run."""
from __future__ import annotations

from piper_plugin import UsageError

__all__ = ["ArgumentError"]


class ArgumentError(UsageError, ValueError):
    """A Megatron argument (or combination) the Piper engine cannot run; the message names the
    argument and the fix."""
