"""kernels/salient_rows.py against its torch reference (the cosines, a stable sort): DyLLM's fixed-size
salient sets, the same rows, ok flags, mask and slot map, ties to the lower row, padded rows last."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.kernels.salient_rows import salient_rows, salient_rows_reference
from tests.device import DEVICE


def draw_stats(batch, rows, values, seed):
    """Per-row (new . old, new . new, old . old): distinct cosines, a few repeated ones (ties), or
    contexts that did not move at all (cos exactly 1) next to some that did."""
    generator = torch.Generator().manual_seed(seed)
    new, old = (torch.randn(batch, rows, 8, generator=generator) for _ in range(2))
    if values == "ties":
        pattern = torch.randn(3, 8, generator=generator)
        new = pattern[torch.randint(0, 3, (batch, rows), generator=generator)]
        old = pattern[torch.zeros(batch, rows, dtype=torch.long)]
    elif values == "unmoved":
        old = torch.where(torch.rand(batch, rows, 1, generator=generator) < 0.7, new, old)
    stats = torch.stack([(new * old).sum(-1), (new * new).sum(-1), (old * old).sum(-1)], dim=-1)
    return stats.to(DEVICE)


def draw_valid(batch, rows, pads):
    """Left padding as the masked engine lays out a ragged batch: pads[b] leading rows not real."""
    return (torch.arange(rows)[None, :] >= torch.tensor(pads)[:, None]).to(DEVICE)


@settings(deadline=None)
@given(batch=st.integers(1, 3), rows=st.integers(1, 300), values=st.sampled_from(["distinct", "ties", "unmoved"]),
       fraction=st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0]), capped=st.booleans(),
       data=st.data(), seed=st.integers(0, 2**16))
def test_salient_rows_match_the_reference(batch, rows, values, fraction, capped, data, seed):
    stats = draw_stats(batch, rows, values, seed)
    valid = draw_valid(batch, rows, data.draw(st.lists(st.integers(0, rows), min_size=batch, max_size=batch)))
    tau = 0.9 if capped else None
    got = salient_rows(stats, valid, fraction, tau)
    want = salient_rows_reference(stats, valid, fraction, tau)
    for name, g, w in zip(("mask", "rows", "ok", "slots"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


def test_unmoved_contexts_tie_at_a_cosine_of_exactly_one():
    """A context that did not move has cosine s / sqrt(s * s), exactly 1 when rounded correctly (torch's
    float32 sqrt on some CPUs is an ulp off): its ties go to the lower row in both forms. Seed 175's 25
    rows hold such ties where the two once differed."""
    stats, valid = draw_stats(1, 25, "unmoved", 175), draw_valid(1, 25, [0])
    for got, want in zip(salient_rows(stats, valid, 0.7), salient_rows_reference(stats, valid, 0.7), strict=True):
        assert torch.equal(got, want)

def test_comparison_catches_a_wrong_selection():
    """The lowest cosines, not the highest; each sequence's own count; the cap's tau."""
    stats = draw_stats(2, 40, "distinct", 0)
    valid = draw_valid(2, 40, [0, 15])
    mask, rows, ok, slots = salient_rows(stats, valid, 0.25)
    assert torch.equal(rows, salient_rows_reference(stats, valid, 0.25)[1])
    flipped = stats * torch.tensor([-1.0, 1.0, 1.0], device=DEVICE)  # every cosine negated
    assert not torch.equal(rows, salient_rows_reference(flipped, valid, 0.25)[1])
    assert ok.sum(dim=1).tolist() == [10, 7]  # ceil(40 / 4), ceil(25 / 4): the padded sequence's own count
    assert torch.equal(mask.sum(dim=1), ok.sum(dim=1))
    assert torch.equal(slots >= 0, mask)  # the slot map marks the ok rows, with their places in the list
    assert torch.equal(slots.gather(1, rows), torch.where(ok, torch.arange(10, device=DEVICE).int(), -1))
    assert not torch.equal(salient_rows(stats, valid, 0.25, tau=-2.0)[2], ok)  # no cosine is below -2


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.7])
def test_own_counts_round_as_float64(fraction):
    """Each sequence keeps ceil(v * fraction) rows, v its real rows, with the product in float64 as
    Python and the reference compute it (10 * 0.1 is 1.0 there; in float32, 1.0000000149)."""
    rows = 64
    stats = draw_stats(rows, rows, "distinct", 1)
    valid = draw_valid(rows, rows, list(range(rows)))  # sequence b has rows - b real rows
    _, _, ok, _ = salient_rows(stats, valid, fraction)
    assert ok.sum(dim=1).tolist() == [math.ceil((rows - b) * fraction) for b in range(rows)]


def test_bad_inputs_are_named():
    stats = torch.rand(1, 5, 3, device=DEVICE)
    valid = torch.ones(1, 5, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="stats must be"):
        salient_rows(stats.double(), valid, 0.5)
    with pytest.raises(ValueError, match="valid must be"):
        salient_rows(stats, valid[:, :4], 0.5)
    with pytest.raises(ValueError, match="fraction must be"):
        salient_rows(stats, valid, 1.5)
    with pytest.raises(ValueError, match="at most 4096 rows"):
        salient_rows(torch.rand(1, 4097, 3, device=DEVICE), torch.ones(1, 4097, dtype=torch.bool, device=DEVICE), 0.5)


def test_a_cosine_equal_to_tau_is_not_under_the_cap():
    """With tau a listed row is ok only if cos < tau, strictly: cosines 0.5, 0.25 and 0.75 (exact: s0 / sqrt(1 * 1))
    under tau 0.5 leave only the 0.25 row ok, as in the reference."""
    stats = torch.tensor([[[0.5, 1.0, 1.0], [0.25, 1.0, 1.0], [0.75, 1.0, 1.0]]], device=DEVICE)
    valid = draw_valid(1, 3, [0])
    got, want = salient_rows(stats, valid, 1.0, tau=0.5), salient_rows_reference(stats, valid, 1.0, tau=0.5)
    assert got[0].tolist() == [[False, True, False]]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_context_of_zeros_has_a_cosine_of_zero():
    """cos = s0 / max(sqrt(s1 * s2), 1e-30): a row whose new or old context is all zeros (a product of 0) has
    cosine 0, not 0 / 0; it ranks among the others as a 0 and passes a cap above 0, as in the reference."""
    stats = draw_stats(2, 12, "distinct", 3)
    stats[:, 2] = 0.0  # both contexts zero
    stats[:, 7] = torch.tensor([0.0, 2.0, 0.0], device=DEVICE)  # the old context zero
    stats[1, 4] = torch.tensor([0.0, 0.0, 3.0], device=DEVICE)  # the new context zero
    valid = draw_valid(2, 12, [0, 1])
    for fraction, tau in ((1.0, 0.5), (0.5, None), (0.25, 0.9), (0.75, 0.1)):
        got, want = salient_rows(stats, valid, fraction, tau), salient_rows_reference(stats, valid, fraction, tau)
        for name, g, w in zip(("mask", "rows", "ok", "slots"), got, want, strict=True):
            assert torch.equal(g, w), (name, fraction, tau)
    assert salient_rows(stats, valid, 1.0, 0.5)[0][:, [2, 7]].tolist() == [[True, True], [True, True]]
