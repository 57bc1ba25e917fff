"""dLLM-Cache: reuse each layer's features of the canvas across denoising steps (masked engine).

Paper: Liu et al. 2025, "dLLM-Cache: accelerating diffusion large language models with adaptive
caching", https://arxiv.org/abs/2506.06295, as MaskKV (https://arxiv.org/abs/2510.09309, appendix
A.9, Algorithms 4-7) restates it and builds on it.
Idea: between denoising steps most of the canvas barely changes. Per layer the cache keeps the canvas's
K/V and, for each of the R response rows, what attention and the FFN added to its residual stream.
At step t of the generation (from 0):
    t % prompt_interval == 0     the prompt is forwarded again and its K/V replaced;
    t % response_interval == 0   every response row is recomputed;
    otherwise                    every response row's value is projected, and the floor(rho R) rows
                                 whose value moved most, 1 - cos(V_t, V_t-1), get fresh Q/K, attention
                                 and FFN; every other row adds its cached attention and FFN outputs.
Step 0 refreshes everything; a prompt-only refresh leaves the response's outputs as they are. Of the
prompt only K/V are kept (it is forwarded at refreshes only); on a shifted-logit model (Dream) the
first response logits read the prompt's last row as the last refresh left it. A subclass may keep a
part of the prompt's K/V, chosen at step 0 (prompt_kept: MaskKV, SnapKV).
Hooks: begin_block (block 0: a new generation), step (from the layer primitives), logits, step_kind
(the steps between prompt refreshes), kv_kept (what step 0 kept), rows_computed.
Equals dense token for token when prompt_interval = response_interval = 1. Heads split over ranks: each
drift test gathers the response's new and cached values of every KV head (two all-gathers per layer).
Knobs (paper defaults): prompt_interval T_p = 50, response_interval T_r = 5, rho = 0.25. The paper
decodes LLaDA with block length 8, a loop setting (--block-length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanodllm.kernels import value_drift

from ..attention import attention, use_kernels
from ..parallel import SINGLE, Group, group_of
from .base import Method, StepContext
from .common import check_int, overwrite, put_heads, put_rows, take_heads, take_rows


@dataclass
class LayerCache:
    """One layer's cached features. keys, values: [batch, kv_heads, kept prompt + R, head_dim], the kept
    prompt's first; key_mask: [batch, 1 or kv_heads, 1, keys] (False: hidden) or None; attn_out,
    mlp_out: [batch, R, hidden], what attention and the FFN added to each response row."""

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


class Plan(NamedTuple):
    refresh_prompt: bool
    recomputed: str  # the response rows given fresh attention and FFN: "all", "none" or "drifted"
    drifted: int  # how many drifted rows


def drifted_rows(values: torch.Tensor, cached_values: torch.Tensor, count: int, group: Group = SINGLE) -> torch.Tensor:
    """[batch, count] response rows whose values (all KV heads: gathered in order where ranks split them)
    have the lowest cosine to the cached ones, most drifted first; the new values replace the cached."""
    if group.world > 1:
        rows = drifted_rows(group.all_gather(values, dim=1), group.all_gather(cached_values, dim=1), count)
        cached_values.copy_(values)
        return rows
    if use_kernels(values):
        return value_drift.most_drifted(value_drift.value_drift(values, cached_values), count)
    return value_drift.most_drifted_reference(value_drift.value_drift_reference(values, cached_values), count)


def same_layout(cache: LayerCache, slots: int, key_mask: torch.Tensor | None) -> bool:
    """Whether `slots` keys per head (and key_mask) fit the cache's buffers as they are."""
    old_mask = cache.key_mask
    masks_fit = key_mask is None if old_mask is None else key_mask is not None and old_mask.shape == key_mask.shape
    return cache.keys.shape[2] == slots and masks_fit


