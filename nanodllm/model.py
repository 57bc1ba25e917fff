"""The decoder: embedding, layers, final norm, head. Architecture only, no decoding policy.

Module names follow Qwen3 (embed_tokens, layers.i.self_attn.q_proj, ..., norm, lm_head); the loader
maps each family's tensor names onto them. A layer exposes the primitives a method recombines:

    h = layer.attn_norm(x)
    q, k, v = layer.qkv(h, rope)          # projections, optional q/k norm, RoPE; [b, heads, t, d]
    q, k = layer.qk(h, rope)              # the same without v
    q, v = layer.query(h, rope), layer.value(h)   # one projection alone
    k, v = layer.kv(h, rope)              # without q
    x = x + layer.out(attend(q, k, v))    # attention is always somebody else's callback
    x = x + layer.mlp(layer.mlp_norm(x))

`Model.forward(ids, positions, attend)` composes them, calling `attend(layer_idx, q, k, v)`; its
residual adds run inside the next norm (Layer.step), which rounds as the separate adds above do.
Numerics follow the references: RMSNorm in fp32 then cast then weight; RoPE tables and rotation in
fp32 (LLaDA's rope_full_precision), cast back to the activation dtype. On CUDA in float16 / bfloat16
outside autograd, both run as one-pass Triton kernels (kernels/rmsnorm.py, kernels/rope.py) with the
same rounding points, as does SwiGLU's silu(gate) * up (kernels/silu_mul.py). Over the few rows of a
block-decode step (at most 32) a layer's norms and SwiGLU ride inside its matmuls instead
(kernels/norm_linear.py) and o_proj and down_proj add into x in the matmul, which rounds x + o @ W^T
once where the separate add rounds the product first (Layer.step). NANODLLM_KERNELS=0 keeps all of
them on torch. Models from build_empty (the loader, build_random) store q/k/v and gate/up weights
back to back, so each group is one matmul at inference (stack_in_place); the Parameters and their
names are unchanged.
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
        # cos and sin in one table, so that Rope.rows takes both with one gather
        self.table = torch.empty(2, *angles.shape, dtype=angles.dtype, device=angles.device)
        self.cos, self.sin = torch.cos(angles, out=self.table[0]), torch.sin(angles, out=self.table[1])

    def rows(self, rows: torch.Tensor) -> "Rope":
        """The tables at some positions only: rows [batch, s] indexes this Rope's t (no recompute)."""
        index = rows[None, :, None, :, None].expand(2, -1, 1, -1, self.cos.shape[-1])
        picked = Rope.__new__(Rope)
        picked.table = self.table.gather(3, index)
        picked.cos, picked.sin = picked.table[0], picked.table[1]
        return picked

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            from kernels.rope import apply_rope

            return apply_rope(x, self.cos, self.sin)
        x32 = fp32_or_wider(x)
        half = x32.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * self.cos + rotated * self.sin).to(x.dtype)


def stack_in_place(linears: list[nn.Linear]):
    """Re-store the linears' weights (and biases, where all have one) back to back in one tensor, each
    Parameter a view of it, so that `stacked` can run all of them as one matmul. Values are kept; the
    state dict's names and shapes do not change (safetensors refuses to save views of one tensor:
    clone them first)."""
    for attr in ("weight", "bias"):
        parts = [getattr(linear, attr) for linear in linears]
        if any(part is None for part in parts):
            continue
        block = torch.cat([part.detach() for part in parts])
        start = 0
        for linear, part in zip(linears, parts):
            setattr(linear, attr, nn.Parameter(block[start : start + part.shape[0]], requires_grad=part.requires_grad))
            start += part.shape[0]


