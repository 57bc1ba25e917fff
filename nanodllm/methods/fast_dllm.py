"""Fast-dLLM's approximate KV caches for the masked engine: the prefix cache and the dual cache.

Paper: Wu et al. 2025, "Fast-dLLM: training-free acceleration of diffusion LLM by enabling KV cache
and parallel decoding", https://arxiv.org/abs/2505.22618, the baseline Sparse-dLLM is measured against.
Idea: while a block is denoised, the K/V of the tokens outside it barely change. So at the block's
step `delay` (0: its first) the whole canvas is forwarded, exactly as dense, and each layer keeps the
K/V outside the fed range:
    mode = "prefix"   the fed range is the block and everything after it (the still-masked suffix);
    mode = "dual"     the fed range is the block alone.
Later steps feed only the fed range, whose tokens attend to the kept K/V plus their own fresh K/V
(bidirectionally, as the canvas does), written into room left at the end of the kept buffers. Steps
before `delay` run in full without a cache; a new block starts over; with refresh = n a full forward
rebuilds the cache every n steps from `delay` on. On a shifted-logit model (Dream) the fed range
starts one column before the block (its hidden state gives the block's first logits), not kept. With
the loop's threshold decoding (--threshold 0.9) this is Fast-dLLM's whole recipe.
Hooks: begin_block (drop the cache), step (full or cached), logits, step_kind (a cached step, per
cache), kv_kept (at a build).
Equals dense: refresh = 1 (a full forward every step). A cached step on the canvas its cache was
built from gives the full forward's logits (test).
Heads split over ranks: each rank keeps its heads' K/V; nothing is communicated.
Knobs: mode = "dual" | "prefix" (default dual), delay = 0, refresh = 0 (0: the cache lives for the
whole block; n: a full forward every n steps from `delay` on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attention
from .base import Method, StepContext
from .common import check_int


@dataclass
class KeptKV:
    """One layer's kept K/V: [batch, kv_heads, n + room, head_dim], the last `room` slots for the fed
    tokens of each cached step; a key mask [batch, 1 or kv_heads, 1, n + room] (False = hidden:
    padding, unused slots) or None; how many real tokens (summed over rows) they were chosen from."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None
    candidates: int
    room: int = 0


def with_room(kept: KeptKV, room: int) -> KeptKV:
    """The same K/V in buffers with `room` more slots at the end, so attention reads one buffer in place
    (the split-KV decode kernel when the fed tokens are few and nothing is hidden: attention.py)."""
    batch, heads, n, head_dim = kept.keys.shape
    keys, values = (x.new_empty(batch, heads, n + room, head_dim) for x in (kept.keys, kept.values))
    keys[:, :, :n], values[:, :, :n] = kept.keys, kept.values
    mask = kept.mask
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:3], room)], dim=3)
    return KeptKV(keys, values, mask, kept.candidates, room)


def outside_block(x: torch.Tensor, start: int, stop: int, dim: int) -> torch.Tensor:
    """x without positions start..stop-1 along dim."""
    return torch.cat([x.narrow(dim, 0, start), x.narrow(dim, stop, x.shape[dim] - stop)], dim=dim)


