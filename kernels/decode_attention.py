"""Block-decode attention: the L queries of the active block against each row's KV cache.

Row b attends to the keys 0 .. lengths[b]-1 of its cache: the cached prefix followed by the
block's own L keys, which the engine wrote right after it (no mask among them).

Algorithm (split-KV, "flash-decoding"):
1. GQA packing. The `group` query heads that share a KV head, times the L queries, form one query
   tile of group * L rows, so every K/V tile loaded from memory serves the whole group.
2. Split-KV. The keys of a row are cut into `num_splits` contiguous slices, one program per (query
   tile, slice, batch row * KV head), so even batch 1 fills every SM; each writes its normalised
   partial output and base-2 partial log-sum-exp to scratch (a slice past the row's length: 0, -inf).
3. Merge. A small kernel combines the slices of each query row, weighting slice s by
   2^(lse_s - max_s lse_s), and writes the output in q's dtype and the natural-log LSE.
K and V are read in place through their strides ([batch, capacity, kv_heads, head_dim]). The jit
helpers are shared with sparse_decode_attention.py. The reference is decode_attention_reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_inputs import check_decode_lengths, check_query_and_cache, score_scale
from .device import shared_memory_limit, sm_count

LOG2E = tl.constexpr(math.log2(math.e))  # kernels use it as is, host code as LOG2E.value
LN2 = tl.constexpr(math.log(2.0))
DENSE_MAX_QUERIES = 256  # decode_attention's own limit: past it flash_attention wins (docs/results/bench_routing.md)
MIN_KEYS_PER_SPLIT = 256  # a slice's partial (group*L*D) must stay small next to its K/V
MAX_SPLITS = 128  # the merge holds all of a row's slices in registers
MERGE_TILE = 2048  # elements of partial output per merge warp (merge_launch)
INTERPRETER_SMS = 4  # "SM count" used to pick splits off the GPU (TRITON_INTERPRET=1)
# 4 stages of 64-key tiles (160 KB of shared memory at D = 128): the best of a sweep of that tile at
# 32K-128K keys, kept where dense_tiles keeps the tile (head_dim 64, float32); the sparse kernel's
# gathers do better with default_tiles' 3.
DENSE_STAGES = 4
SHARED_MEMORY_BUDGET = 200 * 1024  # of sm_90's 227 KB per block: room for barriers and layout conversions
WIDE_KEY_TILES = {"BLOCK_N": 128, "num_stages": 3}  # dense_tiles' at D = 128 in 16 bits: 192 KB of K + V

DEBUG_POISON = False  # True (tests): buffers a kernel must fill start as NaN, so an unwritten element fails


@triton.jit
def load_query_tile(q_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head, m_tile,
                    group, num_queries, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The GQA group's queries as one tile: row r is query r % L of head kv_head*group + r // L.
    Returns the tile and its row numbers within the group (rows >= group*L are padding, zeros)."""
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + rows // num_queries
    offsets = (batch.to(tl.int64) * stride_qb + heads.to(tl.int64) * stride_qh
               + (rows % num_queries).to(tl.int64) * stride_ql)
    # [BLOCK_M, HEAD_DIM]
    q = tl.load(q_ptr + offsets[:, None] + dims[None, :].to(tl.int64) * stride_qd,
                mask=(rows < group * num_queries)[:, None], other=0.0)
    return q, rows


