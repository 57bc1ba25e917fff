"""Fast-dLLM's approximate KV caches for the masked engine: the prefix cache and the dual cache.

Paper: Wu et al. 2025, "Fast-dLLM: training-free acceleration of diffusion LLM by enabling KV cache
and parallel decoding", the baseline Sparse-dLLM (../shared/papers/004_1b321dc639f7ffd1.txt) is
measured against.

Idea. While a block is being denoised, the K/V of the tokens outside it barely change. So at the
block's step `delay` (0: its first step) the whole canvas is forwarded, exactly as dense, and each
layer keeps the K/V outside the block:
    mode = "prefix"   the K/V before the block; later steps feed the block and everything after it
                      (the still-masked suffix);
    mode = "dual"     the K/V before and after the block; later steps feed only the block.
Fed tokens attend to the kept K/V plus their own fresh K/V (bidirectionally, as the canvas does).
Steps before `delay` run in full without a cache; a new block starts over. With the engine's
threshold decoding (--threshold 0.9) this is Fast-dLLM's whole recipe.

Hooks: begin_block (drop the cache), step. Subclasses choose what to keep (`keep`; sparse_dllm.py
prunes there). On a shifted-logit model (Dream) the fed range starts one column before the block,
whose hidden state gives the block's first logits, and that column is not kept.
Equals dense: refresh = 1 (a full forward every step). A cached step on the canvas its cache was
built from gives the full forward's logits (test).
Knobs: mode = "dual" | "prefix" (default dual), delay = 0, refresh = 0 (0: the cache lives for the
whole block; n: a full forward every n steps from `delay` on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attention
from ..graphs import StepGraphs
from .base import Method, StepContext, check_int


@dataclass
class KeptKV:
    """One layer's kept K/V outside the fed tokens: [batch, kv_heads, n + room, head_dim] (the last
    `room` slots belong to the fed tokens of each cached step: `with_room`), a key mask [batch, 1 or
    kv_heads, 1, n + room] (False = hidden: padding, unused slots) or None, and how many real tokens
    (summed over rows) they were chosen from."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None
    candidates: int
    room: int = 0


def with_room(kept: KeptKV, room: int) -> KeptKV:
    """The same K/V in buffers with `room` more slots at the end, where each cached step writes its fed
    tokens' K/V: attention then reads one buffer in place (no concatenation per step), through the
    split-KV decode kernel when the fed tokens are few and nothing is hidden (nanodllm/attention.py).
    The mask grows with visible slots."""
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

    def __init__(self, mode: str = "dual", delay: int = 0, refresh: int = 0):
        super().__init__()
        if mode not in ("dual", "prefix"):
            raise ValueError(f"mode must be 'dual' or 'prefix', got {mode!r}")
        check_int(0, delay=delay, refresh=refresh)
        self.mode, self.delay, self.refresh = mode, delay, refresh
        self.kept: list[KeptKV] = []
        self.keys_kept = self.keys_outside = 0
        self.builds = 0  # caches built so far: a cached step's CUDA graph lives as long as its cache
        self.graphs = StepGraphs()
        self.shift = 0  # 1 on a shifted-logit model (Dream): the fed range starts one column earlier
        self.outside = None  # at a building step: (validity [batch, n] outside the fed range, all real, count)

    def begin_block(self, ctx: StepContext):
        self.kept = []
        self.graphs.reset()

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        if ctx.attn_mask is not None and ctx.attn_mask.block_size is not None:
            raise ValueError(f"{self.name} caches a bidirectional canvas; this model is block-causal "
                             "(decode it with the block engine)")
        self.shift = int(model.cfg.logit_shift)
        since = ctx.step - self.delay
        if since < 0 or not self.kept or (self.refresh and since % self.refresh == 0):
            return self.full_step(model, ctx, build=since >= 0)
        return self.cached_step(model, ctx)

    def full_step(self, model, ctx, build: bool) -> torch.Tensor:
        """The dense forward; with build, each layer's K/V outside the block are kept as it passes."""
        kept = []
        low, high = self.fed_range(ctx)
        if build:  # the tokens outside the fed range: their validity, whether all are real, how many
            valid = outside_block(ctx.valid, low, high, dim=1)
            self.outside = (valid, bool(valid.all()), int(valid.sum()))  # host syncs once, not per layer

        def attend(layer, q, k, v):
            if build:
                kept.append(with_room(self.keep(layer, q, k, v, ctx), high - low))
            return attention(q, k, v, ctx.attn_mask)

        logits = model(ctx.tokens, ctx.positions, attend, ctx.logits_start, ctx.logits_stop)
        if build:
            self.kept = kept
            self.builds += 1
            self.count_kept(kept, ctx)
        return logits

    def fed_range(self, ctx) -> tuple[int, int]:
        """The columns a cached step feeds: the block (dual) or the block and everything after it
        (prefix); on a shifted-logit model from one column earlier, whose hidden state gives the
        block's first logits."""
        high = ctx.logits_stop if self.mode == "dual" else ctx.tokens.shape[1]
        return ctx.logits_start - self.shift, high

    def cached_step(self, model, ctx) -> torch.Tensor:
        """Feed the fed range against the kept K/V; on a GPU replayed from a CUDA graph captured once
        per cache (nanodllm/graphs.py)."""
        low, high = self.fed_range(ctx)
        start, stop = ctx.logits_start - low, ctx.logits_stop - low
        tokens, positions = ctx.tokens[:, low:high], ctx.positions[:, low:high]
        forward = lambda tokens, positions: model(tokens, positions, self.attend_cached, start, stop)
        return self.graphs((self.builds, low, tuple(tokens.shape)), forward, tokens, positions)

    def attend_cached(self, layer, q, k, v):
        """The fed tokens' attention: the kept K/V and their own, written into the buffers' room."""
        kept = self.kept[layer]
        kept.keys[:, :, -kept.room :].copy_(k)
        kept.values[:, :, -kept.room :].copy_(v)
        return attention(q, kept.keys, kept.values, kept.mask)

    def keep(self, layer: int, q, k, v, ctx) -> KeptKV:
        """What layer `layer` keeps of the full forward's K/V: everything outside the fed range,
        padding hidden. q is the full canvas's queries (unused here)."""
        low, high = self.fed_range(ctx)
        valid, all_valid, count = self.outside
        mask = None if all_valid else valid[:, None, None, :]
        return KeptKV(outside_block(k, low, high, dim=2), outside_block(v, low, high, dim=2), mask, count)

    def count_kept(self, kept: list[KeptKV], ctx):
        """stats['kv_kept']: cached keys / the real tokens they were chosen from, per KV head, over
        layers and blocks (1.0 for these caches, the retention for sparse_dllm)."""
        for layer in kept:
            batch, heads, slots, _ = layer.keys.shape
            n = slots - layer.room
            mask = None if layer.mask is None else layer.mask[..., :n]
            self.keys_kept += batch * heads * n if mask is None else int(mask.expand(-1, heads, -1, -1).sum())
            self.keys_outside += layer.candidates * heads
        self.stats["kv_kept"] = self.keys_kept / max(self.keys_outside, 1)
