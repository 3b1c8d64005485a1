"""Per-rank action orders for pipeline-parallel schedules (pure Python).

Conventions
-----------
* ``p`` pipeline ranks, ``m`` microbatches, ``v`` virtual stages (chunks) per
  rank; stages ``0..S-1`` in model order with ``S = p * v``.
* An action is ``(kind, stage, microbatch)`` with kind in
  ``{"F", "B", "BI", "BW"}``: ``B`` is the full backward, ``BI`` the
  input-gradient half and ``BW`` the weight-gradient half (``BI`` + ``BW``
  together replace one ``B``).
* Dependencies: ``F(s,i)`` needs ``F(s-1,i)``; ``B/BI(s,i)`` needs
  ``B/BI(s+1,i)`` (the last stage needs its own ``F(S-1,i)``) and ``F(s,i)``;
  ``BW(s,i)`` needs ``BI(s,i)``.
* Every generator returns ``orders[rank]``: the list of actions that rank runs,
  strictly in that order. Each ``(stage, microbatch)`` of a rank's stages gets
  exactly one ``F`` and either one ``B`` or one ``BI`` followed later by one
  ``BW``.
"""

from __future__ import annotations

from collections import deque

Action = tuple[str, int, int]
Orders = list[list[Action]]

__all__ = [
    "stage_rank",
    "stages_of_rank",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "dualpipev",
]


def _check(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")


def stage_rank(stage: int, p: int, v: int, layout: str = "loop") -> int:
    """Rank that owns ``stage``.

    ``"loop"``: stage ``s`` on rank ``s % p`` (Megatron interleaving).
    ``"v"`` (v == 2 only): stage ``s`` on rank ``s`` if ``s < p`` else
    ``2p - 1 - s``, so rank 0 holds the first and the last stage.
    """
    if not 0 <= stage < p * v:
        raise ValueError(f"stage {stage} out of range for p={p}, v={v}")
    if layout == "loop":
        return stage % p
    if layout == "v":
        if v != 2:
            raise ValueError(f"'v' layout needs v == 2, got v={v}")
        return stage if stage < p else 2 * p - 1 - stage
    raise ValueError(f"unknown layout {layout!r} (expected 'loop' or 'v')")


def stages_of_rank(rank: int, p: int, v: int, layout: str = "loop") -> list[int]:
    """Stages held by ``rank``, in increasing model order."""
    return [s for s in range(p * v) if stage_rank(s, p, v, layout) == rank]


def gpipe(p: int, m: int) -> Orders:
    """GPipe: every rank runs ``F(r, 0..m-1)`` then ``B(r, 0..m-1)``.

    Peak in-flight activations: ``m`` on every rank.
    Idle per rank (list scheduling, no comm): ``(p-1)(F+B)``.
    """
    _check(p, m)
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int, extra_warmup: int = 0) -> Orders:
    """Non-interleaved 1F1B (PipeDream-flush).

    Rank ``r``: ``w = min(p-r-1, m)`` warm-up forwards, then ``m-w`` pairs
    ``F(i+w), B(i)``, then the ``w`` remaining backwards. Microbatches run in
    order on every rank. Peak in-flight activations on rank ``r``:
    ``min(p-r, m)``. Idle per rank: ``(p-1)(F+B)``.

    ``extra_warmup`` k: ``w = min(p-r-1+k, m)``, k more forwards in flight on every
    rank before its first backward (k more activations held; a message's latency
    then hides behind a queued forward); k >= m - 1 is GPipe.
    """
    _check(p, m)
    if extra_warmup < 0:
        raise ValueError(f"extra_warmup must be >= 0; got {extra_warmup}")
    orders = []
    for r in range(p):
        w = min(p - r - 1 + extra_warmup, m)
        acts = [("F", r, i) for i in range(w)]
        for i in range(m - w):
            acts += [("F", r, i + w), ("B", r, i)]
        acts += [("B", r, i) for i in range(m - w, m)]
        orders.append(acts)
    return orders


