"""dLLM-Cache's drift test in two small launches: how far each response row's value vector moved, and
which rows moved most.

    drift[b, r] = 1 - cos(new[b, :, r, :], cached[b, :, r, :])     (all KV heads and dims of row r)
    cached[b, :, r, :] = new[b, :, r, :]                          (in the same pass)
    rows[b] = the `count` rows of largest drift, largest first, ties to the lower row

The cosine is dot / (max(|new|, eps) * max(|cached|, eps)) with fp32 sums, as torch's
cosine_similarity defines it. In torch the test is two fp32 copies, two norms, a product and its
sum, the copy of the new values into the cache and a topk; here value_drift reads new and cached
once and writes cached in the same pass, and most_drifted ranks the drifts. A NaN drift (values
that were not finite) ranks above every number, as torch.sort places it. The references are
value_drift_reference and most_drifted_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-8  # torch.nn.functional.cosine_similarity's default
TILE_ELEMENTS = 4096  # value_drift's [heads, head_dim] tile: 32 KV heads of 128 in one load
# When True, outputs start as NaN (drift) or -1 (rows), so an element a kernel forgets fails the tests.
DEBUG_POISON = False


def output(shape, dtype, device) -> torch.Tensor:
    if DEBUG_POISON:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def value_drift_kernel(new_ptr, cached_ptr, drift_ptr,
                       stride_nb, stride_nh, stride_nr, stride_nd,
                       stride_cb, stride_ch, stride_cr, stride_cd,
                       stride_db, stride_dr,
                       num_heads, head_dim, eps,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row, batch): its row's KV heads in chunks of BLOCK_H (one [BLOCK_H, head_dim] tile of
    TILE_ELEMENTS at most), so a few hundred rows still fill the GPU."""
    row, batch = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    new_row = new_ptr + batch.to(tl.int64) * stride_nb + row.to(tl.int64) * stride_nr
    cached_row = cached_ptr + batch.to(tl.int64) * stride_cb + row.to(tl.int64) * stride_cr
    dot = tl.zeros([BLOCK_H], tl.float32)
    new_sq = tl.zeros([BLOCK_H], tl.float32)
    cached_sq = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, num_heads, BLOCK_H):
        heads = start + tl.arange(0, BLOCK_H)
        ok = (heads < num_heads)[:, None] & (dims < head_dim)[None, :]
        new_at = new_row + heads[:, None] * stride_nh + dims[None, :] * stride_nd
        cached_at = cached_row + heads[:, None] * stride_ch + dims[None, :] * stride_cd
        fresh = tl.load(new_at, mask=ok, other=0.0)
        new = fresh.to(tl.float32)
        cached = tl.load(cached_at, mask=ok, other=0.0).to(tl.float32)
        dot += tl.sum(new * cached, axis=1)
        new_sq += tl.sum(new * new, axis=1)
        cached_sq += tl.sum(cached * cached, axis=1)
        tl.store(cached_at, fresh, mask=ok)  # after the sums have read the old value
    norms = tl.maximum(tl.sqrt(tl.sum(new_sq, axis=0)), eps) * tl.maximum(tl.sqrt(tl.sum(cached_sq, axis=0)), eps)
    tl.store(drift_ptr + batch.to(tl.int64) * stride_db + row * stride_dr, 1.0 - tl.sum(dot, axis=0) / norms)


