"""Query-sparse attention with the key-block scores and an online top-k fused in (MOMO, step 1).

Every gamma-th query (rows 0, gamma, 2 gamma, ...) attends to all the keys it may see, exactly as
flash attention does (online softmax in base 2, fp32 running max / sum / accumulator). The key tiles
are the key blocks (BLOCK_N = beta keys), so while a tile is in registers the kernel also has its
block score, MOMO's eq. 4: S(j) = logsumexp over the block of the row's scaled scores (-inf when the
row sees none of the block). Each row keeps the k best blocks in a k-slot buffer held in registers
(the paper's online exact top-k): a block replaces the buffer's minimum when its score is strictly
higher, so among equal scores the lower block stays, and the buffer ends with the exact top-k.
That update costs O(k) per block (a min and an argmin over the buffer); the paper's tournament tree
(O(log k), buffer in HBM) and its Gaussian-threshold estimate (O(1)) are the other two variants.

Masks as in flash_attention.py: bidirectional, causal, or block-causal with block_size B (query at
position p sees key j iff j // B <= p // B), and optional key padding k_valid [batch, N]. Sampled
query i sits at position i * gamma. GQA: query head h reads KV head h // group.
Outputs: o [batch, heads, S, D] (S = ceil(N / gamma)), lse [batch, heads, S] float32, and the top-k
blocks per sampled row: indices [batch, heads, S, k] int32 (-1 = empty slot: the row sees fewer
blocks) with their scores [batch, heads, S, k] float32 (natural log), in buffer order (unsorted).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)
LN_2 = tl.constexpr(math.log(2.0))


@triton.jit
def qsa_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, lse_ptr, top_index_ptr, top_score_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_valid_b, stride_valid_n,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_tb, stride_th, stride_ts, stride_tk,
    n_keys, num_sampled, num_heads, group, gamma, mask_block, qk_scale, top_k,
    MASKED: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, K_SLOTS: tl.constexpr,
):
    m_tile, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // num_heads, batch_head % num_heads
    kv_head = head // group
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_sampled
    positions = rows * gamma
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + positions[:, None] * stride_qn + dims[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    slots = tl.arange(0, K_SLOTS)
    # slots past k hold +inf: never the minimum, never replaced
    top_score = tl.where(slots[None, :] < top_k, float("-inf"), float("inf")) + tl.zeros((BLOCK_M, K_SLOTS), tl.float32)
    top_index = tl.full((BLOCK_M, K_SLOTS), -1, tl.int32)

    last_row = tl.minimum(m_tile * BLOCK_M + BLOCK_M, num_sampled) - 1
    key_end = n_keys
    if MASKED:  # key tiles past what the tile's last row sees are never visited
        key_end = tl.minimum((last_row * gamma // mask_block + 1) * mask_block, n_keys)
    for start in range(0, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        visible = (keys[None, :] < n_keys) & row_ok[:, None]
        if MASKED:
            visible = visible & ((keys[None, :] // mask_block) <= (positions[:, None] // mask_block))
        if HAS_VALID:
            key_valid = tl.load(valid_ptr + batch * stride_valid_b + keys * stride_valid_n, mask=keys < n_keys, other=0)
            visible = visible & (key_valid[None, :] != 0)
        k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + keys[:, None] * stride_kn + dims[None, :] * stride_kd,
                    mask=keys[:, None] < n_keys, other=0.0)
        v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + keys[:, None] * stride_vn + dims[None, :] * stride_vd,
                    mask=keys[:, None] < n_keys, other=0.0)
        scores = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))  # base 2

        tile_max = tl.max(scores, axis=1)
        seen = tile_max > float("-inf")
        tile_sum = tl.sum(tl.exp2(scores - tl.where(seen, tile_max, 0.0)[:, None]), axis=1)
        block_score = tl.where(seen, (tile_max + tl.log2(tl.where(seen, tile_sum, 1.0))) * LN_2, float("-inf"))

        lowest = tl.min(top_score, axis=1)
        lowest_slot = tl.argmin(top_score, axis=1)
        replace = seen & (block_score > lowest)
        hit = replace[:, None] & (slots[None, :] == lowest_slot[:, None])
        top_score = tl.where(hit, block_score[:, None], top_score)
        top_index = tl.where(hit, start // BLOCK_N, top_index)

        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + dims[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * LN_2, float("-inf"))
    tl.store(lse_ptr + batch * stride_lb + head * stride_lh + rows * stride_ls, lse, mask=row_ok)
    top_offsets = batch * stride_tb + head * stride_th + rows[:, None] * stride_ts + slots[None, :] * stride_tk
    keep = row_ok[:, None] & (slots[None, :] < top_k)
    tl.store(top_index_ptr + top_offsets, top_index, mask=keep)
    tl.store(top_score_ptr + top_offsets, top_score, mask=keep)


def check_inputs(q, k, v, gamma, beta, top_k, causal, block_size, k_valid):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError("q must be [batch, heads, N, D] and k, v [batch, kv_heads, N, D]")
    batch, heads, n, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != n or k.shape[3] != head_dim or heads % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {head_dim}")
    if beta not in (16, 32, 64, 128):
        raise ValueError(f"beta (key block size) must be 16, 32, 64 or 128, got {beta}")
    if gamma < 1 or top_k < 1:
        raise ValueError(f"gamma and top_k must be >= 1, got {gamma} and {top_k}")
    if causal and block_size is not None:
        raise ValueError("causal and block_size are exclusive (causal is block_size = 1)")
    if k_valid is not None and (k_valid.shape != (batch, n) or k_valid.dtype != torch.bool):
        raise ValueError(f"k_valid must be a bool tensor of shape ({batch}, {n})")


def qsa_attention(q, k, v, *, gamma: int, beta: int, top_k: int, causal=False, block_size=None, k_valid=None,
                  scale=None):
    """See the module docstring. Returns (o, lse, top_indices, top_scores)."""
    check_inputs(q, k, v, gamma, beta, top_k, causal, block_size, k_valid)
    batch, heads, n, head_dim = q.shape
    sampled = triton.cdiv(n, gamma)
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(batch, heads, sampled, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, sampled, dtype=torch.float32, device=q.device)
    top_index = torch.empty(batch, heads, sampled, top_k, dtype=torch.int32, device=q.device)
    top_score = torch.empty(batch, heads, sampled, top_k, dtype=torch.float32, device=q.device)
    valid = k_valid.view(torch.uint8) if k_valid is not None else lse
    valid_strides = k_valid.stride() if k_valid is not None else (0, 0)
    block_m = 16
    grid = (triton.cdiv(sampled, block_m), batch * heads)
    qsa_kernel[grid](
        q, k, v, valid, out, lse, top_index, top_score,
        *q.stride(), *k.stride(), *v.stride(), *valid_strides, *out.stride(), *lse.stride(), *top_index.stride(),
        n, sampled, heads, heads // k.shape[1], gamma, 1 if causal else (block_size or 1), scale * LOG2_E, top_k,
        MASKED=causal or block_size is not None, HAS_VALID=k_valid is not None, BLOCK_M=block_m, BLOCK_N=beta,
        HEAD_DIM=head_dim, K_SLOTS=triton.next_power_of_2(top_k), num_warps=4,
    )
    return out, lse, top_index, top_score


def qsa_attention_reference(q, k, v, *, gamma: int, beta: int, top_k: int, causal=False, block_size=None,
                            k_valid=None, scale=None):
    """Plain torch (dense scores of the sampled rows, fp32 or wider): the same outputs, the top-k
    sorted by score (ties to the lower block)."""
    batch, heads, n, head_dim = q.shape
    group = heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    positions = torch.arange(0, n, gamma, device=q.device)
    scores = q[:, :, positions].to(compute) @ k.to(compute).repeat_interleave(group, 1).transpose(-1, -2) * scale
    visible = torch.ones(batch, 1, len(positions), n, dtype=torch.bool, device=q.device)
    if causal or block_size is not None:
        b = 1 if causal else block_size
        keys = torch.arange(n, device=q.device)
        visible = visible & ((keys[None, :] // b) <= (positions[:, None] // b))
    if k_valid is not None:
        visible = visible & k_valid[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    probs = torch.nan_to_num((scores - lse[..., None]).exp(), nan=0.0)
    out = probs @ v.to(compute).repeat_interleave(group, 1)
    blocks = triton.cdiv(n, beta)
    padded = torch.nn.functional.pad(scores, (0, blocks * beta - n), value=float("-inf"))
    block_scores = padded.view(batch, heads, len(positions), blocks, beta).logsumexp(dim=-1)
    count = min(top_k, blocks)
    ranked = block_scores.double() - torch.arange(blocks, device=q.device) * 1e-9  # ties: the lower block first
    values, indices = ranked.topk(count, dim=-1)
    top_score = block_scores.gather(-1, indices).float()
    indices = torch.where(values > float("-inf"), indices, -1).to(torch.int32)
    top_score = torch.where(indices >= 0, top_score, float("-inf"))
    if count < top_k:
        pad = (0, top_k - count)
        indices = torch.nn.functional.pad(indices, pad, value=-1)
        top_score = torch.nn.functional.pad(top_score, pad, value=float("-inf"))
    return out.to(q.dtype), lse.float(), indices, top_score
