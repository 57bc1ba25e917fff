"""kernels/wide_attention.py against its plain-torch reference.

Without a GPU the kernels run in Triton's interpreter with small tiles drawn per example, so that small
shapes cross many tile edges (fp16 and fp32: the interpreter's bf16 tl.dot is wrong). Keys past each
row's count hold NaN, which must never reach the output, and outputs are allocated NaN-filled, so an
element the kernels never write fails the comparison.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nanodllm.kernels.wide_attention as wa
from nanodllm.kernels.wide_attention import wide_attention, wide_attention_reference
from tests.device import DEVICE

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# fp32 runs exact dots (tests only); p is rounded to the inputs' dtype.
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
# (probabilities' BLOCK_M, BLOCK_N, BLOCK_D), (values' BLOCK_M, BLOCK_D)
INTERPRETER_TILES = [((16, 16, 16), (16, 16)), ((32, 16, 16), (16, 32)), ((16, 32, 32), (32, 16))]


def nan_output(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def check_against_reference(q, k, v, counts, tiles=INTERPRETER_TILES[0], scale=None, probs_bytes=wa.PROBS_BYTES):
    """wide_attention (out and lse) against the reference, the keys past each row's count NaN in the kernel's."""
    expected, expected_lse = wide_attention_reference(q, k, v, counts.clamp(max=k.shape[2]), scale=scale,
                                                      return_lse=True)
    k, v = k.clone(), v.clone()
    for row, count in enumerate(counts.tolist()):
        k[row, :, count:], v[row, :, count:] = float("nan"), float("nan")
    (pm, pn, pd), (vm, vd) = tiles
    interpreter_tiles = (dict(BLOCK_M=pm, BLOCK_N=pn, BLOCK_D=pd), dict(BLOCK_M=vm, BLOCK_D=vd))
    with mock.patch.object(wa, "_output", nan_output), mock.patch.object(wa, "INTERPRETER_TILES", interpreter_tiles), \
            mock.patch.object(wa, "PROBS_BYTES", probs_bytes):
        out, lse = wide_attention(q, k, v, counts, scale=scale, return_lse=True)
    tolerance = TOLERANCE[q.dtype] * max(1.0, expected.float().abs().max().item())
    assert out.shape == q.shape and out.dtype == q.dtype and out.transpose(1, 2).is_contiguous()
    error = (out.float() - expected.float()).abs().max().item()
    assert error <= tolerance, (error, tolerance)
    seen = expected_lse > float("-inf")
    assert torch.equal(lse > float("-inf"), seen)  # a row without keys: lse = -inf, out = 0
    lse_error = (lse[seen] - expected_lse[seen]).abs().max().item() if seen.any() else 0.0
    assert lse_error <= max(1e-4, TOLERANCE[q.dtype]), lse_error


def random_heads(batch, heads, length, head_dim, dtype, seq_major, generator, spread=1.0):
    """[batch, heads, length, head_dim], or the transposed view of a [batch, length, heads, head_dim] buffer (a
    fused projection's or the KV cache's layout)."""
    shape = (batch, length, heads, head_dim) if seq_major else (batch, heads, length, head_dim)
    x = (torch.randn(shape, generator=generator) * spread).to(dtype=dtype, device=DEVICE)
    return x.transpose(1, 2) if seq_major else x


@st.composite
def attention_cases(draw):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = 1 if group == 8 else draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    n_q, n_k = draw(st.integers(1, 40)), draw(st.integers(1, 72))
    counts = torch.tensor(draw(st.lists(st.integers(0, n_k + 5), min_size=batch, max_size=batch)), device=DEVICE)
    dtype = draw(st.sampled_from(DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = random_heads(batch, group * kv_heads, n_q, head_dim, dtype, draw(st.booleans()), generator)
    k, v = (random_heads(batch, kv_heads, n_k, head_dim, dtype, draw(st.booleans()), generator) for _ in range(2))
    scale = draw(st.sampled_from([None, 0.3, 1.0]))
    probs_bytes = draw(st.sampled_from([wa.PROBS_BYTES, 1]))  # 1: a launch per batch row
    return q, k, v, counts, draw(st.sampled_from(INTERPRETER_TILES)), scale, probs_bytes


@given(attention_cases())
def test_matches_reference(case):
    check_against_reference(*case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_diffusion_gemmas_full_layers(dtype):
    """DiffusionGemma's full layers: head_dim 512, 8 query heads per KV head, scale 1, a canvas of queries
    against a cache whose rows hold different numbers of keys, K = V; scores spread over many units, so the
    key tiles' maxima differ and their weights matter."""
    generator = torch.Generator().manual_seed(512)
    q = random_heads(2, 16, 24, 512, dtype, True, generator, spread=0.2)
    k = random_heads(2, 2, 70, 512, dtype, True, generator, spread=0.5)
    check_against_reference(q, k, k, torch.tensor([70, 23], device=DEVICE), ((32, 16, 64), (32, 64)), scale=1.0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's tiles compile for the GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gpus_tiles_at_a_canvas_against_thousands_of_keys(dtype):
    """The tiles the GPU runs, at a canvas of 256 against 3,000 keys (rows of 3,000 and 1,500), head_dim 512."""
    generator = torch.Generator().manual_seed(0)
    q = random_heads(2, 16, 256, 512, dtype, True, generator, spread=0.2)
    k = random_heads(2, 2, 3000, 512, dtype, True, generator, spread=0.5)
    counts = torch.tensor([3000, 1500], device=DEVICE)
    expected = wide_attention_reference(q, k, k, counts, scale=1.0)
    got = wide_attention(q, k, k, counts, scale=1.0)
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * expected.float().abs().max()


def test_without_lse_returns_only_the_output():
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    counts = torch.tensor([1], device=DEVICE)
    assert isinstance(wide_attention(q, q[:, :1], q[:, :1], counts), torch.Tensor)


def _inputs(n_q=4, n_k=6, heads=4, kv_heads=2, head_dim=16, dtype=torch.float16):
    q = torch.randn(1, heads, n_q, head_dim, dtype=dtype)
    k = torch.randn(1, kv_heads, n_k, head_dim, dtype=dtype)
    return q, k, k.clone(), torch.tensor([n_k])


BAD_CALLS = [
    ("3-d q", lambda q, k, v, c: (q[0], k, v, c), {}, "4-d tensor"),
    ("head_dim 96", lambda q, k, v, c: _inputs(head_dim=96), {}, "power of two from 16, got 96"),
    ("k and v differ", lambda q, k, v, c: (q, k, k[:, :, :5], c), {}, "must be \\[batch, kv_heads, N_k, D\\]"),
    ("heads not a multiple", lambda q, k, v, c: _inputs(heads=3, kv_heads=2), {}, r"heads \(3\) must be a multiple"),
    ("dtype mismatch", lambda q, k, v, c: (q, k.float(), v, c), {}, "must share float16"),
    ("empty", lambda q, k, v, c: _inputs(n_q=0), {}, "empty"),
    ("counts shape", lambda q, k, v, c: (q, k, v, c.repeat(2)), {}, r"key_counts must be int32 or int64 \[1\]"),
    ("counts float", lambda q, k, v, c: (q, k, v, c.float()), {}, "key_counts must be int32 or int64"),
    ("scale 0", None, {"scale": 0.0}, "scale must be positive"),
]


@pytest.mark.parametrize("change, kwargs, message", [case[1:] for case in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("function", [wide_attention, wide_attention_reference])
def test_rejects_bad_inputs(function, change, kwargs, message):
    q, k, v, counts = _inputs()
    if change is not None:
        q, k, v, counts = change(q, k, v, counts)
    with pytest.raises(ValueError, match=message):
        function(q, k, v, counts, **kwargs)
