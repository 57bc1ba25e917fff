"""dLLM-Cache, MaskKV and SnapKV (methods/dllm_cache.py, maskkv.py, snapkv.py): refreshing every step
equals dense, a budget covering the prompt equals dllm_cache, small budgets and stale caches differ,
and the pieces (drift rows, mask voting, budget allocation, eviction) do what the papers say."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm import masked
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.canvas_cache import drifted_rows, keep_top
from nanodllm.methods.common import (attention_mass, attention_mass_kernels, attention_mass_reference, heads_index,
                                     take_heads, take_rows)
from nanodllm.methods.maskkv import head_budgets, layer_budgets
from tests.device import DEVICE, FP32_OUT_TOLERANCE
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, RAGGED_PROMPTS, differing, random_prompt,
                               refuses_block_causal, tiny_model)
from tests.tiny_models import masked_tokens as generate

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
    method = get_method("dllm_cache", prompt_interval=50, response_interval=8, rho=0.0)
    assert differing(generate(method), DENSE) > 0
    assert 0 < method.stats["rows_computed"] < 0.3  # 2 response refreshes + the first step over 16 steps


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


@pytest.mark.parametrize("name", ["maskkv", "snapkv"])
def test_budget_covering_the_prompt_equals_dllm_cache(name):
    expected = generate(get_method("dllm_cache", prompt_interval=3, response_interval=2))
    method = get_method(name, budget=20, prompt_interval=3, response_interval=2)
    assert generate(method) == expected
    assert "kv_kept" not in method.stats  # nothing was evicted


@pytest.mark.parametrize("name", ["maskkv", "snapkv"])
def test_tiny_budget_differs_and_keeps_little(name):
    knobs = {"window": 4} if name == "snapkv" else {}
    expected = generate(get_method("dllm_cache"))
    method = get_method(name, budget=1, **knobs)
    assert differing(generate(method), expected) > 0
    kept, prompt = method.stats["kv_per_head"]
    assert kept <= 1 and prompt == pytest.approx(16.5)
    kv_heads = MODEL.cfg.num_kv_heads
    importance = method.importance[0] if name == "maskkv" else [1.0] * MODEL.cfg.num_layers  # SnapKV: uniform
    layer_budget = layer_budgets(1, importance, beta=0.4, boundary_layers=1)  # 1 per layer: all boundary
    for (indices, keep), cache, budget in zip(method.indices, method.layers, layer_budget, strict=True):
        per_head = keep[:, :, 0].sum(dim=-1)  # [rows, kv_heads]
        assert bool((per_head.sum(dim=1) <= budget * kv_heads).all())  # Algorithm 3 splits B_l * H_kv
        assert indices.shape[2] == max(int(per_head.max()), 1) <= budget * kv_heads  # the largest head, padded
        assert cache.keys.shape[2] == indices.shape[2] + GEN.gen_length  # the full prompt is not kept past step 0


BATCH_CASES = [
    ("maskkv", dict(budget=15)),  # between the rows' prompt lengths (13 and 20)
    ("maskkv", dict(budget=5)),  # below both
    ("maskkv", dict(budget=15, prompt_interval=3, response_interval=2)),  # the kept K/V gathered again at refreshes
    ("maskkv", dict(budget=5, prompt_interval=3, response_interval=2)),
    ("snapkv", dict(budget=18, window=16)),  # the window is wider than the short prompt
    ("snapkv", dict(budget=8, window=4)),  # the pool's reach past the short row's first token
]


@pytest.mark.parametrize("name, knobs", BATCH_CASES)
def test_a_row_decodes_the_same_alone_and_next_to_another_prompt(name, knobs):
    batched = generate(get_method(name, **knobs))
    alone = [generate(get_method(name, **knobs), [prompt])[0] for prompt in PROMPTS]
    assert batched == alone


@pytest.mark.parametrize("budget", [13, 15])  # 13: the row's prompt is exactly the budget
@pytest.mark.parametrize("intervals", [{}, dict(prompt_interval=3, response_interval=2)])
def test_a_row_whose_prompt_fits_the_budget_equals_dllm_cache_in_any_batch(intervals, budget):
    method = get_method("maskkv", budget=budget, **intervals)
    short_row = generate(method)[1]  # 13 tokens, next to 20
    assert short_row == generate(get_method("dllm_cache", **intervals))[1]
    for indices, keep in method.indices:  # it kept its whole prompt (columns 7..19) in every layer and head
        for head in range(indices.shape[1]):
            assert set(indices[1, head][keep[1, head, 0]].tolist()) == set(range(20 - 13, 20))


def test_eviction_keeps_each_heads_budget_of_the_real_prompt():
    method = get_method("snapkv", budget=5, window=2, pool=1)
    generate(method)
    for indices, keep in method.indices:
        assert keep.sum(dim=-1).flatten().tolist() == [5] * (2 * 4)  # 2 rows x 4 KV heads
        assert bool((indices[1][keep[1, :, 0]] >= 20 - 13).all())  # row 1: never a pad column
        assert bool((indices[:, :, :, None] != indices[:, :, None, :]).sum() == 2 * 4 * 5 * 4)  # distinct
        assert bool((indices[..., 1:] >= indices[..., :-1]).all())  # prompt order


@pytest.mark.parametrize("prompt_interval, response_interval", [(4, 3), (3, 2), (5, 5)])
def test_dllm_cache_refreshes_on_its_schedule_and_a_full_refresh_is_exact(prompt_interval, response_interval):
    """Step t forwards the prompt again when t % T_p == 0 and the whole response when t % T_r == 0;
    between those, only the rho share of drifted rows; a step that refreshes both gives the dense
    forward's response hidden states."""
    from nanodllm.attention import attention

    method = get_method("dllm_cache", prompt_interval=prompt_interval, response_interval=response_interval)
    step, seen = method.step, []

    def checked_step(model, ctx):
        prompt_width, prompt, recomputed, _ = method.plan(ctx)
        seen.append((prompt, recomputed))
        hidden = step(model, ctx)
        if prompt and recomputed == "all":
            dense = model.hidden(ctx.tokens, ctx.positions, lambda layer, q, k, v: attention(q, k, v, ctx.attn_mask))
            torch.testing.assert_close(hidden, dense[:, prompt_width:], atol=1e-10, rtol=0)
        return hidden

    method.step = checked_step
    generate(method)
    expected = [(t % prompt_interval == 0, "all" if t % response_interval == 0 else "none" if t % prompt_interval == 0
                 else "drifted") for t in range(MASKED_GEN.steps)]
    assert seen == expected


