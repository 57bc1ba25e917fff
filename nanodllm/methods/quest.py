"""Quest adapted to block diffusion: every denoising step estimates the block's important pages of
the prefix from per-page key bounds and attends to the best pages only.

Paper: Quest (Tang et al., ICML 2024, https://arxiv.org/abs/2406.10774), as MAGE's paper adapts it for
its per-block baseline (its §2 and §5: p = 16, re-estimated at every step).
Idea: split each row's cached prefix into pages of p keys and keep, per KV head, the channel-wise
min and max of each page's keys. For a query q the largest score any key of the page can reach is
bounded by  sum_d max(q_d * min_d, q_d * max_d). Per block (the B queries must share one key set per
KV head) the estimate is that bound averaged over the block's queries and the group's query heads,
as eq. 2 of the MAGE paper averages exact scores; since the bound is linear in q's positive and
negative parts, the average is  mean(q+) . max + mean(q-) . min  (q+ = max(q, 0), q- = min(q, 0)).
The top k / p pages are attended (with the block's own keys), at every step.

Page bounds are kept per layer and updated only from the first page a new block touched, at the
start of each block (outside the steps, which are all of one kind), so a step reads the bounds (2/p
of the K bytes) plus the selected pages, never the whole cache.

Hooks: begin_block (new bounds for a new generation, else brought up to date), attend (estimate +
sparse attention per step; the commit exact by default, with sparse_commit selecting from its own
queries), step_kind (every step of one kind), selection (the pages a layer read).
On CUDA (bf16/fp16) the pages go to kernels/sparse_decode_attention as key blocks of p tokens.
On DiffusionGemma: per canvas, on its full layers only (as MAGE).
Equals dense: k >= every row's prefix rounded up to whole pages (test).
Heads split over ranks: each KV head selects its own pages; nothing is communicated.
Knobs: k = 1024 keys per KV head (k / p pages), page_size p = 16, exact_layers = 2, sparse_commit False.
"""

from __future__ import annotations

import torch

from ..attention import use_kernels
from ..cache import KVCache
from .base import Method, Selection, StepContext
from .common import check_int, select_top_k, sparse_cache_attention