@triton.jit
def most_drifted_kernel(drift_ptr, out_ptr, stride_db, stride_dr, stride_ob, stride_oc, num_rows, count,
                        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program (row tile of BLOCK_I, batch): ranks its rows against every row (rank = rows with larger
    drift, or equal drift and a lower index), so the ranks are distinct and row i is written at
    position rank[i] when rank[i] < count. That costs rows^2 comparisons, cheap for the few hundred
    rows of a response. NaN ranks above every number, so every slot of the output is still written."""
    tile, batch = tl.program_id(0), tl.program_id(1)
    rows = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    drift_base = drift_ptr + batch.to(tl.int64) * stride_db
    mine = tl.load(drift_base + rows * stride_dr, mask=rows < num_rows, other=0.0)
    mine = tl.where(mine != mine, float("inf"), mine)  # NaN ranks first, as in torch.sort
    rank = tl.zeros([BLOCK_I], tl.int32)
    for start in range(0, num_rows, BLOCK_J):
        others = start + tl.arange(0, BLOCK_J)
        theirs = tl.load(drift_base + others * stride_dr, mask=others < num_rows, other=0.0)
        theirs = tl.where(theirs != theirs, float("inf"), theirs)
        tied = (theirs[None, :] == mine[:, None]) & (others[None, :] < rows[:, None])
        ahead = (theirs[None, :] > mine[:, None]) | tied
        rank += tl.sum((ahead & (others < num_rows)[None, :]).to(tl.int32), axis=1)
    tl.store(out_ptr + batch.to(tl.int64) * stride_ob + rank * stride_oc, rows.to(tl.int64),
             mask=(rows < num_rows) & (rank < count))


def check_values(new: torch.Tensor, cached: torch.Tensor):
    if new.dim() != 4 or new.shape != cached.shape:
        raise ValueError(f"new and cached must be [batch, kv_heads, rows, head_dim] of one shape, got "
                         f"{tuple(new.shape)} and {tuple(cached.shape)}")
    if new.dtype != cached.dtype or new.device != cached.device:
        raise ValueError(f"new and cached must share dtype and device, got {new.dtype} on {new.device} and "
                         f"{cached.dtype} on {cached.device}")


def value_drift(new: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """new, cached [batch, kv_heads, rows, head_dim] (any strides, one dtype) -> drift [batch, rows]
    float32; cached is overwritten with new."""
    check_values(new, cached)
    batch, heads, rows, head_dim = new.shape
    drift = output((batch, rows), torch.float32, new.device)
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(heads), max(1, TILE_ELEMENTS // block_d))
    if rows == 0 or batch == 0:
        return drift
    value_drift_kernel[(rows, batch)](
        new, cached, drift, *new.stride(), *cached.stride(), *drift.stride(), heads, head_dim, EPS,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return drift


def value_drift_reference(new: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    check_values(new, cached)
    batch, _, rows, _ = new.shape
    flat = lambda x: x.transpose(1, 2).reshape(batch, rows, -1).float()
    a, b = flat(new), flat(cached)
    norms = a.norm(dim=-1).clamp(min=EPS) * b.norm(dim=-1).clamp(min=EPS)
    drift = 1 - (a * b).sum(dim=-1) / norms
    cached.copy_(new)
    return drift


def check_drift(drift: torch.Tensor, count: int):
    if drift.dim() != 2 or drift.dtype != torch.float32:
        raise ValueError(f"drift must be a float32 [batch, rows] tensor, got {drift.dtype} {tuple(drift.shape)}")
    if not 0 <= count <= drift.shape[1]:
        raise ValueError(f"count must lie in [0, rows] = [0, {drift.shape[1]}], got {count}")


def most_drifted(drift: torch.Tensor, count: int) -> torch.Tensor:
    """drift [batch, rows] float32 -> [batch, count] int64: the rows of largest drift, largest first,
    ties to the lower row."""
    check_drift(drift, count)
    batch, rows = drift.shape
    out = output((batch, count), torch.int64, drift.device)
    if count:
        block_i, block_j = 32, 128
        most_drifted_kernel[(triton.cdiv(rows, block_i), batch)](
            drift, out, *drift.stride(), *out.stride(), rows, count, BLOCK_I=block_i, BLOCK_J=block_j, num_warps=4)
    return out


def most_drifted_reference(drift: torch.Tensor, count: int) -> torch.Tensor:
    check_drift(drift, count)
    return drift.sort(dim=1, descending=True, stable=True).indices[:, :count]
