"""Key importance scores: how much attention each cached prefix key receives from the active block.

For row b, KV head h and prefix key j < cache_lengths[b], over the group*L query rows r (the L
queries of each of the `group` query heads that read KV head h):

    scores[b, h, j] = reduce_r exp(scale * q_r . k_j - lse_r)      reduce = mean (MAGE eq. 3) or
                                                                   sum (MaskKV mask voting)
    dots[b, h, j]   = mean_r scale * q_r . k_j                     (optional, Sparse-dLLM)

lse is the caller's per-row normaliser: a full attention's log-sum-exp gives the true probabilities
of that attention; nothing is renormalised here. Or part_lse, decode_partials(block_apart=True)'s
per-slice LSEs, merged in the kernel over every slice but the block's own, so the probabilities are
those of a softmax over the prefix (MAGE's eq. 3). Positions past a row's prefix, up to
max(cache_lengths), are written as 0. One program per (chunk of keys, row * KV head) reads its keys
once and V not at all; the reference is key_scores_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E, SHARED_MEMORY_BUDGET, dot_precision, load_query_tile, new_buffer, split_keys
from .decode_inputs import check_lengths_tensor, check_query_and_cache


@triton.jit
def row_lse(lse_ptr, batch_head, rows, num_rows, prefix_slices, BLOCK_M: tl.constexpr, FROM_SLICES: tl.constexpr,
            SLICE_PAD: tl.constexpr):
    """Base-2 LSE of the group's query rows (+inf for padding rows, >= num_rows: their probabilities
    2^(s - inf) are exactly 0). lse is contiguous [batch, num_heads, L] (natural log), so group row r
    of (batch, kv_head) is flat row batch_head * num_rows + r. FROM_SLICES: lse is decode_partials'
    part_lse [batch * kv_heads, prefix_slices + 1, num_rows] (base 2), and the first prefix_slices
    slices are merged as merge_splits_kernel merges them (one [rows, slices] load, max, then the sum
    of 2^(lse_s - max)); -inf when every slice is empty. The merge runs in each program, with no launch
    of its own."""
    row_valid = rows < num_rows
    if FROM_SLICES:
        slices = tl.arange(0, SLICE_PAD)
        # [BLOCK_M, SLICE_PAD]
        index = (batch_head.to(tl.int64) * (prefix_slices + 1) + slices[None, :]) * num_rows + rows[:, None]
        parts = tl.load(lse_ptr + index, mask=row_valid[:, None] & (slices < prefix_slices)[None, :],
                        other=float("-inf"))
        top = tl.max(parts, 1)
        top = tl.where(top == float("-inf"), 0.0, top)  # no keys in any slice: 2^(-inf - 0) = 0, not NaN
        total = tl.sum(tl.exp2(parts - top[:, None]), 1)
        has_keys = total > 0.0
        lse = tl.where(has_keys, top + tl.log2(tl.where(has_keys, total, 1.0)), float("-inf"))
    else:
        lse = tl.load(lse_ptr + batch_head.to(tl.int64) * num_rows + rows, mask=row_valid, other=0.0) * LOG2E
    return tl.where(row_valid, lse, float("inf"))


@triton.jit
def load_query_rows(q_ptr, lse_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head, batch_head,
                    m_tile, group, num_queries, prefix_slices, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    FROM_SLICES: tl.constexpr, SLICE_PAD: tl.constexpr):
    """Query tile m_tile of the group and its base-2 LSE (row_lse)."""
    # [BLOCK_M, HEAD_DIM]
    q, rows = load_query_tile(q_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head, m_tile,
                              group, num_queries, BLOCK_M, HEAD_DIM)
    return q, row_lse(lse_ptr, batch_head, rows, group * num_queries, prefix_slices, BLOCK_M, FROM_SLICES,
                      SLICE_PAD)


@triton.jit(do_not_specialize=["max_length", "keys_per_program", "prefix_slices"])
def key_scores_kernel(
    q_ptr, k_ptr, cache_lengths_ptr, lse_ptr, scores_ptr, dots_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    num_kv_heads, group, num_queries, max_length, keys_per_program, prefix_slices, qk_scale, score_weight,
    dot_weight,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, M_TILES: tl.constexpr,
    WITH_DOTS: tl.constexpr, FROM_SLICES: tl.constexpr, SLICE_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (chunk, batch*kv_head): scores (and dots) of keys
    [chunk*keys_per_program, (chunk+1)*keys_per_program) clipped to max_length.

    The first query tile of the group (all of it when group*L <= 128) stays resident while the program
    streams its chunk of K tile by tile, so K is read once and V not at all; larger groups reload their
    further query tiles from L2 for each key tile. Per key tile the scores are computed transposed,
    S^T = K Q^T [keys, rows], so that the reductions over query rows run along axis 1: in the MMA
    accumulator layout a key's row lies within one thread and its quad of lanes (registers and two
    shuffles; summing over axis 0 of Q K^T would cross warps through shared memory and a barrier on
    every tile). Then P^T = 2^(S^T * scale * log2(e) - lse * log2(e)), row sums of P^T (and of S^T:
    the dots). Padding query rows are zero queries with LSE +inf, so they add exactly 0 to both."""
    chunk, batch_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head = batch_head // num_kv_heads, batch_head % num_kv_heads
    q_first, lse_first = load_query_rows(q_ptr, lse_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head,
                                         batch_head, 0, group, num_queries, prefix_slices, BLOCK_M, HEAD_DIM,
                                         FROM_SLICES, SLICE_PAD)
    # [HEAD_DIM, BLOCK_M], transposed here, outside the loop, so that it goes to shared memory once
    q_first = tl.trans(q_first)

    cache_length = tl.load(cache_lengths_ptr + batch).to(tl.int32)
    start = chunk * keys_per_program
    end = tl.minimum(start + keys_per_program, max_length)
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    out_base = batch_head.to(tl.int64) * max_length
    dims = tl.arange(0, HEAD_DIM)
    for key_start in range(start, end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_valid = keys < cache_length
        # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + dims[None, :].to(tl.int64) * stride_kd,
                    mask=key_valid[:, None], other=0.0)
        prob_sum = tl.zeros([BLOCK_N], tl.float32)
        dot_sum = tl.zeros([BLOCK_N], tl.float32)
        for m_tile in tl.static_range(M_TILES):
            if m_tile == 0:
                q_t, lse = q_first, lse_first
            else:
                q, lse = load_query_rows(q_ptr, lse_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head,
                                         batch_head, m_tile, group, num_queries, prefix_slices, BLOCK_M, HEAD_DIM,
                                         FROM_SLICES, SLICE_PAD)
                q_t = tl.trans(q)
            # [BLOCK_N, BLOCK_M]: one row per key, one column per query row
            dots = tl.dot(k, q_t, input_precision=DOT_PRECISION)
            # [BLOCK_N, BLOCK_M]
            probs = tl.exp2(dots * qk_scale - lse[None, :])
            prob_sum += tl.sum(probs, 1)
            if WITH_DOTS:
                dot_sum += tl.sum(dots, 1)
        in_chunk = keys < end
        tl.store(scores_ptr + out_base + keys, tl.where(key_valid, prob_sum * score_weight, 0.0), mask=in_chunk)
        if WITH_DOTS:
            tl.store(dots_ptr + out_base + keys, tl.where(key_valid, dot_sum * dot_weight, 0.0), mask=in_chunk)


