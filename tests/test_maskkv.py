"""MaskKV (methods/maskkv.py) on the masked engine: a budget covering the prompt equals dllm_cache, a
tiny budget differs and keeps (and states in kv_kept) at most its budget, a row decodes alike alone
and in a ragged batch, mask voting's attention mass (torch and kernels), Algorithms 2 and 3, keep_top,
the profile knob and `--calibrate`, the online importance, and at step 0 it keeps exactly the prompt
tokens of a plain-torch float64 reference of the paper (reference_maskkv)."""

import json
import math
import tempfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanodllm.attention import CanvasMask, attention
from nanodllm.config import GenerationConfig
from nanodllm.decoding import left_padded_canvas
from nanodllm.methods import get_method
from nanodllm.methods.common import attention_mass, attention_mass_kernels, attention_mass_reference, keep_top
from nanodllm.methods.maskkv import head_budgets, layer_budgets, layer_importance
from tests.device import DEVICE, FP32_OUT_TOLERANCE
from tests.masked_references import (TIE, assert_matches_reference, batches, first_canvas_attention, kept_fraction,
                                     kept_lists, top, votes)
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, MASK_ID, RAGGED_PROMPTS, differing, random_prompt, tiny_model,
                               masked_decode as decode, masked_tokens as generate)

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



def test_budget_covering_the_prompt_equals_dllm_cache():
    expected = generate(get_method("dllm_cache", prompt_interval=3, response_interval=2))
    result = decode(get_method("maskkv", budget=20, prompt_interval=3, response_interval=2))
    assert result.tokens == expected
    assert "kv_kept" not in result.stats  # nothing was evicted


def test_tiny_budget_differs_and_keeps_little():
    expected = generate(get_method("dllm_cache"))
    method = get_method("maskkv", budget=1)
    result = decode(method)
    assert differing(result.tokens, expected) > 0
    kept, kv_heads = kept_lists(method), MODEL.cfg.num_kv_heads
    assert result.stats["kv_kept"] == kept_fraction(method, PROMPTS)  # of 20 + 13 prompt tokens per layer and head
    assert sum(int(keep.sum()) for _, keep in kept) <= len(PROMPTS) * kv_heads * len(kept)  # <= 1 per head on average
    layer_budget = layer_budgets(1, method.importance[0], beta=0.4, boundary_layers=1)  # 1 per layer: all boundary
    for (indices, keep), cache, budget in zip(kept, method.layers, layer_budget, strict=True):
        per_head = keep[:, :, 0].sum(dim=-1)  # [rows, kv_heads]
        assert bool((per_head.sum(dim=1) <= budget * kv_heads).all())  # Algorithm 3 splits B_l * H_kv
        assert indices.shape[2] == max(int(per_head.max()), 1) <= budget * kv_heads  # the largest head, padded
        assert cache.keys.shape[2] == indices.shape[2] + GEN.gen_length  # the full prompt is not kept past step 0


@pytest.mark.parametrize("knobs", [
    dict(budget=15),  # between the rows' prompt lengths (13 and 20)
    dict(budget=5),  # below both
    dict(budget=15, prompt_interval=3, response_interval=2),  # the kept K/V gathered again at refreshes
    dict(budget=5, prompt_interval=3, response_interval=2),
])
def test_a_row_decodes_the_same_alone_and_next_to_another_prompt(knobs):
    batched = generate(get_method("maskkv", **knobs))
    alone = [generate(get_method("maskkv", **knobs), [prompt])[0] for prompt in PROMPTS]
    assert batched == alone


@pytest.mark.parametrize("budget", [13, 15])  # 13: the row's prompt is exactly the budget
@pytest.mark.parametrize("intervals", [{}, dict(prompt_interval=3, response_interval=2)])
def test_a_row_whose_prompt_fits_the_budget_equals_dllm_cache_in_any_batch(intervals, budget):
    method = get_method("maskkv", budget=budget, **intervals)
    short_row = generate(method)[1]  # 13 tokens, next to 20
    assert short_row == generate(get_method("dllm_cache", **intervals))[1]
    for indices, keep in kept_lists(method):  # it kept its whole prompt (columns 7..19) in every layer and head
        for head in range(indices.shape[1]):
            assert set(indices[1, head][keep[1, head, 0]].tolist()) == set(range(20 - 13, 20))


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


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), group=st.sampled_from([1, 2]), q_len=st.integers(1, 5), prompt=st.integers(1, 9),
       extra=st.integers(0, 4), per_head_mask=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_mass_is_the_summed_softmax(batch, group, q_len, prompt, extra, per_head_mask, seed):
    """Mask voting's sum (methods/common.py attention_mass): per KV head, the softmax probability on each
    prompt key summed over the weighted queries, averaged over the query group."""
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


