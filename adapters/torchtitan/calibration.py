"""``piper calibrate --host torchtitan -- <torchtitan.train flags>``: the calibration jobs as
TorchTitan runs of the user's config (:mod:`piper_plugin.calibrate_host`'s host contract).

A job is the user's command with ``--parallelism.pipeline_engine=piper``, a recipe of a stage
layout (one stage per rank: 1F1B and ZB-H1, whose split backward measures BI and BW; two:
interleaved 1F1B and DualPipeV), ``--parallelism.pipeline_parallel_microbatch_size`` giving the
microbatch count, ``--training.steps`` and ``--piper.trace`` set (and, for the layout the config
does not have, ``--parallelism.pipeline_parallel_schedule``); every other flag is the user's. A user flag the jobs set themselves is refused, naming it.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from typing import Sequence

from piper_plugin import UsageError

from piper_plugin.adapters.torchtitan.ray_launch import flag_value, titan_argv

__all__ = ["program", "calibration_layouts", "job_argv", "tunable_zero", "SET_BY_CALIBRATION"]

program = "torchtitan.train"
SET_BY_CALIBRATION = ("--piper.recipe", "--parallelism.pipeline_parallel_microbatch_size", "--training.steps",
                      "--piper.trace", "--piper.trace_memory", "--dump_folder")
_SINGLE = ("1f1b", "zb-h1")  # one stage per pipeline rank
_MULTI = ("interleaved-1f1b", "dualpipev")  # two per rank
_SCHEDULE_OF_LAYOUT = {1: "1F1B", 2: "Interleaved1F1B"}  # TorchTitan's schedule giving that many stages per rank


def _spellings(flag: str) -> tuple[str, ...]:
    return (flag, flag.replace("_", "-"))


def _checked(argv: Sequence[str]) -> list[str]:
    """torchtitan.train's argv for the user's flags (``--module`` added), refusing the ones the
    jobs set and an engine other than Piper's."""
    args = titan_argv(["--", *argv])
    for flag in SET_BY_CALIBRATION:
        for spelling in _spellings(flag):
            if any(a == spelling or a.startswith(spelling + "=") for a in args):
                raise UsageError(f"{spelling}: piper calibrate sets it for each of its jobs; leave it out")
    engine = flag_value(args, *_spellings("--parallelism.pipeline_engine"))
    if engine not in (None, "piper"):
        raise UsageError(f"--parallelism.pipeline_engine {engine}: the calibration measures Piper's engine; leave "
                         f"the flag out")
    return args


def _config(args: list[str]):
    """TorchTitan's config for ``args``, its parse-time notes (printed per rank when it trains) kept quiet."""
    from torchtitan.config import ConfigManager

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ConfigManager().parse_args(args)


def _layouts(config) -> list[int]:
    """Stages per rank the jobs run: the config's own, then the other (one or two) unless the
    config fixes its stages (``pipeline_parallel_layers_per_stage``, ``module_fqns_per_model_part``)."""
    from piper_plugin.adapters.torchtitan.pipelining import recipe_for

    own = 2 if recipe_for(config.parallelism.pipeline_parallel_schedule) in _MULTI else 1
    parallelism = config.parallelism
    if parallelism.pipeline_parallel_layers_per_stage or parallelism.module_fqns_per_model_part:
        return [own]
    return [own, 3 - own]


def _without(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` (either spelling, ``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in _spellings(flag):
            skip = True
        elif not a.startswith(tuple(s + "=" for s in _spellings(flag))):
            out.append(a)
    return out


def _shard_degree(parallelism, nproc: int) -> int:
    """The data-parallel shard degree the flags give on ``nproc`` ranks (-1: the ranks left)."""
    degree = parallelism.data_parallel_shard_degree
    if degree != -1:
        return degree
    others = (parallelism.pipeline_parallel_degree * parallelism.data_parallel_replicate_degree
              * parallelism.tensor_parallel_degree * parallelism.context_parallel_degree)
    return max(nproc // max(others, 1), 1)


def tunable_zero(argv: Sequence[str], nproc: int) -> tuple[int, ...]:
    """The ZeRO levels ``piper tune`` may pick for these flags: with a data-parallel shard axis,
    every level the engine accepts beside them (expert parallelism: 1 and 2; parameters in
    bf16: 1 to 3); without one, 0."""
    config = _config(_checked(argv))
    parallelism = config.parallelism
    if _shard_degree(parallelism, nproc) < 2:
        return (0,)
    if parallelism.expert_parallel_degree > 1:
        return (1, 2)
    if config.training.mixed_precision_param != "float32":
        return (1, 2, 3)
    return (0, 1, 2, 3)


def calibration_layouts(argv: Sequence[str], nproc: int) -> tuple[int, list[tuple[int, str, str | None]]]:
    """(local batch, layouts): the config's own stage layout with its two recipes (the second
    splits the backward), then the other where the config leaves the stages to the schedule."""
    config = _config(_checked(argv))
    layouts = [(chunks, *(_MULTI if chunks == 2 else _SINGLE)) for chunks in _layouts(config)]
    return config.training.local_batch_size, layouts


def job_argv(argv: Sequence[str], nproc: int, *, recipe: str, microbatches: int, chunks: int,
             steps: int | None = None, trace: str | None = None, zero: int | None = None) -> list[str]:
    """torchtitan.train's arguments for one calibration job: the calibration's flags first (a
    tyro subcommand among the user's flags scopes what follows it), then the user's; a layout
    other than the config's sets TorchTitan's schedule to one with that many stages per rank.
    Without ``steps`` and ``trace``: the command that runs ``recipe`` (a tuned plan's file) so;
    ``zero``: Piper's ZeRO level for it (one of :func:`tunable_zero`'s), replacing the user's."""
    args = _checked(argv)
    config = _config(args)
    if zero is not None and _shard_degree(config.parallelism, nproc) > 1:
        args = _without(args, "--piper.zero")
    else:
        zero = None
    module, rest = args[:2], args[2:]  # titan_argv puts --module first
    mine = ["--parallelism.pipeline_engine=piper", "--piper.recipe", recipe,
            "--parallelism.pipeline_parallel_microbatch_size", str(config.training.local_batch_size // microbatches)]
    mine += ["--piper.zero", str(zero)] if zero is not None else []
    mine += ["--training.steps", str(steps)] if steps is not None else []
    mine += ["--piper.trace", trace, "--piper.trace_memory", "--dump_folder", f"{trace}_dump"] if trace is not None else []
    if chunks != _layouts(config)[0]:
        mine += ["--parallelism.pipeline_parallel_schedule", _SCHEDULE_OF_LAYOUT[chunks]]
    if module[0] != "--module":
        return [*mine, *args]
    return [*module, *mine, *rest]
