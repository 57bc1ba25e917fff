"""DyLLM (methods/dyllm.py) and its approximate-attention kernel (kernels/approx_attention.py): the
kernel equals its reference, the update is exact when only values change, every row salient equals
dense, a low threshold shrinks the salient set and changes the output, a row decodes alike alone
and in a ragged batch, and the sparse steps equal a plain-torch reading of the method's docstring
(ReferenceDyLLM) logit for logit, response-only steps and Dream's shifted logits included; its
rows_computed statistics count the salient rows of the real fed rows."""

import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nanodllm.methods.dyllm as dyllm_module
from nanodllm.kernels.approx_attention import approximate_attention, approximate_attention_reference
from nanodllm.kernels.row_scatter import put_rows_where, put_rows_where_reference
from nanodllm.attention import attention_with_lse
from nanodllm.config import GenerationConfig
from nanodllm.loader import load_model
from nanodllm.methods import Method, get_method
from nanodllm.methods.dyllm import index_rows, list_rows
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, RAGGED_PROMPTS, differing, random_prompt, tiny_model,
                               masked_decode as decode, masked_tokens as generate)
from tests.device import DEVICE, TF32_DOTS, FP32_OUT_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



def random_inputs(batch, group, kv_heads, rows, keys, salient, head_dim, dtype, seed):
    """q, k, dv, columns, counts, lse, context on DEVICE (q, k, dv on the float16 grid where dots are TF32)."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    q, k = randn(batch, kv_heads * group, rows, head_dim), randn(batch, kv_heads, keys, head_dim)
    dv = randn(batch, kv_heads, salient, head_dim) * 0.1
    columns = torch.stack([torch.randperm(keys, generator=generator)[:salient] for _ in range(batch)])
    counts = torch.randint(0, salient + 1, (batch,), generator=generator)
    lse = randn(batch, kv_heads * group, rows).abs() + 2
    context = randn(batch, kv_heads * group, rows, head_dim)
    dot_inputs = [t.to(dtype) for t in (q, k, dv)]
    if TF32_DOTS and dtype == torch.float32:
        dot_inputs = [t.half().float() for t in dot_inputs]
    return [t.to(DEVICE) for t in dot_inputs + [columns, counts, lse, context.to(dtype)]]


def random_merge(batch, heads, rows, exact_rows, head_dim, dtype, seed):
    """(exact [batch, heads, E, D], exact_lse, slots [batch, rows]) on DEVICE: E distinct rows per batch
    row take the exact values, every other row -1."""
    generator = torch.Generator().manual_seed(seed)
    exact = torch.randn(batch, heads, exact_rows, head_dim, generator=generator).to(dtype)
    exact_lse = torch.rand(batch, heads, exact_rows, generator=generator) * 4
    slots = torch.full((batch, rows), -1, dtype=torch.int32)
    for b in range(batch):
        slots[b, torch.randperm(rows, generator=generator)[:exact_rows]] = torch.arange(exact_rows, dtype=torch.int32)
    return exact.to(DEVICE), exact_lse.to(DEVICE), slots.to(DEVICE)


def updated(update, inputs, merge=None):
    """(context, lse, stats) after an in-place update of copies of the inputs' context and lse."""
    *front, lse, context = inputs
    lse, context = lse.clone(), context.clone()
    stats = update(*front, lse, context, merge)
    return context, lse, stats


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), kv_heads=st.integers(1, 2),
       rows=st.integers(1, 40), keys=st.integers(1, 60), head_dim=st.sampled_from([16, 32, 64]),
       dtype=st.sampled_from([torch.float32, torch.float16]), merged=st.booleans(), data=st.data())