def span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over parts that lie back to back in one storage (stack_in_place's layout), else None."""
    first = parts[0]
    address = first.data_ptr()
    for part in parts:
        if part.data_ptr() != address or part.dtype != first.dtype or not part.is_contiguous():
            return None
        address += part.numel() * part.element_size()
    storage = first.untyped_storage()
    if address > storage.data_ptr() + storage.nbytes():  # adjacent by chance, not one tensor
        return None
    rows = sum(part.shape[0] for part in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def stacked(linears: list[nn.Linear]):
    """(weight, bias) spanning the linears' outputs in order, views of the tensors stack_in_place made;
    None under autograd (the views are not the Parameters) or if the parameters were replaced since
    (loaded with assign, moved, cast)."""
    if torch.is_grad_enabled():
        return None
    weight = span([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    if weight is None or all(b is None for b in biases):
        return None if weight is None else (weight, None)
    bias = span(biases) if all(b is not None for b in biases) else None
    return None if bias is None else (weight, bias)


def add_linear(x: torch.Tensor, inputs: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x += linear(inputs), in place: one matmul with the add in its epilogue when x is contiguous and
    the linear has no bias (x [b, t, out] must be a tensor nothing else still reads). inputs [b, t, in]
    whose sequences are each contiguous but not one block (a slice of a longer cache: DyLLM's
    response-only steps) go through a batched matmul, which reads them in place; flattening them would
    copy them first (16 x 256 rows of 4096: 221 -> 183 us with o_proj, H100)."""
    if linear.bias is not None or not x.is_contiguous():
        return x.add_(linear(inputs))
    if inputs.dim() == 3 and inputs.shape[0] > 1 and rows_contiguous(inputs) and not flat(inputs):
        return x.baddbmm_(inputs, linear.weight.t().expand(inputs.shape[0], -1, -1))
    x.view(-1, x.shape[-1]).addmm_(inputs.reshape(-1, inputs.shape[-1]), linear.weight.t())
    return x


def rows_contiguous(t: torch.Tensor) -> bool:
    """[b, rows, width] with each sequence's rows one after another."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def flat(t: torch.Tensor) -> bool:
    """[b, rows, width] whose sequences follow one another: viewable as [b * rows, width]."""
    return rows_contiguous(t) and t.stride(0) == t.shape[1] * t.shape[2]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up over [..., gate | up] (one fused kernel on CUDA, see kernels/silu_mul.py)."""
    if use_fused(gate_up):
        from kernels.silu_mul import silu_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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

    def projections(self) -> list[nn.Linear]:
        return [self.q_proj, self.k_proj, self.v_proj]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = stacked([self.gate_proj, self.up_proj])
        if gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(silu_mul(F.linear(x, *gate_up)))


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
        """[b, t, hidden] -> q [b, heads, t, d], k and v [b, kv_heads, t, d]; RoPE applied to q, k.
        One matmul when the projections are stacked (build_empty stacks them); on CUDA the per-head
        q/k norm and RoPE of q and k then run as one kernel (kernels/rope.py rope_qk)."""
        return self._project(h, rope, self.self_attn.projections())

    def qk(self, h: torch.Tensor, rope: Rope):
        """q and k as qkv gives them, without v's share of the matmul (caches that project v apart)."""
        return self._project(h, rope, self.self_attn.projections()[:2])

    def kv(self, h: torch.Tensor, rope: Rope):
        """k and v as qkv gives them, without q's share of the matmul (rows whose query is not needed)."""
        attn = self.self_attn
        weights = stacked([attn.k_proj, attn.v_proj])
        k, v = (attn.k_proj(h), attn.v_proj(h)) if weights is None else F.linear(h, *weights).split(
            [attn.k_proj.out_features, attn.v_proj.out_features], dim=-1)
        return rope.apply(self._heads(k, getattr(attn, "k_norm", None))), self._split_heads(v)

    def _project(self, h: torch.Tensor, rope: Rope, projections: list[nn.Linear]):
        """q and k (normed, rotated) and, if projections has v_proj too, v."""
        weights = stacked(projections)
        if weights is None:
            return self._rotate([proj(h) for proj in projections], rope)
        return self._split_stacked(F.linear(h, *weights), rope, len(projections))

    def _split_stacked(self, projected: torch.Tensor, rope: Rope, count: int):
        """The stacked projection's output [b, t, W] -> q, k (normed, rotated) and, with count 3, v."""
        attn, cfg = self.self_attn, self.cfg
        widths = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        outputs = projected.split(widths[:count], dim=-1)
        if use_fused(projected) and cfg.qk_norm != "projection" and projected.dim() == 3:
            from kernels.rope import rope_qk

            norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
            eps = attn.q_norm.eps if cfg.qk_norm else 0.0
            q, k = rope_qk(projected, cfg.num_heads, cfg.num_kv_heads, rope.cos, rope.sin, *norms, eps)
            return (q, k, *(self._split_heads(v) for v in outputs[2:]))
        return self._rotate(outputs, rope)

    def _rotate(self, outputs: list[torch.Tensor], rope: Rope):
        """The projections' outputs [b, t, heads * d] -> q, k q/k-normed and rotated, and v split into heads."""
        attn = self.self_attn
        q = rope.apply(self._heads(outputs[0], getattr(attn, "q_norm", None)))
        k = rope.apply(self._heads(outputs[1], getattr(attn, "k_norm", None)))
        return (q, k, *(self._split_heads(v) for v in outputs[2:]))

    def query(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[b, t, hidden] -> q [b, heads, t, d] alone, normed (q/k norm) and rotated."""
        attn = self.self_attn
        return rope.apply(self._heads(attn.q_proj(h), getattr(attn, "q_norm", None)))

    def _heads(self, projected: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """[b, t, heads * d] -> [b, heads, t, d], q/k-normed (cfg.qk_norm) over the whole projection or per head."""
        if self.cfg.qk_norm == "projection":
            projected = norm(projected)
        heads = self._split_heads(projected)
        return norm(heads) if self.cfg.qk_norm == "head" else heads

    def _split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[b, t, heads * d] -> a [b, heads, t, d] view."""
        b, t = projected.shape[:2]
        return projected.view(b, t, -1, self.cfg.head_dim).transpose(1, 2)

    def value(self, h: torch.Tensor) -> torch.Tensor:
        """[b, t, hidden] -> v [b, kv_heads, t, d] alone (caches that watch value drift)."""
        return self._split_heads(self.self_attn.v_proj(h))

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output [b, heads, t, d] -> [b, t, hidden] through o_proj."""
        b, _, t, _ = o.shape
        return self.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x += out(o), in place (see add_linear)."""
        b, _, t, _ = o.shape
        return add_linear(x, o.transpose(1, 2).reshape(b, t, -1), self.self_attn.o_proj)

    def mlp_norm(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return self.post_attention_layernorm(x, add)

    def step(self, x: torch.Tensor, pending: torch.Tensor | None, rope: Rope, attend: Callable):
        """The layer on the residual stream x, in place: x += pending (the previous layer's MLP output),
        x += attention output, each add fused into the norm after it; returns this layer's MLP output,
        not yet added (the next layer's norm adds it), or None where it was added already (the
        few-row path). x must be a tensor nothing else reads."""
        weights = self._few_row_weights(x)
        if weights is not None:
            return self._few_row_step(x, pending, rope, attend, *weights)
        q, k, v = self.qkv(self.attn_norm(x, pending), rope)
        return self.mlp(self.mlp_norm(x, self.out(attend(q, k, v))))

    def _few_row_weights(self, x: torch.Tensor):
        """(q/k/v weight, bias, gate/up weight) for _few_row_step, or None where it does not apply: off
        the fused kernels, over more rows than kernels/norm_linear.py takes, or unstacked weights."""
        from kernels.norm_linear import MAX_ROWS

        if not use_fused(x) or x.dim() != 3 or not x.is_contiguous() or x.shape[0] * x.shape[1] > MAX_ROWS:
            return None
        qkv, gate_up = stacked(self.self_attn.projections()), stacked([self.mlp.gate_proj, self.mlp.up_proj])
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        if qkv is None or gate_up is None or any(w.dtype != x.dtype for w in (*norms, qkv[0])):
            return None
        return (*qkv, gate_up[0])

    def _few_row_step(self, x, pending, rope, attend, qkv_weight, qkv_bias, gate_up_weight) -> None:
        """step for a decode step's few rows (kernels/norm_linear.py): each norm rides in the matmul
        after it, silu(gate) * up in gate/up's, and o_proj and down_proj add into x in their epilogues,
        four launches where the unfused step runs seven around the attention."""
        from kernels.norm_linear import norm_linear

        if pending is not None:
            x.add_(pending)
        norm = self.input_layernorm
        q, k, v = self._split_stacked(norm_linear(x, norm.weight, norm.eps, qkv_weight, qkv_bias), rope, 3)
        self.add_out(x, attend(q, k, v))
        norm = self.post_attention_layernorm
        act = norm_linear(x, norm.weight, norm.eps, gate_up_weight, swiglu=True)
        add_linear(x, act, self.mlp.down_proj)
        return None

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        """x + attention + MLP, out of place."""
        x = x.clone()
        pending = self.step(x, None, rope, attend)
        return x if pending is None else x.add_(pending)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def stack_projections(self):
        """Store each layer's q/k/v and gate/up weights back to back (stack_in_place): one matmul each.
        Moving or casting the model afterwards (.to, .cuda, .float) stacks them again."""
        for layer in self.layers:
            stack_in_place(layer.self_attn.projections())
            stack_in_place([layer.mlp.gate_proj, layer.mlp.up_proj])
        self.projections_stacked = True

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)  # gives every Parameter a tensor of its own
        if getattr(self, "projections_stacked", False):
            self.stack_projections()
        return self

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
        x, rope = self.embed(ids), self.rope(positions)  # x: a fresh tensor, updated in place
        pending = None
        for i, layer in enumerate(self.layers):
            pending = layer.step(x, pending, rope, lambda q, k, v, i=i: attend(i, q, k, v))
        return x if pending is None else x.add_(pending)

    def forward(self, ids, positions, attend: Attend, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Logits for positions start..stop-1 of a forward over all of `ids`."""
        return self.head(self.hidden(ids, positions, attend), start, stop)


def build_empty(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16) -> Model:
    """A model with uninitialised parameters allocated once, in `dtype`, directly on `device`
    (built on the meta device first, so no CPU or fp32 copy of an 8B model is ever made), its
    projections stacked (Model.stack_projections)."""
    with torch.device("meta"):
        model = Model(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.stack_projections()
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
