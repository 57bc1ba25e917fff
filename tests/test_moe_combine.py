"""kernels/moe_combine.py (each token's k expert rows, sorted by expert, weighted and summed) against
the torch form it replaces: an un-permute and MoE.combine's fp32 sum. Off a GPU in Triton's
interpreter; bfloat16 is drawn on a GPU only (the interpreter's bf16 is wrong)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanodllm.kernels.moe_combine import BLOCK, moe_combine, moe_combine_reference
from tests.device import DEVICE

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def case(tokens, k, width, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens * k, width, generator=generator).to(dtype=dtype, device=DEVICE)
    order = torch.randperm(tokens * k, generator=generator).to(DEVICE)
    weights = torch.rand(tokens, k, generator=generator).to(DEVICE)
    return rows, order, weights


@given(tokens=st.integers(1, 6), k=st.sampled_from([1, 2, 8]), width=st.sampled_from([1, 33, BLOCK, BLOCK + 70]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999))
def test_moe_combine_matches_the_torch_form(tokens, k, width, dtype, seed):
    rows, order, weights = case(tokens, k, width, dtype, seed)
    out, expected = moe_combine(rows, order, weights), moe_combine_reference(rows, order, weights)
    assert out.shape == (tokens, width) and out.dtype == dtype
    # The sums differ only in fp32 addition order: a few fp32 ulps of the products, then one cast.
    products = rows.float().abs().max() * weights.max()
    torch.testing.assert_close(out.float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=k * 2**-22 * float(products))


def test_moe_combine_reads_each_pair_through_the_inverse_of_order():
    """Exact values: token t's slot j row holds t * 10 + j, weights one-hot on slot 1."""
    tokens, k = 3, 4
    order = torch.tensor([5, 0, 11, 7, 2, 9, 1, 4, 10, 3, 8, 6], device=DEVICE)
    rows = (order // k * 10 + order % k).to(torch.float32)[:, None].expand(-1, 5).contiguous()
    weights = torch.zeros(tokens, k, device=DEVICE)
    weights[:, 1] = 1.0
    expected = torch.tensor([1.0, 11.0, 21.0], device=DEVICE)[:, None].expand(-1, 5)
    torch.testing.assert_close(moe_combine(rows, order, weights), expected, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (lambda r, o, w: (r, o, w.double()), "weights float32"),
    (lambda r, o, w: (r[:-1], o[:-1], w), "need rows"),
    (lambda r, o, w: (r.t().contiguous().t(), o, w), "contiguous"),
    (lambda r, o, w: (r, o.int(), w), "order int64"),
])
def test_moe_combine_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        moe_combine(*change(*case(2, 2, 8, torch.float32, 0)))