def test_kernel_matches_reference(batch, group, kv_heads, rows, keys, head_dim, dtype, merged, data):
    salient = data.draw(st.integers(1, keys))
    seed = data.draw(st.integers(0, 999))
    inputs = random_inputs(batch, group, kv_heads, rows, keys, salient, head_dim, dtype, seed)
    merge = random_merge(batch, kv_heads * group, rows, data.draw(st.integers(1, rows)), head_dim, dtype, seed) \
        if merged else None
    got_context, got_lse, got_stats = updated(approximate_attention, inputs, merge)
    expected_context, expected_lse, expected_stats = updated(approximate_attention_reference, inputs, merge)
    fp32 = FP32_OUT_TOLERANCE
    tolerance = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=fp32, rtol=fp32)
    torch.testing.assert_close(got_context.float(), expected_context.float(), **tolerance)
    torch.testing.assert_close(got_lse, expected_lse)
    torch.testing.assert_close(got_stats, expected_stats, atol=0.05 if dtype == torch.float16 else 1e-3, rtol=1e-3)


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_no_counts_takes_every_listed_column(path):
    """counts=None (DyLLM's fixed-size lists) is counts equal to the list width, and differs from a
    shorter count."""
    update = approximate_attention if path == "kernel" else approximate_attention_reference
    q, k, dv, columns, _, lse, context = random_inputs(2, 2, 1, 10, 24, 7, 16, torch.float32, 5)
    full = torch.full((2,), 7, device=DEVICE)
    every = updated(update, [q, k, dv, columns, None, lse, context])
    for got, expected in zip(every, updated(update, [q, k, dv, columns, full, lse, context])):
        torch.testing.assert_close(got, expected)
    fewer = updated(update, [q, k, dv, columns, full - 3, lse, context])
    assert not torch.allclose(every[0], fewer[0])


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_merged_rows_take_the_exact_values_and_the_others_the_update(path):
    update = approximate_attention if path == "kernel" else approximate_attention_reference
    inputs = random_inputs(2, 2, 2, 12, 20, 6, 16, torch.float32, 4)
    exact, exact_lse, slots = random_merge(2, 4, 12, 5, 16, torch.float32, 4)
    context, lse, stats = updated(update, inputs, (exact, exact_lse, slots))
    plain_context, _, plain_stats = updated(update, inputs)
    old = inputs[-1]
    for b in range(2):
        for row in range(12):
            slot = int(slots[b, row])
            if slot < 0:
                torch.testing.assert_close(context[b, :, row], plain_context[b, :, row])
                torch.testing.assert_close(lse[b, :, row], inputs[5][b, :, row])
                torch.testing.assert_close(stats[b, :, row], plain_stats[b, :, row])
            else:
                torch.testing.assert_close(context[b, :, row], exact[b, :, slot])
                torch.testing.assert_close(lse[b, :, row], exact_lse[b, :, slot])
                fresh, cached = exact[b, :, slot], old[b, :, row]
                sums = torch.stack([(fresh * cached).sum(-1), (fresh * fresh).sum(-1), (cached * cached).sum(-1)], -1)
                torch.testing.assert_close(stats[b, :, row], sums, atol=1e-4, rtol=1e-4)


def test_update_is_exact_when_only_values_change():
    """Same keys, so the same softmax: C_old + p dV over the changed columns is the new attention."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 16, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 2, 30, 16, generator=generator, dtype=torch.float64)
    v_old = torch.randn(1, 2, 30, 16, generator=generator, dtype=torch.float64)
    columns = torch.tensor([[3, 17, 29, 8]])
    v_new = v_old.clone()
    v_new[:, :, columns[0]] += torch.randn(1, 2, 4, 16, generator=generator, dtype=torch.float64)
    context, lse = attention_with_lse(q, k, v_old)
    stats = approximate_attention_reference(q, k, v_new[:, :, columns[0]] - v_old[:, :, columns[0]], columns,
                                            torch.tensor([4]), lse, context)
    expected, _ = attention_with_lse(q, k, v_new)
    torch.testing.assert_close(context, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(stats[..., 1], (expected**2).sum(-1).float())


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_a_stale_normaliser_never_weights_a_column_above_one(path):
    """With lse far below the fresh scores, each salient column adds at most its whole value delta."""
    q, k, dv, columns, _, lse, context = random_inputs(1, 1, 1, 6, 12, 4, 16, torch.float32, 3)
    stale = torch.full_like(lse, -30.0)  # exp(score + 30) would be ~1e13
    update = approximate_attention if path == "kernel" else approximate_attention_reference
    new, _, _ = updated(update, [q, k, dv, columns, torch.tensor([4], device=DEVICE), stale, context])
    moved = dv[0, 0].sum(0)  # every weight clamped to 1
    torch.testing.assert_close(new - context, moved.expand_as(new), atol=1e-4, rtol=1e-4)


def test_bad_kernel_inputs_are_named():
    inputs = random_inputs(1, 2, 2, 5, 10, 3, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="columns"):
        approximate_attention(*inputs[:3], inputs[3][:, :2], *inputs[4:])
    with pytest.raises(ValueError, match="head_dim"):
        approximate_attention(*random_inputs(1, 1, 1, 5, 10, 3, 24, torch.float32, 0))
    with pytest.raises(ValueError, match="float32"):
        approximate_attention(*inputs[:5], inputs[5].double(), inputs[6])
    exact, exact_lse, slots = random_merge(1, 4, 5, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="slots"):
        approximate_attention(*inputs, (exact, exact_lse, slots[:, :3]))
    with pytest.raises(ValueError, match="exact"):
        approximate_attention(*inputs, (exact[:, :2], exact_lse, slots))


def cache_layout(layout, batch, heads, n, width, dtype, generator):
    """A [batch, heads, n, width] cache on DEVICE: "heads" contiguous, "tokens" a view of [batch, n, heads,
    width] (DyLLM's context), "rows" a [batch, n, width] cache seen as [batch, 1, n, width] (its FFN outputs)."""
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)
    if layout == "tokens":
        return randn(batch, n, heads, width).transpose(1, 2)
    if layout == "rows":
        return randn(batch, n, width)[:, None]
    return randn(batch, heads, n, width)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), n=st.integers(1, 30), width=st.sampled_from([8, 24, 128, 300]),
       layout=st.sampled_from(["heads", "tokens", "rows"]), delta=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), data=st.data())
