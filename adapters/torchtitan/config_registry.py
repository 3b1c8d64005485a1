"""Config functions for ``python -m torchtitan.train --module piper_plugin.adapters.torchtitan``.

Every stock TorchTitan config function is reachable here by its own name (``llama3_debugmodel``,
``deepseek_v3_debugmodel``, ...): it returns the stock config as a ``PiperTrainer.Config`` (so
``--parallelism.pipeline_engine`` and ``--piper.*`` parse), with the CPU fixes applied when there
is no accelerator. Drop-in configs set the pipeline for a quick start: ``<stock>_pp2_<schedule>``
(schedule gpipe, 1f1b, interleaved or dualpipev) for any stock config without tied embeddings,
and ``<stock>_pp2_dp2_zero<1|2|3>[_<schedule>]``: 4 ranks, 2 pipeline x 2 data-parallel with
Piper's ZeRO at that level (1F1B unless a schedule is named); ``<stock MoE>_pp2_ep2_<schedule>``:
4 ranks, 2 pipeline x 2 with the experts split over them (ZeRO-2 for the dense part);
``<stock>_pp2_tp2_<schedule>``: 4 ranks, 2 pipeline x 2 tensor-parallel (TorchTitan's TP inside
each stage, sequence parallel on).

Invariant: every public callable of this module is a config function (TorchTitan lists them
when ``--config`` names none); helpers are private, and importing this module imports no
TorchTitan (:mod:`.config_names` checks a name before any rank starts).
"""
from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Callable

from piper_plugin.adapters.torchtitan.config_names import drop_in as _parse_drop_in
from piper_plugin.adapters.torchtitan.config_names import ep_drop_in as _parse_ep_drop_in
from piper_plugin.adapters.torchtitan.config_names import tp_drop_in as _parse_tp_drop_in
from piper_plugin.adapters.torchtitan.config_names import MODELS as _MODELS
from piper_plugin.adapters.torchtitan.config_names import SCHEDULES
from piper_plugin.adapters.torchtitan.flags import FlagError, one_line_errors

if TYPE_CHECKING:
    from piper_plugin.adapters.torchtitan.trainer import PiperTrainer

__all__ = ["SCHEDULES", "llama3_debugmodel_pp2_1f1b", "llama3_debugmodel_pp2_interleaved",
           "llama3_debugmodel_pp2_gpipe", "llama3_debugmodel_pp2_dualpipev", "deepseek_v3_debugmodel_pp2_1f1b",
           "llama3_debugmodel_pp2_dp2_zero1", "llama3_debugmodel_pp2_dp2_zero2", "llama3_debugmodel_pp2_dp2_zero3"]


def _to_piper_config(stock_config: object) -> "PiperTrainer.Config":
    from piper_plugin.adapters.torchtitan.trainer import to_piper_config

    return to_piper_config(stock_config)


