"""Fast-dLLM's prefix and dual caches and Sparse-dLLM (methods/fast_dllm.py, sparse_dllm.py, on
methods/outside_cache.py) against a plain-torch float64 reference of what their docstrings and the
Sparse-dLLM paper state, on the masked engine: tiny float64 LLaDA models (1, 2 or 4 KV heads for 4
query heads), ragged batches of 2-3 left-padded prompts, 3 blocks of 4 steps or threshold decoding,
with or without classifier-free guidance (a doubled batch), random knobs.

The reference (ReferenceOutsideCache) decodes every batch row alone, from the row's own tokens (its
prompt without the padding, then the whole generated region, positions from 0), with an explicit
softmax over an explicit key mask in every layer. Per block, at step s within it and since = s - delay:
    since < 0                   a full forward of the row, nothing kept;
    since == 0, or refresh > 0 and since % refresh == 0
                                a full forward of the row; each layer keeps the K/V of a set of the
                                row's positions per KV head (below), the others zeroed and hidden;
    otherwise                   a cached step: only the fed range is forwarded (the block in dual mode,
                                the block and everything after it in prefix mode); its queries attend
                                to the kept K/V and the fed range's own fresh K/V, nothing else.
A new block drops what was kept. Fast-dLLM keeps every position outside the fed range. Sparse-dLLM
(dual mode, no refresh) keeps Algorithm 1's pivotal tokens: the candidates are the positions outside
the block (Algorithm 5, prefix_sparse: before it); each candidate's score is the dot product of the
block's mean query with its key, / sqrt(d) (the paper's A; Algorithm 1 leaves the positive scale out,
which ranks alike); the scores are max-pooled over the candidates in their
order (the block removed, nothing beyond either end) with width `kernel`; the top floor(ratio *
candidates) pooled scores are kept; with prefix_sparse the whole suffix is kept as well.

Where the docstrings settle what the papers leave open, the reference follows the docstrings: Fast-
dLLM's `delay` and `refresh` count steps within the block from the building step; Sparse-dLLM's count
is the row's own candidates (a row alone: its padding is neither counted nor kept); ties go to the
lower position; the paper keeps one set for all heads, its scores averaged over the query heads, and
`per_head` keeps one set per KV head, its scores averaged over that head's query group. Sparse-dLLM
scores in float32 and the reference in float64: an example where a pooled score lies within 1e-5 (times
the largest sum of |q_i k_i / sqrt(d)| over the scores) of the last kept one, or where a tie straddling
the cut rests on a window whose two largest scores are that close, is skipped (hypothesis.assume).
Sparse-dLLM has no window knob besides the pooling width `kernel`.

Both run in the engine (the reference through the base Method hooks only): every step's logits must
agree within 1e-9, both must decode the same tokens, and at every step that builds a cache the method
must keep the reference's positions per block, step, layer, batch row and KV head (read from the K
buffers it keeps, matched to the canvas's keys)."""

import math
from functools import lru_cache

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanodllm import masked
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.base import Method
from tests.tiny_models import random_prompt, tiny_model

BLOCKS = 3
TIE = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@lru_cache(maxsize=None)
def model_of(kv_heads):
    return tiny_model("llada", seed=5, n_kv_heads=kv_heads)


def attend(q, keys, values, visible):
    """Explicit softmax(q k^T / sqrt(d)) v over the visible keys only: q [heads, m, d], keys and values
    [kv_heads, n, d], visible [kv_heads, n] bool."""
    group = q.shape[0] // keys.shape[0]
    k, v, seen = (x.repeat_interleave(group, 0) for x in (keys, values, visible))
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~seen[:, None, :], float("-inf"))
    return scores.softmax(-1) @ v


class Outside:
    """Fast-dLLM: every position outside the fed range, for every KV head."""

    def __call__(self, q, k, block, fed):
        keep = torch.ones(k.shape[:2], dtype=torch.bool)
        keep[:, fed.start : fed.stop] = False
        return keep


