"""The ``--config`` names of ``--module piper_plugin.adapters.torchtitan``, known without importing TorchTitan.

Stock config functions are read from the source of each model's ``config_registry.py`` (its
top-level public functions annotated to return a ``...Config``), so a launcher checks a name
in milliseconds before any rank starts (importing TorchTitan takes ~10 s). Piper's drop-ins
are ``<stock>_pp2_<schedule>`` and, with ZeRO over 2 data-parallel ranks (4 ranks),
``<stock>_pp2_dp2_zero<level>`` (1F1B) and ``<stock>_pp2_dp2_zero<level>_<schedule>``; with
TorchTitan's tensor parallelism in each stage (4 ranks), ``<stock>_pp2_tp2_<schedule>``. Invariant: every name :func:`unknown` accepts resolves in
:mod:`.config_registry` (which imports the stock function); a stock model that does not import
on this machine is accepted here and named with its import error there.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from pathlib import Path

__all__ = ["MODELS", "BASES", "SCHEDULES", "DROP_IN", "ZERO_DROP_IN", "EP_DROP_IN", "TP_DROP_IN", "drop_in",
           "ep_drop_in", "tp_drop_in",
           "stock_configs", "unknown"]

# The model packages searched for stock config functions, in this order.
MODELS = ("llama3", "deepseek_v3", "qwen3", "qwen3_5", "gpt_oss", "kimi_k2_7", "flux", "muse_glimmer")
# Piper's own base configs (variants of a stock one), usable wherever a stock config name is.
BASES = {"llama3_widemodel": "llama3", "deepseek_v3_debugmodel_ce_loss": "deepseek_v3"}
# ``<stock config>_pp2_<schedule>``: any stock config as a 2-rank pipeline run by Piper.
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "dualpipev": "DualPipeV"}
DROP_IN = re.compile(r"(.+)_pp2_(" + "|".join(SCHEDULES) + ")")
# ``<stock config>_pp2_dp2_zero<level>[_<schedule>]``: 2 pipeline x 2 data-parallel ranks, Piper's ZeRO.
ZERO_DROP_IN = re.compile(r"(.+)_pp2_dp2_zero([123])(?:_(" + "|".join(SCHEDULES) + "))?")


# ``<stock config>_pp2_ep2_<schedule>``: 2 pipeline x 2 ranks whose experts are split over them.
EP_DROP_IN = re.compile(r"(.+)_pp2_ep2_(" + "|".join(SCHEDULES) + ")")


# ``<stock config>_pp2_tp2_<schedule>``: 2 pipeline x 2 tensor-parallel ranks (TorchTitan's TP in each stage).
TP_DROP_IN = re.compile(r"(.+)_pp2_tp2_(" + "|".join(SCHEDULES) + ")")


def tp_drop_in(name: str) -> tuple[str, str] | None:
    """(stock config, schedule key) of a tensor-parallel drop-in name; None for other names."""
    found = TP_DROP_IN.fullmatch(name)
    return (found[1], found[2]) if found else None


def ep_drop_in(name: str) -> tuple[str, str] | None:
    """(stock config, schedule key) of an expert-parallel drop-in name; None for other names."""
    found = EP_DROP_IN.fullmatch(name)
    return (found[1], found[2]) if found else None


def drop_in(name: str) -> tuple[str, str, int | None] | None:
    """(stock config, schedule key, ZeRO level or None) of a drop-in name; None for other names."""
    zero = ZERO_DROP_IN.fullmatch(name)
    if zero:
        return zero[1], zero[3] or "1f1b", int(zero[2])
    plain = DROP_IN.fullmatch(name)
    return (plain[1], plain[2], None) if plain else None


@functools.lru_cache(maxsize=1)
def stock_configs() -> dict[str, tuple[str, ...]]:
    """Model package -> its stock config function names, in source order; empty when
    TorchTitan's source is not found (then nothing can be checked here)."""
    spec = importlib.util.find_spec("torchtitan")  # a top-level name: finds without importing
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = Path(next(iter(spec.submodule_search_locations))) / "models"
    found = {}
    for model in MODELS:
        try:
            tree = ast.parse((root / model / "config_registry.py").read_text())
        except (OSError, SyntaxError):
            continue
        names = tuple(node.name for node in tree.body
                      if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
                      and node.returns is not None and ast.unparse(node.returns).endswith("Config"))
        if names:
            found[model] = names
    return found


def unknown(name: str) -> str:
    """Why ``--config name`` does not exist, listing what does; "" when it does (or when
    TorchTitan's source cannot be read here: TorchTitan then checks it)."""
    stock = stock_configs()
    every = [n for names in stock.values() for n in names] + list(BASES)
    if not stock or name in every:
        return ""
    parsed = drop_in(name) or ep_drop_in(name) or tp_drop_in(name)
    if parsed and parsed[0] in every:
        return ""
    if parsed:
        head = f"the drop-in needs a stock config named {parsed[0]!r}, and there is none"
        close = difflib.get_close_matches(parsed[0], every, n=3)
    else:
        head = "not a config function of piper_plugin.adapters.torchtitan"
        close = difflib.get_close_matches(name, every + [f"{n}_pp2_1f1b" for n in every], n=3)
    suggestion = f" (did you mean {' or '.join(close)}?)" if close else ""
    listing = "; ".join(f"{model}: {', '.join(names)}" for model, names in stock.items())
    return (f"{head}{suggestion}. Stock TorchTitan configs, by model: {listing}. Piper drop-ins: "
            f"<stock>_pp2_<schedule> with schedule {', '.join(SCHEDULES)} (2 pipeline ranks run by Piper; "
            f"stock configs without tied embeddings), e.g. llama3_debugmodel_pp2_1f1b, deepseek_v3_debugmodel_pp2_1f1b; "
            f"<stock>_pp2_dp2_zero<1|2|3>[_<schedule>] (4 ranks: 2 pipeline x 2 data-parallel with Piper's ZeRO), "
            f"e.g. llama3_debugmodel_pp2_dp2_zero3; <stock MoE>_pp2_ep2_<schedule> (4 ranks: 2 pipeline x 2 with the "
            f"experts split over them), e.g. deepseek_v3_debugmodel_pp2_ep2_dualpipev; <stock>_pp2_tp2_<schedule> (4 ranks: "
            f"2 pipeline x 2 tensor-parallel), e.g. llama3_debugmodel_pp2_tp2_1f1b")
