"""The receive-posting policy the runtime follows and the simulator models.

A logical stream holding only SENDs and RECVs is *posted*: its operations are issued in stream
order without a thread of their own. A receive is posted ahead of its consumer while fewer than
``POST_AHEAD`` receives of its stream are outstanding (posted, not yet consumed) *or* the
buffers of the outstanding ones plus its own fit in ``POST_BUDGET`` bytes. Small messages
therefore go out early, as many as fit (the runtime starts posting once the rank's first task
ended or a thread is about to wait; the simulator, from step start): a message whose receive
is not posted yet waits a round trip more. Large ones stay ``POST_AHEAD`` deep, so a 1F1B rank does not hold
every microbatch's buffer at once. A receive's buffer exists from its post on.
"""
from __future__ import annotations

import heapq
from typing import Iterable

from piper_plugin.ir.nodes import P2P, Kind

__all__ = ["POST_AHEAD", "POST_BUDGET", "posted_streams", "post_sizes", "post_times"]

POST_AHEAD = 2
POST_BUDGET = 4 << 20  # bytes of receive buffers a posted stream may hold ahead, per rank


def posted_streams(dag, rank_plan) -> list[str]:
    """Streams of a rank holding only P2P sends and receives: they are posted, not threaded.
    Streams holding sends come first: after a task, its messages go out before more receives
    are posted."""
    nodes, streams = dag.nodes, rank_plan.streams
    posted = [s for s, keys in streams.items() if keys and all(nodes[k].kind in P2P for k in keys)]
    return sorted(posted, key=lambda s: (not any(nodes[k].kind == Kind.SEND for k in streams[s]), s))


def post_sizes(dag, rank_plan, posted: Iterable[str]) -> dict[str, int]:
    """Bytes of each task on the ``posted`` streams (what the budget counts)."""
    return {k: dag.nodes[k].bytes for s in posted for k in rank_plan.streams[s]}


def post_times(receives: Iterable[tuple[str, int, float]], ahead: int = POST_AHEAD,
               budget: int = POST_BUDGET) -> dict[str, float]:
    """When each receive of one posted stream is posted, given ``(key, bytes, first use)`` in
    stream order (first use: when its first consumer starts, which completes it). A receive
    is posted once the one before it is and the policy allows it, and at the latest when it is
    first used (a consumer that needs it posts it)."""
    out: dict[str, float] = {}
    live: list[tuple[float, int]] = []  # (first use, bytes) of posted, not yet consumed receives
    live_bytes, t = 0, 0.0
    for key, nbytes, use in receives:
        while True:
            while live and live[0][0] <= t:
                live_bytes -= heapq.heappop(live)[1]
            if len(live) < ahead or live_bytes + nbytes <= budget or live[0][0] >= use:
                break
            t = live[0][0]  # the next consumption makes room
        t = min(t, use)
        out[key] = t
        heapq.heappush(live, (use, nbytes))
        live_bytes += nbytes
    return out
