"""Dense attention and the masks both engines use.

Shapes: q [batch, num_heads, q_len, head_dim], k and v [batch, num_kv_heads, k_len, head_dim]
(GQA: num_heads is a multiple of num_kv_heads; query head h reads KV head h // group).
A mask is None ("everything"), a bool tensor [batch, 1 or num_kv_heads, q_len or 1, k_len] (True = may
attend; a per-KV-head mask serves methods that keep different keys per head), or a
CanvasMask: the structured masks of the engines (key padding, block-causal), which a kernel can
apply without materialising [q_len, k_len].

Who computes it: the Triton kernels of kernels/ when use_kernels(q), the kernels take the head_dim
(the decode kernels 64 and 128, flash_attention also DiffusionGemma's 256 and 512) and the mask does
not depend on the query (see `attention`); torch SDPA for other CUDA tensors; on the CPU a plain-torch
version with scores and softmax in fp32. `use_kernels` is the one switch of the whole
package between the Triton kernels and plain torch: every caller asks it, so NANODLLM_KERNELS=0 in
the environment keeps everything on torch (SDPA on CUDA), to compare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanodllm.kernels.decode_attention import decode_attention
from nanodllm.kernels.decode_inputs import MAX_QUERIES as DECODE_MAX_QUERIES
from nanodllm.kernels.flash_attention import HEAD_DIMS as FLASH_HEAD_DIMS
from nanodllm.kernels.flash_attention import flash_attention

KERNELS_ENABLED = os.environ.get("NANODLLM_KERNELS", "1") != "0"
KERNEL_DEVICES = ("cuda",)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128)
SPLIT_MIN_KEYS = 1024
SPLIT_MAX_QUERIES = 256  # decode_attention's DENSE_MAX_QUERIES


def use_kernels(x: torch.Tensor) -> bool:
    """Whether work on x runs on the Triton kernels: float16 / bfloat16 tensors on a GPU, outside
    autograd (the kernels have no backward). A test that adds "cpu" to KERNEL_DEVICES runs the kernels
    in Triton's CPU interpreter (TRITON_INTERPRET=1; float16, since its bfloat16 dot is wrong)."""
    return (KERNELS_ENABLED and x.device.type in KERNEL_DEVICES and x.dtype in KERNEL_DTYPES
            and not torch.is_grad_enabled())


def attention_on_kernels(q: torch.Tensor) -> bool:
    """Whether q's attention runs on the attention kernels (which take head_dim 64 and 128)."""
    return use_kernels(q) and q.shape[-1] in KERNEL_HEAD_DIMS


def decode_kernels_take(q: torch.Tensor) -> bool:
    """Whether the block-decode kernels of sparse methods (sparse_decode_attention, key_scores) take q."""
    return attention_on_kernels(q) and q.shape[2] <= DECODE_MAX_QUERIES


def flash_on_kernels(q: torch.Tensor) -> bool:
    """Whether q's attention over whole key lists runs on flash_attention (head_dim 64 to 512)."""
    return use_kernels(q) and q.shape[-1] in FLASH_HEAD_DIMS


