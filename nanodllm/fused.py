"""The model of model.py on the GPU kernels: the same primitives, the same signatures, tested against it.

What changes, where use_kernels(x) holds (CUDA, float16 / bfloat16, outside autograd), and nothing
elsewhere (every fused primitive falls back to its reference):
- q/k/v and gate/up weights are stored back to back (stack_in_place), so each group is one matmul;
  the Parameters and the state dict are unchanged;
- RMSNorm (with the residual add before it), RoPE (for q and k at once, with the per-head q/k norm)
  and SwiGLU's silu(gate) * up are one-pass kernels with the reference's rounding points
  (kernels/rmsnorm.py, rope.py, silu_mul.py);
- o_proj adds into the residual stream in the matmul (add_out), which rounds x + o W^T once;
- the forward carries each layer's MLP output into the next layer's norm, which adds it there;
- over a decode step's few rows (kernels/norm_linear.py MAX_ROWS) the norms and SwiGLU ride inside the
  q/k/v and gate/up matmuls, and o_proj and down_proj add into the residual in their epilogues;
- a mixture of experts stores every expert's gate/up and down back to back, groups the tokens' rows by
  expert and runs one grouped matmul per projection (torch's grouped_mm), with no host sync.
FusedModel is a Model with these modules; the builders (build_empty, build_random, the loader)
make every model one.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import first_use
from kernels.norm_linear import MAX_ROWS, norm_linear
from kernels.rmsnorm import rms_norm
from kernels.rope import apply_rope, rope_qk
from kernels.silu_mul import silu_mul

from .attention import use_kernels
from .config import ModelConfig
from .mlp import MLP, MoE
from .model import Attend, Layer, Model, RMSNorm, Rope

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
CHUNK_TOKENS = 8192  # a long prefill's MLPs run on this many tokens at a time: their wide activations stay small


def stack_in_place(linears: list[nn.Linear]):
    """Re-store the linears' weights (and biases, where all have one) back to back in one tensor, each
    Parameter a view of it. Values are kept; the state dict's names and shapes do not change
    (safetensors refuses to save views of one tensor: clone them first)."""
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
    """(weight, bias) spanning the linears' outputs in order, or None if their parameters were
    replaced since stack_in_place (loaded with assign, moved, cast)."""
    weight = span([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    if weight is None or all(b is None for b in biases):
        return None if weight is None else (weight, None)
    bias = span(biases) if all(b is not None for b in biases) else None
    return None if bias is None else (weight, bias)


def add_linear(x: torch.Tensor, inputs: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x += linear(inputs), in place, the add in the matmul's epilogue when x is contiguous and the
    linear has no bias. inputs [b, t, in] whose sequences are each contiguous but not one block (a
    slice of a longer cache) go through a batched matmul, which reads them in place."""
    if linear.bias is not None or not x.is_contiguous():
        return x.add_(linear(inputs))
    rows_contiguous = inputs.stride(-1) == 1 and inputs.stride(-2) == inputs.shape[-1]
    flat = rows_contiguous and inputs.stride(0) == inputs.shape[1] * inputs.shape[2]
    if inputs.dim() == 3 and inputs.shape[0] > 1 and rows_contiguous and not flat:
        return x.baddbmm_(inputs, linear.weight.t().expand(inputs.shape[0], -1, -1))
    x.view(-1, x.shape[-1]).addmm_(inputs.reshape(-1, inputs.shape[-1]), linear.weight.t())
    return x


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if use_kernels(x) and (add is None or x.dim() <= 4):
            return rms_norm(x, self.weight, self.eps, add)
        return super().forward(x, add)


class FusedRope(Rope):
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        whole_head = self.cos.shape[-1] == x.shape[-1]  # the kernel rotates every dim
        return apply_rope(x, self.cos, self.sin) if use_kernels(x) and whole_head else super().apply(x)


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = stacked([self.gate_proj, self.up_proj]) if use_kernels(x) else None
        if gate_up is None:
            return super().forward(x)
        return by_chunks(lambda rows: self.down_proj(silu_mul(F.linear(rows, *gate_up))), x)


def by_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn, a row-wise map from [n, hidden] to [n, hidden], over x [..., hidden] CHUNK_TOKENS rows at a time."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= CHUNK_TOKENS:
        return fn(flat).view_as(x)
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[0], CHUNK_TOKENS):
        out[start : start + CHUNK_TOKENS] = fn(flat[start : start + CHUNK_TOKENS])
    return out.view_as(x)


