"""Block-sparse attention over listed key blocks (MOMO, step 3).

The queries are cut into query blocks of chi rows; each (batch, head, query block) has a list of key
blocks of beta keys to attend to (MOMO's trimmed union plus the diagonal blocks). A program owns
BLOCK_M rows of one query block and walks its list, one key block per tile (BLOCK_N = beta), with the
online softmax of flash_attention.py (base 2, fp32 running max / sum / accumulator). The mask is
applied inside each tile: bidirectional, causal, or block-causal with block_size B (query at p sees
key j iff j // B <= p // B), and key padding k_valid [batch, N]. Lists may be shorter than their
buffer: entries < 0 are skipped. The walk stops after a list's last entry >= 0 and has no branch
inside (an entry < 0 before it is a tile past the keys, nothing loaded, every key hidden), so
Triton's pipeliner loads the next tiles while one is attended. A row that sees no listed key gets
out = 0 and lse = -inf.
GQA: query head h reads KV head h // group. Lists must be duplicate-free (a duplicate counts twice).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)
# Rows per program and launch settings on a GPU (the interpreter uses 16 rows); chi must be a
# multiple of BLOCK_M. Heads wider than 128 (DiffusionGemma's 256 and 512) take fewer rows and stages:
# a stage holds a K and a V tile of beta x head_dim, and one of at most WIDE_TILE elements fits once.
CUDA_TILES = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}
HEAD_DIMS = (16, 32, 64, 128, 256, 512)
WIDE_TILE = 64 * 512


def launch_tiles(q: torch.Tensor, beta: int) -> dict:
    """BLOCK_M and the launch settings for q's head_dim and device (the interpreter: 16 rows)."""
    head_dim = q.shape[-1]
    if not q.is_cuda:
        return {"BLOCK_M": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 128:
        return dict(CUDA_TILES)
    return {"BLOCK_M": 32 if head_dim == 256 else 16, "num_warps": 8,
            "num_stages": 2 if beta * head_dim < WIDE_TILE else 1}


def takes(head_dim: int, beta: int) -> bool:
    """Whether the MOMO kernels (this one and qsa_attention.py) take this head_dim and key block."""
    return head_dim in HEAD_DIMS and beta in (16, 32, 64, 128) and (head_dim <= 128 or beta * head_dim <= WIDE_TILE)


def check_head_dim(head_dim: int, beta: int):
    if head_dim not in HEAD_DIMS or beta not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} and beta 16, 32, 64 or 128, got {head_dim} and {beta}")
    if not takes(head_dim, beta):
        raise ValueError(f"beta x head_dim must be at most {WIDE_TILE} at head_dim > 128, got {beta} x {head_dim}")
LN_2 = tl.constexpr(math.log(2.0))


@triton.jit
def key_tile(k_ptr, v_ptr, valid_ptr, k_base, v_base, valid_base, keys, positions, row_ok, n, stride_kn, stride_kd,
             stride_vn, stride_vd, stride_valid_n, MASK_BLOCK: tl.constexpr, MASKED: tl.constexpr,
             HAS_VALID: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V of a tile of keys, and which (row, key) pairs the mask lets through. MASK_BLOCK is a
    compile-time constant, so `// MASK_BLOCK` compiles to a shift or a multiply instead of an integer
    division per element (one compilation per block size)."""
    dims = tl.arange(0, HEAD_DIM)
    visible = (keys[None, :] < n) & row_ok[:, None]
    if MASKED:
        visible = visible & ((keys // MASK_BLOCK)[None, :] <= (positions // MASK_BLOCK)[:, None])
    if HAS_VALID:
        key_valid = tl.load(valid_ptr + valid_base + keys * stride_valid_n, mask=keys < n, other=0)
        visible = visible & (key_valid[None, :] != 0)
    in_range = keys[:, None] < n
    k = tl.load(k_ptr + k_base + keys[:, None] * stride_kn + dims[None, :] * stride_kd, mask=in_range, other=0.0)
    v = tl.load(v_ptr + v_base + keys[:, None] * stride_vn + dims[None, :] * stride_vd, mask=in_range, other=0.0)
    return k, v, visible


@triton.jit
def online_softmax(scores, v, m_i, l_i, acc):
    """Fold a tile of base-2 scores (-inf = hidden) and its values into the running max, sum and output.
    Also returns the tile's own row sums of 2^(s - m) and that m (0 while nothing is seen), so
    log2 of the tile's sum of 2^s is m + log2(row sum) (qsa_attention.py's block scores)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: exp2 gives 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    tile_sum = tl.sum(p, axis=1)
    return m_new, l_i * alpha + tile_sum, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), tile_sum, m_safe


@triton.jit
def store_rows(out_ptr, lse_ptr, out_base, lse_base, rows, row_ok, acc, m_i, l_i, stride_on, stride_od, stride_ln,
               HEAD_DIM: tl.constexpr):
    """out = acc / l and lse = ln(sum of exp) for the rows (0 and -inf where a row saw nothing)."""
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + out_base + rows[:, None] * stride_on + dims[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * LN_2, float("-inf"))
    tl.store(lse_ptr + lse_base + rows * stride_ln, lse, mask=row_ok)


