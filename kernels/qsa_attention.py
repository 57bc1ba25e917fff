"""Query-sparse attention with the key-block scores and an online top-k fused in (MOMO, step 1).

Every gamma-th query (rows 0, gamma, 2 gamma, ...) attends to all the keys it may see, exactly as
flash attention does. The key tiles are the key blocks (BLOCK_N = beta keys), so the kernel also
has each block's score, MOMO's eq. 4: S(j) = logsumexp over the block of the row's scaled scores
(-inf when the row sees none of the block), and each row keeps its k best blocks (the paper's
online exact top-k; among equal scores the lower block stays). With k_exact < k it runs the paper's
estimate instead (eq. 6-7, kernels/qsa_estimate.py); with tree=True the exact top-k lives in a
tournament tree in HBM (any k; the paper's third variant).

Masks as in flash_attention.py: bidirectional, causal, or block-causal with block_size B (query at
position p sees key j iff j // B <= p // B), and optional key padding k_valid [batch, N]. Sampled
query i sits at position i * gamma; with q_valid [batch, N] those at False columns choose no blocks.
GQA: query head h reads KV head h // group. Outputs (S = ceil(N / gamma)): o [batch, heads, S, D],
lse [batch, heads, S] float32, the top-k block indices [batch, heads, S, k] int32 and their scores.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .block_sparse_attention import check_head_dim, key_tile, launch_tiles, online_softmax, store_rows
from .qsa_estimate import ORDER_ROWS, estimated_top_k, golden_strides, group_maxima, last_blocks

LOG2_E = math.log2(math.e)
# Sampled rows per program and launch settings on a GPU (the interpreter uses 16 rows). The top-k
# buffer is BLOCK_M x K_SLOTS scores + indices in registers: 64 rows at 4 warps won the tuning sweep
# at 64K causal with k = 128 (docs/results/bench_momo.md, Launch settings), but at k = 256 they spill
# (docs/results/bench_momo.md), so buffers (exact or estimated) over WIDE_BUFFER slots take 16 rows.
CUDA_TILES = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}
WIDE_BUFFER = 128
LN_2 = tl.constexpr(math.log(2.0))


@triton.jit
def tree_insert(tree_score_ptr, tree_index_ptr, tree_leaf_ptr, row_base, root_score, root_leaf, block_score, block,
                seen, LOG_LEAVES: tl.constexpr, LEVELS: tl.constexpr):
    """The tournament tree (a winner tree over 2^LOG_LEAVES slots, in HBM): node 1 holds the minimum,
    kept in registers with the leaf it sits in (root_score, root_leaf per row). A block beating it
    overwrites that leaf and the path to the root is replayed. The path's siblings are never on the
    path, so all LOG_LEAVES of them load at once ([rows, LEVELS] gathers), the climb runs in
    registers, and the path's new nodes store at once: one round trip to memory per insertion instead
    of one per level. Skipped when no row of the tile inserts. Returns the new (root_score, root_leaf)."""
    update = seen & (block_score > root_score)
    if tl.max(update.to(tl.int32), axis=0) > 0:
        levels = tl.arange(0, LEVELS)[None, :]
        path = root_leaf[:, None] >> levels  # the path's node at each level, the leaf first
        sibling = path ^ 1
        on_path = update[:, None] & (levels < LOG_LEAVES)
        sibling_score = tl.load(tree_score_ptr + row_base[:, None] + sibling, mask=on_path, other=0.0)
        sibling_leaf = tl.load(tree_leaf_ptr + row_base[:, None] + sibling, mask=on_path & (levels > 0), other=0)
        sibling_leaf = tl.where(levels == 0, sibling, sibling_leaf)  # a leaf's minimum sits in itself
        score, leaf = block_score, root_leaf
        parent_score = tl.zeros(sibling_score.shape, tl.float32)
        parent_leaf = tl.zeros(sibling_leaf.shape, tl.int32)
        for level in tl.static_range(LOG_LEAVES):
            here = levels == level
            other_score = tl.max(tl.where(here, sibling_score, float("-inf")), axis=1)
            other_leaf = tl.max(tl.where(here, sibling_leaf, -1), axis=1)
            on_left = ((root_leaf >> level) & 1) == 0
            other_wins = tl.where(on_left, other_score < score, other_score <= score)  # the left child wins ties
            score = tl.where(other_wins, other_score, score)
            leaf = tl.where(other_wins, other_leaf, leaf)
            parent_score = tl.where(here, score[:, None], parent_score)
            parent_leaf = tl.where(here, leaf[:, None], parent_leaf)
        tl.store(tree_score_ptr + row_base + root_leaf, block_score, mask=update)
        tl.store(tree_index_ptr + row_base + root_leaf, block, mask=update)
        parents = row_base[:, None] + (path >> 1)
        tl.store(tree_score_ptr + parents, parent_score, mask=on_path)
        tl.store(tree_leaf_ptr + parents, parent_leaf, mask=on_path)
        root_score = tl.where(update, score, root_score)
        root_leaf = tl.where(update, leaf, root_leaf)
        tl.debug_barrier()  # the next insertion's loads see these stores, whichever thread made them
    return root_score, root_leaf


@triton.jit
def qsa_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, lse_ptr, top_index_ptr, top_score_ptr,
    tree_score_ptr, tree_index_ptr, tree_leaf_ptr, last_ptr, scan_ptr, stride_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_valid_b, stride_valid_n,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_tb, stride_th, stride_ts, stride_tk, stride_last_b, stride_scan_b,
    n_keys, num_sampled, num_heads, group, gamma, qk_scale, k_exact, k_greedy,
    MASK_BLOCK: tl.constexpr, MASKED: tl.constexpr, HAS_VALID: tl.constexpr, ESTIMATED: tl.constexpr,
    TREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, K_SLOTS: tl.constexpr,
    G_SLOTS: tl.constexpr, LEAVES: tl.constexpr, LOG_LEAVES: tl.constexpr, LEVELS: tl.constexpr,
    ORDER_ROWS: tl.constexpr,
):
    """A block's score comes from the online softmax's own exponentials, m + log2 of their sum with m
    the running max (cheaper than a second exp2 pass over the tile; a block whose scores all sit over
    126, in base 2, below m counts as unseen: its weight is below 2^-126). The exact top-k is a k-slot
    buffer in registers: a block replaces the buffer's minimum when its score is strictly higher, so
    among equal scores the lower block stays, at O(k) per block (a min and an argmin)."""
    # grid (batch * heads, row tiles), the longest rows first: a head group's programs for one row tile
    # run side by side and walk the same K/V tiles (faster than (row tiles, batch * heads) at
    # 64K-128K, k = 128: docs/results/bench_momo.md)
    batch_head, m_tile = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    batch, head = batch_head // num_heads, batch_head % num_heads
    kv_head = head // group
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_sampled
    positions = rows * gamma
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + batch * stride_qb + head * stride_qh + positions * stride_qn
    q = tl.load(q_rows[:, None] + dims[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    slots = tl.arange(0, K_SLOTS)
    # the exact buffer: slots past k_exact hold +inf, never the minimum, never replaced
    top_score = (tl.where(slots[None, :] < k_exact, float("-inf"), float("inf"))
                 + tl.zeros((BLOCK_M, K_SLOTS), tl.float32))
    top_index = tl.full((BLOCK_M, K_SLOTS), -1, tl.int32)
    # the estimated part (ESTIMATED): k_greedy slots filled in order, Welford statistics per row
    greedy_slots = tl.arange(0, G_SLOTS)
    greedy_index = tl.full((BLOCK_M, G_SLOTS), -1, tl.int32)
    greedy_score = tl.full((BLOCK_M, G_SLOTS), float("-inf"), tl.float32)
    filled = tl.zeros((BLOCK_M,), tl.int32)
    count = tl.zeros((BLOCK_M,), tl.float32)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    m2 = tl.zeros((BLOCK_M,), tl.float32)

    if TREE:  # the tree's root (its minimum and the leaf it sits in) rides in registers
        tree_base = (batch_head * num_sampled + rows).to(tl.int64) * (2 * LEAVES)
        root_score = tl.load(tree_score_ptr + tree_base + 1, mask=row_ok, other=float("inf"))
        root_leaf = tl.load(tree_leaf_ptr + tree_base + 1, mask=row_ok, other=1)

    last_row = tl.minimum(m_tile * BLOCK_M + BLOCK_M, num_sampled) - 1
    key_end = n_keys
    if MASKED:  # key tiles past what the tile's last row sees are never visited
        key_end = tl.minimum((last_row * gamma // MASK_BLOCK + 1) * MASK_BLOCK, n_keys)
    steps = tl.cdiv(key_end, BLOCK_N)
    if ESTIMATED:  # the scan of the row group (ORDER_ROWS rows) this program belongs to, in golden strides
        steps = tl.load(scan_ptr + batch * stride_scan_b + m_tile * BLOCK_M // ORDER_ROWS)
        stride = tl.load(stride_ptr + steps)
        last = tl.load(last_ptr + batch * stride_last_b + rows, mask=row_ok, other=0).to(tl.float32)
    for step in range(0, steps):
        start = (step * stride % steps) * BLOCK_N if ESTIMATED else step * BLOCK_N
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
            root_score, root_leaf = tree_insert(tree_score_ptr, tree_index_ptr, tree_leaf_ptr, tree_base, root_score,
                                                root_leaf, block_score, block, seen, LOG_LEAVES, LEVELS)
        if ESTIMATED:  # what the exact buffer displaced or rejected meets the threshold (eq. 6-7)
            count += seen.to(tl.float32)
            finite = tl.where(seen, block_score, 0.0)  # keeps -inf out of the arithmetic
            delta = tl.where(seen, finite - mean, 0.0)
            mean += tl.where(seen, delta / tl.maximum(count, 1.0), 0.0)
            m2 += tl.where(seen, delta * (finite - mean), 0.0)
            out_score = tl.where(replace, lowest, tl.where(seen, block_score, float("-inf")))
            out_index = tl.where(replace, lowest_index, tl.where(seen, block, -1))
            free = k_greedy - filled
            left = last - count + seen.to(tl.float32)  # the row's blocks not seen yet, this one included
            p = 1.0 - free.to(tl.float32) / tl.maximum(left, 1.0)
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


def check_inputs(q, k, v, gamma, beta, top_k, causal, block_size, k_valid, q_valid=None):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError("q must be [batch, heads, N, D] and k, v [batch, kv_heads, N, D]")
    batch, heads, n, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != n or k.shape[3] != head_dim or heads % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    check_head_dim(head_dim, beta)
    if gamma < 1 or top_k < 1:
        raise ValueError(f"gamma and top_k must be >= 1, got {gamma} and {top_k}")
    if causal and block_size is not None:
        raise ValueError("causal and block_size are exclusive (causal is block_size = 1)")
    for name, valid in (("k_valid", k_valid), ("q_valid", q_valid)):
        if valid is not None and (valid.shape != (batch, n) or valid.dtype != torch.bool):
            raise ValueError(f"{name} must be a bool tensor of shape ({batch}, {n})")


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
                  causal=False, block_size=None, k_valid=None, q_valid=None, scale=None):
    """See the module docstring. k_exact: None (or top_k) for the exact top-k; smaller for the
    estimated one (k_exact exact slots, the rest by threshold: `estimated_top_k`): what the exact slots
    displace or reject fills the other k - k_exact slots when it beats a Gaussian threshold from
    Welford running statistics (O(1) per block beyond the small exact part), visiting a row's blocks in
    golden-ratio strides (kernels/qsa_estimate.py). tree: the exact top-k in a tournament tree in HBM
    instead of the register buffer (O(log k) loads and stores per accepted block, issued at once).
    Sampled rows at q_valid False choose no blocks and leave the estimate's scan order alone.
    Returns (o, lse, top_indices, top_scores): top_indices -1 = empty slot (the row sees fewer blocks),
    top_scores [batch, heads, S, k] float32 (natural log), in buffer order (unsorted; the estimate's
    k_exact exact slots first)."""
    check_inputs(q, k, v, gamma, beta, top_k, causal, block_size, k_valid, q_valid)
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
    tiles = dict(CUDA_TILES) if q.is_cuda and head_dim <= 128 else launch_tiles(q, beta)  # wide heads: as step 3's
    k_slots = triton.next_power_of_2(max(register_slots, 1))
    g_slots = triton.next_power_of_2(max(top_k - k_exact, 1))
    if max(k_slots, g_slots) > WIDE_BUFFER:
        tiles["BLOCK_M"] = 16
    estimated = k_exact < top_k
    if estimated and q.is_cuda:  # with its greedy slots and Welford state, 2 K/V stages beat 3 (bench_momo.md)
        tiles["num_stages"] = min(tiles["num_stages"], 2)
    assert ORDER_ROWS % tiles["BLOCK_M"] == 0, "a program's rows must lie in one scan-order group"
    last = last_blocks(n, gamma, beta, causal, block_size, k_valid, batch, q.device, q_valid) if estimated else lse
    scans = group_maxima(last) if estimated else lse  # int32, as last_blocks gives it
    strides = golden_strides(triton.cdiv(n, beta), q.device) if estimated else lse
    grid = (batch * heads, triton.cdiv(sampled, tiles["BLOCK_M"]))
    qsa_kernel[grid](
        q, k, v, valid, out, lse, top_index, top_score, tree_score, tree_index, tree_leaf, last, scans, strides,
        *q.stride(), *k.stride(), *v.stride(), *valid_strides, *out.stride(), *lse.stride(),
        *top_index.stride(), last.stride(0), scans.stride(0),
        n, sampled, heads, heads // k.shape[1], gamma, scale * LOG2_E, register_slots, top_k - k_exact,
        MASK_BLOCK=1 if causal else (block_size or 1), MASKED=causal or block_size is not None,
        HAS_VALID=k_valid is not None, ESTIMATED=estimated, TREE=tree, BLOCK_N=beta, HEAD_DIM=head_dim,
        K_SLOTS=k_slots, G_SLOTS=g_slots,
        LEAVES=leaves, LOG_LEAVES=int(math.log2(leaves)), LEVELS=triton.next_power_of_2(max(int(math.log2(leaves)), 1)),
        ORDER_ROWS=ORDER_ROWS, **tiles,
    )
    if tree:
        top_index = tree_index[..., leaves : leaves + top_k].contiguous()
        top_score = tree_score[..., leaves : leaves + top_k].contiguous()
    return (out, lse, *unchosen_padding(top_index, top_score, q_valid, gamma))


def unchosen_padding(top_index, top_score, q_valid, gamma):
    """The top-k with the sampled rows at padded columns (q_valid False) emptied: -1 and -inf."""
    if q_valid is None:
        return top_index, top_score
    real = q_valid[:, None, ::gamma, None]
    return torch.where(real, top_index, -1), torch.where(real, top_score, float("-inf"))


def qsa_attention_reference(q, k, v, *, gamma: int, beta: int, top_k: int, k_exact: int | None = None,
                            causal=False, block_size=None, k_valid=None, q_valid=None, scale=None):
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
    if q_valid is not None:  # padded sampled rows see no block, so they choose none and scan nothing
        block_scores = block_scores.masked_fill(~q_valid[:, None, ::gamma, None], float("-inf"))
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
