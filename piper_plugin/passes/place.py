"""place: put tagged regions on pipeline ranks; closing placement inserts SEND/RECV.

Invariants: every region is placed exactly once; after ``close_placement`` every data edge
between nodes on different pipeline ranks runs through a SEND on the producer's ranks and a
RECV on the consumer's ranks, on the stream of that direction (``p2p:<src>><dst>``); tied
parameters spanning ranks get one gradient all-reduce over their copies.
"""
from __future__ import annotations

from piper_plugin.ir.graph import DAG
from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.ir.rank_grid import RankGrid

__all__ = ["place", "close_placement", "p2p_stream"]


def p2p_stream(src_rank: int, dst_rank: int) -> str:
    return f"p2p:{src_rank}>{dst_rank}"


def place(dag: DAG, grid: RankGrid, regions: list[str], rank: int) -> None:
    placement = dag.meta.placement
    devices = grid.slice(rank)
    for name in regions:
        placement[name] = rank
        for node in dag.nodes.values():
            if node.region == name:
                node.devices = devices


def _update_params(dag: DAG, placement: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """A parameter is updated by the first region reading it on each pipeline rank."""
    seen: dict[int, set[str]] = {}
    out: dict[str, tuple[str, ...]] = {}
    for region in sorted(dag.regions.values(), key=lambda r: r.index):
        owned = seen.setdefault(placement[region.name], set())
        out[region.name] = tuple(p for p in region.params if p not in owned)
        owned.update(region.params)
    return out


def close_placement(dag: DAG, grid: RankGrid, tied: dict[str, tuple[str, ...]]) -> None:
    placement = dag.meta.placement
    dag.meta.update_params = update = _update_params(dag, placement)
    for name, params in update.items():
        if not params and f"{name}UPDATE" in dag:
            dag.remove(f"{name}UPDATE")
    for src in list(dag.nodes):
        node = dag.nodes[src]
        if node.kind not in (Kind.F, Kind.B):
            continue
        for dst, values in list(dag.data_succ[src].items()):
            other = dag.nodes[dst]
            if other.kind != node.kind or other.region == node.region:
                continue
            a, b = placement[node.region], placement[other.region]
            if a != b:
                _insert_p2p(dag, grid, node, other, a, b, dag.remove_data(src, dst))
    _insert_ties(dag, grid, tied, placement)


def _insert_p2p(dag: DAG, grid: RankGrid, src: Node, dst: Node, a: int, b: int, values) -> None:
    phase = src.kind.value
    region_bytes = dag.regions[src.region].value_bytes | dag.regions[dst.region].value_bytes
    nbytes = sum(region_bytes.get(v.removeprefix("grad:"), 0) for v in values)
    send = Node(Kind.SEND, src.region, src.stage, qual=f"{phase}>{dst.region}", devices=grid.slice(a),
                stream=p2p_stream(a, b), tags=src.tags, bytes=nbytes, phase=phase)
    recv = Node(Kind.RECV, dst.region, dst.stage, qual=f"{phase}<{src.region}", devices=grid.slice(b),
                stream=p2p_stream(a, b), tags=dst.tags, bytes=nbytes, phase=phase)
    send.peer, recv.peer = recv.key, send.key
    dag.add(send)
    dag.add(recv)
    dag.add_data(src.key, send.key, values)
    dag.add_data(send.key, recv.key, values)
    dag.add_data(recv.key, dst.key, values)


def _insert_ties(dag: DAG, grid: RankGrid, tied: dict[str, tuple[str, ...]], placement) -> None:
    """One SUM all-reduce per tied parameter whose readers sit on different pipeline ranks."""
    ties = {}
    for i, (param, readers) in enumerate(sorted(tied.items())):
        ranks = sorted({placement[r] for r in readers})
        if len(ranks) < 2:
            continue
        owner = dag.regions[readers[0]]
        devices = tuple(r for pp in ranks for r in grid.slice(pp))
        nbytes = _param_bytes(dag, param)
        node = dag.add(Node(Kind.ALL_REDUCE, owner.name, owner.stage, qual=f"tie{i}", devices=devices,
                            stream="dp", tags=owner.tags, bytes=nbytes, phase="step", axis="pp"))
        ties[node.key] = param
        for reader in readers:
            dag.add_data(f"{reader}B", node.key, ("tie:" + param,))
            if f"{reader}UPDATE" in dag:
                dag.add_data(node.key, f"{reader}UPDATE", ("tie:" + param,))
    dag.meta.ties = ties


def _param_bytes(dag: DAG, param: str) -> int:
    return dag.meta.param_bytes.get(param, 0)
