"""Each expert's linear layer over its own rows, for the one to a few dozen rows per expert of a decode step.

    out[rows of e] = x[rows of e] @ W[e]^T                       for every expert e
    out[rows of e] = act(x @ W_gate[e]^T) * (x @ W_up[e]^T)      with glu = "silu" or "gelu_tanh"

The rows come grouped by expert (group_ends[e] is where expert e's rows end), or are read from the
tokens as they load (row r is token pairs[r] // per_token; pairs: group_by_expert's order, a counting
sort in one launch). With a few dozen rows per expert the product is weight streaming: a program owns
BLOCK_N output columns of one expert and walks its rows in tiles of BLOCK_M, computing the product
transposed (W tile @ x tile^T) with kernels/norm_linear.py's tiles, so the weight tile fills the tensor
cores' wide side. BLOCK_M grows with the mean rows per expert (16 at one or two, up to 128) so that
most experts' weights are read once; an expert with rows for half a tile runs a half tile, one whose
rows overflow it (a block's tokens often pick the same few) tiles twice as tall, up to 128 rows, and
one with none an empty program. Rounding as torch's grouped matmul and its activation (fp32
accumulation, gate and up rounded before the activation). Rows past the last group are not written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanodllm.kernels.norm_linear import fit_shared_memory, shared_memory_limit, store_transposed
from nanodllm.kernels.silu_mul import silu_mul_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GLUS = (None, "silu", "gelu_tanh")
MAX_TILE_ROWS = tl.constexpr(128)
FEW_ROWS_PER_EXPERT = 64  # up to this mean it beats torch's grouped matmuls (docs/results/bench_moe.md)
MAX_SCANNED_IDS = 1 << 22  # group_by_expert's kernel reads every id once per expert: past this many, a sort


@triton.jit
def expert_linear_kernel(
    x_ptr, w_ptr, ends_ptr, out_ptr, pairs_ptr,
    out_width, dim, stride_x, stride_we, stride_wn, stride_out,
    GLU: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0)
    first = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    last = tl.load(ends_ptr + expert)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    args = (x_ptr, gate_ptrs, out_ptr, pairs_ptr, first, last, cols, out_width, dim, stride_x, stride_wn, stride_out)
    if BLOCK_M >= 32 and last - first <= BLOCK_M // 2:  # a quiet expert: half the tile's work
        _expert_rows(*args, GLU=GLU, PER_TOKEN=PER_TOKEN, ROWS=BLOCK_M // 2, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    elif BLOCK_M < MAX_TILE_ROWS and last - first > BLOCK_M:  # a busy expert: its weights read half as often
        _expert_rows(*args, GLU=GLU, PER_TOKEN=PER_TOKEN, ROWS=2 * BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    else:
        _expert_rows(*args, GLU=GLU, PER_TOKEN=PER_TOKEN, ROWS=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@triton.jit
def _expert_rows(
    x_ptr, gate_ptrs, out_ptr, pairs_ptr, first, last, cols, out_width, dim, stride_x, stride_wn, stride_out,
    GLU: tl.constexpr, PER_TOKEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One expert's rows [first, last) in tiles of ROWS, against its BLOCK_N weight rows at gate_ptrs; with
    PER_TOKEN, grouped row r read from x's row pairs[r] // PER_TOKEN."""
    col_ok = cols < out_width
    up_ptrs = gate_ptrs + out_width * stride_wn  # read only with a GLU: the up half of [gate; up]
    dtype = gate_ptrs.dtype.element_ty
    precision: tl.constexpr = "ieee" if dtype == tl.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < last
        source = rows.to(tl.int64)
        if PER_TOKEN:
            source = tl.load(pairs_ptr + rows, mask=row_ok, other=0) // PER_TOKEN
        x_ptrs = x_ptr + source[None, :] * stride_x
        gate_acc = tl.zeros((BLOCK_N, ROWS), tl.float32)  # transposed: [columns, rows]
        up_acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        for k in range(0, dim, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < dim
            x_t = tl.load(x_ptrs + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # [BLOCK_K, ROWS]
            w_mask = col_ok[:, None] & k_ok[None, :]
            gate_acc = tl.dot(tl.load(gate_ptrs + ks[None, :], mask=w_mask, other=0.0), x_t, gate_acc,
                              input_precision=precision)
            if GLU != "":
                up_acc = tl.dot(tl.load(up_ptrs + ks[None, :], mask=w_mask, other=0.0), x_t, up_acc,
                                input_precision=precision)
        store_transposed(out_ptr, gate_acc, up_acc, rows, cols, row_ok, col_ok, stride_out, GLU)


@triton.jit
def _shifted_ids(experts_ptr, pair, pairs, first_held, num_experts):
    """The ids of pairs [BLOCK] counted from first_held (modulo num_experts): a share's experts first."""
    ids = tl.load(experts_ptr + pair, mask=pair < pairs, other=0).to(tl.int32)
    return (ids - first_held + num_experts) % num_experts


@triton.jit
def group_by_expert_kernel(experts_ptr, order_ptr, slot_of_ptr, ends_ptr, pairs, first_held, num_experts, groups,
                           BLOCK: tl.constexpr):
    """Program e writes the pairs of (shifted) id e in their order after every pair of a smaller id, the
    row each pair lands in, and for e < groups where they end: a counting sort, one program per id, each
    reading every id twice."""
    me = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    placed = tl.full([], 0, tl.int32)  # the pairs of smaller ids, then those of me written so far
    for start in range(0, pairs, BLOCK):
        pair = start + offs
        ids = _shifted_ids(experts_ptr, pair, pairs, first_held, num_experts)
        placed += tl.sum(((ids < me) & (pair < pairs)).to(tl.int32), 0)
    for start in range(0, pairs, BLOCK):
        pair = start + offs
        mine = ((_shifted_ids(experts_ptr, pair, pairs, first_held, num_experts) == me) & (pair < pairs)).to(tl.int32)
        row = placed + tl.cumsum(mine, 0) - 1
        tl.store(order_ptr + row, pair.to(tl.int64), mask=mine != 0)
        tl.store(slot_of_ptr + pair, row.to(tl.int64), mask=mine != 0)
        placed += tl.sum(mine, 0)
    if me < groups:
        tl.store(ends_ptr + me, placed)


class Grouped(NamedTuple):
    """A step's (token, slot) pairs grouped by expert: grouped row i holds the pair order[i] = token * k +
    slot, the pair p lies in row slot_of[p] (int64 both), each held expert's rows end at ends[e] (int32)."""
    order: torch.Tensor
    ends: torch.Tensor
    slot_of: torch.Tensor


def group_by_expert(experts: torch.Tensor, num_experts: int, held: range | None = None) -> Grouped:
    """The (token, slot) pairs of experts [n, k] (ids 0 .. num_experts - 1) grouped by expert, as this
    kernel and torch's grouped matmuls take them, len(held) groups. held (default all): a rank's share, its
    experts' groups first (numbered from held.start), the other experts' pairs after the last group, each
    id's in their order. One launch of group_by_expert_kernel for a step's few thousand pairs; the
    reference's sort for a prompt's (past MAX_SCANNED_IDS ids read)."""
    held = range(num_experts) if held is None else held
    pairs = experts.numel()
    if pairs * num_experts > MAX_SCANNED_IDS:
        return group_by_expert_reference(experts, num_experts, held)
    order, slot_of = (torch.empty(pairs, dtype=torch.int64, device=experts.device) for _ in range(2))
    ends = torch.empty(len(held), dtype=torch.int32, device=experts.device)
    group_by_expert_kernel[(num_experts,)](experts.reshape(-1), order, slot_of, ends, pairs, held.start, num_experts,
                                           len(held), BLOCK=min(1024, triton.next_power_of_2(max(pairs, 16))))
    return Grouped(order, ends, slot_of)


def group_by_expert_reference(experts: torch.Tensor, num_experts: int, held: range | None = None) -> Grouped:
    """group_by_expert in torch: a stable sort of the ids in the narrowest integer type that holds them (a
    radix sort makes a pass per byte of its keys)."""
    held = range(num_experts) if held is None else held
    if held.start:  # the held experts' ids to 0 .., the others' past them
        experts = (experts - held.start) % num_experts
    narrow = next(t for t in (torch.uint8, torch.int16, torch.int32) if num_experts - 1 <= torch.iinfo(t).max)
    by_expert, order = experts.flatten().to(narrow).sort(stable=True)
    ids = torch.arange(len(held), device=experts.device, dtype=narrow)
    slot_of = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return Grouped(order, torch.searchsorted(by_expert, ids, right=True, out_int32=True), slot_of)


def beats_grouped_mm(num_rows: int, num_experts: int) -> bool:
    """Whether num_rows rows over num_experts experts run faster here than on torch's grouped matmuls."""
    return num_rows <= FEW_ROWS_PER_EXPERT * num_experts


def tile_shape(num_rows: int, num_experts: int, dim: int, glu: str | None, element_size: int,
               shared_limit: int | None) -> dict:
    """BLOCK_M from the rows per expert (1.5x the mean: room for the busier experts); the rest the best of
    sweeps in bfloat16: at 16-row tiles (and a gate/up's 32), of a block step's 32 or 128 tokens over
    LLaDA2.0-mini's experts (2 x 512 x 2048, 2048 x 512; a sixth to two thirds of them touched) and over a
    rank's share of LLaDA2.0-flash's on two GPUs; from 32 rows, of DiffusionGemma's (2 x 704 x 2816,
    2816 x 704) over 128 experts at 16 and 64 rows each (the times: docs/results/bench_moe.md). From 64
    rows the tanh GELU's epilogue runs faster on 4 warps, SiLU's as fast or faster on 8."""
    busy = triton.cdiv(3 * num_rows, 2 * num_experts)
    gated = glu is not None
    tile_rows = min(MAX_TILE_ROWS.value, max(16, triton.next_power_of_2(busy)))
    narrow = tile_rows <= 32
    if tile_rows == 16 or (gated and narrow):
        shape = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4 if gated else 3)
    elif gated:
        shape = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4 if glu == "gelu_tanh" else 8, num_stages=3)
    else:
        shape = dict(BLOCK_N=64 if narrow else 128, BLOCK_K=64, num_warps=4, num_stages=4 if narrow else 3)
    shape["BLOCK_K"] = min(shape["BLOCK_K"], max(16, triton.next_power_of_2(dim)))
    widest = dict(shape, BLOCK_M=min(2 * tile_rows, MAX_TILE_ROWS.value))  # the busy experts' tiles fit too
    return dict(fit_shared_memory(widest, gated, element_size, shared_limit), BLOCK_M=tile_rows)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, glu: str | None = None,
                  pairs: torch.Tensor | None = None, per_token: int = 1) -> torch.Tensor:
    """x [R, K] rows grouped by expert, or with pairs [R] int64 (group_by_expert's order) x [n, K] tokens,
    grouped row r being x[pairs[r] // per_token]; weight [E, N, K] (each expert's nn.Linear weight; N = 2I,
    [gate; up], with a glu: "silu" for SwiGLU, "gelu_tanh" for GELU-gated); group_ends [E] int32,
    non-decreasing, at most R. Returns [R, N] (or [R, I]) of x's dtype, rows past group_ends[-1]
    unwritten."""
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1] or group_ends.shape != weight.shape[:1]:
        raise ValueError(f"need x [R, K], weight [E, N, K] and group_ends [E]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(group_ends.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES or group_ends.dtype != torch.int32:
        raise ValueError(f"x and weight must share one of {DTYPES} and group_ends be int32; got {x.dtype}, "
                         f"{weight.dtype} and {group_ends.dtype}")
    if x.stride(1) != 1 or weight.stride(2) != 1 or not group_ends.is_contiguous():
        raise ValueError(f"the last dims must be contiguous, got strides {x.stride()} and {weight.stride()}")
    if glu not in GLUS:
        raise ValueError(f"glu must be one of {GLUS}, got {glu!r}")
    if glu and weight.shape[1] % 2:
        raise ValueError(f"a glu needs stacked [gate; up] weights (an even N), got N = {weight.shape[1]}")
    if pairs is not None and (pairs.dim() != 1 or pairs.dtype != torch.int64 or per_token < 1):
        raise ValueError(f"pairs must be [R] int64 and per_token at least 1; got {tuple(pairs.shape)} {pairs.dtype}, "
                         f"per_token {per_token}")
    width = weight.shape[1] // 2 if glu else weight.shape[1]
    rows = x.shape[0] if pairs is None else len(pairs)
    out = torch.empty((rows, width), device=x.device, dtype=x.dtype)
    if out.numel() and weight.shape[0]:
        shape = tile_shape(rows, weight.shape[0], x.shape[1], glu, x.element_size(),
                           shared_memory_limit(x.device))
        grid = (weight.shape[0], triton.cdiv(width, shape["BLOCK_N"]))
        gather = (group_ends, 0) if pairs is None else (pairs, per_token)  # (pairs_ptr, PER_TOKEN): 0 reads x's rows
        expert_linear_kernel[grid](x, weight, group_ends, out, gather[0], width, x.shape[1], x.stride(0),
                                   weight.stride(0), weight.stride(1), out.stride(0), GLU=glu or "",
                                   PER_TOKEN=gather[1], **shape, enable_fp_fusion=False)
    return out


def glu_reference(gate_up: torch.Tensor, glu: str) -> torch.Tensor:
    """The torch form: act(gate) * up on the two halves of the last dim."""
    if glu == "silu":
        return silu_mul_reference(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def expert_linear_reference(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor,
                            glu: str | None = None) -> torch.Tensor:
    """One F.linear per expert over its rows (then act(gate) * up); rows past the last group zero."""
    width = weight.shape[1] // 2 if glu else weight.shape[1]
    out = x.new_zeros(x.shape[0], width)
    first = 0
    for expert, last in enumerate(group_ends.tolist()):
        product = torch.nn.functional.linear(x[first:last], weight[expert])
        out[first:last] = glu_reference(product, glu) if glu else product
        first = last
    return out
