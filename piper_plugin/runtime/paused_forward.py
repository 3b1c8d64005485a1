"""A forward that stops where it hands a value off the rank, so that other work runs meanwhile.

Model code calls :func:`hand_off` (an expert-parallel dispatch or combine, say) with what it
sends; the forward's thread then waits while the runtime moves the value (an ALL_TO_ALL node on
its own stream) and runs other tasks, and resumes it with what came back. Each stretch between
hand-offs is one piece of :class:`~piper_plugin.autograd.graph_pieces.GraphPieces`, so its
backward also runs piece by piece.

Invariants: exactly one of the caller and the forward's thread runs at a time (the caller blocks
in :meth:`PausedForward.run` until the forward pauses or ends), so the forward sees the same
values as an uninterrupted run; the forward's thread runs under the caller's grad mode and the
``context`` it is given (host meshes, a CUDA stream); an exception in the forward is raised
from :meth:`run` with its own traceback; every wait has a timeout.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch

from piper_plugin.autograd.graph_pieces import GraphPieces

__all__ = ["PausedForward", "hand_off", "HandOffError"]

_local = threading.local()


class HandOffError(RuntimeError):
    """A hand-off outside a paused forward, or a forward that did not resume in time."""


def hand_off(value: Any, roots: tuple[torch.Tensor, ...] = ()) -> Any:
    """Hand ``value`` off from the running :class:`PausedForward` and return what comes back.
    ``roots`` are the tensors of ``value`` whose gradients the backward will bring back (they
    end the current piece); what comes back is the next piece's to read."""
    forward = getattr(_local, "forward", None)
    if forward is None:
        raise HandOffError("hand_off() ran outside a Piper paused forward: this module's dispatch needs the "
                           "Piper engine's expert-parallel plan (or the host's own dispatcher)")
    return forward._pause(value, roots)


class PausedForward:
    """``fn()`` on a thread of its own, advanced by :meth:`run` from hand-off to hand-off."""

    def __init__(self, fn: Callable[[], Any], *, timeout_s: float,
                 context: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.pieces = GraphPieces()
        self.timeout_s = timeout_s
        self._fn, self._context = fn, context
        self._grad = torch.is_grad_enabled()
        self._turn = threading.Condition()
        self._forward_turn = False
        self._outbox: tuple[str, Any] | None = None
        self._inbox: Any = None
        self._thread: threading.Thread | None = None
        self.done = False

    # -- the forward's side --------------------------------------------------------------
    def _main(self) -> None:
        _local.forward = self
        result: tuple[str, Any]
        try:
            with torch.set_grad_enabled(self._grad), (self._context() if self._context else contextlib.nullcontext()):
                with self.pieces.forward():
                    out = self._fn()
                    self.pieces.end_piece(_tensors(out))
            result = ("done", out)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            result = ("error", exc)
        finally:
            _local.forward = None
        self._give_back(result)

    def _pause(self, value: Any, roots: tuple[torch.Tensor, ...]) -> Any:
        self.pieces.end_piece(list(roots))
        self._give_back(("paused", value))
        with self._turn:
            if not self._turn.wait_for(lambda: self._forward_turn, timeout=self.timeout_s):
                raise HandOffError(f"a paused forward waited {self.timeout_s:.0f} s for what its hand-off brings back")
            reply, self._inbox = self._inbox, None
        return reply

    def _give_back(self, result: tuple[str, Any]) -> None:
        with self._turn:
            self._outbox = result
            self._forward_turn = False
            self._turn.notify_all()

    # -- the caller's side ---------------------------------------------------------------
    def run(self, reply: Any = None) -> tuple[bool, Any]:
        """Start the forward, or resume it with ``reply``; returns (ended, value): the value
        handed off at the next pause, or the forward's result when it ended."""
        if self.done:
            raise HandOffError("this forward already ended")
        with self._turn:
            self._inbox, self._outbox, self._forward_turn = reply, None, True
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="piper-paused-forward", daemon=True)
                self._thread.start()
            else:
                self._turn.notify_all()
            if not self._turn.wait_for(lambda: self._outbox is not None, timeout=self.timeout_s):
                raise HandOffError(f"a paused forward ran {self.timeout_s:.0f} s without reaching a hand-off or its end")
            kind, value = self._outbox
        if kind == "error":
            self.done = True
            raise value
        self.done = kind == "done"
        return self.done, value


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    if isinstance(out, dict):
        return [t for t in out.values() if isinstance(t, torch.Tensor)]
    return []
