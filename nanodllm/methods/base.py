"""Method: the exact (dense) computation of every decoding loop, and the hooks a method overrides.

A loop owns the schedule and the remasking rule; a Method owns what is computed. The loop calls
prefill (block engine), begin_block per block, step then logits per denoising step, and commit
(block engine); each runs the model, whose attention goes through attend. A method that changes WHICH
KEYS are read overrides attend (MAGE, Quest, SparseD, MOMO); one that changes WHICH ROWS are computed
overrides step and builds it from the model's per-layer primitives (the caches, MaskKV, DyLLM).
Replay: steps and commits of one step_kind(ctx) (hashable; None: never replayed) must compute one
function of ctx's tensors and the method's tensors, so that a loop may rerun a step's GPU work without
its Python (nanodllm/graphs.py). Such a step reads no host number beyond ctx and its kind, changes no
Python state, keeps what it carries over in tensors it overwrites in place, and hands work nothing in
the step reads to ctx.aside(fn), which may overlap it with the step. What a step read and computed is
stated by selection, kv_kept and rows_computed, and counted by the loop (nanodllm/meter.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Hashable, NamedTuple

import torch

from ..attention import CanvasMask, attention
from ..cache import KVCache


def run_now(fn: Callable, *inputs: torch.Tensor):
    """ctx.aside(fn, *inputs): fn() returns the tensors it wrote, inputs are the tensors it reads; here
    it simply runs now (nanodllm/graphs.py overlaps it with the rest of the step on a GPU)."""
    return fn()


@dataclass(frozen=True)
class StepContext:
    """What the loop knows at one forward, built afresh for each; methods may read all of it.

    tokens, positions, valid: [batch, t] what is fed (the whole canvas, the active block, or the
        prompt's complete blocks at a prefill); valid is False at padding.
    prompt_lengths: [batch]; prompt_width: the masked engine's left-padded prompt columns (else 0).
    block, step, steps_per_block: where the schedule is (a commit's step: the steps its block took);
        t: the step's index in the generation.
    attn_mask: among the fed tokens (a CanvasMask, or None: all visible); logits_start, logits_stop:
        the columns whose logits the loop reads; block_length: the loop's block size.
    cache: the block engine's exact KV cache; counts: [batch] tokens of each row joining it.
    phase: "prefill", "step" or "commit"; kind: what step_kind said of it, where a loop asked;
        aside: where a step hands work nothing in it reads.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    prompt_lengths: torch.Tensor
    prompt_width: int = 0
    block: int = 0
    step: int = 0
    steps_per_block: int = 1
    t: int = 0
    mask_id: int = 0
    attn_mask: CanvasMask | None = None
    logits_start: int = 0
    logits_stop: int | None = None
    block_length: int = 0
    cache: KVCache | None = None
    counts: torch.Tensor | None = None
    phase: str = "step"
    kind: Hashable | None = None
    aside: Callable = run_now


class Selection(NamedTuple):
    """The prefix keys a layer's attention reads, per (row, KV head), as kernels/sparse_decode_attention
    takes them: indices [batch, kv_heads, width] of key blocks of `index_block` tokens, counts [batch,
    kv_heads]; `most`: tokens a row reads at most (a host number); chosen_now: picked from this step's
    exact attention (which read every key), read from the next step on."""

    indices: torch.Tensor
    counts: torch.Tensor
    index_block: int
    most: int
    chosen_now: bool = False


class Method:
    """The exact reference computation. Subclass and override hooks for a sparse method."""

    name = "dense"
    engines = ("masked", "block", "gemma")  # its loops: masked (LLaDA, Dream), block (SDAR, LLaDA2), DiffusionGemma's
    needs_bidirectional = False  # True: it caches a bidirectional canvas (no block-causal model)
    sparse_prefill = False  # True: attend computes a prefill its own way, cached steps exactly (MOMO)

    def prefill(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the prompt's whole blocks (ctx.counts real per row), K/V into ctx.cache; the last hidden states."""

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
        return ctx.cache.attend(layer, q, k, v)

    def commit(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the clean block against the cache (its K/V join it where ctx.counts > 0)."""
        return model.hidden(ctx.tokens, ctx.positions, partial(self.attend, ctx=ctx))

    def step_kind(self, ctx: StepContext) -> Hashable | None:
        return None

    def selection(self, layer: int, ctx: StepContext) -> Selection | None:
        """Block engine: the prefix keys this step's attention at `layer` read or chose (None: all)."""
        return None

    def kv_kept(self, ctx: StepContext):
        """(K/V entries this step kept or read, of how many), numbers or tensors, or None: the block
        engine counts selection's prefix keys, the masked engine nothing."""
        return None

    def rows_computed(self, ctx: StepContext):
        """(canvas rows this step computed, of how many), or None: not counted."""
        return None


class Dense(Method):
    """The exact reference. Its block-engine steps and commits are each of one kind."""

    def step_kind(self, ctx: StepContext):
        return () if ctx.cache is not None else None
