"""Dense attention forward (FlashAttention-2) for prefill and canvas steps.

out = softmax(scale * q k^T, masked) v without the [N_q, N_k] score matrix: a program owns BLOCK_M query
rows of one (batch, head), all their output columns or half (V_PARTS = 2, for head_dim 512's registers),
and walks the keys in tiles of BLOCK_N with an online softmax (fp32, base 2).
q [batch, num_heads, N_q, D], k and v [batch, num_kv_heads, N_k, D], D in HEAD_DIMS; query head h reads
KV head h // group. Too few query tiles to fill the GPU (a canvas at batch 1) cut the keys into slices
too, each program writing a partial that decode_attention's merge_splits combines (split-KV).
Masks. Query i sits at position i + (N_k - N_q) (the last N_q positions). Key j is visible to it iff
    causal=True:     j <= pos(i)              (block-causal with B = 1, and the kernel treats it so)
    block_size=B:    j // B <= pos(i) // B   (block-causal, blocks aligned to position 0)
    neither:         always (bidirectional)
and k_valid ([batch, N_k], or [batch, num_kv_heads, N_k] per KV head), when given, is True at j.
A query row that sees no key at all gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .decode_attention import merge_splits, new_buffer, split_keys
from .tuning import Tuner

LOG2_E = math.log2(math.e)  # host side: folded into the scale
LN_2 = tl.constexpr(math.log(2.0))  # kernel side: lse back from base 2 (kernels read only constexpr globals)

# The tuning space per head dim (kernels/tuning.py measures it once per machine; kernels/tuned.json
# ships the choices for some GPUs); it holds the tiles that won some key in `python scripts/bench.py
# tune`, plus one that fits float32 inputs. Prefill is compute-bound, so the tiles are the largest that keep
# one CTA per SM fed: BLOCK_M = 128 query rows (two warpgroups of 64 rows for sm_90's wgmma at
# 8 warps) and BLOCK_N = 64 or 128 keys. Shared memory bounds the pipeline depth: at D = 128 (16-bit)
# Q takes 32 KB and each stage of K + V 2 * BLOCK_N * 256 B, so BLOCK_N = 128 fits 3 stages (224 KB)
# under sm_90's 227 KB limit, just; that tile wins most long prefills' keys in kernels/tuned.json
# (docs/results/bench_kernels.md times it). At D = 64 everything halves, and 128 x 64 tiles win. Float32
# inputs (tests) double the bytes: of the D = 128 tiles only 128 x 64 with 2 stages fits them, and
# the tuner skips those that do not. DiffusionGemma's D = 256 and 512 take fewer rows and keys: at D = 512
# a 64-row fp32 accumulator is 128 registers a thread at 8 warps; with V_PARTS = 2 (each program all of
# q . k for half of the output columns) it halves and 128 rows fit. 16 x 16 fits float32.
def _tiles(block_m, block_n, warps, stages, v_parts=1) -> dict:
    parts = {"V_PARTS": v_parts} if v_parts > 1 else {}  # 1 is the kernel's default, as the settings files store it
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, **parts, "num_warps": warps, "num_stages": stages}


_TUNING_SPACE = {
    128: [_tiles(128, 64, 8, 2), _tiles(128, 128, 8, 2), _tiles(128, 128, 8, 3)],
    64: [_tiles(128, 64, 4, 3), _tiles(128, 64, 8, 3)],
    256: [_tiles(128, 64, 8, 2), _tiles(64, 64, 4, 2), _tiles(64, 32, 4, 3), _tiles(16, 16, 4, 1)],
    512: [_tiles(64, 32, 8, 2), _tiles(64, 64, 8, 1), _tiles(32, 32, 4, 2), _tiles(16, 16, 4, 1),
          _tiles(128, 32, 8, 2, v_parts=2)],
}

# A few query rows against many keys (DyLLM's 64-192 salient rows a head) leave much of a 128-row tile empty: up
# to FEW_ROWS rows the tuner also tries 64-row tiles (one warpgroup) at D <= 128; D = 256's and 512's are all such.
FEW_ROWS = 256
_FEW_ROW_TILES = {d: [_tiles(64, 64, 4, 3), _tiles(64, 128, 4, 3)] if d <= 128 else [] for d in _TUNING_SPACE}
HEAD_DIMS = tuple(sorted(_TUNING_SPACE))
TUNER = Tuner("flash_attention")

# The shortest key slice of the split-KV path: replayed from a CUDA graph, merge_splits' launch costs less than
# the SMs one slice leaves idle (a canvas's windows, a few hundred rows against 2K-32K keys; bench.py routing).
MIN_KEYS_PER_SLICE = 512

# Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), where timing means
# nothing: fixed small tiles, so that small test shapes cross many tile edges. Tests may change them.
INTERPRETER_TILES = {"BLOCK_M": 32, "BLOCK_N": 16}


@functools.lru_cache(maxsize=None)
def candidate_tiles(head_dim: int, tuning_rows: int) -> list[dict]:
    """The tiles tried for a key (one list per head dim and row bucket, built once)."""
    return _TUNING_SPACE[head_dim] + (_FEW_ROW_TILES[head_dim] if tuning_rows <= FEW_ROWS else [])


@triton.jit
def _key_rows(base, keys, n_k, stride_n, columns, stride_d, MASK_TILE: tl.constexpr):
    """[BLOCK_N, len(columns)] of K or V at rows `keys`; in a masked tile the rows past n_k read as 0."""
    ptrs = base + keys[:, None].to(tl.int64) * stride_n + columns[None, :].to(tl.int64) * stride_d
    if MASK_TILE:
        rows = tl.load(ptrs, mask=(keys < n_k)[:, None], other=0.0)
    else:
        rows = tl.load(ptrs)
    return rows


@triton.jit
def _attend_key_tiles(
    acc, l_i, m_i, q, q_high, q_block,
    k_base, v_base, valid_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_valid_n,
    key_start, key_stop, n_k, block_size, qk_scale,
    offs_n, offs_low, offs_high, offs_d,
    MASK_TILE: tl.constexpr, BLOCK_CAUSAL: tl.constexpr, HAS_K_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr, V_PARTS: tl.constexpr,
):
    """Fold the key tiles [key_start, key_stop) into the running (acc, l_i, m_i).

    MASK_TILE=False is for tiles every row of the query tile sees in full (only k_valid can hide a
    key there); MASK_TILE=True adds the bounds check against n_k and the block-causal comparison.
    Per row, m is the largest scaled score so far, l the sum of exp(score - m) and acc the sum of
    exp(score - m) * v; a tile that raises m to m' rescales l and acc by exp(m - m'), so at the end
    out = acc / l and lse = m + log(l). Scores are in base 2 (the scale carries log2(e), so every
    exponential is an exp2); the probabilities are cast to the input dtype for P @ V, as in
    FlashAttention-2. With V_PARTS = 2 the program owns the output columns offs_d, half of the head: its
    scores still take all of q . k, in two halves (offs_low, then offs_high), as both parts add them."""
    for key_tile_start in range(key_start, key_stop, BLOCK_N):
        keys = key_tile_start + offs_n  # [BLOCK_N]
        k = _key_rows(k_base, keys, n_k, stride_kn, offs_low, stride_kd, MASK_TILE)  # [BLOCK_N, HEAD_DIM // V_PARTS]

        # [BLOCK_M, BLOCK_N] raw scores q . k (not yet scaled)
        scores = tl.dot(q, tl.trans(k))
        if V_PARTS == 2:  # the other half of the head
            k = _key_rows(k_base, keys, n_k, stride_kn, offs_high, stride_kd, MASK_TILE)
            scores = tl.dot(q_high, tl.trans(k), scores)
        if MASK_TILE:
            in_range = keys < n_k  # [BLOCK_N]
            visible = in_range[None, :]  # [BLOCK_M, BLOCK_N] once broadcast
            if BLOCK_CAUSAL:
                visible = visible & ((keys // block_size)[None, :] <= q_block[:, None])
            if HAS_K_VALID:
                key_ok = tl.load(valid_base + keys.to(tl.int64) * stride_valid_n, mask=in_range, other=0)  # [BLOCK_N]
                visible = visible & (key_ok != 0)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        elif HAS_K_VALID:
            key_ok = tl.load(valid_base + keys.to(tl.int64) * stride_valid_n)  # [BLOCK_N]
            if tl.min(key_ok, 0) == 0:  # only a tile with a hidden key pays for the select
                scores = tl.where((key_ok != 0)[None, :], scores, float("-inf"))

        # Online softmax in base 2. scale > 0, so max(scores) * qk_scale is the max of the scaled
        # scores, and each probability costs one fused multiply-add and one exp2.
        m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)  # [BLOCK_M]
        alpha = tl.math.exp2(m_i - m_new)  # [BLOCK_M]
        p = tl.math.exp2(scores * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)

        v = _key_rows(v_base, keys, n_k, stride_vn, offs_d, stride_vd, MASK_TILE)  # [BLOCK_N, HEAD_DIM // V_PARTS]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_M, HEAD_DIM // V_PARTS]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_q", "n_k", "keys_per_split", "stride_valid_b", "stride_valid_h", "stride_span_b"])
def _flash_attention_fwd(
    Q, K, V, K_VALID, VISIBLE_SPAN, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_valid_b, stride_valid_h, stride_valid_n, stride_span_b, stride_span_h,
    stride_ob, stride_oh, stride_os, stride_om, stride_od,
    stride_lb, stride_lh, stride_ls, stride_lm,
    n_q, n_k, num_heads, group, block_size, qk_scale, keys_per_split,
    HEAD_DIM: tl.constexpr, BLOCK_CAUSAL: tl.constexpr, HAS_K_VALID: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_PARTS: tl.constexpr = 1,
):
    # Under a (block-)causal mask the last query tiles see the most keys: first, so short ones fill the tail.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    batch_head = tl.program_id(1) // V_PARTS
    part = tl.program_id(1) % V_PARTS  # which part of the head's output columns this program writes
    split = tl.program_id(2)  # this program's slice of the keys: [split_start, split_stop)
    batch, head = batch_head // num_heads, batch_head % num_heads
    kv_head = head // group

    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    valid_base = K_VALID + batch.to(tl.int64) * stride_valid_b + kv_head.to(tl.int64) * stride_valid_h
    o_base = OUT + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + split.to(tl.int64) * stride_os
    lse_base = LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + split.to(tl.int64) * stride_ls

    tile_start = tile_m * BLOCK_M
    rows = tile_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_low = tl.arange(0, HEAD_DIM // V_PARTS)  # [HEAD_DIM // V_PARTS]: q . k's first columns (all, one part)
    offs_high = HEAD_DIM // V_PARTS + offs_low  # its second half (V_PARTS = 2)
    offs_d = part * (HEAD_DIM // V_PARTS) + offs_low  # the output columns this program writes
    row_ok = rows < n_q  # [BLOCK_M]

    q_ptrs = q_base + rows[:, None].to(tl.int64) * stride_qm  # [BLOCK_M, 1]
    q = tl.load(q_ptrs + offs_low[None, :].to(tl.int64) * stride_qd, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, ..]
    q_high = q  # the second half's columns (V_PARTS = 2)
    if V_PARTS == 2:
        q_high = tl.load(q_ptrs + offs_high[None, :].to(tl.int64) * stride_qd, mask=row_ok[:, None], other=0.0)

    # Which keys this tile needs. Row i sees keys [0, (pos(i) // B + 1) * B), so the first row's
    # limit is seen by every row and the last row's limit by at least one.
    position_shift = n_k - n_q
    if BLOCK_CAUSAL:
        first_pos = tile_start + position_shift
        last_pos = tl.minimum(tile_start + BLOCK_M, n_q) - 1 + position_shift
        seen_by_all = tl.minimum((first_pos // block_size + 1) * block_size, n_k)
        seen_by_any = tl.minimum((last_pos // block_size + 1) * block_size, n_k)
    else:
        seen_by_all, seen_by_any = n_k, n_k
    unmasked_stop = seen_by_all // BLOCK_N * BLOCK_N
    key_start = 0
    if HAS_K_VALID:  # key tiles outside [first visible key, last visible key] (left pads, a hidden tail): never visited
        span_ptr = VISIBLE_SPAN + batch.to(tl.int64) * stride_span_b + kv_head * stride_span_h
        first_visible, visible_stop = tl.load(span_ptr).to(tl.int32), tl.load(span_ptr + 1).to(tl.int32)
        key_stop = tl.cdiv(visible_stop, BLOCK_N) * BLOCK_N
        unmasked_stop = tl.minimum(unmasked_stop, key_stop)
        seen_by_any = tl.minimum(seen_by_any, key_stop)
        key_start = tl.minimum(first_visible // BLOCK_N * BLOCK_N, unmasked_stop)
    q_block = (rows + position_shift) // block_size  # [BLOCK_M]
    split_start, slice_keys = split * keys_per_split, keys_per_split  # a whole number of key tiles
    if HAS_K_VALID:  # the slices share the tiles this program visits, not all N_k keys
        slice_keys = tl.cdiv(tl.cdiv(seen_by_any - key_start, BLOCK_N), tl.num_programs(2)) * BLOCK_N
        split_start = key_start + split * slice_keys
    split_stop = split_start + slice_keys

    # m starts at a finite floor, not -inf: a row whose keys so far are all masked then computes
    # exp2(-inf - floor) = 0 for p and exp2(0) = 1 for alpha, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M]
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM // V_PARTS], dtype=tl.float32)  # [BLOCK_M, HEAD_DIM // V_PARTS]

    # Key tiles that every row sees in full: no bounds or position checks.
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_high, q_block, k_base, v_base, valid_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_valid_n, tl.maximum(key_start, split_start),
        tl.minimum(unmasked_stop, split_stop), n_k, block_size, qk_scale, offs_n, offs_low, offs_high, offs_d,
        MASK_TILE=False, BLOCK_CAUSAL=BLOCK_CAUSAL, HAS_K_VALID=HAS_K_VALID, BLOCK_N=BLOCK_N, V_PARTS=V_PARTS,
    )
    # The rest up to the last key any row sees: the block-causal diagonal and the ragged last tile.
    # Tiles past seen_by_any are never visited: that is the causal saving.
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_high, q_block, k_base, v_base, valid_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_valid_n, tl.maximum(unmasked_stop, split_start),
        tl.minimum(seen_by_any, split_stop), n_k, block_size, qk_scale, offs_n, offs_low, offs_high, offs_d,
        MASK_TILE=True, BLOCK_CAUSAL=BLOCK_CAUSAL, HAS_K_VALID=HAS_K_VALID, BLOCK_N=BLOCK_N, V_PARTS=V_PARTS,
    )

    # A row that saw no key has l = 0 and acc = 0: it writes out = 0 and lse = -inf.
    saw_keys = l_i > 0.0  # [BLOCK_M]
    l_safe = tl.where(saw_keys, l_i, 1.0)  # [BLOCK_M]
    out = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM // V_PARTS]
    # [BLOCK_M] in base 2 for a partial (what merge_splits reads), else natural
    lse = tl.where(saw_keys, m_i + tl.math.log2(l_safe), float("-inf"))
    if not PARTIAL:
        lse = lse * LN_2

    o_ptrs = o_base + rows[:, None].to(tl.int64) * stride_om + offs_d[None, :].to(tl.int64) * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if part == 0:  # both parts hold the same lse: the first writes it
        tl.store(lse_base + rows.to(tl.int64) * stride_lm, lse, mask=row_ok)


def visible_span(valid: torch.Tensor) -> torch.Tensor:
    """valid [..., N_k] (bytes) -> int64 [..., 2]: first visible key, last + 1 (none visible: all keys)."""
    return torch.stack([valid.argmax(dim=-1), valid.shape[-1] - valid.flip(-1).argmax(dim=-1)], dim=-1)


def _output(shape, dtype, device) -> torch.Tensor:
    """torch.empty; the tests swap in a NaN fill to prove the kernel writes every element."""
    return torch.empty(shape, dtype=dtype, device=device)


def flash_attention(q, k, v, *, causal=False, block_size=None, k_valid=None, scale=None, return_lse=False):
    """softmax(scale * q k^T, masked) v with GQA; see the module docstring for shapes and masks.

    q [batch, num_heads, N_q, D], k/v [batch, num_kv_heads, N_k, D], N_q <= N_k under a (block-)causal
    mask and any N_q without one (fp16/bf16, or fp32 for testing, whose dots run in TF32 on a GPU; any
    strides), k_valid [batch, N_k] or [batch, num_kv_heads, N_k] bool or None, scale > 0 defaulting
    to D ** -0.5. Hidden keys between the first and the last visible key's tiles are still read, so like
    SDPA's boolean mask they must hold finite values (0 * NaN would leak into the output); the tiles
    before and after are not (a cache's unwritten slots may sit there).
    Returns out [batch, num_heads, N_q, D] in q's dtype, laid out [batch, N_q, num_heads, D] in memory
    (a transposed view: o_proj's input layout, so the model reads it without a copy), and with return_lse also
    lse [batch, num_heads, N_q] float32 (natural log of the sum of exp of the scaled visible scores).
    Rows with no visible key get out = 0 and lse = -inf.
    Positions are columns of k, the same for every row: in a left-padded batch whose rows count positions
    from their first real token (nanodllm/masked.py), block boundaries agree only where a row's padding is
    a multiple of B."""
    _check_inputs(q, k, v, causal, block_size, k_valid, scale)
    batch, num_heads, n_q, head_dim = q.shape
    num_kv_heads, n_k = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else float(scale)
    # A bool tensor is read as bytes. Without a mask the kernel never touches K_VALID or VISIBLE_SPAN.
    valid = k_valid.view(torch.uint8) if k_valid is not None else q
    span = visible_span(valid) if k_valid is not None else q
    if k_valid is None:
        valid_strides, span_strides = (0, 0, 0), (0, 0)
    elif k_valid.dim() == 2:  # shared by every head
        valid_strides, span_strides = (k_valid.stride(0), 0, k_valid.stride(1)), (span.stride(0), 0)
    else:
        valid_strides, span_strides = k_valid.stride(), span.stride()[:2]

    block = block_size if block_size is not None else 1  # causal is B = 1; bidirectional never reads it
    # The tuner keys on N_k in power-of-two buckets from 1K to 32K (a short warm-up call does not choose a long
    # prefill's tiles), on the rows a head (few or many) and on the 128-row programs up to two waves (a canvas
    # at batch 1 leaves SMs idle that batch 4 fills, and the two favour different tiles).
    tuning_length = min(max(triton.next_power_of_2(n_k), 1024), 32768)
    tuning_rows = 64 if n_q <= 64 else FEW_ROWS if n_q <= FEW_ROWS else 1024
    tuning_programs = min(triton.next_power_of_2(batch * num_heads * triton.cdiv(n_q, 128)), 256)

    inputs = (q, k, v, valid, span)
    strides = (*q.stride(), *k.stride(), *v.stride(), *valid_strides, *span_strides)
    scalars = (n_q, n_k, num_heads, num_heads // num_kv_heads, block, scale * LOG2_E)
    meta = dict(HEAD_DIM=head_dim, BLOCK_CAUSAL=causal or block_size is not None, HAS_K_VALID=k_valid is not None)

    def launch(tiles):
        """One grid of (query tile, batch * head * V_PARTS, key slice). Too few query tiles to fill the GPU (a
        canvas at batch 1) cut the keys into slices whose partials merge_splits combines."""
        heads, tiles_m = batch * num_heads * tiles.get("V_PARTS", 1), triton.cdiv(n_q, tiles["BLOCK_M"])
        slice_keys, splits = split_keys(n_k, tiles_m * heads, q.device, tiles["BLOCK_N"], min_keys=MIN_KEYS_PER_SLICE)
        if splits == 1:  # out and lse themselves, with a slice axis of one
            out = _output((batch, n_q, num_heads, head_dim), q.dtype, q.device).transpose(1, 2)
            lse = _output((batch, num_heads, n_q), torch.float32, q.device)
            written = out.unsqueeze(2), lse.unsqueeze(2)
        else:  # [batch, heads, splits, N_q, D] and [batch, heads, splits, N_q], as merge_splits reads them
            written = (new_buffer((batch, num_heads, splits, n_q, head_dim), q.dtype, q.device),
                       new_buffer((batch, num_heads, splits, n_q), torch.float32, q.device))
        _flash_attention_fwd[(tiles_m, heads, splits)](
            *inputs, *written, *strides, *written[0].stride(), *written[1].stride(), *scalars, slice_keys,
            **meta, PARTIAL=splits > 1, **tiles)
        return (out, lse) if splits == 1 else merge_splits(written[0].flatten(0, 1), written[1].flatten(0, 1), q)

    if q.is_cuda:
        key = (head_dim, int(meta["BLOCK_CAUSAL"]), int(meta["HAS_K_VALID"]), tuning_length, tuning_rows,
               tuning_programs, str(q.dtype).removeprefix("torch."))
        out, lse = launch(TUNER.choose(key, candidate_tiles(head_dim, tuning_rows), launch, q.device))
    else:
        out, lse = launch(INTERPRETER_TILES)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v, causal, block_size, k_valid, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [batch, heads, seq, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, num_heads, n_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head_dim")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {', '.join(map(str, HEAD_DIMS))}, got {head_dim}")
    if k.shape[1] == 0 or num_heads % k.shape[1]:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({k.shape[1]})")
    if batch == 0 or num_heads == 0 or n_q == 0 or k.shape[2] == 0:
        raise ValueError(f"empty inputs are not supported: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if block_size is not None:
        if causal:
            raise ValueError("causal=True and block_size are exclusive (causal is block_size=1)")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if n_q > k.shape[2] and (causal or block_size is not None):
        raise ValueError(f"under a (block-)causal mask the queries are the last N_q of the N_k key positions, "
                         f"so N_q ({n_q}) must be <= N_k ({k.shape[2]})")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    if k_valid is not None:
        shapes = [(batch, k.shape[2]), (batch, k.shape[1], k.shape[2])]
        if not isinstance(k_valid, torch.Tensor) or k_valid.dtype != torch.bool:
            raise ValueError("k_valid must be a bool tensor [batch, N_k] or [batch, num_kv_heads, N_k]")
        if tuple(k_valid.shape) not in shapes:
            raise ValueError(f"k_valid must have shape {shapes[0]} or {shapes[1]}, got {tuple(k_valid.shape)}")
        if k_valid.device != q.device:
            raise ValueError(f"k_valid must be on {q.device}, got {k_valid.device}")


def flash_attention_reference(q, k, v, *, causal=False, block_size=None, k_valid=None, scale=None,
                              return_lse=False):
    """Plain torch, same signature and outputs: the full score matrix and softmax in fp32, out cast
    to q's dtype, lse float32."""
    _check_inputs(q, k, v, causal, block_size, k_valid, scale)
    batch, num_heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    group = num_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [batch, num_heads, N_q, N_k]

    q_pos = torch.arange(n_q, device=q.device) + (n_k - n_q)
    k_pos = torch.arange(n_k, device=q.device)
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = k_pos[None, :] <= q_pos[:, None]
    elif block_size is not None:
        visible = k_pos[None, :] // block_size <= q_pos[:, None] // block_size
    visible = visible[None, None]  # [1, 1, N_q, N_k]
    if k_valid is not None:
        per_head = k_valid.repeat_interleave(group, dim=1) if k_valid.dim() == 3 else k_valid[:, None]
        visible = visible & per_head[:, :, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))

    lse = scores.logsumexp(dim=-1)  # [batch, num_heads, N_q], -inf where no key is visible
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = (probs @ v).to(q.dtype)
    return (out, lse) if return_lse else out
