"""Bidirectional attention for heads too wide for flash_attention's registers, in two matmuls.

    out = softmax(scale * q k^T) v over each batch row's first key_counts[b] keys

At head_dim 512 one program of kernels/flash_attention.py cannot hold a 128-row fp32 accumulator, so it
computes q . k twice, once per half of the output columns (V_PARTS = 2). Here the two products are two
kernels, neither with a wide accumulator. `_probs_kernel` computes a [BLOCK_M, BLOCK_N] tile of scores s
(base 2) and writes p = 2^(s - m), m the tile's row max rounded up to a whole number (p rounded to the
inputs' dtype, as flash rounds p before its second dot), with m and the fp32 row sum l.
`_values_kernel` owns BLOCK_D output columns of BLOCK_M rows: with M each row's max m over its tiles,
it sums (2^(m - M) p) @ v tile by tile (an exact scaling: a power of two) and divides by the sum of
2^(m - M) l. The probabilities make a round trip through memory (2 bytes a score), which at a canvas's
256 queries against many keys costs less than the second q . k. The queries of one KV head's GQA group
are packed as rows, so every tile of keys is read once per group. q [batch, heads, N_q, D], k and v
[batch, kv_heads, N_k, D].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)
LN_2 = tl.constexpr(math.log(2.0))
# Tiles for DiffusionGemma's full layers (a canvas of 256 against 8K-128K keys, head_dim 512, bfloat16; their
# times: docs/results/bench_diffusiongemma.md): 128 x 128 tiles of scores summed over 64-deep slices of the
# head, the values in 128 columns. 256-row or 256-key tiles ran slower or out of shared memory.
PROBS_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_D=64, num_warps=8, num_stages=3)
VALUES_TILES = dict(BLOCK_M=128, BLOCK_D=128, num_warps=8, num_stages=3)
FLOAT32_TILES = (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=32, num_warps=4, num_stages=2),  # tests: fit in shared memory
                 dict(BLOCK_M=64, BLOCK_D=64, num_warps=4, num_stages=2))
INTERPRETER_TILES = (dict(BLOCK_M=32, BLOCK_N=16, BLOCK_D=16), dict(BLOCK_M=32, BLOCK_D=16))
PROBS_BYTES = 8 << 30  # the probabilities one launch writes at most: a 128K cache's canvas of 256 is 1 GiB a row


@triton.jit
def _group_rows(tile, n_q, group, kv_head, BLOCK_M: tl.constexpr):
    """The packed rows of a tile: row r of a KV head's group is query r % n_q of head kv_head * group + r // n_q."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows < group * n_q, kv_head * group + rows // n_q, rows % n_q


