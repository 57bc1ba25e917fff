"""What DiffusionGemma's sampler reads of a step's logits, in three passes over each row instead of twenty.

Per row of logits [..., V] (float32) and a temperature T, with z = logits / T, e = exp(z - max z), S = sum e:
    scaled = z in the model's dtype (the next step's self-conditioning); argmax = the first index of max z;
    entropy = -sum p log p = log S - sum(e (z - max z)) / S; probs = p = e / S (when asked: for sampling).
In torch the loop divides, casts, takes a softmax, two argmaxes and a Categorical's entropy: some twenty
passes over [batch, 256, V] floats, V = 262,144. Here a program owns a row: pass 1 writes `scaled` and
finds the max (lane by lane, then the first index among the lanes at it), pass 2 sums e and e (z - max),
pass 3 writes probs. z is rounded as torch rounds logits / T on the logits' device (a GPU multiplies by
the float32 reciprocal of a host scalar, a CPU divides): `scaled` is torch's to the bit. exp is Triton's
and the sums run in another order: probs differ from torch's in the last bits, a sharp row's entropy
comes closer to its exact value than the Categorical's (which loses digits in log p), and where exp
rounds two near-max logits to one probability the softmax's argmax (the deterministic draw) may differ.
The reference is softmax_stats_reference.
"""

from __future__ import annotations

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
def softmax_stats_kernel(logits_ptr, scaled_ptr, argmax_ptr, entropy_ptr, probs_ptr, divisor, width,
                         RECIPROCAL: tl.constexpr, PROBS: tl.constexpr, BLOCK: tl.constexpr):
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
        higher = z > best  # strictly: a lane keeps the first column at its max
        best_at = tl.where(higher, cols, best_at)
        best = tl.where(higher, z, best)
    top = tl.max(best, 0)
    tl.store(argmax_ptr + row, tl.min(tl.where(best == top, best_at, width), 0).to(tl.int64))
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
    if PROBS:
        probs_ptr += row * width
        for start in range(0, width, BLOCK):
            cols = start + lanes
            z = _scaled(logits_ptr, cols, width, divisor, RECIPROCAL)
            tl.store(probs_ptr + cols, tl.exp(z - top) / norm, mask=cols < width)


def check_inputs(logits: torch.Tensor, temperature: torch.Tensor, dtypes=(torch.float32,)):
    if logits.dim() == 0 or logits.shape[-1] == 0 or logits.dtype not in dtypes:
        raise ValueError(f"logits must be a [..., V] tensor with V > 0 of {', '.join(map(str, dtypes))}, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if temperature.numel() != 1 or not temperature.item() > 0:
        raise ValueError(f"the temperature must be one positive number, got {temperature}")


def softmax_stats(logits: torch.Tensor, temperature: torch.Tensor, dtype: torch.dtype, probs: bool = False):
    """(scaled [..., V] in dtype, argmax [...] int64, entropy [...] float32, probs [..., V] float32 or None)
    of logits [..., V] float32 at temperature T (a one-element tensor, read on the host)."""
    check_inputs(logits, temperature)
    logits, temperature = logits.contiguous(), temperature.to("cpu", torch.float32)
    reciprocal = logits.is_cuda  # torch's CUDA division by a host scalar multiplies by its reciprocal
    divisor = 1 / temperature if reciprocal else temperature
    rows, width = logits.numel() // logits.shape[-1], logits.shape[-1]
    scaled = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    argmax = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    entropy = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    probs_out = torch.empty_like(logits) if probs else None
    if rows:
        softmax_stats_kernel[(rows,)](logits, scaled, argmax, entropy, probs_out if probs else logits,
                                      divisor.item(), width, RECIPROCAL=reciprocal, PROBS=probs, BLOCK=BLOCK,
                                      num_warps=8)
    return scaled, argmax, entropy, probs_out


def softmax_stats_reference(logits: torch.Tensor, temperature: torch.Tensor, dtype: torch.dtype,
                            probs: bool = False):
    """The torch form the loop runs off the kernels (logits of any float dtype)."""
    check_inputs(logits, temperature, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    z = logits / temperature
    entropy = torch.distributions.Categorical(logits=z).entropy()
    return z.to(dtype), z.argmax(dim=-1), entropy, torch.softmax(z, dim=-1) if probs else None