@dataclass
class CanvasMask:
    """The mask of a forward over a whole canvas, as data a kernel can apply.

    valid: [batch, n] bool, False at padding positions (hidden as keys), or None (no padding).
    block_size: block-causal with this block size (None = bidirectional). Blocks are aligned to
        column 0 unless `positions` is given.
    positions: [batch, n] per-row positions whose blocks count, for a left-padded block-causal
        canvas (rows start at different columns); only the dense form supports it.
    Queries are the last q_len of the n columns (q_len == n for a full canvas)."""

    valid: torch.Tensor | None = None
    block_size: int | None = None
    positions: torch.Tensor | None = None

    def dense(self, q_len: int, k_len: int, device) -> torch.Tensor | None:
        """The same mask as a bool tensor [batch, 1, q_len, k_len] (None if everything is visible).
        Padded queries see every key the block-causal rule allows, so their softmax is defined;
        the kernel gives them only valid keys instead (or none: output 0). Their outputs are never read."""
        mask = None
        if self.block_size is not None:
            if self.positions is not None:
                k_pos = self.positions[:, -k_len:]
            else:
                k_pos = torch.arange(k_len, device=device)[None, :]
            mask = block_causal_mask(k_pos[:, k_len - q_len :], k_pos, self.block_size)
        if self.valid is not None:
            padding = key_padding_mask(self.valid[:, -k_len:], self.valid[:, -q_len:])
            mask = padding if mask is None else mask & padding
        return mask

    def repeat(self, times: int) -> "CanvasMask":
        """The mask of the batch concatenated `times` times (classifier-free guidance)."""
        twice = lambda t: None if t is None else torch.cat([t] * times)
        return CanvasMask(twice(self.valid), self.block_size, twice(self.positions))


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | CanvasMask | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale masked) v, with GQA (scale None: 1 / sqrt(d)). Returns [batch, num_heads,
    q_len, head_dim].

    On the kernels: decode_attention (head_dim 64, 128) for at most SPLIT_MAX_QUERIES queries against
    SPLIT_MIN_KEYS or more unmasked keys (it splits the keys over the SMs and reads a KV head's slice once
    for its group of query heads: docs/results/bench_routing.md); flash_attention for the
    rest, when the mask is a CanvasMask or hides keys without depending on the query (a bool mask
    [batch, 1 or num_kv_heads, 1, k_len]). Other CUDA tensors, or a bool mask that differs per query:
    torch SDPA."""
    kernel_mask = as_kernel_mask(mask, q, k) if flash_on_kernels(q) else None
    if kernel_mask is not None:
        block_size, k_valid = kernel_mask
        few_queries = q.shape[2] <= SPLIT_MAX_QUERIES and k.shape[2] >= SPLIT_MIN_KEYS
        if attention_on_kernels(q) and block_size is None and k_valid is None and few_queries:
            return decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), k.shape[2], scale=scale, return_lse=False)
        return flash_attention(q, k, v, block_size=block_size, k_valid=k_valid, scale=scale)
    if isinstance(mask, CanvasMask):
        mask = mask.dense(q.shape[2], k.shape[2], q.device)
    if q.is_cuda:
        if mask is not None and 1 < mask.shape[1] < q.shape[1]:  # per KV head -> per query head for SDPA
            mask = mask.repeat_interleave(q.shape[1] // mask.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return attention_reference(q, k, v, mask, scale)


def as_kernel_mask(mask, q: torch.Tensor, k: torch.Tensor) -> tuple | None:
    """The mask as flash_attention takes it, (block_size, k_valid), or None if it cannot: a CanvasMask
    with per-row positions, a mask that is not a 4-D bool tensor, or a bool mask that differs per
    query or is broadcast over the batch."""
    if mask is None:
        return None, None
    if isinstance(mask, CanvasMask):
        if mask.positions is not None:
            return None
        return mask.block_size, None if mask.valid is None else mask.valid[:, -k.shape[2]:]
    if mask.dtype != torch.bool or mask.dim() != 4:  # an additive or lower-rank mask: SDPA takes it
        return None
    if mask.shape[0] != q.shape[0] or mask.shape[2] != 1 or mask.shape[1] not in (1, k.shape[1]):
        return None
    return None, mask[:, 0, 0] if mask.shape[1] == 1 else mask[:, :, 0]


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                    max_length: int, ragged: bool, launch_length: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """The active block's queries against each row's cached keys, read in place.

    k_cache, v_cache: [batch, capacity, num_kv_heads, head_dim] (token-major, as KVCache keeps them);
    row b attends to slots 0 .. lengths[b]-1, which end with the block's own keys; max_length =
    max(lengths), known on the host; ragged: whether rows differ in length (padding to hide);
    launch_length: a bound >= max_length that sizes the kernel's launch (KVCache.launch_length; default
    max_length); scale: as attention's. Returns [batch, num_heads, q_len, head_dim]."""
    if attention_on_kernels(q):
        return decode_attention(q, k_cache, v_cache, lengths, max_length=launch_length or max_length, scale=scale,
                                return_lse=False)
    keys, values = k_cache[:, :max_length].transpose(1, 2), v_cache[:, :max_length].transpose(1, 2)
    mask = None
    if ragged:
        slots = torch.arange(max_length, device=q.device)
        mask = key_padding_mask(slots[None, :] < lengths[:, None])
    return attention(q, keys, values, mask, scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_valid: torch.Tensor | None = None):
    """Bidirectional attention of q against every key (k_valid [batch, k_len]: False = hidden), with
    the log-sum-exp of each row's scaled scores: (out [batch, heads, q_len, d], lse [batch, heads,
    q_len] float32). Methods that reuse a row's softmax normaliser later (DyLLM) need it."""
    if attention_on_kernels(q):
        return flash_attention(q, k, v, k_valid=k_valid, return_lse=True)
    batch, num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(compute).reshape(batch, k.shape[1], group * q_len, head_dim)
    scores = (qg @ k.to(compute).transpose(-1, -2)) * head_dim**-0.5
    if k_valid is not None:
        scores = scores.masked_fill(~k_valid[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse[..., None]).exp() @ v.to(compute)
    return (out.view(batch, num_heads, q_len, head_dim).to(q.dtype),
            lse.view(batch, num_heads, q_len).to(torch.promote_types(compute, torch.float32)))


def attention_reference(q, k, v, mask=None, scale=None):
    """Plain torch, scores and softmax in fp32 (float64 for float64 inputs), cast back to q's dtype."""
    batch, num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    compute, out_dtype = torch.promote_types(q.dtype, torch.float32), q.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    qg = q.reshape(batch, k.shape[1], group * q_len, head_dim)
    scores = (qg @ k.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)  # [b, kv, group*q_len, k_len]
    scores = scores.view(batch, k.shape[1], group, q_len, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(batch, k.shape[1], group * q_len, -1)
    out = probs @ v
    return out.view(batch, num_heads, q_len, head_dim).to(out_dtype)
