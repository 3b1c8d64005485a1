"""TorchTitan's SPMD mesh state for Piper's stream threads.

Under ``--parallelism.spmd_backend spmd_types`` TorchTitan keeps the current mesh (and the
dense / sparse meshes) in thread-local state that its trainer sets around every step; model
code (e.g. muse_glimmer's ``spmd.assert_type``) reads it. Piper runs stage chunks on one thread
per logical stream, so each task on another thread re-enters the state the calling thread had;
on the calling thread itself (where the compute stream and posted messages run) the state is
already there and entering it again would cost more than a message post (six device-mesh group
lookups).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager

__all__ = ["caller_spmd_context"]


def caller_spmd_context() -> Callable[[], ContextManager[None]] | None:
    """A context factory reproducing the calling thread's SPMD meshes on any other thread (a
    no-op on the calling thread), or None when none is set."""
    try:
        from torchtitan.distributed import spmd_types as titan_spmd
    except ImportError:
        return None
    mesh = titan_spmd.current_spmd_mesh()
    if mesh is None:
        return None
    dense = getattr(titan_spmd._MESH_TLS, "dense_mesh", None)  # noqa: SLF001 - no public getter that tolerates None
    sparse = titan_spmd.spmd_sparse_mesh()
    caller = threading.get_ident()

    @contextlib.contextmanager
    def context():
        if threading.get_ident() == caller:
            yield
            return
        if dense is not None:
            titan_spmd.set_spmd_meshes(dense_mesh=dense, sparse_mesh=sparse)
        with titan_spmd.set_current_spmd_mesh(mesh):
            yield

    return context
