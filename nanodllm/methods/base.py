"""Method: the exact (dense) computation of both engines, and the hooks a sparse method overrides.

Engines own the schedule and the remasking rule; a Method owns what is computed per step. Both
engines call only these hooks for model work:

    prefill(model, ctx)          block engine: KV cache of the prompt's complete blocks
    prefill_attention(q, k, v, mask)  the attention prefill uses (MOMO's block-sparse prefill)
    begin_block(ctx)             a new block starts: reset per-block state
    step(model, ctx) -> logits   logits of the positions being decoded (ctx.logits_start..stop)
    attend(layer, q, k, v, ctx)  the attention the default step uses
    attended_selection(layer, ctx)  the keys that attend read, for diagnostics (None: every key)
    commit(model, ctx)           block engine: forward the finished block, keep its KV in the cache

Methods that change WHICH KEYS are read (MAGE, Quest, SparseD) override `attend` and `begin_block`;
methods that change WHICH ROWS are computed (caches, MaskKV, DyLLM) override `step` and build it from
the model's per-layer primitives. Everything a hook needs is in `ctx`; there is no global state.

On a GPU the block engine's denoising steps and commits replay CUDA graphs (nanodllm/graphs.py): a
step is the same computation on new tokens, and at batch 1 launching its ~500 kernels from Python
takes longer than running them. Nothing a step launches depends on host numbers that change every
block (KVCache: device-side lengths, bucketed launch shapes), so a recording serves block after block.
`graph_key` says which steps share a recording (MAGE: its selecting step, and the sparse steps after
it); state a recording reads lives in tensors the method overwrites in place.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..attention import CanvasMask, attention, cache_attention, use_kernels
from ..cache import KVCache
from ..graphs import StepGraphs


@dataclass
class StepContext:
    """What the engine knows at one step; methods may read all of it. The masked engine builds one
    per step; the block engine one per block, updating tokens and step in place.

    tokens, positions: [batch, t] what is fed this step: the whole canvas (masked engine) or the
        active block (block engine).
    valid: [batch, t] False at padding positions of a ragged batch.
    prompt_lengths: [batch] each row's prompt length.
    block, step, steps_per_block: where the schedule is (block index counts from the first
        generated block); block_length: the engine's block size (also the block-causal mask's).
    attn_mask: masked engine: the mask among the fed tokens, a CanvasMask (key padding, block-causal;
        `.dense(t, t, device)` gives it as a bool tensor) or None (all visible).
    logits_start, logits_stop: the span of tokens whose logits the engine reads.
    cache: block engine only, the exact KV cache of everything before the active block.
    counts: [batch] block engine prefill/commit: how many tokens of each row to append to the cache.
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


