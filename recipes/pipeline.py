"""Pipeline recipes: each is nothing but directives on a :class:`Schedule`.

Every recipe places stage ``s`` on the rank its layout names, shards expert regions when the
grid has ``ep > 1``, replicates every region with the requested ZeRO level (so ZeRO 0-3
compose with every schedule), splits into microbatches and orders each rank's chunks.
"""
from __future__ import annotations

from typing import Callable

from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.schedule import Schedule
from piper_plugin.recipes import orders as _orders

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "dualpipev", "RECIPES", "apply_recipe"]


def _num_stages(sch: Schedule) -> int:
    return len({r.stage for r in sch.dag.regions.values()})


def _prepare(sch: Schedule, recipe: str, v: int, layout: str, microbatches: int, zero: int,
             bucket_bytes: int | None, split_backward: bool) -> None:
    p = sch.grid.pp
    stages = _num_stages(sch)
    if stages != p * v:
        raise DirectiveError(recipe, f"pp={p}, chunks={v}",
                             f"the model has {stages} PP stages but the recipe needs pp x chunks = {p * v}",
                             "annotate pp x chunks stages (e.g. --layers) or change --pp / --chunks")
    for s in range(stages):
        sch.place(f"PP={s}", rank=_orders.stage_rank(s, p, v, layout))
    if sch.grid.ep > 1:
        sch.shard("EP=*")
    sch.replicate("*", zero=zero, bucket_bytes=bucket_bytes)
    sch.split(microbatches, split_backward=split_backward)


def _group(kind: str, stage: int, mb: int, split_backward: bool) -> list[str]:
    if kind == "B" and split_backward:
        return [f"stage={stage},kind=BI,mb={mb}", f"stage={stage},kind=BW,mb={mb}"]
    return [f"stage={stage},kind={kind},mb={mb}"]


def _pairable(pairs: str, stage: int, mb: int, nxt: tuple[str, int, int]) -> bool:
    """Whether an action and the next one form an overlap block: ``"FB"`` (DualPipeV) a forward and
    the backward of another stage after it; ``"BF"`` (interleaved 1F1B) a backward and the forward
    of another stage or microbatch after it."""
    return nxt[1] != stage if pairs == "FB" else (nxt[1], nxt[2]) != (stage, mb)


def _apply_orders(sch: Schedule, orders: list[list[tuple[str, int, int]]], split_backward: bool,
                  overlap_pairs: str = "") -> Schedule:
    chains = {}
    for rank, actions in enumerate(orders):
        groups: list = []
        i = 0
        while i < len(actions):
            kind, stage, mb = actions[i]
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            if overlap_pairs and nxt and kind + nxt[0] == overlap_pairs and _pairable(overlap_pairs, stage, mb, nxt):
                groups.append({"overlap": _group(kind, stage, mb, split_backward) + _group(*nxt, split_backward)})
                i += 2
                continue
            groups.append(_group(kind, stage, mb, split_backward))
            i += 1
        chains[rank] = groups
    return sch.order_per_rank(chains)


def gpipe(sch: Schedule, *, microbatches: int, zero: int = 0, bucket_bytes: int | None = None) -> Schedule:
    _prepare(sch, "gpipe", 1, "loop", microbatches, zero, bucket_bytes, False)
    return _apply_orders(sch, _orders.gpipe(sch.grid.pp, microbatches), False)


def one_f_one_b(sch: Schedule, *, microbatches: int, zero: int = 0, bucket_bytes: int | None = None,
                extra_warmup: int = 0) -> Schedule:
    """``extra_warmup``: forwards each rank runs ahead beyond 1F1B's warm-up (:func:`~.orders.one_f_one_b`)."""
    _prepare(sch, "1f1b", 1, "loop", microbatches, zero, bucket_bytes, False)
    return _apply_orders(sch, _orders.one_f_one_b(sch.grid.pp, microbatches, extra_warmup), False)


def interleaved_1f1b(sch: Schedule, *, microbatches: int, chunks: int = 2, zero: int = 0,
                     bucket_bytes: int | None = None) -> Schedule:
    """Megatron's interleaved 1F1B. With expert parallelism each steady-state backward and the
    forward after it form an overlap block, so one microbatch's all-to-alls run under the other's
    compute. (Plain 1F1B gets no blocks: a block waits for both members' inputs, and 1F1B's
    forward must not wait for the backward's gradient; simulated, blocks make it slower.)"""
    _prepare(sch, "interleaved-1f1b", chunks, "loop", microbatches, zero, bucket_bytes, False)
    try:
        orders = _orders.interleaved_1f1b(sch.grid.pp, chunks, microbatches)
    except ValueError as exc:
        raise DirectiveError("interleaved-1f1b", f"microbatches={microbatches}", str(exc)) from None
    return _apply_orders(sch, orders, False, overlap_pairs="BF" if sch.grid.ep > 1 else "")


def zb_h1(sch: Schedule, *, microbatches: int, zero: int = 0, bucket_bytes: int | None = None) -> Schedule:
    _prepare(sch, "zb-h1", 1, "loop", microbatches, zero, bucket_bytes, True)
    return _apply_orders(sch, _orders.zb_h1(sch.grid.pp, microbatches), True)


def dualpipev(sch: Schedule, *, microbatches: int, zero: int = 0, bucket_bytes: int | None = None) -> Schedule:
    """DualPipeV: 2p stages in a V on p ranks, DeepSeek's order of F / B / BI / BW.

    With expert parallelism a forward and the backward of another stage that follows it form
    an overlap block (issued together, so one's all-to-all hides behind the other's compute).
    Without it there is nothing inside a pair to hide: the pair runs as F then B on the compute
    stream, each waiting only for its own inputs, as torch's ``ScheduleDualPipeV`` runs it (a
    block would make F wait for B's incoming gradient and hold F's output until B is done).
    """
    try:
        orders = _orders.dualpipev(sch.grid.pp, microbatches)
    except ValueError as exc:
        raise DirectiveError("dualpipev", f"microbatches={microbatches}", str(exc)) from None
    _prepare(sch, "dualpipev", 2, "v", microbatches, zero, bucket_bytes, True)
    return _apply_orders(sch, orders, True, overlap_pairs="FB" if sch.grid.ep > 1 else "")


RECIPES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "dualpipev": dualpipev,
}

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": None, "zb-h1": 1, "dualpipev": 2}


def apply_recipe(sch: Schedule, name: str, *, microbatches: int, chunks: int = 2, zero: int = 0,
                 bucket_bytes: int | None = None) -> Schedule:
    if name not in RECIPES:
        raise DirectiveError("recipe", repr(name), "unknown recipe", f"use one of {sorted(RECIPES)}")
    kwargs = {"microbatches": microbatches, "zero": zero, "bucket_bytes": bucket_bytes}
    if name == "interleaved-1f1b":
        kwargs["chunks"] = chunks
    return RECIPES[name](sch, **kwargs)


def stages_needed(name: str, pp: int, chunks: int = 2) -> int:
    """How many PP stages the model must be annotated with for recipe ``name``."""
    return pp * (CHUNKS.get(name) or chunks)
