"""Query-sparse attention with the key-block scores and an online top-k fused in (MOMO, step 1).

Every gamma-th query (rows 0, gamma, 2 gamma, ...) attends to all the keys it may see, exactly as
flash attention does (online softmax in base 2, fp32 running max / sum / accumulator). The key tiles
are the key blocks (BLOCK_N = beta keys), so while a tile is in registers the kernel also has its
block score, MOMO's eq. 4: S(j) = logsumexp over the block of the row's scaled scores (-inf when the
row sees none of the block), taken from the online softmax's own exponentials, m + log2 of their sum
with m the running max (a second exp2 pass over the tile cost 20% more time at 64K-128K; a block whose
scores all sit over 126, in base 2, below m counts as unseen: its weight is below 2^-126). Each row
keeps the k best blocks in a k-slot buffer held in registers (the paper's online exact top-k): a
block replaces the buffer's minimum when its score is strictly higher, so among equal scores the
lower block stays, and the buffer ends with the exact top-k. That update costs O(k) per block (a min
and an argmin over the buffer). With k_exact < k the kernel runs the paper's estimate instead
(eq. 6-7): only k_exact slots are exact, and what they displace or reject fills the other k - k_exact
slots when it beats a Gaussian threshold from Welford running statistics (O(1) per block beyond the
small exact part; `estimated_top_k` is its torch form). Its choice depends on the order the blocks arrive in, which the paper leaves open: it scans each row's
key blocks from the last back to the first (FlashAttention-2's order), so a causal row's local
blocks, often its heaviest, meet the threshold while the slots are still free, and the blocks left
to scan at block j are simply j + 1 (forwards, the local blocks came last and mostly found the slots
gone: 0.970 -> 0.982 of the oracle's mass at 32K, docs/results/momo_synthetic.md). With
tree=True the exact top-k lives in a tournament tree in HBM instead (O(log k) loads and stores per
accepted block, any k; the paper's third variant).

Masks as in flash_attention.py: bidirectional, causal, or block-causal with block_size B (query at
position p sees key j iff j // B <= p // B), and optional key padding k_valid [batch, N]. Sampled
query i sits at position i * gamma. GQA: query head h reads KV head h // group.
Outputs: o [batch, heads, S, D] (S = ceil(N / gamma)), lse [batch, heads, S] float32, and the top-k
blocks per sampled row: indices [batch, heads, S, k] int32 (-1 = empty slot: the row sees fewer
blocks) with their scores [batch, heads, S, k] float32 (natural log), in buffer order (unsorted;
the estimate's k_exact exact slots first).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .block_sparse_attention import key_tile, online_softmax, store_rows

LOG2_E = math.log2(math.e)
# Sampled rows per program and launch settings on a GPU (the interpreter uses 16 rows). The top-k
# buffer is BLOCK_M x K_SLOTS scores + indices in registers: 64 rows at 4 warps ran fastest on an H100
# at 64K causal with k = 128 (19.3 ms vs 29.5 at 16 rows, 23.3 at 32; 8 warps slower at each:
# docs/results/bench_momo_tune.md), but at k = 256 they spill (MOMO 121 ms at 64 rows in
# docs/results/bench_momo.md, 87.5 at 16 in bench_momo_tune.md), so buffers (exact or estimated) over WIDE_BUFFER slots take 16 rows.
CUDA_TILES = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}
WIDE_BUFFER = 128
LN_2 = tl.constexpr(math.log(2.0))


@triton.jit
def tree_insert(tree_score_ptr, tree_index_ptr, tree_leaf_ptr, row_base, block_score, block, seen,
                LEAVES: tl.constexpr, LOG_LEAVES: tl.constexpr):
    """The tournament tree (a winner tree over LEAVES slots, in HBM): node 1 holds the minimum and
    the leaf it sits in; a block beating it overwrites that leaf and the path to the root is
    replayed, O(log k) loads and stores. Rows are independent; a barrier orders each level."""
    root_score = tl.load(tree_score_ptr + row_base + 1)
    update = seen & (block_score > root_score)
    node = tl.load(tree_leaf_ptr + row_base + 1)
    tl.store(tree_score_ptr + row_base + node, block_score, mask=update)
    tl.store(tree_index_ptr + row_base + node, block, mask=update)
    for _ in tl.static_range(LOG_LEAVES):
        tl.debug_barrier()
        node = node // 2
        left = 2 * node
        left_score = tl.load(tree_score_ptr + row_base + left, mask=update, other=0.0)
        right_score = tl.load(tree_score_ptr + row_base + left + 1, mask=update, other=0.0)
        left_leaf = tl.where(left >= LEAVES, left, tl.load(tree_leaf_ptr + row_base + left, mask=update & (left < LEAVES), other=0))
        right_leaf = tl.where(left + 1 >= LEAVES, left + 1,
                              tl.load(tree_leaf_ptr + row_base + left + 1, mask=update & (left + 1 < LEAVES), other=0))
        left_wins = left_score <= right_score
        tl.store(tree_score_ptr + row_base + node, tl.where(left_wins, left_score, right_score), mask=update)
        tl.store(tree_leaf_ptr + row_base + node, tl.where(left_wins, left_leaf, right_leaf), mask=update)
    tl.debug_barrier()


@triton.jit
def qsa_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, lse_ptr, top_index_ptr, top_score_ptr,
    tree_score_ptr, tree_index_ptr, tree_leaf_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_valid_b, stride_valid_n,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_tb, stride_th, stride_ts, stride_tk,
    n_keys, num_sampled, num_heads, group, gamma, qk_scale, k_exact, k_greedy,
    MASK_BLOCK: tl.constexpr, MASKED: tl.constexpr, HAS_VALID: tl.constexpr, ESTIMATED: tl.constexpr, TREE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, K_SLOTS: tl.constexpr,
    G_SLOTS: tl.constexpr, LEAVES: tl.constexpr, LOG_LEAVES: tl.constexpr,
):
    # grid (batch * heads, row tiles), the longest rows first: a head group's programs for one row tile
    # run side by side and walk the same K/V tiles (7-15% faster than (row tiles, batch * heads) at
    # 64K-128K, k = 128; docs/results/bench_momo.md)
    batch_head, m_tile = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
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
    # the exact buffer: slots past k_exact hold +inf, never the minimum, never replaced
    top_score = tl.where(slots[None, :] < k_exact, float("-inf"), float("inf")) + tl.zeros((BLOCK_M, K_SLOTS), tl.float32)
    top_index = tl.full((BLOCK_M, K_SLOTS), -1, tl.int32)
    # the estimated part (ESTIMATED): k_greedy slots filled in order, Welford statistics per row
    greedy_slots = tl.arange(0, G_SLOTS)
    greedy_index = tl.full((BLOCK_M, G_SLOTS), -1, tl.int32)
    greedy_score = tl.full((BLOCK_M, G_SLOTS), float("-inf"), tl.float32)
    filled = tl.zeros((BLOCK_M,), tl.int32)
    count = tl.zeros((BLOCK_M,), tl.float32)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    m2 = tl.zeros((BLOCK_M,), tl.float32)

    last_row = tl.minimum(m_tile * BLOCK_M + BLOCK_M, num_sampled) - 1
    key_end = n_keys
    if MASKED:  # key tiles past what the tile's last row sees are never visited
        key_end = tl.minimum((last_row * gamma // MASK_BLOCK + 1) * MASK_BLOCK, n_keys)
    tiles = tl.cdiv(key_end, BLOCK_N)
    for tile in range(0, tiles):
        start = (tiles - 1 - tile) * BLOCK_N if ESTIMATED else tile * BLOCK_N  # the estimate scans backwards
        keys = start + tl.arange(0, BLOCK_N)
        k, v, visible = key_tile(k_ptr, v_ptr, valid_ptr, batch * stride_kb + kv_head * stride_kh,
                                 batch * stride_vb + kv_head * stride_vh, batch * stride_valid_b, keys, positions,
                                 row_ok, n_keys, stride_kn, stride_kd, stride_vn, stride_vd, stride_valid_n,
                                 MASK_BLOCK, MASKED, HAS_VALID, HEAD_DIM)
        scores = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))  # base 2

        # the online softmax's exponentials give the block score too: log2 sum 2^s = m + log2 sum 2^(s - m)
        m_i, l_i, acc, tile_sum, m_safe = online_softmax(scores, v, m_i, l_i, acc)
        seen = tile_sum > 0  # a block 126 (base 2) below the running max underflows: weight < 2^-126, unseen
        block_score = tl.where(seen, (m_safe + tl.log2(tl.where(seen, tile_sum, 1.0))) * LN_2, float("-inf"))

        block = start // BLOCK_N
        lowest = tl.min(top_score, axis=1)
        lowest_slot = tl.argmin(top_score, axis=1)
        replace = seen & (block_score > lowest)
        hit = replace[:, None] & (slots[None, :] == lowest_slot[:, None])
        lowest_index = tl.max(tl.where(slots[None, :] == lowest_slot[:, None], top_index, -1), axis=1)
        top_score = tl.where(hit, block_score[:, None], top_score)
        top_index = tl.where(hit, block, top_index)
        if TREE:
            tree_base = (batch_head * num_sampled + rows).to(tl.int64) * (2 * LEAVES)
            tree_insert(tree_score_ptr, tree_index_ptr, tree_leaf_ptr, tree_base, block_score, block, seen,
                        LEAVES, LOG_LEAVES)
        if ESTIMATED:  # what the exact buffer displaced or rejected meets the threshold (eq. 6-7)
            count += seen.to(tl.float32)
            finite = tl.where(seen, block_score, 0.0)  # keeps -inf out of the arithmetic
            delta = tl.where(seen, finite - mean, 0.0)
            mean += tl.where(seen, delta / tl.maximum(count, 1.0), 0.0)
            m2 += tl.where(seen, delta * (finite - mean), 0.0)
            out_score = tl.where(replace, lowest, tl.where(seen, block_score, float("-inf")))
            out_index = tl.where(replace, lowest_index, tl.where(seen, block, -1))
            free = k_greedy - filled
            p = 1.0 - free.to(tl.float32) / (block + 1.0)  # blocks left to scan: this one and those before it
            sigma = tl.sqrt(m2 / tl.maximum(count - 1.0, 1.0))
            z = (out_score - mean) / tl.maximum(sigma * 1.4142135623730951, 1e-30)
            beats = tl.where(sigma > 0, tl.erf(z) > 2.0 * p - 1.0, out_score > mean)
            accept = (out_index >= 0) & (free > 0) & ((p <= 0) | beats)
            take = accept[:, None] & (greedy_slots[None, :] == filled[:, None])
            greedy_index = tl.where(take, out_index[:, None], greedy_index)
            greedy_score = tl.where(take, out_score[:, None], greedy_score)
            filled += accept.to(tl.int32)

    store_rows(out_ptr, lse_ptr, batch * stride_ob + head * stride_oh, batch * stride_lb + head * stride_lh, rows,
               row_ok, acc, m_i, l_i, stride_os, stride_od, stride_ls, HEAD_DIM)
    row_base = batch * stride_tb + head * stride_th + rows[:, None] * stride_ts
    keep = row_ok[:, None] & (slots[None, :] < k_exact)
    tl.store(top_index_ptr + row_base + slots[None, :] * stride_tk, top_index, mask=keep)
    tl.store(top_score_ptr + row_base + slots[None, :] * stride_tk, top_score, mask=keep)
    if ESTIMATED:
        keep = row_ok[:, None] & (greedy_slots[None, :] < k_greedy)
        greedy_offsets = row_base + (k_exact + greedy_slots[None, :]) * stride_tk
        tl.store(top_index_ptr + greedy_offsets, greedy_index, mask=keep)
        tl.store(top_score_ptr + greedy_offsets, greedy_score, mask=keep)


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


def new_tree(rows_shape, leaves, top_k, device):
    """Tournament-tree scratch per row: scores and block indices of nodes 1 .. 2 leaves - 1 (leaves at
    leaves .. 2 leaves - 1; those past top_k hold +inf and are never the minimum) and, per internal
    node, the leaf its minimum sits in (initially the leftmost leaf under it)."""
    scores = torch.full((*rows_shape, 2 * leaves), float("-inf"), dtype=torch.float32, device=device)
    scores[..., leaves + top_k :] = float("inf")
    nodes = torch.arange(2 * leaves, device=device)
    depth = torch.floor(torch.log2(nodes.clamp(min=1).double())).long()
    leftmost = nodes * (2 ** (int(math.log2(leaves)) - depth))
    leaf = torch.where(nodes >= leaves, nodes, leftmost).to(torch.int32).expand(*rows_shape, -1).contiguous()
    if top_k < leaves:  # the initial minimum must sit in a real slot: replay the winners bottom-up
        for node in range(leaves - 1, 0, -1):
            left, right = 2 * node, 2 * node + 1
            left_wins = scores[..., left] <= scores[..., right]
            scores[..., node] = torch.where(left_wins, scores[..., left], scores[..., right])
            leaf[..., node] = torch.where(left_wins, leaf[..., left] if left < leaves else left,
                                          leaf[..., right] if right < leaves else right)
    index = torch.full((*rows_shape, 2 * leaves), -1, dtype=torch.int32, device=device)
    return scores, index, leaf


def qsa_attention(q, k, v, *, gamma: int, beta: int, top_k: int, k_exact: int | None = None, tree=False,
                  causal=False, block_size=None, k_valid=None, scale=None):
    """See the module docstring. k_exact: None (or top_k) for the exact top-k; smaller for the
    estimated one (k_exact exact slots, the rest by threshold: `estimated_top_k`). tree: the exact
    top-k in a tournament tree in HBM instead of the register buffer.
    Returns (o, lse, top_indices, top_scores)."""
    check_inputs(q, k, v, gamma, beta, top_k, causal, block_size, k_valid)
    k_exact = top_k if k_exact is None else k_exact
    if not 0 <= k_exact <= top_k:
        raise ValueError(f"k_exact must be in [0, top_k], got {k_exact}")
    if tree and k_exact < top_k:
        raise ValueError("the tournament tree keeps the exact top-k: leave k_exact unset")
    batch, heads, n, head_dim = q.shape
    sampled = triton.cdiv(n, gamma)
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(batch, heads, sampled, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, sampled, dtype=torch.float32, device=q.device)
    top_index = torch.empty(batch, heads, sampled, top_k, dtype=torch.int32, device=q.device)
    top_score = torch.empty(batch, heads, sampled, top_k, dtype=torch.float32, device=q.device)
    valid = k_valid.view(torch.uint8) if k_valid is not None else lse
    valid_strides = k_valid.stride() if k_valid is not None else (0, 0)
    leaves = triton.next_power_of_2(top_k) if tree else 1
    tree_score, tree_index, tree_leaf = new_tree((batch, heads, sampled), leaves, top_k if tree else 1, q.device)
    register_slots = 0 if tree else k_exact
    tiles = dict(CUDA_TILES) if q.is_cuda else {"BLOCK_M": 16, "num_warps": 4, "num_stages": 1}
    k_slots = triton.next_power_of_2(max(register_slots, 1))
    g_slots = triton.next_power_of_2(max(top_k - k_exact, 1))
    if max(k_slots, g_slots) > WIDE_BUFFER:
        tiles["BLOCK_M"] = 16
    grid = (batch * heads, triton.cdiv(sampled, tiles["BLOCK_M"]))
    qsa_kernel[grid](
        q, k, v, valid, out, lse, top_index, top_score, tree_score, tree_index, tree_leaf,
        *q.stride(), *k.stride(), *v.stride(), *valid_strides, *out.stride(), *lse.stride(),
        *top_index.stride(),
        n, sampled, heads, heads // k.shape[1], gamma, scale * LOG2_E, register_slots, top_k - k_exact,
        MASK_BLOCK=1 if causal else (block_size or 1), MASKED=causal or block_size is not None, HAS_VALID=k_valid is not None, ESTIMATED=k_exact < top_k,
        TREE=tree, BLOCK_N=beta, HEAD_DIM=head_dim,
        K_SLOTS=k_slots, G_SLOTS=g_slots,
        LEAVES=leaves, LOG_LEAVES=int(math.log2(leaves)), **tiles,
    )
    if tree:
        top_index = tree_index[..., leaves : leaves + top_k].contiguous()
        top_score = tree_score[..., leaves : leaves + top_k].contiguous()
    return out, lse, top_index, top_score


def qsa_attention_reference(q, k, v, *, gamma: int, beta: int, top_k: int, k_exact: int | None = None,
                            causal=False, block_size=None, k_valid=None, scale=None):
    """Plain torch (dense scores of the sampled rows, fp32 or wider): the same outputs; the exact
    top-k sorted by score (ties to the lower block), or estimated_top_k's choice (k_exact < top_k)."""
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
    if k_exact is not None and k_exact < top_k:
        chosen = estimated_top_k(block_scores, top_k, k_exact)
        picked = block_scores.gather(-1, chosen.clamp(min=0)).float()
        return out.to(q.dtype), lse.float(), chosen.to(torch.int32), torch.where(chosen >= 0, picked, float("-inf"))
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


