"""Rotary position embedding (rotate-half) in one pass, rounded as the model's torch code rounds.

With x1, x2 the two halves of a head vector and cos, sin the fp32 tables of its position:

    out[:d/2] = x1 * cos[:d/2] - x2 * sin[:d/2]
    out[d/2:] = x2 * cos[d/2:] + x1 * sin[d/2:]

in fp32, rounded to x's dtype (tables of r < d dims, LLaDA2's partial rotary, rotate the first r dims
and copy the rest). Where torch (nanodllm.model.Rope.apply; here apply_rope_reference) runs a cat, a
negation and four elementwise kernels, each element is read and written once, products and sums
rounded separately (no FMA contraction): equal to torch's bit for bit. x is [batch, heads, t, d]
(usually a transposed view of a [batch, t, heads * d] projection), cos and sin [batch or 1, 1, t, r];
round_products=True is DiffusionGemma's form (tables in x's dtype, each product rounded to it before
the sum, as torch computes it in 16 bits). rope_qk does the same for q and k at once, read from the
stacked q/k/v projection, with SDAR / Qwen3's per-head q/k norm first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["seq_len", "num_rows"])
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xb, stride_xh, stride_xt,
    stride_cb, stride_ct, stride_sb, stride_st,
    stride_ob, stride_oh, stride_ot,
    num_heads, seq_len, num_rows, half, tail,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, ROUND_PRODUCTS: tl.constexpr,
):
    """Grid: (row tiles of BLOCK_R rows,). x and out go through explicit strides; cos and sin through
    any strides with the last dim contiguous (the gathered tables of Rope.rows are views). Rows are
    walked in (batch, t, head) order, the memory order of a projection's output, so the heads of one
    position share their table rows in cache. A program holds BLOCK_R rows as two [BLOCK_R, BLOCK_H]
    halves, BLOCK_H = next power of two of r/2 (masked past it), and the `tail` dims past r in a
    [BLOCK_R, BLOCK_T] tile (BLOCK_T = 0: none). The launch sets enable_fp_fusion=False."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    batch = (rows // (seq_len * num_heads)).to(tl.int64)
    pos = ((rows // num_heads) % seq_len).to(tl.int64)
    head = (rows % num_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < half)[None, :]
    x_rows = x_ptr + batch * stride_xb + head * stride_xh + pos * stride_xt
    out_rows = out_ptr + batch * stride_ob + head * stride_oh + pos * stride_ot
    x1_ptrs = x_rows[:, None] + cols[None, :]
    cos_ptrs = cos_ptr + (batch * stride_cb + pos * stride_ct)[:, None] + cols[None, :]
    sin_ptrs = sin_ptr + (batch * stride_sb + pos * stride_st)[:, None] + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptrs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptrs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    out1_ptrs = out_rows[:, None] + cols[None, :]
    out_dtype = out_ptr.dtype.element_ty
    x1_cos, x2_sin, x2_cos, x1_sin = x1 * cos1, x2 * sin1, x2 * cos2, x1 * sin2
    if ROUND_PRODUCTS:  # each exact in fp32 (two 16-bit mantissas), rounded as a 16-bit product is
        x1_cos, x2_sin = x1_cos.to(out_dtype).to(tl.float32), x2_sin.to(out_dtype).to(tl.float32)
        x2_cos, x1_sin = x2_cos.to(out_dtype).to(tl.float32), x1_sin.to(out_dtype).to(tl.float32)
    tl.store(out1_ptrs, (x1_cos - x2_sin).to(out_dtype), mask=mask)
    tl.store(out1_ptrs + half, (x2_cos + x1_sin).to(out_dtype), mask=mask)
    if BLOCK_T > 0:  # the dims past the rotated ones, as they are
        tail_cols = 2 * half + tl.arange(0, BLOCK_T)
        tail_mask = (rows < num_rows)[:, None] & (tail_cols < 2 * half + tail)[None, :]
        x_tail = tl.load(x_rows[:, None] + tail_cols[None, :], mask=tail_mask)
        tl.store(out_rows[:, None] + tail_cols[None, :], x_tail, mask=tail_mask)


def check_tables(cos, sin, batch: int, seq_len: int, head_dim: int, dtype=torch.float32):
    """The tables' checks; their last dim r (the rotated dims) may be below the head's d."""
    rotated = cos.shape[-1] if cos.dim() == 4 else head_dim
    if rotated % 2:
        raise ValueError(f"the rotated dims must be even (rotate-half pairs their halves), got {rotated}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 4 or table.shape[0] not in (1, batch) or table.shape[1:] != (1, seq_len, rotated) \
                or rotated > head_dim:
            raise ValueError(f"{name} must be [batch or 1, 1, t, r] = [{batch} or 1, 1, {seq_len}, r <= {head_dim}] "
                             f"(and sin as cos), got {tuple(table.shape)}")
        if table.dtype != dtype:
            raise ValueError(f"{name} must be a {str(dtype).removeprefix('torch.')} table, got {table.dtype}")
        if table.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {table.stride()}")


def check_inputs(x, cos, sin, round_products=False):
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [batch, heads, t, d], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x's last dim must be contiguous (stride 1), got strides {x.stride()}")
    batch, _, seq_len, head_dim = x.shape
    check_tables(cos, sin, batch, seq_len, head_dim, x.dtype if round_products else torch.float32)


def empty(shape, like: torch.Tensor) -> torch.Tensor:
    """torch.empty in like's dtype and device; the tests swap in a NaN fill to prove every element is written."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, round_products: bool = False) -> torch.Tensor:
    """x rotated by the tables; see the module docstring.

    x [batch, heads, t, d] float16 / bfloat16 / float32; cos, sin [batch or 1, 1, t, r], r <= d even
    (the first r dims rotate, the rest are copied), float32 (round_products: x's dtype; broadcast over
    heads); every last dim contiguous. Returns x's shape and dtype, laid out as x (torch.empty_like)."""
    check_inputs(x, cos, sin, round_products)
    batch, num_heads, seq_len, head_dim = x.shape
    cos, sin = cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1)  # batch 1: stride 0
    out = torch.empty_like(x)
    num_rows, half, tail = batch * num_heads * seq_len, cos.shape[-1] // 2, head_dim - cos.shape[-1]
    if num_rows and half:
        block_h, block_t = triton.next_power_of_2(half), triton.next_power_of_2(tail) if tail else 0
        block_r = max(1, 2048 // max(block_h, block_t))
        rope_kernel[(triton.cdiv(num_rows, block_r),)](
            x, cos, sin, out,
            x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            num_heads, seq_len, num_rows, half, tail,
            BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_T=block_t, ROUND_PRODUCTS=round_products, num_warps=4,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def qk_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr,
    stride_xb, stride_xt,
    stride_cb, stride_ct, stride_sb, stride_st,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    num_heads, num_kv_heads, seq_len, num_rows, half, tail, eps,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr,
):
    """rope_kernel's walk over the rows (batch, t, q or k head) of the stacked q/k/v projection
    [batch, t, (heads + 2 kv_heads) * d]; with NORM each row is first RMS-normalised and weighted with
    kernels/rmsnorm.py's rounding points."""
    heads_all = num_heads + num_kv_heads
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    batch = (rows // (seq_len * heads_all)).to(tl.int64)
    pos = ((rows // heads_all) % seq_len).to(tl.int64)
    head = (rows % heads_all).to(tl.int64)  # q heads first, then k heads: the packed row's order
    is_q = head < num_heads
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < half
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    x_rows = qkv_ptr + batch * stride_xb + pos * stride_xt + head * (2 * half + tail)
    x1_ptrs = x_rows[:, None] + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    if BLOCK_T > 0:  # the dims past the rotated ones: normed (with NORM), not rotated
        tail_cols = 2 * half + tl.arange(0, BLOCK_T)
        tail_ok = tail_cols < 2 * half + tail
        tail_mask = (rows < num_rows)[:, None] & tail_ok[None, :]
        x_tail = tl.load(x_rows[:, None] + tail_cols[None, :], mask=tail_mask, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm over the whole head, rounded as kernels/rmsnorm.py rounds it
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_T > 0:
            squares += tl.sum(x_tail * x_tail, axis=1)
        rstd = tl.math.rsqrt(squares / (2 * half + tail) + eps)
        pick = is_q[:, None]
        w1 = tl.where(pick, tl.load(q_weight_ptr + cols, mask=col_mask, other=0.0)[None, :].to(tl.float32),
                      tl.load(k_weight_ptr + cols, mask=col_mask, other=0.0)[None, :].to(tl.float32))
        w2 = tl.where(pick, tl.load(q_weight_ptr + half + cols, mask=col_mask, other=0.0)[None, :].to(tl.float32),
                      tl.load(k_weight_ptr + half + cols, mask=col_mask, other=0.0)[None, :].to(tl.float32))
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        if BLOCK_T > 0:
            w_tail = tl.where(pick, tl.load(q_weight_ptr + tail_cols, mask=tail_ok, other=0.0),
                              tl.load(k_weight_ptr + tail_cols, mask=tail_ok, other=0.0))
            x_tail = ((x_tail * rstd[:, None]).to(dtype).to(tl.float32) * w_tail.to(tl.float32)).to(dtype)
    cos_ptrs = cos_ptr + (batch * stride_cb + pos * stride_ct)[:, None] + cols[None, :]
    sin_ptrs = sin_ptr + (batch * stride_sb + pos * stride_st)[:, None] + cols[None, :]
    cos1, cos2 = tl.load(cos_ptrs, mask=mask, other=0.0), tl.load(cos_ptrs + half, mask=mask, other=0.0)
    sin1, sin2 = tl.load(sin_ptrs, mask=mask, other=0.0), tl.load(sin_ptrs + half, mask=mask, other=0.0)
    out1 = (x1 * cos1 - x2 * sin1).to(dtype)
    out2 = (x2 * cos2 + x1 * sin2).to(dtype)
    q_rows = batch * stride_qb + head * stride_qh + pos * stride_qt
    k_rows = batch * stride_kb + (head - num_heads) * stride_kh + pos * stride_kt
    q_mask, k_mask = mask & is_q[:, None], mask & (~is_q)[:, None]
    tl.store(q_ptr + q_rows[:, None] + cols[None, :], out1, mask=q_mask)
    tl.store(q_ptr + q_rows[:, None] + half + cols[None, :], out2, mask=q_mask)
    tl.store(k_ptr + k_rows[:, None] + cols[None, :], out1, mask=k_mask)
    tl.store(k_ptr + k_rows[:, None] + half + cols[None, :], out2, mask=k_mask)
    if BLOCK_T > 0:
        x_tail = x_tail.to(dtype)
        tl.store(q_ptr + q_rows[:, None] + tail_cols[None, :], x_tail, mask=tail_mask & is_q[:, None])
        tl.store(k_ptr + k_rows[:, None] + tail_cols[None, :], x_tail, mask=tail_mask & (~is_q)[:, None])


def rope_qk(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
            head_dim: int | None = None):
    """q and k of a stacked q/k/v projection, each head RMS-normalised (with q_weight / k_weight: SDAR
    and Qwen3's per-head q/k norm) and rotated, in one kernel instead of two norms and two ropes.

    qkv [batch, t, W] with W >= (num_heads + num_kv_heads) * d: q's heads, then k's (v, after them,
    is not read), last dim contiguous; d = head_dim (default: the tables' last dim r); cos, sin as
    apply_rope's, the first r dims of a head rotated; the weights [d] in qkv's dtype, both or neither.
    Returns q [batch, num_heads, t, d] and k [batch, num_kv_heads, t, d] in qkv's dtype, laid out as the
    model's projections are ([batch, t, heads, d] in memory, a transposed view): what rms_norm then
    apply_rope give, rounded at the same points."""
    if qkv.dim() != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [batch, t, W] with a contiguous last dim, got shape {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    batch, seq_len, width = qkv.shape
    head_dim = cos.shape[-1] if head_dim is None else head_dim
    if width < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(f"qkv's last dim {width} is narrower than (num_heads + num_kv_heads) * d = "
                         f"({num_heads} + {num_kv_heads}) * {head_dim}")
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    check_tables(cos, sin, batch, seq_len, head_dim)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight (per-head q/k norm) or neither")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype or weight.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor of qkv's dtype {qkv.dtype}, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
    cos, sin = cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1)
    q = empty((batch, seq_len, num_heads, head_dim), qkv).transpose(1, 2)
    k = empty((batch, seq_len, num_kv_heads, head_dim), qkv).transpose(1, 2)
    num_rows = batch * seq_len * (num_heads + num_kv_heads)
    half, tail = cos.shape[-1] // 2, head_dim - cos.shape[-1]
    if num_rows and half:
        block_h, block_t = triton.next_power_of_2(half), triton.next_power_of_2(tail) if tail else 0
        block_r = max(1, 2048 // max(block_h, block_t))
        norm = q_weight is not None
        weights = (q_weight, k_weight) if norm else (qkv, qkv)  # not read without the norm
        qk_rope_kernel[(triton.cdiv(num_rows, block_r),)](
            qkv, cos, sin, q, k, *weights,
            qkv.stride(0), qkv.stride(1),
            cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
            *q.stride()[:3], *k.stride()[:3],
            num_heads, num_kv_heads, seq_len, num_rows, half, tail, eps,
            BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_T=block_t, NORM=norm, num_warps=4, enable_fp_fusion=False,
        )
    return q, k


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's torch form: fp32 (float64 stays float64) x * cos + rotate_half(x) * sin over the
    tables' r dims, cast back, the rest of x as it is."""
    width = cos.shape[-1]
    x32 = x[..., :width].to(torch.promote_types(x.dtype, torch.float32))
    half = width // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    out = (x32 * cos + rotated * sin).to(x.dtype)
    return out if width == x.shape[-1] else torch.cat([out, x[..., width:]], dim=-1)
