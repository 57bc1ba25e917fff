"""Exact top-k positions of each row, in ascending position order: the selection step of MAGE and Quest.

For each row of scores (a KV head's key scores, say) only its first `length` entries count; the
result is the positions of the k highest of them, sorted by position, as the sparse decode kernel
takes its index lists. Ties are broken towards lower positions. Rows whose length is at most k keep
all their positions; entries of the output past a row's count are 0. Scores must not be NaN.
The reference is top_k_positions_reference (a stable sort).

Here: a radix select on the scores' bits, then one compaction that emits positions in order, so no
sort is needed (torch needs a topk, then a sort of the chosen positions). A float32 is mapped to a
uint32 key with the same order; four histogram passes find the k-th largest key T one byte at a
time, most significant first; then the entries above T, and the first ones equal to T, are written
in position order. A long row takes seven launches over (row, chunk of CHUNK entries) programs; a
row of at most WHOLE_ROW_MAX entries takes one program that holds it in registers (one launch),
since below a few thousand entries the seven launches cost more than the work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WHOLE_ROW_MAX = 4096  # rows up to this many entries take the one-program route
CHUNK = 2048  # entries per program on a GPU: the tuning sweep's pick at 8 warps over 2K-128K entries
NUM_WARPS = 8
INTERPRETER_CHUNK = 64


@triton.jit
def ordered_keys(x):
    """uint32 keys of float32 x, ordered as the floats are: flip every bit of a negative number, the
    sign bit of a positive one."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order = float order
    return (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # flip the sign bit: unsigned order


@triton.jit
def order_keys(scores_ptr, row, stride_row, positions, valid):
    """ordered_keys of the scores at positions."""
    return ordered_keys(tl.load(scores_ptr + row.to(tl.int64) * stride_row + positions, mask=valid,
                                other=0.0).to(tl.float32))


@triton.jit
def this_chunk(lengths_ptr, heads, n, CHUNK: tl.constexpr):
    """(row, chunk, the row's length, the chunk's positions, which of them are in the row) of this program."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    length = tl.minimum(tl.load(lengths_ptr + row // heads).to(tl.int32), n)
    positions = chunk * CHUNK + tl.arange(0, CHUNK)
    return row, chunk, length, positions, positions < length


@triton.jit
def byte_histogram(keys, candidates, PASS: tl.constexpr):
    """How many of the candidate keys have each value (0..255) of byte PASS (0: the top byte)."""
    byte = ((keys >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
    counts = tl.histogram(tl.where(candidates, byte, 0), 256)  # the others land in bin 0: taken out again
    return counts - tl.where(tl.arange(0, 256) == 0, keys.numel - tl.sum(candidates.to(tl.int32)), 0)


@triton.jit
def pick_byte(counts, still):
    """(T's next byte, how many entries equal to T's bytes so far are still to take after it) from the
    histogram of that byte over the entries equal to T's bytes so far."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # entries with this byte or a higher one
    byte = tl.max(tl.where(at_or_above >= still, bins, 0))
    return byte, still - tl.sum(tl.where(bins > byte, counts, 0))


@triton.jit
def known_bytes(hist_ptr, row, k, PASSES: tl.constexpr):
    """(prefix: T's top PASSES bytes, still: how many entries equal to that prefix are still to take)
    from the histograms of passes 0..PASSES-1."""
    prefix = tl.zeros((), tl.uint32)
    still = k
    for p in tl.static_range(PASSES):
        byte, still = pick_byte(tl.load(hist_ptr + (row * 4 + p) * 256 + tl.arange(0, 256)), still)
        prefix = (prefix << 8) | byte.to(tl.uint32)
    return prefix, still


@triton.jit
def topk_histogram_kernel(scores_ptr, lengths_ptr, hist_ptr, stride_row, heads, n, k,
                          PASS: tl.constexpr, CHUNK: tl.constexpr):
    """Pass PASS: among the entries whose top PASS bytes equal T's, how many have each value of the next
    byte. The (row, chunk) programs add their chunk's 256 counts into the row's histogram with atomics,
    and re-derive the bytes found so far from the earlier histograms themselves (256 values each:
    cheaper than a launch). tl.histogram's time grows with the entries per program, so CHUNK and
    NUM_WARPS are tuned for these passes."""
    row, _, length, positions, valid = this_chunk(lengths_ptr, heads, n, CHUNK)
    if length > k:
        keys = order_keys(scores_ptr, row, stride_row, positions, valid)
        prefix, still = known_bytes(hist_ptr, row, k, PASS)
        if PASS > 0:
            valid = valid & ((keys >> (32 - 8 * PASS)) == prefix)
        tl.atomic_add(hist_ptr + (row * 4 + PASS) * 256 + tl.arange(0, 256), byte_histogram(keys, valid, PASS))


@triton.jit
def topk_count_kernel(scores_ptr, lengths_ptr, hist_ptr, chunk_counts_ptr, stride_row, heads, n, k,
                      CHUNK: tl.constexpr):
    """chunk_counts[row, chunk] = (entries above T, entries equal to T) of the chunk."""
    row, chunk, length, positions, valid = this_chunk(lengths_ptr, heads, n, CHUNK)
    if length > k:
        keys = order_keys(scores_ptr, row, stride_row, positions, valid)
        threshold, _ = known_bytes(hist_ptr, row, k, 4)
        out = chunk_counts_ptr + (row * tl.num_programs(1) + chunk) * 2
        tl.store(out, tl.sum((valid & (keys > threshold)).to(tl.int32)))
        tl.store(out + 1, tl.sum((valid & (keys == threshold)).to(tl.int32)))


@triton.jit
def topk_write_kernel(scores_ptr, lengths_ptr, hist_ptr, chunk_counts_ptr, indices_ptr, counts_ptr, stride_row,
                      stride_out, heads, n, k, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each chunk's output offset is a prefix sum over the row's chunk counts; it stores the positions of
    its entries above T, and of the first ones equal to T (in position order, as many as needed), in
    order."""
    row, chunk, length, positions, valid = this_chunk(lengths_ptr, heads, n, CHUNK)
    if chunk == 0:
        tl.store(counts_ptr + row, tl.minimum(length, k))
    out = indices_ptr + row.to(tl.int64) * stride_out
    if length <= k:  # every position, each at its own slot
        tl.store(out + positions, positions, mask=valid)
    else:
        keys = order_keys(scores_ptr, row, stride_row, positions, valid)
        threshold, still = known_bytes(hist_ptr, row, k, 4)
        chunks = tl.arange(0, BLOCK_C)
        before = chunks < chunk
        counts = chunk_counts_ptr + (row * tl.num_programs(1) + chunks) * 2
        above_before = tl.sum(tl.load(counts, mask=before, other=0))
        equal_before = tl.sum(tl.load(counts + 1, mask=before, other=0))
        above = valid & (keys > threshold)
        equal = valid & (keys == threshold)
        equal_rank = equal_before + tl.cumsum(equal.to(tl.int32), 0) - 1
        take = above | (equal & (equal_rank < still))
        slot = above_before + tl.minimum(equal_before, still) + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out + slot, positions, mask=take)


@triton.jit
def top_of_row(keys, candidates, k):
    """Which of a whole row's candidate keys (held by one program) are its k highest, ties to the lower
    position: the four byte passes on the registers, then one prefix sum over the keys equal to T.
    All of them where there are at most k."""
    remaining = candidates  # the entries whose bytes so far equal T's
    threshold = tl.zeros((), tl.uint32)
    still = k
    for p in tl.static_range(4):
        byte, still = pick_byte(byte_histogram(keys, remaining, p), still)
        threshold = (threshold << 8) | byte.to(tl.uint32)
        remaining = remaining & (((keys >> (24 - 8 * p)) & 0xFF) == byte.to(tl.uint32))
    equal = candidates & (keys == threshold)
    return (candidates & (keys > threshold)) | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= still))


@triton.jit
def topk_row_kernel(scores_ptr, lengths_ptr, indices_ptr, counts_ptr, stride_row, stride_out, heads, n, k, width,
                    BLOCK: tl.constexpr):
    """The whole route for one row in one program: the same four byte passes and tie rule, on the
    registers (no atomics, no histograms in memory), and one prefix sum over the row for the writes."""
    row = tl.program_id(0)
    length = tl.minimum(tl.load(lengths_ptr + row // heads).to(tl.int32), n)
    positions = tl.arange(0, BLOCK)
    valid = positions < length
    out = indices_ptr + row.to(tl.int64) * stride_out
    tl.store(counts_ptr + row, tl.minimum(length, k))
    if length <= k:  # every position, 0 in the slots past it
        tl.store(out + positions, tl.where(valid, positions, 0), mask=positions < width)
    else:  # then width = k: every slot is written below
        take = top_of_row(order_keys(scores_ptr, row, stride_row, positions, valid), valid, k)
        tl.store(out + tl.cumsum(take.to(tl.int32), 0) - 1, positions, mask=take)


def whole_row_warps(block: int) -> int:
    """Warps for a one-program row of `block` entries (4 up to 1024, 8 at 2048, 16 beyond): the best
    of 4 / 8 / 16 at each size in the tuning sweep (docs/results/bench_mage.md)."""
    return 4 if block <= 1024 else 8 if block <= 2048 else 16


def top_k_positions(scores: torch.Tensor, lengths: torch.Tensor, k: int, chunk: int | None = None,
                    num_warps: int = NUM_WARPS, whole_row: bool | None = None):
    """Per row of scores [batch, heads, n] (float16 / bfloat16 / float32, last dim contiguous), the
    positions of the k highest entries among the first lengths[b] (lengths [batch], int), ascending.
    Returns (indices [batch, heads, min(k, n)] int32, 0 past a row's count; counts [batch, heads] int32
    = min(k, length)). chunk: entries per program (default CHUNK, INTERPRETER_CHUNK off the GPU).
    whole_row: one program per row (default: where n <= WHOLE_ROW_MAX); chunk and num_warps then do
    not apply. The chunked route is seven launches (a zero fill, four histograms, count, write); past
    WHOLE_ROW_MAX they win over one program per row (docs/results/bench_mage.md, "Top-k selection")."""
    if scores.dim() != 3 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be [batch, heads, n] with a contiguous last dim, got {tuple(scores.shape)}")
    if scores.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"scores must be float16, bfloat16 or float32, got {scores.dtype}")
    batch, heads, n = scores.shape
    if lengths.shape != (batch,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != scores.device:
        raise ValueError(f"lengths must be an int tensor of shape ({batch},) on {scores.device}, got "
                         f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    rows, width = batch * heads, min(k, n)
    flat = scores.reshape(rows, n)  # a view: the last dim is contiguous and rows are uniform
    if n and rows and (n <= WHOLE_ROW_MAX if whole_row is None else whole_row):
        block = triton.next_power_of_2(n)
        indices = torch.empty(rows, width, dtype=torch.int32, device=scores.device)
        counts = torch.empty(rows, dtype=torch.int32, device=scores.device)
        topk_row_kernel[(rows,)](flat, lengths, indices, counts, flat.stride(0), width, heads, n, k, width,
                                 BLOCK=block, num_warps=whole_row_warps(block))
        return indices.view(batch, heads, width), counts.view(batch, heads)
    chunk = chunk or (CHUNK if scores.is_cuda else INTERPRETER_CHUNK)
    num_chunks = triton.cdiv(n, chunk)
    # one zero fill for the four histograms per row, the per-chunk counts, the index lists and counts
    sizes = [rows * 4 * 256, rows * num_chunks * 2, rows * width, rows]
    hist, chunk_counts, indices, counts = torch.zeros(sum(sizes), dtype=torch.int32, device=scores.device).split(sizes)
    if n and rows:
        grid = (rows, num_chunks)
        common = (flat.stride(0), heads, n, k)
        for p in range(4):
            topk_histogram_kernel[grid](flat, lengths, hist, *common, PASS=p, CHUNK=chunk, num_warps=num_warps)
        topk_count_kernel[grid](flat, lengths, hist, chunk_counts, *common, CHUNK=chunk, num_warps=num_warps)
        topk_write_kernel[grid](flat, lengths, hist, chunk_counts, indices, counts, flat.stride(0), width, *common[1:],
                           CHUNK=chunk, BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=num_warps)
    return indices.view(batch, heads, width), counts.view(batch, heads)


def top_k_positions_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int):
    """The same by a stable sort (ties to the lower position), in torch."""
    batch, heads, n = scores.shape
    width = min(k, n)
    counts = torch.clamp(lengths.clamp(max=n), max=k).to(torch.int32)[:, None].expand(batch, heads).contiguous()
    in_row = torch.arange(n, device=scores.device)[None, :] < lengths[:, None]
    ranked = scores.float().masked_fill(~in_row[:, None], float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
    valid = torch.arange(width, device=scores.device) < counts[..., None]
    chosen = torch.where(valid, order, n).sort(dim=-1).values  # the invalid ones sort last
    return torch.where(valid, chosen, 0).to(torch.int32), counts
