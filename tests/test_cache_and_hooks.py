"""The KV cache on its own, and the dense method's hooks called on random tensors without a model."""

import torch
from hypothesis import given, strategies as st

from nanodllm.attention import attention
from nanodllm.cache import KVCache
from nanodllm.methods import METHODS, get_method, knob_defaults, parse_knobs
from nanodllm.methods.base import Dense, StepContext

import pytest


def random_cache(lengths, heads=2, dim=8, capacity=40, seed=0, scale=None):
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(1, len(lengths), capacity, heads, dim, "cpu", torch.float64, scale=scale)
    longest = max(lengths)
    k = torch.randn(len(lengths), heads, longest, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(len(lengths), heads, longest, dim, generator=generator, dtype=torch.float64)
    cache.write(0, k, v, torch.tensor(lengths))
    cache.advance(torch.tensor(lengths))
    return cache, k, v


@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4), block=st.integers(1, 6))
def test_ragged_write_view_and_attend_equal_per_row_attention(lengths, block):
    cache, k, v = random_cache(lengths)
    assert cache.host_lengths == lengths and cache.lengths.tolist() == lengths
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(len(lengths), 4, block, 8, generator=generator, dtype=torch.float64)  # GQA 2
    k_new = torch.randn(len(lengths), 2, block, 8, generator=generator, dtype=torch.float64)
    v_new = torch.randn(len(lengths), 2, block, 8, generator=generator, dtype=torch.float64)
    out = cache.attend(0, q, k_new, v_new)
    for row, n in enumerate(lengths):
        keys = torch.cat([k[row : row + 1, :, :n], k_new[row : row + 1]], dim=2)
        values = torch.cat([v[row : row + 1, :, :n], v_new[row : row + 1]], dim=2)
        torch.testing.assert_close(out[row : row + 1], attention(q[row : row + 1], keys, values))
    assert cache.host_lengths == lengths  # a denoising step never grows the cache


@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3), heads=st.integers(1, 3),
       tokens=st.integers(1, 40), head_dim=st.sampled_from([8, 64, 100, 128]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_cache_write_kernel_writes_exactly_the_block_slots(lengths, heads, tokens, head_dim, dtype, seed):
    """kernels/cache_write.py (the block engine's per-layer K/V write on CUDA) against its torch
    reference: the t slots after each row's length get the block, every other slot keeps its value;
    k and v come in as the model hands them over (views with a transposed layout)."""
    from nanodllm.kernels.cache_write import cache_write, cache_write_reference
    from tests.device import DEVICE

    generator = torch.Generator().manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + tokens + 3
    cache_k, cache_v = (torch.randn(batch, capacity, heads, head_dim, generator=generator).to(dtype).to(DEVICE)
                        for _ in range(2))
    k, v = (torch.randn(batch, tokens, heads, head_dim, generator=generator).to(dtype).to(DEVICE).transpose(1, 2)
            for _ in range(2))
    row_lengths = torch.tensor(lengths, device=DEVICE)
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    cache_write_reference(expected_k, expected_v, k, v, row_lengths)
    cache_write(cache_k, cache_v, k, v, row_lengths)
    assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v)
    for row, n in enumerate(lengths):
        assert torch.equal(cache_k[row, n : n + tokens], k[row].transpose(0, 1))


def test_cache_write_kernel_refuses_mismatched_shapes():
    from nanodllm.kernels.cache_write import cache_write

    cache = torch.zeros(2, 16, 2, 8)
    block = torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="k_cache must be"):
        cache_write(torch.zeros(2, 16, 3, 8), cache, block, block, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="lengths must be"):
        cache_write(cache, cache, block, block, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="one dtype"):
        cache_write(cache, cache, block.half(), block.half(), torch.tensor([0, 1]))


def test_advance_makes_the_written_block_part_of_the_cache():
    cache, k, v = random_cache([3, 5])
    k_new = torch.ones(2, 2, 4, 8, dtype=torch.float64)
    cache.write(0, k_new, k_new)
    cache.advance(torch.tensor([4, 0]))
    keys, _ = cache.view(0)
    assert cache.host_lengths == [7, 5]
    assert torch.equal(keys[0, :, 3:7], k_new[0]) and torch.equal(keys[1, :, :5], k[1, :, :5])


