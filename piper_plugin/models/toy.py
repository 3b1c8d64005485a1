"""Toy models for tests and the CLI: a small LM, its MoE variant, a two-branch net, an MLP.

All of them trace with ``torch.fx.symbolic_trace`` and run on the meta device: no control
flow on tensor values or shapes, no data-dependent shapes, fp32, no dropout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F

from piper_plugin.api.annotate import annotate, annotate_modules

__all__ = [
    "ToyLMConfig", "ToyLM", "ToyMoELM", "Attention", "MLP", "Block", "MoELayer",
    "GroupedExperts", "TwoBranch", "toy_sequential", "layer_stages", "lm_batch", "lm_loss",
    "mse_loss", "build_toy_lm", "build_toy_moe", "TOY_MODELS",
]


@dataclass
class ToyLMConfig:
    """Sizes of the toy LM; ``capacity=None`` means C = tokens (a token picks an expert at most once, so nothing is dropped)."""

    vocab: int = 128
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    ffn: int = 64
    seq: int = 16
    tie_embeddings: bool = False
    n_experts: int = 4
    top_k: int = 2
    capacity: int | None = None


def layer_stages(n_layers: int, stages: int) -> list[int]:
    """Stage of each layer: contiguous, even split; earlier stages take the remainder."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages > n_layers:
        raise ValueError(
            f"stages={stages} > n_layers={n_layers}: every pipeline stage needs at least one "
            f"layer; use more layers or fewer stages"
        )
    base, rem = divmod(n_layers, stages)
    out: list[int] = []
    for s in range(stages):
        out += [s] * (base + (1 if s < rem else 0))
    return out


class Attention(nn.Module):
    """Causal multi-head self-attention (fused QKV, SDPA)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has no gradient
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x).unflatten(-1, (3, self.n_heads, self.head_dim))  # [B, T, 3, H, Dh]
        q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))  # [B, H, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Dense feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GroupedExperts(nn.Module):
    """E expert MLPs as batched matmuls; every parameter has a leading expert dim E."""

    def __init__(self, n_experts: int, dim: int, ffn: int, std: float = 0.02):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn, dim))
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w2, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[E, C, dim] -> [E, C, dim]."""
        return torch.bmm(F.gelu(torch.bmm(x, self.w1)), self.w2)


