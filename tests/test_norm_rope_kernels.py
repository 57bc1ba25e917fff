"""kernels/rmsnorm.py, kernels/rope.py and kernels/silu_mul.py against their torch references (the model's own math).

Off the GPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before the kernel
modules are imported; conftest.py sets it, and so does this module, so that it also runs on its own.
The interpreter rounds bf16 differently from torch, so CPU runs draw float16 and float32 only.
Outputs are allocated NaN-filled: an element a kernel never writes fails the comparison.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from contextlib import contextmanager  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import nanodllm.kernels.rope as rope_module  # noqa: E402
from nanodllm.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from nanodllm.kernels.rope import apply_rope, apply_rope_reference, rope_qk  # noqa: E402
from nanodllm.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402
from nanodllm.model import Rope  # noqa: E402
from tests.device import DEVICE

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DIMS = [16, 24, 64, 96, 128, 200]
EXAMPLES = settings(deadline=None)


@contextmanager
def nan_outputs():
    """torch.empty_like gives NaN-filled tensors (the kernels allocate their outputs with it)."""
    empty_like = torch.empty_like
    nan_like = lambda *args, **kwargs: empty_like(*args, **kwargs).fill_(float("nan"))
    with mock.patch.object(torch, "empty_like", nan_like):
        yield


def close(out: torch.Tensor, ref: torch.Tensor, ulps: float, dtype: torch.dtype) -> bool:
    """Same shape and dtype, and every element within `ulps` units in the last place of `dtype`
    (relative), or 1e-6 absolute near zero."""
    rtol = ulps * torch.finfo(dtype).eps
    return (out.shape == ref.shape and out.dtype == ref.dtype
            and bool(((out.double() - ref.double()).abs() <= rtol * ref.double().abs() + 1e-6).all()))


def norm_close(out, ref, x) -> bool:
    """Two roundings to x's dtype (x * rstd, then the weight's product): 2 ulps; float32: the sum's
    order differs from torch's, a few ulps."""
    return close(out, ref, 2 if x.dtype != torch.float32 else 8, x.dtype)


def rope_close(out, ref) -> bool:
    return close(out, ref, 1, ref.dtype)