class FusedMoE(MoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.stacked_experts() if use_kernels(x) and GROUPED_MM is not None else None
        if weights is None:
            return super().forward(x)
        return by_chunks(lambda rows: self.grouped(rows, *weights), x)

    def grouped(self, flat: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """MoE.forward over tokens [n, hidden], the rows grouped by expert for two grouped matmuls."""
        chosen, routing = self.gate(flat)
        experts = chosen.flatten()
        order = experts.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.zeros(len(self.experts), dtype=torch.int32, device=flat.device)  # bincount would sync
        group_ends = counts.index_add_(0, experts, torch.ones_like(experts, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
        rows = flat[order // chosen.shape[1]]
        hidden = silu_mul(GROUPED_MM(rows, gate_up.transpose(1, 2), offs=group_ends))
        grouped = GROUPED_MM(hidden, down.transpose(1, 2), offs=group_ends)
        outputs = torch.empty_like(grouped).index_copy_(0, order, grouped).view(*chosen.shape, -1)
        y = self.combine(outputs, routing, flat.dtype)
        return y if self.shared_expert is None else y + self.shared_expert(flat)

    def projections(self) -> list[list[nn.Linear]]:
        """Every expert's gate and up (one after the other, expert by expert), and every down."""
        gate_up = [linear for expert in self.experts for linear in (expert.gate_proj, expert.up_proj)]
        return [gate_up, [expert.down_proj for expert in self.experts]]

    def stacked_experts(self):
        """(gate/up [experts, 2 * size, hidden], down [experts, hidden, size]) over the stacked weights,
        or None if they were replaced since stack_in_place (loaded with assign, moved, cast). Checks
        the first and last expert only, so a forward costs O(1) host work, not O(experts): an expert
        in between replaced by hand is not noticed."""
        first, last = self.experts[0], self.experts[-1]
        blocks = [span_between(first.gate_proj.weight, last.up_proj.weight),
                  span_between(first.down_proj.weight, last.down_proj.weight)]
        if any(block is None for block in blocks):
            return None
        return tuple(block.view(len(self.experts), -1, block.shape[-1]) for block in blocks)


def span_between(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor | None:
    """One [rows, cols] view from first's first row to last's last row, where both are contiguous
    [*, cols] views of one storage with last at or after first, else None."""
    size = first.element_size()
    same = first.dtype == last.dtype and first.shape[1:] == last.shape[1:] and first.is_contiguous() and last.is_contiguous()
    if not same or first.untyped_storage().data_ptr() != last.untyped_storage().data_ptr():
        return None
    end = last.data_ptr() + last.numel() * size
    row_bytes = first.shape[1] * size
    if end <= first.data_ptr() or (end - first.data_ptr()) % row_bytes:
        return None
    rows = (end - first.data_ptr()) // row_bytes
    return first.detach().as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())


class FusedLayer(Layer):
    def projections(self) -> list[nn.Linear]:
        return [self.self_attn.q_proj, self.self_attn.k_proj, self.self_attn.v_proj]

    def qkv(self, h: torch.Tensor, rope: Rope):
        weights = stacked(self.projections()) if use_kernels(h) else None
        if weights is None:
            return super().qkv(h, rope)
        return self.split_stacked(F.linear(h, *weights), rope, 3)

    def qk(self, h: torch.Tensor, rope: Rope):
        weights = stacked(self.projections()[:2]) if use_kernels(h) else None
        if weights is None:
            return super().qk(h, rope)
        return self.split_stacked(F.linear(h, *weights), rope, 2)

    def kv(self, h: torch.Tensor, rope: Rope):
        weights = stacked(self.projections()[1:]) if use_kernels(h) else None
        if weights is None:
            return super().kv(h, rope)
        k, v = F.linear(h, *weights).split([self.self_attn.k_proj.out_features] * 2, dim=-1)
        return rope.apply(self.heads(k, self.self_attn.k_norm)), self.heads(v)

    def split_stacked(self, projected: torch.Tensor, rope: Rope, count: int):
        """The stacked projection's output [b, t, W] -> q, k (normed, rotated) and, with count 3, v; q
        and k through one kernel (kernels/rope.py rope_qk) where the q/k norm is per head."""
        attn, cfg = self.self_attn, self.cfg
        widths = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        outputs = projected.split(widths[:count], dim=-1)
        values = tuple(self.heads(v) for v in outputs[2:])
        if cfg.qk_norm != "projection" and projected.dim() == 3 and cfg.rotary_dim == cfg.head_dim:
            norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
            eps = attn.q_norm.eps if cfg.qk_norm else 0.0
            return (*rope_qk(projected, cfg.num_heads, cfg.num_kv_heads, rope.cos, rope.sin, *norms, eps), *values)
        q = rope.apply(self.heads(outputs[0], attn.q_norm))
        return (q, rope.apply(self.heads(outputs[1], attn.k_norm)), *values)

    def add_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        if not use_kernels(x):
            return super().add_out(x, o)
        b, _, t, _ = o.shape
        return add_linear(x, o.transpose(1, 2).reshape(b, t, -1), self.self_attn.o_proj)

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
        weights = self.few_row_weights(x)
        if weights is not None:
            return self.few_row_step(x, pending, rope, attend, *weights)
        q, k, v = self.qkv(self.attn_norm(x, pending), rope)
        return self.mlp(self.mlp_norm(x, self.out(attend(q, k, v))))

    def few_row_weights(self, x: torch.Tensor):
        """(q/k/v weight, bias, gate/up weight) for few_row_step, or None where it does not apply."""
        if x.dim() != 3 or not x.is_contiguous() or x.shape[0] * x.shape[1] > MAX_ROWS:
            return None
        if not isinstance(self.mlp, MLP):  # a mixture of experts runs as itself
            return None
        qkv, gate_up = stacked(self.projections()), stacked([self.mlp.gate_proj, self.mlp.up_proj])
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        if qkv is None or gate_up is None or any(w.dtype != x.dtype for w in (*norms, qkv[0])):
            return None
        return (*qkv, gate_up[0])

    def few_row_step(self, x, pending, rope, attend, qkv_weight, qkv_bias, gate_up_weight) -> None:
        """step over a decode step's few rows: each norm inside the matmul after it, silu(gate) * up in
        gate/up's, o_proj and down_proj adding into x in their epilogues."""
        if pending is not None:
            x.add_(pending)
        norm = self.input_layernorm
        q, k, v = self.split_stacked(norm_linear(x, norm.weight, norm.eps, qkv_weight, qkv_bias), rope, 3)
        self.add_out(x, attend(q, k, v))
        norm = self.post_attention_layernorm
        add_linear(x, norm_linear(x, norm.weight, norm.eps, gate_up_weight, swiglu=True), self.mlp.down_proj)
        return None


class FusedModel(Model):
    """Model whose layers, MLPs and norms are their fused subclasses, which add methods only: the
    parameters and the state dict are a Model's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for module in self.modules():
            module.__class__ = FUSED.get(type(module), type(module))
        self.stack_projections()

    def rope(self, positions: torch.Tensor) -> Rope:
        return FusedRope(positions, self.cfg.rotary_dim, self.cfg.rope_base)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        if not use_kernels(self.embed_tokens.weight):
            return super().hidden(ids, positions, attend)
        x, rope = self.embed(ids), self.rope(positions)  # x: a fresh tensor, updated in place
        pending = None
        for i, layer in enumerate(self.layers):
            pending = layer.step(x, pending, rope, partial(attend, i))
        return x if pending is None else x.add_(pending)

    def stack_projections(self):
        """Each layer's q/k/v and gate/up weights back to back (stack_in_place). Moving or casting the
        model afterwards (.to, .cuda, .half) stacks them again."""
        for module in reversed(list(self.modules())):  # each expert's gate/up pair, then all experts
            if isinstance(module, FusedLayer):
                stack_in_place(module.projections())
            elif isinstance(module, FusedMLP):
                stack_in_place([module.gate_proj, module.up_proj])
            elif isinstance(module, FusedMoE):
                for linears in module.projections():
                    stack_in_place(linears)
        self.projections_stacked = True

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)  # gives every Parameter a tensor of its own
        if getattr(self, "projections_stacked", False):
            self.stack_projections()
        return self


FUSED = {Layer: FusedLayer, MLP: FusedMLP, MoE: FusedMoE, RMSNorm: FusedRMSNorm}


def build_empty(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16) -> FusedModel:
    """A fused model with uninitialised parameters allocated once, in `dtype`, directly on `device`
    (built on the meta device first, so no CPU or fp32 copy of an 8B model is ever made)."""
    first_use.start(device, dtype)  # on a GPU, overlaps the loading, which waits for it (kernels/first_use.py)
    with torch.device("meta"):
        model = FusedModel(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval()


def build_random(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> FusedModel:
    """A model of cfg's shape with N(0, 0.02) weights (norms 1) for speed benchmarks and tests."""
    model = build_empty(cfg, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    first_use.wait()
    return model
