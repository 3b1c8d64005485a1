"""A plan whose ranks are tensor-parallel groups: what the runtime requires and how it groups.

- Compute on one logical stream per rank (the host's TP collectives inside the compute keep one
  order on every member): a recipe that moves compute nodes to a second stream is refused.
- Four forked gloo ranks running two TP copies of a 2-rank plan: each copy's communicators stay
  within its TP coordinate, and the replica group (gradients summed after a step) joins only
  copies of one coordinate.
"""
from __future__ import annotations

import pytest
import torch

from piper_plugin import PlanError, capture, compile_program
from piper_plugin.models import build_toy_lm, lm_batch, lm_loss
from piper_plugin.recipes import apply_recipe
from piper_plugin.runtime.executor import check_tensor_parallel_plan


def _plan(move_compute: bool):
    model, cfg = build_toy_lm(stages=2, layers=2)
    x, y = lm_batch(cfg, 8)
    program = capture(model, lm_loss, (x,), y)

    def schedule(prog):
        from piper_plugin import Schedule

        sch = Schedule(prog, pp=2)
        apply_recipe(sch, "1f1b", microbatches=2)
        if move_compute:
            sch.stream("kind=F", "second")
        return sch

    return compile_program(program, schedule).plan


def test_compute_on_two_streams_is_refused_under_tensor_parallelism():
    check_tensor_parallel_plan(_plan(move_compute=False))
    with pytest.raises(PlanError, match=r"rank 0 computes on streams compute, second.*under tensor parallelism"):
        check_tensor_parallel_plan(_plan(move_compute=True))


def _rank(rank: int, port: int, world: int, replicas, tp: int, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from piper_plugin.runtime.dist_comm import DistComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    plan = _plan(move_compute=False)
    plan_rank = next(r for copy in replicas for r, p in enumerate(copy) if p == rank)
    comm = DistComm(plan, plan_rank, {}, 30.0, replicas=[list(c) for c in replicas], tensor_parallel=tp)
    members = {name: dist.get_process_group_ranks(group) for name, group in comm.groups.items()}
    summed = dist.get_process_group_ranks(comm.replica_group) if comm.replica_group is not None else None
    dist.destroy_process_group()
    out.put((rank, {"coordinate": comm.tp_coordinate, "groups": sorted(map(sorted, members.values())),
                    "summed": summed}))


@pytest.mark.slow
def test_tp_copies_talk_within_their_coordinate_and_sum_only_with_their_own():
    from forkserver_ranks import run_ranks

    # 8 processes: pipeline 2 x data replicas 2 x TP 2, Megatron's order (tp fastest):
    # process = pp * 4 + replica * 2 + t; copies ordered (replica, t)
    replicas = [[r * 2 + t, 4 + r * 2 + t] for r in range(2) for t in range(2)]
    reports = run_ranks(_rank, 8, 8, replicas, 2, timeout_s=120)
    assert sorted(reports) == list(range(8))
    for process, report in reports.items():
        t = process % 2
        assert report["coordinate"] == t
        for group in report["groups"]:  # every communicator this process uses: one TP coordinate
            assert {p % 2 for p in group} == {t}, (process, report)
        assert report["summed"] is not None and {p % 2 for p in report["summed"]} == {t}
        assert len(report["summed"]) == 2  # its plan rank in both data replicas, nothing more
