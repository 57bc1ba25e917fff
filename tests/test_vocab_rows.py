"""kernels/vocab_rows.py (DiffusionGemma's softcapped head and self-conditioning softmax) against their torch
forms: the softcap within float32 ulps of torch's tanh (the kernel's is built from exp(-2|x|)), the probabilities
to float32 rounding then the cast. Rows are drawn wider and narrower than a tile, from flat to sharp, with
logits past the cap. Off the GPU the kernels run in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels.vocab_rows import (BLOCK, soft_probs, soft_probs_reference, softcap,  # noqa: E402
                                          softcap_reference)
from tests.device import DEVICE  # noqa: E402

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
WIDTHS = [1, 7, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK + 17]


def rows_of(rows, width, sharpness, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator) * sharpness).to(dtype).to(DEVICE)


@settings(deadline=None, max_examples=20)
@given(rows=st.integers(1, 3), width=st.sampled_from(WIDTHS), sharpness=st.sampled_from([0.01, 3.0, 80.0]),
       cap=st.sampled_from([30.0, 7.5]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_softcap_equals_the_torch_form(rows, width, sharpness, cap, dtype, seed):
    logits = rows_of(rows, width, sharpness, seed, dtype)
    capped = softcap(logits, cap)
    assert capped.dtype == torch.float32 and capped.shape == logits.shape
    torch.testing.assert_close(capped, softcap_reference(logits, cap), rtol=2e-6, atol=cap * 3e-7)


@settings(deadline=None, max_examples=20)
@given(rows=st.integers(1, 3), width=st.sampled_from(WIDTHS), sharpness=st.sampled_from([0.1, 3.0, 60.0]),
       dtype=st.sampled_from(DTYPES), out=st.sampled_from([torch.float16, torch.float32]), seed=st.integers(0, 2**16))
def test_soft_probs_equal_the_torch_form(rows, width, sharpness, dtype, out, seed):
    z = rows_of(rows, width, sharpness, seed, dtype)
    probs = soft_probs(z, out)
    assert probs.dtype == out and probs.shape == z.shape
    reference = z.double().softmax(dim=-1)
    tolerance = dict(rtol=2e-5, atol=1e-8) if out == torch.float32 else dict(rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(probs.double(), reference, **tolerance)
    torch.testing.assert_close(probs, soft_probs_reference(z, out), **tolerance)


def test_leading_dims_and_strides():
    z = rows_of(6, 600, 2.0, 0, torch.float32).view(2, 3, 600)[..., ::2]  # every other column: not contiguous
    torch.testing.assert_close(soft_probs(z, torch.float32), soft_probs_reference(z, torch.float32))
    torch.testing.assert_close(softcap(z, 30.0), softcap_reference(z, 30.0), rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda: softcap(torch.zeros(2, 0), 30.0), "logits must be a [..., V] float tensor"),
    (lambda: softcap(torch.zeros(2, 3, dtype=torch.long), 30.0), "logits must be a [..., V] float tensor"),
    (lambda: softcap(torch.zeros(2, 3), 0.0), "the softcap must be positive"),
    (lambda: soft_probs(torch.tensor(1.0), torch.float32), "z must be a [..., V] float tensor"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        call()


@pytest.mark.parametrize("width", [1, BLOCK + 5])
def test_soft_probs_of_logits_far_below_zero(width):
    """softmax is the same for logits shifted by a constant: rows around -200 (where exp underflows in float32)
    give the probabilities torch gives them, a one-column row exactly 1."""
    z = rows_of(2, width, 3.0, 0, torch.float32) - 200.0
    probs = soft_probs(z, torch.float32)
    torch.testing.assert_close(probs.double(), z.double().softmax(dim=-1), rtol=2e-5, atol=1e-8)
    if width == 1:
        assert probs.tolist() == [[1.0], [1.0]]
