"""kernels/expert_linear.py (each expert's linear layer over its grouped rows, optionally SwiGLU) against
one F.linear per expert. Both are held against the float64 result: the kernel must come as close as the
per-expert torch path does in the same dtype (tests/test_norm_linear.py's bound). Groups are drawn
empty, of one row and longer than a tile; rows past the last group (another rank's experts) must stay
unwritten: outputs are allocated NaN-filled. Off the GPU the kernel runs in Triton's interpreter
(float16 and float32, whose dots it computes correctly)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels.expert_linear import expert_linear, expert_linear_reference  # noqa: E402
from tests.device import DEVICE  # noqa: E402
from tests.test_norm_linear import nan_empty, within  # noqa: E402

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def inputs(sizes, trailing, dim, width, dtype, swiglu, seed):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)
    x = make(sum(sizes) + trailing, dim)
    weight = make(len(sizes), 2 * width if swiglu else width, dim, scale=dim**-0.5)
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    return x, weight, ends


def errors(out, x, weight, ends, swiglu):
    """max |out - float64 result| over the grouped rows and the per-expert torch path's, in x's dtype."""
    written = int(ends[-1])
    exact = expert_linear_reference(x.double(), weight.double(), ends, swiglu)[:written]
    torch_path = expert_linear_reference(x, weight, ends, swiglu)[:written]
    return ((out[:written].double() - exact).abs().max().item(), (torch_path.double() - exact).abs().max().item(),
            exact)


@settings(deadline=None, max_examples=20)
@given(sizes=st.lists(st.sampled_from([0, 0, 1, 2, 3, 17, 35]), min_size=1, max_size=5).filter(any),
       trailing=st.integers(0, 3), dim=st.sampled_from([16, 40, 200]), width=st.sampled_from([8, 24, 100, 130]),
       dtype=st.sampled_from(DTYPES), swiglu=st.booleans(), seed=st.integers(0, 2**16))
def test_expert_linear_comes_as_close_as_one_linear_per_expert(sizes, trailing, dim, width, dtype, swiglu, seed):
    x, weight, ends = inputs(sizes, trailing, dim, width, dtype, swiglu, seed)
    with nan_empty():
        out = expert_linear(x, weight, ends, swiglu)
    assert out.shape == (len(x), width) and out.dtype == dtype
    assert out[int(ends[-1]):].isnan().all(), "rows past the last group are left unwritten"
    out_error, torch_error, exact = errors(out, x, weight, ends, swiglu)
    assert within(out_error, torch_error, exact, dtype, dim), (out_error, torch_error)


@pytest.mark.parametrize("mistake", ["neighbour's weights", "halves"])
def test_the_comparison_catches_a_wrong_expert_or_formula(mistake):
    """The bound above fails rows sent through the next expert, or gate and up swapped."""
    x, weight, ends = inputs([3, 17, 2], 0, 40, 24, torch.float16, True, 5)
    wrong = weight.roll(1, dims=0) if mistake == "neighbour's weights" else torch.cat(weight.chunk(2, dim=1)[::-1], 1)
    out_error, torch_error, exact = errors(expert_linear(x, wrong, ends, True), x, weight, ends, True)
    assert not within(out_error, torch_error, exact, torch.float16, 40)


def test_bad_inputs_are_refused():
    x, weight, ends = inputs([2, 3], 0, 16, 8, torch.float16, False, 0)
    cases = [
        ((x, weight[:, :, :8], ends), "weight \\[E, N, K\\]"),
        ((x, weight, ends[:1]), "group_ends \\[E\\]"),
        ((x.float(), weight, ends), "share one of"),
        ((x, weight, ends.long()), "int32"),
        ((x, weight[:, :7], ends, True), "even N"),
        ((x.t().contiguous().t(), weight, ends), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            expert_linear(*args)