@pytest.mark.parametrize("budget, window", [(6, 3), (4, 4), (9, 2)])
def test_snapkv_always_keeps_its_observation_window(budget, window):
    """Every layer, row and KV head keeps the row's last `window` prompt tokens, whatever the votes,
    and fills the rest of its budget with other prompt tokens (prompts of 20 and 13, right-aligned in
    20 prompt columns)."""
    method = get_method("snapkv", budget=budget, window=window, pool=3)
    generate(method)
    assert len(method.indices) == MASKED_MODEL.cfg.num_layers
    for indices, keep in method.indices:
        for row in range(2):
            for head in range(indices.shape[1]):
                kept = set(indices[row, head][keep[row, head, 0]].tolist())  # keep: [batch, heads, 1, slots]
                assert set(range(20 - window, 20)) <= kept and len(kept) == budget


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), group=st.sampled_from([1, 2]), q_len=st.integers(1, 5), prompt=st.integers(1, 9),
       extra=st.integers(0, 4), per_head_mask=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_mass_is_the_summed_softmax(batch, group, q_len, prompt, extra, per_head_mask, seed):
    generator = torch.Generator().manual_seed(seed)
    kv_heads, d, n = 2, 4, prompt + extra
    q = torch.randn(batch, kv_heads * group, q_len, d, generator=generator, dtype=torch.float64)
    keys = torch.randn(batch, kv_heads, n, d, generator=generator, dtype=torch.float64)
    weight = torch.rand(batch, q_len, generator=generator) > 0.3
    mask = torch.rand(batch, kv_heads if per_head_mask else 1, 1, n, generator=generator) > 0.3
    mask[..., -1] = True
    got = attention_mass(q, keys, mask, weight, prompt)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, keys.repeat_interleave(group, dim=1)) / d**0.5
    scores = scores.masked_fill(~mask.repeat_interleave(group, dim=1) if per_head_mask else ~mask, float("-inf"))
    probs = scores.softmax(-1)[..., :prompt] * weight[:, None, :, None]
    expected = probs.sum(2).view(batch, kv_heads, group, prompt).mean(2)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-4)


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 2), group=st.sampled_from([1, 2]), q_len=st.sampled_from([1, 7, 64, 70]),
       prompt=st.integers(1, 40), extra=st.integers(0, 9), key_mask=st.sampled_from(["none", "padding", "per_kv_head"]),
       seed=st.integers(0, 2**16))
