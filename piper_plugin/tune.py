"""Strategy search by simulation (``piper tune``).

Every built-in recipe x every grid ``pp x dp x ep`` of the ranks x ZeRO level x microbatch
count x chunks per rank x order overlay (1F1B with k more forwards in flight per rank before its
first backward, :data:`WARMUP_OVERLAYS`) x stream overlay (one kind of communication moved onto a
logical stream of its own, so it runs beside the stream it came from) is compiled on the same
model and global batch and simulated with one cost model; what does not apply (too few microbatches, a stage count the model cannot cut, an
expert degree on a model without experts) is counted with its reason, not scored. Plans whose
simulated peak memory on their fullest rank is above the cap are set aside; the rest are
ranked by simulated step time, then by memory. The best one's directives are written as a
Schedule trace (JSON), which ``piper train --recipe-file`` / ``load()`` replay as they are.

Invariants: every candidate runs the same model (same layers, same global batch) and the same
cost model, so step times compare; a candidate is scored only from its own compiled plan.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

__all__ = ["Candidate", "Scored", "TuneResult", "grids", "candidates", "search", "STREAM_OVERLAYS",
           "WARMUP_OVERLAYS"]

# node filters a stream overlay moves onto a stream of its own (None: the recipe's streams)
STREAM_OVERLAYS = (None, "kind=SEND", "kind=ALL_TO_ALL", "kind=REDUCE_SCATTER", "kind=ALL_GATHER", "kind=ALL_REDUCE")
OVERLAY_STREAM = "tuned"
# order overlays: extra forwards in flight beyond 1F1B's warm-up (0: the recipe's own order)
WARMUP_OVERLAYS = (0, 1, 2)


@dataclass(frozen=True)
class Candidate:
    """One strategy: a built-in recipe on a grid, with its ZeRO level, microbatches and chunks."""

    recipe: str
    pp: int
    dp: int
    ep: int
    zero: int
    microbatches: int
    chunks: int
    stream: str | None = None  # a node filter moved onto its own stream (a stream overlay)
    warmup: int = 0  # forwards in flight beyond 1F1B's warm-up (an order overlay; 1f1b only)

    def label(self) -> str:
        chunks = f" v={self.chunks}" if self.chunks > 1 else ""
        order = f" order[warm-up+{self.warmup}]" if self.warmup else ""
        stream = f" stream[{self.stream}]" if self.stream else ""
        return (f"{self.recipe} pp={self.pp} dp={self.dp} ep={self.ep} zero={self.zero} "
                f"m={self.microbatches}{chunks}{order}{stream}")

    def schedule(self, program: Any) -> Any:
        """This candidate's Schedule over ``program`` (its recipe, order and stream overlays)."""
        from piper_plugin.api.schedule import Schedule
        from piper_plugin.recipes import load, one_f_one_b

        settings = dict(pp=self.pp, dp=self.dp, ep=self.ep, microbatches=self.microbatches, zero=self.zero)
        if self.warmup:
            sch = one_f_one_b(Schedule(program, pp=self.pp, dp=self.dp, ep=self.ep), microbatches=self.microbatches,
                              zero=self.zero, extra_warmup=self.warmup)
        else:
            sch = load(self.recipe).schedule(program, chunks=self.chunks, **settings)
        return _overlaid(sch, self.stream)


@dataclass
class Scored:
    """A candidate's simulated step: its time, its fullest rank's peak bytes, its bubble; and
    the Schedule whose trace reproduces it."""

    candidate: Candidate
    step_time: float
    peak_bytes: int
    bubble: float
    schedule: Any


@dataclass
class TuneResult:
    fitting: list[Scored]  # under the memory cap, fastest first
    over_cap: list[Scored]  # above it, smallest peak first
    refused: dict[str, int]  # reason -> candidates that did not apply
    duplicates: int = 0  # candidates whose plan equals one scored before (e.g. every recipe at pp=1)
    no_overlay: int = 0  # stream overlays whose filter matched nothing in that plan (the plan without it is scored)


def grids(ranks: int, experts: bool) -> Iterator[tuple[int, int, int]]:
    """Every ``(pp, dp, ep)`` whose product is ``ranks`` (``ep`` 1 unless the model has experts)."""
    for pp in range(1, ranks + 1):
        if ranks % pp:
            continue
        rest = ranks // pp
        for ep in range(1, rest + 1):
            if rest % ep or (ep > 1 and not experts):
                continue
            yield pp, rest // ep, ep


