"""``piper launch --host megatron``: the :mod:`.pretrain_gpt` entry on Ray actors, one per rank.

Registered in the ``piper_plugin.hosts`` entry-point group (pyproject.toml): ``piper launch`` finds
``host_argv`` (Megatron-LM's arguments, checked before Ray starts) and ``rank_class``; the actors
and driver are the engine's (:func:`piper_plugin.launch_host`: torchrun's environment per actor,
output as ``(rank R) <line>``, the earliest failure named, silence bounded).
"""
from __future__ import annotations

from typing import Sequence

from piper_plugin import HostRank, UsageError

__all__ = ["MegatronRank", "host_argv", "rank_class", "EXAMPLE"]

EXAMPLE = ("piper launch --nproc 2 --host megatron -- --pipeline-model-parallel-size 2 --num-layers 4 "
           "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 16 "
           "--train-iters 20 --lr 1e-3 --pipeline-engine=piper")


def host_argv(args: Sequence[str], nproc: int) -> list[str]:
    """What followed ``--``, checked as the entry checks it for ``nproc`` ranks."""
    from piper_plugin.adapters.megatron.arguments import parse_args

    argv = list(args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    elif argv:
        raise UsageError(f"unexpected argument {argv[0]!r}: pretrain_gpt's arguments go after --, e.g. {EXAMPLE}")
    if not argv:
        raise UsageError(f"no pretrain_gpt arguments: put them after --, e.g. {EXAMPLE}")
    parse_args(argv, nproc)  # ArgumentError (a UsageError) names the argument and the fix
    return argv


class MegatronRank(HostRank):
    """One rank running ``pretrain_gpt`` (its exit status 2 for a refused argument)."""

    program = "piper_plugin.adapters.megatron.pretrain_gpt"

    def main(self, argv: list[str]) -> None:
        from piper_plugin.adapters.megatron.pretrain_gpt import main

        code = main(argv)
        if code:
            raise SystemExit(code)


rank_class = MegatronRank
