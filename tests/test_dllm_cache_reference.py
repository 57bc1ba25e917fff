"""dLLM-Cache (methods/dllm_cache.py, on methods/canvas_cache.py) against a plain-torch float64
reference of what its docstrings state, on the masked engine: a tiny float64 LLaDA, a ragged batch of
2 left-padded prompts, several blocks, random prompt_interval T_p, response_interval T_r and rho.

The reference (ReferenceDllmCache) decodes every batch row alone, from the row's own tokens (its
prompt without the padding, then the whole generated region, positions from 0), with explicit Python
caches per row and layer: the prompt's K/V, and the response's K/V, attention outputs and FFN outputs
as lists of per-row tensors. At step t, counted over the whole generation from 0:
    t % T_p == 0   the prompt rows are forwarded again (explicit softmax attention over the prompt's
                   and the response's K/V, then the FFN) and their K/V replaced;
    t % T_r == 0   every response row gets fresh Q/K/V, attention and FFN;
    otherwise, unless the prompt is refreshed, every response row's V is computed; the floor(rho * R)
                   rows of largest 1 - cos(V_t, V_cached) (all KV heads together; ties to the lower
                   row) get fresh Q and K, attention and FFN; the cached V become the new V of every row;
    a prompt-only refresh (t % T_p == 0, t % T_r != 0) recomputes no response row;
    every response row adds its cached attention and FFN outputs to its residual stream.
The logits are the final norm and LM head of the active block's rows. The projections, norms, RoPE and
FFN are the model's layer primitives (the same float64 arithmetic; RoPE's fp32 tables included); the
drift's cosine is in fp32 sums as kernels/value_drift.py states (dot / (max(|a|, eps) max(|b|, eps))),
so that the cosines of unchanged rows rank alike.

Both run in the engine (the reference through the base Method hooks only), so they decode the same
tokens when their logits agree; every step's logits must agree within 1e-9, and every drift step's
drifted rows, per layer and batch row, must be the reference's."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm import masked
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.base import Method
from tests.tiny_models import random_prompt, tiny_model

MODEL = tiny_model("llada", seed=3)
GEN = GenerationConfig(gen_length=12, block_length=4, steps=12)  # 3 blocks of 4 steps
EPS = 1e-8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def attend(q, keys, values):
    """Explicit softmax(q k^T / sqrt(d)) v: q [heads, n, d], keys/values [kv_heads, m, d]."""
    group = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def drift(new, cached):
    """1 - cos of one row's value vectors ([kv_heads, d] each, all heads together), in fp32 sums."""
    a, b = new.reshape(-1).float(), cached.reshape(-1).float()
    return (1 - (a * b).sum() / (a.norm().clamp(min=EPS) * b.norm().clamp(min=EPS))).item()


