"""Prefix keys selected once per block, from one exact step's attention, and attended alone afterwards:
the mechanism of MAGE (methods/mage.py, which selects at the block's first step) and of SparseD as
MAGE's paper adapts it (methods/sparsed.py, which selects later).

At the block's capture step every layer past `exact_layers` attends exactly and ranks each row's
cached prefix keys, per KV head, by eq. 3 of MAGE's paper: the attention probability averaged over
the block's L queries and the G query heads of the group, the softmax taken over the row's prefix
alone (so every query's prefix probabilities sum to 1 and every query weighs the same):

    score_j = 1 / (G L) * sum over the group's heads h and block queries i of softmax(q_hi K^T)_j

It keeps the k best (sorted by position); the block's later steps attend to them plus the block's
own keys. The commit attends exactly unless sparse_commit.
On the kernels the capture step's decode keeps the block's keys in a key slice of their own
(kernels/decode_attention block_apart), kernels/key_scores merges the slices before it into the
prefix-only log-sum-exp and normalises by it (one more read of K), and the top-k runs on a second
stream, overlapped with the rest of the step (Algorithm 1), joined at the step's end; later steps run
kernels/sparse_decode_attention over the index lists. Elsewhere the same in torch.
The selection tensors persist across blocks, overwritten in place, so a step recorded in one block
reads the next block's selection.
"""

from __future__ import annotations

import torch

from kernels.decode_attention import decode_partials, merge_splits
from kernels.key_scores import key_scores

from ..attention import attention_on_kernels
from .base import Method, StepContext, attend_with_cache
from .common import KeysRead, check_int, select_top_k, sparse_cache_attention


def block_scores(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor) -> torch.Tensor:
    """Scaled scores, fp32, [batch, num_kv_heads, G*L, max prefix + L], of every query row of the
    group against each row's prefix and the block's keys (right after the prefix in the cache); -inf
    at slots a row does not have. q: [batch, num_heads, L, D]; k_cache: [batch, capacity, kv_heads, D]."""
    batch, num_heads, block, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    n = int(prefix_lengths.max()) + block
    keys = k_cache[:, :n].transpose(1, 2).float()  # [batch, kv_heads, n, D]
    queries = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * block, head_dim)
    scores = (queries @ keys.transpose(-1, -2)) * head_dim**-0.5
    visible = torch.arange(n, device=q.device)[None, :] < (prefix_lengths + block)[:, None]  # [batch, n]
    return scores.masked_fill(~visible[:, None, None], float("-inf"))


def block_probabilities(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor) -> torch.Tensor:
    """Eq. 3 in torch: [batch, num_kv_heads, max prefix] mean probability of each prefix key under the
    block's queries, the softmax over the row's prefix alone; 0 past a row's prefix."""
    prefix = int(prefix_lengths.max())
    in_prefix = torch.arange(prefix, device=q.device)[None, :] < prefix_lengths[:, None]  # [batch, prefix]
    visible = in_prefix[:, None, None]
    scores = block_scores(q, k_cache, prefix_lengths)[..., :prefix].masked_fill(~visible, float("-inf"))
    probs = torch.where(visible, scores.softmax(-1), 0.0)  # an empty prefix's NaNs dropped
    return probs.mean(2)


