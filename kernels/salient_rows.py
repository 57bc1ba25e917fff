"""DyLLM's next salient rows at a fixed fraction: the cosine of each row's new attention context to its
cached one, and the lowest-cosine rows of each sequence, in one launch.

Per sequence b (one program each): cos_i = s0_i / max(sqrt(s1_i * s2_i), 1e-30) from the per-row sums
stats [batch, rows, 3] = (new . old, new . new, old . old) over the heads; the `width` rows of lowest
cosine (padded rows last, ties to the lower row) are listed in row order, and of them the
ceil(v_b * fraction) lowest are ok, v_b the sequence's own count of real rows (so its set does not
depend on what else is in the batch); with tau (DyLLM's salient_cap) a listed row is ok only if also
cos < tau. Returns (mask [batch, rows] bool: the ok rows, rows [batch, width] int64, ok [batch, width]
bool, slots [batch, rows] int32: each ok row's place in the list, -1 for the others; DyLLM's
approximate attention reads a salient row's exact context from that place). The listed rows are
torch's exactly (salient_rows_reference: the cosines, then a stable sort). In torch this is about
twenty launches per layer, run in every layer of a sparse step. Rows up to top_k.WHOLE_ROW_MAX per
sequence (one program holds them all).
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from nanodllm.kernels.top_k import WHOLE_ROW_MAX, ordered_keys, top_of_row, whole_row_warps


@triton.jit
def salient_rows_kernel(stats_ptr, valid_ptr, mask_ptr, rows_ptr, ok_ptr, slot_map_ptr, num_rows, width, tau,
                        FRACTION_BITS: tl.constexpr, CAPPED: tl.constexpr, BLOCK: tl.constexpr):
    """top_k.py's one-program radix select (top_of_row) on -cos, run twice (width, then the own count);
    the division and square root round as torch's do (div_rn, sqrt_rn), so the listed rows are
    torch's exactly. The torch form's launches (about twenty): the cosine's element-wise ops, the own
    count, two sorts, the rank mask, the scatter into the mask."""
    b = tl.program_id(0)
    positions = tl.arange(0, BLOCK)
    in_row = positions < num_rows
    sums = stats_ptr + (b * num_rows + positions).to(tl.int64) * 3
    new_old = tl.load(sums, mask=in_row, other=0.0)
    new_new = tl.load(sums + 1, mask=in_row, other=0.0)
    old_old = tl.load(sums + 2, mask=in_row, other=0.0)
    cos = tl.div_rn(new_old, tl.maximum(tl.sqrt_rn(new_new * old_old), 1e-30))
    valid = tl.load(valid_ptr + b * num_rows + positions, mask=in_row, other=0) != 0
    keys = ordered_keys(tl.where(valid, -cos, float("-inf")))
    fraction = tl.full((), FRACTION_BITS, tl.int64).to(tl.float64, bitcast=True)
    own = tl.ceil(tl.sum(valid.to(tl.int32)).to(tl.float64) * fraction).to(tl.int32)
    listed = top_of_row(keys, in_row, width)
    ok = top_of_row(keys, in_row, own)
    if CAPPED:
        ok = ok & (cos < tau)
    place = tl.cumsum(listed.to(tl.int32), 0) - 1  # a listed row's slot in the list
    tl.store(rows_ptr + b * width + place, positions.to(tl.int64), mask=listed)
    tl.store(ok_ptr + b * width + place, ok, mask=listed)
    tl.store(mask_ptr + b * num_rows + positions, listed & ok, mask=in_row)
    tl.store(slot_map_ptr + b * num_rows + positions, tl.where(listed & ok, place, -1), mask=in_row)


def list_width(num_rows: int, fraction: float) -> int:
    """How many rows every sequence lists: ceil(fraction * rows), at least 1 (a fixed shape)."""
    return max(math.ceil(fraction * num_rows), 1)


def check_inputs(stats, valid, fraction):
    if stats.dim() != 3 or stats.shape[2] != 3 or stats.dtype != torch.float32:
        raise ValueError(f"stats must be float32 [batch, rows, 3], got {stats.dtype} {tuple(stats.shape)}")
    if valid.shape != stats.shape[:2] or valid.dtype != torch.bool or valid.device != stats.device:
        raise ValueError(f"valid must be bool {tuple(stats.shape[:2])} on {stats.device}, got {valid.dtype} "
                         f"{tuple(valid.shape)} on {valid.device}")
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")


def salient_rows(stats: torch.Tensor, valid: torch.Tensor, fraction: float, tau: float | None = None):
    """See the module docstring. stats [batch, rows, 3] float32, valid [batch, rows] bool."""
    check_inputs(stats, valid, fraction)
    batch, num_rows, _ = stats.shape
    if num_rows > WHOLE_ROW_MAX:
        raise ValueError(f"at most {WHOLE_ROW_MAX} rows per sequence (one program each), got {num_rows}")
    width = list_width(num_rows, fraction)
    mask = torch.empty(batch, num_rows, dtype=torch.bool, device=stats.device)
    rows = torch.empty(batch, width, dtype=torch.int64, device=stats.device)
    ok = torch.empty(batch, width, dtype=torch.bool, device=stats.device)
    slots = torch.empty(batch, num_rows, dtype=torch.int32, device=stats.device)
    if batch and num_rows:
        block = triton.next_power_of_2(num_rows)
        salient_rows_kernel[(batch,)](
            stats.contiguous(), valid.contiguous(), mask, rows, ok, slots, num_rows, width, 0.0 if tau is None else tau,
            FRACTION_BITS=struct.unpack("<q", struct.pack("<d", float(fraction)))[0], CAPPED=tau is not None,
            BLOCK=block, num_warps=whole_row_warps(block))
    return mask, rows, ok, slots


def slot_map(rows: torch.Tensor, ok: torch.Tensor, num_rows: int) -> torch.Tensor:
    """rows [batch, s] (distinct per sequence), ok [batch, s] -> [batch, num_rows] int32: j at
    rows[b, j] where ok[b, j], -1 elsewhere."""
    places = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int32).expand_as(rows)
    slots = torch.full((rows.shape[0], num_rows), -1, dtype=torch.int32, device=rows.device)
    return slots.scatter_(1, rows, torch.where(ok, places, -1))


def salient_rows_reference(stats: torch.Tensor, valid: torch.Tensor, fraction: float, tau: float | None = None):
    """The same in torch: the cosines, a stable sort (ties to the lower row), the ranks against each
    sequence's own count. The cosine's square root and division are taken in float64 and rounded once,
    which is float32's correctly rounded result on any device (torch's float32 sqrt on some CPUs is
    off by an ulp, which reorders cosines that tie at exactly 1)."""
    check_inputs(stats, valid, fraction)
    root = (stats[..., 1] * stats[..., 2]).double().sqrt().float().clamp(min=1e-30)
    cos = (stats[..., 0].double() / root.double()).float()
    width = list_width(stats.shape[1], fraction)
    own = (valid.sum(dim=1, dtype=torch.float64) * fraction).ceil()
    ranked = (-cos).masked_fill(~valid, float("-inf")).sort(dim=1, descending=True, stable=True).indices[:, :width]
    rows, order = ranked.sort(dim=1)
    ok = (torch.arange(width, device=stats.device) < own[:, None]).gather(1, order)
    if tau is not None:
        ok = ok & (cos.gather(1, rows) < tau)
    slots = slot_map(rows, ok, stats.shape[1])
    return slots >= 0, rows, ok, slots  # the mask: the rows with a place
