"""MAGE: select each block's important prefix keys once, from the all-[MASK] first step, and let the
block's later denoising steps attend only to them.

Paper: "MAGE" (../shared/papers/000_5b6af9b8bc57afd0.txt), block diffusion (SDAR, Fast-dLLM v2).
Idea: at the first denoising step of a block every query is [MASK] (except decoded tokens an engine puts
in the block: the prompt's tail in SDAR's first block, Fast-dLLM v2's first position), and the
keys those queries attend to are the ones the whole block keeps attending to (the paper's Fig. 3:
the step-1 top-k estimates later steps' top-k well). So step 1 runs exact attention and, per layer
and KV head, ranks the cached prefix keys by their attention probability averaged over the block's L
queries and the G query heads of the group (eq. 3):

    score_j = 1 / (G L) * sum over the group's heads h and block queries i of softmax(q_hi K^T)_j

where the softmax runs over the row's prefix alone (the paper's A is in R^{G x B x N}, N the prefix
length), so every query's prefix probabilities sum to 1 and every query weighs the same in the
mean. Normalising over the prefix and the block instead (the exact pass's own probabilities) would
weigh each query by its prefix share: on tiny-sdar (kv prompts at 2K / 4K, where the block's queries
give the prefix 0.89 / 0.94 of their attention) the two top-k sets share 0.91-0.97 of their keys at
k = 32-256. The k best keys per (row, KV head) are kept (sorted by position); steps 2..T attend to
those keys plus the block's own keys.

Hooks: begin_block (the block has no selection yet; the selection tensors persist, overwritten in
place, so that recorded steps read the new one), attend (exact + select at step 0, sparse afterwards),
attend_commit (exact by default, as the paper; `sparse_commit=True` reuses the selection).
On CUDA (bf16/fp16) step 1 is kernels/decode_attention with the block's keys in a key slice of
their own (block_apart), kernels/key_scores merges the slices before it into the prefix-only LSE
and normalises by it (one more read of K), and steps 2..T are kernels/sparse_decode_attention over
the index lists; on CPU the same computation runs in torch.

Equals dense: when k >= every row's prefix length the selection is the whole prefix, so every
step attends to every key: the same outputs up to float rounding (the gathered keys are a copy
of the cache, multiplied in another memory layout), the same tokens.

Knobs (paper defaults): k = 1024 keys per KV head (256 / 512 in the accuracy tables; scale it to
the context), exact_layers = 2 (the first two layers always attend exactly), sparse_commit = False,
side_stream = True.
On CUDA the scoring and top-k run on a second stream, overlapped with the FFN and the following
layers (Algorithm 1; side_stream = False keeps them on the main stream); end_step joins the streams.
"""

from __future__ import annotations

import torch

from .. import attention as attention_module
from ..attention import attention, use_kernels
from .base import Method, StepContext, attend_with_cache, check_int


def block_scores(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor) -> torch.Tensor:
    """Scaled scores, fp32, [batch, num_kv_heads, G*L, max prefix + L], of every query row of the
    group against each row's prefix and the block's keys (which sit right after the prefix in the
    cache); -inf at slots a row does not have. q: [batch, num_heads, L, D];
    k_cache: [batch, capacity, num_kv_heads, D]."""
    batch, num_heads, block, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    n = int(prefix_lengths.max()) + block
    keys = k_cache[:, :n].transpose(1, 2).float()  # [batch, kv_heads, n, D]
    queries = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * block, head_dim)
    scores = (queries @ keys.transpose(-1, -2)) * head_dim**-0.5
    visible = torch.arange(n, device=q.device)[None, :] < (prefix_lengths + block)[:, None]  # [batch, n]
    return scores.masked_fill(~visible[:, None, None], float("-inf"))


def block_probabilities(q: torch.Tensor, k_cache: torch.Tensor, prefix_lengths: torch.Tensor) -> torch.Tensor:
    """Eq. 3 in torch: [batch, num_kv_heads, max prefix] mean probability of each prefix key under
    the block's queries, the softmax taken over the row's prefix alone. 0 past a row's prefix (a row
    with no prefix is all 0)."""
    prefix = int(prefix_lengths.max())
    in_prefix = torch.arange(prefix, device=q.device)[None, :] < prefix_lengths[:, None]  # [batch, prefix]
    visible = in_prefix[:, None, None]
    scores = block_scores(q, k_cache, prefix_lengths)[..., :prefix].masked_fill(~visible, float("-inf"))
    probs = torch.where(visible, scores.softmax(-1), 0.0)  # an empty prefix's NaNs dropped
    return probs.mean(2)


