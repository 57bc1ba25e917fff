"""dLLM-Cache (methods/dllm_cache.py) on the masked engine: refreshing every step equals dense, stale
caches differ, the refresh schedule is the docstring's and a full refresh is exact, rows_computed is
the count of rows the schedule forwards, the drift rows are the least similar values, a method reused
for other prompts decodes as a fresh one, the row gathers it uses equal torch's gather, and every
step's logits and drifted rows equal a plain-torch float64 reference (ReferenceDllmCache); the masked
engine refuses every bidirectional-canvas method on a block-causal model."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.attention import attention
from nanodllm.config import GenerationConfig
from nanodllm.loader import load_model
from nanodllm.methods import METHODS, get_method
from nanodllm.methods.base import Method
from nanodllm.methods.common import heads_index, take_heads, take_rows
from nanodllm.methods.dllm_cache import drifted_rows
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, RAGGED_PROMPTS, differing, random_prompt, refuses_block_causal,
                               tiny_model, masked_decode as decode, masked_tokens as generate)

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



DENSE = generate(get_method("dense"))


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(3, 24), min_size=1, max_size=3), cfg_scale=st.sampled_from([0.0, 1.0]),
       threshold=st.sampled_from([None, 0.5]), seed=st.integers(0, 1000))
def test_refreshing_every_step_equals_dense(lengths, cfg_scale, threshold, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8, cfg_scale=cfg_scale, threshold=threshold)
    expected = generate(get_method("dense"), prompts, gen)
    assert generate(get_method("dllm_cache", prompt_interval=1, response_interval=1), prompts, gen) == expected


def test_stale_caches_differ_and_count_rows():
    result = decode(get_method("dllm_cache", prompt_interval=50, response_interval=8, rho=0.0))
    assert differing(result.tokens, DENSE) > 0
    assert 0 < result.stats["rows_computed"] < 0.3  # 2 response refreshes + the first step over 16 steps


@pytest.mark.parametrize("prompt_interval, response_interval, rho", [(4, 3, 0.25), (50, 8, 0.0), (3, 2, 0.5),
                                                                    (1, 1, 0.25), (4, 3, 0.3)])  # 4.8 rows: 4
def test_rows_computed_counts_the_rows_the_schedule_forwards(prompt_interval, response_interval, rho):
    """stats["rows_computed"] over a generation: at step t the prompt's 20 columns when t % T_p == 0,
    the 16 response rows when t % T_r == 0, none at a prompt-only refresh, else floor(rho * 16) drifted
    rows; over the 36 canvas rows of each of the 16 steps. Per generation: a method reused counts
    afresh."""
    prompt, response = max(map(len, PROMPTS)), GEN.gen_length
    computed = 0
    for t in range(GEN.steps):
        refresh_prompt = t % prompt_interval == 0
        if t % response_interval == 0:
            fresh = response
        else:
            fresh = 0 if refresh_prompt else math.floor(rho * response)
        computed += (prompt if refresh_prompt else 0) + fresh
    expected = computed / (GEN.steps * (prompt + response))
    method = get_method("dllm_cache", prompt_interval=prompt_interval, response_interval=response_interval, rho=rho)
    assert decode(method).stats["rows_computed"] == expected
    assert decode(method).stats == {"rows_computed": expected}


def test_all_rows_drifting_equals_a_response_refresh():
    """rho = 1 recomputes every response row through the drift path (gather, scatter of K and of
    the cached outputs): the same tokens as refreshing the response every step."""
    refreshed = generate(get_method("dllm_cache", prompt_interval=50, response_interval=1))
    assert generate(get_method("dllm_cache", prompt_interval=50, response_interval=100, rho=1.0)) == refreshed


def test_drifted_rows_are_the_least_similar_values():
    old = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    new = old.clone()
    new[0, :, 4] = -old[0, :, 4]  # cos = -1: drift 2
    new[0, :, 1] += 0.5 * torch.randn(3, 4, dtype=torch.float64)
    new[1, :, 2] = torch.randn(3, 4, dtype=torch.float64)
    rows = drifted_rows(new, old, 2)
    assert rows[0].tolist() == [4, 1]
    assert rows[1, 0] == 2
    assert torch.equal(old, new)  # the cache now holds the new values


@pytest.mark.parametrize("prompt_interval, response_interval", [(4, 3), (3, 2), (5, 5)])
def test_dllm_cache_refreshes_on_its_schedule_and_a_full_refresh_is_exact(prompt_interval, response_interval):
    """Step t forwards the prompt again when t % T_p == 0 and the whole response when t % T_r == 0;
    between those, only the rho share of drifted rows; a step that refreshes both gives the dense
    forward's response hidden states."""
    method = get_method("dllm_cache", prompt_interval=prompt_interval, response_interval=response_interval)
    step, seen = method.step, []

    def checked_step(model, ctx):
        plan = method.plan(ctx)
        seen.append((plan.refresh_prompt, plan.recomputed))
        hidden = step(model, ctx)
        if plan.refresh_prompt and plan.recomputed == "all":
            dense = model.hidden(ctx.tokens, ctx.positions, lambda layer, q, k, v: attention(q, k, v, ctx.attn_mask))
            torch.testing.assert_close(hidden, dense[:, ctx.prompt_width:], atol=1e-10, rtol=0)
        return hidden

    method.step = checked_step
    generate(method)
    expected = [(t % prompt_interval == 0, "all" if t % response_interval == 0 else "none" if t % prompt_interval == 0
                 else "drifted") for t in range(MASKED_GEN.steps)]
    assert seen == expected


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """The cached canvas starts over with every generation: after decoding one prompt (16 steps, so a
    count left running would move every refresh), the method decodes the ragged batch as a new one does."""
    intervals = dict(prompt_interval=3, response_interval=2)
    reused = get_method("dllm_cache", **intervals)
    generate(reused, [random_prompt(9, seed=5)])
    assert generate(reused) == generate(get_method("dllm_cache", **intervals))


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="response_interval"):
        get_method("dllm_cache", response_interval=0)
    with pytest.raises(ValueError, match="rho"):
        get_method("dllm_cache", rho=1.5)