def test_attention_mass_kernels_match_the_torch_version(batch, group, q_len, prompt, extra, key_mask, seed):
    """flash_attention's LSE + key_scores in launches of 64 queries (interpreted on a CPU) against the
    fp32 softmax, with padding or per-KV-head key masks and queries of weight 0. Inputs on the float16
    grid, so a GPU's TF32 dots hold them exactly (tests/device.py)."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, d, n = 2, 64, prompt + extra
    draw = lambda *shape: torch.randn(*shape, generator=generator).half().float().to(DEVICE)
    q, keys = draw(batch, kv_heads * group, q_len, d), draw(batch, kv_heads, n, d)
    weight = (torch.rand(batch, q_len, generator=generator) > 0.3).to(DEVICE)
    k_valid = None
    if key_mask != "none":
        k_valid = torch.rand(batch, *((kv_heads,) if key_mask == "per_kv_head" else ()), n, generator=generator) > 0.3
        k_valid[..., -1] = True
        k_valid = k_valid.to(DEVICE)
    mask = None if k_valid is None else (k_valid[:, :, None, :] if k_valid.dim() == 3 else k_valid[:, None, None, :])
    got = attention_mass_kernels(q, keys, k_valid, weight, prompt)
    expected = attention_mass_reference(q, keys, mask, weight, prompt)
    torch.testing.assert_close(got, expected, atol=FP32_OUT_TOLERANCE, rtol=FP32_OUT_TOLERANCE)


def test_attention_mass_takes_the_kernels_where_they_apply(kernels_on, monkeypatch):
    """On the kernels, a key mask flash_attention takes (none, padding, per KV head) goes to them as its
    k_valid; a mask that differs per query stays on torch."""
    import nanodllm.methods.common as common_module

    calls = []
    monkeypatch.setattr(common_module, "attention_mass_kernels", lambda q, keys, k_valid, weight, width: calls.append(
        None if k_valid is None else tuple(k_valid.shape)) or attention_mass_reference(q, keys, None, weight, width))
    q, keys, weight = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 10, 64), torch.ones(2, 3, dtype=torch.bool)
    for mask in (None, torch.ones(2, 1, 1, 10, dtype=torch.bool), torch.ones(2, 2, 1, 10, dtype=torch.bool),
                 torch.ones(2, 1, 3, 10, dtype=torch.bool)):
        with torch.no_grad():  # the kernels have no backward: under autograd everything stays on torch
            attention_mass(q, keys, mask, weight, 6)
    assert calls == [None, (2, 10), (2, 2, 10)]


def test_layer_budgets_follow_algorithm_2():
    # 4 layers, boundary = layers 0 and 3; base floor(0.4 * 100) = 40; pool 60 * 4 = 240 split 3:1
    budgets = layer_budgets(100, [0.5, 0.1, 0.1, 0.1], beta=0.4, boundary_layers=1)
    assert budgets == [40 + 180 // 2, 40 + 60 // 2, 40 + 60 // 2, 40 + 180 // 2]
    assert sum(budgets) <= 400
    assert layer_budgets(100, [0.0] * 4, beta=0.4, boundary_layers=2) == [100] * 4  # all boundary


def test_head_budgets_follow_algorithm_3():
    mass = torch.tensor([[[3.0, 1.0], [1.0, 0.0], [0.0, 0.0]]])  # prompt mass 4, 1, 0 -> preference .8 .2 0
    counts = head_budgets(mass, layer_budget=10, alpha=0.1)
    assert counts.tolist() == [[1 + 21, 1 + 5, 1 + 0]]  # base 1, pool 27


def test_keep_top_respects_counts_padding_and_order():
    scores = torch.tensor([[[0.9, 0.1, 0.5, 0.7, 0.3]], [[0.9, 0.8, 0.1, 0.2, 0.6]]])
    indices, keep = keep_top(scores, torch.tensor([[3], [9]]), prompt_lengths=torch.tensor([5, 3]))
    assert indices[0, 0][keep[0, 0, 0]].tolist() == [0, 2, 3]
    assert indices[1, 0][keep[1, 0, 0]].tolist() == [2, 3, 4]  # row 1: 2 pad columns, count clamped to 3


def test_the_profile_knob_is_read_and_checked(tmp_path):
    model = tiny_model("llada")
    profile = tmp_path / "maskkv_profile.json"
    profile.write_text(json.dumps({"layer_importance": [0.9, 0.1]}))
    method = get_method("maskkv", budget=4, profile=str(profile))
    generate(method, model=model)
    assert method.stats["profile"] == str(profile)
    online = get_method("maskkv", budget=4)
    generate(online, model=model)
    assert online.stats["profile"].startswith("online")
    assert online.importance[0] != [0.9, 0.1]
    profile.write_text(json.dumps({"layer_importance": [0.9, 0.1, 0.3]}))
    with pytest.raises(ValueError, match="3 layer importances for a 2-layer model"):
        generate(get_method("maskkv", budget=4, profile=str(profile)), model=model)
    with pytest.raises(FileNotFoundError, match="profile not found"):
        generate(get_method("maskkv", budget=4, profile=str(tmp_path / "none.json")))


def test_calibrate_writes_the_profile_that_maskkv_then_reads(tmp_path, capsys):
    """`python -m nanodllm.eval --model DIR --calibrate` (eq. 8 over task canvases) writes
    DIR/maskkv_profile.json in one piece, and the eval side hands it to MaskKV for DIR's model."""
    import shutil

    from nanodllm.eval import main as eval_main
    from nanodllm.eval import resolve_model, with_profile
    from nanodllm.loader import load_model

    model_dir = tmp_path / "tiny-llada"
    shutil.copytree(resolve_model("tiny-llada"), model_dir)
    (model_dir / "maskkv_profile.json").unlink()
    assert eval_main(["--model", str(model_dir), "--calibrate", "--lengths", "200", "--n", "1",
                      "--gen-length", "8", "--device", "cpu"]) == 0
    profile = model_dir / "maskkv_profile.json"
    record = json.loads(profile.read_text())
    assert str(profile) in capsys.readouterr().out
    assert not list(model_dir.glob("*.partial"))
    importance = record["layer_importance"]
    model = load_model(model_dir, "cpu", torch.float32)
    assert len(importance) == model.cfg.num_layers
    assert all(0.0 <= value <= 2.0 for value in importance) and len(set(importance)) > 1  # 1 - cos, per layer
    assert record["calibration"] == {"tasks": ["passkey", "multikey", "kv"], "lengths": [200], "samples_per_cell": 1,
                                     "gen_length": 8, "seed": 99, "canvases": 3}
    method = get_method("maskkv", **with_profile("maskkv", {"budget": 4}, model_dir))
    generate(method, model=model)
    assert method.stats["profile"] == str(profile) and method.importance == [importance] * len(PROMPTS)
    assert with_profile("snapkv", {"budget": 4}, model_dir) == {"budget": 4}