def rotated_close(out, ref, ulps: float, dtype, rotated: int | None = None) -> bool:
    """Within `ulps` of dtype relative to each rotated pair's length (which the rotation keeps): the normed
    inputs' rounding reaches a coordinate that cancellation left small at its pair's scale, not its own.
    rotated: how many leading dims were rotated (the rest, not rotated, compare as `close`)."""
    rotated = ref.shape[-1] if rotated is None else rotated
    if rotated < ref.shape[-1]:
        return (rotated_close(out[..., :rotated], ref[..., :rotated], ulps, dtype)
                and close(out[..., rotated:], ref[..., rotated:], ulps, dtype))
    half, r = ref.shape[-1] // 2, ref.double()
    pair = (r[..., :half] ** 2 + r[..., half:] ** 2).sqrt().repeat(*([1] * (r.dim() - 1)), 2)
    return (out.shape == ref.shape and out.dtype == ref.dtype
            and bool(((out.double() - r).abs() <= ulps * torch.finfo(dtype).eps * pair + 1e-6).all()))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides in every dim of size > 1 (a size-1 dim's stride is never used)."""
    return a.shape == b.shape and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def leading_view(layout: str, rows: int, dim: int, dtype, generator) -> torch.Tensor:
    """An activation with `rows` rows of `dim`, laid out as
    "rows":       [rows, dim], contiguous;
    "batch_time": [2 or 1, t, dim], contiguous (the residual stream);
    "heads":      [b, heads, t, dim], the transposed view of a [b, t, heads, dim] projection (q/k norm);
    "strided":    every other row of a taller buffer (leading stride 2 * dim)."""
    make = lambda *shape: torch.randn(*shape, generator=generator).mul(3).to(dtype=dtype, device=DEVICE)
    if layout == "batch_time":
        batch = 2 if rows % 2 == 0 else 1
        return make(batch, rows // batch, dim)
    if layout == "heads":
        heads = next(h for h in (3, 2, 1) if rows % h == 0)
        return make(1, rows // heads, heads, dim).transpose(1, 2)
    if layout == "strided":
        return make(2 * rows, dim)[::2]
    return make(rows, dim)


@EXAMPLES
@given(rows=st.integers(1, 40), dim=st.sampled_from(DIMS), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["rows", "batch_time", "heads", "strided"]), eps=st.sampled_from([1e-6, 1e-5, 0.5]),
       fp32_weight=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(rows, dim, dtype, layout, eps, fp32_weight, seed):
    generator = torch.Generator().manual_seed(seed)
    x = leading_view(layout, rows, dim, dtype, generator)
    weight = (1 + torch.randn(dim, generator=generator)).to(torch.float32 if fp32_weight else dtype).to(DEVICE)
    with nan_outputs():
        out = rms_norm(x, weight, eps)
    ref = rms_norm_reference(x, weight, eps)
    assert norm_close(out, ref, x)
    if layout != "strided":
        assert same_layout(out, x)


@EXAMPLES
@given(rows=st.integers(1, 40), dim=st.sampled_from(DIMS + [256, 512]), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["rows", "batch_time", "heads", "strided"]), weighted=st.booleans(),
       seed=st.integers(0, 2**16))
def test_gemmas_rounding_and_a_norm_without_weight_match_the_reference(rows, dim, dtype, layout, weighted, seed):
    """round_normed=False (DiffusionGemma's norms: x * rstd * weight in fp32, one rounding) and weight None
    (its v_norm and router norm), in x's dtype; rounding x * rstd first would miss by more in 16 bits."""
    generator = torch.Generator().manual_seed(seed)
    x = leading_view(layout, rows, dim, dtype, generator)
    weight = (1 + torch.randn(dim, generator=generator)).to(dtype).to(DEVICE) if weighted else None
    with nan_outputs():
        out = rms_norm(x, weight, 1e-6, round_normed=False)
    ref = rms_norm_reference(x, weight, 1e-6, round_normed=False)
    assert out.dtype == x.dtype and close(out, ref, 1 if dtype != torch.float32 else 8, dtype)
    if dtype != torch.float32:  # one rounding of nearly the same fp32 value: equal but at rare boundaries
        assert int((out != ref).sum()) <= 1 + out.numel() // 100
    if layout != "strided":
        assert same_layout(out, x)


@EXAMPLES
@given(rows=st.integers(1, 40), dim=st.sampled_from(DIMS), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["rows", "batch_time", "heads", "strided"]),
       add_layout=st.sampled_from(["rows", "batch_time", "heads", "strided"]), seed=st.integers(0, 2**16))
def test_rms_norm_with_add_writes_the_sum_and_normalises_it(rows, dim, dtype, layout, add_layout, seed):
    generator = torch.Generator().manual_seed(seed)
    x = leading_view(layout, rows, dim, dtype, generator)
    add = leading_view(add_layout, rows, dim, dtype, generator).reshape(x.shape)
    weight = (1 + torch.randn(dim, generator=generator)).to(dtype).to(DEVICE)
    x_ref = x.clone()
    with nan_outputs():
        out = rms_norm(x, weight, 1e-6, add)
    ref = rms_norm_reference(x_ref, weight, 1e-6, add)
    assert torch.equal(x, x_ref)  # the sum, rounded to x's dtype once, written in place
    assert norm_close(out, ref, x)


def test_rms_norm_add_needs_a_matching_tensor():
    x = torch.randn(2, 3, 16).to(DEVICE)
    weight = torch.ones(16).to(DEVICE)
    with pytest.raises(ValueError, match="add must have"):
        rms_norm(x, weight, 1e-6, torch.randn(3, 16).to(DEVICE))
    with pytest.raises(ValueError, match="at most 4-D"):
        rms_norm(x.view(1, 1, 2, 3, 16), weight, 1e-6, torch.randn(1, 1, 2, 3, 16).to(DEVICE))


def test_rms_norm_large_and_non_power_of_two_rows():
    generator = torch.Generator().manual_seed(0)
    for dim in (3584, 8192):  # Dream's hidden size (tail masked) and the largest one-program row
        x = torch.randn(3, dim, generator=generator).to(torch.float16).to(DEVICE)
        weight = torch.randn(dim, generator=generator).to(torch.float16).to(DEVICE)
        assert norm_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), x)


