"""The ALL_TO_ALL nodes of a routed expert region on two gloo ranks: uneven, data-dependent
splits, a member that gets no rows from a peer (an expert no token chose), and each backward
sending the rows' gradients back along the reverse splits of its own microbatch."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from forkserver_ranks import run_ranks
from piper_plugin.runtime.token_exchange import TokenExchanges

# rows each rank sends per expert (4 experts, 2 per member): rank 0 sends none to member 1's
# first expert, rank 1 none to member 0 at all
COUNTS = {0: [2, 0, 0, 1], 1: [0, 0, 3, 1]}


class _State:
    """What TokenExchanges reads of a rank's state: one node's inbox, the region, delivery."""

    def __init__(self, box):
        self.dag = SimpleNamespace(regions={"e": SimpleNamespace(inputs=("x", "xc"), outputs=("y", "yc"))})
        self.box, self.delivered, self.device = box, {}, torch.device("cpu")

    def take(self, key):
        box, self.box = self.box, {}
        return box

    def deliver(self, key, values):
        self.delivered = values

    def finished(self, key):
        pass


def _node(qual: str, mb: int = 0):
    return SimpleNamespace(region="e", phase=qual[0], qual=qual, microbatch=mb, key=f"e@{qual}")


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        exchanges, group = TokenExchanges(), dist.group.WORLD
        counts = torch.tensor(COUNTS[rank])
        rows = torch.arange(int(counts.sum()) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
        for mb in (0, 1):  # two microbatches in flight: each backward uses its own splits
            state = _State({"x": rows + mb, "xc": counts})
            exchanges.run(state, _node("F.in", mb), (0, 1), group)
            got = state.delivered
            state = _State({"grad:x": got["x"] * 10})
            exchanges.run(state, _node("B.in", mb), (0, 1), group)
            back = state.delivered["grad:x"]
            report = {"got": got["x"].tolist(), "counts": got["xc"].tolist(), "back": back.tolist(),
                      "want_back": ((rows + mb) * 10).tolist()}
        # a combine whose receiver has no gradient for its rows: zeros go back
        state = _State({"y": torch.ones(int(counts.sum()), 2), "yc": torch.tensor([1, counts.sum().item() - 1])})
        exchanges.run(state, _node("F.out", 2), (0, 1), group)
        state = _State({})
        exchanges.run(state, _node("B.out", 2), (0, 1), group)
        grad = state.delivered["grad:y"]
        report["zeros_back"] = grad.abs().sum().item() == 0 and grad.shape[0] == counts.sum().item()
        out.put((rank, report))
    finally:
        dist.destroy_process_group()


def test_routed_rows_go_to_their_experts_and_their_gradients_come_back():
    reports = run_ranks(_rank, 2)
    r0, r1 = reports[0], reports[1]
    # member 0 gets rank 0's first 2 rows and nothing from rank 1; member 1 gets the rest
    assert r0["counts"] == [2, 0, 0, 0] and r1["counts"] == [0, 1, 3, 1]
    assert r0["got"] == [[1.0, 2.0], [3.0, 4.0]]
    assert r1["got"] == [[5.0, 6.0], [101.0, 102.0], [103.0, 104.0], [105.0, 106.0], [107.0, 108.0]]
    for report in (r0, r1):
        assert report["back"] == report["want_back"] and report["zeros_back"]
