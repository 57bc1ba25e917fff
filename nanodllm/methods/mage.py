"""MAGE: each block's important prefix keys, selected once from its all-[MASK] first step, are the
only prefix keys its later denoising steps attend to (block engine: SDAR, LLaDA2, Fast-dLLM v2).

Paper: "MAGE: All-[MASK] Block Already Knows Where to Look in Block Diffusion LLM" (Kwon et al.).
Idea: at a block's first denoising step every query is [MASK] (but for decoded tokens a loop puts in
the block: the prompt's tail, Fast-dLLM v2's first token), and the keys those queries attend to are
the ones the whole block keeps attending to (the paper's Fig. 3). So step 1 attends exactly and, per
layer and KV head, ranks each row's cached prefix by eq. 3, the attention probability averaged over
the block's L queries and the group's G query heads, the softmax over the row's prefix alone:
    score_j = 1 / (G L) * sum over heads h of the group and block queries i of softmax(q_hi K^T)_j
and keeps the k best, in position order; steps 2..T attend to those keys plus the block's own.
On the kernels the selecting step's decode keeps the block's keys in a slice of their own
(kernels/decode_attention block_apart), kernels/key_scores normalises by the prefix-only log-sum-exp
those partials give, and the scoring and top-k overlap the rest of the step (Algorithm 1: ctx.aside).
Hooks: begin_block (a new generation drops the selection), attend (exact, selecting or sparse, by
stage), step_kind (the stage), selection (what a layer read or chose). On DiffusionGemma a block is a
canvas and only its full layers select (cache.full, scale 1; sliding layers read a window anyway); its
first step's canvas is random tokens, not [MASK] (how much of Fig. 3 holds then: docs/results/tiny_gemma.md).
Equals dense: k >= every row's prefix: each step attends to every key (up to rounding: the gathered
keys are multiplied in another layout); the same tokens.
Heads split over ranks: each KV head selects its own keys; nothing is communicated.
Knobs (paper defaults): k = 1024 keys per KV head (256 / 512 in its accuracy tables; scale it to the
context), exact_layers = 2 (the first layers always attend exactly), sparse_commit = False (the
commit forward attends to the selection instead of the whole cache).
"""

from __future__ import annotations

import torch

from nanodllm.kernels.decode_attention import decode_partials, merge_splits
from nanodllm.kernels.key_scores import key_scores

from ..attention import decode_kernels_take
from .base import Method, Selection, StepContext
from .common import check_int, select_top_k, sparse_cache_attention


def block_scores(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor, scale=None) -> torch.Tensor:
    """Scaled scores (scale None: D^-1/2), fp32, [batch, kv_heads, G*L, max prefix + L], of every query row
    of the group against each row's prefix and the block's keys (right after the prefix in the cache);
    -inf at slots a row does not have. q: [batch, heads, L, D]; k_cache: [batch, capacity, kv_heads, D]."""
    batch, num_heads, block, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    n = int(prefix_lengths.max()) + block
    keys = k_cache[:, :n].transpose(1, 2).float()  # [batch, kv_heads, n, D]
    queries = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * block, head_dim)
    scores = (queries @ keys.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)
    visible = torch.arange(n, device=q.device)[None, :] < (prefix_lengths + block)[:, None]  # [batch, n]
    return scores.masked_fill(~visible[:, None, None], float("-inf"))


