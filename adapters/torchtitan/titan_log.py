"""TorchTitan start-up log lines that are false under this adapter, said once and true.

:class:`TitanLogFilter` sits on the root logger (TorchTitan logs there; its ``init_logger``
clears handlers, not filters). Each rule rewrites the first matching record and drops repeats:

* "Pipeline Parallel loss is not visible. Please add rank R to LOG_RANK": dropped when LOG_RANK
  is unset (every rank's log is shown, that rank's too); :func:`say_loss_rank` then has the
  rank holding the last pipeline stage say that it prints the loss;
* "Applied FSDP to the model" where the FSDP degree is 1 (pipeline-only runs), or where Piper's
  ZeRO withheld FSDP (:func:`say_fsdp_withheld`): said as what it is;
* on CPU, "Error running lspci", "Peak flops undefined for: cpu, fallback to A100" (logged twice)
  and "Peak FLOPS used for computing MFU: 3.120e+14": one line "CPU: peak FLOPs unknown, MFU not
  reported" (:func:`skip_mfu` makes that true).
"""
from __future__ import annotations

import logging
import os

__all__ = ["TitanLogFilter", "install", "say_loss_rank", "skip_mfu", "say_fsdp_withheld"]

_PP_LOSS = "Pipeline Parallel loss is not visible"
_FSDP = "Applied FSDP to the model"
_CPU_FLOPS = ("Error running lspci", "Peak flops undefined", "Peak FLOPS used for computing MFU")
_CPU_FLOPS_TRUE = "CPU: peak FLOPs unknown, MFU not reported"
_FSDP_TRUE = "Applied FSDP to the model at degree 1: no parameter is sharded or all-gathered (data parallelism off)"


class TitanLogFilter(logging.Filter):
    """Rewrites or drops TorchTitan's misleading start-up records (see the module docstring)."""

    def __init__(self, *, cpu: bool) -> None:
        super().__init__()
        self.cpu = cpu
        self.fsdp_degree_1 = False  # set once TorchTitan's parallel dims are known
        self.fsdp_withheld: str | None = None  # what shards the parameters instead, under Piper's ZeRO
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _PP_LOSS in message:
            return bool(os.environ.get("LOG_RANK"))  # a LOG_RANK that hides the loss rank: TorchTitan is right
        if self.fsdp_withheld and message == _FSDP:
            return self._once(record, self.fsdp_withheld)
        if self.fsdp_degree_1 and message == _FSDP:
            return self._once(record, _FSDP_TRUE)
        if self.cpu and message.startswith(_CPU_FLOPS):
            return self._once(record, _CPU_FLOPS_TRUE)
        return True

    def _once(self, record: logging.LogRecord, text: str) -> bool:
        if text in self._said:
            return False
        self._said.add(text)
        record.msg, record.args, record.levelno, record.levelname = text, (), logging.INFO, "INFO"
        return True


def install(*, cpu: bool) -> TitanLogFilter:
    """The root logger's filter (one per process: a second trainer reuses it)."""
    root = logging.getLogger()
    for existing in root.filters:
        if isinstance(existing, TitanLogFilter):
            existing.cpu = cpu
            return existing
    log_filter = TitanLogFilter(cpu=cpu)
    root.addFilter(log_filter)
    return log_filter


def say_fsdp_withheld(text: str) -> None:
    """TorchTitan's "Applied FSDP to the model" is said as ``text`` (FSDP was withheld)."""
    for existing in logging.getLogger().filters:
        if isinstance(existing, TitanLogFilter):
            existing.fsdp_withheld = text


def say_loss_rank(trainer) -> None:
    """On the rank holding the last pipeline stage: one line saying it prints the loss."""
    dims = trainer.parallel_dims
    if dims.pp_enabled and trainer.pp_has_last_stage:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        logging.getLogger().info(f"Piper: rank {rank} prints the loss (it holds the last pipeline stage; "
                                 "ranks of other stages print loss -1)")


def skip_mfu(trainer) -> None:
    """No MFU on CPU: TorchTitan skips it where its peak-FLOPs figure does not apply."""
    trainer.metrics_processor.has_quantization = True  # its only use: mfu = None, printed "mfu: N/A"
