"""Approximate attention update over salient columns (DyLLM, Algorithm 4), merged with the salient
rows' exact attention, in place, with the cosine statistics fused.

Between two denoising steps only the salient tokens get fresh keys and values. A row whose own
attention is not recomputed updates its cached context C by the change the salient values make:

    C_new[i] = C_old[i] + sum over salient j of  min(exp(scale * q_i . k_j - lse_i), 1) * (v_j - v_j_old)

with lse_i the row's cached softmax normaliser, so the full score matrix is never formed and only
the salient columns' K rows are read. The clamp at 1, the bound of a true softmax weight, keeps a
stale normaliser from weighting a fresh column far above any softmax (the contexts would drift).
The rows recomputed exactly come in as `merge` and are written in the same pass; with both kinds
the kernel writes context and lse in place and returns, per (row, head), the sums new . old,
new . new and old . old that DyLLM's next cosine needs. Query head h reads KV head h // group.
Reference: approximate_attention_reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)
# tuned on DyLLM's llada-8b sparse steps at batch 16 (docs/results/bench_dyllm.md): 3 stages when the
# columns span several tiles, 1 when they fit in one (a single pass has nothing to pipeline)
CUDA_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}


@triton.jit(do_not_specialize=["stride_cb", "stride_fb", "stride_fh", "num_columns"])
def approx_attention_kernel(
    q_ptr, k_ptr, dv_ptr, columns_ptr, counts_ptr, lse_ptr, context_ptr, stats_ptr,
    exact_ptr, exact_lse_ptr, slots_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_cb, stride_cs,
    stride_lb, stride_lh, stride_ll,
    stride_xb, stride_xh, stride_xl, stride_xd,
    stride_sb, stride_sh, stride_sl,
    stride_eb, stride_eh, stride_es, stride_ed,
    stride_fb, stride_fh, stride_fs,
    stride_pb, stride_pl,
    num_heads, group, num_rows, num_columns, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    """Program (query tile of BLOCK_M rows, batch * head): holds its query tile and walks the salient
    list in tiles of BLOCK_N columns, gathering K rows by token index (whole D-element rows, coalesced
    per row) and the matching value deltas; scores in base 2 with the scale folded in. The token
    indices come as a [BLOCK_N, 1] column (the K tile's row layout) one tile ahead, as in
    kernels/sparse_decode_attention.py. Every row is read and written by one program only, so the
    update in place is safe. One pass over the cache replaces a gather, a select and a scatter of the
    exact rows, the statistics' reductions and a copy of the whole context."""
    m_tile, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // num_heads, batch_head % num_heads
    kv_head = head // group
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < num_rows
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_ql + dims[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    lse_at = lse_ptr + batch * stride_lb + head * stride_lh + rows * stride_ll
    lse2 = tl.load(lse_at, mask=row_ok, other=0.0) * 1.4426950408889634  # natural log -> base 2
    # the old contexts (and the exact rows) are loaded before the column loop, so that their reads
    # overlap it rather than wait behind it
    context_at = (context_ptr + batch * stride_xb + head * stride_xh + rows[:, None] * stride_xl
                  + dims[None, :] * stride_xd)
    old = tl.load(context_at, mask=row_ok[:, None], other=0.0)
    if MERGE:
        slot = tl.load(slots_ptr + batch * stride_pb + rows * stride_pl, mask=row_ok, other=-1)
        exact_row = (slot >= 0) & row_ok
        slot = tl.where(exact_row, slot, 0).to(tl.int64)
        exact = tl.load(exact_ptr + batch * stride_eb + head * stride_eh + slot[:, None] * stride_es
                        + dims[None, :] * stride_ed, mask=exact_row[:, None], other=0.0)
    count = tl.load(counts_ptr + batch) if HAS_COUNTS else num_columns
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    # [BLOCK_N, 1]: a tile's salient tokens, loaded in the layout of the K tile's rows, one tile ahead
    columns_at = columns_ptr + batch * stride_cb + tl.arange(0, BLOCK_N)[:, None] * stride_cs
    tokens = tl.load(columns_at, mask=tl.arange(0, BLOCK_N)[:, None] < count, other=0)
    for start in range(0, count, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < count
        k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + tokens.to(tl.int64) * stride_kn
                    + dims[None, :] * stride_kd, mask=slot_ok[:, None], other=0.0)
        tokens = tl.load(columns_at + (start + BLOCK_N) * stride_cs, mask=(slots + BLOCK_N)[:, None] < count, other=0)
        dv = tl.load(dv_ptr + batch * stride_vb + kv_head * stride_vh + slots[:, None] * stride_vs
                     + dims[None, :] * stride_vd, mask=slot_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # base 2
        p = tl.exp2(tl.minimum(scores - lse2[:, None], 0.0))  # a softmax weight is at most 1
        p = tl.where(slot_ok[None, :] & row_ok[:, None], p, 0.0)
        acc += tl.dot(p.to(dv.dtype), dv)
    old = old.to(tl.float32)
    new = old + acc
    if MERGE:
        new = tl.where(exact_row[:, None], exact.to(tl.float32), new)
        exact_lse = tl.load(exact_lse_ptr + batch * stride_fb + head * stride_fh + slot * stride_fs,
                            mask=exact_row, other=0.0)
        tl.store(lse_at, exact_lse, mask=exact_row)
    tl.store(context_at, new.to(context_ptr.dtype.element_ty), mask=row_ok[:, None])
    stats = stats_ptr + batch * stride_sb + head * stride_sh + rows * stride_sl
    tl.store(stats, tl.sum(new * old, axis=1), mask=row_ok)
    tl.store(stats + 1, tl.sum(new * new, axis=1), mask=row_ok)
    tl.store(stats + 2, tl.sum(old * old, axis=1), mask=row_ok)


def check_inputs(q, k, dv, columns, counts, lse, context, merge):
    if q.dim() != 4 or k.dim() != 4 or dv.dim() != 4:
        raise ValueError("q, k and dv must be 4-D: [batch, heads, rows, D], [batch, kv_heads, N, D], "
                         "[batch, kv_heads, S, D]")
    batch, num_heads, num_rows, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or num_heads % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if dv.shape[:2] != k.shape[:2] or dv.shape[3] != head_dim:
        raise ValueError(f"dv must be [batch, kv_heads, S, D] = [{batch}, {k.shape[1]}, S, {head_dim}], "
                         f"got {tuple(dv.shape)}")
    if columns.shape != (batch, dv.shape[2]):
        raise ValueError(f"columns must be [batch, S] = [{batch}, {dv.shape[2]}], got {tuple(columns.shape)}")
    if counts is not None and counts.shape != (batch,):
        raise ValueError(f"counts must be [batch] = [{batch}], got {tuple(counts.shape)}")
    if lse.shape != q.shape[:3] or context.shape != q.shape:
        raise ValueError(f"lse must be {tuple(q.shape[:3])} and context {tuple(q.shape)}, "
                         f"got {tuple(lse.shape)} and {tuple(context.shape)}")
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {head_dim}")
    if merge is not None:
        exact, exact_lse, slots = merge
        if exact.dim() != 4 or exact.shape[:2] != q.shape[:2] or exact.shape[3] != head_dim:
            raise ValueError(f"merge's exact must be [batch, heads, E, D] = [{batch}, {num_heads}, E, {head_dim}], "
                             f"got {tuple(exact.shape)}")
        if exact_lse.shape != exact.shape[:3] or slots.shape != (batch, num_rows):
            raise ValueError(f"merge's lse must be {tuple(exact.shape[:3])} and slots [batch, rows] = "
                             f"[{batch}, {num_rows}], got {tuple(exact_lse.shape)} and {tuple(slots.shape)}")


def approximate_attention(q, k, dv, columns, counts, lse, context, merge=None, *, scale=None):
    """Update cached contexts in place by the salient columns' value deltas; see the module docstring.

    q [batch, heads, rows, D]: the rows' queries (fresh); k [batch, kv_heads, N, D]: every key, the
    salient ones fresh; dv [batch, kv_heads, S, D]: v_new - v_old of the salient columns;
    columns [batch, S] int: their token indices into N (entries past counts[b] are ignored);
    counts [batch] int, or None: every listed column (DyLLM lists fixed-size sets whose unused entries
    carry a zero value delta); lse [batch, heads, rows] float32: each row's cached normaliser;
    context [batch, heads, rows, D]: each row's cached context (any strides);
    merge: None, or (exact [batch, heads, E, D], exact_lse [batch, heads, E], slots [batch, rows] int):
    a row with slots >= 0 takes exact[slots] and exact_lse[slots] instead of the update.
    context (and, with merge, lse) are overwritten. Returns stats [batch, heads, rows, 3] float32:
    new . old, new . new, old . old per head (DyLLM picks the next salient rows by that cosine, over
    all heads together; the caller adds the heads up). Why the weight is clamped at 1:
    docs/results/masked_methods_accuracy.md."""
    check_inputs(q, k, dv, columns, counts, lse, context, merge)
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 (it is updated in place), got {lse.dtype}")
    batch, num_heads, num_rows, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    stats = torch.empty(batch, num_heads, num_rows, 3, dtype=torch.float32, device=q.device)
    exact, exact_lse, slots = merge if merge is not None else (context, lse, columns)  # unread without merge
    if q.is_cuda:
        tiles = dict(CUDA_TILES, num_stages=1 if dv.shape[2] <= CUDA_TILES["BLOCK_N"] else 3)
    else:
        tiles = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    grid = (triton.cdiv(num_rows, tiles["BLOCK_M"]), batch * num_heads)
    approx_attention_kernel[grid](
        q, k, dv, columns, columns if counts is None else counts, lse, context, stats, exact, exact_lse, slots,
        *q.stride(), *k.stride(), *dv.stride(), *columns.stride(), *lse.stride(), *context.stride(),
        *stats.stride()[:3], *exact.stride(), *exact_lse.stride(), *slots.stride(),
        num_heads, num_heads // k.shape[1], num_rows, columns.shape[1], scale * LOG2_E,
        HEAD_DIM=head_dim, MERGE=merge is not None, HAS_COUNTS=counts is not None, **tiles,
    )
    return stats


def approximate_attention_reference(q, k, dv, columns, counts, lse, context, merge=None, *, scale=None):
    """Plain torch, fp32 (float64 for float64 inputs): gather the salient keys, min(exp(s - lse), 1) dv,
    then the merged rows; context and lse updated in place as the kernel does."""
    batch, num_heads, num_rows, head_dim = q.shape
    kv_heads, group = k.shape[1], num_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    index = columns.long()[:, None, :, None].expand(-1, kv_heads, -1, head_dim)
    keys = k.gather(2, index).to(compute).repeat_interleave(group, dim=1)  # [batch, heads, S, D]
    deltas = dv.to(compute).repeat_interleave(group, dim=1)
    scores = q.to(compute) @ keys.transpose(-1, -2) * scale
    weights = (scores - lse.to(compute)[..., None]).clamp(max=0).exp()
    slots = torch.arange(columns.shape[1], device=q.device)
    if counts is not None:
        weights = weights.masked_fill(~(slots[None, :] < counts[:, None])[:, None, None, :], 0.0)
    old = context.to(compute)
    new = old + weights @ deltas
    if merge is not None:
        exact, exact_lse, rows_slot = merge
        exact_row = (rows_slot >= 0)[:, None, :].expand(-1, num_heads, -1)
        at = rows_slot.long().clamp(min=0)[:, None, :].expand(-1, num_heads, -1)
        picked = exact.to(compute).gather(2, at[..., None].expand(-1, -1, -1, head_dim))
        new = torch.where(exact_row[..., None], picked, new)
        lse.copy_(torch.where(exact_row, exact_lse.to(lse.dtype).gather(2, at), lse))
    stats = torch.stack([(new * old).sum(-1), (new * new).sum(-1), (old * old).sum(-1)], dim=-1)
    context.copy_(new)
    return stats.float()
