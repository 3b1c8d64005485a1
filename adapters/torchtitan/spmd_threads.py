"""TorchTitan's SPMD mesh state for Piper's stream threads.

Under ``--parallelism.spmd_backend spmd_types`` TorchTitan keeps the current mesh (and the
dense / sparse meshes) in thread-local state that its trainer sets around every step; model
code (e.g. muse_glimmer's ``spmd.assert_type``) reads it. Piper runs stage chunks on one thread
per logical stream, so each task re-enters the state the calling thread had.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

__all__ = ["caller_spmd_context"]


def caller_spmd_context() -> Callable[[], ContextManager[None]] | None:
    """A context factory reproducing the calling thread's SPMD meshes, or None when none is set."""
    try:
        from torchtitan.distributed import spmd_types as titan_spmd
    except ImportError:
        return None
    mesh = titan_spmd.current_spmd_mesh()
    if mesh is None:
        return None
    dense = getattr(titan_spmd._MESH_TLS, "dense_mesh", None)  # noqa: SLF001 - no public getter that tolerates None
    sparse = titan_spmd.spmd_sparse_mesh()

    @contextlib.contextmanager
    def context():
        if dense is not None:
            titan_spmd.set_spmd_meshes(dense_mesh=dense, sparse_mesh=sparse)
        with titan_spmd.set_current_spmd_mesh(mesh):
            yield

    return context