class MoELayer(nn.Module):
    """Top-k routed MoE with GShard-style static-shape dispatch/combine over capacity C."""

    def __init__(self, dim: int, ffn: int, n_experts: int, top_k: int, capacity: int | None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k, self.capacity = n_experts, top_k, capacity
        self.router = nn.Linear(dim, n_experts)
        self.experts = GroupedExperts(n_experts, dim, ffn)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [T, dim] -> (dispatch mask, combine weights), both [T, E, C] float.

        Slot k of every token is placed after all slot <k assignments (GShard priority);
        an assignment whose position in its expert is >= C is dropped.
        """
        probs = F.softmax(self.router(x), dim=-1)  # [T, E]
        top = torch.topk(probs, self.top_k, dim=-1)
        gates, idx = top[0], top[1]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        cap = self.capacity if self.capacity is not None else x.size(0)
        experts = torch.arange(self.n_experts, device=x.device)
        slots = torch.arange(cap, device=x.device)
        dispatch = combine = 0.0
        offset = 0.0  # assignments per expert made by earlier slots, [1, E]
        for k in range(self.top_k):
            mask = (idx[:, k : k + 1] == experts).to(x.dtype)  # [T, E]
            loc = torch.cumsum(mask, dim=0) - 1.0 + offset  # position inside the chosen expert
            offset = offset + mask.sum(dim=0, keepdim=True)
            mask = mask * (loc < cap).to(x.dtype)  # drop over-capacity assignments
            pos = (loc * mask).sum(dim=-1).to(torch.int64)  # [T]
            d = mask.unsqueeze(-1) * (pos.unsqueeze(-1) == slots).to(x.dtype).unsqueeze(1)  # [T, E, C]
            dispatch = dispatch + d
            combine = combine + gates[:, k : k + 1].unsqueeze(-1) * d
        return dispatch, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)  # [T = B*S, dim]
        dispatch, combine = self.route(tokens)
        dispatched = torch.einsum("tec,td->ecd", dispatch, tokens)
        with annotate(EP="experts"):
            out = self.experts(dispatched)
        y = torch.einsum("tec,ecd->td", combine, out)
        return y.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block; the MLP is dense or MoE."""

    def __init__(self, cfg: ToyLMConfig, moe: bool = False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads)
        self.mlp = (
            MoELayer(cfg.dim, cfg.ffn, cfg.n_experts, cfg.top_k, cfg.capacity)
            if moe else MLP(cfg.dim, cfg.ffn)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyLM(nn.Module):
    """Decoder-only LM: tokens [B, T] int64 -> logits [B, T, vocab].

    With ``stages`` the forward tags its parts ``annotate(PP=s)``: embeddings with stage 0,
    layers split contiguously (see :func:`layer_stages`), final norm + head with the last stage.
    """

    moe = False

    def __init__(self, cfg: ToyLMConfig, stages: int | None = None):
        super().__init__()
        self.cfg, self.stages = cfg, stages
        self.layer_stage = layer_stages(cfg.n_layers, stages) if stages is not None else None
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe=self.moe) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def _stage(self, s: int) -> ContextManager[None]:
        return annotate(PP=s) if self.stages is not None else contextlib.nullcontext()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._stage(0):
            h = self.embed(tokens) + self.pos.weight[: tokens.size(1)]
        for i, layer in enumerate(self.layers):
            with self._stage(self.layer_stage[i] if self.layer_stage else 0):
                h = layer(h)
        with self._stage(self.stages - 1 if self.stages is not None else 0):
            h = self.norm(h)
            return F.linear(h, self.embed.weight) if self.head is None else self.head(h)


class ToyMoELM(ToyLM):
    """:class:`ToyLM` whose every block MLP is a :class:`MoELayer` (experts tagged EP='experts')."""

    moe = True


class TwoBranch(nn.Module):
    """stem (PP=0) -> branches a (PP=1) and b (PP=2) in parallel -> head (PP=3) + stem skip."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.branch_a = MLP(dim, 2 * dim)
        self.branch_b = MLP(dim, 2 * dim)
        self.head = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with annotate(PP=0):
            s = self.stem(x)
        with annotate(PP=1, branch="a"):
            a = self.branch_a(s)
        with annotate(PP=2, branch="b"):
            b = self.branch_b(s)
        with annotate(PP=3):
            return self.head(torch.cat([a, b], dim=-1)) + s


def toy_sequential(dims: tuple[int, ...] = (16, 32, 32, 16), stages: int | None = None) -> nn.Sequential:
    """Plain ``nn.Sequential`` of Linear/ReLU (no ReLU after the last Linear).

    With ``stages`` the Linear(+ReLU) groups are split contiguously over PP stages by
    :func:`annotate_modules` (module tags, nothing inside forward).
    """
    if len(dims) < 2:
        raise ValueError(f"dims needs at least two sizes, got {dims}")
    mods: list[nn.Module] = []
    groups: list[list[int]] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        groups.append([len(mods)])
        mods.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2:
            groups[-1].append(len(mods))
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    if stages is not None:
        stage_of = layer_stages(len(groups), stages)
        annotate_modules(model, {str(m): {"PP": stage_of[g]} for g, grp in enumerate(groups) for m in grp})
    return model


def lm_batch(cfg: ToyLMConfig, batch: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, targets), both int64 [batch, cfg.seq]; targets are tokens shifted by one."""
    seq = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=generator)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits [B, T, V] against targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (for TwoBranch / toy_sequential)."""
    return F.mse_loss(out, target)


def _config(layers: int | None, overrides: dict) -> ToyLMConfig:
    cfg = ToyLMConfig() if layers is None else replace(ToyLMConfig(), n_layers=layers)
    return replace(cfg, **overrides)


def build_toy_lm(stages: int | None, layers: int | None = None, **overrides) -> tuple[ToyLM, ToyLMConfig]:
    """CLI builder for ``toy-lm``; ``layers`` overrides ``n_layers``, keywords other fields."""
    cfg = _config(layers, overrides)
    return ToyLM(cfg, stages), cfg


def build_toy_moe(stages: int | None, layers: int | None = None, **overrides) -> tuple[ToyMoELM, ToyLMConfig]:
    """CLI builder for ``toy-moe``; ``layers`` overrides ``n_layers``, keywords other fields."""
    cfg = _config(layers, overrides)
    return ToyMoELM(cfg, stages), cfg


TOY_MODELS: dict[str, Callable[..., tuple[nn.Module, ToyLMConfig]]] = {
    "toy-lm": build_toy_lm,
    "toy-moe": build_toy_moe,
}
