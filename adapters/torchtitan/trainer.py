"""``--parallelism.pipeline_engine {torch,piper,alternate}`` for TorchTitan, without forking it.

``PiperParallelismConfig`` adds the flag to TorchTitan's ``ParallelismConfig``; ``PiperTrainer``
is TorchTitan's ``Trainer`` with a nested ``Config`` that uses it (the pattern of TorchTitan's own
experiments) plus ``--piper.*`` options. With ``pipeline_engine=piper`` the model spec's
``pipelining_fn`` is swapped for Piper's (:mod:`.pipelining`); everything else of TorchTitan
(data loader, tokenizer, optimizer, LR scheduler, grad clipping, checkpointing, metrics) stays.
On a machine without an accelerator the trainer runs on the CPU with gloo (:mod:`.cpu`).
TorchTitan's start-up lines that are false here are said once and true (:mod:`.titan_log`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
from torchtitan.config import ParallelismConfig
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from piper_plugin.adapters.torchtitan import cpu, resident, titan_log
from piper_plugin.adapters.torchtitan.dump_state import dump_state
from piper_plugin.adapters.torchtitan.flags import one_line_errors
from piper_plugin.adapters.torchtitan.tensor_parallel import check_tensor_parallel_config, check_world_size

__all__ = ["PiperParallelismConfig", "PiperOptions", "PiperTrainer", "to_piper_config"]


@dataclass(kw_only=True, slots=True)
class PiperParallelismConfig(ParallelismConfig):
    pipeline_engine: Literal["torch", "piper", "alternate"] = "torch"
    """Which engine runs the pipeline: TorchTitan's own (torch.distributed.pipelining) or Piper;
    ``alternate`` runs both on the same stages, steps torch, piper, piper, torch, ... (A/B)."""


@dataclass(kw_only=True, slots=True)
class PiperOptions:
    recipe: str | None = None
    """Piper recipe overriding the one derived from pipeline_parallel_schedule: anything
    ``piper_plugin.recipes.load`` takes: a recipe name (gpipe, 1f1b, interleaved-1f1b, zb-h1,
    dualpipev), a .py file defining ``recipe(sch, *, microbatches, chunks, zero)``, or a JSON
    trace written by ``Schedule.dumps()``."""

    timeout_s: float = 300.0
    """A pipeline step that makes no progress for this long fails with the waiting task named."""

    zero: int | None = None
    """Piper's ZeRO level (0-3) over --parallelism.data_parallel_shard_degree; unset: from
    --parallelism.fsdp_reshard_after_forward (never: 2; default, always: 3)."""

    bucket_mb: float = 32.0
    """Size of Piper's ZeRO / gradient-reduction buckets in MiB under a built-in recipe: each is
    gathered, laid out and reduced on its own, so the transient copies stay one bucket."""

    trace: str | None = None
    """Directory where every process writes, after each step, the measured timeline of its latest
    step and the wall time of every step so far (``rank<process rank>.json``; process rank 0 also
    writes the plan, ``plan.pkl``): :class:`piper_plugin.StepTrace`'s layout, what ``piper
    calibrate --host torchtitan`` reads."""

    trace_memory: bool = False
    """With --piper.trace: also count saved activations on the runtime's memory meter and record
    each step's peak transient memory and the meter's windows (what ``piper calibrate --host``
    fits region memory from; hooks on saved tensors, replayed once two steps agree)."""

    profile: str | None = None
    """A cost profile (``piper calibrate``, best ``--host torchtitan`` on this config): the log
    then states the plan's step time and bubble as the profile predicts them."""

    memory_split: bool = False
    """Log, after every step, the parameters, gradients and optimizer state each rank keeps
    (bytes of its live tensors), and once its RSS at start-up: with the ``memory:`` figure, the
    split of a step's peak (either engine; :mod:`.resident`)."""

    dump_state: str | None = None
    """Directory where every process writes, after each of ``dump_steps``, its parameters and
    gradients as whole tensors by name (``step<N>_rank<R>.pt``; either engine;
    :mod:`.dump_state`): for comparing engines parameter by parameter."""

    dump_steps: list[int] = field(default_factory=list)
    """The steps after which ``dump_state`` writes (empty: every step; each costs a gather of
    every parameter and a file per process)."""


class PiperTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        parallelism: PiperParallelismConfig = field(default_factory=PiperParallelismConfig)
        piper: PiperOptions = field(default_factory=PiperOptions)

    def __init__(self, config: "PiperTrainer.Config"):
        startup_rss = resident.current_rss_bytes()
        on_cpu = cpu.on_cpu()
        self._log_filter = titan_log.install(cpu=on_cpu)
        if on_cpu:
            with one_line_errors():
                cpu.refuse_cuda_only_flags(config)
            cpu.use_cpu_device()  # before Trainer.__init__: it calls set_device first thing
        engine = config.parallelism.pipeline_engine
        if engine in ("piper", "alternate"):
            with one_line_errors():
                check_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
                check_tensor_parallel_config(config)
        if engine in ("piper", "alternate") and config.model_spec is not None:
            from piper_plugin.adapters.torchtitan.pipelining import make_pipelining_fn

            config.model_spec = dataclasses.replace(
                config.model_spec, pipelining_fn=make_pipelining_fn(config.piper, alternate=engine == "alternate"))
            if engine == "piper" and config.parallelism.expert_parallel_degree > 1:
                from piper_plugin.adapters.torchtitan.expert_dispatch import OVERRIDE

                if OVERRIDE not in config.override.imports:  # expert all-to-alls as the plan's nodes
                    config.override.imports.append(OVERRIDE)
        super().__init__(config)
        titan_log.say_loss_rank(self)
        if on_cpu:
            titan_log.skip_mfu(self)
            cpu.sum_reductions_on_gloo(self.model_parts)
        self._startup_rss = startup_rss

    def train_step(self, data_iterator):
        options = self.config.piper
        split = options.memory_split
        if split:  # what the process holds besides tensors as the step begins
            kept = resident.resident_bytes(self.model_parts, self.optimizers)
            others = resident.current_rss_bytes() - sum(kept.values())
        super().train_step(data_iterator)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if options.dump_state and (not options.dump_steps or self.step in options.dump_steps):
            dump_state(self.model_parts, options.dump_state, self.step, rank)
        if split:
            held = resident.resident_bytes(self.model_parts, self.optimizers)
            logger.info(resident.split_line(rank, self.step, held, self._startup_rss, cpu.last_peak_rss, others))

    def init_distributed(self):
        dims = super().init_distributed()
        self._log_filter.fsdp_degree_1 = not (dims.fsdp_enabled or dims.dp_replicate_enabled)
        return dims


def to_piper_config(base: Trainer.Config) -> PiperTrainer.Config:
    """A stock ``Trainer.Config`` as a ``PiperTrainer.Config`` (same values, engine "torch")."""
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    par = base.parallelism
    values["parallelism"] = PiperParallelismConfig(
        **{f.name: getattr(par, f.name) for f in dataclasses.fields(par) if f.init})
    values.pop("piper", None)
    config = PiperTrainer.Config(**values)
    if cpu.on_cpu():
        cpu.apply_cpu_fixes(config)
    return config
