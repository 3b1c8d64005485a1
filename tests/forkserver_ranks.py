"""Gloo ranks for tests that drive an Executor by hand, as a host framework does.

``run_ranks(target, world, *args)`` starts ``world`` processes from a fork server (a test
process that ran autograd must not fork) calling ``target(rank, port, *args, out)``; each puts
``(rank, report)`` on ``out``. Returns the reports by rank.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket

__all__ = ["run_ranks"]


def run_ranks(target, world: int, *args, timeout_s: float = 240.0) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(10)
    return results