def test_head_budgets_floor_the_base_and_each_share_per_row():
    """Algorithm 3 with a per-row B_l: floor(alpha B_l) is the base (not rounded up), the pool's shares floored."""
    mass = torch.tensor([[[3.0, 1.0], [1.0, 0.0], [0.0, 0.0]], [[2.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    counts = head_budgets(mass, layer_budget=torch.tensor([15, 7]), alpha=0.1)
    # row 0: base floor(1.5) = 1, pool 14 * 3 = 42 at .8 .2 0; row 1: base 0, pool 21 at .5 .25 .25
    assert counts.tolist() == [[1 + 33, 1 + 8, 1 + 0], [10, 5, 5]]


def test_the_default_boundary_is_at_least_one_layer_at_each_end():
    """boundary_layers None: max(1, L // 8) layers at each end, so a 4-layer model's budgets are those of
    boundary_layers = 1 (Algorithm 2 with the first and last layer as the boundary), not an even split."""
    model = tiny_model("llada", n_layers=4)
    gen = GenerationConfig(gen_length=4, block_length=4, steps=1)
    methods = [get_method("maskkv", budget=10, **knobs) for knobs in ({}, {"boundary_layers": 1})]
    for method in methods:
        generate(method, [random_prompt(30, seed=1)], gen, model)
    importance = methods[0].importance[0]
    expected = layer_budgets(10, importance, beta=0.4, boundary_layers=1)
    assert expected != [10] * 4 and methods[0].budgets[:, 0].tolist() == expected == methods[1].budgets[:, 0].tolist()


def test_keep_top_respects_counts_padding_and_order():
    scores = torch.tensor([[[0.9, 0.1, 0.5, 0.7, 0.3]], [[0.9, 0.8, 0.1, 0.2, 0.6]]])
    indices, keep = keep_top(scores, torch.tensor([[3], [9]]), prompt_lengths=torch.tensor([5, 3]))
    assert indices[0, 0][keep[0, 0, 0]].tolist() == [0, 2, 3]
    assert indices[1, 0][keep[1, 0, 0]].tolist() == [2, 3, 4]  # row 1: 2 pad columns, count clamped to 3


def test_keep_top_breaks_ties_to_the_lower_position_whatever_the_other_heads_keep():
    """A head's choice among equal scores must not depend on the largest count over the heads (a rank
    holding only some heads, tensor parallel, sees a different largest count)."""
    scores = torch.tensor([[[0.5, 0.5, 0.5, 0.5, 0.9, 0.5, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]]])
    for other in (2, 3, 7):
        indices, keep = keep_top(scores, torch.tensor([[2, other]]), prompt_lengths=torch.tensor([8]))
        assert indices[0, 0][keep[0, 0, 0]].tolist() == [0, 4]


def first_canvas_importance(model, prompts, gen=GEN):
    """maskkv.layer_importance on the masked engine's first canvas of the prompts (left-padded, padding
    hidden): what MaskKV measures online."""
    canvas = left_padded_canvas(prompts, gen.gen_length, MASK_ID, model.cfg.eos_token_ids[0], "cpu")
    mask = CanvasMask(valid=canvas.valid if canvas.ragged else None)
    return layer_importance(model, canvas.tokens, canvas.positions, canvas.valid, mask)


def test_the_profile_knob_is_read_and_checked(tmp_path):
    """A profile gives every row its layer importance; without one each row's is measured on the first
    canvas; a profile of the wrong length or path is named."""
    model = tiny_model("llada")
    profile = tmp_path / "maskkv_profile.json"
    profile.write_text(json.dumps({"layer_importance": [0.9, 0.1]}))
    method = get_method("maskkv", budget=4, profile=str(profile))
    generate(method, model=model)
    assert method.importance == [[0.9, 0.1]] * len(PROMPTS)
    online = get_method("maskkv", budget=4)
    generate(online, model=model)
    assert online.importance == first_canvas_importance(model, PROMPTS)
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
    knobs = with_profile("maskkv", {"budget": 4}, model_dir)
    assert knobs == {"budget": 4, "profile": str(profile)}
    method = get_method("maskkv", **knobs)
    generate(method, model=model)
    assert method.importance == [importance] * len(PROMPTS)
    assert with_profile("snapkv", {"budget": 4}, model_dir) == {"budget": 4}


def test_layer_importance_compares_each_layer_with_its_own_input():
    """Eq. 8: layer l's importance is 1 - the mean over a row's real tokens of cos(layer l's input, its output),
    its input the layer before's output, as a dense forward passes it (seen here through forward hooks)."""
    model = tiny_model("llada", n_layers=3)
    got = first_canvas_importance(model, PROMPTS)
    canvas = left_padded_canvas(PROMPTS, GEN.gen_length, MASK_ID, model.cfg.eos_token_ids[0], "cpu")
    mask = CanvasMask(valid=canvas.valid)
    seen = []
    hooks = [layer.register_forward_hook(lambda _, args, out: seen.append((args[0], out))) for layer in model.layers]
    try:
        model.hidden(canvas.tokens, canvas.positions, lambda _, q, k, v: attention(q, k, v, mask))
    finally:
        for hook in hooks:
            hook.remove()
    for row, valid in enumerate(canvas.valid):
        expected = [1 - torch.nn.functional.cosine_similarity(x[row, valid], out[row, valid], dim=-1).mean().item()
                    for x, out in seen]
        assert got[row] == pytest.approx(expected, rel=1e-5, abs=1e-6)  # cosines in float32


def test_maskkv_online_importance_is_each_rows_own():
    """With 4 layers (2 boundary, 2 middle) the layer importance moves the budgets; measured online (no
    profile), each row's comes from its own tokens, so the row decodes as it does alone, and a method
    reused after other prompts measures afresh."""
    model = tiny_model("llada", n_layers=4)
    knobs = dict(budget=10, prompt_interval=1, response_interval=1, boundary_layers=1)
    gen = GenerationConfig(gen_length=16, block_length=4, steps=16)
    prompts = [random_prompt(30, seed=1), random_prompt(21, seed=2)]
    batched_method, alone_methods = get_method("maskkv", **knobs), [get_method("maskkv", **knobs) for _ in prompts]
    batched = generate(batched_method, prompts, gen, model)
    alone = [generate(m, [p], gen, model)[0] for p, m in zip(prompts, alone_methods)]
    assert batched == alone
    for row, method in zip(batched_method.importance, alone_methods):  # the padding counts in no row's mean
        assert row == pytest.approx(method.importance[0], rel=1e-5, abs=1e-6)
    reused = get_method("maskkv", **knobs)
    generate(reused, [random_prompt(37, seed=3)], gen, model)
    assert generate(reused, prompts, gen, model) == batched


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """The step count, the cached canvas and the kept prompt start over with every generation: after
    decoding one prompt (16 steps, so a count left running would move every refresh), the method
    decodes the ragged batch as a new one does."""
    knobs = dict(budget=8, prompt_interval=3, response_interval=2)
    reused = get_method("maskkv", **knobs)
    generate(reused, [random_prompt(9, seed=5)])
    assert generate(reused) == generate(get_method("maskkv", **knobs))


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="budget"):
        get_method("maskkv", budget=0)
    with pytest.raises(ValueError, match="alpha"):
        get_method("maskkv", alpha=1.5)
    with pytest.raises(ValueError, match="response_interval"):
        get_method("maskkv", response_interval=0)


# The reference: MaskKV's step-0 eviction as its paper and docstring state it (tests/masked_references.py
# has the shared machinery). Where the docstring settles what the paper leaves open, the reference
# follows the docstring: the votes take the softmax over the whole canvas (eq. 6; Algorithm 3's
# pseudocode takes it over the prompt keys only); the boundary layers are the first and last
# max(1, L // 8) unless boundary_layers says. A row whose prompt fits the budget keeps all of it. An
# example whose head budget lands within TIE of an integer before its floor is skipped, as is one whose
# k-th and (k+1)-th votes are that close.


def algorithm_2(budget, importance, beta, boundary):
    """MaskKV's layer budgets, exactly: base floor(beta B) each; the pool (B - base) L split as
    floor(pool S_bound / (S_bound + S_mid)) to the boundary layers (the first and last `boundary`), the
    rest to the middle, each group's share floored equally over its layers."""
    num_layers = len(importance)
    is_boundary = [l < boundary or l >= num_layers - boundary for l in range(num_layers)]
    base = math.floor(beta * budget)
    pool = (budget - base) * num_layers
    s_bound = sum(Fraction(s) for s, b in zip(importance, is_boundary) if b)
    s_mid = sum(Fraction(s) for s, b in zip(importance, is_boundary) if not b)
    pool_bound = math.floor(pool * s_bound / (s_bound + s_mid))
    n_bound = sum(is_boundary)
    return [base + (pool_bound // n_bound if b else (pool - pool_bound) // (num_layers - n_bound))
            for b in is_boundary]


def reference_maskkv(model, prompt, budget, alpha, layer_budgets):
    """Per layer, per KV head, the prompt tokens MaskKV keeps for this row, and whether a float32 tie
    could change them. Mask voting: I[h, j] = the sum over the response's [MASK] queries (all of them at
    step 0) of their softmax on prompt key j, softmax over the whole canvas, averaged over the group.
    Algorithm 3: P_h = sum_j I[h, j] / sum_h' sum_j I[h', j]; k_h = floor(alpha B_l) + floor((B_l -
    floor(alpha B_l)) H_kv P_h); head h keeps its top-k_h tokens (all of them if k_h >= n)."""
    n, kv_heads = len(prompt), model.cfg.num_kv_heads
    kept, fragile = [], False
    for p, layer_budget in zip(first_canvas_attention(model, prompt), layer_budgets, strict=True):
        if n <= budget:
            kept.append((frozenset(range(n)),) * kv_heads)
            continue
        scores = votes(p, slice(n, None), n, kv_heads)
        preference = scores.sum(-1) / scores.sum()
        base = math.floor(alpha * layer_budget)
        shares = ((layer_budget - base) * kv_heads * preference).tolist()
        fragile |= any(abs(s - round(s)) <= TIE * max(1.0, s) and s != round(s) for s in shares)
        heads = []
        for h, share in enumerate(shares):
            chosen, tie = top(scores[h], base + math.floor(share))
            heads.append(chosen)
            fragile |= tie
        kept.append(tuple(heads))
    return kept, fragile


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
@settings(max_examples=15, deadline=None, derandomize=True)
@given(batch=batches(), alpha=st.integers(0, 20), beta=st.integers(0, 20), boundary=st.sampled_from([None, 1, 2]),
       data=st.data())
def test_maskkv_keeps_its_references_tokens(batch, alpha, beta, boundary, data):
    """Random alpha, beta (multiples of 0.05) and boundary groups; the layer importance from a profile,
    so the layer budgets are the formula's."""
    model, prompts, budget, intervals = batch
    alpha, beta, num_layers = alpha / 20, beta / 20, model.cfg.num_layers
    importance = data.draw(st.lists(st.integers(1, 9), min_size=num_layers, max_size=num_layers))
    layer_budgets = algorithm_2(budget, importance, beta, min(boundary or max(1, num_layers // 8), num_layers))
    references = [reference_maskkv(model, prompt, budget, alpha, layer_budgets) for prompt in prompts]
    assume(not any(fragile for _, fragile in references))
    with tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "maskkv_profile.json"
        profile.write_text(json.dumps({"layer_importance": [float(s) for s in importance]}))
        method = get_method("maskkv", budget=budget, alpha=alpha, beta=beta, boundary_layers=boundary,
                            profile=str(profile), **intervals)
        assert_matches_reference(method, model, prompts, [kept for kept, _ in references], intervals)


@pytest.mark.parametrize("boundary_layers", [2, 3, 8])
def test_boundary_groups_meeting_or_wider_than_the_model_make_every_layer_boundary(boundary_layers):
    """boundary_layers at least half the layers (here 4): every layer is a boundary layer, none middle, so
    Algorithm 2 shares the whole pool equally and each layer's budget is the budget itself, whatever the
    importance."""
    model = tiny_model("llada", n_layers=4)
    gen = GenerationConfig(gen_length=4, block_length=4, steps=1)
    method = get_method("maskkv", budget=10, boundary_layers=boundary_layers)
    generate(method, [random_prompt(30, seed=1)], gen, model)
    assert method.budgets[:, 0].tolist() == [10] * 4
