"""DyLLM: recompute only the salient rows, update the others approximately (masked engine).

Paper: "DyLLM: Efficient Diffusion LLM Inference via Saliency-based Token Selection and Partial
Attention", https://arxiv.org/abs/2603.08026 (appendix C, Algorithms 1-4).
Idea: between denoising steps most rows' attention context barely moves. After `full_steps` dense
steps caching, per layer, K, V, each row's attention context C (per head, before o_proj) with its
log-sum-exp, and each row's FFN output, steps are sparse: they feed the whole canvas every
`full_period`-th step and only the response otherwise, and per layer, given the salient rows S:
    Q for every fed row; fresh K, V for S only, dV = V_new[S] - V_old[S];
    rows in S: exact attention over all keys (and a fresh log-sum-exp);
    every other row: C = C_old + sum over j in S of min(exp(scale q k_j - lse_old), 1) dV_j, with its
        cached normaliser, no score matrix formed (kernels/approx_attention.py; the clamp at 1, a
        softmax weight's bound, keeps a stale normaliser from blowing a column up);
    the next S: the fed rows with cos(C, C_old) < tau over all heads (heads split: one all-gather a layer);
    every fed row adds o_proj(C); only the next S run the FFN, the others add their cached output.
A layer's S is the one the layer before chose (Algorithm 3); S entering layer 1 is the last layer's S
of the previous step plus the tokens unmasked since (assumed: Algorithm 1 does not say). With tau
alone a layer sizes S from its values (a host sync; listed in multiples of 64 rows), except in steps
feeding at most list_all_rows rows: they list every fed row, the salient ones marked (fixed shapes).
Hooks: step (from the layer primitives), logits, step_kind, rows_computed (S per layer).
Equals dense: tau > 1 (every row salient) with full_period = 1 (every step feeds the whole canvas).
Knobs (paper defaults): tau = 0.99 for LLaDA and 0.995 for Dream (None: by the model's type),
full_steps T_full = 4, full_period = 4; not in the paper: salient_fraction = None (S is that fraction
of the real fed rows, the lowest cosines), salient_cap = None (S at most that fraction; the paper's S
if fewer cross tau), list_all_rows = 256 (changes no output; 0 sizes every tau-only step's S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanodllm.kernels.approx_attention import approximate_attention, approximate_attention_reference
from nanodllm.kernels.row_scatter import put_rows_where, put_rows_where_reference
from nanodllm.kernels.salient_rows import WHOLE_ROW_MAX, salient_rows, salient_rows_reference, slot_map

from ..attention import attention_on_kernels, attention_with_lse, use_kernels
from ..parallel import group_of
from .base import Method, StepContext
from .common import check_int, flat_rows, overwrite, take_heads, take_rows

LLADA_TAU, DREAM_TAU = 0.99, 0.995  # the paper's choices (section 4.2.3, threshold sweep)


@dataclass
class LayerState:
    """One layer's caches over the canvas: keys/values [batch, kv_heads, N, d], context [batch,
    heads, N, d] (stored token-major, [batch, N, heads, d], so o_proj reads it without a copy),
    lse [batch, heads, N] (float32 or wider), mlp_out [batch, N, hidden]."""

    keys: torch.Tensor
    values: torch.Tensor
    context: torch.Tensor
    lse: torch.Tensor
    mlp_out: torch.Tensor


class Salient(NamedTuple):
    """A layer's salient rows: mask [batch, fed] bool; rows [batch, s] int64, listed (the salient ones
    first in index_rows, in row order in kernels/salient_rows.py); ok [batch, s]: which listed rows are
    salient; slots [batch, fed] int32: a salient row's place in the list, -1 for the others; flat
    [batch * s]: the listed rows in the flattened [batch * fed] rows (take_rows' index)."""

    mask: torch.Tensor
    rows: torch.Tensor
    ok: torch.Tensor
    slots: torch.Tensor
    flat: torch.Tensor

    @classmethod
    def listed(cls, mask, rows, ok, slots) -> "Salient":
        return cls(mask, rows, ok, slots, flat_rows(rows, mask.shape[1]))


@dataclass
class Fed:
    """What every layer of one sparse step shares about its fed rows: valid [batch, fed] (real rows),
    offset (the first fed column of the canvas: 0, or the prompt's width in a response-only step),
    k_valid (the keys' validity, None where all are real), list_fraction (the fraction of the real fed
    rows each layer lists its S at, or None: as many as there are, rounded up by capacity)."""

    valid: torch.Tensor
    offset: int
    k_valid: torch.Tensor | None
    list_fraction: float | None


def index_rows(mask: torch.Tensor, count: int | None = None):
    """[batch, n] bool -> (rows [batch, s] of the True entries first, in order; ok [batch, s]: which
    entries are real). s = count, else the largest count of True entries (at least 1; a host sync)."""
    if count is None:
        count = max(int(mask.sum(dim=1).max()), 1)
    rows = (~mask).to(torch.int8).argsort(dim=1, stable=True)[:, :count]
    return rows, mask.gather(1, rows)


def capacity(count: int, width: int, granule: int = 64) -> int:
    """count rounded up to a multiple of granule, at most width: few distinct sizes, few kinds."""
    return min(-(-max(count, 1) // granule) * granule, width)


def list_rows(mask: torch.Tensor, count: int | None = None):
    """index_rows' listing with its slot map: (mask, rows, ok, slots) as kernels/salient_rows.py gives them;
    without a count, as many as the largest count of True entries, rounded up by capacity (a host sync)."""
    if count is None:
        count = capacity(int(mask.sum(dim=1).max()), mask.shape[1])
    rows, ok = index_rows(mask, count)
    return mask, rows, ok, slot_map(rows, ok, mask.shape[1])


def approximate(q, keys, dv, columns, lse, context, merge):
    """Algorithm 4 with cached normalisers, the exact rows merged: context and lse updated in place;
    returns per-head [new.old, new.new, old.old]. Every listed column takes part: a listed row that is
    not salient has a zero value delta (put_where)."""
    on_kernels = attention_on_kernels(q) and lse.dtype == torch.float32
    update = approximate_attention if on_kernels else approximate_attention_reference
    return update(q, keys, dv, columns, counts=None, lse=lse, context=context, merge=merge)


def put_where(dst, rows, ok, src, delta=False):
    """dst[b, h, rows[b, j]] = src[b, h, j] where ok[b, j] (and src - old, 0 where not ok, if delta)."""
    scatter = put_rows_where if use_kernels(dst) else put_rows_where_reference
    return scatter(dst, rows, ok, src, delta)


class DyLLM(Method):
    name = "dyllm"
    engines = ("masked",)
    needs_bidirectional = True

    def __init__(self, tau: float | None = None, full_steps: int = 4, full_period: int = 4,
                 salient_fraction: float | None = None, salient_cap: float | None = None, list_all_rows: int = 256):
        check_int(1, full_steps=full_steps, full_period=full_period)
        check_int(0, list_all_rows=list_all_rows)
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau)):
            raise ValueError(f"tau must be a number (a cosine threshold; above 1 every row is salient), got {tau!r}")
        for name, value in (("salient_fraction", salient_fraction), ("salient_cap", salient_cap)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if salient_fraction is not None and salient_cap is not None:
            raise ValueError("salient_fraction fixes the salient set's size; salient_cap only bounds tau's: give one")
        self.tau, self.full_steps, self.full_period = tau, full_steps, full_period
        self.threshold = tau  # the tau in use: the knob, or the model type's paper default (step)
        self.salient_fraction, self.salient_cap, self.list_all_rows = salient_fraction, salient_cap, list_all_rows
        self.layers: list[LayerState] = []
        self.full_done = 0  # full steps so far: a sparse step's kind names the caches it reads
        self.salient = self.previous_tokens = self.prompt_tail = self.fractions = None

    def offset(self, ctx: StepContext) -> int:
        """The first fed column of a sparse step: 0 every full_period-th step, else the prompt's width."""
        return 0 if ctx.t % self.full_period == 0 else ctx.prompt_width

    def list_fraction(self, ctx: StepContext, offset: int) -> float | None:
        """The fraction of the real fed rows each layer of a sparse step lists its S at (Fed.list_fraction)."""
        if self.salient_fraction is not None or self.salient_cap is not None:
            return self.salient_cap if self.salient_fraction is None else self.salient_fraction
        return 1.0 if ctx.tokens.shape[0] * (ctx.tokens.shape[1] - offset) <= self.list_all_rows else None

    def plan(self, ctx: StepContext):
        """(offset, the first layer's listing width or None (sized from its values), whether every
        column is real, Fed.list_fraction) of a sparse step; host syncs."""
        offset = self.offset(ctx)
        fraction, all_valid = self.list_fraction(ctx, offset), bool(ctx.valid.all())
        if fraction is None:
            return offset, None, all_valid, None
        salient = (self.salient | (ctx.tokens != self.previous_tokens))[:, offset:] & ctx.valid[:, offset:]
        return offset, capacity(int(salient.sum(dim=1).max()), ctx.tokens.shape[1] - offset), all_valid, fraction

    def step_kind(self, ctx: StepContext):
        """Sparse steps with fixed-size salient sets, per plan and per the caches of the last full step."""
        if self.full(ctx) or self.list_fraction(ctx, self.offset(ctx)) is None:
            return None
        return (self.full_done, *self.plan(ctx))

    def full(self, ctx: StepContext) -> bool:
        """The first full_steps steps of a generation are full (Algorithm 2), the rest sparse."""
        return ctx.t < self.full_steps

    def step(self, model, ctx: StepContext) -> torch.Tensor:
        self.group = group_of(model)  # the ranks, if split: next_salient sums the cosine terms of every head
        if ctx.t == 0 and self.tau is None:
            self.threshold = DREAM_TAU if model.cfg.model_type == "Dream" else LLADA_TAU
        if self.full(ctx):
            hidden = self.full_step(model, ctx)
        else:
            hidden = self.sparse_step(model, ctx, *(ctx.kind[1:] if ctx.kind else self.plan(ctx)))
        self.previous_tokens = overwrite(self.previous_tokens, ctx.tokens)
        return hidden

    def full_step(self, model, ctx) -> torch.Tensor:
        """Algorithm 2: the dense forward, caching K, V, C, lse and the FFN output of every row."""
        x, rope = model.embed(ctx.tokens), model.rope(ctx.positions)
        k_valid = None if bool(ctx.valid.all()) else ctx.valid
        self.layers = []
        for layer in model.layers:
            q, k, v = layer.qkv(layer.attn_norm(x), rope)
            v = v.transpose(1, 2).contiguous().transpose(1, 2)  # own storage: a view would keep all of q/k/v cached
            context, lse = attention_with_lse(q, k, v, k_valid)
            context = context.transpose(1, 2).contiguous().transpose(1, 2)  # token-major: o_proj reads it as is
            x = x + layer.out(context)
            mlp_out = layer.mlp(layer.mlp_norm(x))
            x = x + mlp_out
            self.layers.append(LayerState(k, v, context, lse, mlp_out))
        self.full_done += 1
        self.salient = ctx.valid.clone()  # every row was just computed
        self.prompt_tail = overwrite(self.prompt_tail, x[:, ctx.prompt_width - 1 : ctx.prompt_width])
        return x

    def sparse_step(self, model, ctx, offset: int, first: int | None, all_valid: bool,
                    list_fraction: float | None) -> torch.Tensor:
        """Algorithm 3 over the fed rows (the whole canvas, or the response only): their hidden states."""
        prompt_width = ctx.prompt_width
        tokens, positions, valid = ctx.tokens[:, offset:], ctx.positions[:, offset:], ctx.valid[:, offset:]
        salient = (self.salient | (ctx.tokens != self.previous_tokens))[:, offset:] & valid
        fed = Fed(valid, offset, None if all_valid else ctx.valid, list_fraction)
        x, salient, fractions = self.forward_layers(model, tokens, positions, salient, fed, first)
        self.salient[:, :offset] = False
        self.salient[:, offset:] = salient
        self.fractions = overwrite(self.fractions, fractions)
        if offset == 0:  # a response-only step's first logits read the prompt's last row as last seen
            self.prompt_tail = overwrite(self.prompt_tail, x[:, prompt_width - 1 : prompt_width])
        return x

    def logits(self, model, hidden, ctx: StepContext) -> torch.Tensor:
        """From the fed rows' hidden states: the canvas's last hidden.shape[1] columns."""
        offset = ctx.tokens.shape[1] - hidden.shape[1]
        return model.head(hidden, ctx.logits_start - offset, ctx.logits_stop - offset, before=self.prompt_tail)

    def forward_layers(self, model, tokens, positions, salient, fed: Fed, first: int | None):
        """Every layer over the fed rows, given the salient rows entering layer 1 (listed `first` at a
        time, or as many as there are, rounded up by capacity): (hidden states, the last layer's
        salient rows, the salient fraction of each layer)."""
        x, rope = model.embed(tokens), model.rope(positions)
        selected = Salient.listed(*list_rows(salient, first))
        masks, mlp_out = [], None
        for layer, state in zip(model.layers, self.layers):
            x, mlp_out, selected = self.layer_step(layer, state, x, mlp_out, rope, selected, fed)
            masks.append(selected.mask)
        fractions = torch.stack(masks).sum(dim=(1, 2)) / fed.valid.sum()  # over the real fed rows
        return x.add_(mlp_out), selected.mask, fractions

    def layer_step(self, layer, state, x, pending, rope, selected: Salient, fed: Fed):
        """One layer of a sparse step, given its input x + pending (the last layer's FFN output, None
        at layer 1; added in the norm's pass) and its salient rows; returns (x, this layer's FFN output
        to add, the next salient rows)."""
        h = layer.attn_norm(x, pending)
        q = layer.query(h, rope)
        columns = selected.rows + fed.offset if fed.offset else selected.rows
        k_rows, v_rows = layer.kv(take_rows(h, selected.rows, selected.flat), rope.rows(selected.rows))
        put_where(state.keys, columns, selected.ok, k_rows)
        dv = put_where(state.values, columns, selected.ok, v_rows, delta=True)  # v_new - v_old, 0 where not ok

        shared = selected.rows[:, None]  # the same rows for every head
        exact, lse = attention_with_lse(take_heads(q, shared, selected.flat), state.keys, state.values, fed.k_valid)
        context = state.context[:, :, fed.offset:]
        dots = approximate(q, state.keys, dv, columns, state.lse[:, :, fed.offset:], context,
                           (exact, lse, selected.slots))
        selected = Salient.listed(*self.next_salient(dots, fed, use_kernels(q)))

        x = layer.add_out(x, context)
        cached = state.mlp_out[:, fed.offset:]
        fresh = layer.mlp(layer.mlp_norm(take_rows(x, selected.rows, selected.flat)))
        put_where(cached[:, None], selected.rows, selected.ok, fresh[:, None])
        return x, cached, selected

    def next_salient(self, dots, fed: Fed, on_kernels: bool):
        """Rows whose context moved: cos(C, C_old) < tau; or the lowest-cosine salient_fraction; or,
        listed at a fixed fraction (salient_cap, or every fed row), those below tau among the
        lowest-cosine fraction's worth (listed without a host sync). dots: per head [new.old, new.new,
        old.old], summed over every head (gathered in order where ranks split them). Returns (mask,
        rows, ok, slots) as Salient holds them."""
        dots = self.group.all_gather(dots, dim=1).sum(dim=1)
        if fed.list_fraction is None:
            cos = dots[..., 0] / (dots[..., 1] * dots[..., 2]).sqrt().clamp(min=1e-30)
            return list_rows((cos < self.threshold) & fed.valid)
        tau = self.threshold if self.salient_fraction is None else None
        select = salient_rows if on_kernels and dots.shape[1] <= WHOLE_ROW_MAX else salient_rows_reference
        return select(dots, fed.valid, fed.list_fraction, tau)

    def rows_computed(self, ctx: StepContext):
        """At a sparse step, each layer's salient rows (fresh attention and FFN) of the real fed rows."""
        return None if self.full(ctx) else (self.fractions.double(), 1)
