"""The decoder as its math: embedding, layers, final norm, head. No decoding policy, no kernels.

Module names follow Qwen3 (embed_tokens, layers.i.self_attn.q_proj, ..., norm, lm_head); the loader
maps each family's onto them. A layer, h = x + out(attend(qkv(attn_norm(x)))) and then
x' = h + mlp(mlp_norm(h)), exposes those pieces, the primitives a method recombines:

    h = layer.attn_norm(x)
    q, k, v = layer.qkv(h, rope)          # projections, q/k norm, RoPE: [b, heads, t, d]
    q, k = layer.qk(h, rope)              # the same without v (k, v = layer.kv(h, rope): without q)
    q, v = layer.query(h, rope), layer.value(h)   # one projection alone
    x = layer.add_out(x, o)               # x + o_proj(o), x updated in place

Attention is somebody else's callback: forward(ids, positions, attend) calls attend(layer_idx, q, k, v).
The MLP is a SwiGLU or a mixture of experts (mlp.py). Numerics follow the references: RMSNorm in fp32,
cast, then the weight; RoPE tables and rotation in fp32 (LLaDA's rope_full_precision), cast back.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from .config import ModelConfig
from .mlp import MLP, MoE, fp32_or_wider

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x; with add, of x + add, which is written into x first (x: the residual
        stream of a method that carries the last layer's output into this norm, DyLLM's)."""
        if add is not None:
            x.add_(add)
        x32 = fp32_or_wider(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Rope:
    """Rotate-half RoPE at given positions [batch, t]: fp32 cos and sin tables [batch, 1, t, r] for the
    first r = rotary_dim dims of each head (the frequencies over those r); the others pass through."""

    def __init__(self, positions: torch.Tensor, rotary_dim: int, base: float):
        exponent = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim
        inv_freq = 1.0 / base**exponent
        freqs = positions.float()[..., None] * inv_freq  # [batch, t, d/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]
        self.table = torch.stack([torch.cos(angles), torch.sin(angles)])  # cos, sin: one gather in rows()
        self.cos, self.sin = self.table[0], self.table[1]

    def rows(self, rows: torch.Tensor) -> "Rope":
        """The tables at some positions only: rows [batch, s] indexes this Rope's t."""
        index = rows[None, :, None, :, None].expand(2, -1, 1, -1, self.cos.shape[-1])
        picked = type(self).__new__(type(self))
        picked.table = self.table.gather(3, index)
        picked.cos, picked.sin = picked.table[0], picked.table[1]
        return picked

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, heads, t, d] rotated: x cos + rotate_half(x) sin over its first r dims."""
        width = self.cos.shape[-1]
        x32 = fp32_or_wider(x[..., :width])
        half = width // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        out = (x32 * self.cos + rotated * self.sin).to(x.dtype)
        return out if width == x.shape[-1] else torch.cat([out, x[..., width:]], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # "head": per head (Qwen3); "projection": over the whole projection (OLMo)
            whole = cfg.qk_norm == "projection"
            self.q_norm = RMSNorm(cfg.num_heads * hd if whole else hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * hd if whole else hd, cfg.rms_norm_eps)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.moe is None or index in cfg.moe.dense_layers
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else MoE(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        h = x + self.out(attend(*self.qkv(self.attn_norm(x), rope)))
        return h + self.mlp(self.mlp_norm(h))

    def attn_norm(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return self.input_layernorm(x, add)

    def mlp_norm(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return self.post_attention_layernorm(x, add)

    def qkv(self, h: torch.Tensor, rope: Rope):
        """[b, t, hidden] -> q [b, heads, t, d], k and v [b, kv_heads, t, d]; q, k normed and rotated."""
        return self.query(h, rope), self.key(h, rope), self.value(h)

    def qk(self, h: torch.Tensor, rope: Rope):
        return self.query(h, rope), self.key(h, rope)

    def kv(self, h: torch.Tensor, rope: Rope):
        return self.key(h, rope), self.value(h)

    def query(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        return rope.apply(self.heads(self.self_attn.q_proj(h), self.self_attn.q_norm))

    def key(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        return rope.apply(self.heads(self.self_attn.k_proj(h), self.self_attn.k_norm))

    def value(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads(self.self_attn.v_proj(h))

    def heads(self, projected: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """[b, t, heads * d] -> [b, heads, t, d], q/k-normed over the whole projection or per head."""
        if self.cfg.qk_norm == "projection" and norm is not None:
            projected = norm(projected)
        b, t = projected.shape[:2]
        heads = projected.view(b, t, -1, self.cfg.head_dim).transpose(1, 2)
        return norm(heads) if self.cfg.qk_norm == "head" and norm is not None else heads

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output [b, heads, t, d] -> [b, t, hidden] through o_proj."""
        b, _, t, _ = o.shape
        return self.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x + out(o), written into x (a residual stream nothing else reads)."""
        return x.add_(self.out(o))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """With tie_word_embeddings the LM head is the embedding matrix (one Parameter)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.cfg.rotary_dim, self.cfg.rope_base)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Every layer over ids; the last hidden state, before the final norm."""
        x, rope = self.embed(ids), self.rope(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, partial(attend, i))
        return x

    def head(self, hidden: torch.Tensor, start: int = 0, stop: int | None = None,
             before: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, stop - start, vocab] for positions start..stop-1 (final norm + LM head only there).
        With logit_shift, position i gets the logits of hidden state i-1, as Dream-style checkpoints
        expect; position 0 reads `before` ([b, 1, hidden]: the state of the column before hidden's
        first, for a forward over part of a canvas) or, without it, keeps its own."""
        stop = hidden.shape[1] if stop is None else stop
        if not self.cfg.logit_shift:
            return self.lm_head(self.norm(hidden[:, start:stop]))
        if start == 0 and before is not None:
            return self.lm_head(self.norm(torch.cat([before, hidden[:, : stop - 1]], dim=1)))
        source = (torch.arange(start, stop, device=hidden.device) - 1).clamp(min=0)
        return self.lm_head(self.norm(hidden[:, source]))

    def forward(self, ids, positions, attend: Attend, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Logits for positions start..stop-1 of a forward over all of `ids`."""
        return self.head(self.hidden(ids, positions, attend), start, stop)
