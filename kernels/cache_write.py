"""Write the active block's keys and values into the KV cache, right after each row's length.

    k_cache[b, lengths[b] + j, h] = k[b, h, j]      and the same for v,   j < t

The block engine does this in every layer of every step (nanodllm/cache.py). The offsets are read
on the device, so a CUDA graph recorded in one block replays in the next; in torch the same write
is an index computation and two scatters (four launches per layer), here it is one launch for both
K and V.

Grid: (token tiles of BLOCK_T, batch * kv_heads). k, v: [batch, kv_heads, t, head_dim];
k_cache, v_cache: [batch, capacity, kv_heads, head_dim]; all through their strides, one dtype (a copy,
no conversion). The caller
guarantees lengths[b] + t <= capacity (KVCache.write checks it on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cache_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, lengths_ptr,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_cb, stride_cn, stride_ch, stride_cd,
    stride_wb, stride_wn, stride_wh, stride_wd,
    num_kv_heads, num_tokens, head_dim,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t_tile, batch_head = tl.program_id(0), tl.program_id(1)
    batch, head = batch_head // num_kv_heads, batch_head % num_kv_heads
    tokens = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    inside = (tokens < num_tokens)[:, None] & (dims < head_dim)[None, :]
    slots = tl.load(lengths_ptr + batch).to(tl.int64) + tokens
    b, h = batch.to(tl.int64), head.to(tl.int64)
    # [BLOCK_T, BLOCK_D]
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + tokens[:, None] * stride_kt + dims[None, :] * stride_kd,
                mask=inside)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + tokens[:, None] * stride_vt + dims[None, :] * stride_vd,
                mask=inside)
    tl.store(k_cache_ptr + b * stride_cb + h * stride_ch + slots[:, None] * stride_cn + dims[None, :] * stride_cd,
             k, mask=inside)
    tl.store(v_cache_ptr + b * stride_wb + h * stride_wh + slots[:, None] * stride_wn + dims[None, :] * stride_wd,
             v, mask=inside)


def check_inputs(k_cache, v_cache, k, v, lengths):
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_heads, t, head_dim], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    batch, heads, _, head_dim = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or (cache.shape[0], cache.shape[2], cache.shape[3]) != (batch, heads, head_dim):
            raise ValueError(f"{name} must be [{batch}, capacity, {heads}, {head_dim}], got {tuple(cache.shape)}")
        if cache.device != k.device:
            raise ValueError(f"{name} is on {cache.device}, k on {k.device}")
        if cache.dtype != k.dtype or v.dtype != k.dtype:
            raise ValueError(f"{name} ({cache.dtype}), k ({k.dtype}) and v ({v.dtype}) must have one dtype")
    if lengths.shape != (batch,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != k.device:
        raise ValueError(f"lengths must be an int tensor of shape ({batch},) on {k.device}, got "
                         f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}")


def cache_write(k_cache, v_cache, k, v, lengths):
    """k_cache[b, lengths[b] + j, h] = k[b, h, j] (and v), in place; see the module docstring."""
    check_inputs(k_cache, v_cache, k, v, lengths)
    batch, heads, num_tokens, head_dim = k.shape
    if num_tokens == 0 or batch * heads == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_t = min(triton.next_power_of_2(num_tokens), max(1, 4096 // block_d))
    grid = (triton.cdiv(num_tokens, block_t), batch * heads)
    cache_write_kernel[grid](
        k, v, k_cache, v_cache, lengths,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        heads, num_tokens, head_dim,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )


def cache_write_reference(k_cache, v_cache, k, v, lengths):
    """Plain torch: the slots as an index tensor, two scatters."""
    batch, _, num_tokens, _ = k.shape
    rows = torch.arange(batch, device=k.device)[:, None]
    slots = lengths[:, None] + torch.arange(num_tokens, device=k.device)[None, :]  # [batch, t]
    k_cache[rows, slots] = k.transpose(1, 2)
    v_cache[rows, slots] = v.transpose(1, 2)
