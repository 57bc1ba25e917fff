"""Rotary position embedding (rotate-half) in one pass, rounded as the model's torch code rounds.

With x1, x2 the two halves of a head vector and cos, sin the fp32 tables of its position:

    out[:d/2] = x1 * cos[:d/2] - x2 * sin[:d/2]
    out[d/2:] = x2 * cos[d/2:] + x1 * sin[d/2:]

in fp32, rounded to x's dtype: the torch form (nanodllm.model.Rope.apply) builds the rotated copy with
torch.cat and a negation and runs four more elementwise kernels; here each element is read once and
written once. Products and sums are rounded separately (the launch sets enable_fp_fusion=False, so no
FMA contraction), which makes the result equal to torch's bit for bit.

Grid: (row tiles of BLOCK_R rows,). x is [batch, heads, t, d] with the last dim contiguous, read and
written through explicit strides (the usual x is a transposed view of a [batch, t, heads * d]
projection); cos and sin are [batch or 1, 1, t, d], any strides with the last dim contiguous (the
gathered tables of Rope.rows are views). Rows are walked in (batch, t, head) order, the memory order
of a projection's output, so the heads of one position share their table rows in cache. A program
holds BLOCK_R rows as two [BLOCK_R, BLOCK_H] halves, BLOCK_H = next power of two of d/2 (tail masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xb, stride_xh, stride_xt,
    stride_cb, stride_ct, stride_sb, stride_st,
    stride_ob, stride_oh, stride_ot,
    num_heads, seq_len, num_rows, half,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    batch = (rows // (seq_len * num_heads)).to(tl.int64)
    pos = ((rows // num_heads) % seq_len).to(tl.int64)
    head = (rows % num_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < half)[None, :]
    x1_ptrs = x_ptr + (batch * stride_xb + head * stride_xh + pos * stride_xt)[:, None] + cols[None, :]
    cos_ptrs = cos_ptr + (batch * stride_cb + pos * stride_ct)[:, None] + cols[None, :]
    sin_ptrs = sin_ptr + (batch * stride_sb + pos * stride_st)[:, None] + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    cos1, cos2 = tl.load(cos_ptrs, mask=mask, other=0.0), tl.load(cos_ptrs + half, mask=mask, other=0.0)
    sin1, sin2 = tl.load(sin_ptrs, mask=mask, other=0.0), tl.load(sin_ptrs + half, mask=mask, other=0.0)
    out1_ptrs = out_ptr + (batch * stride_ob + head * stride_oh + pos * stride_ot)[:, None] + cols[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out1_ptrs, (x1 * cos1 - x2 * sin1).to(out_dtype), mask=mask)
    tl.store(out1_ptrs + half, (x2 * cos2 + x1 * sin2).to(out_dtype), mask=mask)


def check_inputs(x, cos, sin):
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [batch, heads, t, d], got shape {tuple(x.shape)}")
    batch, _, seq_len, head_dim = x.shape
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if head_dim % 2:
        raise ValueError(f"the head dim must be even (rotate-half pairs its halves), got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 4 or table.shape[0] not in (1, batch) or table.shape[1:] != (1, seq_len, head_dim):
            raise ValueError(f"{name} must be [batch or 1, 1, t, d] = [{batch} or 1, 1, {seq_len}, {head_dim}], "
                             f"got {tuple(table.shape)}")
        if table.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 table, got {table.dtype}")
    for name, tensor in (("x", x), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {tensor.stride()}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the tables; see the module docstring.

    x [batch, heads, t, d] float16 / bfloat16 / float32, d even; cos, sin [batch or 1, 1, t, d]
    float32 (broadcast over heads); every last dim contiguous. Returns x's shape and dtype, laid
    out as x (torch.empty_like)."""
    check_inputs(x, cos, sin)
    batch, num_heads, seq_len, head_dim = x.shape
    cos, sin = cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1)  # batch 1: stride 0
    out = torch.empty_like(x)
    num_rows, half = batch * num_heads * seq_len, head_dim // 2
    if num_rows and half:
        block_h = triton.next_power_of_2(half)
        block_r = max(1, 2048 // block_h)
        rope_kernel[(triton.cdiv(num_rows, block_r),)](
            x, cos, sin, out,
            x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            num_heads, seq_len, num_rows, half,
            BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False,
        )
    return out


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's torch form: fp32 (float64 stays float64) x * cos + rotate_half(x) * sin, cast back."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