def select_on_kernel(scores: torch.Tensor) -> bool:
    """Whether select_top_k runs on kernels/top_k.py (tests switch this on for the interpreter)."""
    return attention_module.KERNELS_ENABLED and scores.is_cuda


def select_top_k(scores: torch.Tensor, prefix_lengths: torch.Tensor, k: int):
    """Per (row, KV head) the k highest-scoring prefix positions, ascending, and how many are valid
    (min(k, prefix length)). Returns indices [batch, kv_heads, min(k, max prefix)] int32 (entries past
    counts point at slot 0 and are never read) and counts [batch, kv_heads] int32. On CUDA one radix
    select, no sort (kernels/top_k.py), elsewhere its torch reference (a stable sort): ties go to the
    lower position on both."""
    from kernels.top_k import top_k_positions, top_k_positions_reference

    select = top_k_positions if select_on_kernel(scores) else top_k_positions_reference
    return select(scores, prefix_lengths, k)


def listed_tokens(indices, counts, prefix_lengths, index_block: int = 1):
    """The index lists as prefix tokens: (tokens [batch, kv_heads, K * S] int64, selected: the same
    shape, True where the entry is within counts and the token within the row's prefix). Key blocks
    of S = index_block tokens are expanded (the batched form of kernels/sparse_decode_attention.selected_tokens)."""
    width = indices.shape[2]
    offsets = torch.arange(index_block, device=indices.device)
    tokens = (indices.long()[..., None] * index_block + offsets).flatten(2)
    listed = (torch.arange(width, device=indices.device) < counts[..., None]).repeat_interleave(index_block, dim=2)
    return tokens, listed & (tokens < prefix_lengths[:, None, None])


