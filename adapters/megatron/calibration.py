"""``piper calibrate --host megatron -- <pretrain_gpt arguments>``: the calibration jobs as runs of
the adapter's Megatron-style entry (:mod:`piper_plugin.calibrate_host`'s host contract).

A job is the user's arguments with ``--pipeline-engine=piper``, a recipe of the model's stage
layout (no virtual pipeline: 1F1B and ZB-H1, whose split backward measures BI and BW; a virtual
size of 2: interleaved 1F1B and DualPipeV; and, for a model
without one, interleaved 1F1B over a virtual pipeline of 2 where the layers allow), ``--micro-batch-size`` giving the microbatch count
per pipeline, ``--train-iters`` and ``--piper-trace`` set. A user argument the jobs set
themselves is refused, naming it.
"""
from __future__ import annotations

from typing import Sequence

from piper_plugin import UsageError

__all__ = ["program", "calibration_layouts", "job_argv", "tunable_zero", "SET_BY_CALIBRATION"]

program = "piper_plugin.adapters.megatron.pretrain_gpt"
SET_BY_CALIBRATION = ("--piper-recipe", "--micro-batch-size", "--train-iters", "--piper-trace", "--piper-trace-memory",
                      "--save", "--load")


def _checked(argv: Sequence[str], nproc: int):
    from piper_plugin.adapters.megatron.arguments import parse_args

    args = list(argv)
    for flag in SET_BY_CALIBRATION:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise UsageError(f"{flag}: piper calibrate sets it for each of its jobs (or runs without it); leave it out")
    if not any(a == "--global-batch-size" or a.startswith("--global-batch-size=") for a in args):
        raise UsageError("--global-batch-size is missing: the calibration splits it into microbatches of several "
                         "sizes; pass it")
    # the jobs set the microbatch size and iterations: any valid value checks the rest
    parsed = parse_args([*args, "--pipeline-engine", "piper", "--micro-batch-size", "1", "--train-iters", "1"], nproc)
    return args, parsed


def calibration_layouts(argv: Sequence[str], nproc: int) -> tuple[int, list[tuple[int, str, str | None]]]:
    """(batch per pipeline, layouts): the model's own layout with its two recipes (DualPipeV the
    split one of a virtual pipeline), then, without a virtual pipeline and where the layers split over twice
    the stages (and there are two at least), interleaved 1F1B over a virtual pipeline of 2."""
    _, parsed = _checked(argv, nproc)
    vpp = parsed.virtual_pipeline_model_parallel_size
    if vpp not in (None, 2):
        raise UsageError(f"--virtual-pipeline-model-parallel-size {vpp}: the calibration's recipes take 1 or 2 "
                         f"model chunks per rank; calibrate with 2 (or none)")
    if vpp is None:
        layouts = [(1, "1f1b", "zb-h1")]
        uneven = parsed.decoder_first_pipeline_num_layers or parsed.decoder_last_pipeline_num_layers
        pp = parsed.pipeline_model_parallel_size  # Megatron's virtual pipeline needs two stages at least
        if not uneven and pp > 1 and parsed.num_layers % (2 * pp) == 0:
            layouts.append((2, "interleaved-1f1b", None))
    else:  # without DualPipeV no split backward is measured (BI, BW: half of B)
        layouts = [(2, "interleaved-1f1b", "dualpipev")]
    return parsed.global_batch_size // parsed.data_parallel_size, layouts


def job_argv(argv: Sequence[str], nproc: int, *, recipe: str, microbatches: int, chunks: int,
             steps: int | None = None, trace: str | None = None, zero: int | None = None) -> list[str]:
    """pretrain_gpt's arguments for one calibration job (the user's, then the job's: the last
    wins); two chunks per rank where the model has one add a virtual pipeline of 2. Without
    ``steps`` and ``trace``: the arguments that run ``recipe`` (a tuned plan's file) so;
    ``zero``: Piper's ZeRO level for it (one of :func:`tunable_zero`'s; 0 keeps the arguments')."""
    args, parsed = _checked(argv, nproc)
    batch = parsed.global_batch_size // parsed.data_parallel_size
    virtual = (["--virtual-pipeline-model-parallel-size", "2"]
               if chunks == 2 and parsed.virtual_pipeline_model_parallel_size is None else [])
    return [*args, *virtual, "--pipeline-engine", "piper", "--piper-recipe", recipe, "--micro-batch-size",
            str(batch // microbatches), *(["--train-iters", str(steps)] if steps is not None else []),
            *(["--piper-trace", trace, "--piper-trace-memory"] if trace is not None else []),
            *(["--piper-zero", str(zero)] if zero else [])]


def tunable_zero(argv: Sequence[str], nproc: int) -> tuple[int, ...]:
    """The ZeRO levels ``piper tune`` may pick for these arguments: where Piper's plan spans the
    data-parallel ranks (the arguments say ``--piper-zero``), every level the entry runs; else
    the arguments' own (data parallelism, if any, stays Megatron's DDP, outside the plan)."""
    from piper_plugin.adapters.megatron.zero import LEVELS

    _, parsed = _checked(argv, nproc)
    return tuple(LEVELS) if parsed.piper_zero is not None else (0,)