def test_a_cache_attends_at_its_score_scale():
    """A cache built with a score scale (DiffusionGemma's 1) attends at it, not at head_dim^-1/2."""
    cache, k, v = random_cache([5, 3], scale=1.0)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2, 8, generator=generator, dtype=torch.float64)
    k_new, v_new = (torch.randn(2, 2, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    out = cache.attend(0, q, k_new, v_new)
    for row, n in enumerate([5, 3]):
        keys = torch.cat([k[row : row + 1, :, :n], k_new[row : row + 1]], dim=2)
        values = torch.cat([v[row : row + 1, :, :n], v_new[row : row + 1]], dim=2)
        torch.testing.assert_close(out[row : row + 1], attention(q[row : row + 1], keys, values, scale=1.0))


def test_a_write_that_fills_the_capacity_exactly_fits():
    cache, _, _ = random_cache([10, 7], capacity=12)
    block = torch.ones(2, 2, 2, 8, dtype=torch.float64)
    cache.write(0, block, block)
    keys, _ = cache.view(0, extra=2)
    assert torch.equal(keys[0, :, 10:12], block[0]) and torch.equal(keys[1, :, 7:9], block[1])


def test_overflow_is_an_error():
    cache, _, _ = random_cache([10], capacity=12)
    with pytest.raises(ValueError, match="KV cache overflow: capacity 12"):
        cache.write(0, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


def test_dense_attend_hook_without_a_model():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6, generator=generator) > 0.3
    mask[..., 0] = True
    ctx = StepContext(torch.zeros(2, 6, dtype=torch.long), torch.arange(6).expand(2, -1),
                      torch.ones(2, 6, dtype=torch.bool), torch.tensor([3, 3]), attn_mask=mask)
    torch.testing.assert_close(Dense().attend(0, q, k, v, ctx), attention(q, k, v, mask))


def test_registry_and_unknown_method():
    assert METHODS["dense"] is Dense and isinstance(get_method("dense"), Dense)
    with pytest.raises(ValueError, match="unknown method 'nope'; valid methods: dense"):
        get_method("nope")


def test_an_unknown_knob_lists_the_methods_knobs():
    assert knob_defaults("mage") == {"k": 1024, "exact_layers": 2, "sparse_commit": False}
    with pytest.raises(ValueError, match="method 'mage' has no knob 'side_stream'"):  # side streams are graphs.py's
        get_method("mage", side_stream=False)
    assert knob_defaults("dense") == {}
    with pytest.raises(ValueError, match=r"method 'quest' has no knob 'budget', 'kk'; its knobs \(defaults\): "
                                         r"k=1024, page_size=16, exact_layers=2, sparse_commit=False"):
        get_method("quest", kk=3, budget=4)
    with pytest.raises(ValueError, match="method 'dense' has no knob 'k'; its knobs \\(defaults\\): none"):
        get_method("dense", k=1)
    assert get_method("quest", k=64).k == 64


def test_a_knob_value_parses_as_a_bool_an_int_a_float_or_text():
    """--knobs values keep their types: an integer stays an int (a top-k size), not 64.0."""
    parsed = parse_knobs("k=64, ratio=0.5,sparse_commit=True,mode=dual,tau=1e-3")
    assert parsed == {"k": 64, "ratio": 0.5, "sparse_commit": True, "mode": "dual", "tau": 1e-3}
    assert [type(value) for value in parsed.values()] == [int, float, bool, str, float]


@pytest.mark.parametrize("tokens", [3, 17])
def test_cache_write_kernel_takes_each_caches_own_layout(tokens):
    """The K and V caches go through their own strides: a V cache laid out [batch, heads, capacity, dim]
    in memory (seen as [batch, capacity, heads, dim]) beside a contiguous K cache gets the same writes as
    the torch reference gives it."""
    from nanodllm.kernels.cache_write import cache_write, cache_write_reference
    from tests.device import DEVICE

    generator = torch.Generator().manual_seed(tokens)
    batch, heads, capacity, dim = 2, 3, 30, 8
    cache_k = torch.randn(batch, capacity, heads, dim, generator=generator).to(DEVICE)
    cache_v = torch.randn(batch, heads, capacity, dim, generator=generator).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(batch, heads, tokens, dim, generator=generator).to(DEVICE) for _ in range(2))
    lengths = torch.tensor([4, 11], device=DEVICE)
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    cache_write_reference(expected_k, expected_v, k, v, lengths)
    cache_write(cache_k, cache_v, k, v, lengths)
    assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v)


def test_cache_write_kernel_refuses_a_v_of_another_dtype():
    """The write is a copy, no conversion: k, v and both caches share one dtype, v included."""
    from nanodllm.kernels.cache_write import cache_write

    cache, block = torch.zeros(2, 16, 2, 8), torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        cache_write(cache, cache, block, block.half(), torch.tensor([0, 1]))


@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=3), extra=st.integers(0, 40),
       spare=st.integers(0, 80))
def test_the_launch_length_bounds_the_longest_row_within_an_eighth_and_the_capacity(lengths, extra, spare):
    """launch_length(extra) is at least max_length + extra, at most the capacity, and, below the capacity,
    a multiple of 1/8 of that number's power of two: less than 12.5% over it."""
    n = max(lengths) + extra
    capacity = n + spare
    cache = KVCache(1, len(lengths), capacity, 1, 1, "cpu", torch.float32)
    cache.advance(torch.tensor(lengths))
    launch = cache.launch_length(extra)
    assert n <= launch <= capacity
    if launch < capacity:
        step = 1 << max(n.bit_length() - 4, 0)
        assert launch % step == 0 and launch - n < max(n / 8, 1)


@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4))
def test_a_counted_write_leaves_the_slots_after_each_rows_count_alone(lengths):
    """write(counts=...) writes only the first counts[row] tokens of each row: the slots after them keep
    what they held (the cache's zeros)."""
    cache, k, v = random_cache(lengths)
    keys, values = cache.view(0, extra=cache.capacity - cache.max_length)
    for row, n in enumerate(lengths):
        assert torch.equal(keys[row, :, :n], k[row, :, :n]) and torch.equal(values[row, :, :n], v[row, :, :n])
        assert not keys[row, :, n:].any() and not values[row, :, n:].any()
