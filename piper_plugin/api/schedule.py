"""Schedule: directives that rewrite a captured program's DAG, Halide style.

    sch = Schedule(program, pp=2, dp=2)
    sch.place("PP=0", rank=0); sch.place("PP=1", rank=1)
    sch.replicate("*", zero=3)
    sch.split(microbatches=4)
    sch.order_per_rank({0: ["0F0", "0F1", ...], 1: [...]})

Directives come in phases: placement (place, shard, replicate) before split, and order /
stream after it. Each directive is validated when applied and raises a
:class:`DirectiveError` naming the directive, its filter, the reason and the fix; the DAG is
validated after every pass. Applied directives form a trace (``to_json``) that replays on
the same program to the same DAG (``Schedule.from_json``).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping, Sequence

from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.filters import NODE_KEYS, parse_filter
from piper_plugin.ir.capture import Program
from piper_plugin.ir.graph import CycleError, DAG, gc_paused
from piper_plugin.ir.rank_grid import RankGrid
from piper_plugin.ir.validate import ValidationError, validate
from piper_plugin.passes import order as order_pass
from piper_plugin.passes.place import close_placement, place
from piper_plugin.passes.replicate import replicate
from piper_plugin.passes.shard import shard, shard_problem
from piper_plugin.passes.split import split

__all__ = ["Schedule", "Group"]

Group = str | Sequence[str] | Mapping[str, Sequence[str]]  # filter | union | {"overlap": [...]}

# The exact filter recipes use, ``stage=S,kind=K,mb=M``: answered from an index without parsing.
_EXACT = re.compile(r"stage=(\d+),kind=([A-Za-z_]+),mb=(\d+)\Z")


def model_fingerprint(program: Program) -> str:
    """A short name for the model a trace was recorded on: its regions and their parameters'
    names (not sizes: a trace fits any batch)."""
    regions = sorted((name, sorted(region.params)) for name, region in program.dag.regions.items())
    return hashlib.sha1(json.dumps(regions).encode()).hexdigest()[:12]


class Schedule:
    def __init__(self, program: Program, *, pp: int, dp: int = 1, ep: int = 1):
        self.program = program
        self.grid = RankGrid(pp, dp, ep)
        self.dag: DAG = program.dag.copy()
        self.dag.meta.grid = self.grid
        self.trace: list[dict[str, Any]] = []
        self._placement_closed = False
        self._index: dict[tuple[int, str, int | None], list[str]] | None = None

    # -- helpers ------------------------------------------------------------------------
    def _regions(self, directive: str, text: str) -> list[str]:
        try:
            flt = parse_filter(text)
        except ValueError as exc:
            raise DirectiveError(directive, repr(text), str(exc)) from None
        known = {t for r in self.dag.regions.values() for t in r.tags} | {"region", "stage"}
        unknown = flt.tag_names - known
        if unknown or flt.key_patterns:
            bad = sorted(unknown) or list(flt.key_patterns)
            raise DirectiveError(directive, repr(text), f"unknown tag {bad[0]!r}",
                                 f"select regions by one of the tags {sorted(known)}")
        hits = [r.name for r in self.dag.regions.values() if flt.matches_region(r)]
        if not hits:
            tags = sorted({f"{k}={v}" for r in self.dag.regions.values() for k, v in r.tags.items()})
            raise DirectiveError(directive, repr(text), "the filter matches no region",
                                 f"regions carry the tags {', '.join(tags[:12])}")
        return hits

    def _record(self, directive: str, _acyclic: bool = False, **args: Any) -> None:
        try:
            validate(self.dag, self.grid, acyclic=_acyclic)
        except ValidationError as exc:
            target = repr(next(iter(args.values()), ""))
            raise DirectiveError(directive, target, str(exc)) from None
        self.trace.append({"directive": directive, **args})

    def _close_placement(self, directive: str) -> None:
        if self._placement_closed:
            return
        placement = self.dag.meta.placement
        missing = [r for r in self.dag.regions if r not in placement]
        if missing:
            raise DirectiveError(directive, "", f"regions {missing} are not placed",
                                 "place every region first, e.g. place('PP=3', rank=1)")
        close_placement(self.dag, self.grid, self.program.tied)
        self._placement_closed = True

    def _before_split(self, directive: str, target: str) -> None:
        if self.dag.meta.microbatches is not None:
            fix = "apply split once" if directive == "split" else f"apply {directive} before split"
            raise DirectiveError(directive, target, "the DAG is already split into microbatches", fix)

    # -- placement phase ------------------------------------------------------------------
    def place(self, regions: str, *, rank: int) -> "Schedule":
        """Put the regions matching ``regions`` on pipeline rank ``rank`` (all its replicas)."""
        if self._placement_closed:
            raise DirectiveError("place", repr(regions), "placement is closed",
                                 "call place before shard / replicate / split")
        hits = self._regions("place", regions)
        if not isinstance(rank, int) or not 0 <= rank < self.grid.pp:
            raise DirectiveError("place", repr(regions), f"rank {rank!r} is out of range for pp={self.grid.pp}",
                                 f"use a pipeline rank in 0..{self.grid.pp - 1}")
        placement = self.dag.meta.placement
        for name in hits:
            if name in placement:
                raise DirectiveError("place", repr(regions), f"region {name} is already placed on rank "
                                     f"{placement[name]}", "make the filters of place calls disjoint")
        place(self.dag, self.grid, hits, rank)
        self.trace.append({"directive": "place", "regions": regions, "rank": rank})
        return self

    def shard(self, regions: str, *, degree: int | None = None) -> "Schedule":
        """Expert parallelism: split the matching regions' experts over the grid's ep axis."""
        self._before_split("shard", repr(regions))
        self._close_placement("shard")
        hits = self._regions("shard", regions)
        if self.grid.ep == 1:
            raise DirectiveError("shard", repr(regions), "the rank grid has ep=1", "set ep > 1 (--ep 2)")
        if degree is not None and degree != self.grid.ep:
            raise DirectiveError("shard", repr(regions), f"degree {degree} differs from the grid's ep={self.grid.ep}",
                                 "omit degree or make it equal to --ep")
        for name in hits:
            if name in self.dag.meta.sharded:
                raise DirectiveError("shard", repr(regions), f"region {name} is already sharded")
            if name in self.dag.meta.replicated:
                raise DirectiveError("shard", repr(regions), f"region {name} is already replicated",
                                     "apply shard before replicate")
            problem = shard_problem(self.dag, name, self.grid.ep)
            if problem:
                raise DirectiveError("shard", repr(regions), problem,
                                     "shard only expert regions (GShard layout [experts, capacity, dim])")
        for name in hits:
            shard(self.dag, self.grid, name)
        self._record("shard", regions=regions, degree=degree)
        return self

    def replicate(self, regions: str = "*", *, zero: int = 0, bucket_bytes: int | None = None,
                  blocks: bool = True) -> "Schedule":
        """Data parallelism over each region's replicas, ZeRO level ``zero`` (0-3). At ZeRO 2
        and 3 a region that declares blocks (module regions, e.g. a TorchTitan stage's
        transformer blocks) reduces (and at ZeRO-3 gathers) them one at a time inside its chunk,
        as FSDP does, unless ``blocks=False``: then whole buckets, by the plan's own nodes."""
        self._before_split("replicate", repr(regions))
        self._close_placement("replicate")
        hits = self._regions("replicate", regions)
        if zero not in (0, 1, 2, 3):
            raise DirectiveError("replicate", repr(regions), f"zero={zero!r} is not a ZeRO level", "use 0, 1, 2 or 3")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise DirectiveError("replicate", repr(regions), f"bucket_bytes={bucket_bytes!r} must be a positive int")
        done = self.dag.meta.replicated
        for name in hits:
            if name in done:
                raise DirectiveError("replicate", repr(regions), f"region {name} is already replicated",
                                     "make the filters of replicate calls disjoint")
            if "EP" in self.dag.regions[name].tags and self.grid.ep > 1 and name not in self.dag.meta.sharded:
                raise DirectiveError("replicate", repr(regions), f"expert region {name} is not sharded yet",
                                     "apply shard('EP=...') before replicate")
            if zero and any(p in self.dag.meta.ties.values() for p in self.dag.meta.update_params[name]):
                raise DirectiveError("replicate", repr(regions), f"region {name} holds a weight tied across "
                                     f"pipeline ranks, supported with zero=0 only", "use zero=0 for this region")
            shared = [(p, r) for p in self.dag.meta.update_params[name] for r in self.program.tied.get(p, ())
                      if r != name] if zero == 3 else []
            if shared:
                raise DirectiveError("replicate", repr(regions), f"region {name} holds weight {shared[0][0]} that "
                                     f"region {shared[0][1]} also reads on the same pipeline rank; ZeRO-3 frees it "
                                     f"between the two", "use zero=2 or lower for this region")
        for name in hits:
            replicate(self.dag, self.grid, name, zero, bucket_bytes, blocks)
        self._record("replicate", regions=regions, zero=zero, bucket_bytes=bucket_bytes, blocks=blocks)
        return self

    def split(self, microbatches: int, *, split_backward: bool = False) -> "Schedule":
        """Copy the per-microbatch sub-DAG ``microbatches`` times (BI/BW if ``split_backward``)."""
        self._before_split("split", str(microbatches))
        self._close_placement("split")
        shards = self.grid.data_shards
        if not isinstance(microbatches, int) or microbatches < 1:
            raise DirectiveError("split", str(microbatches), "microbatches must be a positive int")
        if self.dag.batch_size % (microbatches * shards):
            raise DirectiveError("split", str(microbatches),
                                 f"batch {self.dag.batch_size} is not divisible by {microbatches} microbatches "
                                 f"x {shards} data shards", "pick a microbatch count dividing batch / (dp*ep)")
        # split maps every edge of its output onto an edge (or, BI -> BW, a self-loop) of its
        # input, so an acyclic input gives an acyclic output: check the small input instead.
        acyclic = self.dag.is_acyclic()
        with gc_paused():
            self.dag = split(self.dag, microbatches, shards, split_backward)
            self._index = None
            self._record("split", _acyclic=acyclic, microbatches=microbatches, split_backward=split_backward)
        return self

    # -- ordering phase -------------------------------------------------------------------
    def nodes(self, text: str, directive: str = "nodes") -> list[str]:
        """Keys of the nodes a filter or a printable key selects."""
        if text in self.dag.nodes:
            return [text]
        exact = _EXACT.match(text) if isinstance(text, str) else None
        if exact:  # what parse_filter + _lookup give for this form, without parsing
            return list(self._compute_index().get((int(exact[1]), exact[2], int(exact[3])), []))
        try:
            flt = parse_filter(text)
        except ValueError as exc:
            raise DirectiveError(directive, repr(text), str(exc)) from None
        fast = self._lookup(flt)
        if fast is not None:
            return fast
        known = {t for r in self.dag.regions.values() for t in r.tags} | set(NODE_KEYS)
        unknown = flt.tag_names - known
        if unknown:
            raise DirectiveError(directive, repr(text), f"unknown tag {sorted(unknown)[0]!r}",
                                 f"use one of {sorted(known)}")
        rank_of = self.dag.meta.placement
        return [k for k, n in self.dag.nodes.items() if flt.matches_node(n, rank_of)]

    def _lookup(self, flt) -> list[str] | None:
        """Index for the common exact filter ``stage=S,kind=K,mb=M`` used by recipes."""
        terms = dict(flt.terms)
        if flt.key_patterns or set(terms) != {"stage", "kind", "mb"} or any(c in "".join(terms.values()) for c in "*?["):
            return None
        return list(self._compute_index().get((int(terms["stage"]), terms["kind"], int(terms["mb"])), []))

    def _compute_index(self) -> dict[tuple[int, str, int | None], list[str]]:
        if self._index is None:
            self._index = {}
            for key, node in self.dag.nodes.items():
                if node.is_compute:
                    self._index.setdefault((node.stage, node.kind.value, node.microbatch), []).append(key)
        return self._index

    def _group(self, directive: str, group: Group) -> tuple[list[str], bool]:
        overlap = isinstance(group, Mapping)
        if overlap:
            if set(group) != {"overlap"}:
                raise DirectiveError(directive, repr(group), "a dict group must be {'overlap': [filters]}")
            parts = group["overlap"]
        else:
            parts = [group] if isinstance(group, str) else group
        keys = [k for part in parts for k in self.nodes(part, directive)]
        if not keys:
            raise DirectiveError(directive, repr(group), "the group matches no node",
                                 "name nodes by key (2F0) or filter (stage=2,kind=F,mb=0)")
        return keys, overlap

    def order(self, *groups: Group) -> "Schedule":
        """One chain: every node of each group runs before every node of the next."""
        self.order_per_rank({None: list(groups)}, _directive="order")
        return self

    def order_per_rank(self, chains: Mapping[int | None, Sequence[Group]], *, _directive: str = "order_per_rank") -> "Schedule":
        """One chain per pipeline rank (checked to hold only that rank's nodes), applied at once."""
        with gc_paused():
            return self._order_per_rank(chains, _directive)

    def _order_per_rank(self, chains: Mapping[int | None, Sequence[Group]], _directive: str) -> "Schedule":
        if self.dag.meta.microbatches is None:
            raise DirectiveError(_directive, "", "the DAG is not split yet", "call split(microbatches=N) first")
        placement = self.dag.meta.placement
        added: list[tuple[str, str]] = []
        blocks: list[tuple[str, ...]] = []
        try:
            for rank, groups in chains.items():
                resolved = []
                for group in groups:
                    keys, overlap = self._group(_directive, group)
                    if rank is not None:
                        stray = [k for k in keys if placement[self.dag.nodes[k].region] != rank]
                        if stray:
                            raise DirectiveError(_directive, repr(group), f"node {stray[0]} is not on pipeline rank {rank}",
                                                 "order each rank's own nodes only")
                    if overlap:
                        added += order_pass.overlap_block(self.dag, keys)
                        blocks.append(tuple(keys))
                    resolved.append(keys)
                added += order_pass.chain(self.dag, resolved)
            if not self.dag.is_acyclic():
                self.dag.topological_order()  # raises CycleError naming a cycle
        except CycleError as exc:
            order_pass.roll_back(self.dag, added)
            shown = {r: list(g)[:3] for r, g in chains.items()}
            raise DirectiveError(_directive, repr(shown)[:200], f"the order creates a {exc}",
                                 "order nodes consistently with their data dependencies") from None
        except DirectiveError:
            order_pass.roll_back(self.dag, added)
            raise
        self.dag.meta.overlaps += tuple(blocks)
        chains_json = {("*" if r is None else str(r)): [g if isinstance(g, (str, dict)) else list(g) for g in gs]
                       for r, gs in chains.items()}
        # Only temporal edges were added and the cycle check above covers them; validate's
        # other rules concern nodes and data edges, which held after the previous directive.
        self.trace.append({"directive": _directive, "chains": chains_json})
        return self

    def stream(self, nodes: str, name: str) -> "Schedule":
        """Put the selected nodes on logical stream ``name``.

        A SEND and its RECV always share a stream (their communicator belongs to it), so
        selecting one moves its peer too.
        """
        if not isinstance(name, str) or not name or ":" in name and not name.startswith("p2p:"):
            raise DirectiveError("stream", repr(nodes), f"stream name {name!r} is invalid",
                                 "use a plain name such as 'dp_comm'")
        keys = self.nodes(nodes, "stream")
        if not keys:
            raise DirectiveError("stream", repr(nodes), "the filter matches no node")
        for k in keys:
            node = self.dag.nodes[k]
            node.stream = name
            if node.peer is not None:
                self.dag.nodes[node.peer].stream = name
        self._record("stream", nodes=nodes, name=name)
        return self

    # -- trace ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"grid": self.grid.to_json(), "model": model_fingerprint(self.program), "directives": self.trace}

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, program: Program, data: Mapping[str, Any] | str) -> "Schedule":
        if isinstance(data, str):
            data = json.loads(data)
        recorded, here = data.get("model"), model_fingerprint(program)
        if recorded is not None and recorded != here:  # traces written before fingerprints replay as they are
            raise DirectiveError("trace", f"model {recorded}", f"recorded on another model than this one ({here}: "
                                 f"other regions or parameters)", "record the trace on this model with "
                                 "Schedule.dumps(), or use a recipe (.py) that selects by tags")
        sch = cls(program, **data["grid"])
        for step in data["directives"]:
            args = dict(step)
            name = args.pop("directive")
            if name == "place":
                sch.place(args["regions"], rank=args["rank"])
            elif name == "shard":
                sch.shard(args["regions"], degree=args["degree"])
            elif name == "replicate":
                sch.replicate(args["regions"], zero=args["zero"], bucket_bytes=args["bucket_bytes"],
                              blocks=args.get("blocks", True))
            elif name == "split":
                sch.split(args["microbatches"], split_backward=args["split_backward"])
            elif name in ("order", "order_per_rank"):
                chains = {(None if r == "*" else int(r)): gs for r, gs in args["chains"].items()}
                sch.order_per_rank(chains, _directive=name)
            elif name == "stream":
                sch.stream(args["nodes"], args["name"])
            else:
                raise DirectiveError(name, "", "unknown directive in trace",
                                     "use place, shard, replicate, split, order, order_per_rank, stream")
        return sch