MAX_STAGES = 3


def launch_params(num_rows: int, head_dim: int, element_size: int) -> dict:
    """Launch parameters {BLOCK_M, BLOCK_N, num_warps, num_stages} for num_rows = group * L query rows.

    BLOCK_N = 128 keys are the MMA's M dimension (sm_90 wgmma: 64 rows per warpgroup), so 8 warps
    (two warpgroups) split the keys and each key's row of S^T stays within one warp. BLOCK_M =
    min(128, next power of 2 of group*L) query rows, at least 16 (tl.dot): the [128, 128] fp32 S^T
    is 64 registers per thread. num_stages: the pipeline holds, per stage, one K tile
    (BLOCK_N * D) and the M_TILES - 1 further query tiles that each key tile reloads (BLOCK_M * D
    each); next to the resident first query tile it must fit SHARED_MEMORY_BUDGET, so
    stages = min(MAX_STAGES, (budget - BLOCK_M*D*size) // stage size), at least 1. SDAR-8B (128 rows,
    D = 128, bf16): 32 KB stages, 3 of them; group 8 x L 64 at D = 64 (4 query tiles): 64 KB
    stages, 2 of them. Three stages keep two K tiles (64 KB at D = 128) loading while one is
    scored, which covers HBM latency at one program per SM."""
    block_m = min(128, max(16, triton.next_power_of_2(num_rows)))
    block_n = 128
    m_tiles = triton.cdiv(num_rows, block_m)
    resident = block_m * head_dim * element_size
    stage = (block_n + (m_tiles - 1) * block_m) * head_dim * element_size
    num_stages = max(1, min(MAX_STAGES, (SHARED_MEMORY_BUDGET - resident) // stage))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8, "num_stages": num_stages}


def key_scores(q, k_cache, cache_lengths, lse=None, *, part_lse=None, reduce="mean", scale=None, with_dots=False,
               max_length=None, num_chunks=None):
    """Attention probability mass each cached prefix key gets from the block's queries, per KV head.

    q: [batch, num_heads, L, D] the active block's queries (L <= 64, D in (64, 128)).
    k_cache: [batch, capacity, num_kv_heads, D], read in place; prefix of row b = slots 0 .. cache_lengths[b]-1.
    cache_lengths: [batch] int32/int64.
    lse: [batch, num_heads, L] float32, the natural-log LSE the probabilities are normalised by (e.g.
        decode_attention's, of the full attention).
    part_lse: instead of lse, decode_partials(block_apart=True)'s partial LSEs
        [batch * num_kv_heads, slices, group * L] float32 (base 2): every slice but the last (the
        block's own keys) is merged in the kernel, so each query is normalised over its prefix alone.
    reduce: "mean" (MAGE eq. 3: average over the L queries and the group's heads) or "sum" (MaskKV votes).
    with_dots: also return dots, the mean over the same rows of scale * q . k_j (Sparse-dLLM's A).
    max_length: max(cache_lengths) if known on the host (saves a device sync); sets the output width.
    num_chunks: how many programs share one (row, KV head)'s keys; default from the SM count.

    Returns scores [batch, num_kv_heads, max_length] float32 (0 past each row's prefix) and, with
    with_dots, dots of the same shape.

    dots and Sparse-dLLM: its Algorithm 1 scores candidate keys with A = mean(Q_b) K^T, the mean of
    the current block's query states against each key, before max pooling and top-k (the method's,
    not the kernel's). A dot product is linear, so mean_r scale * q_r . k_j = scale * mean_r(q_r) . k_j:
    with the default scale 1/sqrt(d) this is the paper's A of one query head (Algorithm 1 omits the
    1/sqrt(d_k) its equation has, which does not change the ranking). The paper does not say how query
    heads that share a KV head (GQA) are combined; here the mean also runs over the group, one score
    per KV head, as a cache shared by the group needs. With group = 1 (MHA) it is the paper's A.
    """
    batch, num_heads, num_queries, head_dim, capacity, num_kv_heads = check_query_and_cache(q, k_cache)
    check_lengths_tensor("cache_lengths", cache_lengths, batch, q.device)
    group = num_heads // num_kv_heads
    num_rows = group * num_queries
    if (lse is None) == (part_lse is None):
        raise ValueError("give the normaliser as exactly one of lse and part_lse")
    if part_lse is None:
        normaliser, shape_ok = lse, lse.shape == (batch, num_heads, num_queries)
        what = f"lse must be float32 [{batch}, {num_heads}, {num_queries}]"
    else:
        normaliser = part_lse
        shape_ok = part_lse.dim() == 3 and part_lse.shape[1] >= 2 and part_lse.shape[::2] == (batch * num_kv_heads,
                                                                                               num_rows)
        what = f"part_lse must be float32 [{batch * num_kv_heads}, slices >= 2, {num_rows}]"
    if not shape_ok or normaliser.dtype != torch.float32 or normaliser.device != q.device:
        raise ValueError(f"{what} on {q.device}, got {normaliser.dtype} {tuple(normaliser.shape)} on "
                         f"{normaliser.device}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    if max_length is None:
        max_length = int(cache_lengths.max())
    if max_length > capacity:
        raise ValueError(f"max_length {max_length} exceeds the cache capacity {capacity}")
    scale = head_dim**-0.5 if scale is None else scale
    normaliser = normaliser.contiguous()

    scores = new_buffer((batch, num_kv_heads, max_length), torch.float32, q.device)
    dots = new_buffer((batch, num_kv_heads, max_length), torch.float32, q.device) if with_dots else scores
    if max_length > 0:
        launch = launch_params(num_rows, head_dim, q.element_size())
        m_tiles = triton.cdiv(num_rows, launch["BLOCK_M"])
        keys_per_program, num_chunks = split_keys(max_length, batch * num_kv_heads, q.device, launch["BLOCK_N"],
                                                  num_chunks)
        grid = (num_chunks, batch * num_kv_heads)
        key_scores_kernel[grid](
            q, k_cache, cache_lengths, normaliser, scores, dots,
            *q.stride(), *k_cache.stride(),
            num_kv_heads, group, num_queries, max_length, keys_per_program,
            0 if part_lse is None else part_lse.shape[1] - 1, scale * LOG2E.value,
            1.0 / num_rows if reduce == "mean" else 1.0, scale / num_rows,
            HEAD_DIM=head_dim, M_TILES=m_tiles, WITH_DOTS=with_dots, FROM_SLICES=part_lse is not None,
            SLICE_PAD=1 if part_lse is None else triton.next_power_of_2(part_lse.shape[1] - 1),
            DOT_PRECISION=dot_precision(q.dtype), **launch,
        )
    return (scores, dots) if with_dots else scores


def key_scores_reference(q, k_cache, cache_lengths, lse, *, reduce="mean", scale=None, with_dots=False):
    """Plain torch, fp32: the probabilities exp(scale q.k - lse) of every (query head, query, prefix
    key), reduced over the group's heads and the L queries."""
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_length = int(cache_lengths.max())
    scores = torch.zeros(batch, num_kv_heads, max_length, device=q.device)
    dots = torch.zeros(batch, num_kv_heads, max_length, device=q.device)
    for b in range(batch):
        n = int(cache_lengths[b])
        keys = k_cache[b, :n].float().transpose(0, 1)  # [kv_heads, n, D]
        queries = q[b].float().view(num_kv_heads, group * num_queries, head_dim)
        logits = (queries @ keys.transpose(1, 2)) * scale  # [kv_heads, group*L, n]
        probs = torch.exp(logits - lse[b].view(num_kv_heads, group * num_queries, 1))
        scores[b, :, :n] = probs.mean(1) if reduce == "mean" else probs.sum(1)
        dots[b, :, :n] = logits.mean(1)
    return (scores, dots) if with_dots else scores