class BlockSelection(Method):
    """Subclasses say at which step of a block the selection is made (capture_step)."""

    engines = ("block",)

    def __init__(self, k: int, exact_layers: int, sparse_commit: bool, side_stream: bool = True):
        super().__init__()
        check_int(1, k=k)
        check_int(0, exact_layers=exact_layers)
        self.k, self.exact_layers, self.sparse_commit, self.side_stream = k, exact_layers, sparse_commit, side_stream
        self.stream = None  # the CUDA side stream, created on first use
        self.forked = False  # this step put selections on the side stream: step joins it
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (indices, counts)
        self.selected = False  # this block's capture step has run with a prefix to select from
        self.reads = KeysRead()
        self.stats = {"kv_kept": 1.0}

    def capture_step(self, ctx: StepContext) -> int:
        raise NotImplementedError

    def begin_block(self, ctx: StepContext):
        self.selected = False
        if ctx.block == 0:  # a new generation
            self.selection = {}

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        hidden = super().step(model, ctx)
        if self.forked:  # join: the selections are ready before anyone reads them
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False
        return hidden

    def end_step(self, ctx: StepContext):
        capture, cache = self.capture_step(ctx), ctx.cache
        sparse = ctx.step > capture and self.selected
        exact_calls = min(self.exact_layers, len(cache.keys)) if sparse else len(cache.keys)
        self.reads.count(self.stats, cache.host_lengths, exact_calls)
        if sparse:
            self.reads.count(self.stats, cache.host_lengths, len(cache.keys) - exact_calls, cap=self.k)
        if ctx.step == capture:
            self.selected = cache.max_length > 0

    def step_kind(self, ctx: StepContext):
        """The exact steps before the capture step, the capture step (its side stream forks and joins
        inside it), and the sparse steps after it, which read the selection tensors."""
        if ctx.phase == "commit":
            return (self.sparse_commit and self.selected,)
        capture = self.capture_step(ctx)
        if ctx.step <= capture:
            return ("exact" if ctx.step < capture else "select",)
        return ("selected", self.selected)

    def attended_selection(self, layer: int, ctx: StepContext):
        """The block's selection past the exact layers from the capture step on, as (indices, counts,
        index_block) (nanodllm/recall.py); None where this step attended exactly."""
        if layer < self.exact_layers or ctx.step < self.capture_step(ctx) or layer not in self.selection:
            return None
        return (*self.selection[layer], 1)

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if ctx.cache is None:
            raise ValueError(f"{self.name} runs on the block engine (it needs the KV cache of the prefix)")
        if ctx.phase == "prefill":
            return super().attend(layer, q, k, v, ctx)
        if ctx.phase == "commit":
            if self.sparse_commit and layer >= self.exact_layers and self.selected:
                return self.attend_selected(layer, q, k, v, ctx)
            return attend_with_cache(layer, q, k, v, ctx.cache)
        if layer < self.exact_layers or ctx.step < self.capture_step(ctx):
            return attend_with_cache(layer, q, k, v, ctx.cache)
        if ctx.step == self.capture_step(ctx) or not self.selected:
            return self.attend_and_select(layer, q, k, v, ctx)
        return self.attend_selected(layer, q, k, v, ctx)

    def attend_and_select(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        """Exact attention, and the layer's selection from its probabilities."""
        cache = ctx.cache
        if cache.max_length == 0:
            return attend_with_cache(layer, q, k, v, cache)
        if not attention_on_kernels(q):
            out = attend_with_cache(layer, q, k, v, cache)
            scores = block_probabilities(q, cache.keys[layer], cache.lengths)
            self.keep(layer, *select_top_k(scores, cache.lengths, self.k, on_kernels=False))
            return out
        cache.write(layer, k, v)
        block = k.shape[2]
        partials = decode_partials(q, cache.keys[layer], cache.values[layer], cache.lengths + block,
                                   max_length=cache.launch_length(block), block_apart=True)
        out, _ = merge_splits(*partials, q)
        self.select_on_side_stream(layer, q, partials[1], cache)
        return out

    def keep(self, layer: int, indices: torch.Tensor, counts: torch.Tensor):
        """Store a layer's new selection, into its tensors of earlier blocks if the width is the same.
        The width is min(k, the cache's launch bound), which is part of every step's key and never
        shrinks within a generation, so a recorded step never reads tensors replaced after it."""
        kept = self.selection.get(layer)
        if kept is None or kept[0].shape != indices.shape:
            self.selection[layer] = (indices, counts)
            return
        kept[0].copy_(indices)
        kept[1].copy_(counts)

    def select_on_side_stream(self, layer: int, q, part_lse, cache):
        """Key scores normalised by the prefix-only LSE (key_scores merges it from the decode pass's
        partial LSEs), then the top-k, on a second stream; the kernels are the same either way."""
        width = cache.launch_length(q.shape[2])  # >= the longest prefix, a shape that lasts many blocks
        select = lambda: select_top_k(key_scores(q, cache.keys[layer], cache.lengths, part_lse=part_lse,
                                                 max_length=width), cache.lengths, self.k, on_kernels=True)
        if not (self.side_stream and q.is_cuda):
            self.keep(layer, *select())
            return
        main = torch.cuda.current_stream(q.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=q.device)
        self.stream.wait_stream(main)
        self.forked = True
        with torch.cuda.stream(self.stream):
            self.keep(layer, *select())
        for tensor in (q, part_lse, cache.lengths):  # memory crossing streams is not reused before both are done
            tensor.record_stream(self.stream)
        for tensor in self.selection[layer]:
            tensor.record_stream(main)

    def attend_selected(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        cache = ctx.cache
        cache.write(layer, k, v)
        indices, counts = self.selection[layer]
        return sparse_cache_attention(q, k, v, cache.keys[layer], cache.values[layer], cache.lengths, indices, counts)
