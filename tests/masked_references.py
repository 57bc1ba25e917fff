"""What the MaskKV and SnapKV reference tests share (tests/test_maskkv.py, test_snapkv.py): tiny float64
LLaDA models on the CPU (2-4 layers, GQA groups 1, 2 or 4), ragged batches of 2-3 left-padded prompts,
each row's first canvas attention in plain torch, the votes and top-k of the references, what a method
kept, and a dLLM-Cache that evicts to given token sets.

A reference forwards each row alone, its first canvas (prompt then [MASK] * gen_length, positions from
0) with an explicit softmax per layer, forms every vote, pool and budget from the formulas, and keeps
per layer and KV head a set of the row's prompt tokens. The engine with the real method must keep
exactly those tokens in every layer, row and KV head, and decode the same tokens as the engine evicting
to the reference's sets (GivenSelection). The methods vote in float32, the references in float64: an
example whose k-th and (k+1)-th scores are within TIE relative is skipped by the tests
(hypothesis.assume), far from a float32 tie."""

from functools import lru_cache

import torch
from hypothesis import strategies as st

from nanodllm.config import GenerationConfig
from nanodllm.generation import generate
from nanodllm.methods.common import keep_top
from nanodllm.methods.dllm_cache import DllmCache
from tests.tiny_models import MASK_ID, random_prompt, tiny_model

GEN = GenerationConfig(gen_length=8, block_length=4, steps=8)
TIE = 1e-4


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


def kept_lists(method):
    """Per layer, the prompt tokens a DllmCache kept at step 0 as (indices [batch, kv_heads, slots], keep
    [batch, kv_heads, 1, slots] bool), keep all True where the method stored no key mask."""
    assert method.kept and all(entry is not None for entry in method.kept), "a layer kept its whole prompt"
    return [(indices, torch.ones_like(indices, dtype=torch.bool)[:, :, None] if mask is None else mask)
            for indices, mask in method.kept]


def kept_fraction(method, prompts) -> float:
    """The prompt K/V entries the method's layers kept at step 0, of every row's prompt in every layer
    and KV head (what stats["kv_kept"] states)."""
    kept = kept_lists(method)
    slots = sum(int(keep.sum()) for _, keep in kept)
    return slots / (sum(map(len, prompts)) * kept[0][0].shape[1] * len(kept))


def method_kept(method, prompts):
    """What the engine's method kept after step 0: per layer, per row, per KV head, the set of prompt
    tokens (counted from the row's first prompt token, not from the padded column)."""
    width = max(map(len, prompts))
    kept = []
    for indices, keep in kept_lists(method):
        kept.append([tuple(frozenset(int(c) - (width - len(prompt)) for c in indices[row, h][keep[row, h, 0]])
                           for h in range(indices.shape[1])) for row, prompt in enumerate(prompts)])
    return kept


class GivenSelection(DllmCache):
    """dLLM-Cache evicting, at step 0, every layer, row and KV head to given prompt token sets
    (given[row][layer][head], counted from the row's first prompt token)."""

    name = "given"

    def __init__(self, given, **intervals):
        super().__init__(**intervals)
        self.given = given

    def prompt_kept(self, i, q_p, q_r, cache, ctx):
        width = cache.prompt_slots
        scores = torch.zeros(ctx.tokens.shape[0], cache.keys.shape[1], width, dtype=torch.float64)
        for row, length in enumerate(ctx.prompt_lengths.tolist()):
            for h, tokens in enumerate(self.given[row][i]):
                scores[row, h, [width - length + t for t in tokens]] = 1.0
        return keep_top(scores, scores.sum(-1).long(), ctx.prompt_lengths)


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


def assert_matches_reference(method, model, prompts, expected, intervals):
    """The method keeps the reference's sets in every layer, row and KV head, and decodes what the
    engine evicting to those sets decodes."""
    tokens = generate(model, prompts, GEN, method).tokens
    got = method_kept(method, prompts)
    assert len(got) == model.cfg.num_layers
    for layer, rows in enumerate(got):
        for row, heads in enumerate(rows):
            want = expected[row][layer]
            assert heads == want, f"layer {layer}, row {row}: the method kept {heads}, the reference {want}"
    given = GivenSelection(expected, rho=0.25, **intervals)
    assert generate(model, prompts, GEN, given).tokens == tokens
