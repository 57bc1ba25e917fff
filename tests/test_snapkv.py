"""SnapKV (methods/snapkv.py) on the masked engine: a budget covering the prompt equals dllm_cache, a
tiny budget differs and keeps (and states in kv_kept) at most its budget, a row decodes and votes alike
alone and in a ragged batch, every head keeps its budget of the real prompt and always its observation
window, and at step 0 it keeps exactly the prompt tokens of a plain-torch float64 reference
(reference_snapkv)."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanodllm.methods import get_method
from nanodllm.methods.maskkv import layer_budgets
from nanodllm.methods.snapkv import pool_real
from tests.masked_references import (assert_matches_reference, batches, first_canvas_attention, kept_fraction,
                                     kept_lists, top, votes)
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, RAGGED_PROMPTS, differing, random_prompt, masked_decode as
                               decode, masked_tokens as generate)

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



def test_budget_covering_the_prompt_equals_dllm_cache():
    expected = generate(get_method("dllm_cache", prompt_interval=3, response_interval=2))
    result = decode(get_method("snapkv", budget=20, prompt_interval=3, response_interval=2))
    assert result.tokens == expected
    assert "kv_kept" not in result.stats  # nothing was evicted


def test_tiny_budget_differs_and_keeps_little():
    expected = generate(get_method("dllm_cache"))
    method = get_method("snapkv", budget=1, window=4)
    result = decode(method)
    assert differing(result.tokens, expected) > 0
    kept, kv_heads = kept_lists(method), MODEL.cfg.num_kv_heads
    assert result.stats["kv_kept"] == kept_fraction(method, PROMPTS)  # of 20 + 13 prompt tokens per layer and head
    assert sum(int(keep.sum()) for _, keep in kept) <= len(PROMPTS) * kv_heads * len(kept)  # <= 1 per head on average
    layer_budget = layer_budgets(1, [1.0] * MODEL.cfg.num_layers, beta=0.4, boundary_layers=1)  # uniform: 1 per layer
    for (indices, keep), cache, budget in zip(kept, method.layers, layer_budget, strict=True):
        per_head = keep[:, :, 0].sum(dim=-1)  # [rows, kv_heads]
        assert bool((per_head.sum(dim=1) <= budget * kv_heads).all())
        assert indices.shape[2] == max(int(per_head.max()), 1) <= budget * kv_heads  # the largest head, padded
        assert cache.keys.shape[2] == indices.shape[2] + GEN.gen_length  # the full prompt is not kept past step 0


@pytest.mark.parametrize("knobs", [
    dict(budget=18, window=16),  # the window is wider than the short prompt
    dict(budget=8, window=4),  # the pool's reach past the short row's first token
])
def test_a_row_decodes_the_same_alone_and_next_to_another_prompt(knobs):
    batched = generate(get_method("snapkv", **knobs))
    alone = [generate(get_method("snapkv", **knobs), [prompt])[0] for prompt in PROMPTS]
    assert batched == alone


def test_eviction_keeps_each_heads_budget_of_the_real_prompt():
    method = get_method("snapkv", budget=5, window=2, pool=1)
    result = decode(method)
    for indices, keep in kept_lists(method):
        assert keep.sum(dim=-1).flatten().tolist() == [5] * (2 * 4)  # 2 rows x 4 KV heads
        assert bool((indices[1][keep[1, :, 0]] >= 20 - 13).all())  # row 1: never a pad column
        assert bool((indices[:, :, :, None] != indices[:, :, None, :]).sum() == 2 * 4 * 5 * 4)  # distinct
        assert bool((indices[..., 1:] >= indices[..., :-1]).all())  # prompt order
    assert result.stats["kv_kept"] == 5 * 2 / (20 + 13)  # 5 of each row's prompt, per layer and head


@pytest.mark.parametrize("budget, window", [(6, 3), (4, 4), (9, 2)])
def test_snapkv_always_keeps_its_observation_window(budget, window):
    """Every layer, row and KV head keeps the row's last `window` prompt tokens, whatever the votes,
    and fills the rest of its budget with other prompt tokens (prompts of 20 and 13, right-aligned in
    20 prompt columns)."""
    method = get_method("snapkv", budget=budget, window=window, pool=3)
    generate(method)
    kept = kept_lists(method)
    assert len(kept) == MASKED_MODEL.cfg.num_layers
    for indices, keep in kept:
        for row in range(2):
            for head in range(indices.shape[1]):
                chosen = set(indices[row, head][keep[row, head, 0]].tolist())  # keep: [batch, heads, 1, slots]
                assert set(range(20 - window, 20)) <= chosen and len(chosen) == budget


@pytest.mark.parametrize("window, pool", [(4, 5), (16, 3)])
def test_snapkv_votes_for_a_padded_row_as_for_the_row_alone(window, pool):
    """Every layer's pooled votes of the 13-token row, left-padded by 7 columns next to the 20-token
    one, equal its votes alone on its own columns: the pool never averages padding in, and a window
    wider than the row (16) is its whole prompt, never the padding columns left of it."""

    def scores_of(prompts):
        method = get_method("snapkv", budget=8, window=window, pool=pool)
        scores, token_scores = [], method.token_scores
        method.token_scores = lambda *args: scores.append(token_scores(*args)) or scores[-1]
        generate(method, prompts)
        return scores

    batched, alone = scores_of(PROMPTS), scores_of([PROMPTS[1]])
    assert len(batched) == len(alone) == MODEL.cfg.num_layers
    for together, by_itself in zip(batched, alone):
        torch.testing.assert_close(together[1, :, 20 - 13 :], by_itself[0], atol=1e-10, rtol=0)


def test_the_pool_averages_each_token_over_the_real_prompt_tokens_in_reach():
    """pool_real (width 5) at a prompt's edges and beside left padding: each token's average is over
    its row's own tokens within 2 columns, neither the pads nor the columns past the ends counted as 0."""
    scores = torch.tensor([[[1.0, 2, 3, 4, 5, 6, 7]], [[100.0, 100, 3, 4, 5, 6, 7]]])
    real = torch.tensor([[[True] * 7], [[False, False] + [True] * 5]])
    pooled = pool_real(scores, real, 5)
    assert pooled[0, 0].tolist() == [2.0, 2.5, 3.0, 4.0, 5.0, 5.5, 6.0]
    assert pooled[1, 0, 2:].tolist() == [4.0, 4.5, 5.0, 5.5, 6.0]  # as the 5 tokens alone


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """The step count, the cached canvas and the kept prompt start over with every generation: after
    decoding one prompt (16 steps, so a count left running would move every refresh), the method
    decodes the ragged batch as a new one does."""
    knobs = dict(budget=8, prompt_interval=3, response_interval=2)
    reused = get_method("snapkv", **knobs)
    generate(reused, [random_prompt(9, seed=5)])
    assert generate(reused) == generate(get_method("snapkv", **knobs))


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="pool"):
        get_method("snapkv", pool=4)
    with pytest.raises(ValueError, match="window"):
        get_method("snapkv", window=0)
    with pytest.raises(ValueError, match="budget"):
        get_method("snapkv", budget=0)


