"""kernels/top_k.py against a stable sort: exact top-k positions, ascending, ties to the lower position.

Off the GPU the kernel runs in Triton's interpreter with 64-entry chunks, so small rows still span
several chunks (the cross-chunk prefix sums and the atomics of the histograms are exercised).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels.top_k import top_k_positions, top_k_positions_reference  # noqa: E402
from nanodllm.methods.common import select_top_k  # noqa: E402
from tests.device import DEVICE



def draw_scores(batch, heads, n, values, seed, dtype):
    """Scores of one of four kinds: distinct floats of both signs, distinct negative floats (whose bits
    order the other way round), few distinct values (many ties at the threshold), or values differing
    only in the low bits (the later radix passes decide)."""
    generator = torch.Generator().manual_seed(seed)
    if values == "distinct":
        scores = torch.randn(batch, heads, n, generator=generator) * 10
    elif values == "negative":
        scores = -(torch.rand(batch, heads, n, generator=generator) * 10 + 1e-3)
    elif values == "ties":
        scores = torch.randint(-2, 3, (batch, heads, n), generator=generator).float() * 0.5
    else:
        scores = 1.0 + torch.randint(0, 64, (batch, heads, n), generator=generator).float() * 2**-20
    return scores.to(dtype=dtype, device=DEVICE)


@settings(deadline=None, derandomize=True, max_examples=50)  # cheap: many examples, the same ones every run
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), n=st.integers(1, 300), k=st.integers(1, 320),
       values=st.sampled_from(["distinct", "negative", "ties", "low_bits"]),
       dtype=st.sampled_from([torch.float32, torch.float16]),
       chunk=st.sampled_from([None, 32, 128]), whole_row=st.booleans(), data=st.data(), seed=st.integers(0, 2**16))
def test_top_k_positions_match_a_stable_sort(batch, heads, n, k, values, dtype, chunk, whole_row, data, seed):
    """Both routes: chunks across programs, and one program per row."""
    scores = draw_scores(batch, heads, n, values, seed, dtype)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=batch, max_size=batch)), device=DEVICE)
    indices, counts = top_k_positions(scores, lengths, k, chunk=chunk, whole_row=whole_row)
    expected_indices, expected_counts = top_k_positions_reference(scores, lengths, k)
    assert indices.dtype == torch.int32 and counts.dtype == torch.int32
    assert torch.equal(counts, expected_counts)
    assert torch.equal(indices, expected_indices)


@pytest.mark.parametrize("whole_row", [False, True])
def test_comparison_catches_a_wrong_selection(whole_row):
    scores = draw_scores(1, 2, 200, "distinct", 0, torch.float32)
    lengths = torch.tensor([150], device=DEVICE)
    indices, _ = top_k_positions(scores, lengths, 20, whole_row=whole_row)
    assert torch.equal(indices, top_k_positions_reference(scores, lengths, 20)[0])
    assert not torch.equal(indices, top_k_positions_reference(-scores, lengths, 20)[0])  # the lowest instead
    cut = lengths.clone().fill_(int(indices[0, 0, -1]))  # a row one selected position short
    assert not torch.equal(indices, top_k_positions_reference(scores, cut, 20)[0])


def test_select_top_k_on_the_kernel_equals_torch():
    """The methods' select_top_k takes the kernel where asked; same sets as its torch form."""
    scores = draw_scores(2, 4, 500, "distinct", 3, torch.float32).abs()
    lengths = torch.tensor([500, 321], device=DEVICE)
    torch_result = select_top_k(scores, lengths, 100, on_kernels=False)
    kernel_result = select_top_k(scores, lengths, 100, on_kernels=True)
    for got, want in zip(kernel_result, torch_result):
        assert torch.equal(got, want)


def test_bad_inputs_are_named():
    scores = torch.rand(1, 2, 10, device=DEVICE)
    lengths = torch.tensor([10], device=DEVICE)
    with pytest.raises(ValueError, match="k must be at least 1"):
        top_k_positions(scores, lengths, 0)
    with pytest.raises(ValueError, match="lengths must be"):
        top_k_positions(scores, lengths.float(), 3)
    with pytest.raises(ValueError, match=r"\[batch, heads, n\]"):
        top_k_positions(scores[0], lengths, 3)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        top_k_positions(scores.double(), lengths, 3)


@pytest.mark.parametrize("whole_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_k_best_of_negative_scores_are_those_nearest_zero(whole_row, dtype):
    """Two positive scores and -1 .. -198, shuffled: the 10 best are 2, 0.5 and -1 .. -8, so the
    selection's threshold falls among the negative scores, whose bits order the other way round."""
    generator = torch.Generator().manual_seed(7)
    values = torch.cat([torch.tensor([2.0, 0.5]), -torch.arange(1.0, 199.0)])
    order = torch.randperm(200, generator=generator)
    scores = values[order].to(dtype=dtype, device=DEVICE).view(1, 1, 200)
    indices, counts = top_k_positions(scores, torch.tensor([200], device=DEVICE), 10, whole_row=whole_row)
    assert counts.tolist() == [[10]]
    assert sorted(values[order][indices[0, 0].long().cpu()].tolist()) == [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0,
                                                                          -1.0, 0.5, 2.0]


@pytest.mark.parametrize("whole_row", [False, True])
def test_lengths_past_the_row_count_as_the_whole_row(whole_row):
    """A length past n counts as n: only the row's own n entries compete, not what lies after them in
    memory (here rows of a wider buffer whose last columns hold higher scores)."""
    wide = draw_scores(2, 3, 64, "distinct", 5, torch.float32)
    wide[..., 40:] = 1e4  # past each row's n = 40 entries
    scores = wide[..., :40]
    lengths = torch.tensor([50, 64], device=DEVICE)
    indices, counts = top_k_positions(scores, lengths, 8, whole_row=whole_row)
    expected_indices, expected_counts = top_k_positions_reference(scores, torch.full_like(lengths, 40), 8)
    assert torch.equal(counts, expected_counts) and torch.equal(indices, expected_indices)
