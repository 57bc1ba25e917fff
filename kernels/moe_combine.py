"""Each token's k expert outputs, weighted and summed, read where the grouped matmuls left them.

    out[t] = sum_j weights[t, j] * rows[slot_of[t * k + j]]      in fp32, cast to rows' dtype

The experts' grouped matmuls leave their output rows sorted by expert: row i belongs to the (token,
slot) pair order[i] = token * k + slot. In torch the sum takes an un-permute (index_copy), a cast of
every row to fp32, a multiply and a reduction: four passes over the k rows of each token, two of them
in fp32. Here a program owns BLOCK columns of one token and reads its k rows once, through slot_of
(the inverse of order). Rounding as MoE.combine: each row cast to fp32 and multiplied by its fp32
weight (no FMA contraction: the launch sets enable_fp_fusion=False), the products added in slot order
(torch may add them in another order, a difference of fp32 rounding before the cast), one cast at the
end. The reference is moe_combine_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024


@triton.jit
def moe_combine_kernel(rows_ptr, slot_of_ptr, weights_ptr, out_ptr, width, stride_rows, stride_weights, stride_out,
                       K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    total = tl.zeros((BLOCK,), tl.float32)
    for slot in tl.static_range(K):
        row = tl.load(slot_of_ptr + token * K + slot).to(tl.int64)
        weight = tl.load(weights_ptr + token * stride_weights + slot)
        total += tl.load(rows_ptr + row * stride_rows + cols, mask=in_row, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)


def check_inputs(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor):
    if rows.dim() != 2 or weights.dim() != 2 or order.shape != (rows.shape[0],) or rows.shape[0] != weights.numel():
        raise ValueError(f"need rows [n * k, width], order [n * k] and weights [n, k]; got {tuple(rows.shape)}, "
                         f"{tuple(order.shape)} and {tuple(weights.shape)}")
    if rows.dtype not in DTYPES or weights.dtype != torch.float32 or order.dtype != torch.int64:
        raise ValueError(f"rows must be one of {DTYPES}, weights float32 and order int64 (a sort's); got {rows.dtype}, "
                         f"{weights.dtype} and {order.dtype}")
    if rows.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError(f"the last dims must be contiguous, got strides {rows.stride()} and {weights.stride()}")


def moe_combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [n * k, width], row i the output for the (token, slot) pair order[i] (a permutation of
    0 .. n*k - 1, token * k + slot); weights [n, k] float32. Returns [n, width] in rows' dtype."""
    check_inputs(rows, order, weights)
    tokens, k = weights.shape
    slot_of = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    out = torch.empty((tokens, rows.shape[1]), device=rows.device, dtype=rows.dtype)
    if out.numel():
        grid = (tokens, triton.cdiv(rows.shape[1], BLOCK))
        moe_combine_kernel[grid](rows, slot_of, weights, out, rows.shape[1], rows.stride(0), weights.stride(0),
                                 out.stride(0), K=k, BLOCK=BLOCK, enable_fp_fusion=False)
    return out


def moe_combine_reference(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The torch form: un-permute, then MoE.combine's fp32 weighted sum, cast to rows' dtype."""
    check_inputs(rows, order, weights)
    outputs = torch.empty_like(rows).index_copy_(0, order, rows).view(*weights.shape, -1)
    return (outputs.float() * weights[..., None]).sum(dim=1).to(rows.dtype)