def page_bounds(keys: torch.Tensor, lengths: torch.Tensor, page_size: int):
    """Channel-wise min and max of each page of keys.

    keys: [batch, n, kv_heads, D] with n a multiple of page_size, slot 0 the first key of a page;
    lengths: [batch], how many of the n slots hold keys. Returns (low, high), each
    [batch, kv_heads, n / page_size, D] in the keys' dtype (min and max are keys' own values, so
    nothing rounds); pages with no key get 0."""
    batch, n, num_kv_heads, head_dim = keys.shape
    keys = keys.view(batch, n // page_size, page_size, num_kv_heads, head_dim)
    held = (torch.arange(n, device=keys.device)[None, :] < lengths[:, None]).view(batch, -1, page_size, 1, 1)
    low = torch.where(held, keys, float("inf")).amin(2)
    high = torch.where(held, keys, float("-inf")).amax(2)
    empty = ~held.any(2)
    zero = keys.new_zeros(())
    low, high = torch.where(empty, zero, low), torch.where(empty, zero, high)
    return low.transpose(1, 2), high.transpose(1, 2)


def page_scores(q: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads, pages]: the bound of each page's best score, averaged over the block's
    queries and the group's heads. q: [batch, num_heads, L, D]; low/high: [batch, kv_heads, pages, D]
    in the cache's dtype. The products accumulate in fp32 and each page's bound rounds to that dtype,
    so pages whose bounds agree to its precision tie and the top-k's tie rule (the lower page) picks
    among them; scoring in fp32 would convert the bounds at every step."""
    batch, num_heads, block, head_dim = q.shape
    num_kv_heads = low.shape[1]
    rows = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * block, head_dim)
    positive = rows.clamp(min=0).mean(2).to(high.dtype)  # [batch, kv_heads, D]
    negative = rows.clamp(max=0).mean(2).to(low.dtype)
    return (high @ positive[..., None] + low @ negative[..., None]).squeeze(-1).float()


class PageBounds:
    """One layer's page bounds over a KVCache, brought up to date from the first changed page."""

    def __init__(self, keys: torch.Tensor, cache: KVCache, page_size: int):
        """keys: the layer's cache keys [batch, capacity, kv_heads, D]."""
        pages = -(-cache.capacity // page_size)
        shape = (len(cache.host_lengths), keys.shape[2], pages, keys.shape[3])
        self.low, self.high = keys.new_zeros(shape), keys.new_zeros(shape)
        self.page_size = page_size
        self.summarised = [0] * len(cache.host_lengths)  # per row, keys the bounds include

    def update(self, keys: torch.Tensor, cache: KVCache):
        """keys: the layer's cache keys [batch, capacity, kv_heads, D]."""
        if self.summarised == cache.host_lengths:
            return
        p = self.page_size
        first = min(self.summarised) // p
        last = -(-cache.max_length // p)
        window = keys[:, first * p : last * p]
        if window.shape[1] < (last - first) * p:  # the cache's capacity is not a whole page
            window = torch.cat([window, window.new_zeros(window.shape[0], (last - first) * p - window.shape[1],
                                                         *window.shape[2:])], dim=1)
        low, high = page_bounds(window, (cache.lengths - first * p).clamp(min=0), p)
        self.low[:, :, first:last], self.high[:, :, first:last] = low, high
        self.summarised = list(cache.host_lengths)


class Quest(Method):
    name = "quest"
    engines = ("block", "gemma")

    def __init__(self, k: int = 1024, page_size: int = 16, exact_layers: int = 2, sparse_commit: bool = False):
        check_int(1, page_size=page_size)
        check_int(page_size, k=k)  # k / page_size pages are kept
        check_int(0, exact_layers=exact_layers)
        self.k, self.page_size, self.exact_layers, self.sparse_commit = k, page_size, exact_layers, sparse_commit
        self.bounds: dict[int, PageBounds] = {}  # layer -> bounds over the current generation's cache
        self.pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> this step's (indices, counts)

    def begin_block(self, ctx: StepContext):
        if ctx.block == 0:  # a new generation: a new cache, no pages chosen yet
            self.bounds, self.pages = {}, {}
        for layer, bounds in self.bounds.items():
            bounds.update(ctx.cache.keys[layer], ctx.cache)

    def step_kind(self, ctx: StepContext):
        return ()

    def selection(self, layer: int, ctx: StepContext) -> Selection | None:
        """The pages this step read at the layer: k / page_size whole pages at most (a kept last page
        may be partial); None at the exact layers."""
        if layer < self.exact_layers or ctx.cache.max_length == 0 or layer not in self.pages:
            return None
        return Selection(*self.pages[layer], index_block=self.page_size, most=self.k // self.page_size * self.page_size)

    def attend(self, layer: int, q, k, v, ctx: StepContext) -> torch.Tensor:
        cache = ctx.cache
        if cache is None:
            raise ValueError("quest runs on the block engine (it needs the KV cache of the prefix)")
        if ctx.phase == "prefill":
            return super().attend(layer, q, k, v, ctx)
        exact = layer < self.exact_layers or cache.max_length == 0
        if exact or (ctx.phase == "commit" and not self.sparse_commit):
            return cache.attend(layer, q, k, v)
        if layer not in self.bounds:
            self.bounds[layer] = PageBounds(cache.keys[layer], cache, self.page_size)
            self.bounds[layer].update(cache.keys[layer], cache)
        bounds = self.bounds[layer]
        num_pages = -(-cache.lengths // self.page_size)
        # every page up to the launch bound (a shape that lasts many blocks); pages past a row's are not chosen
        width = -(-cache.launch_length(k.shape[2]) // self.page_size)
        scores = page_scores(q, bounds.low[:, :, :width], bounds.high[:, :, :width])
        indices, counts = select_top_k(scores, num_pages, self.k // self.page_size, on_kernels=use_kernels(q))
        self.pages[layer] = (indices, counts)
        cache.write(layer, k, v)
        return sparse_cache_attention(q, k, v, cache.keys[layer], cache.values[layer], cache.lengths, indices, counts,
                                      index_block=self.page_size, scale=cache.scale)
