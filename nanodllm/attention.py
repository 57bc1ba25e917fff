"""Dense attention and the masks both engines use.

Shapes: q [batch, num_heads, q_len, head_dim], k and v [batch, num_kv_heads, k_len, head_dim]
(GQA: num_heads is a multiple of num_kv_heads; query head h reads KV head h // group).
A mask is a bool tensor [batch, 1, q_len, k_len] (True = may attend) or None for "everything".

On CUDA, torch SDPA runs it; on CPU a plain-torch version computes scores and softmax in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Query at absolute position q sees key k iff k // B <= q // B (blocks aligned to 0).

    q_pos [batch, q_len], k_pos [batch, k_len] -> [batch, 1, q_len, k_len]."""
    return (k_pos[:, None, None, :] // block_size) <= (q_pos[:, None, :, None] // block_size)


def key_padding_mask(k_valid: torch.Tensor, q_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Hide padded keys. k_valid [batch, k_len] -> [batch, 1, 1 or q_len, k_len].

    Padded queries (q_valid False) are given every key so their softmax is defined; their
    outputs are never read, and as keys they stay hidden from everyone else."""
    mask = k_valid[:, None, None, :]
    if q_valid is not None:
        mask = mask | ~q_valid[:, None, :, None]
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v, with GQA. Returns [batch, num_heads, q_len, head_dim]."""
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return attention_reference(q, k, v, mask)


def attention_reference(q, k, v, mask=None):
    """Plain torch, scores and softmax in fp32 (float64 for float64 inputs), cast back to q's dtype."""
    batch, num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    compute, out_dtype = torch.promote_types(q.dtype, torch.float32), q.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    qg = q.reshape(batch, k.shape[1], group * q_len, head_dim)
    scores = (qg @ k.transpose(-1, -2)) * head_dim**-0.5  # [batch, kv_heads, group*q_len, k_len]
    scores = scores.view(batch, k.shape[1], group, q_len, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(batch, k.shape[1], group * q_len, -1)
    out = probs @ v
    return out.view(batch, num_heads, q_len, head_dim).to(out_dtype)
