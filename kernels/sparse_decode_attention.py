"""Sparse block-decode attention: the active block's L queries against a selected part of each
row's cached prefix plus, always, the block's own L keys.

Row b's cache holds its prefix at slots 0 .. cache_lengths[b]-1 and the block's keys right after,
at cache_lengths[b] .. cache_lengths[b]+L-1. Per (batch row, KV head) an index list selects the part
of the prefix to read: token indices (index_block = 1: MAGE, MaskKV, Sparse-dLLM) or key-block
indices j covering tokens j*S .. j*S+S-1 clipped to the prefix (index_block = S: Quest pages, MOMO).

Algorithm: the same as decode_attention.py (GQA group packed into the query tile, split-KV with an
online softmax in base 2, fp32 partials merged by LSE by the shared merge kernel), walking a virtual
key list instead of a contiguous range. Position t of the list of (b, kv_head) is
    t <  count * S:   token indices[t // S] * S + t % S   (a key block's tokens >= cache_lengths[b] skipped)
    t >= count * S:   block key cache_lengths[b] + t - count * S
so a head's list is count * S + L positions long; slices cut it into equal pieces, and each tile
gathers its K/V rows by token number. The reference is sparse_decode_attention_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import (
    LOG2E,
    attend_tile,
    default_tiles,
    dot_precision,
    load_query_tile,
    merge_splits,
    partial_buffers,
    split_keys,
    store_partial,
)
from .decode_inputs import check_lengths_tensor, check_query_and_cache, score_scale


@triton.jit
def load_entries(index_base, positions, end, num_selected, stride_ik, INDEX_BLOCK: tl.constexpr):
    """The list entries behind virtual positions (0 where a position is past the slice or is a block key)."""
    from_list = (positions < end) & (positions < num_selected)
    return tl.load(index_base + (positions // INDEX_BLOCK).to(tl.int64) * stride_ik, mask=from_list, other=0)


@triton.jit(do_not_specialize=["keys_per_split"])
def sparse_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, cache_lengths_ptr, indices_ptr, counts_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ib, stride_ih, stride_ik, stride_cb, stride_ch,
    num_kv_heads, group, num_queries, keys_per_split, qk_scale,
    INDEX_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHOLE_TILES: tl.constexpr,
):
    """Program (m_tile, split, batch*kv_head): one query tile against positions
    [split*keys_per_split, (split+1)*keys_per_split) of the head's virtual key list.

    Each tile gathers whole D-element K/V rows (coalesced per row). Three things keep the gather close
    to the dense kernel's stream:
    - the list entries of tile i+1 are loaded while tile i is attended: otherwise every tile waits for
      two dependent memory round trips (entries, then K/V);
    - they are loaded as a [BLOCK_N, 1] column, in the layout of the K/V tile's rows: a 1-D load
      compiles to more global loads and address arithmetic;
    - key blocks of a multiple of BLOCK_N tokens (WHOLE_TILES) take one entry per tile, and a tile's
      rows are one run of tokens."""
    m_tile, split, batch_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, kv_head = batch_head // num_kv_heads, batch_head % num_kv_heads
    q, rows = load_query_tile(q_ptr, stride_qb, stride_qh, stride_ql, stride_qd, batch, kv_head, m_tile,
                              group, num_queries, BLOCK_M, HEAD_DIM)

    cache_length = tl.load(cache_lengths_ptr + batch).to(tl.int32)
    count = tl.load(counts_ptr + batch.to(tl.int64) * stride_cb + kv_head.to(tl.int64) * stride_ch).to(tl.int32)
    num_selected = count * INDEX_BLOCK
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, num_selected + num_queries)
    index_base = indices_ptr + batch.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    dims = tl.arange(0, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # [BLOCK_M, HEAD_DIM]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the first tile's list entries: one per tile (WHOLE_TILES), else one per position as a column, in the
    # layout of the K/V tile's rows; each iteration loads the next tile's while its K/V arrive
    if WHOLE_TILES:
        entries = load_entries(index_base, start + tl.arange(0, 1), end, num_selected, stride_ik, INDEX_BLOCK)
    else:
        entries = load_entries(index_base, start + tl.arange(0, BLOCK_N)[:, None], end, num_selected, stride_ik,
                               INDEX_BLOCK)
    for pos_start in range(start, end, BLOCK_N):
        positions = pos_start + tl.arange(0, BLOCK_N)
        in_slice = positions < end
        from_list = in_slice & (positions < num_selected)
        if WHOLE_TILES:  # one run of BLOCK_N tokens: part of one key block, or the block's keys
            in_list = pos_start < num_selected
            first_token = tl.where(in_list, entries.to(tl.int64) * INDEX_BLOCK + pos_start % INDEX_BLOCK,
                                   (cache_length + pos_start - num_selected).to(tl.int64))
            run = first_token + tl.arange(0, BLOCK_N)
            key_valid = in_slice & (~from_list | (run < cache_length))  # key blocks clipped to the prefix
            # [BLOCK_N, 1]
            tokens = run[:, None]
            entries = load_entries(index_base, pos_start + BLOCK_N + tl.arange(0, 1), end, num_selected, stride_ik,
                                   INDEX_BLOCK)
        else:
            # [BLOCK_N, 1]
            column = positions[:, None]
            tokens = tl.where(column < num_selected, entries.to(tl.int64) * INDEX_BLOCK + column % INDEX_BLOCK,
                              (cache_length + column - num_selected).to(tl.int64))
            entries = load_entries(index_base, column + BLOCK_N, end, num_selected, stride_ik, INDEX_BLOCK)
            if INDEX_BLOCK == 1:
                key_valid = in_slice  # listed tokens lie in the prefix: the contract check_indices tests
            else:  # key blocks clipped to the prefix
                key_valid = in_slice & (~from_list | tl.reshape(tokens < cache_length, [BLOCK_N]))
        # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_base + tokens * stride_kn + dims[None, :].to(tl.int64) * stride_kd,
                    mask=key_valid[:, None], other=0.0)
        # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + tokens * stride_vn + dims[None, :].to(tl.int64) * stride_vd,
                    mask=key_valid[:, None], other=0.0)
        m_i, l_i, acc = attend_tile(q, k, v, key_valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, False)

    store_partial(part_out_ptr, part_lse_ptr, acc, m_i, l_i, rows, batch_head, split, tl.num_programs(1),
                  group * num_queries, HEAD_DIM)


def check_index_lists(indices, counts, cache_lengths, index_block, num_queries, capacity):
    """The documented device-side check of check_indices=True: one reduction and a device sync.
    Raises ValueError naming the first bad (batch, head, position, value)."""
    if bool((cache_lengths < 0).any()) or bool((cache_lengths + num_queries > capacity).any()):
        raise ValueError(f"cache_lengths {cache_lengths.tolist()} + L = {num_queries} must fit the capacity {capacity}")
    list_length = indices.shape[2]
    bad_counts = (counts < 0) | (counts > list_length)
    if bool(bad_counts.any()):
        b, h = bad_counts.nonzero()[0].tolist()
        raise ValueError(f"counts[{b}, {h}] = {int(counts[b, h])} is outside [0, {list_length}]")
    limit = (cache_lengths + index_block - 1) // index_block  # valid entries: [0, limit[b])
    used = torch.arange(list_length, device=indices.device) < counts[..., None]
    bad = used & ((indices < 0) | (indices >= limit[:, None, None]))
    if bool(bad.any()):
        b, h, i = bad.nonzero()[0].tolist()
        unit = "token" if index_block == 1 else f"key block of {index_block}"
        raise ValueError(f"indices[{b}, {h}, {i}] = {int(indices[b, h, i])} is not a {unit} of the prefix of "
                         f"row {b}: valid range [0, {int(limit[b])})")


def sparse_decode_attention(q, k_cache, v_cache, cache_lengths, indices, counts, *, index_block=1, scale=None,
                            check_indices=False, return_lse=True, num_splits=None):
    """Attention of the active block's queries against the selected prefix keys and the block's keys:
    the split pass (sparse_decode_partials) and decode_attention.py's merge.

    q: [batch, num_heads, L, D] (L <= 64, D in (64, 128), float16 / bfloat16 / float32).
    k_cache, v_cache: [batch, capacity, num_kv_heads, D], read in place.
    cache_lengths: [batch] int32/int64, the cached prefix length P_b of each row; the block's L keys
        sit at slots P_b .. P_b+L-1 and are always attended.
    indices: [batch, num_kv_heads, K] int32/int64, per (row, KV head) the selected prefix tokens
        (index_block = 1, values in [0, P_b)) or key blocks (index_block = S, values in
        [0, ceil(P_b / S)), block j = tokens j*S .. j*S+S-1 clipped to P_b). Lists must be
        duplicate-free: a duplicate would be attended (counted) twice.
    counts: [batch, num_kv_heads] int32/int64, how many entries of each list are valid; entries past
        counts are ignored (may be garbage).
    check_indices: validate counts, index ranges and capacity on the device (a reduction plus a
        device sync: the documented cost) and raise ValueError naming the first bad entry.
    num_splits: how many slices per (row, KV head) list (upper bound); default from the SM count.

    Returns out [batch, num_heads, L, D] in q's dtype (laid out [batch, L, num_heads, D]: merge_splits)
    and, if return_lse, lse [batch, num_heads, L]
    float32 (natural log of the scaled scores' sum of exponentials over the attended keys).
    """
    partials = sparse_decode_partials(q, k_cache, v_cache, cache_lengths, indices, counts, index_block=index_block,
                                      scale=scale, check_indices=check_indices, num_splits=num_splits)
    out, lse = merge_splits(*partials, q)
    return (out, lse) if return_lse else out


def sparse_decode_partials(q, k_cache, v_cache, cache_lengths, indices, counts, *, index_block=1, scale=None,
                           check_indices=False, num_splits=None):
    """sparse_decode_attention's split pass alone (same arguments): the scratch merge_splits combines."""
    batch, num_heads, num_queries, head_dim, capacity, num_kv_heads = check_query_and_cache(q, k_cache, v_cache)
    check_lengths_tensor("cache_lengths", cache_lengths, batch, q.device)
    if indices.dim() != 3 or indices.shape[:2] != (batch, num_kv_heads):
        raise ValueError(f"indices must be [batch, num_kv_heads, K] = [{batch}, {num_kv_heads}, K], "
                         f"got {tuple(indices.shape)}")
    if counts.shape != (batch, num_kv_heads):
        raise ValueError(f"counts must have shape ({batch}, {num_kv_heads}), got {tuple(counts.shape)}")
    for name, tensor in (("indices", indices), ("counts", counts)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    if not isinstance(index_block, int) or index_block < 1:
        raise ValueError(f"index_block must be a positive int, got {index_block!r}")
    if check_indices:
        check_index_lists(indices, counts, cache_lengths, index_block, num_queries, capacity)
    group = num_heads // num_kv_heads
    num_rows = group * num_queries
    scale = score_scale(scale, head_dim)

    launch = default_tiles(num_rows, head_dim, q.element_size())
    m_tiles = triton.cdiv(num_rows, launch["BLOCK_M"])
    longest_list = indices.shape[2] * index_block + num_queries
    keys_per_split, num_splits = split_keys(longest_list, batch * num_kv_heads * m_tiles, q.device,
                                            launch["BLOCK_N"], num_splits)
    part_out, part_lse = partial_buffers(batch * num_kv_heads, num_splits, num_rows, head_dim, q.dtype, q.device)
    grid = (m_tiles, num_splits, batch * num_kv_heads)
    sparse_decode_split_kernel[grid](
        q, k_cache, v_cache, cache_lengths, indices, counts, part_out, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *indices.stride(), *counts.stride(),
        num_kv_heads, group, num_queries, keys_per_split, scale * LOG2E.value,
        INDEX_BLOCK=index_block, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype),
        WHOLE_TILES=index_block % launch["BLOCK_N"] == 0, **launch,
    )
    return part_out, part_lse


def selected_tokens(indices_row, count, cache_length, index_block):
    """The prefix tokens one index list selects, in list order (key blocks expanded and clipped)."""
    entries = indices_row[:count].long()
    tokens = (entries[:, None] * index_block + torch.arange(index_block, device=entries.device)).flatten()
    return tokens[tokens < cache_length]


def sparse_decode_attention_reference(q, k_cache, v_cache, cache_lengths, indices, counts, *, index_block=1,
                                      scale=None, return_lse=True):
    """Plain torch: gather each (row, KV head)'s selected tokens plus the block keys, dense softmax in fp32."""
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(batch):
        prefix = int(cache_lengths[b])
        block = torch.arange(prefix, prefix + num_queries, device=q.device)
        for h in range(num_kv_heads):
            tokens = torch.cat([selected_tokens(indices[b, h], int(counts[b, h]), prefix, index_block), block])
            keys, values = k_cache[b, tokens, h].to(compute), v_cache[b, tokens, h].to(compute)  # [n, D]
            heads = slice(h * group, (h + 1) * group)
            scores = (q[b, heads].to(compute) @ keys.T) * scale  # [group, L, n]
            out[b, heads] = (scores.softmax(-1) @ values).to(q.dtype)
            lse[b, heads] = scores.logsumexp(-1).float()
    return (out, lse) if return_lse else out