@triton.jit
def block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, blocks_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_valid_b, stride_valid_n,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    n, num_heads, group, chi, list_length, qk_scale,
    MASK_BLOCK: tl.constexpr, MASKED: tl.constexpr, HAS_VALID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, LIST_PAD: tl.constexpr,
):
    m_tile, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // num_heads, batch_head % num_heads
    kv_head = head // group
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    query_block = (m_tile * BLOCK_M) // chi
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qn + dims[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    list_base = blocks_ptr + batch * stride_bb + head * stride_bh + query_block * stride_bq
    # the walk ends after the list's last entry >= 0; an entry < 0 before it points past the keys, so
    # its loads read nothing and every key is hidden
    slots = tl.arange(0, LIST_PAD)
    entries = tl.load(list_base + slots * stride_bk, mask=slots < list_length, other=-1)
    end = tl.max(tl.where(entries >= 0, slots + 1, 0), axis=0)
    for entry in range(0, end):
        key_block = tl.load(list_base + entry * stride_bk)
        keys = tl.where(key_block >= 0, key_block * BLOCK_N, n) + tl.arange(0, BLOCK_N)
        k, v, visible = key_tile(k_ptr, v_ptr, valid_ptr, batch * stride_kb + kv_head * stride_kh,
                                 batch * stride_vb + kv_head * stride_vh, batch * stride_valid_b, keys, rows,
                                 row_ok, n, stride_kn, stride_kd, stride_vn, stride_vd, stride_valid_n,
                                 MASK_BLOCK, MASKED, HAS_VALID, HEAD_DIM)
        scores = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_i, l_i, acc, _, _ = online_softmax(scores, v, m_i, l_i, acc)
    store_rows(out_ptr, lse_ptr, batch * stride_ob + head * stride_oh, batch * stride_lb + head * stride_lh, rows,
               row_ok, acc, m_i, l_i, stride_on, stride_od, stride_ln, HEAD_DIM)


def block_sparse_attention(q, k, v, blocks, *, chi: int, beta: int, causal=False, block_size=None, k_valid=None,
                           scale=None):
    """q [batch, heads, N, D], k/v [batch, kv_heads, N, D], blocks [batch, heads, ceil(N / chi), L]
    int (key block indices, < 0 = none). Returns (out [batch, heads, N, D], lse [batch, heads, N] float32)."""
    batch, heads, n, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != n or k.shape[3] != head_dim or heads % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    check_head_dim(head_dim, beta)
    tiles = launch_tiles(q, beta)
    block_m = tiles["BLOCK_M"]
    if chi % block_m:
        raise ValueError(f"chi must be a multiple of {block_m}, got {chi}")
    if blocks.dim() != 4 or blocks.shape[:3] != (batch, heads, triton.cdiv(n, chi)):
        raise ValueError(f"blocks must be [batch, heads, ceil(N / chi), L] = [{batch}, {heads}, "
                         f"{triton.cdiv(n, chi)}, L], got {tuple(blocks.shape)}")
    if causal and block_size is not None:
        raise ValueError("causal and block_size are exclusive (causal is block_size = 1)")
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, dtype=torch.float32, device=q.device)
    valid = k_valid.view(torch.uint8) if k_valid is not None else lse
    valid_strides = k_valid.stride() if k_valid is not None else (0, 0)
    grid = (triton.cdiv(n, block_m), batch * heads)
    block_sparse_kernel[grid](
        q, k, v, valid, blocks, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *valid_strides, *blocks.stride(), *out.stride(), *lse.stride(),
        n, heads, heads // k.shape[1], chi, blocks.shape[3], scale * LOG2_E,
        MASK_BLOCK=1 if causal else (block_size or 1), MASKED=causal or block_size is not None,
        HAS_VALID=k_valid is not None, BLOCK_N=beta, HEAD_DIM=head_dim,
        LIST_PAD=max(1, triton.next_power_of_2(blocks.shape[3])), **tiles,
    )
    return out, lse


def block_sparse_attention_reference(q, k, v, blocks, *, chi: int, beta: int, causal=False, block_size=None,
                                     k_valid=None, scale=None):
    """Plain torch: the listed blocks as a dense [N, N] mask, softmax in fp32 or wider."""
    batch, heads, n, head_dim = q.shape
    group = heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    key_blocks = triton.cdiv(n, beta)
    listed = torch.zeros(batch, heads, blocks.shape[2], key_blocks + 1, dtype=torch.bool, device=q.device)
    listed.scatter_(3, torch.where(blocks >= 0, blocks.long(), key_blocks), True)
    positions = torch.arange(n, device=q.device)
    visible = listed[:, :, positions // chi][..., positions // beta]
    if causal or block_size is not None:
        size = 1 if causal else block_size
        visible = visible & ((positions[None, :] // size) <= (positions[:, None] // size))
    if k_valid is not None:
        visible = visible & k_valid[:, None, None, :]
    scores = q.to(compute) @ k.to(compute).repeat_interleave(group, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    probs = torch.nan_to_num((scores - lse[..., None]).exp(), nan=0.0)
    out = probs @ v.to(compute).repeat_interleave(group, 1)
    return out.to(q.dtype), lse.float()
