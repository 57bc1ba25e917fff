"""kernels/norm_linear.py (RMSNorm -> matmul [-> SwiGLU] for a decode step's few rows) against the
model's unfused torch path (the fused layer's few-row step: tests/test_fused.py).

The kernel rounds at other points than the unfused path (x * norm weight, not x * rstd then the
weight), so neither is the other's bit for bit: both are held against the float64 result, and the
kernel must come as close as the unfused path does in the same dtype (twice its error, plus a few
units in the last place, more for longer dots). Off the GPU the kernel runs in Triton's interpreter
(float16 and float32, whose dots it computes correctly). Outputs are allocated NaN-filled: an element
never written fails.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import nanodllm.kernels.norm_linear as norm_linear_module  # noqa: E402
from nanodllm.kernels.norm_linear import MAX_ROWS, norm_linear, norm_linear_reference  # noqa: E402
from tests.device import DEVICE  # noqa: E402

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EXAMPLES = settings(deadline=None, max_examples=20)


def inputs(rows, dim, width, dtype, bias, swiglu, seed):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)
    x = make(rows, dim, scale=3.0)  # rms 3: the norm must actually scale
    norm_weight = (1 + torch.randn(dim, generator=generator) * 0.3).to(DEVICE, dtype)
    n = 2 * width if swiglu else width
    weight = make(n, dim, scale=dim**-0.5)
    return x, norm_weight, weight, make(n) if bias else None


def error(out, x, norm_weight, weight, bias, swiglu, eps):
    """max |out - float64 result| and the unfused path's max error in the same dtype."""
    exact = norm_linear_reference(*(t.double() if t is not None else None for t in (x, norm_weight)), eps,
                                  weight.double(), None if bias is None else bias.double(), swiglu)
    unfused = norm_linear_reference(x.clone(), norm_weight, eps, weight, bias, swiglu)
    return (out.double() - exact).abs().max().item(), (unfused.double() - exact).abs().max().item(), exact


def within(out_error, unfused_error, exact, dtype, dim: int) -> bool:
    """Twice the unfused path's error plus 4 + sqrt(dim) units in the last place: the two paths sum the
    dim products of each dot in different orders, and a sum's rounding error grows as the square
    root of its length (the unfused path's own error is small by luck as often as not)."""
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    return out_error <= 2 * unfused_error + (4 + dim**0.5) * ulp


def nan_empty():
    """torch.empty NaN-filled while the kernel's wrapper allocates its output."""
    empty = torch.empty
    return mock.patch.object(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))


@EXAMPLES
@given(rows=st.integers(1, MAX_ROWS), dim=st.sampled_from([16, 40, 64, 200, 300]),
       width=st.sampled_from([8, 24, 64, 100, 130]), dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       swiglu=st.booleans(), seed=st.integers(0, 2**16))
def test_norm_linear_comes_as_close_as_the_unfused_path(rows, dim, width, dtype, bias, swiglu, seed):
    x, norm_weight, weight, b = inputs(rows, dim, width, dtype, bias, swiglu, seed)
    with nan_empty():
        out = norm_linear(x, norm_weight, 1e-5, weight, b, swiglu)
    assert out.shape == (rows, width) and out.dtype == dtype
    out_error, unfused_error, exact = error(out, x, norm_weight, weight, b, swiglu, 1e-5)
    assert within(out_error, unfused_error, exact, dtype, dim), (out_error, unfused_error)


def test_norm_linear_keeps_leading_dims_and_reads_strided_rows():
    x, norm_weight, weight, _ = inputs(12, 64, 48, torch.float16, False, True, 3)
    wide = torch.zeros(2, 6, 96, device=DEVICE, dtype=torch.float16)
    wide[..., :64] = x.view(2, 6, 64)
    view = wide[..., :64]  # rows 96 apart
    out = norm_linear(view, norm_weight, 1e-6, weight, swiglu=True)
    assert out.shape == (2, 6, 48)
    torch.testing.assert_close(out.view(12, 48), norm_linear(x, norm_weight, 1e-6, weight, swiglu=True))


@pytest.mark.parametrize("mistake", ["norm weight", "rstd", "halves"])
def test_the_comparison_catches_a_wrong_formula(mistake):
    """The tolerance used above fails a result with the norm weight dropped, no 1 / rms, or gate and
    up swapped."""
    x, norm_weight, weight, _ = inputs(32, 64, 40, torch.float16, False, True, 7)
    if mistake == "norm weight":
        out = norm_linear(x, torch.ones_like(norm_weight), 1e-5, weight, swiglu=True)
    elif mistake == "rstd":
        out = norm_linear(x, norm_weight, 1e-5, weight, swiglu=True) * 3.0
    else:
        out = norm_linear(x, norm_weight, 1e-5, torch.cat(weight.chunk(2)[::-1]), swiglu=True)
    out_error, unfused_error, exact = error(out, x, norm_weight, weight, None, True, 1e-5)
    assert not within(out_error, unfused_error, exact, torch.float16, 64)