class FastDllm(Method):
    name = "fast_dllm"
    engines = ("masked",)
    needs_bidirectional = True

    def __init__(self, mode: str = "dual", delay: int = 0, refresh: int = 0):
        if mode not in ("dual", "prefix"):
            raise ValueError(f"mode must be 'dual' or 'prefix', got {mode!r}")
        check_int(0, delay=delay, refresh=refresh)
        self.mode, self.delay, self.refresh = mode, delay, refresh
        self.kept: list[KeptKV] = []
        self.builds = 0  # caches built so far: a cached step's kind names its cache
        self.shift = 0  # 1 on a shifted-logit model (Dream): the fed range starts one column earlier
        self.outside = None  # at a building step: (validity [batch, n] outside the fed range, all real, count)

    def begin_block(self, ctx: StepContext):
        self.kept = []

    def cached(self, ctx: StepContext) -> bool:
        """Whether this step feeds the fed range against the kept K/V (else: a full forward)."""
        since = ctx.step - self.delay
        return since > 0 and not (self.refresh and since % self.refresh == 0)

    def building(self, ctx: StepContext) -> bool:
        """Whether this step's full forward keeps its K/V: the block's step `delay`, and each refresh."""
        return ctx.step >= self.delay and not self.cached(ctx)

    def step_kind(self, ctx: StepContext):
        return (self.builds, self.fed_range(ctx)[0]) if self.cached(ctx) else None

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        self.shift = int(model.cfg.logit_shift)
        if self.cached(ctx):
            return self.cached_step(model, ctx)
        return self.full_step(model, ctx, build=self.building(ctx))

    def full_step(self, model, ctx, build: bool) -> torch.Tensor:
        """The dense forward (hidden states of the canvas); with build, each layer's K/V outside the fed
        range are kept as it passes."""
        kept = []
        low, high = self.fed_range(ctx)
        if build:  # the tokens outside the fed range: their validity, whether all are real, how many
            valid = outside_block(ctx.valid, low, high, dim=1)
            self.outside = (valid, bool(valid.all()), int(valid.sum()))  # host syncs once, not per layer

        def attend(layer, q, k, v):
            if build:
                kept.append(with_room(self.keep(layer, q, k, v, ctx), high - low))
            return attention(q, k, v, ctx.attn_mask)

        hidden = model.hidden(ctx.tokens, ctx.positions, attend)
        if build:
            self.kept = kept
            self.builds += 1
        return hidden

    def fed_range(self, ctx) -> tuple[int, int]:
        """The columns a cached step feeds: the block (dual) or the block and everything after it
        (prefix); on a shifted-logit model from one column earlier."""
        high = ctx.logits_stop if self.mode == "dual" else ctx.tokens.shape[1]
        return ctx.logits_start - self.shift, high

    def cached_step(self, model, ctx) -> torch.Tensor:
        """Feed the fed range against the kept K/V."""
        low, high = self.fed_range(ctx)
        return model.hidden(ctx.tokens[:, low:high], ctx.positions[:, low:high], self.attend_cached)

    def logits(self, model, hidden, ctx: StepContext) -> torch.Tensor:
        """From the whole canvas's hidden states (a full step) or the fed range's."""
        low = 0 if hidden.shape[1] == ctx.tokens.shape[1] else self.fed_range(ctx)[0]
        return model.head(hidden, ctx.logits_start - low, ctx.logits_stop - low)

    def attend_cached(self, layer, q, k, v):
        """The fed tokens' attention: the kept K/V and their own, written into the buffers' room."""
        kept = self.kept[layer]
        kept.keys[:, :, -kept.room :].copy_(k)
        kept.values[:, :, -kept.room :].copy_(v)
        return attention(q, kept.keys, kept.values, kept.mask)

    def keep(self, layer: int, q, k, v, ctx) -> KeptKV:
        """What layer `layer` keeps of the full forward's K/V (q: the canvas's queries): everything
        outside the fed range, padding hidden."""
        low, high = self.fed_range(ctx)
        valid, all_valid, count = self.outside
        mask = None if all_valid else valid[:, None, None, :]
        return KeptKV(outside_block(k, low, high, dim=2), outside_block(v, low, high, dim=2), mask, count)

    def kv_kept(self, ctx: StepContext):
        """At a step that built the cache: the K/V entries kept, of the real tokens outside the fed range."""
        if not self.building(ctx):
            return None
        kept = outside = 0
        for layer in self.kept:
            batch, heads, slots, _ = layer.keys.shape
            mask = None if layer.mask is None else layer.mask[..., : slots - layer.room]
            kept = kept + (batch * heads * (slots - layer.room) if mask is None
                           else mask.expand(-1, heads, -1, -1).sum())
            outside += layer.candidates * heads
        return kept, outside
