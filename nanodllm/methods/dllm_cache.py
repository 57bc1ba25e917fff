"""dLLM-Cache: reuse each layer's features of the canvas across denoising steps (masked engine).

Paper: Liu et al. 2025, "dLLM-Cache: accelerating diffusion large language models with adaptive
caching", in the form MaskKV (../shared/papers/001_11756cf7236fadd5.txt, appendix A.9, Algorithms
4-7) restates and builds on.

Idea. Between two denoising steps most of the canvas barely changes. Per layer the method keeps the
K/V of the canvas and, for the response (the generated region, R tokens), what attention and the FFN
added to each row's residual stream. At step t (counted over the whole generation, from 0):
    t % prompt_interval == 0     the prompt rows are forwarded again and their K/V replaced;
    t % response_interval == 0   every response row is recomputed;
    otherwise                    the value projection of every response row is computed, and the
                                 floor(rho * R) rows whose value moved most, 1 - cos(V_t, V_t-1),
                                 get fresh Q/K, attention and FFN; every other row adds its cached
                                 attention and FFN outputs to its new residual stream.
A prompt-only refresh leaves the response rows' cached outputs as they are (Algorithm 5). Prompt
rows are forwarded only at prompt refreshes, since nothing else reads their hidden states, so of
the prompt only K/V are kept (MaskKV's prompt-state exclusion); the engine asks for the active block's
logits only (mask-only projection). Step 0 refreshes everything.

On a shifted-logit model (Dream) the first response logits read the prompt's last row, whose output
is kept from the last prompt refresh. On a GPU the steps between prompt refreshes (drift steps and
response refreshes), whose shapes are fixed, replay CUDA graphs of their layers (nanodllm/graphs.py);
for that, refreshes write the cached K/V and outputs in place whenever their shapes allow, and the
graphs are recorded again only when a buffer is replaced.

Hooks: begin_block (block 0 starts a new generation), step (the forward, from the layer primitives).
Subclasses decide which prompt K/V are kept (`keep_prompt`, MaskKV and SnapKV evict) and may look at
the exact first step (`first_step_attention`).
Equals dense token for token when prompt_interval = response_interval = 1.
Knobs (paper defaults): prompt_interval T_p = 50, response_interval T_r = 5, rho = 0.25. The paper
decodes LLaDA with block length 8, an engine setting (--block-length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attention
from ..graphs import StepGraphs
from ..model import use_fused
from .base import Method, StepContext, check_int


@dataclass
class LayerCache:
    """One layer's cached features. keys/values: [batch, kv_heads, kept prompt + R, head_dim], the
    kept prompt K/V first, the response's after them (written in place); key_mask: [batch, 1 or
    kv_heads, 1, keys] (False = hidden: prompt padding, unused slots) or None; attn_out, mlp_out:
    [batch, R, hidden], what attention and the FFN added to each response row."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor | None
    attn_out: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None

    @property
    def prompt_slots(self) -> int:
        return self.keys.shape[2] - self.attn_out.shape[1]


def same_layout(cache: LayerCache, slots: int, key_mask: torch.Tensor | None) -> bool:
    """Whether `slots` keys per head (and key_mask) fit the cache's buffers as they are; the batch and
    head shapes never change within a generation."""
    if cache.keys.shape[2] != slots or (cache.key_mask is None) != (key_mask is None):
        return False
    return key_mask is None or cache.key_mask.shape == key_mask.shape


def flat_rows(rows: torch.Tensor, t: int) -> torch.Tensor:
    """rows [batch, n] of tensors with t rows per sequence -> [batch * n] indices into their flattened
    [batch * t] rows (take_rows' index; a caller taking several tensors at the same rows computes it once)."""
    batch = rows.shape[0]
    return (rows if batch == 1 else rows + torch.arange(0, batch * t, t, device=rows.device)[:, None]).flatten()


