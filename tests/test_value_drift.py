"""kernels/value_drift.py against its torch references (interpreter on the CPU): the drift of each
row's values with the cache overwritten, and the most drifted rows with ties broken to the lower row."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nanodllm.kernels.value_drift as vd
from nanodllm.kernels.value_drift import most_drifted, most_drifted_reference, value_drift, value_drift_reference
from tests.device import DEVICE


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(vd, "DEBUG_POISON", True)


def values(batch, heads, rows, head_dim, dtype, layout, generator):
    """[batch, heads, rows, head_dim] laid out as a projection gives it (token-major, a transposed
    view) or as a head-major cache's slice past some prompt slots."""
    if layout == "token_major":
        x = torch.randn(batch, rows, heads, head_dim, generator=generator).to(dtype).to(DEVICE)
        return x.transpose(1, 2)
    x = torch.randn(batch, heads, rows + 3, head_dim, generator=generator).to(dtype).to(DEVICE)
    return x[:, :, 3:]


@given(batch=st.integers(1, 3), heads=st.integers(1, 6), rows=st.integers(1, 40),
       head_dim=st.sampled_from([16, 24, 64]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       layouts=st.tuples(*[st.sampled_from(["token_major", "cache_slice"])] * 2),
       same_rows=st.integers(0, 40), tile=st.sampled_from([64, 4096]), seed=st.integers(0, 2**16))
@example(batch=2, heads=5, rows=7, head_dim=24, dtype=torch.float16, layouts=("token_major", "cache_slice"),
         same_rows=2, tile=64, seed=0)  # chunks of 2 heads: two full, one partial
def test_value_drift_matches_reference(batch, heads, rows, head_dim, dtype, layouts, same_rows, tile, seed):
    generator = torch.Generator().manual_seed(seed)
    new = values(batch, heads, rows, head_dim, dtype, layouts[0], generator)
    cached = values(batch, heads, rows, head_dim, dtype, layouts[1], generator)
    cached[:, :, :same_rows] = new[:, :, :same_rows]  # unchanged rows: drift 0
    cached_reference = cached.clone()
    default_tile, vd.TILE_ELEMENTS = vd.TILE_ELEMENTS, tile  # 64: the heads in several (partial) chunks
    try:
        drift = value_drift(new, cached)
    finally:
        vd.TILE_ELEMENTS = default_tile
    expected = value_drift_reference(new, cached_reference)
    torch.testing.assert_close(drift, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cached, new) and torch.equal(cached_reference, new)


@given(batch=st.integers(1, 3), rows=st.integers(1, 300), levels=st.sampled_from([2, 5, 1000]),
       count_fraction=st.floats(0, 1), nan_fraction=st.sampled_from([0.0, 0.0, 0.1, 0.5]), seed=st.integers(0, 2**16))
@example(batch=1, rows=4, levels=5, count_fraction=0.75, nan_fraction=0.5, seed=3)
def test_most_drifted_matches_stable_sort(batch, rows, levels, count_fraction, nan_fraction, seed):
    """Few distinct levels make many ties, which must go to the lower row; NaN drifts (from values
    that were not finite) rank above every number, as in torch.sort."""
    generator = torch.Generator().manual_seed(seed)
    drift = torch.randint(0, levels, (batch, rows), generator=generator).float() / levels
    drift[torch.rand(batch, rows, generator=generator) < nan_fraction] = float("nan")
    drift = drift.to(DEVICE)
    count = round(count_fraction * rows)
    assert torch.equal(most_drifted(drift, count), most_drifted_reference(drift, count))


def test_a_row_of_zeros_drifts_by_one_as_torch_clamps_its_norm():
    """cosine_similarity clamps each norm at eps, so a zero vector (new, cached or both) has cosine 0:
    drift 1, not 0 / 0."""
    generator = torch.Generator().manual_seed(0)
    new = torch.randn(2, 3, 5, 16, generator=generator).to(DEVICE)
    cached = torch.randn(2, 3, 5, 16, generator=generator).to(DEVICE)
    new[:, :, 0] = 0.0
    cached[:, :, 1] = 0.0
    new[:, :, 2] = cached[:, :, 2] = 0.0
    expected = value_drift_reference(new, cached.clone())
    drift = value_drift(new, cached)
    torch.testing.assert_close(drift, expected, atol=1e-5, rtol=1e-5)
    assert drift[:, :3].tolist() == [[1.0] * 3] * 2


def test_drifts_just_below_zero_rank_as_the_sort_places_them():
    """1 - cos is a little negative where the cosine rounds above 1: such rows rank below every positive
    drift and by row among equals, also in a last tile of rows only partly filled."""
    generator = torch.Generator().manual_seed(1)
    drift = (torch.randint(-2, 3, (2, 50), generator=generator).float() * 6e-8).to(DEVICE)
    for count in (10, 50):
        assert torch.equal(most_drifted(drift, count), most_drifted_reference(drift, count))


def test_most_drifted_of_a_strided_view():
    drift = torch.rand(2, 50, generator=torch.Generator().manual_seed(0)).to(DEVICE)[:, ::2]
    assert torch.equal(most_drifted(drift, 7), most_drifted_reference(drift, 7))


@pytest.mark.parametrize("function", [value_drift, value_drift_reference])
def test_value_drift_rejects_mismatched_inputs(function):
    new = torch.zeros(1, 2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        function(new, torch.zeros(1, 2, 4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="share dtype"):
        function(new, new.half())


@pytest.mark.parametrize("function", [most_drifted, most_drifted_reference])
def test_most_drifted_rejects_bad_counts(function):
    drift = torch.zeros(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="count must lie"):
        function(drift, 6)
    with pytest.raises(ValueError, match="float32"):
        function(drift.double(), 2)
