"""MaskKV and SnapKV's step-0 eviction (methods/maskkv.py, snapkv.py) against plain-torch float64
references of their papers and docstrings, on the masked engine: tiny float64 LLaDA models on the CPU
(2-4 layers, GQA groups 1, 2 or 4), random budgets and knobs, ragged batches of 2-3 left-padded
prompts. A reference forwards each row alone, its first canvas (prompt then [MASK] * gen_length,
positions from 0) with an explicit softmax per layer, forms every vote, pool and budget from the
formulas, and keeps per layer and KV head a set of the row's prompt tokens. The engine with the real
method must keep exactly those tokens in every layer, row and KV head, and decode the same tokens as
the engine evicting to the reference's sets.

Where the docstring settles what the paper leaves open, the reference follows the docstring: MaskKV's
votes take the softmax over the whole canvas (eq. 6; Algorithm 3's pseudocode takes it over the prompt
keys only); the boundary layers are the first and last max(1, L // 8) unless boundary_layers says;
SnapKV's pool averages, at each prompt token, the votes of the row's own prompt tokens in reach, the
window's included (SnapKV's code pools the non-window votes only, zeros past the edges counted), and
the window always stays, its latest tokens first when the budget is smaller. A row whose prompt fits
the budget keeps all of it. The methods vote in float32, the references in float64: an example whose
k-th and (k+1)-th scores are within 1e-4 relative, or whose head budget lands within 1e-4 of an
integer before its floor, is skipped (hypothesis.assume), far from a float32 tie."""

import json
import math
import tempfile
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanodllm import masked
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.canvas_cache import PromptEviction
from tests.tiny_models import MASK_ID, random_prompt, tiny_model

GEN = GenerationConfig(gen_length=8, block_length=4, steps=8)
TIE = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@lru_cache(maxsize=None)
def model_of(layers, kv_heads):
    return tiny_model("llada", n_layers=layers, n_kv_heads=kv_heads)


def first_canvas_attention(model, prompt):
    """Per layer, the softmax(q k^T / sqrt(d)) [heads, t, t] of the row's first canvas alone (prompt,
    then gen_length [MASK], positions from 0, every key visible), each layer fed the exact output of
    the one before."""
    ids = torch.tensor(prompt + [MASK_ID] * GEN.gen_length)[None]
    x, rope = model.embed(ids), model.rope(torch.arange(ids.shape[1])[None])
    probs = []
    for layer in model.layers:
        q, k, v = (t[0] for t in layer.qkv(layer.attn_norm(x), rope))
        group = q.shape[0] // k.shape[0]
        p = (q @ k.repeat_interleave(group, 0).transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        probs.append(p)
        x = x + layer.out((p @ v.repeat_interleave(group, 0))[None])
        x = x + layer.mlp(layer.mlp_norm(x))
    return probs


def votes(p, queries, n, kv_heads):
    """[kv_heads, n]: summed over the query rows `queries`, each query's probability on prompt key j,
    averaged over each KV head's query group."""
    return p[:, queries, :n].sum(1).unflatten(0, (kv_heads, -1)).mean(1)


def top(scores, count):
    """(the `count` best positions of scores [n] as a set, whether the count-th and the next are within
    TIE relative: a float32 tie)."""
    if count <= 0:
        return frozenset(), False
    if count >= scores.shape[0]:
        return frozenset(range(scores.shape[0])), False
    ranked = scores.sort(descending=True)
    last, next_ = ranked.values[count - 1].item(), ranked.values[count].item()
    return frozenset(ranked.indices[:count].tolist()), last - next_ <= TIE * abs(last)


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


def method_kept(method, prompts):
    """What the engine's method kept after step 0: per layer, per row, per KV head, the set of prompt
    tokens (counted from the row's first prompt token, not from the padded column)."""
    width = max(map(len, prompts))
    kept = []
    for indices, keep in method.indices:
        kept.append([tuple(frozenset(int(c) - (width - len(prompt)) for c in indices[row, h][keep[row, h, 0]])
                           for h in range(indices.shape[1])) for row, prompt in enumerate(prompts)])
    return kept


class GivenSelection(PromptEviction):
    """The cached canvas evicting, at step 0, every layer, row and KV head to given prompt token sets
    (kept[row][layer][head], counted from the row's first prompt token)."""

    name = "given"

    def __init__(self, kept, budget, **intervals):
        super().__init__(budget, **intervals)
        self.kept = kept

    def token_scores(self, i, q_p, q_r, cache, ctx):
        width = cache.prompt_slots
        scores = torch.zeros(ctx.tokens.shape[0], cache.keys.shape[1], width, dtype=torch.float64)
        for row, length in enumerate(ctx.prompt_lengths.tolist()):
            for h, tokens in enumerate(self.kept[row][i]):
                scores[row, h, [width - length + t for t in tokens]] = 1.0
        return scores

    def head_counts(self, i, scores, ctx):
        return scores.sum(-1).long()


@st.composite
def batches(draw):
    """(model, 2-3 ragged prompts of 2-24 tokens, not all of one length, a budget below the longest,
    refresh intervals)."""
    model = model_of(draw(st.integers(2, 4)), draw(st.sampled_from([1, 2, 4])))
    first = draw(st.integers(2, 24))
    offsets = draw(st.lists(st.integers(1, 22), min_size=1, max_size=2))
    lengths = [first] + [2 + (first - 2 + offset) % 23 for offset in offsets]  # the second differs from the first
    seed = draw(st.integers(0, 2**16))
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    budget = draw(st.integers(1, max(lengths) - 1))
    intervals = dict(prompt_interval=draw(st.sampled_from([2, 50])), response_interval=draw(st.sampled_from([1, 3])))
    return model, prompts, budget, intervals


def assert_matches_reference(method, model, prompts, expected, budget, intervals):
    """The method keeps the reference's sets in every layer, row and KV head, and decodes what the
    engine evicting to those sets decodes."""
    tokens = masked.generate(model, prompts, GEN, method).tokens
    got = method_kept(method, prompts)
    assert len(got) == model.cfg.num_layers
    for layer, rows in enumerate(got):
        for row, heads in enumerate(rows):
            want = expected[row][layer]
            assert heads == want, f"layer {layer}, row {row}: the method kept {heads}, the reference {want}"
    given = GivenSelection(expected, budget, rho=0.25, **intervals)
    assert masked.generate(model, prompts, GEN, given).tokens == tokens


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
        assert_matches_reference(method, model, prompts, [kept for kept, _ in references], budget, intervals)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(batch=batches(), window=st.integers(1, 10), pool=st.sampled_from([1, 3, 5, 7]))
def test_snapkv_keeps_its_references_tokens(batch, window, pool):
    """Random window (wider or narrower than a row's prompt, or than the budget) and pool width."""
    model, prompts, budget, intervals = batch
    references = [reference_snapkv(model, prompt, budget, window, pool) for prompt in prompts]
    assume(not any(fragile for _, fragile in references))
    method = get_method("snapkv", budget=budget, window=window, pool=pool, **intervals)
    assert_matches_reference(method, model, prompts, [kept for kept, _ in references], budget, intervals)
