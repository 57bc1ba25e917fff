"""Each token's k expert outputs, weighted and summed, read where the grouped matmuls left them.

    out[t] = sum_j weights[t, j] * rows[slot_of[t * k + j]]      in fp32, cast to rows' dtype

The experts' grouped matmuls leave their output rows sorted by expert: the (token, slot) pair t * k + j
lies in row slot_of[t * k + j] (kernels/expert_linear.py group_by_expert). In torch the sum takes an
un-permute, a cast of every row to fp32, a multiply and a reduction: four passes over the k rows of each
token, two of them in fp32. Here a program owns BLOCK columns of one token and reads its k rows once;
rows from rows_end on (a rank's pairs of experts held elsewhere, left unwritten) count as zeros and
are not read. Rounding as MoE.combine: each row cast to fp32 and multiplied by its fp32
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
def moe_combine_kernel(rows_ptr, slot_of_ptr, weights_ptr, rows_end_ptr, out_ptr, width, stride_rows, stride_weights,
                       stride_out, K: tl.constexpr, BLOCK: tl.constexpr, ROWS_END: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    rows_end = 0
    if ROWS_END:  # the rows from it on were never written
        rows_end = tl.load(rows_end_ptr).to(tl.int64)
    total = tl.zeros((BLOCK,), tl.float32)
    for slot in tl.static_range(K):
        row = tl.load(slot_of_ptr + token * K + slot).to(tl.int64)
        weight = tl.load(weights_ptr + token * stride_weights + slot)
        written = in_row
        if ROWS_END:
            written = written & (tl.zeros_like(cols) + row < rows_end)
        total += tl.load(rows_ptr + row * stride_rows + cols, mask=written, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)


def check_inputs(rows: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor, rows_end: torch.Tensor | None):
    if rows.dim() != 2 or weights.dim() != 2 or slot_of.shape != (rows.shape[0],) or rows.shape[0] != weights.numel():
        raise ValueError(f"need rows [n * k, width], slot_of [n * k] and weights [n, k]; got {tuple(rows.shape)}, "
                         f"{tuple(slot_of.shape)} and {tuple(weights.shape)}")
    if rows.dtype not in DTYPES or weights.dtype != torch.float32 or slot_of.dtype != torch.int64:
        raise ValueError(f"rows must be one of {DTYPES}, weights float32 and slot_of int64; got {rows.dtype}, "
                         f"{weights.dtype} and {slot_of.dtype}")
    if rows_end is not None and (rows_end.shape != (1,) or rows_end.dtype != torch.int32):
        raise ValueError(f"rows_end must be one int32 (group_ends[-1:]); got {tuple(rows_end.shape)} {rows_end.dtype}")
    if rows.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError(f"the last dims must be contiguous, got strides {rows.stride()} and {weights.stride()}")


def moe_combine(rows: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor,
                rows_end: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n * k, width], the (token, slot) pair token * k + slot's output in row slot_of[pair] (a
    permutation of 0 .. n*k - 1); weights [n, k] float32; rows_end [1] int32 (default: every row written).
    Returns [n, width] in rows' dtype."""
    check_inputs(rows, slot_of, weights, rows_end)
    tokens, k = weights.shape
    out = torch.empty((tokens, rows.shape[1]), device=rows.device, dtype=rows.dtype)
    if out.numel():
        grid = (tokens, triton.cdiv(rows.shape[1], BLOCK))
        moe_combine_kernel[grid](rows, slot_of, weights, slot_of if rows_end is None else rows_end, out, rows.shape[1],
                                 rows.stride(0), weights.stride(0), out.stride(0), K=k, BLOCK=BLOCK,
                                 ROWS_END=rows_end is not None, enable_fp_fusion=False)
    return out


def moe_combine_reference(rows: torch.Tensor, slot_of: torch.Tensor, weights: torch.Tensor,
                          rows_end: torch.Tensor | None = None) -> torch.Tensor:
    """The torch form: un-permute, then MoE.combine's fp32 weighted sum, cast to rows' dtype."""
    check_inputs(rows, slot_of, weights, rows_end)
    if rows_end is not None:
        rows = rows.masked_fill(torch.arange(len(rows), device=rows.device)[:, None] >= rows_end, 0.0)
    outputs = rows[slot_of].view(*weights.shape, -1)
    return (outputs.float() * weights[..., None]).sum(dim=1).to(rows.dtype)
