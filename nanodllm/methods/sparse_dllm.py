"""Sparse-dLLM: Fast-dLLM's dual cache, pruned per layer to the keys the block attends to (masked engine).

Paper: "Sparse-dLLM: accelerating diffusion LLMs with dynamic cache eviction",
https://arxiv.org/abs/2508.02558 (section 3, Algorithms 1-5).

Idea: which tokens a block attends to is stable across its steps, and the attention is sparse. Per
block: steps before `delay` run the full canvas without a cache (the K/V are not settled yet, Fig.
4); step `delay` runs it too and, layer by layer, builds the cache of everything outside the block,
pruned (Algorithm 1): score each candidate key by its dot product with the block's mean query,
max-pool the scores over neighbouring tokens (width `kernel`), keep the top floor(ratio * the row's
own candidates), padding never counted nor kept; later steps feed only the block and attend to the
kept K/V plus the block's own. The paper keeps one index set for all heads (scores averaged over
heads; `per_head` keeps one per KV head); `prefix_sparse` (Algorithm 5) prunes only the tokens
before the block and keeps the whole suffix.

Hooks: Fast-dLLM's (methods/fast_dllm.py) in dual mode; Sparse-dLLM's are when the cache is built
(cache_state, Algorithm 4) and what each layer keeps of it (keep, Algorithms 1 and 5).
Equals fast_dllm mode=dual with the same delay when ratio = 1; a small ratio differs (tests).
Heads split over ranks: a build all-gathers each layer's key scores per KV head (per_head: nothing).
Knobs (paper defaults): ratio r = 0.5, kernel = 3, delay = 1, per_head = False, prefix_sparse = False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel import SINGLE, Group, group_of
from .common import check_int, take_heads
from .fast_dllm import FastDllm, KeptKV, outside_block


def attention_scores(q_mean, candidates, per_head: bool, group: Group = SINGLE) -> torch.Tensor:
    """Algorithm 1 lines 5-6: [batch, 1 or kv_heads, n] float32, the dot product of the block's mean
    query (q_mean [batch, heads, d]) with each candidate key (candidates [batch, kv_heads, n, d]),
    averaged over each KV head's query group and, unless per_head, over every KV head (gathered in
    order where ranks split them)."""
    batch, kv_heads, _, head_dim = candidates.shape
    group_size = q_mean.shape[1] // kv_heads
    grouped = q_mean.float().view(batch, kv_heads, group_size, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhn", grouped, candidates.float()) / group_size  # mean over the group
    return scores if per_head else group.all_gather(scores, dim=1).mean(dim=1, keepdim=True)


def importance(scores, valid, kernel: int) -> torch.Tensor:
    """Line 8: the scores max-pooled over `kernel` neighbouring tokens. Padding (valid [batch, n] False)
    scores -inf before the pool, so it spreads into no real token, and after it, so it inherits no
    neighbour's score: it never takes a slot."""
    padding = ~valid[:, None, :]
    scores = scores.masked_fill(padding, float("-inf"))
    if kernel == 1:
        return scores
    batch, heads, n = scores.shape
    pooled = F.max_pool1d(scores.view(batch * heads, 1, n), kernel, stride=1, padding=kernel // 2)
    return pooled.view(batch, heads, n).masked_fill(padding, float("-inf"))


def top_positions(scores: torch.Tensor, width: int, counts: torch.Tensor):
    """The `width` best-scoring positions along the last dim, in position order, and which of them are
    among each row's first counts[...] by rank: (positions [..., width], kept [..., width] bool).
    counts broadcasts against scores' leading dims. A stable sort: ties go to the lower position, the
    same in any batch. A fixed width (a shape that persists) with each row keeping its own count."""
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    positions, order = ranked.sort(dim=-1)
    ranks = torch.arange(width, device=scores.device)
    return positions, (ranks < counts[..., None]).expand_as(ranked).gather(-1, order)


def pivotal_tokens(q_mean, candidates, valid, ratio: float, kernel: int, per_head: bool, group: Group = SINGLE):
    """Algorithm 1 lines 5-10. q_mean [batch, heads, d] (the block's mean query), candidates
    [batch, kv_heads, n, d], valid [batch, n]. Returns (indices [batch, 1 or kv_heads, int(ratio * n)]
    in token order, keep [batch, 1 or kv_heads, 1, int(ratio * n)]).

    Each row keeps floor(ratio * its own valid candidates), its own count (line 9), so its selection
    does not depend on the batch: every row lists as many top-ranked slots as an unpadded row keeps,
    and keep is False past a row's own count. Ties go to the lower position, alike in any batch."""
    scores = importance(attention_scores(q_mean, candidates, per_head, group), valid, kernel)
    own_count = (valid.sum(dim=1, dtype=torch.float64) * ratio).floor()  # int(ratio * n) of an unpadded row
    indices, keep = top_positions(scores, int(ratio * candidates.shape[2]), own_count[:, None])
    return indices, keep[:, :, None, :]


class SparseDllm(FastDllm):
    """Builds on Fast-dLLM's dual cache: what each layer keeps of it is pruned."""

    name = "sparse_dllm"

    def __init__(self, ratio: float = 0.5, kernel: int = 3, delay: int = 1, per_head: bool = False,
                 prefix_sparse: bool = False):
        super().__init__("dual", delay, refresh=0)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        check_int(1, odd=True, kernel=kernel)
        self.ratio, self.kernel, self.per_head, self.prefix_sparse = ratio, kernel, per_head, prefix_sparse

    def step(self, model, ctx):
        self.group = group_of(model)  # the ranks, if split: keep averages the scores of every KV head
        return super().step(model, ctx)

    def cache_state(self, ctx) -> int:
        """Algorithm 4: 0 before the block's step `delay` (the full canvas, no cache: its K/V are not
        settled yet), 1 at it (the full canvas, and the pruned cache built), 2 after it (the cache read)."""
        if ctx.step > self.delay:
            return 2
        return 1 if ctx.step == self.delay else 0

    def cached(self, ctx) -> bool:
        return self.cache_state(ctx) == 2

    def building(self, ctx) -> bool:
        return self.cache_state(ctx) == 1

    def candidates(self, k, v, ctx):
        """(K_f, V_f, their validity [batch, n], the suffix (K_r, V_r) kept whole or None): Algorithm 1
        lines 1-3, every token outside the block; with prefix_sparse Algorithm 5 lines 1-6, the tokens
        before the block, and the suffix after it."""
        low, high = self.fed_range(ctx)
        if not self.prefix_sparse:
            return outside_block(k, low, high, dim=2), outside_block(v, low, high, dim=2), self.outside[0], None
        return k[:, :, :low], v[:, :, :low], ctx.valid[:, :low], (k[:, :, high:], v[:, :, high:])

    def keep(self, layer: int, q, k, v, ctx) -> KeptKV:
        """Algorithm 1 (or 5): the pivotal tokens of the candidates, scored by the block's mean query,
        then the suffix where prefix_sparse keeps it whole."""
        k_f, v_f, valid, suffix = self.candidates(k, v, ctx)
        q_mean = q[:, :, ctx.logits_start : ctx.logits_stop].mean(dim=2)  # line 5
        indices, keep = pivotal_tokens(q_mean, k_f, valid, self.ratio, self.kernel, self.per_head, self.group)
        keys, values = take_heads(k_f, indices), take_heads(v_f, indices)  # lines 12-13
        if suffix is not None:  # Algorithm 5 lines 15-16
            keys, values = torch.cat([keys, suffix[0]], dim=2), torch.cat([values, suffix[1]], dim=2)
            keep = torch.cat([keep, keep.new_ones(*keep.shape[:3], suffix[0].shape[2])], dim=3)
        mask = None if bool(keep.all()) else keep  # rows keeping fewer than the list: one sync per layer
        return KeptKV(keys, values, mask, self.outside[2])