def test_bad_inputs_are_refused():
    x, norm_weight, weight, bias = inputs(4, 16, 8, torch.float16, True, False, 0)
    cases = [
        ((torch.zeros(MAX_ROWS + 1, 16, device=DEVICE, dtype=torch.float16), norm_weight, 1e-6, weight), "at most"),
        ((x, norm_weight, 1e-6, weight[:, :8]), "weight \\[N, K\\]"),
        ((x, norm_weight[:8], 1e-6, weight), "norm_weight \\[K\\]"),
        ((x.float(), norm_weight, 1e-6, weight), "share one of"),
        ((x, norm_weight, 1e-6, weight, bias[:4]), "bias must be"),
        ((x, norm_weight, 1e-6, weight[:7], None, True), "even N"),
        ((x.t(), norm_weight[:4], 1e-6, weight[:, :4]), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            norm_linear(*args)


@pytest.mark.parametrize("limit", [232448, 166912, 101376, 49152])  # sm_90, sm_80, consumer GPUs, a small one
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("element_size", [2, 4])
def test_launch_shape_fits_the_shared_memory(limit, swiglu, element_size):
    """The pipelined tiles (stages x (weight rows + x rows) x BLOCK_K) fit the device's limit; on sm_90
    (227 KB) in bfloat16 the swept shape is kept."""
    shape = norm_linear_module.launch_shape(32, 4096, swiglu, element_size, limit)
    rows = shape["BLOCK_N"] * (2 if swiglu else 1) + shape["BLOCK_M"]
    used = shape["num_stages"] * rows * shape["BLOCK_K"] * element_size + norm_linear_module.SHARED_SLACK
    assert used <= limit and shape["BLOCK_K"] >= 16 and shape["num_stages"] >= 2
    if limit == 232448 and element_size == 2:
        assert shape == norm_linear_module.launch_shape(32, 4096, swiglu, 2, None)


@pytest.mark.parametrize("width, swiglu, fills", [(6144, False, True), (4096, False, False), (3072, False, False),
                                                  (24576, True, True), (12288, True, False)])
def test_a_launch_fills_the_device_with_programs_for_half_its_sms(width, swiglu, fills):
    """sdar-8b's q/k/v (6144 rows, 96 programs of 64) and gate/up (2 x 12288, 96 of 128) on 132 SMs take
    the kernel; their halves on a rank of two (48 programs), or LLaDA's 4096-row o_proj (64), do not."""
    weight = torch.empty(width, 4096, dtype=torch.bfloat16, device="meta")
    assert norm_linear_module.fills_device(weight, swiglu, sms=132) == fills
    assert norm_linear_module.fills_device(torch.empty(8, 16), swiglu)  # off CUDA (the interpreter): always


@pytest.mark.skipif(DEVICE != "cuda", reason="asks the GPU's driver")
def test_shared_memory_limit_is_the_devices():
    limit = norm_linear_module.shared_memory_limit(torch.device(DEVICE))
    assert 48 * 1024 <= limit <= 256 * 1024


def test_where_every_sum_is_exact_the_kernel_rounds_as_the_unfused_path():
    """x of entries +-2 (rstd 1/2 exactly at eps 0), norm weight 1 and weights on a 1/1024 grid: every
    product and sum is exact in fp32, so the kernel's gate and up are the unfused path's exact values,
    and with them rounded to the activation dtype, silu(gate) rounded and the product rounded (the
    module docstring) the result equals the unfused path's but where exp's last fp32 bit moves a rounding."""
    generator = torch.Generator().manual_seed(11)
    for dtype in (dtype for dtype in DTYPES if dtype != torch.float32):
        x = (torch.randint(0, 2, (MAX_ROWS, 64), generator=generator) * 4 - 2).to(DEVICE, dtype)
        weight = (torch.randint(-1023, 1024, (2 * 96, 64), generator=generator) / 1024).to(DEVICE, dtype)
        norm_weight = torch.ones(64, device=DEVICE, dtype=dtype)
        out = norm_linear(x, norm_weight, 0.0, weight, swiglu=True)
        differ = int((out != norm_linear_reference(x, norm_weight, 0.0, weight, swiglu=True)).sum())
        assert differ <= 1 + out.numel() // 100, differ