def estimated_top_k(scores, k, k_exact):
    """The estimated online top-k (MOMO eq. 6-7 with an exact part), in torch, scanning each row's
    blocks from the last to the first as the kernel does. scores [..., blocks] (-inf = not visible).
    Each visible block updates Welford's mean m and variance sigma^2 and is offered to a k_exact-slot
    exact buffer; what the buffer rejects or displaces takes one of the k - k_exact other slots when
    it beats the threshold: erf((s - m) / (sigma sqrt 2)) > 2p - 1 (s > m while sigma = 0),
    p = 1 - free slots / blocks left to scan (block j: j + 1, itself included), taken outright when
    p <= 0. Returns [..., k] block indices (-1 = empty): the exact part, then the others in the
    order they were taken."""
    rows_shape, blocks = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(-1, blocks).double()
    rows = flat.shape[0]
    device = scores.device
    exact_scores = flat.new_full((rows, k_exact), float("-inf"))
    exact_index = torch.full((rows, k_exact), -1, dtype=torch.long, device=device)
    greedy = torch.full((rows, k - k_exact), -1, dtype=torch.long, device=device)
    filled = torch.zeros(rows, dtype=torch.long, device=device)
    count, mean, m2 = (torch.zeros(rows, dtype=torch.float64, device=device) for _ in range(3))
    all_rows = torch.arange(rows, device=device)
    for j in reversed(range(blocks)):
        score = flat[:, j]
        visible = score > float("-inf")
        count += visible.double()
        delta = torch.where(visible, score - mean, 0.0)
        mean += torch.where(visible, delta / count.clamp(min=1), 0.0)
        m2 += torch.where(visible, delta * (score - mean), 0.0)
        out_score, out_index = torch.where(visible, score, float("-inf")), torch.where(visible, j, -1)
        if k_exact:
            slot = exact_scores.argmin(dim=1)
            lowest, lowest_index = exact_scores[all_rows, slot], exact_index[all_rows, slot]
            takes = visible & (score > lowest)
            out_score, out_index = torch.where(takes, lowest, out_score), torch.where(takes, lowest_index, out_index)
            exact_scores[all_rows, slot] = torch.where(takes, score, lowest)
            exact_index[all_rows, slot] = torch.where(takes, j, lowest_index)
        free = greedy.shape[1] - filled
        p = 1 - free.double() / (j + 1)
        sigma = (m2 / (count - 1).clamp(min=1)).sqrt()
        z = (out_score - mean) / (sigma * math.sqrt(2)).clamp(min=1e-300)
        beats = torch.where(sigma > 0, torch.erf(z) > 2 * p - 1, out_score > mean)
        accept = (out_index >= 0) & (free > 0) & ((p <= 0) | beats)
        if greedy.shape[1]:
            target = filled.clamp(max=greedy.shape[1] - 1)
            greedy[all_rows, target] = torch.where(accept, out_index, greedy[all_rows, target])
        filled += accept.long()
    return torch.cat([exact_index, greedy], dim=1).view(*rows_shape, k)