def test_row_scatter_matches_reference(batch, heads, n, width, layout, delta, dtype, data):
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    heads = 1 if layout == "rows" else heads
    slots = data.draw(st.integers(0, n))
    dst = cache_layout(layout, batch, heads, n, width, dtype, generator)
    rows = torch.stack([torch.randperm(n, generator=generator)[:slots] for _ in range(batch)]).to(DEVICE)
    ok = (torch.rand(batch, slots, generator=generator) < 0.7).to(DEVICE)
    src = torch.randn(batch, heads, slots, width, generator=generator).to(dtype=dtype, device=DEVICE)
    expected = dst.clone()
    expected_delta = put_rows_where_reference(expected, rows, ok, src, delta)
    with mock.patch.object(torch, "empty_like", lambda x: torch.full_like(x, float("nan"))):  # unwritten: NaN
        got_delta = put_rows_where(dst, rows, ok, src, delta)
    assert torch.equal(dst, expected)
    if delta:
        assert torch.equal(got_delta, expected_delta)
        assert not got_delta.masked_select(~ok[:, None, :, None]).any()  # untouched rows moved by nothing
    else:
        assert got_delta is None


def test_row_scatter_bad_inputs_are_named():
    dst, src = torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 3, 8)
    rows, ok = torch.tensor([[0, 2, 4]]), torch.tensor([[True, False, True]])
    with pytest.raises(ValueError, match="src must be"):
        put_rows_where(dst, rows, ok, src[:, :1])
    with pytest.raises(ValueError, match="rows and ok"):
        put_rows_where(dst, rows[:, :2], ok, src)
    with pytest.raises(ValueError, match="ok must be bool"):
        put_rows_where(dst, rows, ok.int(), src)


def test_sparse_steps_write_the_same_caches_with_the_row_scatter_kernel(monkeypatch):
    """DyLLM with its caches written by the kernel (float32; interpreted on a CPU, compiled on a GPU)
    decodes what the torch path decodes, with a cap so that some listed rows must keep their cached
    values. The torch path is float32's own on a GPU too (the kernels switch takes float16 / bfloat16)."""
    model = tiny_model("llada", dtype=torch.float32).to(DEVICE)
    method = lambda: get_method("dyllm", tau=0.9, salient_cap=0.25)
    expected = generate(method(), model=model)
    calls = []
    monkeypatch.setattr(dyllm_module, "put_where", lambda dst, rows, ok, src, delta=False: calls.append(1) or
                        put_rows_where(dst, rows, ok, src, delta))
    assert generate(method(), model=model) == expected
    assert calls