@triton.jit
def attend_tile(q, k, v, key_valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, ALL_VALID: tl.constexpr):
    """One online-softmax step over a tile of keys, statistics in base 2: m_i is the running row
    max of the log2-scaled scores, l_i the running sum of 2^(score - m_i), acc the unnormalised
    output. Invalid keys get score -inf; a tile with no valid key leaves everything unchanged.
    ALL_VALID: every key of the tile is valid (key_valid is not read): no select, no guard of an all -inf row. The
    scale (> 0) is applied to the row max and inside the exponent, one fused multiply-add."""
    # [BLOCK_M, BLOCK_N]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if not ALL_VALID:
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    m_ref = m_new
    if not ALL_VALID:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp2 gives 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    # [BLOCK_M, BLOCK_N]
    p = tl.exp2(scores * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # [BLOCK_M, HEAD_DIM]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_partial(part_out_ptr, part_lse_ptr, acc, m_i, l_i, rows, batch_head, split, num_splits,
                  num_rows, HEAD_DIM: tl.constexpr):
    """Write one slice's normalised output (in part_out's dtype) and base-2 LSE (fp32) to the scratch
    part_out [batch*kv_heads, num_splits, num_rows, HEAD_DIM], part_lse [..., num_rows]."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    # [BLOCK_M, HEAD_DIM]
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    row_index = (batch_head.to(tl.int64) * num_splits + split) * num_rows + rows
    row_valid = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    tl.store(part_lse_ptr + row_index, lse, mask=row_valid)
    tl.store(part_out_ptr + row_index[:, None] * HEAD_DIM + dims[None, :], out.to(part_out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


@triton.jit
def attend_keys(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start, end, qk_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The query tile against keys [start, end) of its row: (m_i, l_i, acc) as attend_tile keeps them.
    The whole tiles first, with no bounds to check, then the partial one past them, if any."""
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # [BLOCK_M, HEAD_DIM]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for key_start in range(start, whole_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        # [BLOCK_N, HEAD_DIM] each
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + dims[None, :].to(tl.int64) * stride_kd)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + dims[None, :].to(tl.int64) * stride_vd)
        m_i, l_i, acc = attend_tile(q, k, v, keys, m_i, l_i, acc, qk_scale, DOT_PRECISION, True)
    if whole_end < end:
        keys = whole_end + tl.arange(0, BLOCK_N)
        key_valid = keys < end
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + dims[None, :].to(tl.int64) * stride_kd,
                    mask=key_valid[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + dims[None, :].to(tl.int64) * stride_vd,
                    mask=key_valid[:, None], other=0.0)
        m_i, l_i, acc = attend_tile(q, k, v, key_valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, False)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["keys_per_split", "same_length"])
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    num_kv_heads, group, num_queries, keys_per_split, qk_scale, same_length,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SAME_LENGTH: tl.constexpr, BLOCK_APART: tl.constexpr,
):
    """Program (m_tile, split, batch*kv_head): one query tile against keys
    [split*keys_per_split, (split+1)*keys_per_split) of its row, clipped to the row's length
    (lengths[batch], or same_length for every row when SAME_LENGTH). With BLOCK_APART the slices cut
    the prefix before the block's own num_queries keys, and the last slice's program then takes those
    keys into one more partial (the last), so the partials of all but the last merge to the prefix's
    LSE. Programs of their own for those keys would add a column past the one wave the slices fill
    (docs/results/bench_mage.md). The slice is walked BLOCK_N keys at a time with an online softmax
    (fp32 statistics, scores prescaled by log2(e) so exp2 does the exponentials); a slice past the
    row's length writes the neutral partial: output 0, LSE -inf."""
    m_tile, split, batch_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, kv_head = batch_head // num_kv_heads, batch_head % num_kv_heads
    q, rows = load_query_tile(q_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head, m_tile,
                              group, num_queries, BLOCK_M, HEAD_DIM)

    if SAME_LENGTH:
        length = same_length
    else:
        length = tl.load(lengths_ptr + batch).to(tl.int32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, length)
    num_slots = tl.num_programs(1)
    if BLOCK_APART:
        end = tl.minimum(end, length - num_queries)
        num_slots += 1
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    m_i, l_i, acc = attend_keys(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start, end, qk_scale,
                                BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    store_partial(part_out_ptr, part_lse_ptr, acc, m_i, l_i, rows, batch_head, split, num_slots,
                  group * num_queries, HEAD_DIM)
    if BLOCK_APART:
        if split == tl.num_programs(1) - 1:
            m_i, l_i, acc = attend_keys(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                        length - num_queries, length, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                                        DOT_PRECISION)
            store_partial(part_out_ptr, part_lse_ptr, acc, m_i, l_i, rows, batch_head, num_slots - 1, num_slots,
                          group * num_queries, HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_rows, num_splits, num_queries,
                        num_heads, num_kv_heads,
                        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (row tile, batch*kv_head): combine all slices of BLOCK_R query rows at once (one load,
    no loop over slices, so the merge is not a chain of memory latencies).
    Group row r of (batch, kv_head) is query r % L of head kv_head * G + r // L. lse is contiguous
    [batch, num_heads, L], so that is its flat row batch_head * num_rows + r; out is [batch, L,
    num_heads, HEAD_DIM] in memory (o_proj's input layout)."""
    row_tile, batch_head = tl.program_id(0), tl.program_id(1)
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_S)
    row_valid = rows < num_rows
    valid = row_valid[:, None] & (splits < num_splits)[None, :]
    dims = tl.arange(0, HEAD_DIM)

    # [BLOCK_R, BLOCK_S]
    index = (batch_head.to(tl.int64) * num_splits + splits[None, :]) * num_rows + rows[:, None]
    lse = tl.load(part_lse_ptr + index, mask=valid, other=float("-inf"))
    lse = tl.where(row_valid[:, None], lse, 0.0)  # padding rows stay finite
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row no slice saw keys for (flash_attention's masks)
    weight = tl.exp2(lse - m[:, None])  # 0 for empty and padding slices
    # [BLOCK_R, BLOCK_S, HEAD_DIM]
    parts = tl.load(part_out_ptr + index[:, :, None] * HEAD_DIM + dims[None, None, :], mask=valid[:, :, None],
                    other=0.0).to(tl.float32)
    denom = tl.sum(weight, 1)
    saw_keys = denom > 0  # else a row that saw no key: out 0, lse -inf
    denom = tl.where(saw_keys, denom, 1.0)
    # [BLOCK_R, HEAD_DIM]
    out = tl.sum(weight[:, :, None] * parts, 1) / denom[:, None]

    batch = batch_head // num_kv_heads
    head = (batch_head % num_kv_heads) * (num_rows // num_queries) + rows // num_queries
    out_rows = (batch.to(tl.int64) * num_queries + rows % num_queries) * num_heads + head
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])
    lse = tl.where(saw_keys, (m + tl.log2(denom)) * LN2, float("-inf"))
    tl.store(lse_ptr + batch_head.to(tl.int64) * num_rows + rows, lse, mask=row_valid)


# Host side, shared with sparse_decode_attention.py


def new_buffer(shape, dtype, device) -> torch.Tensor:
    """A buffer a kernel fills completely (NaN-filled under DEBUG_POISON)."""
    if DEBUG_POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def default_tiles(num_rows: int, head_dim: int, element_size: int, num_stages: int = 3) -> dict:
    """Launch parameters {BLOCK_M, BLOCK_N, num_warps, num_stages} for num_rows = group * L query rows.

    BLOCK_M: one tile of up to 128 rows covers SDAR-8B's 4 heads x 32 queries, so K/V are read once
    (at least 16 rows: tl.dot needs it). BLOCK_N = 64 keys: a stage of K + V is 32 KB at D = 128
    (bf16), so two tiles in flight per SM cover HBM latency, and the [128, 64] fp32 scores fit in
    registers next to the [128, 128] fp32 accumulator, which takes 8 warps (two sm_90 warpgroups);
    smaller tiles take 4. Stages: 3 for the sparse kernel's gathered tiles, DENSE_STAGES for this
    file's contiguous ones, fewer where they and the query tile would not fit SHARED_MEMORY_BUDGET
    (float32 at D = 128: 64 KB stages, 2 of them)."""
    block_m = min(128, max(16, triton.next_power_of_2(num_rows)))
    block_n = 64
    num_warps = 8 if block_m * head_dim >= 128 * 128 else 4
    stage = 2 * block_n * head_dim * element_size
    num_stages = max(1, min(num_stages, (SHARED_MEMORY_BUDGET - block_m * head_dim * element_size) // stage))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


def dense_tiles(num_rows: int, head_dim: int, element_size: int, shared_limit: int | None = None) -> dict:
    """decode_attention's launch: default_tiles with DENSE_STAGES, or at D = 128 in 16 bits WIDE_KEY_TILES
    where they and the query tile fit shared_limit (bytes; None: no limit): sm_90's 227 KB, not sm_80's 163.
    They halve the rescales per key and run faster where a slice is compute-bound (bench_routing.md)."""
    tiles = default_tiles(num_rows, head_dim, element_size, DENSE_STAGES)
    wide = {**tiles, **WIDE_KEY_TILES}
    launch_bytes = (wide["num_stages"] * 2 * wide["BLOCK_N"] + wide["BLOCK_M"]) * head_dim * element_size
    fits = shared_limit is None or launch_bytes <= shared_limit
    return wide if head_dim == 128 and element_size == 2 and fits else tiles


def split_keys(max_keys: int, programs_per_split: int, device, block_n: int, num_splits: int | None = None,
               min_keys: int | None = None):
    """(keys_per_split, num_splits) for key lists of at most max_keys keys.

    Enough slices that programs_per_split * num_splits fills the SMs once (one wave: each program
    then streams its K/V with no tail), but no slice shorter than min_keys (default MIN_KEYS_PER_SPLIT).
    Slices are whole BLOCK_N tiles; num_splits, when given, replaces the SM-based count. Either is an
    upper bound, and at most MAX_SPLITS."""
    if num_splits is None:
        sms = sm_count(device) if device.type == "cuda" else INTERPRETER_SMS
        min_keys = MIN_KEYS_PER_SPLIT if min_keys is None else min_keys
        num_splits = min(max(1, sms // programs_per_split), triton.cdiv(max_keys, min_keys))
    num_splits = min(num_splits, MAX_SPLITS)
    keys_per_split = triton.cdiv(triton.cdiv(max(max_keys, 1), num_splits), block_n) * block_n
    return keys_per_split, triton.cdiv(max(max_keys, 1), keys_per_split)


def dot_precision(dtype) -> str:
    """fp32 inputs get exact fp32 products (not tf32) so they match the fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def partial_buffers(batch_heads, num_splits, num_rows, head_dim, dtype, device):
    """Scratch of the split kernels: normalised partial outputs in the activation dtype (half the bytes
    of fp32 for bf16/fp16: at short key lists the partials are as many bytes as the K/V read; rounding
    them adds at most one ulp of that dtype to the merged output), base-2 partial LSEs in fp32."""
    part_out = new_buffer((batch_heads, num_splits, num_rows, head_dim), dtype, device)
    part_lse = new_buffer((batch_heads, num_splits, num_rows), torch.float32, device)
    return part_out, part_lse


def merge_splits(part_out, part_lse, q):
    """Combine the per-slice partials of q's queries into out (q's shape and dtype, laid out [batch, L, heads, D]
    in memory: a transposed view, so o_proj reads it without a copy) and lse [batch, heads, L] (float32)."""
    batch, num_heads, num_queries, _ = q.shape
    batch_heads, num_splits, num_rows, head_dim = part_out.shape
    out = new_buffer((batch, num_queries, num_heads, head_dim), q.dtype, part_out.device).transpose(1, 2)
    lse = new_buffer((batch, num_heads, num_queries), torch.float32, part_out.device)
    block_s = triton.next_power_of_2(num_splits)
    block_r, num_warps = merge_launch(num_rows, block_s, head_dim)
    grid = (triton.cdiv(num_rows, block_r), batch_heads)
    merge_splits_kernel[grid](part_out, part_lse, out, lse, num_rows, num_splits, num_queries, num_heads,
                              batch_heads // batch, BLOCK_R=block_r,
                              BLOCK_S=block_s, HEAD_DIM=head_dim, num_warps=num_warps)
    return out, lse


def merge_launch(num_rows: int, block_s: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps) of the merge: rows per program so that its [BLOCK_R, BLOCK_S, D] tile holds
    MERGE_TILE elements (one row when a row alone is larger), and one warp per MERGE_TILE elements (64 per
    thread), up to 8. Each program is one load, so the merge is bound by how many programs are in
    flight: many small ones beat fewer large ones."""
    row = block_s * head_dim
    block_r = min(triton.next_power_of_2(num_rows), max(1, MERGE_TILE // row))
    return block_r, max(1, min(8, block_r * row // MERGE_TILE))


def decode_attention(q, k_cache, v_cache, lengths, *, scale=None, return_lse=True, max_length=None,
                     num_splits=None, check_lengths=False, tiles=None):
    """Attention of the active block's queries against each row's cache (prefix + block keys): the
    split pass (decode_partials, steps 1-2 of the module docstring) and the merge (step 3).

    q: [batch, num_heads, L, D], L <= DENSE_MAX_QUERIES (256), D in (64, 128), float16 / bfloat16 / float32.
    k_cache, v_cache: [batch, capacity, num_kv_heads, D], read in place through their strides.
    lengths: [batch] int32/int64 on q's device; row b attends to keys 0 .. lengths[b]-1, which
        include the block's own L keys. Contract: L <= lengths[b] <= capacity (not checked unless
        check_lengths=True, which costs a device sync). Or an int: every row's length (checked, free),
        which spares a caller whose rows are all full the launch that would fill a lengths tensor.
    scale: score scale (> 0), default D ** -0.5. GQA: query head h reads KV head h // (num_heads // num_kv_heads).
    max_length: an upper bound of lengths known on the host (e.g. KVCache.max_length + L); the split
        size is chosen from it (checked against lengths with check_lengths). Default lengths.max().item(),
        one device sync.
    num_splits: how many key slices per row (upper bound); default from the SM count.
    tiles: overrides of dense_tiles' launch parameters (BLOCK_M, BLOCK_N, num_warps, num_stages),
        for launch sweeps (the tests run a few).

    Returns out [batch, num_heads, L, D] in q's dtype (laid out [batch, L, num_heads, D]: merge_splits)
    and, if return_lse, lse [batch, num_heads, L]
    float32: the natural-log log-sum-exp of each query's scaled scores.
    """
    partials = decode_partials(q, k_cache, v_cache, lengths, scale=scale, max_length=max_length,
                               num_splits=num_splits, check_lengths=check_lengths, tiles=tiles)
    out, lse = merge_splits(*partials, q)
    return (out, lse) if return_lse else out


def decode_partials(q, k_cache, v_cache, lengths, *, scale=None, max_length=None, num_splits=None,
                    check_lengths=False, tiles=None, block_apart=False):
    """decode_attention's split pass alone (same arguments): the scratch merge_splits combines.
    block_apart: the block's own L keys (the last L of each row) get a partial of their own, the last
    (taken by the last prefix slice's programs), so that the others' LSEs merge into the prefix's alone
    (MAGE's eq. 3: key_scores' part_lse)."""
    batch, num_heads, num_queries, head_dim, capacity, num_kv_heads = check_query_and_cache(q, k_cache, v_cache,
                                                                                             DENSE_MAX_QUERIES)
    same_length = isinstance(lengths, int)
    max_length = check_decode_lengths(lengths, batch, num_queries, capacity, q.device, max_length, check_lengths)
    group = num_heads // num_kv_heads
    num_rows = group * num_queries
    scale = score_scale(scale, head_dim)

    launch = dense_tiles(num_rows, head_dim, q.element_size(), shared_memory_limit(q.device))
    if tiles is not None and not set(tiles) <= set(launch):
        raise ValueError(f"tiles may set {sorted(launch)}, got {sorted(tiles)}")
    launch.update(tiles or {})
    m_tiles = triton.cdiv(num_rows, launch["BLOCK_M"])
    if block_apart:  # slices over the longest prefix; the last one's programs also take the block's keys
        max_length -= num_queries
        num_splits = None if num_splits is None else min(num_splits, MAX_SPLITS - 1)
    keys_per_split, num_splits = split_keys(max(max_length, 1), batch * num_kv_heads * m_tiles, q.device,
                                            launch["BLOCK_N"], num_splits)
    part_out, part_lse = partial_buffers(batch * num_kv_heads, num_splits + int(block_apart), num_rows, head_dim,
                                         q.dtype, q.device)
    grid = (m_tiles, num_splits, batch * num_kv_heads)
    decode_split_kernel[grid](
        q, k_cache, v_cache, q if same_length else lengths, part_out, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, group, num_queries, keys_per_split, scale * LOG2E.value, lengths if same_length else 0,
        HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype), SAME_LENGTH=same_length, BLOCK_APART=block_apart,
        **launch,
    )
    return part_out, part_lse


def decode_attention_reference(q, k_cache, v_cache, lengths, *, scale=None, return_lse=True):
    """Plain torch, one row at a time, scores and softmax in fp32 (float64 for float64 inputs)."""
    batch, num_heads, num_queries, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    for b in range(batch):
        n = lengths if isinstance(lengths, int) else int(lengths[b])
        keys = k_cache[b, :n].to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, n, D]
        values = v_cache[b, :n].to(compute).transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (q[b].to(compute) @ keys.transpose(1, 2)) * scale  # [heads, L, n]
        outs.append((scores.softmax(-1) @ values).to(q.dtype))
        lses.append(scores.logsumexp(-1).float())
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out, lse) if return_lse else out
