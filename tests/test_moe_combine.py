"""kernels/moe_combine.py (each token's k expert rows, sorted by expert, weighted and summed) against
the torch form it replaces: an un-permute and MoE.combine's fp32 sum; rows past a rank's groups count as
zeros. Off a GPU in Triton's interpreter; bfloat16 is drawn on a GPU only (the interpreter's bf16 is wrong)."""

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
    slot_of = torch.randperm(tokens * k, generator=generator).to(DEVICE)
    weights = torch.rand(tokens, k, generator=generator).to(DEVICE)
    return rows, slot_of, weights


@given(tokens=st.integers(1, 6), k=st.sampled_from([1, 2, 8]), width=st.sampled_from([1, 33, BLOCK, BLOCK + 70]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999), written=st.none() | st.integers(0, 48))
def test_moe_combine_matches_the_torch_form(tokens, k, width, dtype, seed, written):
    rows, slot_of, weights = case(tokens, k, width, dtype, seed)
    rows_end = None if written is None else torch.tensor([min(written, len(rows))], dtype=torch.int32, device=DEVICE)
    if rows_end is not None:
        rows[int(rows_end):] = float("nan")  # unwritten rows: never read
    out = moe_combine(rows, slot_of, weights, rows_end)
    expected = moe_combine_reference(rows, slot_of, weights, rows_end)
    assert out.shape == (tokens, width) and out.dtype == dtype
    # The sums differ only in fp32 addition order: a few fp32 ulps of the products, then one cast.
    products = rows.float().nan_to_num().abs().max() * weights.max()
    torch.testing.assert_close(out.float(), expected.float(), rtol=torch.finfo(dtype).eps,
                               atol=k * 2**-22 * float(products))


def test_moe_combine_reads_each_pair_through_the_inverse_of_order():
    """Exact values: token t's slot j row holds t * 10 + j, weights one-hot on slot 1; from row 6 on
    (rows_end) the rows count as zeros."""
    tokens, k = 3, 4
    order = torch.tensor([5, 0, 11, 7, 2, 9, 1, 4, 10, 3, 8, 6], device=DEVICE)
    slot_of = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=DEVICE))
    rows = (order // k * 10 + order % k).to(torch.float32)[:, None].expand(-1, 5).contiguous()
    weights = torch.zeros(tokens, k, device=DEVICE)
    weights[:, 1] = 1.0
    expected = torch.tensor([1.0, 11.0, 21.0], device=DEVICE)[:, None].expand(-1, 5)
    torch.testing.assert_close(moe_combine(rows, slot_of, weights), expected, rtol=0, atol=0)
    rows_end = torch.tensor([6], dtype=torch.int32, device=DEVICE)  # pair 1 (token 0, slot 1) lies in row 6
    torch.testing.assert_close(moe_combine(rows, slot_of, weights, rows_end), expected * torch.tensor(
        [0.0, 1.0, 1.0], device=DEVICE)[:, None], rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (lambda r, o, w: (r, o, w.double()), "weights float32"),
    (lambda r, o, w: (r[:-1], o[:-1], w), "need rows"),
    (lambda r, o, w: (r.t().contiguous().t(), o, w), "contiguous"),
    (lambda r, o, w: (r, o.int(), w), "slot_of int64"),
    (lambda r, o, w: (r, o, w, torch.tensor([2])), "rows_end must be one int32"),
])
def test_moe_combine_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        moe_combine(*change(*case(2, 2, 8, torch.float32, 0)))