def _llama3_widemodel() -> object:
    """TorchTitan's ``llama3_debugmodel`` made parameter-heavy: dim 1024, 16 layers, 16 heads
    (205M parameters; the debug tokenizer's 2048 tokens). With short sequences the model state,
    not the activations, fills a rank: the regime where ZeRO-3's re-sharding matters."""
    import dataclasses

    from torchtitan.models import llama3

    config = _stock_config_fn("llama3_debugmodel")()
    spec, dim, heads = config.model_spec, 1024, 16
    base = spec.model
    layers = llama3._build_llama3_layers(  # TorchTitan's own builder of its llama3 flavors
        n_layers=16, dim=dim, n_heads=heads, hidden_dim=llama3.compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=dataclasses.replace(base.layers[0].attention.rope, dim=dim // heads), attn_backend="flex")
    model = dataclasses.replace(
        base, dim=dim, layers=layers, tok_embeddings=dataclasses.replace(base.tok_embeddings, embedding_dim=dim),
        norm=dataclasses.replace(base.norm, normalized_shape=dim),
        lm_head=dataclasses.replace(base.lm_head, in_features=dim))
    config.model_spec = dataclasses.replace(spec, flavor="widemodel", model=model)
    return config


def _deepseek_v3_debugmodel_ce_loss() -> object:
    """TorchTitan's ``deepseek_v3_debugmodel`` with plain cross-entropy instead of its chunked loss
    (as TorchTitan's own ``llama3_debugmodel_ce_loss``): under a split backward (DualPipeV,
    ZBVZeroBubble) TorchTitan's engine drops the chunked loss's ``norm.weight`` gradient of the
    microbatches whose last-stage backward is split (docs/torchtitan.md), so parity against it
    needs this loss."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size

    config = _stock_config_fn("deepseek_v3_debugmodel")()
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


_BASES = {"llama3_widemodel": _llama3_widemodel, "deepseek_v3_debugmodel_ce_loss": _deepseek_v3_debugmodel_ce_loss}


def _stock_config_fn(name: str) -> Callable[[], object]:
    """The stock TorchTitan config function ``name`` (searched in every model's config_registry),
    or one of Piper's base configs (:data:`config_names.BASES`)."""
    if name in _BASES:
        return _BASES[name]
    likely = [m for m in _MODELS if name.startswith(m.split("_")[0])]  # qwen35_* lives in qwen3_5
    failed: dict[str, str] = {}
    for model in likely + [m for m in _MODELS if m not in likely]:
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except Exception as exc:  # noqa: BLE001 - a model package that cannot import here
            failed[model] = f"{type(exc).__name__}: {exc}"
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    why = "".join(f"; torchtitan.models.{m} does not import here ({failed[m]})" for m in likely if m in failed)
    raise AttributeError(f"no TorchTitan config function named {name!r} (searched the config_registry "
                         f"of {', '.join(_MODELS)}){why}")


_LOW_PRECISION = re.compile(r"_(?:float8|mx|nvfp4)")  # TorchTitan's low-precision config suffixes


def _build(name: str) -> object:
    """The stock config ``name`` built; a low-precision config that cannot be built on this machine
    (float8's converter without torchao, or on a CPU) ends the rank in one ``piper: error:`` line."""
    with one_line_errors():
        try:
            return _stock_config_fn(name)()
        except (ImportError, ValueError) as exc:
            plain = _LOW_PRECISION.split(name)[0]
            if isinstance(exc, ValueError) and plain == name:
                raise
            gpu = (f" (float8 / MX / NVFP4 training needs torchao and a CUDA GPU of its generation; on CPU use the "
                   f"config without the converter, e.g. {plain}, or TorchTitan's emulated float8, "
                   f"llama3_debugmodel_float8_emulate_lora)" if plain != name else "")
            raise FlagError(f"TorchTitan's config {name} cannot be built here: {exc}{gpu}") from None


def _wrap(name: str) -> Callable[[], PiperTrainer.Config]:
    _stock_config_fn(name)  # fail now, naming a missing stock config

    def config_fn() -> PiperTrainer.Config:
        return _to_piper_config(_build(name))

    config_fn.__name__ = config_fn.__qualname__ = name
    config_fn.__doc__ = f"TorchTitan's {name}, runnable with --parallelism.pipeline_engine piper."
    return config_fn


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    parsed, expert, tensor = _parse_drop_in(name), _parse_ep_drop_in(name), _parse_tp_drop_in(name)
    fn = (_drop_in(name, *parsed) if parsed else _ep_drop_in(name, *expert) if expert
          else _tp_drop_in(name, *tensor) if tensor else _wrap(name))
    globals()[name] = fn
    return fn


def _drop_in(name: str, base: str, schedule: str, zero: int | None = None) -> Callable[[], PiperTrainer.Config]:
    _stock_config_fn(base)  # fail now, naming the missing stock config

    def config_fn() -> PiperTrainer.Config:
        return _pp2(base, SCHEDULES[schedule], zero=zero)

    config_fn.__name__ = config_fn.__qualname__ = name
    sharded = f" x 2 data-parallel ranks with ZeRO-{zero}" if zero else ""
    config_fn.__doc__ = f"TorchTitan's {base}, 2 pipeline ranks{sharded}, {SCHEDULES[schedule]} run by Piper."
    return config_fn


def _ep_drop_in(name: str, base: str, schedule: str) -> Callable[[], PiperTrainer.Config]:
    return _degree_drop_in(name, base, schedule, "expert_parallel_degree", zero=2, doc=(
        f"TorchTitan's {base}, 2 pipeline x 2 ranks with the experts split over them (and ZeRO-2 for the rest), "
        f"{SCHEDULES[schedule]} run by Piper."))


def _tp_drop_in(name: str, base: str, schedule: str) -> Callable[[], PiperTrainer.Config]:
    return _degree_drop_in(name, base, schedule, "tensor_parallel_degree", zero=None, doc=(
        f"TorchTitan's {base}, 2 pipeline x 2 tensor-parallel ranks (TorchTitan's TP and sequence parallelism "
        f"inside each stage), {SCHEDULES[schedule]} run by Piper."))


def _degree_drop_in(name: str, base: str, schedule: str, degree: str, *, zero: int | None,
                    doc: str) -> Callable[[], PiperTrainer.Config]:
    """A 4-rank drop-in: 2 pipeline ranks x 2 along ``parallelism.<degree>``, seq 64."""
    _stock_config_fn(base)  # fail now, naming the missing stock config

    def config_fn() -> PiperTrainer.Config:
        config = _pp2(base, SCHEDULES[schedule], zero=zero, seq_len=64)
        setattr(config.parallelism, degree, 2)
        return config

    config_fn.__name__ = config_fn.__qualname__ = name
    config_fn.__doc__ = doc
    return config_fn


def _pp2(base: str, schedule: str, engine: str = "piper", zero: int | None = None, **training) -> PiperTrainer.Config:
    config = _to_piper_config(_build(base))
    if getattr(config.model_spec.model, "enable_weight_tying", False):
        raise ValueError(f"{base} ties tok_embeddings and lm_head (enable_weight_tying), which TorchTitan rejects "
                         f"under pipeline parallelism for either engine; use an untied config (e.g. the model's "
                         f"MoE debug config) or run it with --parallelism.pipeline_parallel_degree 1")
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = schedule
    config.parallelism.pipeline_engine = engine
    config.training.seq_len = training.get("seq_len", 256)
    config.training.local_batch_size = training.get("local_batch_size", 4)
    config.training.steps = training.get("steps", 10)
    config.checkpoint.enable = False
    config.validator.enable = False
    config.activation_checkpoint = None  # no AC: the CPU is compute-bound, and DualPipeV needs none/full
    if zero is not None:  # 2 x 2 ranks: Piper's ZeRO over the data-parallel pair, FSDP's policy names the level
        config.parallelism.data_parallel_shard_degree = 2
        config.parallelism.data_parallel_replicate_degree = 1
        config.parallelism.fsdp_reshard_after_forward = "never" if zero == 2 else "always"
        config.piper.zero = zero
    return config


def llama3_debugmodel_pp2_1f1b() -> PiperTrainer.Config:
    """llama3 debug model, 2 pipeline ranks, 1F1B run by Piper (seq 256, batch 4, 4 microbatches)."""
    return _pp2("llama3_debugmodel", "1F1B")


def llama3_debugmodel_pp2_gpipe() -> PiperTrainer.Config:
    """GPipe: all forwards, then all backwards; 2 stages on 2 ranks, run by Piper."""
    return _pp2("llama3_debugmodel", "GPipe")


def llama3_debugmodel_pp2_interleaved() -> PiperTrainer.Config:
    """Interleaved 1F1B: 4 stages on 2 ranks (loop layout), run by Piper."""
    return _pp2("llama3_debugmodel", "Interleaved1F1B")


def llama3_debugmodel_pp2_dualpipev() -> PiperTrainer.Config:
    """DualPipeV: 4 stages on 2 ranks in a V, run by Piper."""
    return _pp2("llama3_debugmodel", "DualPipeV")


def llama3_debugmodel_pp2_dp2_zero1() -> PiperTrainer.Config:
    """llama3 debug, 4 ranks: 2 pipeline (1F1B) x 2 data-parallel with ZeRO-1 (optimizer state sharded)."""
    return _pp2("llama3_debugmodel", "1F1B", zero=1)


def llama3_debugmodel_pp2_dp2_zero2() -> PiperTrainer.Config:
    """As ``..._zero1`` with ZeRO-2: gradients reduce-scattered per microbatch, sharded too."""
    return _pp2("llama3_debugmodel", "1F1B", zero=2)


def llama3_debugmodel_pp2_dp2_zero3() -> PiperTrainer.Config:
    """As ``..._zero1`` with ZeRO-3: parameters gathered per microbatch and freed after use."""
    return _pp2("llama3_debugmodel", "1F1B", zero=3)


def deepseek_v3_debugmodel_pp2_1f1b() -> PiperTrainer.Config:
    """DeepSeek-V3 debug model (MoE, MLA), 2 pipeline ranks, 1F1B by Piper; seq 64, batch 2."""
    return _pp2("deepseek_v3_debugmodel", "1F1B", seq_len=64, local_batch_size=2)
