"""The decoder: embedding, layers, final norm, head. Architecture only, no decoding policy.

Module names follow Qwen3 (embed_tokens, layers.i.self_attn.q_proj, ..., norm, lm_head); the loader
maps each family's tensor names onto them. A layer exposes the primitives a method recombines:

    h = layer.attn_norm(x)
    q, k, v = layer.qkv(h, rope)          # projections, optional q/k norm, RoPE; [b, heads, t, d]
    q, v = layer.query(h, rope), layer.value(h)   # one projection alone
    x = x + layer.out(attend(q, k, v))    # attention is always somebody else's callback
    x = x + layer.mlp(layer.mlp_norm(x))

`Model.forward(ids, positions, attend)` composes them, calling `attend(layer_idx, q, k, v)`.
Numerics follow the references: RMSNorm in fp32 then cast then weight; RoPE tables and rotation in
fp32 (LLaDA's rope_full_precision), cast back to the activation dtype. On CUDA in float16 / bfloat16
outside autograd, both run as one-pass Triton kernels (kernels/rmsnorm.py, kernels/rope.py) with the
same rounding points; NANODLLM_KERNELS=0 keeps them on torch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import attention
from .config import ModelConfig

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fp32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is (tests run whole models in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def use_fused(x: torch.Tensor) -> bool:
    """Whether x's RMSNorm / RoPE run on the fused Triton kernels (tests switch this on for the
    interpreter). Not under autograd: the kernels have no backward (training runs on torch)."""
    return (attention.KERNELS_ENABLED and x.is_cuda and x.dtype in attention.KERNEL_DTYPES
            and not torch.is_grad_enabled())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x; with add, of x + add, written into x first (x: a tensor nothing else reads)."""
        if use_fused(x) and (add is None or x.dim() <= 4):
            from kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, add)
        if add is not None:
            x.add_(add)
        x32 = fp32_or_wider(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Rope:
    """cos/sin tables (fp32) for given positions; apply() rotates q or k by rotate-half."""

    def __init__(self, positions: torch.Tensor, head_dim: int, base: float):
        exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (base**exponent)
        freqs = positions.float()[..., None] * inv_freq  # [batch, t, d/2], fp32 as the references
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [batch, 1, t, d]
        self.cos, self.sin = angles.cos(), angles.sin()

    def rows(self, rows: torch.Tensor) -> "Rope":
        """The tables at some positions only: rows [batch, s] indexes this Rope's t (no recompute)."""
        index = rows[:, None, :, None].expand(-1, 1, -1, self.cos.shape[-1])
        picked = Rope.__new__(Rope)
        picked.cos, picked.sin = self.cos.gather(2, index), self.sin.gather(2, index)
        return picked

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            from kernels.rope import apply_rope

            return apply_rope(x, self.cos, self.sin)
        x32 = fp32_or_wider(x)
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * self.cos + rotated * self.sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        if cfg.qk_norm:
            whole = cfg.qk_norm == "projection"
            self.q_norm = RMSNorm(cfg.num_heads * hd if whole else hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * hd if whole else hd, cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_norm(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return self.input_layernorm(x, add)

    def qkv(self, h: torch.Tensor, rope: Rope):
        """[b, t, hidden] -> q [b, heads, t, d], k and v [b, kv_heads, t, d]; RoPE applied to q, k."""
        attn = self.self_attn
        q = self._heads(attn.q_proj(h), getattr(attn, "q_norm", None))
        k = self._heads(attn.k_proj(h), getattr(attn, "k_norm", None))
        return rope.apply(q), rope.apply(k), self.value(h)

    def query(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[b, t, hidden] -> q [b, heads, t, d] alone, normed (q/k norm) and rotated."""
        attn = self.self_attn
        return rope.apply(self._heads(attn.q_proj(h), getattr(attn, "q_norm", None)))

    def _heads(self, projected: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """[b, t, heads * d] -> [b, heads, t, d], q/k-normed (cfg.qk_norm) over the whole projection or per head."""
        if self.cfg.qk_norm == "projection":
            projected = norm(projected)
        b, t = projected.shape[:2]
        heads = projected.view(b, t, -1, self.cfg.head_dim).transpose(1, 2)
        return norm(heads) if self.cfg.qk_norm == "head" else heads

    def value(self, h: torch.Tensor) -> torch.Tensor:
        """[b, t, hidden] -> v [b, kv_heads, t, d] alone (caches that watch value drift)."""
        return self.self_attn.v_proj(h).view(h.shape[0], h.shape[1], -1, self.cfg.head_dim).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output [b, heads, t, d] -> [b, t, hidden] through o_proj."""
        b, _, t, _ = o.shape
        return self.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x += out(o), in place: one matmul with the add in its epilogue when x is contiguous and
        o_proj has no bias (x [b, t, hidden] must be a tensor nothing else still reads)."""
        proj = self.self_attn.o_proj
        if proj.bias is not None or not x.is_contiguous():
            return x.add_(self.out(o))
        b, _, t, _ = o.shape
        x.view(b * t, -1).addmm_(o.transpose(1, 2).reshape(b * t, -1), proj.weight.t())
        return x

    def mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x)

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x), rope)
        x = x + self.out(attend(q, k, v))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
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
        return Rope(positions, self.cfg.head_dim, self.cfg.rope_base)

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

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Run all layers; returns the last hidden state before the final norm."""
        x, rope = self.embed(ids), self.rope(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, lambda q, k, v, i=i: attend(i, q, k, v))
        return x

    def forward(self, ids, positions, attend: Attend, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Logits for positions start..stop-1 of a forward over all of `ids`."""
        return self.head(self.hidden(ids, positions, attend), start, stop)


def build_empty(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16) -> Model:
    """A model with uninitialised parameters allocated once, in `dtype`, directly on `device`
    (built on the meta device first, so no CPU or fp32 copy of an 8B model is ever made)."""
    with torch.device("meta"):
        model = Model(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval()


def build_random(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> Model:
    """A model of cfg's shape with N(0, 0.02) weights (norms 1) for speed benchmarks and tests."""
    model = build_empty(cfg, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model
