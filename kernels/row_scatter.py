"""Write listed rows into a cache where a flag says so, optionally returning what each write changed.

    dst[b, h, rows[b, j]] = src[b, h, j]          for every j with ok[b, j]
    delta[b, h, j] = src[b, h, j] - old value      (0 where not ok; the old value read before the write)

DyLLM's sparse steps write the salient rows' fresh keys, values and FFN outputs into their caches.
Their row lists have a fixed length (so the steps can be graphed), padded with rows that must keep
their cached values (ok False). In torch that is a gather, a select, a scatter and, for the deltas
the approximate update needs, a subtraction: four launches. Here each listed row is read once and
written once (the old row read too for the delta). dst is [batch, heads, n, width], src and delta
[batch, heads, s, width], all through explicit strides (a [batch, n, width] cache is passed as
dst[:, None]); rows [batch, s] int must be distinct within a batch row; ok [batch, s] bool. The
difference is taken in fp32 and rounded to delta's dtype, as torch's subtraction rounds. The
reference is put_rows_where_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_rb", "stride_ob", "num_slots"])
def row_scatter_kernel(
    dst_ptr, src_ptr, rows_ptr, ok_ptr, delta_ptr,
    stride_db, stride_dh, stride_dn, stride_dw,
    stride_sb, stride_sh, stride_ss, stride_sw,
    stride_rb, stride_rs,
    stride_ob, stride_os,
    stride_eb, stride_eh, stride_es, stride_ew,
    num_heads, num_slots, width,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, DELTA: tl.constexpr,
):
    """Grid: (slot tiles of BLOCK_S, batch * heads, width tiles of BLOCK_W). Each destination row is
    written by one program only (rows are distinct within a batch row)."""
    s_tile, batch_head, w_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, head = batch_head // num_heads, batch_head % num_heads
    slots = s_tile * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = w_tile * BLOCK_W + tl.arange(0, BLOCK_W)
    slot_in = slots < num_slots
    rows = tl.load(rows_ptr + batch * stride_rb + slots * stride_rs, mask=slot_in, other=0).to(tl.int64)
    ok = tl.load(ok_ptr + batch * stride_ob + slots * stride_os, mask=slot_in, other=0) != 0
    inside = slot_in[:, None] & (cols < width)[None, :]
    write = inside & ok[:, None]
    src = tl.load(src_ptr + batch * stride_sb + head * stride_sh + slots[:, None] * stride_ss
                  + cols[None, :] * stride_sw, mask=inside, other=0.0)
    dst_at = dst_ptr + batch * stride_db + head * stride_dh + rows[:, None] * stride_dn + cols[None, :] * stride_dw
    if DELTA:
        old = tl.load(dst_at, mask=write, other=0.0)
        delta = tl.where(write, src.to(tl.float32) - old.to(tl.float32), 0.0)
        tl.store(delta_ptr + batch * stride_eb + head * stride_eh + slots[:, None] * stride_es
                 + cols[None, :] * stride_ew, delta.to(delta_ptr.dtype.element_ty), mask=inside)
    tl.store(dst_at, src.to(dst_ptr.dtype.element_ty), mask=write)


def check_inputs(dst, rows, ok, src):
    if dst.dim() != 4 or src.dim() != 4:
        raise ValueError(f"dst and src must be 4-D [batch, heads, n, width] and [batch, heads, s, width], "
                         f"got {tuple(dst.shape)} and {tuple(src.shape)}")
    batch, heads, _, width = dst.shape
    if src.shape[:2] != (batch, heads) or src.shape[3] != width:
        raise ValueError(f"src must be [{batch}, {heads}, s, {width}], got {tuple(src.shape)}")
    if rows.shape != (batch, src.shape[2]) or ok.shape != rows.shape:
        raise ValueError(f"rows and ok must be [batch, s] = [{batch}, {src.shape[2]}], "
                         f"got {tuple(rows.shape)} and {tuple(ok.shape)}")
    if ok.dtype != torch.bool:
        raise ValueError(f"ok must be bool, got {ok.dtype}")


def put_rows_where(dst, rows, ok, src, delta: bool = False):
    """dst[b, h, rows[b, j]] = src[b, h, j] where ok[b, j], in place; see the module docstring.
    Returns delta [batch, heads, s, width] in src's dtype (src - old, 0 where not ok) when asked, else None."""
    check_inputs(dst, rows, ok, src)
    batch, heads, _, width = dst.shape
    slots = src.shape[2]
    out = torch.empty_like(src) if delta else src  # not written without delta
    if slots == 0 or width == 0:
        return out if delta else None
    block_w = min(triton.next_power_of_2(width), 256 if dst.is_cuda else 64)
    block_s = max(1, 2048 // block_w) if dst.is_cuda else 4
    grid = (triton.cdiv(slots, block_s), batch * heads, triton.cdiv(width, block_w))
    row_scatter_kernel[grid](
        dst, src, rows, ok, out,
        *dst.stride(), *src.stride(), *rows.stride(), *ok.stride(), *out.stride(),
        heads, slots, width,
        BLOCK_S=block_s, BLOCK_W=block_w, DELTA=delta, num_warps=4,
    )
    return out if delta else None


def put_rows_where_reference(dst, rows, ok, src, delta: bool = False):
    """Plain torch: gather the old rows, select, scatter back (and the difference, in fp32 or src's dtype
    where wider, rounded to src's dtype)."""
    index = rows.long()[:, None, :, None].expand(-1, dst.shape[1], -1, dst.shape[3])
    old = dst.gather(2, index)
    new = torch.where(ok[:, None, :, None], src.to(dst.dtype), old)
    dst.scatter_(2, index, new)
    wide = torch.promote_types(src.dtype, torch.float32)
    return (new.to(wide) - old.to(wide)).to(src.dtype) if delta else None
