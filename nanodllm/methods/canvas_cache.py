"""The cached canvas of dLLM-Cache (methods/dllm_cache.py), and the prompt eviction that MaskKV and
SnapKV (methods/maskkv.py, snapkv.py) add to it. Masked engine.

Per layer the cache keeps the K/V of the canvas and, for the response (the generated region, R rows),
what attention and the FFN added to each row's residual stream. At step t (counted over the whole
generation, from 0):
    t % prompt_interval == 0     the prompt rows are forwarded again and their K/V replaced;
    t % response_interval == 0   every response row is recomputed;
    otherwise                    the value projection of every response row is computed, and the
                                 floor(rho * R) rows whose value moved most, 1 - cos(V_t, V_t-1), get
                                 fresh Q/K, attention and FFN; every other row adds its cached
                                 attention and FFN outputs to its new residual stream.
A prompt-only refresh leaves the response rows' cached outputs as they are. Prompt rows are forwarded
only at prompt refreshes, so of the prompt only K/V are kept; the engine asks for the active block's
logits only. Step 0 refreshes everything. On a shifted-logit model (Dream) the first response logits
read the prompt's last row as the last prompt refresh left it.

Steps between prompt refreshes have fixed shapes and no host syncs: each is of a kind (step_kind),
and refreshes write the cached K/V and outputs in place wherever their shapes allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import value_drift

from ..attention import attention, use_kernels
from .base import Method, StepContext
from .common import check_int, overwrite, put_heads, put_rows, take_heads, take_rows


@dataclass
class LayerCache:
    """One layer's cached features. keys/values: [batch, kv_heads, kept prompt + R, head_dim], the
    kept prompt K/V first, the response's after them; key_mask: [batch, 1 or kv_heads, 1, keys]
    (False = hidden: prompt padding, unused slots) or None; attn_out, mlp_out: [batch, R, hidden], what
    attention and the FFN added to each response row."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor | None
    attn_out: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None

    @property
    def prompt_slots(self) -> int:
        return self.keys.shape[2] - self.attn_out.shape[1]

    def response_kv(self):
        """Views of the response part of the key and value buffers."""
        return self.keys[:, :, self.prompt_slots:], self.values[:, :, self.prompt_slots:]


def same_layout(cache: LayerCache, slots: int, key_mask: torch.Tensor | None) -> bool:
    """Whether `slots` keys per head (and key_mask) fit the cache's buffers as they are."""
    if cache.keys.shape[2] != slots or (cache.key_mask is None) != (key_mask is None):
        return False
    return key_mask is None or cache.key_mask.shape == key_mask.shape


def drifted_rows(values: torch.Tensor, cached_values: torch.Tensor, count: int) -> torch.Tensor:
    """[batch, count] indices of the response rows whose value vectors (all KV heads together) have the
    lowest cosine similarity to the cached ones, most drifted first (ties: the lower row); the cached
    values are then replaced by the new ones (kernels/value_drift.py)."""
    if use_kernels(values):
        return value_drift.most_drifted(value_drift.value_drift(values, cached_values), count)
    return value_drift.most_drifted_reference(value_drift.value_drift_reference(values, cached_values), count)