def test_only_prompt_kv_is_kept_and_only_the_active_block_is_projected(monkeypatch):
    """MaskKV's prompt-state exclusion (of the prompt only the kept K/V stay; attention and FFN outputs
    are kept for the response's rows alone) and mask-only projection (the LM head sees the response
    rows and returns logits for the active block only)."""
    calls = []
    original = MASKED_MODEL.head

    def head(hidden, start=0, stop=None, before=None):
        logits = original(hidden, start, stop, before)
        calls.append((hidden.shape[1], logits.shape[1]))
        return logits

    monkeypatch.setattr(MASKED_MODEL, "head", head)
    method = get_method("maskkv", budget=4)
    generate(method)
    response, block = MASKED_GEN.gen_length, MASKED_GEN.block_length
    assert calls and all(rows == response and logits == block for rows, logits in calls)
    for layer in method.layers:
        assert layer.attn_out.shape[1] == layer.mlp_out.shape[1] == response
        assert layer.prompt_slots <= max(len(p) for p in RAGGED_PROMPTS) and layer.prompt_slots < 20


def test_bad_knobs_and_block_causal_models_are_named():
    with pytest.raises(ValueError, match="response_interval"):
        get_method("dllm_cache", response_interval=0)
    with pytest.raises(ValueError, match="rho"):
        get_method("dllm_cache", rho=1.5)
    with pytest.raises(ValueError, match="budget"):
        get_method("maskkv", budget=0)
    with pytest.raises(ValueError, match="pool"):
        get_method("snapkv", pool=4)
    assert "block-causal" in refuses_block_causal(get_method("dllm_cache"))


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 9), count=st.integers(1, 6), heads=st.integers(1, 3),
       layout=st.sampled_from(["contiguous", "token-major", "strided"]), shared=st.booleans(), seed=st.integers(0, 999))