class Pivotal:
    """Sparse-dLLM's Algorithm 1 (Algorithm 5 with prefix_sparse) for one row and layer; fragile turns
    True once a selection is near a float32 tie."""

    def __init__(self, ratio, kernel, per_head, prefix_sparse):
        self.ratio, self.half, self.per_head, self.prefix_sparse = ratio, kernel // 2, per_head, prefix_sparse
        self.fragile = False

    def __call__(self, q, k, block, fed):
        kv_heads, n, head_dim = k.shape
        after = [] if self.prefix_sparse else list(range(block.stop, n))
        candidates = list(range(block.start)) + after
        q_mean = q[:, block.start : block.stop].mean(1)  # [heads, d]
        keys = k.repeat_interleave(q.shape[0] // kv_heads, 0)[:, candidates]  # [heads, m, d]
        products = q_mean[:, None, :] * keys * head_dim**-0.5
        per_query_head = products.sum(-1)  # [heads, m]
        if self.per_head:
            scores = per_query_head.unflatten(0, (kv_heads, -1)).mean(1)
        else:
            scores = per_query_head.mean(0, keepdim=True).expand(kv_heads, -1)
        tolerance = TIE * products.abs().sum(-1).max().item()
        count = math.floor(self.ratio * len(candidates))
        keep = torch.zeros(kv_heads, n, dtype=torch.bool)
        if self.prefix_sparse:
            keep[:, block.stop :] = True  # the whole suffix
        for h in range(kv_heads):
            row = scores[h].tolist()
            pooled = [max(row[max(0, i - self.half) : i + self.half + 1]) for i in range(len(row))]
            chosen = sorted(range(len(row)), key=lambda i: (-pooled[i], i))[:count]
            keep[h, [candidates[i] for i in chosen]] = True
            self.fragile |= self.near_tie(row, pooled, count, tolerance)
        return keep

    def near_tie(self, scores, pooled, count, tolerance):
        """Whether float32 rounding of the scores could change the top `count` pooled: a pooled score
        within tolerance of the last kept one but not equal to it, or, where that score's tie straddles
        the cut, one of its windows whose two largest scores are within tolerance."""
        if count == 0 or count == len(pooled):
            return False
        ranked = sorted(pooled, reverse=True)
        last = ranked[count - 1]
        if any(0 < abs(p - last) <= tolerance for p in pooled):
            return True
        if ranked[count] != last:
            return False
        for i, p in enumerate(pooled):
            window = sorted(scores[max(0, i - self.half) : i + self.half + 1], reverse=True)
            if p == last and len(window) > 1 and window[0] - window[1] <= tolerance:
                return True
        return False


class ReferenceOutsideCache(Method):
    """The cache of the module's docstring, per batch row, with what each layer keeps chosen by select
    (Outside or Pivotal). kept_sets: (block, step, layer, batch row, KV head, kept positions of the row)
    at every building step."""

    name = "reference_outside_cache"
    engines = ("masked",)

    def __init__(self, mode, delay, refresh, select):
        super().__init__()
        self.mode, self.delay, self.refresh, self.select = mode, delay, refresh, select
        self.cache, self.kept_sets = {}, []

    def begin_block(self, ctx):
        self.cache = {}

    def step(self, model, ctx):
        since = ctx.step - self.delay
        if since == 0 or (since > 0 and self.refresh > 0 and since % self.refresh == 0):
            phase = "build"
        else:
            phase = "cached" if since > 0 else "full"
        hidden = torch.zeros(*ctx.tokens.shape, model.cfg.hidden_size, dtype=torch.float64)
        for b in range(ctx.tokens.shape[0]):
            columns = ctx.valid[b].nonzero()[:, 0]
            pad = int(columns[0])
            block = range(ctx.logits_start - pad, ctx.logits_stop - pad)
            fed = range(block.start, block.stop if self.mode == "dual" else len(columns))
            rows = fed if phase == "cached" else range(len(columns))
            if phase == "build":
                self.cache[b] = []
            x = self.forward(model, ctx.tokens[b, columns], rows, block, fed, phase, self.cache.get(b))
            hidden[b, columns[rows.start : rows.stop]] = x
            if phase == "build":
                for i, (keep, _, _) in enumerate(self.cache[b]):
                    for h, positions in enumerate(keep):
                        self.kept_sets.append((ctx.block, ctx.step, i, b, h, tuple(positions.nonzero()[:, 0].tolist())))
        return hidden

    def forward(self, model, ids, rows, block, fed, phase, cache):
        """The row's hidden states at `rows`: all its tokens, or, on a cached step, the fed range. cache:
        the row's (kept positions [kv_heads, n], keys, values) per layer, which a building step fills."""
        positions = torch.arange(rows.start, rows.stop)
        x, rope = model.embed(ids[positions][None]), model.rope(positions[None])
        for i, layer in enumerate(model.layers):
            q, k, v = (t[0] for t in layer.qkv(layer.attn_norm(x), rope))
            if phase == "cached":
                keep, keys, values = cache[i]
                keys, values, visible = keys.clone(), values.clone(), keep.clone()
                keys[:, fed.start : fed.stop], values[:, fed.start : fed.stop] = k, v
                visible[:, fed.start : fed.stop] = True
            else:
                keys, values, visible = k, v, torch.ones(k.shape[:2], dtype=torch.bool)
            if phase == "build":
                keep = self.select(q, k, block, fed)
                cache.append((keep, k * keep[..., None], v * keep[..., None]))
            x = x + layer.out(attend(q, keys, values, visible)[None])
            x = x + layer.mlp(layer.mlp_norm(x))
        return x[0]


def kept_positions(kept, k, ctx, layer):
    """The method's kept key set at a building step: (block, step, layer, batch row, KV head, positions
    of the row) for every unmasked slot of its K buffer, each found among the canvas's keys k by exact
    equality (a padding column gives a negative position)."""
    sets = []
    for b in range(k.shape[0]):
        pad = int((~ctx.valid[b]).sum())
        for h in range(k.shape[1]):
            shown = torch.ones(kept.keys.shape[2], dtype=torch.bool) if kept.mask is None else \
                kept.mask[b, h % kept.mask.shape[1], 0]
            matches = (kept.keys[b, h, shown][:, None] == k[b, h][None]).all(-1)
            assert matches.any(1).all(), "a kept key is none of the canvas's keys"
            columns = matches.int().argmax(1)  # the first matching column
            sets.append((ctx.block, ctx.step, layer, b, h, tuple(sorted((columns - pad).tolist()))))
    return sets


def with_kept_sets(method):
    """The method, its keep wrapped to record every kept key set (method.kept_sets)."""
    method.kept_sets, keep = [], method.keep

    def recorded_keep(layer, q, k, v, ctx):
        kept = keep(layer, q, k, v, ctx)
        method.kept_sets += kept_positions(kept, k, ctx, layer)
        return kept

    method.keep = recorded_keep
    return method


def decode(method, model, prompts, gen):
    """The engine's tokens with `method`, whose logits at every step are recorded (method.seen_logits)."""
    method.seen_logits, logits = [], method.logits

    def recorded_logits(model, hidden, ctx):
        out = logits(model, hidden, ctx)
        method.seen_logits.append(out.clone())
        return out

    method.logits = recorded_logits
    return masked.generate(model, prompts, gen, method).tokens


@st.composite
def batches(draw):
    """(model, 2-3 ragged prompts of 2-14 tokens, not all of one length, a schedule of 3 blocks of 4
    tokens: 4 steps each or threshold decoding, with or without classifier-free guidance)."""
    model = model_of(draw(st.sampled_from([1, 2, 4])))
    first = draw(st.integers(2, 14))
    offsets = draw(st.lists(st.integers(1, 12), min_size=1, max_size=2))
    lengths = [first] + [2 + (first - 2 + offset) % 13 for offset in offsets]  # the second differs from the first
    seed = draw(st.integers(0, 2**16))
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=4 * BLOCKS, block_length=4, steps=4 * BLOCKS,
                           threshold=draw(st.sampled_from([None, 0.15])), cfg_scale=draw(st.sampled_from([0.0, 1.0])))
    return model, prompts, gen


