"""RMSNorm in one pass: y = weight * (x * rsqrt(mean(x^2) + eps)), rounded as the model's torch code rounds.

The torch form (nanodllm.model.RMSNorm; here rms_norm_reference) upcasts x to fp32, squares, takes
the mean, adds eps, takes rsqrt, multiplies, casts back to x's dtype and multiplies by the weight:
eight kernels (one a reduction), each reading and writing the whole activation. Here each row is
read once, kept in fp32 registers, and written once, with the same rounding points: the sum of
squares and rstd in fp32, x * rstd rounded to x's dtype, then times the weight in fp32, rounded to
the output dtype (torch's result dtype of weight * x: x's dtype when the weight has it), with no
FMA contraction. Only the sum's order and rsqrt's last bit can differ from torch, so an element can
land one unit in the last place of x's dtype away from it (tests allow two). round_normed=False is
Gemma's form (nanodllm/gemma.py): x * rstd * weight all in fp32, rounded once to x's dtype.
With `add`, the residual add before a norm is fused in: x += add (rounded to x's dtype, as torch's
in-place add rounds) is written back into x and the sum is normalised, one pass instead of two.
x is [..., D] with the last dim contiguous; up to three leading dims are read through explicit
strides (a transposed [batch, heads, t, d] view for q/k norm is read in place).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, add_ptr,
    stride_x0, stride_x1, stride_x2,
    stride_o0, stride_o1, stride_o2,
    stride_a0, stride_a1, stride_a2,
    stride_w, size1, size2, num_rows, dim, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr, ROUND_NORMED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Grid: (row tiles of BLOCK_R rows,). A program holds BLOCK_R whole rows of BLOCK_D = next power of
    two of D elements (the tail masked), BLOCK_R = max(1, 4096 // BLOCK_D): a row of D = 8192 is one
    program of its own. The launch sets enable_fp_fusion=False (no FMA contraction)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i0 = (rows // (size1 * size2)).to(tl.int64)
    i1 = ((rows // size2) % size1).to(tl.int64)
    i2 = (rows % size2).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    x_rows = i0 * stride_x0 + i1 * stride_x1 + i2 * stride_x2
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        add_rows = i0 * stride_a0 + i1 * stride_a1 + i2 * stride_a2
        add = tl.load(add_ptr + add_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = (x + add).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + x_rows[:, None] + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    normed = x * rstd[:, None]
    if ROUND_NORMED:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        normed = normed * tl.load(w_ptr + cols * stride_w, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
    out_rows = i0 * stride_o0 + i1 * stride_o1 + i2 * stride_o2
    tl.store(out_ptr + out_rows[:, None] + cols[None, :], normed.to(out_ptr.dtype.element_ty), mask=mask)


def check_inputs(x, weight, add):
    if add is not None and (add.shape != x.shape or add.dtype not in DTYPES or x.dim() > 4):
        raise ValueError(f"add must have x's shape {tuple(x.shape)} (x at most 4-D: it is written in place) "
                         f"and a float dtype, got {tuple(add.shape)} {add.dtype}")
    if add is not None and add.stride(-1) != 1 and add.shape[-1] > 1:
        raise ValueError(f"add's last dim must be contiguous (stride 1), got strides {add.stride()}")
    if x.dim() == 0:
        raise ValueError("x must have a last dim to normalise over")
    weight_dtype = x.dtype if weight is None else weight.dtype  # None: ones
    if x.dtype not in DTYPES or weight_dtype not in DTYPES:
        raise ValueError(f"x and weight must be float16, bfloat16 or float32, got {x.dtype} and {weight_dtype}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [D] = [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"x's last dim must be contiguous (stride 1), got strides {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, add: torch.Tensor | None = None,
             round_normed: bool = True) -> torch.Tensor:
    """weight * rms-normalised x over the last dim; see the module docstring.

    x [..., D] float16 / bfloat16 / float32, last dim contiguous; weight [D] (None: ones); add: None, or a
    tensor of x's shape added to x in place first (x then at most 4-D); round_normed: x * rstd rounded to
    x's dtype before the weight (False: Gemma's single rounding). Returns x.shape in promote_types(weight's
    dtype, x.dtype) (round_normed=False or no weight: x's dtype), laid out as x (torch.empty_like) where x
    is dense.
    More than three leading dims are merged first by reshape, which copies only when they cannot be
    merged."""
    check_inputs(x, weight, add)
    dim = x.shape[-1]
    shape4 = (1,) * (4 - x.dim()) + tuple(x.shape) if x.dim() < 4 else (math.prod(x.shape[:-3]), *x.shape[-3:])
    x4 = x.reshape(shape4)  # a view (at most 4-D: only leading ones added) when add writes through it
    add4 = add.reshape(shape4) if add is not None else x4  # not read without add
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if round_normed and weight is not None else x.dtype
    out = torch.empty_like(x4, dtype=out_dtype)
    num_rows = x4.numel() // max(dim, 1)
    if num_rows and dim:
        block_d = triton.next_power_of_2(dim)
        block_r = max(1, 4096 // block_d)
        rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x4, x4 if weight is None else weight, out, add4, *x4.stride()[:3], *out.stride()[:3], *add4.stride()[:3],
            0 if weight is None else weight.stride(0), x4.shape[1], x4.shape[2], num_rows, dim, eps,
            BLOCK_R=block_r, BLOCK_D=block_d, HAS_ADD=add is not None, ROUND_NORMED=round_normed,
            HAS_WEIGHT=weight is not None,
            num_warps=min(16, max(4, block_r * block_d // 512)), enable_fp_fusion=False,
        )
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       add: torch.Tensor | None = None, round_normed: bool = True) -> torch.Tensor:
    """The model's torch form: fp32 (float64 stays float64) normalise, cast to x's dtype, times weight
    (after x.add_(add) when add is given); round_normed=False: times the weight in fp32, cast once."""
    if add is not None:
        x.add_(add)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(x.dtype)
    if not round_normed:
        return (normed * weight.to(normed.dtype)).to(x.dtype)
    return weight * normed.to(x.dtype)
