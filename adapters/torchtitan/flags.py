"""A TorchTitan command line the Piper engine cannot run ends in one line, before step 1.

Every rank checks the same flags while TorchTitan builds the trainer, so every rank finds the
same :class:`FlagError`; :func:`one_line_errors` turns it into ``piper: error: <message>`` on
stderr and exit status 2, with no traceback. Global rank 0 says it at once; any other rank waits
a few seconds first (the launcher ends it as rank 0 exits), so the job prints it once.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator

from piper_plugin import UsageError

__all__ = ["FlagError", "one_line_errors"]

SAY_AFTER_S = 5.0  # how long a rank other than 0 leaves rank 0 to say the error first


class FlagError(UsageError, ValueError):
    """A flag, or a combination of flags, the Piper engine refuses; the message names the flags
    and the fix (Piper's :class:`~piper_plugin.UsageError`, raised inside TorchTitan's trainer)."""


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Within the block, a :class:`FlagError` exits the process (status 2) after one line."""
    try:
        yield
    except FlagError as exc:
        if os.environ.get("RANK", "0") != "0":
            time.sleep(SAY_AFTER_S)  # rank 0 says it and ends the job; still here: rank 0 passed, say it
        print(f"piper: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