def _interleaved_mb(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """Megatron's k-th virtual microbatch -> (chunk, microbatch).

    Microbatches are taken ``p`` at a time through chunk 0, 1, ..., v-1
    (forward) or v-1, ..., 0 (backward) before moving to the next group.
    """
    chunk = (k // p) % v
    if backward:
        chunk = v - 1 - chunk
    return chunk, (k // (p * v)) * p + k % p


def interleaved_1f1b(p: int, v: int, m: int) -> Orders:
    """Megatron interleaved 1F1B on the loop layout (stage ``c*p + r`` on rank r).

    Requires ``m % p == 0``. Rank ``r`` runs ``w = min((v-1)p + 2(p-r-1), v*m)``
    warm-up forwards, then ``v*m - w`` steady pairs ``F(k+w), B(k)``, then the
    remaining backwards, with virtual index ``k`` mapped by
    :func:`_interleaved_mb`. (Megatron additionally runs all forwards first
    when ``m == p``; like torch's ``ScheduleInterleaved1F1B`` we only cap.)
    Idle per rank with per-chunk costs ``f, b``: ``(p-1)(f+b)``, i.e.
    ``(p-1)(F+B)/v`` for whole-model costs ``F = v f``, ``B = v b``.
    """
    _check(p, m, v)
    if m % p != 0:
        raise ValueError(
            f"interleaved_1f1b needs the number of microbatches m={m} to be a "
            f"multiple of the number of pipeline ranks p={p}")
    total = v * m
    orders = []
    for r in range(p):
        w = min((v - 1) * p + 2 * (p - r - 1), total)

        def act(kind: str, k: int, backward: bool) -> Action:
            c, i = _interleaved_mb(k, p, v, backward)
            return (kind, c * p + r, i)

        acts = [act("F", k, False) for k in range(w)]
        for k in range(total - w):
            acts += [act("F", k + w, False), act("B", k, True)]
        acts += [act("B", k, True) for k in range(total - w, total)]
        orders.append(acts)
    return orders


def zb_h1(p: int, m: int) -> Orders:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

    1F1B with every ``B`` split into ``BI`` + ``BW``: rank ``r`` runs
    ``w = min(p-r-1, m)`` warm-up forwards, then ``F, BI`` pairs and a cool-down
    of ``BI``s, exactly as 1F1B. ``BW``s run FIFO, one after each ``BI``,
    except that rank ``r`` holds back its first ``r`` ``BW``s; they run at the
    end and fill the cool-down bubble (the last rank defers the most).
    Activations counted until ``BW``: at most ``p`` per rank (the 1F1B peak,
    reached on rank 0 in 1F1B); counted until ``BI``: ``min(p-r, m)`` as 1F1B.
    Idle per rank (m >= p): ``(p-1)(F + B - 2W)`` with ``B = BI + BW``, ``W = BW``.
    """
    _check(p, m)
    orders = []
    for r in range(p):
        w = min(p - r - 1, m)
        acts = [("F", r, i) for i in range(w)]
        pending: deque[int] = deque()

        def backward(i: int) -> None:
            acts.append(("BI", r, i))
            pending.append(i)
            if len(pending) > r:
                acts.append(("BW", r, pending.popleft()))

        for i in range(m - w):
            acts.append(("F", r, i + w))
            backward(i)
        for i in range(m - w, m):
            backward(i)
        acts += [("BW", r, i) for i in pending]
        orders.append(acts)
    return orders


def dualpipev(p: int, m: int) -> Orders:
    """DeepSeek's DualPipeV ("cut-in-half" DualPipe) on the v layout.

    Rank ``r`` holds stage ``r`` (chunk 0) and stage ``2p-1-r`` (chunk 1);
    requires ``m >= 2p``. Each chunk consumes microbatches in order. ``BW``s
    are FIFO over a queue fed by ``BI``s (zero-bubble backwards); other
    backwards are full ``B``. Phases, as in ``dualpipev.py`` (``s1 = p-r-1``):

    1. ``2*s1`` x ``F0``                       (warm-up of chunk 0)
    2. ``r+1`` x ``F0 F1``
    3. ``s1`` x ``BI1 BW1 F1``                 (1F1B with split backward)
    4. ``m-2p+r+1`` x ``F0 B1 F1 B0``          (main loop; F0&B1, F1&B0 overlap)
    5. ``s1`` x ``B1 F1 B0``                   (F1&B0 overlap)
    6. ``r+1`` x ``B1 B0``; from the middle iteration on (B1 first on odd
       ranks, B0 first on even ranks) these become ``BI``
    7. ``s1`` x ``BW BI0``
    8. ``r+1`` x ``BW``

    Overlapped pairs appear as consecutive ``F`` then ``B`` of two different
    stages (the last rank's first ``F0 B1`` is not overlapped in DualPipe).
    Bubble: the README's ``(PP/2-1)(F&B + B - 3W)`` counts PP = pipeline
    *stages* = 2p (p = PP/2 devices), i.e. ``(p-1)(F&B + B - 3W)`` with
    per-stage costs. Under list scheduling with F=BI=BW=1, B=2 and F&B = F+B:
    if each overlapped pair is one unit (waits for both inputs, releases both
    outputs at its end, as DualPipe runs it) the idle per rank is exactly
    ``2(p-1)``, the README value; if F and B of a pair are scheduled
    independently it is ``p-1``. Peak activations: ``2p+1`` (PP+1) per rank.
    """
    _check(p, m)
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs at least 2*p microbatches (m={m}, p={p}, need m >= {2 * p})")
    orders = []
    for r in range(p):
        st = (r, 2 * p - 1 - r)
        nf, nb = [0, 0], [0, 0]
        wq: deque[tuple[int, int]] = deque()
        acts: list[Action] = []

        def f(c: int) -> None:
            acts.append(("F", st[c], nf[c]))
            nf[c] += 1

        def b(c: int, zb: bool = False) -> None:
            acts.append(("BI" if zb else "B", st[c], nb[c]))
            if zb:
                wq.append((st[c], nb[c]))
            nb[c] += 1

        def w() -> None:
            acts.append(("BW", *wq.popleft()))

        s1 = p - r - 1
        for _ in range(2 * s1):                 # step 1
            f(0)
        for _ in range(r + 1):                  # step 2
            f(0); f(1)
        for _ in range(s1):                     # step 3
            b(1, zb=True); w(); f(1)
        for _ in range(m - 2 * p + r + 1):      # step 4
            f(0); b(1); f(1); b(0)
        for _ in range(s1):                     # step 5
            b(1); f(1); b(0)
        zb = False
        for i in range(r + 1):                  # step 6
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            b(1, zb)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            b(0, zb)
        for _ in range(s1):                     # step 7
            w(); b(0, zb=True)
        for _ in range(r + 1):                  # step 8
            w()
        assert not wq and nf == [m, m] and nb == [m, m]
        orders.append(acts)
    return orders
