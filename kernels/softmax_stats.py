"""What DiffusionGemma's sampler reads of a step's logits, and its draw, in three passes over each row.

Per row of logits [..., V] (float32) and a temperature T, with z = logits / T, e = exp(z - max z), S = sum e:
    scaled = z in the model's dtype (the next step's self-conditioning); argmax = the first index of max z;
    entropy = -sum p log p = log S - sum(e (z - max z)) / S; drawn = a token from p = e / S: with q ~ Exp(1)
    per logit, the first index of max p / q (torch.multinomial's one-sample draw: the same q from the same
    generator state, the same token), else of max p.
In torch (a division, a cast, softmax, argmax, a Categorical's entropy, multinomial's draw) that is some
twenty passes over [batch, 256, V] floats, V = 262,144, and two host syncs. Here a program owns a row: pass 1
writes `scaled` and finds the max, pass 2 sums e and e (z - max), pass 3 draws (and writes p when asked). z is
rounded as torch rounds logits / T on the logits' device (a GPU multiplies by the float32 reciprocal of a host
scalar, a CPU divides): `scaled` is torch's to the bit, and p is computed from that z (enable_fp_fusion=False:
no FMA of the product and the max's subtraction). With Triton's exp and the sums in another order, p differs
from softmax_stats_reference's in the last bits, the draw is exactly multinomial's of this p, and a sharp
row's entropy comes closer to its exact value than the Categorical's."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _scaled(logits_ptr, cols, width, divisor, RECIPROCAL: tl.constexpr):
    """z = logits / T for the columns cols of a row (-inf past its end), with torch's rounding: times
    divisor = 1 / T (float32) where RECIPROCAL, else divided by divisor = T, correctly rounded."""
    x = tl.load(logits_ptr + cols, mask=cols < width, other=float("-inf"))
    if RECIPROCAL:
        return x * divisor
    return tl.math.div_rn(x, divisor)


@triton.jit
def softmax_stats_kernel(logits_ptr, scaled_ptr, argmax_ptr, entropy_ptr, drawn_ptr, exponential_ptr, probs_ptr,
                         divisor, width, RECIPROCAL: tl.constexpr, SAMPLE: tl.constexpr, PROBS: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * width
    scaled_ptr += row * width
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + lanes
        z = _scaled(logits_ptr, cols, width, divisor, RECIPROCAL)
        tl.store(scaled_ptr + cols, z.to(scaled_ptr.dtype.element_ty), mask=cols < width)
        best, best_at = _higher(z, cols, best, best_at)
    top = tl.max(best, 0)
    tl.store(argmax_ptr + row, _first_at_max(best, best_at, width))
    total = tl.zeros((BLOCK,), tl.float32)
    weighted = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + lanes
        shifted = _scaled(logits_ptr, cols, width, divisor, RECIPROCAL) - top
        e = tl.exp(shifted)
        total += e
        weighted += e * tl.where(e > 0, shifted, 0.0)  # at -inf (e = 0) e * shifted would be NaN
    norm = tl.sum(total, 0)
    tl.store(entropy_ptr + row, tl.log(norm) - tl.sum(weighted, 0) / norm)
    exponential_ptr += row * width
    probs_ptr += row * width
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + lanes
        p = tl.exp(_scaled(logits_ptr, cols, width, divisor, RECIPROCAL) - top) / norm
        if PROBS:
            tl.store(probs_ptr + cols, p, mask=cols < width)
        if SAMPLE:  # multinomial's p / q, correctly rounded as torch divides
            p = tl.math.div_rn(p, tl.load(exponential_ptr + cols, mask=cols < width, other=1.0))
        best, best_at = _higher(p, cols, best, best_at)  # 0 past the row: below the max, which is > 0
    tl.store(drawn_ptr + row, _first_at_max(best, best_at, width))


@triton.jit
def _higher(values, cols, best, best_at):
    """Each lane's max so far and its column: strictly higher wins, so a lane keeps its first column at it."""
    higher = values > best
    return tl.where(higher, values, best), tl.where(higher, cols, best_at)


@triton.jit
def _first_at_max(best, best_at, width):
    """The first column at the row's max, over the lanes' maxima and their columns."""
    return tl.min(tl.where(best == tl.max(best, 0), best_at, width), 0).to(tl.int64)


def check_inputs(logits: torch.Tensor, temperature: torch.Tensor, dtypes=(torch.float32,)):
    if logits.dim() == 0 or logits.shape[-1] == 0 or logits.dtype not in dtypes:
        raise ValueError(f"logits must be a [..., V] tensor with V > 0 of {', '.join(map(str, dtypes))}, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if temperature.numel() != 1 or not temperature.item() > 0:
        raise ValueError(f"the temperature must be one positive number, got {temperature}")


class Stats(NamedTuple):
    scaled: torch.Tensor  # [..., V] z = logits / T in the model's dtype
    argmax: torch.Tensor  # [...] int64: the first index of max z
    entropy: torch.Tensor  # [...] float32
    drawn: torch.Tensor  # [...] int64: a token from softmax(z), sampled (as torch.multinomial) or its argmax
    probs: torch.Tensor | None  # [..., V] softmax(z), where asked


def softmax_stats(logits: torch.Tensor, temperature: torch.Tensor, dtype: torch.dtype, sample: bool = False,
                  generator: torch.Generator | None = None, probs: bool = False) -> Stats:
    """Stats of logits [..., V] float32 at temperature T (a one-element tensor, read on the host); with
    sample, q ~ Exp(1) drawn from generator (None: the default one) for the logits' shape, as
    torch.multinomial(softmax(z), 1) draws it; probs: p written too."""
    check_inputs(logits, temperature)
    logits, temperature = logits.contiguous(), temperature.to("cpu", torch.float32)
    reciprocal = logits.is_cuda  # torch's CUDA division by a host scalar multiplies by its reciprocal
    divisor = 1 / temperature if reciprocal else temperature
    rows, width = logits.numel() // logits.shape[-1], logits.shape[-1]
    scaled = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    argmax, drawn = (torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device) for _ in range(2))
    entropy = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    exponential = torch.empty_like(logits).exponential_(generator=generator) if sample else None
    probs_out = torch.empty_like(logits) if probs else None
    if rows:
        softmax_stats_kernel[(rows,)](logits, scaled, argmax, entropy, drawn,
                                      logits if exponential is None else exponential,
                                      logits if probs_out is None else probs_out, divisor.item(), width,
                                      RECIPROCAL=reciprocal, SAMPLE=sample, PROBS=probs, BLOCK=BLOCK, num_warps=8,
                                      enable_fp_fusion=False)
    return Stats(scaled, argmax, entropy, drawn, probs_out)


def softmax_stats_reference(logits: torch.Tensor, temperature: torch.Tensor, dtype: torch.dtype, sample: bool = False,
                            generator: torch.Generator | None = None, probs: bool = False) -> Stats:
    """The torch form the loop runs off the kernels (logits of any float dtype): torch.multinomial's draw."""
    check_inputs(logits, temperature, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    z = logits / temperature
    entropy = torch.distributions.Categorical(logits=z).entropy()
    p = torch.softmax(z, dim=-1)
    if sample:
        drawn = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).view(p.shape[:-1])
    else:
        drawn = p.argmax(dim=-1)
    return Stats(z.to(dtype), z.argmax(dim=-1), entropy, drawn, p if probs else None)