def sparse_cache_attention(q, k, v, k_cache, v_cache, prefix_lengths, indices, counts, index_block=1):
    """The block's queries against the selected prefix keys plus the block's own keys k, v
    ([batch, kv_heads, L, D], already written after each row's prefix in the cache). indices /
    counts as kernels/sparse_decode_attention takes them: token indices, or key blocks of
    index_block tokens (clipped to the prefix)."""
    if use_kernels(q):
        from kernels.sparse_decode_attention import sparse_decode_attention

        return sparse_decode_attention(q, k_cache, v_cache, prefix_lengths, indices, counts, index_block=index_block,
                                       return_lse=False)
    batch, num_kv_heads, _ = indices.shape
    tokens, selected = listed_tokens(indices, counts, prefix_lengths, index_block)
    rows = torch.arange(batch, device=q.device)[:, None, None]
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    tokens = torch.where(selected, tokens, 0)
    keys = torch.cat([k_cache[rows, tokens, heads], k], dim=2)  # [batch, kv_heads, width * S + L, D]
    values = torch.cat([v_cache[rows, tokens, heads], v], dim=2)
    mask = None
    if not bool(selected.all()):
        mask = torch.cat([selected, selected.new_ones(batch, num_kv_heads, k.shape[2])], dim=2)[:, :, None]
        if q.is_cuda:  # SDPA broadcasts a mask over query heads, not KV heads
            mask = mask.repeat_interleave(q.shape[1] // num_kv_heads, dim=1)
    return attention(q, keys, values, mask)


class Mage(Method):
    name = "mage"
    engines = ("block",)

    def __init__(self, k: int = 1024, exact_layers: int = 2, sparse_commit: bool = False, side_stream: bool = True):
        super().__init__()
        check_int(1, k=k)
        check_int(0, exact_layers=exact_layers)
        self.k, self.exact_layers, self.sparse_commit = k, exact_layers, sparse_commit
        self.side_stream = side_stream
        self.stream = None  # the CUDA side stream, created on first use
        self.forked = False  # this step put selections on the side stream: end_step must join it
        # layer -> (indices, counts): the same tensors block after block (a graph recorded in one block
        # reads the next block's selection), overwritten in place when the width is unchanged
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.selected = False  # this block's selecting step has run with a prefix to select from
        self.stats = {"kv_kept": 1.0}

    def begin_block(self, ctx: StepContext):
        self.selected = False
        if ctx.block == 0:  # a new generation
            self.selection = {}

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        logits = super().step(model, ctx)
        if ctx.step == self.capture_step(ctx):  # here, not in attend: a replayed step runs no Python inside
            self.selected = ctx.cache is not None and ctx.cache.max_length > 0
        return logits

    def end_step(self):
        if self.forked:  # join: the selections are ready before anyone reads them
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False

    def capture_step(self, ctx: StepContext) -> int:
        """The denoising step whose exact attention selects the keys (MAGE: the first)."""
        return 0

    def attended_selection(self, layer: int, ctx: StepContext):
        """The block's selection past the exact layers from the capture step on (that step attends
        exactly and makes it); None before (SparseD's exact steps hold the previous block's)."""
        if layer < self.exact_layers or ctx.step < self.capture_step(ctx) or layer not in self.selection:
            return None
        return (*self.selection[layer], 1)

    def graph_key(self, ctx: StepContext):
        """Three recordings: the exact steps before the selecting one (SparseD), the selecting step (its
        side stream forks and joins inside the recording, which overwrites the selection tensors), and
        the sparse steps after it, which read those tensors."""
        key, capture = super().graph_key(ctx), self.capture_step(ctx)
        if key is None:
            return None
        if ctx.step <= capture:
            return key + ("exact" if ctx.step < capture else "select",)
        return key + ("selected", self.selected)

    def commit_key(self, ctx: StepContext):
        key = super().commit_key(ctx)
        return None if key is None else key + (self.sparse_commit and self.selected,)

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if ctx.cache is None:
            raise ValueError(f"{self.name} runs on the block engine (it needs the KV cache of the prefix)")
        capture, lengths = self.capture_step(ctx), ctx.cache.host_lengths
        if layer < self.exact_layers or ctx.step < capture:
            self.count_reads(lengths)
            return attend_with_cache(layer, q, k, v, ctx.cache)
        if ctx.step == capture or not self.selected:
            self.count_reads(lengths)
            return self.attend_and_select(layer, q, k, v, ctx)
        self.count_reads(lengths, cap=self.k)
        return self.attend_selected(layer, q, k, v, ctx)

    def attend_commit(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        if self.sparse_commit and layer >= self.exact_layers and self.selected:
            return self.attend_selected(layer, q, k, v, ctx)
        return attend_with_cache(layer, q, k, v, ctx.cache)

    def attend_and_select(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        """Exact attention, and the layer's selection from its probabilities."""
        cache = ctx.cache
        if cache.max_length == 0:
            return attend_with_cache(layer, q, k, v, cache)
        if use_kernels(q):
            from kernels.decode_attention import decode_partials, merge_splits

            cache.write(layer, k, v)
            block = k.shape[2]
            partials = decode_partials(q, cache.keys[layer], cache.values[layer], cache.lengths + block,
                                       max_length=cache.launch_length(block), block_apart=True)
            out, _ = merge_splits(*partials, q)
            self.select_on_side_stream(layer, q, partials[1], cache)
            return out
        out = attend_with_cache(layer, q, k, v, cache)
        self.keep(layer, *select_top_k(block_probabilities(q, cache.keys[layer], cache.lengths), cache.lengths, self.k))
        return out

    def keep(self, layer: int, indices: torch.Tensor, counts: torch.Tensor):
        """Store a layer's new selection: into its tensors of earlier blocks if the width is the same.
        The width is min(k, the cache's launch bound), which is in every graph key and never shrinks
        within a generation, so a recording never replays over tensors replaced after it was made."""
        kept = self.selection.get(layer)
        if kept is None or kept[0].shape != indices.shape:
            self.selection[layer] = (indices, counts)
            return
        kept[0].copy_(indices)
        kept[1].copy_(counts)

    def select_on_side_stream(self, layer: int, q, part_lse, cache):
        """Key scores normalised by the prefix-only LSE (which key_scores merges from the decode
        pass's partial LSEs), then top-k (Algorithm 1): on a second stream, so the layer's FFN and
        the next layers run meanwhile; end_step joins the streams. The kernels and the top-k are the
        same either way, so the selection does not depend on the stream."""
        from kernels.key_scores import key_scores

        width = cache.launch_length(q.shape[2])  # >= the longest prefix, a shape that lasts many blocks
        select = lambda: select_top_k(key_scores(q, cache.keys[layer], cache.lengths, part_lse=part_lse,
                                                 max_length=width), cache.lengths, self.k)
        if not (self.side_stream and q.is_cuda):
            self.keep(layer, *select())
            return
        main = torch.cuda.current_stream(q.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=q.device)
        self.stream.wait_stream(main)
        self.forked = True
        with torch.cuda.stream(self.stream):
            indices, counts = select()
            self.keep(layer, indices, counts)
        for tensor in (q, part_lse, cache.lengths):  # memory crossing streams is not reused before both are done
            tensor.record_stream(self.stream)
        for tensor in self.selection[layer]:
            tensor.record_stream(main)

    def attend_selected(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        cache = ctx.cache
        cache.write(layer, k, v)
        indices, counts = self.selection[layer]
        return sparse_cache_attention(q, k, v, cache.keys[layer], cache.values[layer], cache.lengths, indices,
                                      counts)