@pytest.mark.parametrize("name", sorted(name for name, cls in METHODS.items() if cls.needs_bidirectional))
def test_the_masked_engine_refuses_every_bidirectional_cache_on_a_block_causal_model(name):
    """Every method that caches a bidirectional canvas (Method.needs_bidirectional) gets the same error
    from the masked engine on a block-causal model."""
    assert refuses_block_causal(get_method(name)) == (
        f"{name} caches a bidirectional canvas; this model is block-causal (decode it with the block engine)")


def test_the_canvas_caching_methods_say_they_need_a_bidirectional_canvas():
    """The refusal above covers these six (an empty parametrization would check nothing)."""
    assert {name for name, cls in METHODS.items() if cls.needs_bidirectional} == {
        "dllm_cache", "maskkv", "snapkv", "fast_dllm", "sparse_dllm", "dyllm"}


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 9), count=st.integers(1, 6), heads=st.integers(1, 3),
       layout=st.sampled_from(["contiguous", "token-major", "strided"]), shared=st.booleans(), seed=st.integers(0, 999))
def test_row_takes_equal_the_gather(batch, length, count, heads, layout, shared, seed):
    """take_rows / take_heads (methods/common.py) copy whole rows where the layout allows; they equal
    torch's gather in every layout (a strided one falls back to it)."""
    generator = torch.Generator().manual_seed(seed)
    store = torch.randn(batch, 2 * length, heads, 5, generator=generator)
    x = {"contiguous": store[:, :length].contiguous(), "token-major": store[:, :length],
         "strided": store[:, ::2]}[layout]  # [batch, length, heads, 5]
    rows = torch.randint(0, length, (batch, count), generator=generator)
    assert torch.equal(take_rows(x, rows), x.gather(1, rows[..., None, None].expand(-1, -1, heads, 5)))
    by_head = x.transpose(1, 2)  # [batch, heads, length, 5]
    index = rows[:, None] if shared else torch.randint(0, length, (batch, heads, count), generator=generator)
    assert torch.equal(take_heads(by_head, index), by_head.gather(2, heads_index(by_head, index)))