def take_rows(x: torch.Tensor, rows: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """x [batch, t, ...], rows [batch, n] -> x at those rows, [batch, n, ...]; flat: flat_rows(rows, t)
    where the caller has it. Where x's batch and row dims flatten into one (a contiguous x does), one
    index_select copies whole rows; a gather reads an int64 index per element instead (five times the
    bytes of bf16 rows: DyLLM's three row gathers per layer took ~180 us at batch 16, 25%, on an H100)."""
    batch, t = x.shape[:2]
    if batch == 1 or x.stride(0) == t * x.stride(1):
        flat = flat_rows(rows, t) if flat is None else flat
        return x.flatten(0, 1).index_select(0, flat).view(*rows.shape, *x.shape[2:])
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def put_rows(x: torch.Tensor, rows: torch.Tensor, src: torch.Tensor):
    """x[b, rows[b, j]] = src[b, j] in place (x [batch, t, ...])."""
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    x.scatter_(1, index, src)


def heads_index(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """index [batch, 1 or heads, k] expanded to gather/scatter x [batch, heads, n, ...] along n."""
    return index.view(*index.shape, *([1] * (x.dim() - 3))).expand(-1, x.shape[1], -1, *x.shape[3:])


def take_heads(x: torch.Tensor, index: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """x [batch, heads, n, ...] at positions index [batch, 1 (shared) or heads, k] -> [batch, heads, k, ...].
    A shared index takes rows of the [batch, n, heads, ...] view (take_rows, flat as it takes it): whole
    rows where x is stored token-major, as projected queries are; the result is then a view in that layout."""
    if index.shape[1] == 1:
        return take_rows(x.transpose(1, 2), index[:, 0], flat).transpose(1, 2)
    return x.gather(2, heads_index(x, index))


def put_heads(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor):
    """x[b, h, index[b, h, j]] = src[b, h, j] in place (index shared over heads when its dim 1 is 1)."""
    x.scatter_(2, heads_index(x, index), src)


def drifted_rows(values: torch.Tensor, cached_values: torch.Tensor, count: int) -> torch.Tensor:
    """[batch, count] indices of the response rows whose value vectors (all KV heads together) have
    the lowest cosine similarity to the cached ones, most drifted first (ties: the lower row); the
    cached values are then replaced by the new ones. Two small launches on a GPU
    (kernels/value_drift.py), the torch reference elsewhere."""
    from kernels import value_drift as kernels

    if use_fused(values):
        return kernels.most_drifted(kernels.value_drift(values, cached_values), count)
    return kernels.most_drifted_reference(kernels.value_drift_reference(values, cached_values), count)


def overwrite(buffer: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """value written into buffer when it has value's shape (same storage), else value itself."""
    if buffer is None or buffer.shape != value.shape:
        return value
    return buffer.copy_(value)


class DllmCache(Method):
    name = "dllm_cache"
    engines = ("masked",)

    def __init__(self, prompt_interval: int = 50, response_interval: int = 5, rho: float = 0.25):
        super().__init__()
        check_int(1, prompt_interval=prompt_interval, response_interval=response_interval)
        if not 0 <= rho <= 1:
            raise ValueError(f"rho must be in [0, 1], got {rho!r}")
        self.prompt_interval, self.response_interval, self.rho = prompt_interval, response_interval, rho
        self.layers: list[LayerCache] = []
        self.t = 0
        self.rows_computed = self.rows_total = 0
        self.layouts = 0  # times the K/V buffers were replaced (recorded steps read the current ones)
        self.prompt_tail = None  # shifted-logit models: the prompt's last row's output at the last refresh
        self.prompt_padding = None  # [batch, 1, 1, prompt] key mask of the current refresh, None without padding
        self.graphs = StepGraphs(size=2)  # drift and response-refresh steps, valid until the next prompt refresh

    def begin_block(self, ctx: StepContext):
        if ctx.block == 0:  # a new generation
            self.layers, self.t = [], 0
            self.graphs.reset()

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        if ctx.attn_mask is not None and ctx.attn_mask.block_size is not None:
            raise ValueError(f"{self.name} caches a bidirectional canvas; this model is block-causal "
                             "(decode it with the block engine)")
        prompt_width = ctx.logits_start - ctx.block * ctx.block_length
        refresh_prompt = self.t % self.prompt_interval == 0 or not self.layers
        refresh_response = self.t % self.response_interval == 0 or not self.layers
        response_rows = ctx.tokens.shape[1] - prompt_width
        drifted = 0 if refresh_response or refresh_prompt else int(self.rho * response_rows)
        if refresh_prompt and not refresh_response:
            recomputed = "none"
        else:
            recomputed = "all" if refresh_response else "drifted"

        stop = (ctx.logits_start - prompt_width, ctx.logits_stop - prompt_width)
        tokens_r, positions_r = ctx.tokens[:, prompt_width:], ctx.positions[:, prompt_width:]
        if refresh_prompt:
            valid = ctx.valid[:, :prompt_width]  # one sync per refresh, not one per layer
            self.prompt_padding = None if bool(valid.all()) else valid[:, None, None, :]
            prompt = ctx.tokens[:, :prompt_width], ctx.positions[:, :prompt_width]
            x_r = self.forward(model, *prompt, tokens_r, positions_r, recomputed, drifted, ctx)
        else:  # drift steps and response refreshes: shapes fixed, no host syncs, so CUDA graphs
            forward = lambda tokens, positions: self.forward(model, None, None, tokens, positions, recomputed,
                                                             drifted, ctx)
            key = (self.layouts, recomputed, drifted, tuple(tokens_r.shape))
            x_r = self.graphs(key, forward, tokens_r, positions_r)
        logits = model.head(x_r, *stop, before=self.prompt_tail)
        self.count_rows(prompt_width if refresh_prompt else 0,
                        {"all": response_rows, "none": 0, "drifted": drifted}[recomputed], ctx.tokens.shape[1])
        self.t += 1
        return logits

    def forward(self, model, tokens_p, positions_p, tokens_r, positions_r, recomputed, drifted, ctx):
        """The layers over the response rows (and the prompt's, given its tokens); returns the
        response rows' hidden states."""
        x_r, rope_r = model.embed(tokens_r), model.rope(positions_r)
        x_p = rope_p = None
        if tokens_p is not None:
            x_p, rope_p = model.embed(tokens_p), model.rope(positions_p)
        for i, layer in enumerate(model.layers):
            x_p, x_r = self.layer_step(i, layer, x_p, x_r, rope_p, rope_r, recomputed, drifted, ctx)
        if x_p is not None:  # a shifted-logit model's first response logits read the prompt's last row
            self.prompt_tail = x_p[:, -1:]
        return x_r

    def layer_step(self, i, layer, x_p, x_r, rope_p, rope_r, recomputed, drifted, ctx):
        """One layer. x_p: the prompt's hidden states at a prompt refresh, else None; recomputed:
        which response rows get fresh attention and FFN ('all', 'none' or 'drifted': the `drifted`
        rows whose value moved most). Returns the layer's (x_p, x_r)."""
        h_r = layer.attn_norm(x_r)
        if recomputed == "all":
            q_r, k_r, v_r = layer.qkv(h_r, rope_r)
        elif recomputed == "drifted":
            q_r, rows = self.refresh_drifted(self.layers[i], layer, h_r, rope_r, drifted)
        if x_p is not None:
            q_p, k_p, v_p = layer.qkv(layer.attn_norm(x_p), rope_p)
            if recomputed == "none":
                k_r, v_r = self.response_kv(self.layers[i])
            self.store_prompt(i, k_p, v_p, k_r, v_r, ctx, x_r.shape[1])
        elif recomputed == "all":
            k_cached, v_cached = self.response_kv(self.layers[i])
            k_cached.copy_(k_r)
            v_cached.copy_(v_r)
        cache = self.layers[i]

        if x_p is not None:
            x_p = x_p + layer.out(attention(q_p, cache.keys, cache.values, cache.key_mask))
            x_p = x_p + layer.mlp(layer.mlp_norm(x_p))
        if recomputed == "all":  # in place after the first time, so a captured drift step stays valid
            attn_out = layer.out(attention(q_r, cache.keys, cache.values, cache.key_mask))
            cache.attn_out = overwrite(cache.attn_out, attn_out)
            cache.mlp_out = overwrite(cache.mlp_out, layer.mlp(layer.mlp_norm(x_r + attn_out)))
            if self.t == 0:
                self.first_step_attention(i, q_p, q_r, ctx)
        elif recomputed == "drifted" and drifted:
            attn_rows = layer.out(attention(q_r, cache.keys, cache.values, cache.key_mask))
            put_rows(cache.attn_out, rows, attn_rows)
            put_rows(cache.mlp_out, rows, layer.mlp(layer.mlp_norm(take_rows(x_r, rows) + attn_rows)))
        x_r = x_r + cache.attn_out
        return x_p, x_r + cache.mlp_out

    @staticmethod
    def response_kv(cache: LayerCache):
        """Views of the response part of a layer's key and value buffers."""
        return cache.keys[:, :, cache.prompt_slots:], cache.values[:, :, cache.prompt_slots:]

    def refresh_drifted(self, cache, layer, h_r, rope_r, count):
        """Algorithm 7: fresh values for every response row; fresh keys (written in place) and
        queries for the `count` rows whose values drifted most. Returns (queries, rows)."""
        k_cached, v_cached = self.response_kv(cache)
        rows = drifted_rows(layer.value(h_r), v_cached, count)
        if not count:
            return None, rows
        q_rows, k_rows = layer.qk(take_rows(h_r, rows), rope_r.rows(rows))
        put_heads(k_cached, rows[:, None], k_rows)
        return q_rows, rows

    def store_prompt(self, i, k_p, v_p, k_r, v_r, ctx, response_rows):
        """Build layer i's key/value buffers: the kept prompt K/V, then the response's."""
        k_kept, v_kept, prompt_mask = self.keep_prompt(i, k_p, v_p, ctx)
        key_mask = None
        if prompt_mask is not None:
            response_mask = prompt_mask.new_ones(*prompt_mask.shape[:3], response_rows)
            key_mask = torch.cat([prompt_mask, response_mask], dim=3)
        old = self.layers[i] if i < len(self.layers) else None
        slots = k_kept.shape[2] + k_r.shape[2]
        if old is not None and same_layout(old, slots, key_mask):  # in place: recorded steps stay valid
            for buffer, kept, response in ((old.keys, k_kept, k_r), (old.values, v_kept, v_r)):
                buffer[:, :, : kept.shape[2]].copy_(kept)
                buffer[:, :, kept.shape[2] :].copy_(response)  # k_r may be this very view: a no-op then
            if key_mask is not None:
                old.key_mask.copy_(key_mask)
            return
        self.layouts += 1
        cache = LayerCache(torch.cat([k_kept, k_r], dim=2), torch.cat([v_kept, v_r], dim=2), key_mask,
                           None if old is None else old.attn_out, None if old is None else old.mlp_out)
        if old is None:
            self.layers.append(cache)
        else:
            self.layers[i] = cache

    def keep_prompt(self, i, k_p, v_p, ctx):
        """The prompt K/V layer i keeps, with a key mask [batch, 1 or kv_heads, 1, kept], None when it
        would hide nothing: all of them here, padding hidden."""
        return k_p, v_p, self.prompt_padding

    def first_step_attention(self, i, q_p, q_r, ctx):
        """Called at step 0 after layer i's exact attention, with the prompt's and the response's
        queries ([batch, heads, rows, head_dim]); MaskKV and SnapKV vote and evict here."""

    def count_rows(self, prompt_rows, response_rows, total):
        """stats['rows_computed']: canvas rows forwarded through the layers / rows a dense step forwards."""
        self.rows_computed += prompt_rows + response_rows
        self.rows_total += total
        self.stats["rows_computed"] = self.rows_computed / self.rows_total
