"""RMSNorm, then a linear layer, then (optionally) SwiGLU, in one launch for the few rows of a decode step.

    out = (rmsnorm(x) * g) @ W^T                        (q/k/v)
    out = silu(h @ W_gate^T) * (h @ W_up^T), h = rmsnorm(x) * g   (gate/up with swiglu=True)

At a decode step's few rows a matmul streams its weights at memory speed, and the small kernels
around it (the norm before the projections, silu(gate) * up after gate/up) cost their launches more
than their bytes, so they ride inside the matmul. RMSNorm's 1 / rms(x) is one number per row, so
it factors out: (x * r * g) @ W^T = r * ((x * g) @ W^T). Each program sums x^2 on its way along K,
feeds x * g to the tensor cores and scales its fp32 accumulator by r = rsqrt(mean(x^2) + eps) at
the end; so x * g is rounded where the unfused path rounds x * r and its product with g. A bias
joins the scaled fp32 accumulator before the rounding; the SwiGLU epilogue rounds as
kernels/silu_mul.py does. x [M, K] (M <= MAX_ROWS) and W [N, K] (row-major, as nn.Linear stores
it; N = 2I, [gate; up], with swiglu) are read through their row stride. The reference is
norm_linear_reference, the unfused path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanodllm.kernels.device import shared_memory_limit, sm_count
from nanodllm.kernels.rmsnorm import rms_norm_reference
from nanodllm.kernels.silu_mul import silu_mul_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 32  # every row lives in each program: more rows, more registers, fewer tiles in flight
SHARED_SLACK = 4096  # bytes of headroom for the shared memory Triton adds to the pipelined tiles


@triton.jit
def norm_linear_kernel(
    x_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr,
    num_rows, out_width, dim, stride_x, stride_w, stride_out, eps,
    GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A program owns BLOCK_N output columns and every row (at most MAX_ROWS). The product is computed
    transposed, W_tile [BLOCK_N, BLOCK_K] @ (x * g)_tile^T [BLOCK_K, rows], so the weight tile fills the
    tensor cores' 64-row side and the few rows their narrow one. With GLU "silu" the program also
    accumulates the up columns (rows I + n of the stacked [gate; up] weight) for the same n and writes
    I outputs; gate and up are rounded to the activation dtype, silu(gate) rounded, the product rounded
    (no FMA contraction: the launch sets enable_fp_fusion=False)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < out_width, rows < num_rows
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x
    gate_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w
    up_ptrs = gate_ptrs + out_width * stride_w  # read only with a GLU: the up half of [gate; up]
    dtype = w_ptr.dtype.element_ty
    precision: tl.constexpr = "ieee" if dtype == tl.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    sum_sq = tl.zeros((BLOCK_M,), tl.float32)
    gate_acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed: [columns, rows]
    up_acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for start in range(0, dim, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < dim
        x = tl.load(x_ptrs + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
        g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        xg_t = tl.trans((x * g[None, :]).to(dtype))  # [BLOCK_K, BLOCK_M]
        w_mask = col_ok[:, None] & k_ok[None, :]
        gate_acc = tl.dot(tl.load(gate_ptrs + ks[None, :], mask=w_mask, other=0.0), xg_t, gate_acc,
                          input_precision=precision)
        if GLU != "":
            up_acc = tl.dot(tl.load(up_ptrs + ks[None, :], mask=w_mask, other=0.0), xg_t, up_acc,
                            input_precision=precision)
    rstd = tl.math.rsqrt(sum_sq / dim + eps)  # [BLOCK_M]
    gate_acc = gate_acc * rstd[None, :]
    up_acc = up_acc * rstd[None, :]
    if HAS_BIAS:  # as the matmul adds it: in fp32, before the rounding
        gate_acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if GLU != "":
            up_acc += tl.load(bias_ptr + out_width + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    store_transposed(out_ptr, gate_acc, up_acc, rows, cols, row_ok, col_ok, stride_out, GLU)


@triton.jit
def store_transposed(out_ptr, gate_acc, up_acc, rows, cols, row_ok, col_ok, stride_out, GLU: tl.constexpr):
    """Write the fp32 accumulators [BLOCK_N, BLOCK_M] (columns, rows) to out [rows, N] in out's dtype;
    with GLU ("silu" or "gelu_tanh") act(gate) * up: gate and up rounded first, act(gate) rounded, the
    product rounded, as torch's F.silu / F.gelu(approximate="tanh") and multiply round them."""
    out_dtype = out_ptr.dtype.element_ty
    out = gate_acc.to(out_dtype)
    if GLU != "":
        gate = out.to(tl.float32)
        up = up_acc.to(out_dtype).to(tl.float32)
        if GLU == "silu":
            activated = gate / (1.0 + tl.exp(-gate))
        else:  # gelu, tanh approximation: tanh(y) = 1 - 2 / (1 + exp(2y))
            y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            activated = 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
        out = (activated.to(out_dtype).to(tl.float32) * up).to(out_dtype)
    out_ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None]
    tl.store(out_ptrs, out, mask=col_ok[:, None] & row_ok[None, :])