class DllmCache(Method):
    name = "dllm_cache"
    engines = ("masked",)
    needs_bidirectional = True

    def __init__(self, prompt_interval: int = 50, response_interval: int = 5, rho: float = 0.25):
        check_int(1, prompt_interval=prompt_interval, response_interval=response_interval)
        if not 0 <= rho <= 1:
            raise ValueError(f"rho must be in [0, 1], got {rho!r}")
        self.prompt_interval, self.response_interval, self.rho = prompt_interval, response_interval, rho
        self.layers: list[LayerCache] = []
        self.kept: list = []  # per layer from step 0: the prompt tokens it keeps (indices, key mask), None: all
        self.prompt_padding = None  # [batch, 1, 1, prompt] key mask of the prompt, None without padding
        self.prompt_tail = None  # shifted-logit models: the prompt's last row's output at the last refresh

    def begin_block(self, ctx: StepContext):
        if ctx.block == 0:  # a new generation
            self.layers = []

    def plan(self, ctx: StepContext) -> Plan:
        refresh_prompt = ctx.t % self.prompt_interval == 0
        if ctx.t % self.response_interval == 0:
            return Plan(refresh_prompt, "all", 0)
        if refresh_prompt:
            return Plan(True, "none", 0)
        return Plan(False, "drifted", int(self.rho * (ctx.tokens.shape[1] - ctx.prompt_width)))

    def step_kind(self, ctx: StepContext):
        """Prompt refreshes read host numbers (padding, eviction); the steps between are of their plan."""
        plan = self.plan(ctx)
        return None if plan.refresh_prompt else plan

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        plan, width, self.group = self.plan(ctx), ctx.prompt_width, group_of(model)  # group: the ranks, if split
        if ctx.t == 0:  # step 0 attends to the whole prompt and chooses again what it keeps
            self.kept = []
        x_p = rope_p = None
        if plan.refresh_prompt:
            valid = ctx.valid[:, :width]  # one sync per refresh, not one per layer
            self.prompt_padding = None if bool(valid.all()) else valid[:, None, None, :]
            x_p, rope_p = model.embed(ctx.tokens[:, :width]), model.rope(ctx.positions[:, :width])
        x_r, rope_r = model.embed(ctx.tokens[:, width:]), model.rope(ctx.positions[:, width:])
        for i, layer in enumerate(model.layers):
            x_p, x_r = self.layer_step(i, layer, x_p, x_r, (rope_p, rope_r), plan, ctx)
        if x_p is not None:  # a shifted-logit model's first response logits read the prompt's last row
            self.prompt_tail = x_p[:, -1:].clone()
        return x_r

    def logits(self, model, hidden, ctx: StepContext) -> torch.Tensor:
        """From the response rows' hidden states."""
        width = ctx.prompt_width
        return model.head(hidden, ctx.logits_start - width, ctx.logits_stop - width, before=self.prompt_tail)

    def layer_step(self, i, layer, x_p, x_r, ropes, plan: Plan, ctx):
        """One layer. x_p: the prompt's hidden states at a prompt refresh, else None; ropes: the prompt's
        and the response's RoPE. Returns the layer's (x_p, x_r)."""
        rope_p, rope_r = ropes
        h_r = layer.attn_norm(x_r)
        if plan.recomputed == "all":
            q_r, k_r, v_r = layer.qkv(h_r, rope_r)
        elif plan.recomputed == "drifted":
            q_r, rows = self.refresh_drifted(self.layers[i], layer, h_r, rope_r, plan.drifted)
        if x_p is not None:
            q_p, k_p, v_p = layer.qkv(layer.attn_norm(x_p), rope_p)
            if plan.recomputed == "none":
                k_r, v_r = self.layers[i].response_kv()
            self.store(i, k_p, v_p, k_r, v_r)
        elif plan.recomputed == "all":
            for cached, fresh in zip(self.layers[i].response_kv(), (k_r, v_r)):
                cached.copy_(fresh)
        cache = self.layers[i]

        if x_p is not None:
            x_p = x_p + layer.out(attention(q_p, cache.keys, cache.values, cache.key_mask))
            x_p = x_p + layer.mlp(layer.mlp_norm(x_p))
        if plan.recomputed == "all":
            attn_out = layer.out(attention(q_r, cache.keys, cache.values, cache.key_mask))
            cache.attn_out = overwrite(cache.attn_out, attn_out)
            cache.mlp_out = overwrite(cache.mlp_out, layer.mlp(layer.mlp_norm(x_r + attn_out)))
            if ctx.t == 0:
                self.keep_part_of_prompt(i, q_p, q_r, ctx)
        elif plan.recomputed == "drifted" and plan.drifted:
            attn_rows = layer.out(attention(q_r, cache.keys, cache.values, cache.key_mask))
            put_rows(cache.attn_out, rows, attn_rows)
            put_rows(cache.mlp_out, rows, layer.mlp(layer.mlp_norm(take_rows(x_r, rows) + attn_rows)))
        x_r = x_r + cache.attn_out
        return x_p, x_r + cache.mlp_out

    def refresh_drifted(self, cache: LayerCache, layer, h_r, rope_r, count):
        """Fresh values for every response row; fresh keys (written in place) and queries for the
        `count` rows whose values drifted most. Returns (queries, rows)."""
        k_cached, v_cached = cache.response_kv()
        rows = drifted_rows(layer.value(h_r), v_cached, count, self.group)
        if not count:
            return None, rows
        q_rows, k_rows = layer.qk(take_rows(h_r, rows), rope_r.rows(rows))
        put_heads(k_cached, rows[:, None], k_rows)
        return q_rows, rows

    def store(self, i, k_p, v_p, k_r, v_r):
        """Layer i's key and value buffers: the prompt K/V it keeps, then the response's; written in
        place where they keep their shapes."""
        k_kept, v_kept, prompt_mask = self.keep_prompt(i, k_p, v_p)
        key_mask = None
        if prompt_mask is not None:
            key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(*prompt_mask.shape[:3], k_r.shape[2])], dim=3)
        old = self.layers[i] if i < len(self.layers) else None
        if old is not None and same_layout(old, k_kept.shape[2] + k_r.shape[2], key_mask):
            for buffer, kept, response in ((old.keys, k_kept, k_r), (old.values, v_kept, v_r)):
                buffer[:, :, : kept.shape[2]].copy_(kept)
                buffer[:, :, kept.shape[2] :].copy_(response)  # k_r may be this very view: a no-op then
            if key_mask is not None:
                old.key_mask.copy_(key_mask)
            return
        cache = LayerCache(torch.cat([k_kept, k_r], dim=2), torch.cat([v_kept, v_r], dim=2), key_mask,
                           None if old is None else old.attn_out, None if old is None else old.mlp_out)
        self.layers[i : i + 1] = [cache]  # replaces layer i's, or appends it

    def keep_prompt(self, i, k_p, v_p):
        """The prompt K/V layer i keeps, with their key mask (None: it hides nothing)."""
        kept = self.kept[i] if i < len(self.kept) else None
        if kept is None:
            return k_p, v_p, self.prompt_padding
        return take_heads(k_p, kept[0]), take_heads(v_p, kept[0]), kept[1]  # (indices, key mask)

    def keep_part_of_prompt(self, i, q_p, q_r, ctx):
        """Step 0, after layer i's exact attention: what of the prompt it keeps from now on, as
        (indices, key mask or None where it keeps every slot: decided once, no sync at refreshes)."""
        cache = self.layers[i]
        kept = self.prompt_kept(i, q_p, q_r, cache, ctx)
        self.kept.append(None if kept is None else (kept[0], None if bool(kept[1].all()) else kept[1]))
        if kept is not None:
            k_r, v_r = cache.response_kv()
            self.store(i, cache.keys[:, :, :cache.prompt_slots], cache.values[:, :, :cache.prompt_slots], k_r, v_r)

    def prompt_kept(self, i, q_p, q_r, cache: LayerCache, ctx) -> tuple | None:
        """The prompt tokens layer i keeps, as common.keep_top gives them, from step 0's queries of the
        prompt and the response ([batch, heads, rows, head_dim]); None: all of them."""
        return None

    def kv_kept(self, ctx: StepContext):
        """At step 0, where layers keep part of the prompt: the prompt K/V entries they keep, of all."""
        if ctx.t != 0 or all(part is None for part in self.kept):
            return None
        kept = sum(indices.numel() if mask is None else mask.sum() for indices, mask in self.kept)
        return kept, ctx.prompt_lengths.sum() * self.layers[0].keys.shape[1] * len(self.kept)

    def rows_computed(self, ctx: StepContext):
        """Canvas rows forwarded through the layers, of the whole canvas."""
        plan, response = self.plan(ctx), ctx.tokens.shape[1] - ctx.prompt_width
        fresh = {"all": response, "none": 0, "drifted": plan.drifted}[plan.recomputed]
        return (ctx.prompt_width if plan.refresh_prompt else 0) + fresh, ctx.tokens.shape[1]