class ReferenceDllmCache(Method):
    """dLLM-Cache as the docstrings state it, per batch row, with explicit caches (see the module's
    docstring). drifted: (t, layer, batch row, sorted drifted rows) of every drift step."""

    name = "reference_dllm_cache"
    engines = ("masked",)

    def __init__(self, prompt_interval, response_interval, rho):
        super().__init__()
        self.tp, self.tr, self.rho = prompt_interval, response_interval, rho
        self.t, self.caches, self.drifted = 0, {}, []

    def begin_block(self, ctx):
        if ctx.block == 0:
            self.t, self.caches = 0, {}

    def step(self, model, ctx):
        P = ctx.logits_start - ctx.block * ctx.block_length  # prompt columns
        R = ctx.tokens.shape[1] - P
        refresh_prompt = self.t % self.tp == 0
        refresh_response = self.t % self.tr == 0
        count = math.floor(self.rho * R)
        hidden = torch.zeros(ctx.tokens.shape[0], ctx.tokens.shape[1], model.cfg.hidden_size, dtype=torch.float64)
        for b in range(ctx.tokens.shape[0]):
            n = int(ctx.valid[b, :P].sum())
            cols = list(range(P - n, P))
            ids_p, ids_r = ctx.tokens[b, cols], ctx.tokens[b, P:]
            rope_p, rope_r = model.rope(ctx.positions[b, cols][None]), model.rope(ctx.positions[b, P:][None])
            x_p = model.embed(ids_p[None]) if refresh_prompt else None
            x_r = model.embed(ids_r[None])  # [1, R, hidden]
            for i, layer in enumerate(model.layers):
                c = self.caches.setdefault((b, i), {})
                h_r = layer.attn_norm(x_r)
                fresh = []  # response rows getting fresh Q, attention and FFN, with their queries
                if refresh_response:
                    q, k, v = (z[0] for z in layer.qkv(h_r, rope_r))
                    c["rk"], c["rv"] = [k[:, r : r + 1] for r in range(R)], [v[:, r : r + 1] for r in range(R)]
                    fresh = [(r, q[:, r : r + 1]) for r in range(R)]
                elif not refresh_prompt:
                    v = layer.value(h_r)[0]
                    drifts = [drift(v[:, r], c["rv"][r]) for r in range(R)]
                    rows = sorted(range(R), key=lambda r: (-drifts[r], r))[:count]
                    self.drifted.append((self.t, i, b, sorted(rows)))
                    c["rv"] = [v[:, r : r + 1] for r in range(R)]
                    q, k = (z[0] for z in layer.qk(h_r, rope_r))
                    for r in rows:
                        c["rk"][r] = k[:, r : r + 1]
                        fresh.append((r, q[:, r : r + 1]))
                if refresh_prompt:
                    q_p, c["pk"], c["pv"] = (z[0] for z in layer.qkv(layer.attn_norm(x_p), rope_p))
                keys = torch.cat([c["pk"]] + c["rk"], dim=1)
                values = torch.cat([c["pv"]] + c["rv"], dim=1)
                if refresh_prompt:
                    x_p = x_p + layer.out(attend(q_p, keys, values)[None])
                    x_p = x_p + layer.mlp(layer.mlp_norm(x_p))
                for r, q_row in fresh:
                    a = layer.out(attend(q_row, keys, values)[None])
                    c.setdefault("attn", [None] * R)[r] = a[0]
                    c.setdefault("mlp", [None] * R)[r] = layer.mlp(layer.mlp_norm(x_r[:, r : r + 1] + a))[0]
                x_r = x_r + torch.cat(c["attn"], dim=0)[None] + torch.cat(c["mlp"], dim=0)[None]
            hidden[b, P:] = x_r[0]
        return hidden

    def end_step(self, ctx):
        self.t += 1


def recording(method):
    """Wrap the method's logits (and, where it has them, its drifted rows) to record every step's."""
    method.seen_logits = []
    logits = method.logits

    def recorded_logits(model, hidden, ctx):
        out = logits(model, hidden, ctx)
        method.seen_logits.append(out.clone())
        return out

    method.logits = recorded_logits
    if hasattr(method, "refresh_drifted"):
        method.drifted, refresh, layer_of = [], method.refresh_drifted, {"t": None, "i": 0}

        def recorded_refresh(cache, layer, h_r, rope_r, count):
            q, rows = refresh(cache, layer, h_r, rope_r, count)
            if layer_of["t"] != method.t:
                layer_of["t"], layer_of["i"] = method.t, 0
            for b in range(rows.shape[0]):
                method.drifted.append((method.t, layer_of["i"], b, sorted(rows[b].tolist())))
            layer_of["i"] += 1
            return q, rows

        method.refresh_drifted = recorded_refresh
    return method


@st.composite
def knobs(draw):
    return dict(prompt_interval=draw(st.integers(1, 8)), response_interval=draw(st.integers(1, 6)),
                rho=draw(st.floats(0, 1, allow_nan=False)))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(knobs=knobs(), lengths=st.tuples(st.integers(2, 12), st.integers(2, 12)).filter(lambda n: n[0] != n[1]),
       seed=st.integers(0, 2**16))
def test_dllm_cache_matches_its_reference(knobs, lengths, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    method = recording(get_method("dllm_cache", **knobs))
    reference = recording(ReferenceDllmCache(**knobs))
    tokens = masked.generate(MODEL, prompts, GEN, method).tokens
    expected = masked.generate(MODEL, prompts, GEN, reference).tokens
    assert len(method.seen_logits) == len(reference.seen_logits) == GEN.steps
    for step, (got, want) in enumerate(zip(method.seen_logits, reference.seen_logits)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert sorted(method.drifted) == sorted(reference.drifted)
    assert tokens == expected