def assert_matches_reference(method, reference, expected, batch):
    """The method's decode against the reference's (expected: its tokens): the same logits at every
    step, the same tokens, the same kept key sets."""
    model, prompts, gen = batch
    tokens = decode(with_kept_sets(method), model, prompts, gen)
    assert len(method.seen_logits) == len(reference.seen_logits)
    for step, (got, want) in enumerate(zip(method.seen_logits, reference.seen_logits)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert tokens == expected
    assert sorted(method.kept_sets) == sorted(reference.kept_sets)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=batches(), mode=st.sampled_from(["dual", "prefix"]), delay=st.integers(0, 3),
       refresh=st.integers(0, 4))
def test_fast_dllm_matches_its_reference(batch, mode, delay, refresh):
    reference = ReferenceOutsideCache(mode, delay, refresh, Outside())
    expected = decode(reference, *batch)
    method = get_method("fast_dllm", mode=mode, delay=delay, refresh=refresh)
    assert_matches_reference(method, reference, expected, batch)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=batches(), ratio=st.integers(1, 20), kernel=st.sampled_from([1, 3, 5]), delay=st.integers(0, 3),
       per_head=st.booleans(), prefix_sparse=st.booleans())
def test_sparse_dllm_matches_its_reference(batch, ratio, kernel, delay, per_head, prefix_sparse):
    """Random ratio (a multiple of 0.05), pooling width, delay, one set per KV head or one for all,
    and Algorithm 5."""
    select = Pivotal(ratio / 20, kernel, per_head, prefix_sparse)
    reference = ReferenceOutsideCache("dual", delay, 0, select)
    expected = decode(reference, *batch)
    assume(not select.fragile)
    method = get_method("sparse_dllm", ratio=ratio / 20, kernel=kernel, delay=delay, per_head=per_head,
                        prefix_sparse=prefix_sparse)
    assert_matches_reference(method, reference, expected, batch)
