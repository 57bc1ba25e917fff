"""SwiGLU's activation, silu(gate) * up, in one pass over the stacked gate/up projection's output.

The model computes gate and up as one matmul (nanodllm.model.stacked): its output row is
[gate (I values) | up (I values)]. The torch form, F.silu(gate) * up, runs two kernels and writes
the silu result in between; here each gate and up element is read once and the product written
once, with torch's rounding points: silu(g) = g / (1 + exp(-g)) in fp32, rounded to the activation
dtype, then the product with up in fp32, rounded again (no FMA contraction: the launch sets
enable_fp_fusion=False). Triton's exp and division may differ from torch's in the last fp32 bits,
which can move the rounded silu by one unit in the last place and the product by up to two in
float16 / bfloat16 (the model runs the kernel only there); a float32 result keeps the whole error of
the GPU's fast exp, several units for |gate| ~ 16.

Grid: (tiles of BLOCK elements of the [rows, I] output,). Rows are read through their stride, so a
[batch, t, 2I] projection and any view with a contiguous last dim are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 2048


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, stride_row, num_elements, width, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < num_elements
    row, col = index // width, index % width
    gate_ptrs = gate_up_ptr + row * stride_row + col
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + index, (activated * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:] for gate_up [..., 2I] float16 / bfloat16 / float32
    with a contiguous last dim. Returns a contiguous [..., I] tensor of gate_up's dtype."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate then up), got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up must be float16, bfloat16 or float32, got {gate_up.dtype}")
    if gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up's last dim must be contiguous (stride 1), got strides {gate_up.stride()}")
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)  # a view unless the leading dims cannot be merged
    out = torch.empty_like(gate_up[..., :width], memory_format=torch.contiguous_format)
    if out.numel():
        silu_mul_kernel[(triton.cdiv(out.numel(), BLOCK),)](
            rows, out, rows.stride(0), out.numel(), width, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's torch form: F.silu(gate) * up, on the two halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