class Method:
    """Dense: exactly the reference computation. Subclass and override hooks for a sparse method."""

    name = "dense"
    engines = ("masked", "block")  # which engines the method supports

    def __init__(self):
        self.stats: dict = {}  # what the method reports, e.g. "kv_kept": fraction of KV entries read
        self.keys_read = self.keys_total = 0
        self.step_graphs = StepGraphs(size=4)  # the block engine's steps and commits (graph_key, commit_key)
        self.graphed_cache = None  # weak reference to the KVCache the recordings read
        self.step_reads: dict = {}  # graph key -> count_reads' caps of one step, counted again per replay
        self.noted_reads: list | None = None  # while a step to be recorded runs eagerly: its caps

    def count_reads(self, lengths: list[int], cap: int | None = None):
        """stats['kv_kept']: prefix keys attended / prefix keys a dense step attends, summed over the
        attention calls so far. One call attends min(cap, n) of a row's n prefix keys (all of them
        with cap None); lengths are the host's (no device sync)."""
        if self.step_graphs.capturing:  # a recording re-runs the step's Python; its eager run counted
            return
        if self.noted_reads is not None:
            self.noted_reads.append(cap)
        self.keys_read += sum(n if cap is None else min(cap, n) for n in lengths)
        self.keys_total += sum(lengths)
        self.stats["kv_kept"] = self.keys_read / max(self.keys_total, 1)

    def prefill(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the prompt's complete blocks (ctx.tokens, right-padded, ctx.counts valid per row)
        under the block-causal mask and append their KV to ctx.cache; returns the last hidden states
        (Fast-dLLM v2 predicts the next block's first token from them). The attention is
        prefill_attention's."""
        mask = CanvasMask(valid=ctx.valid, block_size=ctx.block_length)  # right-padded: blocks align to column 0

        def attend_and_store(layer, q, k, v):
            ctx.cache.write(layer, k, v, ctx.counts)
            return self.prefill_attention(q, k, v, mask)

        hidden = model.hidden(ctx.tokens, ctx.positions, attend_and_store)
        ctx.cache.advance(ctx.counts)
        return hidden

    def prefill_attention(self, q, k, v, mask: CanvasMask) -> torch.Tensor:
        """The prompt's attention in prefill (long-prompt methods such as MOMO override it)."""
        return attention(q, k, v, mask)

    def begin_block(self, ctx: StepContext):
        pass

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        attend = lambda layer, q, k, v: self.attend(layer, q, k, v, ctx)

        def forward(tokens, positions):
            logits = model(tokens, positions, attend, ctx.logits_start, ctx.logits_stop)
            self.end_step()
            return logits

        key = self.graph_key(ctx)
        if key is None:
            return forward(ctx.tokens, ctx.positions)
        return self.graphed(key, forward, ctx)

    def end_step(self):
        """Work that ends the step's forward, inside its recording (MAGE joins its side stream)."""

    def graph_key(self, ctx: StepContext):
        """A hashable key if this step may replay a CUDA graph, steps with equal keys sharing one
        recording; None runs it eagerly. Subclasses add what their step also depends on."""
        return self.launch_key(ctx)

    def launch_key(self, ctx: StepContext):
        """What every graphed forward of the block engine depends on, or None where nothing is graphed.
        On the attention kernels a forward is a pure function of the block's tokens and positions, the
        device-side cache and the method's state, with no host sync; its launch shapes depend on the
        tokens' shape, the logits span and the cache's launch_length. The masked engine's methods
        (ctx.cache None) graph their own steps."""
        cache = ctx.cache
        if cache is None or not use_kernels(cache.keys[0]):
            return None
        block = ctx.tokens.shape[1]
        # an empty cache takes other branches (no prefix to select from); the launch bound alone tells
        # it apart only while caches grow by whole blocks
        return (tuple(ctx.tokens.shape), cache.launch_length(block), cache.max_length == 0, ctx.logits_start,
                ctx.logits_stop)

    def commit_key(self, ctx: StepContext):
        """The graph key of the commit forward (None: eager)."""
        key = self.launch_key(ctx)
        return None if key is None else key + ("commit",)

    def graphed(self, key, forward, ctx: StepContext) -> torch.Tensor:
        """forward(tokens, positions) through self.step_graphs, recordings kept per KV cache (a new
        cache, a new generation: recordings of the old one are dropped). A replay counts the reads of
        the recorded step's attention calls again, at the cache lengths of its own time."""
        if self.graphed_cache is None or self.graphed_cache() is not ctx.cache:
            self.step_graphs.reset()
            self.step_reads = {}
            self.graphed_cache = weakref.ref(ctx.cache)
        if key in self.step_graphs.recordings:
            output = self.step_graphs(key, forward, ctx.tokens, ctx.positions)
            for cap in self.step_reads[key]:
                self.count_reads(ctx.cache.host_lengths, cap)
            return output
        self.noted_reads = []
        try:
            output = self.step_graphs(key, forward, ctx.tokens, ctx.positions)
        finally:
            self.step_reads[key], self.noted_reads = self.noted_reads, None
        return output

    def attended_selection(self, layer: int, ctx: StepContext):
        """The index lists this step's `attend` read at `layer`, as (indices, counts, index_block) in
        kernels/sparse_decode_attention's form (token indices for index_block 1, key blocks of
        index_block tokens otherwise), or None where it read every key (dense always does). The recall
        diagnostics (nanodllm/recall.py) compare them with the step's oracle."""
        return None

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if ctx.cache is None:
            return attention(q, k, v, ctx.attn_mask)
        return attend_with_cache(layer, q, k, v, ctx.cache)

    def commit(self, model, ctx: StepContext) -> torch.Tensor:
        """Forward the clean block against the cache; its K/V, written after each row's cache,
        become part of the cache for rows with ctx.counts > 0. Returns the block's last hidden states."""
        attend = lambda layer, q, k, v: self.attend_commit(layer, q, k, v, ctx)  # attend_with_cache writes k, v
        forward = lambda tokens, positions: model.hidden(tokens, positions, attend)
        key = self.commit_key(ctx)
        hidden = forward(ctx.tokens, ctx.positions) if key is None else self.graphed(key, forward, ctx)
        ctx.cache.advance(ctx.counts)
        return hidden

    def attend_commit(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        """Attention of the commit forward; exact by default, as the reference does."""
        return attend_with_cache(layer, q, k, v, ctx.cache)


def attend_with_cache(layer: int, q, k, v, cache: KVCache) -> torch.Tensor:
    """The active block's queries against each row's cache plus the whole block (no mask inside
    the block). The block's K/V go to the scratch slots after each row's cache, so keys are read in
    place; slots past a row's own cache and block are not attended."""
    cache.write(layer, k, v)
    block = k.shape[2]
    return cache_attention(q, cache.keys[layer], cache.values[layer], cache.lengths + block, cache.max_length + block,
                           ragged=not cache.uniform, launch_length=cache.launch_length(block))


def top_positions(scores: torch.Tensor, width: int, counts: torch.Tensor):
    """The `width` best-scoring positions along the last dim, in position order, and which of them are
    among each row's first counts[...] by rank: (positions [..., width], kept [..., width] bool).
    counts broadcasts against scores' leading dims. A stable sort: ties go to the lower position, the
    same in any batch (torch.topk breaks them in no fixed order). Methods list a fixed width (a shape a
    CUDA graph can keep) and let each row keep its own count of it."""
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    positions, order = ranked.sort(dim=-1)
    ranks = torch.arange(width, device=scores.device)
    return positions, (ranks < counts[..., None]).expand_as(ranked).gather(-1, order)


def check_int(minimum: int, odd: bool = False, **knobs):
    """Knob validation: a ValueError naming the first knob that is not an integer >= minimum (and
    odd, if asked)."""
    for name, value in knobs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (odd and value % 2 == 0):
            raise ValueError(f"{name} must be {'an odd' if odd else 'an'} integer >= {minimum}, got {value!r}")


class Dense(Method):
    """The exact reference computation; every hook is the base one."""

    name = "dense"
