"""Primitives several methods call: knob checks, row and head gathers, top-k selections, attention over
chosen prefix keys, and attention mass.

Shapes: rows index dim 1 of [batch, t, ...] tensors (tokens of a canvas); heads index dim 2 of
[batch, heads, n, d] tensors (one index list per KV head, or one shared list).
"""

from __future__ import annotations

import torch

from nanodllm.kernels.flash_attention import flash_attention
from nanodllm.kernels.key_scores import key_scores
from nanodllm.kernels.sparse_decode_attention import sparse_decode_attention
from nanodllm.kernels.top_k import top_k_positions, top_k_positions_reference

from ..attention import as_kernel_mask, attention, attention_on_kernels, decode_kernels_take

MASK_VOTE_QUERIES = 64  # queries per key_scores launch (kernels/decode_inputs.py MAX_QUERIES)


def check_int(minimum: int, odd: bool = False, **knobs):
    """Knob validation: a ValueError naming the first knob that is not an integer >= minimum (and
    odd, if asked)."""
    for name, value in knobs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (odd and value % 2 == 0):
            raise ValueError(f"{name} must be {'an odd' if odd else 'an'} integer >= {minimum}, got {value!r}")


def overwrite(buffer: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """value written into buffer when it has value's shape (state a method keeps in place, as
    methods/base.py asks), else a copy of value (a buffer of its own, whatever value is a view of)."""
    if buffer is None or buffer.shape != value.shape:
        return value.clone()
    return buffer.copy_(value)


def flat_rows(rows: torch.Tensor, t: int) -> torch.Tensor:
    """rows [batch, n] of tensors with t rows per sequence -> [batch * n] indices into their flattened
    [batch * t] rows (take_rows' index, computed once by a caller taking several tensors' rows)."""
    batch = rows.shape[0]
    return (rows if batch == 1 else rows + torch.arange(0, batch * t, t, device=rows.device)[:, None]).flatten()


def take_rows(x: torch.Tensor, rows: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """x [batch, t, ...] at rows [batch, n] -> [batch, n, ...]; flat: flat_rows(rows, t) if known.
    Where x's batch and row dims flatten into one, an index_select copies whole rows (a gather would
    read an int64 index per element)."""
    batch, t = x.shape[:2]
    if batch == 1 or x.stride(0) == t * x.stride(1):
        flat = flat_rows(rows, t) if flat is None else flat
        return x.flatten(0, 1).index_select(0, flat).view(*rows.shape, *x.shape[2:])
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def put_rows(x: torch.Tensor, rows: torch.Tensor, src: torch.Tensor):
    """x[b, rows[b, j]] = src[b, j] in place (x [batch, t, ...])."""
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    x.scatter_(1, index, src)


def heads_index(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """index [batch, 1 or heads, k] expanded to gather/scatter x [batch, heads, n, ...] along n."""
    return index.view(*index.shape, *([1] * (x.dim() - 3))).expand(-1, x.shape[1], -1, *x.shape[3:])


def take_heads(x: torch.Tensor, index: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """x [batch, heads, n, ...] at index [batch, 1 (shared) or heads, k] -> [batch, heads, k, ...]. A
    shared index takes rows of the [batch, n, heads, ...] view (take_rows): whole rows where x is
    stored token-major, as projected queries are; the result is then a view in that layout."""
    if index.shape[1] == 1:
        return take_rows(x.transpose(1, 2), index[:, 0], flat).transpose(1, 2)
    return x.gather(2, heads_index(x, index))


def put_heads(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor):
    """x[b, h, index[b, h, j]] = src[b, h, j] in place (index shared over heads when its dim 1 is 1)."""
    x.scatter_(2, heads_index(x, index), src)


def keep_top(scores, counts, prompt_lengths):
    """Per (row, KV head) the counts[b, h] best prompt positions, in prompt order, padded; ties go to the
    lower position whatever the other heads' counts (a rank holding some heads chooses alike). scores
    [batch, kv_heads, P] (left-padded prompts: row b's tokens are its last prompt_lengths[b]
    columns), counts [batch, kv_heads]. Returns (indices [batch, kv_heads, kmax], keep [batch,
    kv_heads, 1, kmax]: False at padding slots)."""
    width = scores.shape[2]
    columns = torch.arange(width, device=scores.device)
    real = columns[None, :] >= (width - prompt_lengths)[:, None]
    scores = scores.masked_fill(~real[:, None, :], float("-inf"))
    counts = torch.minimum(counts, prompt_lengths[:, None])
    kmax = max(int(counts.max()), 1)
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :kmax]  # topk's ties depend on kmax
    slots = torch.arange(kmax, device=scores.device)
    indices = torch.where(slots < counts[..., None], top, width).sort(dim=-1).values
    keep = indices < width
    return indices.clamp(max=width - 1), keep[:, :, None, :]


def select_top_k(scores: torch.Tensor, prefix_lengths: torch.Tensor, k: int, on_kernels: bool):
    """Per (row, KV head) the k highest-scoring prefix positions, ascending, and how many are valid
    (min(k, prefix length)): indices [batch, kv_heads, min(k, max prefix)] int32 (entries past counts
    point at slot 0 and are never read), counts [batch, kv_heads] int32. Ties go to the lower position
    on both kernels/top_k.py (a radix select) and its torch reference (a stable sort)."""
    select = top_k_positions if on_kernels else top_k_positions_reference
    return select(scores, prefix_lengths, k)


def listed_tokens(indices, counts, prefix_lengths, index_block: int = 1):
    """Index lists as prefix tokens: (tokens [batch, kv_heads, K * S] int64, selected: True where the
    entry is within counts and the token within the row's prefix). Key blocks of S = index_block
    tokens are expanded (the batched form of kernels/sparse_decode_attention.selected_tokens)."""
    width = indices.shape[2]
    offsets = torch.arange(index_block, device=indices.device)
    tokens = (indices.long()[..., None] * index_block + offsets).flatten(2)
    listed = (torch.arange(width, device=indices.device) < counts[..., None]).repeat_interleave(index_block, dim=2)
    return tokens, listed & (tokens < prefix_lengths[:, None, None])


def sparse_cache_attention(q, k, v, k_cache, v_cache, prefix_lengths, indices, counts, index_block=1, scale=None):
    """The block's queries against the selected prefix keys plus the block's own keys k, v ([batch,
    kv_heads, L, D], already written after each row's prefix in the cache [batch, capacity, kv_heads,
    D]). indices / counts as kernels/sparse_decode_attention takes them: token indices, or key blocks
    of index_block tokens (clipped to the prefix); scale: the scores' (None: D^-1/2). Where the decode kernels
    do not take q (DiffusionGemma's 256 queries at head_dim 512) the chosen keys are gathered for attention().
    Neither path asks the host anything."""
    if decode_kernels_take(q):
        return sparse_decode_attention(q, k_cache, v_cache, prefix_lengths, indices, counts, index_block=index_block,
                                       scale=scale, return_lse=False)
    batch, num_kv_heads, _ = indices.shape
    tokens, selected = listed_tokens(indices, counts, prefix_lengths, index_block)
    rows = torch.arange(batch, device=q.device)[:, None, None]
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    tokens = torch.where(selected, tokens, 0)
    keys = torch.cat([k_cache[rows, tokens, heads], k], dim=2)  # [batch, kv_heads, width * S + L, D]
    values = torch.cat([v_cache[rows, tokens, heads], v], dim=2)
    mask = torch.cat([selected, selected.new_ones(batch, num_kv_heads, k.shape[2])], dim=2)[:, :, None]
    return attention(q, keys, values, mask, scale)


def attention_mass(q, keys, key_mask, query_weight, prompt_width):
    """[batch, kv_heads, prompt_width]: sum over queries (weighted by query_weight [batch, q_len], 0 or
    1) of their softmax probability on each prompt key, the softmax over all `keys` (hidden where the
    bool key_mask [batch, 1 or kv_heads, 1, keys] is False), averaged over each KV head's query group."""
    kernel_mask = as_kernel_mask(key_mask, q, keys) if attention_on_kernels(q) else None
    if kernel_mask is not None:
        return attention_mass_kernels(q, keys, kernel_mask[1], query_weight, prompt_width)
    return attention_mass_reference(q, keys, key_mask, query_weight, prompt_width)


def attention_mass_kernels(q, keys, k_valid, query_weight, prompt_width):
    """attention_mass in two kernel passes (k_valid [batch, keys] or [batch, kv_heads, keys], or None):
    flash_attention gives each query's log-sum-exp over all keys, then key_scores sums exp(score -
    lse) over the queries for each prompt key, MASK_VOTE_QUERIES queries per launch. A query of weight
    0 gets lse = +inf, so it adds exactly 0; a hidden prompt key gets 0, as the softmax gives it."""
    batch, num_heads, q_len, _ = q.shape
    group = num_heads // keys.shape[1]
    _, lse = flash_attention(q, keys, keys, k_valid=k_valid, return_lse=True)
    lse = lse.masked_fill(~query_weight.bool()[:, None, :], float("inf"))
    cache = keys.transpose(1, 2)  # [batch, keys, kv_heads, head_dim], as key_scores reads a cache
    lengths = torch.full((batch,), prompt_width, dtype=torch.int32, device=q.device)
    mass = sum(key_scores(q[:, :, start:start + MASK_VOTE_QUERIES], cache, lengths,
                          lse[:, :, start:start + MASK_VOTE_QUERIES], reduce="sum", max_length=prompt_width)
               for start in range(0, q_len, MASK_VOTE_QUERIES)) / group
    if k_valid is not None:
        prompt_valid = k_valid[..., :prompt_width]
        mass = mass.masked_fill(~(prompt_valid[:, None] if prompt_valid.dim() == 2 else prompt_valid), 0.0)
    return mass


def attention_mass_reference(q, keys, key_mask, query_weight, prompt_width):
    """attention_mass in torch, one KV head at a time to bound the fp32 scores."""
    batch, num_heads, q_len, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = num_heads // kv_heads
    weight = query_weight.float()[:, None, :, None]
    mass = q.new_zeros(batch, kv_heads, prompt_width, dtype=torch.float32)
    for h in range(kv_heads):
        scores = q[:, h * group : (h + 1) * group].float() @ keys[:, h : h + 1].float().transpose(-1, -2)
        scores = scores * head_dim**-0.5
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, h if key_mask.shape[1] > 1 else 0][:, None], float("-inf"))
        probs = scores.softmax(dim=-1)[..., :prompt_width]
        mass[:, h] = (probs * weight).sum(dim=2).mean(dim=1)
    return mass