@triton.jit
def _probs_kernel(q_ptr, k_ptr, counts_ptr, p_ptr, m_ptr, l_ptr,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_pg, stride_pr,
                  stride_mg, stride_mr, n_q, n_k, group, kv_heads, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    tile_n, pair = tl.program_id(1), tl.program_id(2)  # pair: (batch row, KV head)
    batch, kv_head = pair // kv_heads, pair % kv_heads
    count = tl.minimum(tl.load(counts_ptr + batch), n_k)
    if tile_n * BLOCK_N < count:  # tiles past a row's keys are never read
        rows, row_ok, head, query = _group_rows(tl.program_id(0), n_q, group, kv_head, BLOCK_M)
        keys = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < count
        q_rows = (q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                  + query.to(tl.int64) * stride_qn)
        k_cols = (k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
                  + keys.to(tl.int64) * stride_kn)
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        precision: tl.constexpr = "ieee" if q_ptr.dtype.element_ty == tl.float32 else "tf32"  # fp32: tests, exact
        for d in range(0, HEAD_DIM, BLOCK_D):
            dims = d + tl.arange(0, BLOCK_D)
            q = tl.load(q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
            k = tl.load(k_cols[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, k, s, input_precision=precision)
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m = tl.math.ceil(tl.max(s, 1))  # finite (the tile's first key is visible), and whole: see _values_kernel
        p = tl.math.exp2(s - m[:, None])
        group_p = p_ptr + pair.to(tl.int64) * stride_pg + rows.to(tl.int64) * stride_pr
        tl.store(group_p[:, None] + keys[None, :], p.to(p_ptr.dtype.element_ty), mask=row_ok[:, None])
        stats = pair * stride_mg + rows * stride_mr + tile_n
        tl.store(m_ptr + stats, m, mask=row_ok)
        tl.store(l_ptr + stats, tl.sum(p, 1), mask=row_ok)


@triton.jit
def _values_kernel(p_ptr, m_ptr, l_ptr, v_ptr, counts_ptr, out_ptr, lse_ptr,
                   stride_pg, stride_pr, stride_mg, stride_mr, stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_on, stride_lb, stride_lh, n_q, n_k, group, kv_heads,
                   RETURN_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pair = tl.program_id(2)
    batch, kv_head = pair // kv_heads, pair % kv_heads
    count = tl.minimum(tl.load(counts_ptr + batch), n_k)
    tiles = tl.cdiv(count, BLOCK_N)
    rows, row_ok, head, query = _group_rows(tl.program_id(0), n_q, group, kv_head, BLOCK_M)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    stats = pair * stride_mg + rows * stride_mr  # row r's tile t: m_ptr / l_ptr + stats + t
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # each row's largest score, base 2
    for t in range(0, tiles):
        top = tl.maximum(top, tl.load(m_ptr + stats + t, mask=row_ok, other=0.0))
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    precision: tl.constexpr = "ieee" if p_ptr.dtype.element_ty == tl.float32 else "tf32"  # fp32: tests, exact
    group_p = p_ptr + pair.to(tl.int64) * stride_pg + rows.to(tl.int64) * stride_pr
    v_tile = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + dims[None, :]
    for t in range(0, tiles):
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
        weight = tl.math.exp2(tl.load(m_ptr + stats + t, mask=row_ok, other=0.0) - top)  # a power of two: m, top whole
        total += weight * tl.load(l_ptr + stats + t, mask=row_ok, other=0.0)
        p = tl.load(group_p[:, None] + keys[None, :], mask=row_ok[:, None], other=0.0)
        p = p * weight.to(p.dtype)[:, None]  # exact: p's rounding stays the only one
        v = tl.load(v_tile + keys[:, None].to(tl.int64) * stride_vn, mask=keys[:, None] < count, other=0.0)
        acc = tl.dot(p, v, acc, input_precision=precision)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = (out_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + query.to(tl.int64) * stride_on)
    tl.store(out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        if tl.program_id(1) == 0:
            lse = tl.where(total > 0, (top + tl.math.log2(tl.where(total > 0, total, 1.0))) * LN_2, float("-inf"))
            tl.store(lse_ptr + batch * stride_lb + head * stride_lh + query, lse, mask=row_ok)


def wide_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_counts: torch.Tensor, *,
                   scale: float | None = None, return_lse: bool = False):
    """softmax(scale * q k^T) v with GQA, row b attending to its first key_counts[b] keys (key_counts [batch]
    int32 or int64; counts past N_k read N_k; the keys past it are never read, so they may hold anything).
    Returns out [batch, heads, N_q, D] in q's dtype, laid out [batch, N_q, heads, D] in memory as
    flash_attention's, and with return_lse lse [batch, heads, N_q] float32 (natural log). A row with no keys
    gets out = 0 and lse = -inf. The batch goes in slices whose probabilities fit PROBS_BYTES (a row at a
    time past it)."""
    _check_inputs(q, k, v, key_counts, scale)
    q, k, v = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k, v))
    batch, heads, n_q, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    probs_tiles, values_tiles = (FLOAT32_TILES if q.dtype == torch.float32 else (PROBS_TILES, VALUES_TILES)) \
        if q.is_cuda else INTERPRETER_TILES
    narrow = lambda tiles: dict(tiles, BLOCK_D=min(tiles["BLOCK_D"], head_dim))  # a tile's columns within a head
    probs_tiles, values_tiles = narrow(probs_tiles), narrow(dict(values_tiles, BLOCK_N=probs_tiles["BLOCK_N"]))
    out = _output((batch, n_q, heads, head_dim), q.dtype, q.device).transpose(1, 2)
    lse = _output((batch, heads, n_q), torch.float32, q.device) if return_lse else None
    keys = triton.cdiv(k.shape[2], probs_tiles["BLOCK_N"]) * probs_tiles["BLOCK_N"]
    rows = max(1, PROBS_BYTES // (heads * n_q * keys * q.element_size()))
    for first in range(0, batch, rows):
        part = slice(first, first + rows)
        probs = probabilities(q[part], k[part], key_counts[part], scale, probs_tiles)
        values(q[part], probs, v[part], key_counts[part], out[part], None if lse is None else lse[part], values_tiles)
    return (out, lse) if return_lse else out


def probabilities(q, k, key_counts, scale, tiles):
    """_probs_kernel's (p, m, l): p [batch * kv_heads, group * N_q, N_k rounded up to BLOCK_N] in q's dtype, m
    and l [batch * kv_heads, group * N_q, key tiles] float32, m base 2."""
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group, tiles_n = heads // kv_heads, triton.cdiv(n_k, tiles["BLOCK_N"])
    p = torch.empty((batch * kv_heads, group * n_q, tiles_n * tiles["BLOCK_N"]), dtype=q.dtype, device=q.device)
    m, l = (torch.empty((batch * kv_heads, group * n_q, tiles_n), dtype=torch.float32, device=q.device)
            for _ in range(2))
    _probs_kernel[(triton.cdiv(group * n_q, tiles["BLOCK_M"]), tiles_n, batch * kv_heads)](
        q, k, key_counts, p, m, l, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        p.stride(0), p.stride(1), m.stride(0), m.stride(1), n_q, n_k, group, kv_heads, scale * LOG2_E,
        HEAD_DIM=head_dim, **tiles)
    return p, m, l


def values(q, probs, v, key_counts, out, lse, tiles):
    """_values_kernel: out [batch, heads, N_q, D] (and lse [batch, heads, N_q] where not None) written from
    probabilities' (p, m, l) and v."""
    (batch, heads, n_q, head_dim), kv_heads = q.shape, v.shape[1]
    p, m, l = probs
    lse_strides = (0, 0) if lse is None else lse.stride()[:2]
    grid = (triton.cdiv(p.shape[1], tiles["BLOCK_M"]), triton.cdiv(head_dim, tiles["BLOCK_D"]), batch * kv_heads)
    _values_kernel[grid](
        p, m, l, v, key_counts, out, m if lse is None else lse, p.stride(0), p.stride(1), m.stride(0), m.stride(1),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), *lse_strides, n_q,
        v.shape[2], heads // kv_heads, kv_heads, RETURN_LSE=lse is not None, **tiles)


def _output(shape, dtype, device) -> torch.Tensor:
    """torch.empty; the tests swap in a NaN fill to prove the kernel writes every element."""
    return torch.empty(shape, dtype=dtype, device=device)


def wide_attention_reference(q, k, v, key_counts, *, scale=None, return_lse=False):
    """Plain torch, same signature and outputs: the full score matrix and softmax in fp32, out cast to q's dtype."""
    _check_inputs(q, k, v, key_counts, scale)
    scale = q.shape[3] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [batch, heads, N_q, N_k]
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < key_counts[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # -inf where a row sees no key
    out = (torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None]) @ v).to(q.dtype)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v, key_counts, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [batch, heads, seq, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share float16, bfloat16 or float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device or key_counts.device != q.device:
        raise ValueError(f"q, k, v and key_counts must be on one device, got {q.device}, {k.device}, {v.device}, "
                         f"{key_counts.device}")
    batch, heads, n_q, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must be [batch, kv_heads, N_k, D] matching q {tuple(q.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two from 16, got {head_dim}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({k.shape[1]})")
    if batch == 0 or heads == 0 or n_q == 0 or k.shape[2] == 0:
        raise ValueError(f"empty inputs are not supported: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if key_counts.shape != (batch,) or key_counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"key_counts must be int32 or int64 [{batch}], got {key_counts.dtype} "
                         f"{tuple(key_counts.shape)}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