def launch_shape(num_rows: int, dim: int, swiglu: bool, element_size: int, shared_limit: int | None) -> dict:
    """Tiles, warps and stages: the best of the tuning sweep at 32 rows, K = 4096, sdar-8b's q/k/v
    (N = 6144) and gate/up (2 x 12288) weights in bfloat16 (docs/results/bench_kernels.md, "Few-row
    norm_linear", times them); float32 tiles are halved. Where a GPU has less shared memory per block than
    sm_90's 227 KB (shared_limit, bytes; None: no limit, the interpreter), fewer stages, then shorter
    K tiles, until the pipelined tiles fit."""
    shape = dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3) if swiglu else dict(
        BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
    if element_size > 2:
        shape["BLOCK_K"] //= 2
        shape["BLOCK_N"] //= 2 if swiglu else 1
    shape.update(BLOCK_K=min(shape["BLOCK_K"], max(16, triton.next_power_of_2(dim))),
                 BLOCK_M=max(16, triton.next_power_of_2(num_rows)))
    return fit_shared_memory(shape, swiglu, element_size, shared_limit)


def fills_device(weight: torch.Tensor, swiglu: bool = False, sms: int | None = None) -> bool:
    """Whether norm_linear over `weight` [N, K] launches programs for at least half the device's `sms`
    streaming multiprocessors (default: weight's GPU's; off CUDA, the interpreter, always). A program walks
    all of K for its column tile, so a narrow projection (a tensor-parallel rank's share) leaves SMs idle,
    and the unfused norm and cuBLAS's split-K matmul read its weights faster."""
    if sms is None and weight.device.type != "cuda":
        return True
    width = weight.shape[0] // 2 if swiglu else weight.shape[0]
    sms = sm_count(weight.device) if sms is None else sms
    return _fills(width, weight.shape[1], swiglu, weight.element_size(), sms)


@functools.lru_cache(maxsize=None)
def _fills(width: int, dim: int, swiglu: bool, element_size: int, sms: int) -> bool:
    """fills_device, kept per shape: a layer asks it at every eager step."""
    block_n = launch_shape(MAX_ROWS, dim, swiglu, element_size, None)["BLOCK_N"]
    return 2 * triton.cdiv(width, block_n) >= sms


def fit_shared_memory(shape: dict, glu: bool, element_size: int, shared_limit: int | None) -> dict:
    """shape with fewer stages, then shorter K tiles, until its pipelined tiles fit in shared_limit bytes."""
    tile_rows = shape["BLOCK_N"] * (2 if glu else 1) + shape["BLOCK_M"]  # weight rows + x rows per stage
    while shared_limit is not None and shape["BLOCK_K"] > 16 and (
            shape["num_stages"] * tile_rows * shape["BLOCK_K"] * element_size + SHARED_SLACK > shared_limit):
        if shape["num_stages"] > 2:
            shape["num_stages"] -= 1
        else:
            shape["BLOCK_K"] //= 2
    return shape


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """(rmsnorm(x) * norm_weight) @ weight^T + bias, or with swiglu its silu(first half) * second half.

    x [..., K] with at most MAX_ROWS rows (the leading dims' product), last dim contiguous;
    norm_weight [K]; weight [N, K] with a contiguous last dim (N = 2I, [gate; up], with swiglu); bias
    None or [N] (Qwen2's q/k/v have one); all of one dtype (float16, bfloat16 or float32). Returns
    [..., N] (or [..., I]) of x's dtype."""
    if x.dim() == 0 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or norm_weight.shape != x.shape[-1:]:
        raise ValueError(f"need x [..., K], norm_weight [K] and weight [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(norm_weight.shape)} and {tuple(weight.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    dtypes = {t.dtype for t in (x, norm_weight, weight, bias) if t is not None}
    if len(dtypes) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x, norm_weight, weight (and bias) must share one of {DTYPES}, "
                         f"got {sorted(map(str, dtypes))}")
    if x.stride(-1) != 1 or weight.stride(1) != 1 or norm_weight.stride(0) != 1:
        raise ValueError(f"the last dims must be contiguous, got strides {x.stride()}, {norm_weight.stride()}, "
                         f"{weight.stride()}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"norm_linear is for at most {MAX_ROWS} rows, got {rows.shape[0]}")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu needs the stacked [gate; up] weight (an even N), got N = {weight.shape[0]}")
    width = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty((rows.shape[0], width), device=x.device, dtype=x.dtype)
    if out.numel():
        shape = launch_shape(rows.shape[0], x.shape[-1], swiglu, x.element_size(), shared_memory_limit(x.device))
        norm_linear_kernel[(triton.cdiv(width, shape["BLOCK_N"]),)](
            rows, norm_weight, weight, weight if bias is None else bias, out, rows.shape[0], width, x.shape[-1],
            rows.stride(0), weight.stride(0), out.stride(0), eps, GLU="silu" if swiglu else "",
            HAS_BIAS=bias is not None, **shape, enable_fp_fusion=False)
    return out.view(*x.shape[:-1], width)


def norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """The model's unfused path: RMSNorm (kernels/rmsnorm.py's reference), F.linear, then silu(gate) * up."""
    out = torch.nn.functional.linear(rms_norm_reference(x, norm_weight, eps), weight, bias)
    return silu_mul_reference(out) if swiglu else out