# The reference: SnapKV's step-0 eviction as MaskKV's paper runs it and the docstring states it
# (tests/masked_references.py has the shared machinery). Where the docstring settles what the paper
# leaves open, the reference follows it: the pool averages, at each prompt token, the votes of the row's
# own prompt tokens in reach, the window's included (SnapKV's code pools the non-window votes only,
# zeros past the edges counted), and the window always stays, its latest tokens first when the budget
# is smaller. A row whose prompt fits the budget keeps all of it.


def reference_snapkv(model, prompt, budget, window, pool):
    """Per layer, per KV head, the prompt tokens SnapKV keeps for this row, and whether a float32 tie
    could change them. The window: the row's last w = min(window, n) prompt tokens; their queries vote
    (softmax over the whole canvas, summed over the window, averaged over the group); each prompt
    token's pooled score is the mean of the votes of the row's prompt tokens within pool // 2 of it.
    A head keeps the window's last min(budget, w) tokens, then the budget - w best pooled tokens before
    the window."""
    n, kv_heads = len(prompt), model.cfg.num_kv_heads
    w, half = min(window, n), pool // 2
    kept, fragile = [], False
    for p in first_canvas_attention(model, prompt):
        if n <= budget:
            kept.append((frozenset(range(n)),) * kv_heads)
            continue
        scores = votes(p, slice(n - w, n), n, kv_heads)
        pooled = torch.stack([scores[:, max(0, j - half) : j + half + 1].mean(-1) for j in range(n)], dim=-1)
        in_window = frozenset(range(n - min(budget, w), n))
        heads = []
        for h in range(kv_heads):
            chosen, tie = top(pooled[h, : n - w], budget - w)
            heads.append(in_window | chosen)
            fragile |= tie
        kept.append(tuple(heads))
    return kept, fragile


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
@settings(max_examples=15, deadline=None, derandomize=True)
@given(batch=batches(), window=st.integers(1, 10), pool=st.sampled_from([1, 3, 5, 7]))
def test_snapkv_keeps_its_references_tokens(batch, window, pool):
    """Random window (wider or narrower than a row's prompt, or than the budget) and pool width."""
    model, prompts, budget, intervals = batch
    references = [reference_snapkv(model, prompt, budget, window, pool) for prompt in prompts]
    assume(not any(fragile for _, fragile in references))
    method = get_method("snapkv", budget=budget, window=window, pool=pool, **intervals)
    assert_matches_reference(method, model, prompts, [kept for kept, _ in references], intervals)