def test_row_takes_equal_the_gather(batch, length, count, heads, layout, shared, seed):
    """take_rows / take_heads copy whole rows where the layout allows; they equal torch's gather
    in every layout (a strided one falls back to it)."""
    generator = torch.Generator().manual_seed(seed)
    store = torch.randn(batch, 2 * length, heads, 5, generator=generator)
    x = {"contiguous": store[:, :length].contiguous(), "token-major": store[:, :length],
         "strided": store[:, ::2]}[layout]  # [batch, length, heads, 5]
    rows = torch.randint(0, length, (batch, count), generator=generator)
    assert torch.equal(take_rows(x, rows), x.gather(1, rows[..., None, None].expand(-1, -1, heads, 5)))
    by_head = x.transpose(1, 2)  # [batch, heads, length, 5]
    index = rows[:, None] if shared else torch.randint(0, length, (batch, heads, count), generator=generator)
    assert torch.equal(take_heads(by_head, index), by_head.gather(2, heads_index(by_head, index)))


@pytest.mark.parametrize("name, knobs", [("dllm_cache", {}), ("maskkv", dict(budget=8)), ("snapkv", dict(budget=8))])
def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does(name, knobs):
    """The step counter and the cached canvas start over with every generation: after decoding one
    prompt (16 steps, so a counter left running would move every refresh), the method decodes the
    ragged batch as a new one does."""
    intervals = dict(prompt_interval=3, response_interval=2)
    reused = get_method(name, **intervals, **knobs)
    generate(reused, [random_prompt(9, seed=5)])
    assert generate(reused) == generate(get_method(name, **intervals, **knobs))


def test_snapkv_votes_for_a_padded_row_as_for_the_row_alone():
    """Every layer's pooled votes of the 13-token row, left-padded by 7 columns next to the 20-token
    one, equal its votes alone on its own columns: the pool never averages padding in."""

    def votes(prompts):
        method = get_method("snapkv", budget=8, window=4, pool=5)
        scores, token_scores = [], method.token_scores
        method.token_scores = lambda *args: scores.append(token_scores(*args)) or scores[-1]
        generate(method, prompts)
        return scores

    batched, alone = votes(PROMPTS), votes([PROMPTS[1]])
    assert len(batched) == len(alone) == MODEL.cfg.num_layers
    for together, by_itself in zip(batched, alone):
        torch.testing.assert_close(together[1, :, 20 - 13 :], by_itself[0], atol=1e-10, rtol=0)


def test_maskkv_online_importance_is_each_rows_own():
    """With 4 layers (2 boundary, 2 middle) the layer importance moves the budgets; measured online (no
    profile), each row's comes from its own tokens, so the row decodes as it does alone, and a method
    reused after other prompts measures afresh."""
    model = tiny_model("llada", n_layers=4)
    knobs = dict(budget=10, prompt_interval=1, response_interval=1, boundary_layers=1)
    gen = GenerationConfig(gen_length=16, block_length=4, steps=16)
    prompts = [random_prompt(30, seed=1), random_prompt(21, seed=2)]
    batched_method, alone_methods = get_method("maskkv", **knobs), [get_method("maskkv", **knobs) for _ in prompts]
    batched = masked.generate(model, prompts, gen, method=batched_method).tokens
    alone = [masked.generate(model, [p], gen, method=m).tokens[0] for p, m in zip(prompts, alone_methods)]
    assert batched == alone
    for row, method in zip(batched_method.importance, alone_methods):  # the padding counts in no row's mean
        assert row == pytest.approx(method.importance[0], rel=1e-5, abs=1e-6)
    reused = get_method("maskkv", **knobs)
    masked.generate(model, [random_prompt(37, seed=3)], gen, method=reused)
    assert masked.generate(model, prompts, gen, method=reused).tokens == batched
