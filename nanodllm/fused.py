"""model.py's model built for the GPU kernels: the same primitives and signatures, tested against it.

fuse() converts a reference model once (the loader calls it), layer by layer, stacking its weights: q/k/v's rows
(and biases) in qkv_proj, each SwiGLU's gate and up rows in gate_up_proj, a mixture of experts' in two
Parameters [experts, ...] (the MLPs: fused_mlp.py). Where use_kernels(x) holds (CUDA, float16 / bfloat16, no
autograd) a stacked group is one matmul; RMSNorm (with the residual add before it), RoPE (q and k at once, with
the per-head q/k norm) and silu(gate) * up are one-pass kernels; o_proj and the MLP add into the residual in an
epilogue or the next norm; over a decode step's few rows the norms and SwiGLU ride inside the matmuls
(norm_linear). Elsewhere each primitive runs the reference's own ops on row slices of the stacked weights, bit
for bit. Split over ranks (parallel.py), a FusedMoE holds its rank's experts; the summing linears stay as they
are.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanodllm.kernels.norm_linear import MAX_ROWS, fills_device, norm_linear
from nanodllm.kernels.rmsnorm import rms_norm
from nanodllm.kernels.rope import apply_rope, rope_qk

from .attention import use_kernels
from .config import ModelConfig
from .fused_mlp import FusedMLP, FusedMoE
from .mlp import MoE
from .model import Attend, Layer, Model, RMSNorm, Rope
from .parallel import SINGLE, Group, RowParallelLinear, group_of

class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        on_kernel = use_kernels(x) and (add is None or x.dim() <= 4)
        return rms_norm(x, self.weight, self.eps, add) if on_kernel else super().forward(x, add)


class FusedRope(Rope):
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, self.cos, self.sin) if use_kernels(x) else super().apply(x)


class FusedAttention(nn.Module):
    """SelfAttention's weights with q's, k's and v's rows (and biases) back to back in qkv_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.widths = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]  # rows of q, k, v
        self.qkv_proj = nn.Linear(d, sum(self.widths), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # "head": per head; "projection": over the whole projection
            widths = self.widths[:2] if cfg.qk_norm == "projection" else [hd, hd]
            self.q_norm, self.k_norm = (FusedRMSNorm(width, cfg.rms_norm_eps) for width in widths)

    def project(self, h: torch.Tensor, first: int, count: int = 1) -> torch.Tensor:
        """h [b, t, hidden] through `count` of q, k, v from `first` (0: q), one matmul over their rows."""
        rows = slice(sum(self.widths[:first]), sum(self.widths[: first + count]))
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[rows]
        return F.linear(h, self.qkv_proj.weight[rows], bias)


def add_linear(x: torch.Tensor, inputs: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x += linear(inputs) in place, added in the matmul's epilogue unless x is not contiguous or the linear has a
    bias or sums over ranks first (RowParallelLinear); inputs [b, t, in] in slices of a cache: a batched matmul."""
    if linear.bias is not None or not x.is_contiguous() or isinstance(linear, RowParallelLinear):
        return x.add_(linear(inputs))
    rows_contiguous = inputs.stride(-1) == 1 and inputs.stride(-2) == inputs.shape[-1]
    flat = rows_contiguous and inputs.stride(0) == inputs.shape[1] * inputs.shape[2]
    if inputs.dim() == 3 and inputs.shape[0] > 1 and rows_contiguous and not flat:
        return x.baddbmm_(inputs, linear.weight.t().expand(inputs.shape[0], -1, -1))
    x.view(-1, x.shape[-1]).addmm_(inputs.reshape(-1, inputs.shape[-1]), linear.weight.t())
    return x


class FusedLayer(Layer):
    def __init__(self, cfg: ModelConfig, index: int, group: Group = SINGLE):
        nn.Module.__init__(self)  # its own modules, not Layer's
        self.cfg = cfg
        self.input_layernorm = FusedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = FusedAttention(cfg)
        self.post_attention_layernorm = FusedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.moe is None or index in cfg.moe.dense_layers
        self.mlp = FusedMLP(cfg.hidden_size, cfg.intermediate_size) if dense else FusedMoE(cfg, group)

    def query(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        return rope.apply(self.heads(self.self_attn.project(h, 0), self.self_attn.q_norm))

    def key(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        return rope.apply(self.heads(self.self_attn.project(h, 1), self.self_attn.k_norm))

    def value(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads(self.self_attn.project(h, 2))

    def qkv(self, h: torch.Tensor, rope: Rope):
        return self.split_stacked(self.self_attn.project(h, 0, 3), rope, 3) if use_kernels(h) else super().qkv(h, rope)

    def qk(self, h: torch.Tensor, rope: Rope):
        return self.split_stacked(self.self_attn.project(h, 0, 2), rope, 2) if use_kernels(h) else super().qk(h, rope)

    def kv(self, h: torch.Tensor, rope: Rope):
        if not use_kernels(h):
            return super().kv(h, rope)
        k, v = self.self_attn.project(h, 1, 2).split(self.self_attn.widths[1:], dim=-1)
        return rope.apply(self.heads(k, self.self_attn.k_norm)), self.heads(v)

    def split_stacked(self, projected: torch.Tensor, rope: Rope, count: int):
        """The stacked projection's output [b, t, W] -> q, k (normed, rotated) and, with count 3, v; q
        and k through one kernel (kernels/rope.py rope_qk) where the q/k norm is per head."""
        attn, cfg = self.self_attn, self.cfg
        outputs = projected.split(attn.widths[:count], dim=-1)
        values = tuple(self.heads(v) for v in outputs[2:])
        if cfg.qk_norm != "projection" and projected.dim() == 3:
            norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
            eps = attn.q_norm.eps if cfg.qk_norm else 0.0
            q, k = rope_qk(projected, cfg.num_heads, cfg.num_kv_heads, rope.cos, rope.sin, *norms, eps, cfg.head_dim)
            return (q, k, *values)
        q = rope.apply(self.heads(outputs[0], attn.q_norm))
        return (q, rope.apply(self.heads(outputs[1], attn.k_norm)), *values)

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        attn_out = o.transpose(1, 2).flatten(2)
        return add_linear(x, attn_out, self.self_attn.o_proj) if use_kernels(x) else super().add_out(x, o)

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        if not use_kernels(x):
            return super().forward(x, rope, attend)
        x = x.clone()
        pending = self.step(x, None, rope, attend)
        return x if pending is None else x.add_(pending)

    def step(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Rope, attend: Callable):
        """The layer on the residual stream x, in place: x += pending (the previous layer's MLP output)
        and the attention output, each add inside the norm after it; returns this layer's MLP output,
        not yet added, or None where it was added already (the few-row step)."""
        if self.takes_few_row_step(x):
            return self.few_row_step(x, pending, rope, attend)
        q, k, v = self.qkv(self.attn_norm(x, pending), rope)
        return self.mlp(self.mlp_norm(x, self.out(attend(q, k, v))))

    def takes_few_row_step(self, x: torch.Tensor) -> bool:
        """Whether step runs few_row_step over x: few contiguous rows, a dense MLP, weights of x's dtype,
        projections wide enough for norm_linear to fill the GPU."""
        few = x.dim() == 3 and x.is_contiguous() and x.shape[0] * x.shape[1] <= MAX_ROWS
        if not few or not isinstance(self.mlp, FusedMLP):  # a mixture of experts runs as itself
            return False
        qkv, gate_up = self.self_attn.qkv_proj.weight, self.mlp.gate_up_proj.weight
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        same_dtype = all(w.dtype == x.dtype for w in (*norms, qkv, gate_up))
        return same_dtype and fills_device(qkv) and fills_device(gate_up, swiglu=True)

    def few_row_step(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Rope, attend: Callable) -> None:
        """step over a decode step's few rows: each norm inside the matmul after it, silu(gate) * up in
        gate/up's, o_proj and down_proj adding into x in their epilogues."""
        if pending is not None:
            x.add_(pending)
        norm, qkv = self.input_layernorm, self.self_attn.qkv_proj
        q, k, v = self.split_stacked(norm_linear(x, norm.weight, norm.eps, qkv.weight, qkv.bias), rope, 3)
        self.add_out(x, attend(q, k, v))
        norm = self.post_attention_layernorm
        gated = norm_linear(x, norm.weight, norm.eps, self.mlp.gate_up_proj.weight, swiglu=True)
        add_linear(x, gated, self.mlp.down_proj)


class FusedModel(Model):
    def __init__(self, cfg: ModelConfig, group: Group = SINGLE):
        nn.Module.__init__(self)  # its own layers, not Model's
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FusedLayer(cfg, i, group) for i in range(cfg.num_layers))
        self.norm = FusedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def rope(self, positions: torch.Tensor) -> Rope:
        return FusedRope(positions, self.cfg.rotary_dim, self.cfg.rope_base)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        if not use_kernels(self.embed_tokens.weight):
            return super().hidden(ids, positions, attend)
        x, rope, pending = self.embed(ids), self.rope(positions), None  # x: a fresh tensor, updated in place
        for i, layer in enumerate(self.layers):
            pending = layer.step(x, pending, rope, partial(attend, i))
        return x if pending is None else x.add_(pending)


def stacked_state(layer: Layer) -> dict[str, torch.Tensor]:
    """A reference layer's state dict in FusedLayer's names: q/k/v's rows (and biases) and each SwiGLU's
    gate and up rows concatenated, every expert's gate/up and down stacked [experts, rows, cols]."""
    state = layer.state_dict()
    rows = lambda names: torch.cat([state.pop(name) for name in names])
    for kind in ("weight", "bias") if layer.cfg.qkv_bias else ("weight",):
        state[f"self_attn.qkv_proj.{kind}"] = rows(f"self_attn.{name}_proj.{kind}" for name in "qkv")
    for prefix in ("mlp.", "mlp.shared_expert."):
        if prefix + "up_proj.weight" in state:
            state[prefix + "gate_up_proj.weight"] = rows([prefix + "gate_proj.weight", prefix + "up_proj.weight"])
    if isinstance(layer.mlp, MoE):
        experts = len(layer.mlp.experts)
        for into, names in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            stacked = rows(f"mlp.experts.{e}.{name}_proj.weight" for e in range(experts) for name in names)
            state[f"mlp.experts.{into}"] = stacked.unflatten(0, (experts, -1))
    return state


def fuse(model: Model) -> FusedModel:
    """The fused model of a reference one, on its device, in its dtype, built layer by layer: each leaves `model` once
    its weights are stacked (memory peaks about one layer above the model's)."""
    with torch.device("meta"):
        fused = FusedModel(model.layers[0].cfg, group_of(model))  # a layer's config: this rank's share of the heads
    fused.cfg, fused.embed_tokens, fused.lm_head = model.cfg, model.embed_tokens, model.lm_head
    fused.norm.weight = model.norm.weight
    for fused_layer in fused.layers:
        layer = model.layers.pop(0)
        fused_layer.self_attn.o_proj = layer.self_attn.o_proj
        if isinstance(fused_layer.mlp, FusedMLP):
            fused_layer.mlp.down_proj = layer.mlp.down_proj
        fused_layer.load_state_dict(stacked_state(layer), assign=True)
    return fused.eval()
