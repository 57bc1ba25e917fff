"""kernels/softmax_stats.py (DiffusionGemma's sampler statistics of a step's logits, and its draw) against
its torch form: the scaled logits bit for bit (a correctly rounded division, then the cast), the argmax (the
first index at the max); the probabilities and the entropy at least as close to the float64 values as the
torch form's but for float32 sums (so p from z unrounded, an FMA's, fails on a sharp row); the draw
torch.multinomial's of the kernel's probabilities from the same generator state, token for token, and the
deterministic draw their first argmax. Rows are drawn wider and narrower than a tile, with ties at the max,
-inf logits and rows from flat to sharp. Off the GPU the kernel runs in Triton's interpreter (float16 casts:
its bfloat16 cast truncates)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels.softmax_stats import BLOCK, softmax_stats, softmax_stats_reference  # noqa: E402
from tests.device import DEVICE  # noqa: E402

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def logits_of(rows, width, sharpness, seed, ties=False, hidden=False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=generator) * sharpness
    if ties:  # the max twice in every row: the first must win
        top = logits.argmax(dim=-1)
        later = (top + 1 + torch.randint(0, max(width - 1, 1), (rows,), generator=generator)) % width
        logits[torch.arange(rows), later] = logits.max(dim=-1).values
    if hidden:
        logits[torch.rand(rows, width, generator=generator) < 0.3] = float("-inf")
        logits[:, 0] = 1.0  # every row keeps one finite logit
    return logits.to(DEVICE)


@settings(deadline=None, max_examples=25)
@given(rows=st.integers(1, 4), width=st.sampled_from([1, 5, BLOCK - 1, BLOCK, BLOCK + 3, 3 * BLOCK + 17]),
       sharpness=st.sampled_from([0.1, 3.0, 40.0]), temperature=st.sampled_from([0.4, 0.6137, 1.0]),
       ties=st.booleans(), hidden=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_softmax_stats_equal_the_torch_form(rows, width, sharpness, temperature, ties, hidden, dtype, seed):
    logits = logits_of(rows, width, sharpness, seed, ties and width > 1, hidden and width > 1)
    t = torch.tensor(temperature, dtype=torch.float32)
    scaled, argmax, entropy, drawn, probs = softmax_stats(logits, t, dtype, probs=True)
    scaled_ref, argmax_ref, entropy_ref, _, probs_ref = softmax_stats_reference(logits, t, dtype, probs=True)
    assert torch.equal(scaled, scaled_ref)
    assert torch.equal(argmax, argmax_ref)
    exact = torch.distributions.Categorical(logits=logits.double() / t.double()).entropy()
    assert ((entropy - exact).abs() <= (entropy_ref - exact).abs() + 1e-6 + 1e-5 * exact).all()
    exact_p = torch.softmax((logits / t).double(), dim=-1)  # of the float32 z both compute
    assert ((probs - exact_p).abs() <= (probs_ref - exact_p).abs() + 2e-6 * exact_p + 1e-12).all()
    assert torch.equal(drawn, probs.argmax(dim=-1))


@settings(deadline=None, max_examples=20)
@given(rows=st.integers(1, 4), width=st.sampled_from([1, 5, BLOCK - 1, BLOCK + 3, 3 * BLOCK + 17]),
       sharpness=st.sampled_from([0.1, 3.0]), hidden=st.booleans(), seed=st.integers(0, 2**16))
def test_the_draw_is_multinomials(rows, width, sharpness, hidden, seed):
    """sample=True draws what torch.multinomial draws from the kernel's probabilities at the same generator
    state (its one-sample algorithm: argmax p / q, q ~ Exp(1) of p's shape), and leaves the generator where
    multinomial leaves it."""
    logits = logits_of(rows, width, sharpness, seed, hidden=hidden and width > 1).view(rows, 1, width)
    t = torch.tensor(0.6137)
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    stats = softmax_stats(logits, t, torch.float16, sample=True, generator=generator, probs=True)
    after = torch.rand(8, device=DEVICE, generator=generator)
    generator.manual_seed(seed)
    expected = torch.multinomial(stats.probs.view(rows, width), 1, generator=generator).view(rows, 1)
    assert torch.equal(stats.drawn, expected)
    assert torch.equal(after, torch.rand(8, device=DEVICE, generator=generator))
    assert torch.equal(stats.probs, softmax_stats(logits, t, torch.float16, probs=True).probs)


def test_samples_follow_the_probabilities():
    """Over many draws of one row of four tokens each token's share is its probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 4000, device=DEVICE)
    t = torch.tensor(1.0)
    stats = softmax_stats(logits, t, torch.float16, sample=True, generator=torch.Generator(DEVICE).manual_seed(3),
                          probs=True)
    shares = torch.bincount(stats.drawn, minlength=4).float() / len(logits)
    torch.testing.assert_close(shares, stats.probs[0], atol=0.025, rtol=0)


def test_leading_dims_strides_and_no_probs():
    logits = logits_of(6, 600, 2.0, 0).view(2, 3, 600)[..., ::2]  # every other column: not contiguous
    t = torch.tensor(0.7)
    scaled, argmax, entropy, drawn, probs = softmax_stats(logits, t, torch.float16)
    assert probs is None and scaled.shape == (2, 3, 300) and argmax.shape == entropy.shape == drawn.shape == (2, 3)
    assert torch.equal(argmax, logits.argmax(dim=-1)) and torch.equal(drawn, argmax)
    torch.testing.assert_close(entropy, softmax_stats_reference(logits, t, torch.float16)[2], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("logits, temperature, match", [
    (torch.zeros(2, 3, dtype=torch.float16), 1.0, "float32"),
    (torch.zeros(2, 0), 1.0, "V > 0"),
    (torch.zeros(2, 3), 0.0, "positive"),
])
def test_bad_inputs_are_refused(logits, temperature, match):
    with pytest.raises(ValueError, match=match):
        softmax_stats(logits.to(DEVICE), torch.tensor(temperature), torch.bfloat16)
