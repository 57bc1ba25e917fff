"""Method: the exact (dense) computation of both engines, and the hooks a sparse method overrides.

Engines own the schedule and the remasking rule; a Method owns what is computed. The engines call
only these hooks for model work:

    prefill(model, ctx) -> hidden   block engine: the prompt's complete blocks into the KV cache
    begin_block(ctx)                a new block starts: reset per-block state
    step(model, ctx) -> hidden      a denoising step's forward: hidden states of the fed tokens
    logits(model, hidden, ctx)      from them, the logits of the positions being decoded
    attend(layer, q, k, v, ctx)     the attention of every forward above (ctx.phase says whose)
    commit(model, ctx) -> hidden    block engine: forward the finished block against the cache
    end_step(ctx)                   after each step: the method's host-side counters and statistics
    step_kind(ctx)                  what the coming step computes (below)

A method that changes WHICH KEYS are read (MAGE, Quest, SparseD, MOMO's prefill) overrides attend;
one that changes WHICH ROWS are computed (the caches, MaskKV, DyLLM) overrides step and builds it
from the model's per-layer primitives. Everything a hook needs is in ctx; there is no global state.

step_kind(ctx) says, before a step, which steps compute the same function of the fed tokens and of
the method's tensors (a hashable kind, as step reads it from ctx.kind), so that the engine may
replay one's work for the next (nanodllm/graphs.py; logits, whose span moves block to block, always
runs). None, the default, means the step reads host numbers of its own and runs its Python every
time. A method that gives kinds keeps the state its steps read in tensors it overwrites in place,
and its host-side bookkeeping in end_step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Hashable

import torch

from ..attention import CanvasMask, attention, cache_attention
from ..cache import KVCache


@dataclass
class StepContext:
    """What the engine knows at one step; methods may read all of it.

    tokens, positions: [batch, t] what is fed: the whole canvas (masked engine), the active block
        (block engine) or the prompt's complete blocks (prefill).
    valid: [batch, t] False at padding positions of a ragged batch.
    prompt_lengths: [batch] each row's prompt length.
    block, step, steps_per_block: where the schedule is (block counts from the first generated
        block); block_length: the engine's block size (also the block-causal mask's).
    attn_mask: among the fed tokens, a CanvasMask (key padding, block-causal; `.dense(t, t, device)`
        gives it as a bool tensor) or None (all visible): the masked engine's and the prefill's.
    logits_start, logits_stop: the span of tokens whose logits the engine reads.
    cache: block engine only, the exact KV cache of everything before the active block.
    counts: [batch] prefill / commit: how many tokens of each row join the cache.
    phase: "prefill", "step" or "commit": which forward the hooks serve.
    kind: what step_kind said of this step.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    prompt_lengths: torch.Tensor
    block: int = 0
    step: int = 0
    steps_per_block: int = 1
    mask_id: int = 0
    attn_mask: CanvasMask | torch.Tensor | None = None
    logits_start: int = 0
    logits_stop: int | None = None
    cache: KVCache | None = None
    counts: torch.Tensor | None = None
    block_length: int = 0
    phase: str = "step"
    kind: Hashable | None = None


class Method:
    """Dense: exactly the reference computation. Subclass and override hooks for a sparse method."""

    name = "dense"
    engines = ("masked", "block")  # which engines the method supports

    def __init__(self):
        self.stats: dict = {}  # what the method reports, e.g. "kv_kept": fraction of KV entries read

    def prefill(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the prompt's complete blocks (ctx.tokens right-padded, ctx.counts real per row) and
        write their K/V into ctx.cache; returns the last hidden states (Fast-dLLM v2 predicts the next
        block's first token from them)."""

        def attend_and_store(layer, q, k, v):
            ctx.cache.write(layer, k, v, ctx.counts)
            return self.attend(layer, q, k, v, ctx)

        return model.hidden(ctx.tokens, ctx.positions, attend_and_store)

    def begin_block(self, ctx: StepContext):
        pass

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        """Hidden states [batch, t, hidden] of the fed tokens, before the final norm."""
        return model.hidden(ctx.tokens, ctx.positions, partial(self.attend, ctx=ctx))

    def logits(self, model, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """[batch, logits_stop - logits_start, vocab] from step's hidden states."""
        return model.head(hidden, ctx.logits_start, ctx.logits_stop)

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if ctx.cache is None or ctx.phase == "prefill":
            return attention(q, k, v, ctx.attn_mask)
        return attend_with_cache(layer, q, k, v, ctx.cache)

    def commit(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the clean block against the cache, its K/V written after each row's cache (they join
        it for rows with ctx.counts > 0 when the engine advances the cache). Returns its hidden states."""
        return model.hidden(ctx.tokens, ctx.positions, partial(self.attend, ctx=ctx))

    def end_step(self, ctx: StepContext):
        pass

    def step_kind(self, ctx: StepContext) -> Hashable | None:
        return None


class Dense(Method):
    """The exact reference computation. Its block-engine steps and commits are each of one kind."""

    name = "dense"

    def step_kind(self, ctx: StepContext):
        return () if ctx.cache is not None else None


def attend_with_cache(layer: int, q, k, v, cache: KVCache) -> torch.Tensor:
    """The active block's queries against each row's cache plus the whole block (no mask inside the
    block). The block's K/V go to the scratch slots after each row's cache, so keys are read in place;
    slots past a row's own cache and block are not attended."""
    cache.write(layer, k, v)
    block = k.shape[2]
    return cache_attention(q, cache.keys[layer], cache.values[layer], cache.lengths + block, cache.max_length + block,
                           ragged=not cache.uniform, launch_length=cache.launch_length(block))
