"""The KV cache on its own, and the dense method's hooks called on random tensors without a model."""

import torch
from hypothesis import given, strategies as st

from nanodllm.attention import attention
from nanodllm.cache import KVCache
from nanodllm.methods import METHODS, get_method
from nanodllm.methods.base import Dense, StepContext, attend_with_cache

import pytest


def random_cache(lengths, heads=2, dim=8, capacity=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(1, len(lengths), capacity, heads, dim, "cpu", torch.float64)
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
    out = attend_with_cache(0, q, k_new, v_new, cache)
    for row, n in enumerate(lengths):
        keys = torch.cat([k[row : row + 1, :, :n], k_new[row : row + 1]], dim=2)
        values = torch.cat([v[row : row + 1, :, :n], v_new[row : row + 1]], dim=2)
        torch.testing.assert_close(out[row : row + 1], attention(q[row : row + 1], keys, values))
    assert cache.host_lengths == lengths  # a denoising step never grows the cache


def test_advance_makes_the_written_block_part_of_the_cache():
    cache, k, v = random_cache([3, 5])
    k_new = torch.ones(2, 2, 4, 8, dtype=torch.float64)
    cache.write(0, k_new, k_new)
    cache.advance(torch.tensor([4, 0]))
    keys, _ = cache.view(0)
    assert cache.host_lengths == [7, 5]
    assert torch.equal(keys[0, :, 3:7], k_new[0]) and torch.equal(keys[1, :, :5], k[1, :, :5])


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
