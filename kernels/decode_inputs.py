"""Validation of the block-decode kernels' inputs, shared by decode_attention.py, sparse_decode_attention.py
and key_scores.py: shapes, dtypes, devices, the query count each kernel takes, the lengths and the scale."""

from __future__ import annotations

import torch

MAX_QUERIES = 64  # the active block; longer query sets are prefill (flash_attention.py)
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_query_and_cache(q, k_cache, v_cache=None, max_queries=MAX_QUERIES):
    """Validate q [batch, num_heads, L, D], L <= max_queries, against a cache [batch, capacity,
    num_kv_heads, D]; returns (batch, num_heads, L, D, capacity, num_kv_heads)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, num_heads, L, head_dim], got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache is None:
            continue
        if cache.dim() != 4:
            raise ValueError(f"{name} must be [batch, capacity, num_kv_heads, head_dim], got {tuple(cache.shape)}")
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from q dtype {q.dtype}")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device}, q on {q.device}")
    if v_cache is not None and v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    batch, num_heads, num_queries, head_dim = q.shape
    cache_batch, capacity, num_kv_heads, cache_dim = k_cache.shape
    if q.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {q.dtype}")
    if cache_batch != batch or cache_dim != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not 1 <= num_queries <= max_queries:
        raise ValueError(f"L = {num_queries} queries; this kernel takes 1..{max_queries} (use flash_attention)")
    return batch, num_heads, num_queries, head_dim, capacity, num_kv_heads


def check_lengths_tensor(name, lengths, batch, device):
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(lengths.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {lengths.dtype}")
    if lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device}, q on {device}")



def check_decode_lengths(lengths, batch, num_queries, capacity, device, max_length, checked) -> int:
    """decode_attention's lengths (a [batch] tensor, or one int for every row) against L and the capacity, and
    max_length against them; returns the max_length that sizes the launch (default lengths.max(), one device
    sync). An int is checked always; a tensor with `checked`, which costs a device sync."""
    if isinstance(lengths, int):
        if not num_queries <= lengths <= capacity:
            raise ValueError(f"lengths {lengths} must lie in [L, capacity] = [{num_queries}, {capacity}]")
        if max_length is not None and max_length < lengths:
            raise ValueError(f"max_length {max_length} is below lengths {lengths}: keys past it would be skipped")
        return lengths if max_length is None else max_length
    check_lengths_tensor("lengths", lengths, batch, device)
    if checked and bool(((lengths < num_queries) | (lengths > capacity)).any()):
        raise ValueError(f"lengths {lengths.tolist()} must lie in [L, capacity] = [{num_queries}, {capacity}]")
    if checked and max_length is not None and int(lengths.max()) > max_length:
        raise ValueError(f"max_length {max_length} is below lengths {lengths.tolist()}: keys past it would be skipped")
    return int(lengths.max()) if max_length is None else max_length


def score_scale(scale, head_dim: int) -> float:
    """The scores' scale: head_dim ** -0.5 by default, else the positive number given (the kernels take the
    row max of the unscaled scores, which only a positive scale keeps the max)."""
    if scale is None:
        return head_dim**-0.5
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    return scale