# The reference: dLLM-Cache as its docstring states it, against a tiny float64 LLaDA, a ragged batch of
# 2 left-padded prompts, several blocks, random prompt_interval T_p, response_interval T_r and rho.
#
# ReferenceDllmCache decodes every batch row alone, from the row's own tokens (its prompt without the
# padding, then the whole generated region, positions from 0), with explicit Python caches per row and
# layer: the prompt's K/V, and the response's K/V, attention outputs and FFN outputs as lists of per-row
# tensors. At step t, counted over the whole generation from 0 (ctx.t):
#     t % T_p == 0   the prompt rows are forwarded again (explicit softmax attention over the prompt's
#                    and the response's K/V, then the FFN) and their K/V replaced;
#     t % T_r == 0   every response row gets fresh Q/K/V, attention and FFN;
#     otherwise, unless the prompt is refreshed, every response row's V is computed; the floor(rho * R)
#                    rows of largest 1 - cos(V_t, V_cached) (all KV heads together; ties to the lower
#                    row) get fresh Q and K, attention and FFN; the cached V become the new V of every row;
#     a prompt-only refresh (t % T_p == 0, t % T_r != 0) recomputes no response row;
#     every response row adds its cached attention and FFN outputs to its residual stream.
# The logits are the final norm and LM head of the active block's rows. The projections, norms, RoPE and
# FFN are the model's layer primitives (the same float64 arithmetic; RoPE's fp32 tables included); the
# drift's cosine is in fp32 sums as kernels/value_drift.py states (dot / (max(|a|, eps) max(|b|, eps))),
# so that the cosines of unchanged rows rank alike. Both run in the engine (the reference through the
# base Method hooks only), so they decode the same tokens when their logits agree; every step's logits
# must agree within 1e-9, and every drift step's drifted rows, per layer and batch row, must be the
# reference's.

REFERENCE_MODEL = tiny_model("llada", seed=3)
REFERENCE_GEN = GenerationConfig(gen_length=12, block_length=4, steps=12)  # 3 blocks of 4 steps
EPS = 1e-8


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
    """dLLM-Cache as the docstrings state it, per batch row, with explicit caches (see above). drifted:
    (t, layer, batch row, sorted drifted rows) of every drift step."""

    name = "reference_dllm_cache"
    engines = ("masked",)

    def __init__(self, prompt_interval, response_interval, rho):
        self.tp, self.tr, self.rho = prompt_interval, response_interval, rho
        self.caches, self.drifted = {}, []

    def begin_block(self, ctx):
        if ctx.block == 0:
            self.caches = {}

    def step(self, model, ctx):
        P = ctx.logits_start - ctx.block * ctx.block_length  # prompt columns
        R = ctx.tokens.shape[1] - P
        refresh_prompt = ctx.t % self.tp == 0
        refresh_response = ctx.t % self.tr == 0
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
                    self.drifted.append((ctx.t, i, b, sorted(rows)))
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
        method.drifted, step, refresh, now = [], method.step, method.refresh_drifted, {}

        def recorded_step(model, ctx):
            now.update(t=ctx.t, layer=0)
            return step(model, ctx)

        def recorded_refresh(cache, layer, h_r, rope_r, count):
            q, rows = refresh(cache, layer, h_r, rope_r, count)
            for b in range(rows.shape[0]):
                method.drifted.append((now["t"], now["layer"], b, sorted(rows[b].tolist())))
            now["layer"] += 1
            return q, rows

        method.step, method.refresh_drifted = recorded_step, recorded_refresh
    return method


@st.composite
def knobs(draw):
    return dict(prompt_interval=draw(st.integers(1, 8)), response_interval=draw(st.integers(1, 6)),
                rho=draw(st.floats(0, 1, allow_nan=False)))


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
@settings(max_examples=10, deadline=None, derandomize=True)
@given(knobs=knobs(), lengths=st.tuples(st.integers(2, 12), st.integers(2, 12)).filter(lambda n: n[0] != n[1]),
       seed=st.integers(0, 2**16))
def test_dllm_cache_matches_its_reference(knobs, lengths, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    method = recording(get_method("dllm_cache", **knobs))
    reference = recording(ReferenceDllmCache(**knobs))
    tokens = generate(method, prompts, REFERENCE_GEN, REFERENCE_MODEL)
    expected = generate(reference, prompts, REFERENCE_GEN, REFERENCE_MODEL)
    assert len(method.seen_logits) == len(reference.seen_logits) == REFERENCE_GEN.steps
    for step, (got, want) in enumerate(zip(method.seen_logits, reference.seen_logits)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert sorted(method.drifted) == sorted(reference.drifted)
    assert tokens == expected


def test_on_a_shifted_logit_model_refreshing_every_step_equals_dense():
    """On Dream (logit_shift) the response's first logits read the prompt's last row as the last prompt
    refresh left it: refreshing the prompt and the response every step decodes what dense does."""
    model = load_model(Path(__file__).parent / "fixtures" / "dream_tiny", dtype=torch.float64)
    gen = GenerationConfig(gen_length=8, block_length=8, steps=8)  # Dream decodes the response as one block
    expected = generate(get_method("dense"), PROMPTS, gen, model)
    assert generate(get_method("dllm_cache", prompt_interval=1, response_interval=1), PROMPTS, gen, model) == expected