def rope_tables(batch, length, dim, base, offsets, generator, gathered):
    """A real Rope over positions offset..offset+length per row (batch 1: broadcast over x's batch),
    or its Rope.rows gather of a random subset of half the columns."""
    positions = torch.arange(length)[None, :] + torch.tensor(offsets)[:batch, None]
    rope = Rope(positions.to(DEVICE), dim, base)
    if gathered:
        rows = torch.stack([torch.randperm(length, generator=generator)[: max(1, length // 2)] for _ in range(batch)])
        rope = rope.rows(rows.to(DEVICE))
    return rope


@EXAMPLES
@given(batch=st.integers(1, 2), heads=st.integers(1, 4), length=st.integers(1, 10), dim=st.sampled_from(DIMS),
       dtype=st.sampled_from(DTYPES), base=st.sampled_from([10000.0, 1e6]), gathered=st.booleans(),
       table_batch_one=st.booleans(), layout=st.sampled_from(["projection", "contiguous", "every_other_head"]),
       partial=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_matches_reference(batch, heads, length, dim, dtype, base, gathered, table_batch_one, layout, partial,
                                seed):
    """partial: tables for the first half of the dims only (LLaDA2's partial rotary), the rest copied."""
    generator = torch.Generator().manual_seed(seed)
    rotated = dim // 4 * 2 if partial else dim
    rope = rope_tables(1 if table_batch_one else batch, length, rotated, base, [3, 40], generator, gathered)
    t = rope.cos.shape[2]
    make = lambda *shape: torch.randn(*shape, generator=generator).mul(3).to(dtype=dtype, device=DEVICE)
    if layout == "projection":  # [b, t, heads * d] viewed as [b, heads, t, d]
        x = make(batch, t, heads * dim).view(batch, t, heads, dim).transpose(1, 2)
    elif layout == "every_other_head":
        x = make(batch, 2 * heads, t, dim)[:, ::2]
    else:
        x = make(batch, heads, t, dim)
    with nan_outputs():
        out = apply_rope(x, rope.cos, rope.sin)
    assert rope_close(out, apply_rope_reference(x, rope.cos, rope.sin))
    if layout != "every_other_head":
        assert same_layout(out, x)


def test_rope_equals_torch_bit_for_bit():
    """Products and sums rounded separately (no FMA), as torch's separate kernels round them."""
    generator = torch.Generator().manual_seed(1)
    rope = rope_tables(2, 48, 128, 1e6, [0, 700], generator, gathered=False)
    for dtype in DTYPES:
        x = torch.randn(2, 48, 4, 128, generator=generator).mul(4).to(dtype=dtype, device=DEVICE).transpose(1, 2)
        assert torch.equal(apply_rope(x, rope.cos, rope.sin), apply_rope_reference(x, rope.cos, rope.sin))


def test_the_comparison_catches_a_wrong_formula():
    generator = torch.Generator().manual_seed(2)
    rope = rope_tables(1, 8, 64, 10000.0, [5], generator, gathered=False)
    x = torch.randn(1, 2, 8, 64, generator=generator).half().to(DEVICE)
    out = apply_rope(x, rope.cos, rope.sin)
    assert rope_close(out, apply_rope_reference(x, rope.cos, rope.sin))
    assert not rope_close(out, apply_rope_reference(x, rope.cos, -rope.sin))  # rotated the other way
    h = torch.randn(5, 64, generator=generator).half().to(DEVICE)
    weight = torch.linspace(0.5, 1.5, 64).half().to(DEVICE)
    normed = rms_norm(h, weight, 1e-6)
    assert norm_close(normed, rms_norm_reference(h, weight, 1e-6), h)
    assert not norm_close(normed, rms_norm_reference(h, weight.flip(0), 1e-6), h)  # weight misindexed


def test_bad_inputs_are_refused():
    x = torch.randn(2, 3, 4, 8).half().to(DEVICE)
    weight = torch.ones(8).half().to(DEVICE)
    rope = Rope(torch.arange(4)[None].to(DEVICE), 8, 10000.0)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        rms_norm(torch.randn(2, 16).half().to(DEVICE)[:, ::2], weight, 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[D\] = \[8\]"):
        rms_norm(x, torch.ones(6).half().to(DEVICE), 1e-6)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="rotated dims must be even"):
        odd = torch.ones(1, 1, 4, 7, device=DEVICE)  # 7 dims to rotate
        apply_rope(torch.randn(2, 3, 4, 7).half().to(DEVICE), odd, odd)
    with pytest.raises(ValueError, match="cos must be"):
        apply_rope(x[:, :, :3], rope.cos, rope.sin)  # 3 positions, tables for 4
    with pytest.raises(ValueError, match=r"r <= 4\]"):
        apply_rope(x[..., :4], rope.cos, rope.sin)  # tables wider than the head
    with pytest.raises(ValueError, match="x's last dim must be contiguous"):
        apply_rope(torch.randn(2, 3, 4, 16).half().to(DEVICE)[..., ::2], rope.cos, rope.sin)
    with pytest.raises(ValueError, match="sin must be a float32 table"):
        apply_rope(x, rope.cos, rope.sin.half())
    with pytest.raises(ValueError, match="4-D"):
        apply_rope(x[0], rope.cos, rope.sin)


def rope_qk_reference(qkv, num_heads, num_kv_heads, rope, weights, eps, d=None):
    """The model's unfused path: split the projection into heads of d dims (default: the tables'),
    per-head rms_norm (if weights), rope over the tables' dims."""
    batch, t, _ = qkv.shape
    d = rope.cos.shape[-1] if d is None else d
    outs = []
    for start, heads, weight in ((0, num_heads, weights[0]), (num_heads * d, num_kv_heads, weights[1])):
        x = qkv[..., start : start + heads * d].view(batch, t, heads, d).transpose(1, 2)
        if weight is not None:
            x = rms_norm_reference(x, weight, eps)
        outs.append(apply_rope_reference(x, rope.cos, rope.sin))
    return outs


@EXAMPLES
@given(batch=st.integers(1, 2), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 1)]), length=st.integers(1, 9),
       dim=st.sampled_from([16, 24, 64, 128]), dtype=st.sampled_from(DTYPES), norm=st.booleans(),
       gathered=st.booleans(), table_batch_one=st.booleans(), extra=st.integers(0, 2), partial=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_qk_matches_norm_then_rope(batch, heads, length, dim, dtype, norm, gathered, table_batch_one,
                                        extra, partial, seed):
    """q and k of a stacked projection [q heads | k heads | v heads | extra columns], normed per head
    or not, rotated (partial: the first half of each head, as LLaDA2's): equal to the separate
    references, written everywhere, in the projection's layout."""
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    rotated = dim // 2 if partial else dim
    rope = rope_tables(1 if table_batch_one else batch, length, rotated, 1e6, [3, 40], generator, gathered)
    t = rope.cos.shape[2]
    width = (num_heads + 2 * num_kv_heads) * dim + extra * 8
    qkv = torch.randn(batch, t, width, generator=generator).mul(3).to(dtype=dtype, device=DEVICE)
    weights = [(1 + torch.randn(dim, generator=generator)).to(dtype).to(DEVICE) if norm else None for _ in range(2)]
    with mock.patch.object(rope_module, "empty", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype,
                                                                               device=like.device)):
        q, k = rope_qk(qkv, num_heads, num_kv_heads, rope.cos, rope.sin, *weights, 1e-6, head_dim=dim)
    q_ref, k_ref = rope_qk_reference(qkv, num_heads, num_kv_heads, rope, weights, 1e-6, dim)
    ulps = (3 if dtype != torch.float32 else 8) if norm else 1  # the norm's two roundings, then rope's
    for out, ref in ((q, q_ref), (k, k_ref)):
        assert rotated_close(out, ref, ulps, dtype, rotated) if norm else close(out, ref, ulps, dtype)
        assert out.transpose(1, 2).is_contiguous()  # [batch, t, heads, d] in memory


def test_rope_qk_comparison_catches_swapped_weights():
    generator = torch.Generator().manual_seed(3)
    rope = rope_tables(1, 6, 32, 1e4, [0], generator, gathered=False)
    qkv = torch.randn(1, 6, 4 * 32, generator=generator).half().to(DEVICE)
    weights = [torch.linspace(0.5, 1.5, 32).half().to(DEVICE), torch.linspace(2.0, 0.1, 32).half().to(DEVICE)]
    q, k = rope_qk(qkv, 2, 1, rope.cos, rope.sin, *weights, 1e-6)
    q_ref, k_ref = rope_qk_reference(qkv, 2, 1, rope, weights, 1e-6)
    assert close(q, q_ref, 3, torch.float16) and close(k, k_ref, 3, torch.float16)
    q_bad, _ = rope_qk_reference(qkv, 2, 1, rope, weights[::-1], 1e-6)
    assert not close(q, q_bad, 3, torch.float16)


def test_rope_qk_refuses_bad_inputs():
    rope = Rope(torch.arange(4)[None].to(DEVICE), 8, 10000.0)
    qkv = torch.randn(1, 4, 4 * 8).half().to(DEVICE)
    weight = torch.ones(8).half().to(DEVICE)
    with pytest.raises(ValueError, match="narrower than"):
        rope_qk(qkv, 4, 2, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        rope_qk(qkv, 2, 1, rope.cos, rope.sin, weight, None, 1e-6)
    with pytest.raises(ValueError, match="q_weight must be a contiguous"):
        rope_qk(qkv, 2, 1, rope.cos, rope.sin, weight.float(), weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rope_qk(torch.randn(1, 4, 64).half().to(DEVICE)[..., ::2], 2, 1, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="cos must be"):
        rope_qk(qkv[:, :3], 2, 1, rope.cos, rope.sin)


@EXAMPLES
@given(shape=st.sampled_from([(1,), (3,), (2, 5), (1, 7, 3)]), width=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_silu_mul_matches_reference(shape, width, dtype, strided, seed):
    """silu(gate) * up over [..., gate | up]; rows read through their stride (a wider buffer's columns).
    exp and the division may differ from torch's in the last fp32 bits; rounded twice (silu, then the
    product) that is up to 2 units in the last place of a half type. Float32 keeps the whole error: the
    GPU's exp scales its argument by log2(e) before a base-2 exp, an error that grows with |gate|
    (7 units at |gate| ~ 16 compiled on a GPU), so float32 allows 16."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(*shape, 2 * width + (5 if strided else 0), generator=generator).mul(4)
    gate_up = source.to(dtype=dtype, device=DEVICE)[..., : 2 * width]
    with nan_outputs():
        out = silu_mul(gate_up)
    assert out.is_contiguous() and close(out, silu_mul_reference(gate_up), 16 if dtype == torch.float32 else 2, dtype)


def test_silu_mul_comparison_catches_swapped_halves():
    gate_up = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).mul(3).half().to(DEVICE)
    out = silu_mul(gate_up)
    assert close(out, silu_mul_reference(gate_up), 2, torch.float16)
    assert not close(out, silu_mul_reference(gate_up.roll(32, dims=-1)), 2, torch.float16)


def test_silu_mul_refuses_bad_inputs():
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        silu_mul(torch.randn(3, 5).half().to(DEVICE))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        silu_mul(torch.randn(3, 4, dtype=torch.float64).to(DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.randn(3, 8).half().to(DEVICE)[:, ::2])


@EXAMPLES
@given(rows=st.integers(1, 40), dim=st.sampled_from(DIMS), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["rows", "batch_time", "heads", "strided"]), seed=st.integers(0, 2**16))
def test_rms_norm_with_add_normalises_the_sum_it_writes(rows, dim, dtype, layout, seed):
    """With add, what is normalised is the sum rounded to x's dtype, the value written back into x (as
    torch's in-place add, then the norm): the result equals rms_norm of the written x bit for bit, the
    same pass over the same values. Normalising the unrounded fp32 sum misses by an ulp here and there."""
    generator = torch.Generator().manual_seed(seed)
    x = leading_view(layout, rows, dim, dtype, generator)
    add = leading_view("rows", rows, dim, dtype, generator).reshape(x.shape)
    weight = (1 + torch.randn(dim, generator=generator)).to(dtype).to(DEVICE)
    out = rms_norm(x, weight, 1e-6, add)
    assert torch.equal(out, rms_norm(x, weight, 1e-6))


def test_silu_mul_rounds_silu_before_the_product_as_torch():
    """silu(gate) is rounded to the activation dtype before the product with up, as F.silu(gate) * up
    rounds it: in 16 bits the result equals torch's but where exp's last fp32 bit moves a rounding (rare,
    the module docstring); a product of the unrounded silu, rounded once, differs in many elements."""
    generator = torch.Generator().manual_seed(6)
    for dtype in (dtype for dtype in DTYPES if dtype != torch.float32):
        gate_up = torch.randn(64, 512, generator=generator).mul(4).to(dtype=dtype, device=DEVICE)
        out = silu_mul(gate_up)
        assert int((out != silu_mul_reference(gate_up)).sum()) <= 1 + out.numel() // 100


@EXAMPLES
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), length=st.integers(1, 6), dim=st.sampled_from(DIMS),
       dtype=st.sampled_from(DTYPES), table_batch_one=st.booleans(), partial=st.booleans(),
       seed=st.integers(0, 2**16))
def test_each_half_of_the_tables_rotates_its_own_half(batch, heads, length, dim, dtype, table_batch_one, partial,
                                                      seed):
    """out[:r/2] takes cos[:r/2] and sin[:r/2], out[r/2:] takes cos[r/2:] and sin[r/2:] (the module
    docstring's formula). Rope's tables repeat their first half, which would hide one half's columns
    read for the other: here random tables whose halves differ, in apply_rope and rope_qk, equal the
    references."""
    generator = torch.Generator().manual_seed(seed)
    rotated = dim // 4 * 2 if partial else dim
    cos, sin = (torch.randn(1 if table_batch_one else batch, 1, length, rotated, generator=generator).to(DEVICE)
                for _ in range(2))
    make = lambda *shape: torch.randn(*shape, generator=generator).mul(3).to(dtype=dtype, device=DEVICE)
    x = make(batch, heads, length, dim)
    with nan_outputs():
        out = apply_rope(x, cos, sin)
    assert rope_close(out, apply_rope_reference(x, cos, sin))
    qkv = make(batch, length, (heads + 2) * dim)  # heads q heads, one k head, one v head
    q, k = rope_qk(qkv, heads, 1, cos, sin, head_dim=dim)
    tables = mock.Mock(cos=cos, sin=sin)
    q_ref, k_ref = rope_qk_reference(qkv, heads, 1, tables, [None, None], 1e-6, dim)
    assert close(q, q_ref, 1, dtype) and close(k, k_ref, 1, dtype)