class CanvasCache(Method):
    engines = ("masked",)

    def __init__(self, prompt_interval: int, response_interval: int, rho: float):
        super().__init__()
        check_int(1, prompt_interval=prompt_interval, response_interval=response_interval)
        if not 0 <= rho <= 1:
            raise ValueError(f"rho must be in [0, 1], got {rho!r}")
        self.prompt_interval, self.response_interval, self.rho = prompt_interval, response_interval, rho
        self.layers: list[LayerCache] = []
        self.t = 0
        self.rows_computed = self.rows_total = 0
        self.layouts = 0  # times the K/V buffers were replaced (a step's kind names the current ones)
        self.prompt_tail = None  # shifted-logit models: the prompt's last row's output at the last refresh
        self.prompt_padding = None  # [batch, 1, 1, prompt] key mask of the current refresh, None without padding

    def begin_block(self, ctx: StepContext):
        if ctx.block == 0:  # a new generation
            self.layers, self.t = [], 0

    def plan(self, ctx: StepContext):
        """(prompt width, whether the prompt is refreshed, which response rows get fresh attention and
        FFN: 'all', 'none' or 'drifted', how many drifted rows)."""
        prompt_width = ctx.logits_start - ctx.block * ctx.block_length
        refresh_prompt = self.t % self.prompt_interval == 0 or not self.layers
        refresh_response = self.t % self.response_interval == 0 or not self.layers
        drifted = 0 if refresh_response or refresh_prompt else int(self.rho * (ctx.tokens.shape[1] - prompt_width))
        if refresh_prompt and not refresh_response:
            return prompt_width, True, "none", drifted
        return prompt_width, refresh_prompt, "all" if refresh_response else "drifted", drifted

    def step_kind(self, ctx: StepContext):
        """Prompt refreshes read host numbers (padding, eviction); the steps between are kinds."""
        _, refresh_prompt, recomputed, drifted = self.plan(ctx)
        return None if refresh_prompt else (self.layouts, recomputed, drifted)

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        if ctx.attn_mask is not None and ctx.attn_mask.block_size is not None:
            raise ValueError(f"{self.name} caches a bidirectional canvas; this model is block-causal "
                             "(decode it with the block engine)")
        prompt_width, refresh_prompt, recomputed, drifted = self.plan(ctx)
        x_p = rope_p = None
        if refresh_prompt:
            valid = ctx.valid[:, :prompt_width]  # one sync per refresh, not one per layer
            self.prompt_padding = None if bool(valid.all()) else valid[:, None, None, :]
            x_p, rope_p = model.embed(ctx.tokens[:, :prompt_width]), model.rope(ctx.positions[:, :prompt_width])
        x_r, rope_r = model.embed(ctx.tokens[:, prompt_width:]), model.rope(ctx.positions[:, prompt_width:])
        for i, layer in enumerate(model.layers):
            x_p, x_r = self.layer_step(i, layer, x_p, x_r, rope_p, rope_r, recomputed, drifted, ctx)
        if x_p is not None:  # a shifted-logit model's first response logits read the prompt's last row
            self.prompt_tail = x_p[:, -1:].clone()
        return x_r

    def logits(self, model, hidden, ctx: StepContext) -> torch.Tensor:
        """From the response rows' hidden states."""
        prompt_width = ctx.tokens.shape[1] - hidden.shape[1]
        return model.head(hidden, ctx.logits_start - prompt_width, ctx.logits_stop - prompt_width,
                          before=self.prompt_tail)

    def end_step(self, ctx: StepContext):
        """stats['rows_computed']: canvas rows forwarded through the layers / rows a dense step forwards."""
        prompt_width, refresh_prompt, recomputed, drifted = self.plan(ctx)
        response_rows = ctx.tokens.shape[1] - prompt_width
        self.rows_computed += (prompt_width if refresh_prompt else 0) + {"all": response_rows, "none": 0,
                                                                         "drifted": drifted}[recomputed]
        self.rows_total += ctx.tokens.shape[1]
        self.stats["rows_computed"] = self.rows_computed / self.rows_total
        self.t += 1

    def layer_step(self, i, layer, x_p, x_r, rope_p, rope_r, recomputed, drifted, ctx):
        """One layer. x_p: the prompt's hidden states at a prompt refresh, else None. Returns the
        layer's (x_p, x_r)."""
        h_r = layer.attn_norm(x_r)
        if recomputed == "all":
            q_r, k_r, v_r = layer.qkv(h_r, rope_r)
        elif recomputed == "drifted":
            q_r, rows = self.refresh_drifted(self.layers[i], layer, h_r, rope_r, drifted)
        if x_p is not None:
            q_p, k_p, v_p = layer.qkv(layer.attn_norm(x_p), rope_p)
            if recomputed == "none":
                k_r, v_r = self.layers[i].response_kv()
            self.store_prompt(i, k_p, v_p, k_r, v_r, ctx, x_r.shape[1])
        elif recomputed == "all":
            k_cached, v_cached = self.layers[i].response_kv()
            k_cached.copy_(k_r)
            v_cached.copy_(v_r)
        cache = self.layers[i]

        if x_p is not None:
            x_p = x_p + layer.out(attention(q_p, cache.keys, cache.values, cache.key_mask))
            x_p = x_p + layer.mlp(layer.mlp_norm(x_p))
        if recomputed == "all":  # in place after the first time, so the steps' kinds stay valid
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

    def refresh_drifted(self, cache: LayerCache, layer, h_r, rope_r, count):
        """Fresh values for every response row; fresh keys (written in place) and queries for the
        `count` rows whose values drifted most. Returns (queries, rows)."""
        k_cached, v_cached = cache.response_kv()
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
        if old is not None and same_layout(old, slots, key_mask):  # in place: the steps' kinds stay valid
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
        queries ([batch, heads, rows, head_dim]); PromptEviction votes and evicts here."""


def keep_top(scores, counts, prompt_lengths):
    """Per (row, KV head) the counts[b, h] best prompt positions, in prompt order, padded.

    scores [batch, kv_heads, P] (left-padded prompts: row b's tokens are its last prompt_lengths[b]
    columns), counts [batch, kv_heads]. Returns (indices [batch, kv_heads, kmax], keep [batch,
    kv_heads, 1, kmax]: False at padding slots)."""
    width = scores.shape[2]
    columns = torch.arange(width, device=scores.device)
    real = columns[None, :] >= (width - prompt_lengths)[:, None]
    scores = scores.masked_fill(~real[:, None, :], float("-inf"))
    counts = torch.minimum(counts, prompt_lengths[:, None])
    kmax = max(int(counts.max()), 1)
    top = scores.topk(kmax, dim=-1).indices
    slots = torch.arange(kmax, device=scores.device)
    indices = torch.where(slots < counts[..., None], top, width).sort(dim=-1).values
    keep = indices < width
    return indices.clamp(max=width - 1), keep[:, :, None, :]


class PromptEviction(CanvasCache):
    """The cached canvas whose prompt K/V are evicted once, at step 0, to per-layer and per-head
    budgets: each layer scores the prompt tokens from its exact attention (token_scores), sizes each
    head's share (head_counts), keeps each head's best tokens in prompt order (keep_top), and from
    then on every step, prompt refreshes included, attends to the kept prompt K/V plus the response's.
    A row whose whole prompt fits the budget keeps all of it, as the cached canvas alone would. The
    full prompt KV is never stored past step 0; layer l's buffers hold, per head, as many prompt slots
    as its largest head keeps, the slots a smaller head does not use hidden."""

    def __init__(self, budget: int, prompt_interval: int, response_interval: int, rho: float):
        super().__init__(prompt_interval, response_interval, rho)
        check_int(1, budget=budget)
        self.budget = budget
        self.indices: list = []  # per layer: (indices, keep) of the kept prompt tokens
        self.prompt_masks: list = []  # per layer: keep as a key mask, None where every slot is kept
        self.evicting = False  # this generation's budget is below its longest prompt: some row evicts
        self.kept_sum = self.prompt_sum = self.head_rows = 0

    def token_scores(self, i, q_p, q_r, cache: LayerCache, ctx) -> torch.Tensor:
        """[batch, kv_heads, P]: how much layer i's heads want each prompt token."""
        raise NotImplementedError

    def head_counts(self, i, scores, ctx) -> torch.Tensor:
        """[batch, kv_heads]: how many prompt tokens each head of layer i keeps."""
        raise NotImplementedError

    def step(self, model, ctx):
        first = self.t == 0
        if first:
            self.indices, self.prompt_masks = [], []  # step 0 is exact and votes again
            self.evicting = self.budget < int(ctx.prompt_lengths.max())  # else nothing to evict
        hidden = super().step(model, ctx)
        if first and self.evicting:
            self.count_kept(ctx.prompt_lengths)
        return hidden

    def keep_prompt(self, i, k_p, v_p, ctx):
        if i >= len(self.indices):  # step 0: exact
            return super().keep_prompt(i, k_p, v_p, ctx)
        indices, _ = self.indices[i]
        return take_heads(k_p, indices), take_heads(v_p, indices), self.prompt_masks[i]

    def first_step_attention(self, i, q_p, q_r, ctx):
        """Score with the exact step-0 attention, size the heads' budgets, evict layer i's prompt KV."""
        if not self.evicting:
            return
        cache = self.layers[i]
        scores = self.token_scores(i, q_p, q_r, cache, ctx)
        fits = ctx.prompt_lengths <= self.budget  # such a row has nothing to evict: it keeps its whole prompt
        counts = torch.where(fits[:, None], ctx.prompt_lengths[:, None], self.head_counts(i, scores, ctx))
        indices, keep = keep_top(scores, counts, ctx.prompt_lengths)
        self.indices.append((indices, keep))
        self.prompt_masks.append(None if bool(keep.all()) else keep)  # decided once: no sync at refreshes
        k_r, v_r = cache.response_kv()
        k_p, v_p = cache.keys[:, :, :cache.prompt_slots], cache.values[:, :, :cache.prompt_slots]
        self.store_prompt(i, k_p, v_p, k_r, v_r, ctx, k_r.shape[2])

    def count_kept(self, prompt_lengths):
        """stats over the generations so far, after step 0 evicted every layer (each layer, row and KV
        head one entry): kv_kept = kept / prompt KV entries, kv_per_head = (kept, prompt); one sync."""
        layers, (batch, kv_heads) = len(self.indices), self.indices[0][0].shape[:2]
        self.kept_sum += int(sum(keep.sum() for _, keep in self.indices))
        self.prompt_sum += int(prompt_lengths.sum()) * kv_heads * layers
        self.head_rows += batch * kv_heads * layers
        self.stats["kv_kept"] = self.kept_sum / self.prompt_sum
        self.stats["kv_per_head"] = (self.kept_sum / self.head_rows, self.prompt_sum / self.head_rows)