def block_probabilities(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor, scale=None,
                        scores_per_chunk: int = 1 << 27) -> torch.Tensor:
    """Eq. 3 in torch: [batch, kv_heads, max prefix], the mean probability of each prefix key under the
    block's queries, the softmax over the row's prefix alone; 0 past a row's prefix. The group's query
    rows are scored a chunk at a time (about scores_per_chunk fp32 scores), so a long prefix never
    holds every row's scores at once."""
    batch, num_heads, block, head_dim = q.shape
    num_kv_heads, prefix = k_cache.shape[2], int(prefix_lengths.max())
    in_prefix = (torch.arange(prefix, device=q.device)[None, :] < prefix_lengths[:, None])[:, None, None]
    keys = k_cache[:, :prefix].transpose(1, 2).float()  # [batch, kv_heads, prefix, D]
    queries = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * block, head_dim)
    chunk = max(1, scores_per_chunk // max(batch * num_kv_heads * prefix, 1))
    scale = head_dim**-0.5 if scale is None else scale
    total = keys.new_zeros(batch, num_kv_heads, prefix)
    for start in range(0, queries.shape[2], chunk):
        scores = queries[:, :, start : start + chunk] @ keys.transpose(-1, -2) * scale
        probs = scores.masked_fill(~in_prefix, float("-inf")).softmax(-1)
        total += torch.where(in_prefix, probs, 0.0).sum(2)  # an empty prefix's NaNs dropped
    return total / queries.shape[2]


class Mage(Method):
    name = "mage"
    engines = ("block", "gemma")

    def __init__(self, k: int = 1024, exact_layers: int = 2, sparse_commit: bool = False):
        check_int(1, k=k)
        check_int(0, exact_layers=exact_layers)
        self.k, self.exact_layers, self.sparse_commit = k, exact_layers, sparse_commit
        # layer -> (indices [batch, kv_heads, width] int32, counts [batch, kv_heads]): the block's
        # selection, written in place block after block
        self.chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture_step(self, ctx: StepContext) -> int:
        """The step whose exact attention selects: the first, whose queries are all [MASK]."""
        return 0

    def stage(self, ctx: StepContext) -> str:
        """"exact" before the capture step, "select" at it, "sparse" after it; a commit "sparse" with
        sparse_commit once its block has selected; everything "exact" with no prefix to select from."""
        capture = self.capture_step(ctx)
        if ctx.cache.max_length == 0 or ctx.step < capture:
            return "exact"
        if ctx.phase == "commit":
            return "sparse" if self.sparse_commit and ctx.step > capture else "exact"
        return "select" if ctx.step == capture else "sparse"

    def begin_block(self, ctx: StepContext):
        if ctx.block == 0:  # a new generation
            self.chosen = {}

    def step_kind(self, ctx: StepContext):
        return (self.stage(ctx),)

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if ctx.phase == "prefill":
            return super().attend(layer, q, k, v, ctx)
        stage = self.stage(ctx) if layer >= self.exact_layers else "exact"
        if stage == "select":
            return self.attend_and_select(layer, q, k, v, ctx)
        if stage == "sparse":
            return self.attend_selected(layer, q, k, v, ctx)
        return ctx.cache.attend(layer, q, k, v)

    def attend_and_select(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        """Exact attention, and the layer's selection from its probabilities (eq. 3)."""
        cache = ctx.cache
        if not decode_kernels_take(q):
            out = cache.attend(layer, q, k, v)
            scores = block_probabilities(q, cache.keys[layer], cache.lengths, cache.scale)
            # zeros up to the launch bound, as on the kernels: the selection's width moves only with the bound
            scores = torch.nn.functional.pad(scores, (0, cache.launch_length(k.shape[2]) - scores.shape[-1]))
            self.keep(layer, *select_top_k(scores, cache.lengths, self.k, on_kernels=False))
            return out
        cache.write(layer, k, v)
        block = k.shape[2]
        out_parts, lse_parts = decode_partials(q, cache.keys[layer], cache.values[layer], cache.lengths + block,
                                               max_length=cache.launch_length(block), scale=cache.scale,
                                               block_apart=True)
        out, _ = merge_splits(out_parts, lse_parts, q)
        width = cache.launch_length(block)  # >= the longest prefix, a shape that lasts many blocks
        scores = lambda: key_scores(q, cache.keys[layer], cache.lengths, part_lse=lse_parts, scale=cache.scale,
                                    max_length=width)
        ctx.aside(lambda: self.keep(layer, *select_top_k(scores(), cache.lengths, self.k, on_kernels=True)),
                  q, lse_parts, cache.lengths)
        return out

    def keep(self, layer: int, indices: torch.Tensor, counts: torch.Tensor):
        """Store a layer's new selection, into its tensors of earlier blocks where the width is the same
        (min(k, the cache's launch bound), which grows rarely and never within a step's kind)."""
        kept = self.chosen.get(layer)
        if kept is None or kept[0].shape != indices.shape:
            self.chosen[layer] = (indices, counts)
        else:
            kept[0].copy_(indices)
            kept[1].copy_(counts)
        return self.chosen[layer]

    def attend_selected(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        cache = ctx.cache
        cache.write(layer, k, v)
        indices, counts = self.chosen[layer]
        return sparse_cache_attention(q, k, v, cache.keys[layer], cache.values[layer], cache.lengths, indices, counts,
                                      scale=cache.scale)

    def selection(self, layer: int, ctx: StepContext) -> Selection | None:
        stage = self.stage(ctx)
        if layer < self.exact_layers or stage == "exact" or layer not in self.chosen:
            return None
        return Selection(*self.chosen[layer], index_block=1, most=self.k, chosen_now=stage == "select")
