"""Sparse-dLLM: Fast-dLLM's dual cache, pruned per layer to the keys the block attends to (masked engine).

Paper: "Sparse-dLLM: accelerating diffusion LLMs with dynamic cache eviction",
https://arxiv.org/abs/2508.02558 (section 3, Algorithms 1-5).

Idea. Which tokens a block attends to is stable across its steps, and the attention is sparse. Per
block: steps before `delay` run the full canvas without a cache (the K/V are not settled yet, Fig.
4); step `delay` runs it too and, layer by layer, builds the cache of everything outside the block,
pruned (Algorithm 1): score each candidate key by its dot product with the block's mean query,
max-pool the scores over neighbouring tokens (width `kernel`), keep the top floor(ratio * the row's
own candidates), padding never counted nor kept; later steps feed only the block and attend to the
kept K/V plus the block's own. The paper keeps one index set for all heads (scores averaged over
heads; `per_head` keeps one per KV head); `prefix_sparse` (Algorithm 5) prunes only the tokens
before the block and keeps the whole suffix.

Hooks: those of Fast-dLLM's cache (methods/outside_cache.py) in dual mode; keep is Sparse-dLLM's.
Equals fast_dllm mode=dual with the same delay when ratio = 1; a small ratio differs (tests).
Knobs (paper defaults): ratio r = 0.5, kernel = 3, delay = 1, per_head = False, prefix_sparse = False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_int, take_heads, top_positions
from .outside_cache import KeptKV, OutsideCache, outside_block


def pivotal_tokens(q_mean, candidates, valid, ratio: float, kernel: int, per_head: bool):
    """Algorithm 1 lines 5-10. q_mean [batch, heads, d] (the block's mean query), candidates
    [batch, kv_heads, n, d], valid [batch, n]. Returns (indices [batch, 1 or kv_heads, int(ratio * n)]
    in token order, keep [batch, 1 or kv_heads, 1, int(ratio * n)]).

    Each row keeps floor(ratio * its own valid candidates), its own count (line 9), so its selection
    does not depend on the batch: every row lists as many top-ranked slots as an unpadded row keeps,
    and keep is False past a row's own count. Padding scores -inf before the max pool (it spreads into
    no real token) and after it (it inherits no neighbour's score), so it never takes a slot. Ties go to
    the lower position, alike in any batch."""
    batch, kv_heads, n, head_dim = candidates.shape
    group = q_mean.shape[1] // kv_heads
    grouped = q_mean.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhn", grouped, candidates.float()) / group  # mean over the group
    if not per_head:
        scores = scores.mean(dim=1, keepdim=True)
    padding = ~valid[:, None, :]
    scores = scores.masked_fill(padding, float("-inf"))
    if kernel > 1:
        heads = scores.shape[1]
        pooled = F.max_pool1d(scores.view(batch * heads, 1, n), kernel, stride=1, padding=kernel // 2)
        scores = pooled.view(batch, heads, n).masked_fill(padding, float("-inf"))
    own_count = (valid.sum(dim=1, dtype=torch.float64) * ratio).floor()  # int(ratio * n) of an unpadded row
    indices, keep = top_positions(scores, int(ratio * n), own_count[:, None])
    return indices, keep[:, :, None, :]


class SparseDllm(OutsideCache):
    name = "sparse_dllm"

    def __init__(self, ratio: float = 0.5, kernel: int = 3, delay: int = 1, per_head: bool = False,
                 prefix_sparse: bool = False):
        super().__init__("dual", delay, refresh=0)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        check_int(1, odd=True, kernel=kernel)
        self.ratio, self.kernel, self.per_head, self.prefix_sparse = ratio, kernel, per_head, prefix_sparse

    def keep(self, layer: int, q, k, v, ctx) -> KeptKV:
        low, high = self.fed_range(ctx)
        q_mean = q[:, :, ctx.logits_start : ctx.logits_stop].mean(dim=2)
        valid, _, count = self.outside
        if self.prefix_sparse:  # Algorithm 5: the candidates are the tokens before the block
            k_f, v_f, valid = k[:, :, :low], v[:, :, :low], ctx.valid[:, :low]
        else:
            k_f, v_f = outside_block(k, low, high, dim=2), outside_block(v, low, high, dim=2)
        indices, keep = pivotal_tokens(q_mean, k_f, valid, self.ratio, self.kernel, self.per_head)
        keys, values = take_heads(k_f, indices), take_heads(v_f, indices)
        if self.prefix_sparse:
            suffix = k.shape[2] - high
            keys = torch.cat([keys, k[:, :, high:]], dim=2)
            values = torch.cat([values, v[:, :, high:]], dim=2)
            keep = torch.cat([keep, keep.new_ones(*keep.shape[:3], suffix)], dim=3)
        mask = None if bool(keep.all()) else keep  # rows keeping fewer than the list: one sync per layer
        return KeptKV(keys, values, mask, count)