def candidates(ranks: int, batch: int, *, experts: bool, recipes: Sequence[str], zero_levels: Sequence[int],
               microbatches: Sequence[int], chunks: Sequence[int],
               streams: Sequence[str | None] = (None,), warmups: Sequence[int] = (0,),
               grid: tuple[int, int, int] | None = None) -> Iterator[Candidate]:
    """The search space: a microbatch count must give every data shard (dp x ep of them) whole
    samples; chunks above 1 only for recipes that place several stages on a rank; an order
    overlay (``warmups`` above 0) only on 1f1b with a pipeline and microbatches for it to move;
    ``grid``: only that ``(pp, dp, ep)`` (a host's mesh, fixed by its flags)."""
    from piper_plugin.recipes import load

    layouts = [grid] if grid is not None else list(grids(ranks, experts))
    for name, (pp, dp, ep), zero, m in itertools.product(recipes, layouts, zero_levels, microbatches):
        if batch % (dp * ep * m):
            continue
        if zero > 0 and dp * ep == 1:
            continue  # ZeRO shards over data-parallel ranks: with one, every level is ZeRO-0
        recipe = load(name)
        seen_stages = set()
        for v in chunks:
            stages = recipe.stages(pp, v)
            if stages in seen_stages:
                continue  # a recipe that ignores chunks: once
            seen_stages.add(stages)
            for warmup in warmups:
                if warmup and (name != "1f1b" or pp == 1 or pp - 1 + warmup > m):
                    continue  # nothing to move (beyond m the order is GPipe's, scored as gpipe)
                for stream in streams:
                    yield Candidate(name, pp, dp, ep, zero, m, v, stream, warmup)


def search(build_program: Callable[[int], Any], ranks: int, batch: int, *, experts: bool, cost: Any,
           memory_cap: float | None = None, recipes: Sequence[str] | None = None,
           zero_levels: Sequence[int] = (0, 1, 2, 3), microbatches: Sequence[int] = (1, 2, 4, 8, 16),
           chunks: Sequence[int] = (1, 2), max_stages: int | None = None,
           streams: Sequence[str | None] = STREAM_OVERLAYS, warmups: Sequence[int] = WARMUP_OVERLAYS,
           grid: tuple[int, int, int] | None = None) -> TuneResult:
    """Score every candidate. ``build_program(stages)`` captures the model cut into that many
    stages (cached per count here; a ValueError refuses the count); ``max_stages`` skips
    candidates needing more; ``streams``: the stream overlays tried on every candidate;
    ``warmups``: the order overlays (1f1b's); ``grid``: only that ``(pp, dp, ep)``."""
    from piper_plugin.compiler import compile_program
    from piper_plugin.recipes import RECIPES, RecipeError, load

    programs: dict[int, Any] = {}
    duplicates = no_overlay = 0
    fitting, over, refused, hashes = [], [], Counter(), set()
    for cand in candidates(ranks, batch, experts=experts, recipes=list(recipes or RECIPES),
                           zero_levels=zero_levels, microbatches=microbatches, chunks=chunks, streams=streams,
                           warmups=warmups, grid=grid):
        recipe = load(cand.recipe)
        stages = recipe.stages(cand.pp, cand.chunks)
        if max_stages is not None and stages > max_stages:
            refused[f"needs more than {max_stages} stages"] += 1
            continue
        try:
            if stages not in programs:
                programs[stages] = build_program(stages)
            _, sch, plan, result = compile_program(programs[stages], cand.schedule, cost=cost)
        except _NoOverlay:
            no_overlay += 1
            continue
        except (RecipeError, ValueError) as exc:  # DirectiveError and PlanError are ValueErrors
            refused[_reason(exc)] += 1
            continue
        digest = plan.hash()  # the whole plan as JSON, hashed: once
        if digest in hashes:
            duplicates += 1
            continue
        hashes.add(digest)
        peak = max(sum(static.values()) + transient
                   for static, transient in zip(result.static_bytes, result.peak_transient_bytes))
        scored = Scored(cand, result.step_time, int(peak), result.bubble_fraction, sch)
        (fitting if memory_cap is None or peak <= memory_cap else over).append(scored)
    fitting.sort(key=lambda s: (s.step_time, s.peak_bytes, s.candidate.label()))
    over.sort(key=lambda s: (s.peak_bytes, s.step_time, s.candidate.label()))
    return TuneResult(fitting, over, dict(refused), duplicates, no_overlay)


class _NoOverlay(Exception):
    """The candidate's stream overlay selects no node of its plan: it is the plan without it."""


def _overlaid(sch: Any, stream: str | None) -> Any:
    if stream is not None:
        if not sch.nodes(stream):
            raise _NoOverlay(stream)
        sch.stream(stream, OVERLAY_STREAM)
    return sch


def _reason(exc: Exception) -> str:
    """A refusal's kind, for counting: the message after the directive's name, up to its first
    parenthesis or semicolon, numbers as N."""
    text = str(exc).split(": ", 1)[-1].split(" (")[0].split(";")[0]
    return "".join("N" if c.isdigit() else c for c in text)[:120]
