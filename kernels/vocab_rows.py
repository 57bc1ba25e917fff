"""DiffusionGemma's two passes over whole vocabulary rows inside a denoising step, each one kernel where torch
makes three or four passes (V = 262,144: a canvas's rows of float32 logits are 268 MB per batch row):
    softcap(logits, cap) = cap * tanh(logits / cap) in float32, from the head's 16-bit logits;
    soft_probs(z, dtype) = softmax(z) over each row, in float32, written in dtype (the self-conditioning's
    token distribution, which the tied embedding then averages).
tanh(x) is sign(x) (1 - e) / (1 + e), e = exp(-2|x|) (Triton's interpreter has no libdevice tanh): within a few
float32 ulps of torch's.
The probabilities differ from torch's in the last bits (the sums run in another order). The references are
softcap_reference and soft_probs_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
LOG2_E = tl.constexpr(1.4426950408889634)  # kernels read only constexpr globals


@triton.jit
def softcap_kernel(logits_ptr, out_ptr, n, inverse_cap, cap, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + offsets, mask=offsets < n).to(tl.float32) * inverse_cap
    e = tl.exp(-2 * tl.abs(x))  # in (0, 1]: never overflows
    tanh = (1 - e) / (1 + e)
    tl.store(out_ptr + offsets, tl.where(x < 0, -tanh, tanh) * cap, mask=offsets < n)


@triton.jit
def soft_probs_kernel(z_ptr, probs_ptr, width, BLOCK: tl.constexpr):
    """A program owns a row: pass 1 keeps each lane's max and its sum of exp(z - max), rescaled when the max
    grows (an online softmax, base 2); the lanes then merge. Pass 2 writes exp(z - max) / sum."""
    row = tl.program_id(0).to(tl.int64)
    z_ptr += row * width
    probs_ptr += row * width
    lanes = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), -1.0e30, tl.float32)  # finite: a lane past the row's end never makes a NaN
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + lanes
        z = tl.load(z_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32) * LOG2_E
        higher = tl.maximum(top, z)
        total = total * tl.math.exp2(top - higher) + tl.math.exp2(z - higher)
        top = higher
    row_top = tl.max(top, 0)
    norm = tl.sum(total * tl.math.exp2(top - row_top), 0)
    for start in range(0, width, BLOCK):
        cols = start + lanes
        z = tl.load(z_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32) * LOG2_E
        tl.store(probs_ptr + cols, (tl.math.exp2(z - row_top) / norm).to(probs_ptr.dtype.element_ty),
                 mask=cols < width)


def _check_rows(name: str, x: torch.Tensor):
    if x.dim() == 0 or x.shape[-1] == 0 or not x.is_floating_point():
        raise ValueError(f"{name} must be a [..., V] float tensor with V > 0, got {x.dtype} {tuple(x.shape)}")


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) in float32 ([..., V] logits of any float dtype, cap > 0)."""
    _check_rows("logits", logits)
    if not cap > 0:
        raise ValueError(f"the softcap must be positive, got {cap}")
    logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.numel():
        softcap_kernel[(triton.cdiv(logits.numel(), BLOCK),)](logits, out, logits.numel(), 1 / cap, cap, BLOCK=BLOCK)
    return out


def softcap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / cap) * cap


def soft_probs(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(z) over the last dim, computed in float32 and written in dtype ([..., V], any float dtype)."""
    _check_rows("z", z)
    z = z.contiguous()
    probs = torch.empty(z.shape, dtype=dtype, device=z.device)
    if z.numel():
        soft_probs_kernel[(z.numel() // z.shape[-1],)](z, probs, z.shape[-1], BLOCK=BLOCK, num_warps=8)
    return probs


def soft_probs_reference(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return z.float().softmax(dim=-1).to(dtype)