@pytest.mark.parametrize("list_all_rows", [0, 256])  # eager steps; every step listing all its rows
@settings(max_examples=5, deadline=None)
@given(lengths=st.lists(st.integers(3, 24), min_size=1, max_size=3), full_steps=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_every_row_salient_equals_dense(list_all_rows, lengths, full_steps, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8)
    expected = generate(get_method("dense"), prompts, gen)
    method = get_method("dyllm", tau=1.5, full_period=1, full_steps=full_steps, list_all_rows=list_all_rows)
    assert generate(method, prompts, gen) == expected


def test_low_threshold_shrinks_the_salient_set_and_differs():
    dense = generate(get_method("dense"))
    loose, tight = decode(get_method("dyllm", tau=0.5)), decode(get_method("dyllm", tau=0.99))
    assert differing(loose.tokens, dense) > 0
    assert loose.stats["rows_computed"] < tight.stats["rows_computed"] < 1
    per_layer = loose.stats["rows_computed_per_layer"]
    assert len(per_layer) == 2 and per_layer[0] != per_layer[1]
    assert loose.stats["rows_computed"] == pytest.approx(sum(per_layer) / 2)  # the layers' mean


def test_cached_keys_and_values_own_no_more_than_they_hold():
    """The cached V is not a view of the stacked q/k/v projection, which would keep q and k alive too."""
    method = get_method("dyllm")
    generate(method)
    for state in method.layers:
        for cached in (state.keys, state.values):
            assert cached.untyped_storage().nbytes() == cached.numel() * cached.element_size()


def test_salient_fraction_fixes_the_count():
    stats = decode(get_method("dyllm", salient_fraction=0.25)).stats
    assert stats["rows_computed_per_layer"] == pytest.approx([0.25, 0.25], abs=0.03)


def test_a_cap_covering_every_row_is_the_threshold_rule():
    """salient_cap = 1 lists every row and keeps those below tau: the uncapped (paper's) tokens."""
    free = decode(get_method("dyllm", tau=0.99, list_all_rows=0))
    capped = decode(get_method("dyllm", tau=0.99, salient_cap=1.0))
    assert capped.tokens == free.tokens
    assert capped.stats["rows_computed_per_layer"] == free.stats["rows_computed_per_layer"]


def kinds_of(method) -> list:
    """The list method.step_kind's answers go to, one per step (step_kind is wrapped)."""
    kinds, step_kind = [], method.step_kind
    method.step_kind = lambda ctx: kinds.append(step_kind(ctx)) or kinds[-1]
    return kinds


@pytest.mark.parametrize("knobs", [{"tau": 0.99}, {"tau": 0.9, "full_period": 2}])
def test_small_steps_list_every_row_and_decode_what_eager_steps_decode(knobs):
    """A sparse step feeding at most list_all_rows rows lists them all, the salient ones marked: the same
    sets, hence the same tokens and salient fractions as sized (eager) steps, at fixed shapes (a kind).
    Rows count over the batch: the ragged pair's response-only steps feed 2 x 16, its whole-canvas
    ones 2 x 36."""
    eager, listed = decode(get_method("dyllm", list_all_rows=0, **knobs)), decode(get_method("dyllm", **knobs))
    assert eager.tokens == listed.tokens
    assert listed.stats["rows_computed_per_layer"] == eager.stats["rows_computed_per_layer"]
    below, at = get_method("dyllm", list_all_rows=31, **knobs), get_method("dyllm", list_all_rows=32, **knobs)
    kinds_below, kinds_at = kinds_of(below), kinds_of(at)
    assert generate(below) == generate(at) == eager.tokens
    assert kinds_below == [None] * GEN.steps
    response_only = [kind for t, kind in enumerate(kinds_at) if t >= at.full_steps and t % at.full_period]
    assert response_only and all(kind is not None and kind[-1] == 1.0 for kind in response_only)
    assert all(kind is None for t, kind in enumerate(kinds_at) if t % at.full_period == 0)


def test_a_small_cap_bounds_the_salient_set_and_differs():
    free, capped = decode(get_method("dyllm", tau=0.99)), decode(get_method("dyllm", tau=0.99, salient_cap=0.05))
    assert differing(capped.tokens, free.tokens) > 0
    rows = MASKED_GEN.gen_length  # the fewest rows a sparse step feeds (response only)
    assert max(capped.stats["rows_computed_per_layer"]) <= -(-0.05 * rows // 1) / rows < free.stats["rows_computed"]


@pytest.mark.parametrize("knobs", [{"tau": 0.9}, {"tau": 0.9, "list_all_rows": 0},
                                   {"tau": 0.9, "salient_fraction": 0.25}, {"tau": 0.99, "salient_cap": 0.25}])
def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch(knobs):
    """DESIGN.md: a row's result must not depend on the batch. The short prompt, left-padded next to a
    longer one, sizes its salient sets from its own fed rows, as it does alone (tau alone: control)."""
    alone = generate(get_method("dyllm", **knobs), [PROMPTS[1]])[0]
    assert generate(get_method("dyllm", **knobs), PROMPTS)[1] == alone


@pytest.mark.parametrize("knobs", [{"tau": 1.5}, {"salient_fraction": 1.0}])
def test_every_row_salient_counts_as_one_in_a_ragged_batch(knobs):
    """rows_computed is over the real fed rows: padding is never salient nor counted."""
    stats = decode(get_method("dyllm", full_period=1, **knobs)).stats  # every sparse step feeds the padded canvas
    assert stats["rows_computed_per_layer"] == [1.0, 1.0]
    assert stats["rows_computed"] == 1.0


def test_index_rows_lists_true_entries_first():
    rows, ok = index_rows(torch.tensor([[False, True, False, True], [True, False, False, False]]))
    assert rows[:, :2].tolist() == [[1, 3], [0, 1]] and ok.tolist() == [[True, True], [True, False]]
    rows, ok = index_rows(torch.zeros(1, 3, dtype=torch.bool))
    assert rows.shape == (1, 1) and not bool(ok.any())


def test_list_rows_rounds_the_listing_up_and_marks_the_true_entries():
    mask = torch.zeros(2, 200, dtype=torch.bool)
    mask[0, [5, 70]] = mask[1, 199] = True
    _, rows, ok, slots = list_rows(mask)
    assert rows.shape == (2, 64) and ok.sum(dim=1).tolist() == [2, 1]
    assert rows[0, :2].tolist() == [5, 70] and rows[1, 0] == 199
    assert slots[0, 70] == 1 and slots[1, 199] == 0 and int((slots >= 0).sum()) == 3
    assert list_rows(mask[:, :40])[1].shape == (2, 40)  # never wider than the canvas


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="full_period"):
        get_method("dyllm", full_period=0)
    with pytest.raises(ValueError, match="salient_fraction"):
        get_method("dyllm", salient_fraction=2.0)
    with pytest.raises(ValueError, match="salient_cap"):
        get_method("dyllm", salient_cap=-0.5)
    for tau in ("0.99", float("nan"), True):
        with pytest.raises(ValueError, match="tau must be a number"):
            get_method("dyllm", tau=tau)
    with pytest.raises(ValueError, match="give one"):
        get_method("dyllm", salient_fraction=0.25, salient_cap=0.5)


def test_the_kernel_path_decodes_what_the_torch_path_decodes(monkeypatch):
    import nanodllm.methods.dyllm as dyllm

    model = tiny_model("llada", dtype=torch.float32, d_model=64).to(DEVICE)  # head_dim 16
    run = lambda: generate(get_method("dyllm", tau=0.95), model=model)
    torch_path = run()  # float32: the torch path on a GPU too (use_kernels takes float16 / bfloat16)
    monkeypatch.setattr(dyllm, "attention_on_kernels", lambda q: True)  # the Triton kernel (interpreted on a CPU)
    assert run() == torch_path


@pytest.mark.parametrize("knobs", [{"salient_fraction": 0.25}, {"tau": 0.99, "salient_cap": 0.25}])
def test_fixed_size_sets_from_the_kernel_decode_what_torch_decodes(monkeypatch, knobs):
    """next_salient on kernels/salient_rows.py (interpreted on a CPU, compiled on a GPU) against its
    torch reference, a ragged batch (each sequence's own count) with and without the cap's tau."""
    import nanodllm.methods.dyllm as dyllm

    model = tiny_model("llada", dtype=torch.float32).to(DEVICE)
    torch_path = decode(get_method("dyllm", **knobs), model=model)  # float32: the torch reference on a GPU too
    calls = []
    # float32 takes the reference: its name now runs the kernel
    monkeypatch.setattr(dyllm, "salient_rows_reference", lambda *args: calls.append(1) or dyllm.salient_rows(*args))
    kernel_path = decode(get_method("dyllm", **knobs), model=model)
    assert kernel_path.tokens == torch_path.tokens
    assert kernel_path.stats == torch_path.stats
    assert calls


def dense_attention(q, k, v, valid):
    """Softmax attention in plain torch over the valid keys; (context, lse). q [b, heads, rows, d],
    k / v [b, kv_heads, keys, d] (GQA: repeated), valid [b, keys]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~valid[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v, lse


class ReferenceDyLLM(Method):
    """methods/dyllm.py's docstring written out in plain torch, row masks instead of row lists and every
    score formed: the independent result its sparse steps are checked against."""

    name, engines = "reference_dyllm", ("masked",)

    def __init__(self, tau, full_steps=4, full_period=4):
        self.tau, self.full_steps, self.full_period = tau, full_steps, full_period

    def begin_block(self, ctx):
        if ctx.block == 0:
            self.layers = []

    def step(self, model, ctx):
        prompt_width = ctx.logits_start - ctx.block * ctx.block_length
        full = ctx.t < self.full_steps
        offset = 0 if full or ctx.t % self.full_period == 0 else prompt_width
        x, rope = model.embed(ctx.tokens[:, offset:]), model.rope(ctx.positions[:, offset:])
        if full:
            self.layers = []
            for layer in model.layers:
                q, k, v = layer.qkv(layer.attn_norm(x), rope)
                context, lse = dense_attention(q, k, v, ctx.valid)
                x = x + layer.out(context)
                mlp_out = layer.mlp(layer.mlp_norm(x))
                x = x + mlp_out
                self.layers.append(dict(k=k.clone(), v=v.clone(), context=context, lse=lse, mlp_out=mlp_out))
            salient = ctx.valid.clone()
        else:
            salient = ((self.salient | (ctx.tokens != self.tokens)) & ctx.valid)[:, offset:]
            for layer, cache in zip(model.layers, self.layers):
                q, k, v = layer.qkv(layer.attn_norm(x), rope)
                rows = salient[:, None, :, None]
                keys, values = cache["k"].clone(), cache["v"].clone()
                keys[:, :, offset:] = torch.where(rows, k, keys[:, :, offset:])
                values[:, :, offset:] = torch.where(rows, v, values[:, :, offset:])
                exact, exact_lse = dense_attention(q, keys, values, ctx.valid)
                group = q.shape[1] // keys.shape[1]
                scores = q @ keys.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
                weights = (scores - cache["lse"][:, :, offset:, None]).exp().clamp(max=1)
                old = cache["context"][:, :, offset:]
                approximate = old + weights @ (values - cache["v"]).repeat_interleave(group, 1)
                context = torch.where(rows, exact, approximate)
                cosine = (context * old).sum((1, 3)) / ((context**2).sum((1, 3)) * (old**2).sum((1, 3))).sqrt()
                salient = (cosine < self.tau) & ctx.valid[:, offset:]
                cache["k"], cache["v"] = keys, values
                cache["context"][:, :, offset:] = context
                cache["lse"][:, :, offset:] = torch.where(rows[..., 0], exact_lse, cache["lse"][:, :, offset:])
                x = x + layer.out(context)
                fresh = layer.mlp(layer.mlp_norm(x))
                cache["mlp_out"][:, offset:] = torch.where(salient[..., None], fresh, cache["mlp_out"][:, offset:])
                x = x + cache["mlp_out"][:, offset:]
            salient = torch.cat([torch.zeros_like(ctx.valid[:, :offset]), salient], dim=1)
        self.salient, self.tokens = salient, ctx.tokens.clone()
        if offset == 0:
            self.prompt_tail = x[:, prompt_width - 1 : prompt_width]
        return x

    def logits(self, model, hidden, ctx):
        offset = ctx.tokens.shape[1] - hidden.shape[1]
        return model.head(hidden, ctx.logits_start - offset, ctx.logits_stop - offset,
                          before=self.prompt_tail if offset else None)


def logits_per_step(method, **case):
    """The tokens generate() decodes with `method` (the masked engine, or Dream's loop) and the logits of
    each of its steps."""
    logits, head = [], method.logits
    method.logits = lambda model, hidden, ctx: logits.append(head(model, hidden, ctx)) or logits[-1]
    return generate(method, **case), logits


DREAM = dict(model=load_model(Path(__file__).parent / "fixtures" / "dream_tiny", dtype=torch.float64),
             prompts=[random_prompt(9, seed=1), random_prompt(5, seed=2)],
             gen=GenerationConfig(gen_length=12, block_length=12, steps=12))


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("knobs", [dict(tau=0.99), dict(tau=0.5), dict(tau=0.9, full_steps=2, full_period=3)])
@pytest.mark.parametrize("list_all_rows, granule", [(0, 64), (0, 3), (256, 64)])
def test_sparse_steps_match_the_plain_torch_reference(model, knobs, list_all_rows, granule, monkeypatch):
    """Whole-canvas and response-only steps (Dream's shifted logits included) against ReferenceDyLLM,
    logits step by step, on float64 models; eager steps (their listings rounded up to the whole canvas
    at the default granule, to a multiple of 3 rows with padding inside the canvas), and steps listing
    every fed row."""
    monkeypatch.setattr(dyllm_module, "capacity", functools.partial(dyllm_module.capacity, granule=granule))
    case = DREAM if model == "dream" else {}
    tokens, logits = logits_per_step(get_method("dyllm", list_all_rows=list_all_rows, **knobs), **case)
    expected_tokens, expected_logits = logits_per_step(ReferenceDyLLM(**knobs), **case)
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for got, expected in zip(logits, expected_logits):
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


def test_tau_defaults_to_the_papers_choice_for_the_models_type():
    """No tau: 0.99 on LLaDA, 0.995 on Dream (section 4.2.3), chosen at the generation's first step."""
    gen = GenerationConfig(gen_length=4, block_length=4, steps=1)
    llada, dream = get_method("dyllm"), get_method("dyllm")
    generate(llada, gen=gen)
    generate(dream, DREAM["prompts"], gen, DREAM["model"])
    assert (llada.threshold, dream.threshold) == (0.99, 0.995)


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """The caches and salient rows start over with every generation: after decoding one prompt, DyLLM
    runs its full_steps dense steps again and decodes the ragged batch as a new one does."""
    reused = get_method("dyllm", tau=0.9)
    generate(reused, [random_prompt(9, seed=5)])
    assert generate(reused) == generate(get_method("dyllm", tau=0.9))


def test_row_scatter_delta_comes_in_the_sources_dtype():
    """A float32 cache written from float16 rows: the cache gets the rows as the reference writes them, and
    the delta comes in src's dtype (float16), the fp32 difference rounded to it, 0 where not ok."""
    generator = torch.Generator().manual_seed(4)
    dst = torch.randn(2, 2, 10, 24, generator=generator).to(DEVICE)
    src = torch.randn(2, 2, 4, 24, generator=generator).to(dtype=torch.float16, device=DEVICE)
    rows = torch.tensor([[1, 5, 7, 2], [0, 9, 3, 4]], device=DEVICE)
    ok = torch.tensor([[True, False, True, True], [False, True, True, False]], device=DEVICE)
    old, expected = dst.clone(), dst.clone()
    put_rows_where_reference(expected, rows, ok, src)
    delta = put_rows_where(dst, rows, ok, src, delta=True)
    assert torch.equal(dst, expected) and delta.dtype == torch.float16
    index = rows[:, None, :, None].expand(-1, 2, -1, 24)
    difference = torch.where(ok[:, None, :, None], src.float() - old.gather(2, index), 0.0)
    assert torch.equal(delta, difference.half())


def test_row_scatter_refuses_flags_of_another_length():
    """ok has one flag per listed row: a shorter ok is named, not read past its end."""
    dst, src = torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 3, 8)
    rows, ok = torch.tensor([[0, 2, 4]]), torch.tensor([[True, False]])
    with pytest.raises(ValueError, match="rows and ok"):
        put_rows_where(dst, rows, ok, src)


def test_a_method_reused_on_another_model_type_takes_that_types_tau():
    """Without a tau knob the threshold is the paper's choice for the model at hand, chosen again at
    every generation's first step: one DyLLM run on Dream (0.995), then on LLaDA, uses 0.99 there."""
    gen = GenerationConfig(gen_length=4, block_length=4, steps=1)
    method = get_method("dyllm")
    generate(method, DREAM["prompts"], gen, DREAM["model"])
    assert method.threshold == 0.995
    generate(method, gen=gen)
    assert method.threshold == 0.99


def test_the_salient_fractions_take_both_ends_of_zero_to_one():
    """salient_fraction and salient_cap are fractions in [0, 1], both ends included; just past either
    end is refused by name."""
    for name in ("salient_fraction", "salient_cap"):
        for value in (0.0, 1.0, 0, 1):
            assert getattr(get_method("dyllm", **{name: value}), name) == value
        for value in (-1e-9, 1 + 1e-9):
            with pytest.raises(ValueError, match=f"{name} must be in \\[0, 1\\]"):
                get_method("dyllm", **{name: value})
