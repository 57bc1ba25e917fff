"""Sparse-dLLM (methods/sparse_dllm.py) on the masked engine: ratio 1 equals Fast-dLLM's dual cache with
the same delay and keeps everything (kv_kept 1), a small ratio differs and keeps its share, a cached
step on an unchanged canvas equals the full forward, threshold decoding runs on the cached steps, a row
decodes and keeps alike alone and in a ragged batch, Algorithm 1's selection (pooling, padding, per
head), and every step's logits and kept K/V equal a plain-torch float64 reference of the paper
(tests/fast_dllm_references.py with Pivotal) over random knobs."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.sparse_dllm import pivotal_tokens
from tests.fast_dllm_references import (ReferenceOutsideCache, assert_matches_reference, batches, canvas_context,
                                        decode_recording_logits)
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, MASK_ID, RAGGED_PROMPTS, differing, masked_decode as decode,
                               masked_tokens as generate)

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



def test_threshold_decoding_runs_on_the_cached_steps():
    """Threshold decoding combined with the pruned cache. With a threshold of 1 each step unmasks only
    its most confident position (no position here is certain), so it decodes what it decodes one token
    per step without a threshold; a low threshold unmasks several per step."""
    one_per_step = GenerationConfig(gen_length=16, block_length=4, steps=16)
    never = GenerationConfig(gen_length=16, block_length=4, steps=16, threshold=1.0)
    expected = decode(get_method("sparse_dllm", ratio=0.5), gen=one_per_step)
    result = decode(get_method("sparse_dllm", ratio=0.5), gen=never)
    assert result.tokens == expected.tokens and result.forwards == expected.forwards == 16
    parallel = decode(get_method("sparse_dllm", ratio=0.5),
                      gen=GenerationConfig(gen_length=16, block_length=4, steps=16, threshold=0.05))
    assert parallel.forwards < 16 and all(MASK_ID not in row for row in parallel.tokens)


def test_a_cached_step_on_an_unchanged_canvas_equals_the_full_forward():
    method = get_method("sparse_dllm", ratio=1.0, delay=0)
    ctx = canvas_context(PROMPTS, step=0)
    method.begin_block(ctx)
    full = method.logits(MODEL, method.step(MODEL, ctx), ctx)  # builds the cache
    ctx = replace(ctx, step=1, t=ctx.t + 1)
    torch.testing.assert_close(method.logits(MODEL, method.step(MODEL, ctx), ctx), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("knobs", [{}, {"per_head": True}, {"prefix_sparse": True}])
def test_ratio_one_equals_the_dual_cache(delay, knobs):
    dual = generate(get_method("fast_dllm", mode="dual", delay=delay))
    result = decode(get_method("sparse_dllm", ratio=1.0, delay=delay, **knobs))
    assert result.tokens == dual
    assert result.stats["kv_kept"] == 1.0


def test_small_ratio_differs_and_keeps_its_share():
    dual = generate(get_method("fast_dllm", mode="dual", delay=1))
    result = decode(get_method("sparse_dllm", ratio=0.1))
    assert differing(result.tokens, dual) > 0
    assert 0.05 < result.stats["kv_kept"] < 0.15


@pytest.mark.parametrize("knobs", [{}, {"ratio": 0.25}, {"per_head": True}, {"ratio": 0.25, "prefix_sparse": True}])
def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch(knobs):
    """DESIGN.md: a row's result must not depend on the batch. The short prompt, left-padded next to a
    longer one, keeps floor(ratio * its own candidates), as it does alone (Algorithm 1 line 9)."""
    alone = generate(get_method("sparse_dllm", **knobs), [PROMPTS[1]])[0]
    assert generate(get_method("sparse_dllm", **knobs), PROMPTS)[1] == alone


def test_pivotal_tokens_pool_neighbours_and_skip_padding():
    q_mean = torch.tensor([[[1.0, 0.0]]])  # one head, d = 2: a key's score is its first coordinate
    keys = torch.tensor([[[[9.0, 0], [0, 0], [5, 0], [0, 0], [0, 0], [3, 0], [0, 0], [1, 0]]]])
    valid = torch.tensor([[False, False, True, True, True, True, True, True]])  # left padding: the 9 and a 0
    indices, keep = pivotal_tokens(q_mean, keys, valid, ratio=0.5, kernel=3, per_head=False)
    # pooled over the 6 real tokens: 5 5 3 3 3 1; the 9 spreads nowhere and the pad beside the 5 takes no
    # slot; int(0.5 * 8) = 4 are listed, floor(0.5 * 6) = 3 kept, and ties at 3 go to the lower position
    assert indices.tolist() == [[[2, 3, 4, 5]]] and keep.tolist() == [[[[True, True, True, False]]]]
    everything = torch.ones_like(valid)
    indices, keep = pivotal_tokens(q_mean, keys, everything, ratio=0.5, kernel=3, per_head=False)
    assert indices.tolist() == [[[0, 1, 2, 3]]]  # the 9 and the 5 spread to their neighbours
    indices, keep = pivotal_tokens(q_mean, keys, everything, ratio=0.25, kernel=1, per_head=False)
    assert indices.tolist() == [[[0, 2]]] and bool(keep.all())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 16), pad=st.integers(1, 8), ratio=st.floats(0.05, 1.0), kernel=st.sampled_from([1, 3, 5]),
       per_head=st.booleans(), seed=st.integers(0, 1000))
def test_a_padded_row_keeps_what_it_keeps_alone(n, pad, ratio, kernel, per_head, seed):
    """Row 1 is row 0's last n candidates behind `pad` pads of high score: it keeps the same
    floor(ratio * n) of its own candidates as those n alone, whatever the pads and the longer row."""
    generator = torch.Generator().manual_seed(seed)
    q_mean = torch.randn(1, 4, 8, generator=generator, dtype=torch.float64).expand(2, -1, -1)  # 2 KV heads
    keys = torch.randn(2, 2, pad + n, 8, generator=generator, dtype=torch.float64)
    keys[1, :, :pad] = q_mean[1].view(2, 2, 8).mean(dim=1, keepdim=True) * 10  # pads that would outscore all
    valid = torch.ones(2, pad + n, dtype=torch.bool)
    valid[1, :pad] = False
    indices, keep = pivotal_tokens(q_mean, keys, valid, ratio, kernel, per_head)
    alone, alone_keep = pivotal_tokens(q_mean[1:], keys[1:, :, pad:], valid[1:, pad:], ratio, kernel, per_head)
    kept = lambda indices, keep, shift: [[i - shift for i, k in zip(*head) if k]
                                         for head in zip(indices.tolist(), keep[:, 0].tolist())]
    assert kept(indices[1], keep[1], pad) == kept(alone[0], alone_keep[0], 0)
    assert all(len(head) == int(ratio * n) for head in kept(alone[0], alone_keep[0], 0))


def test_per_head_selection_differs_between_heads():
    q_mean = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # two KV heads (no GQA) looking at different coordinates
    keys = torch.tensor([[[[1.0, 0], [0, 0], [0, 0]], [[0.0, 0], [0, 0], [0, 1]]]])
    indices, _ = pivotal_tokens(q_mean, keys, torch.ones(1, 3, dtype=torch.bool), 0.34, 1, per_head=True)
    assert indices.tolist() == [[[0], [2]]]
    shared, _ = pivotal_tokens(q_mean, keys, torch.ones(1, 3, dtype=torch.bool), 0.34, 1, per_head=False)
    assert shared.shape == (1, 1, 1)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="ratio"):
        get_method("sparse_dllm", ratio=0.0)
    with pytest.raises(ValueError, match="kernel"):
        get_method("sparse_dllm", kernel=2)
    with pytest.raises(ValueError, match="delay"):
        get_method("sparse_dllm", delay=-1)


@pytest.mark.parametrize("per_head", [False, True])
def test_each_layer_keeps_the_keys_the_blocks_mean_query_scores_highest(per_head):
    """Algorithm 1 as its paper states it, on an unpadded row: each layer scores every key outside the
    block by its dot product with the mean of the block's queries (averaged over the heads too unless
    per_head), max-pools the scores over 3 neighbours and keeps the floor(ratio * candidates) best
    (ties to the lower position); the cache built at step `delay` holds exactly those keys."""
    method = get_method("sparse_dllm", ratio=0.25, delay=0, per_head=per_head)
    ctx = canvas_context([PROMPTS[0]], step=0)
    keep, seen = method.keep, []
    method.keep = lambda layer, q, k, v, ctx: seen.append((q, k)) or keep(layer, q, k, v, ctx)
    method.begin_block(ctx)
    method.step(MODEL, ctx)
    low, high = ctx.logits_start, ctx.logits_stop
    assert len(seen) == len(method.kept) == MODEL.cfg.num_layers
    for (q, k), kept in zip(seen, method.kept):
        candidates = torch.cat([k[0, :, :low], k[0, :, high:]], dim=1)  # [kv_heads, n, d]
        group = q.shape[1] // k.shape[1]
        q_mean = q[0, :, low:high].mean(dim=1).view(k.shape[1], group, -1).mean(dim=1)  # [kv_heads, d]
        scores = torch.einsum("hd,hnd->hn", q_mean, candidates)
        scores = scores if per_head else scores.mean(dim=0, keepdim=True).expand(k.shape[1], -1)
        pooled = F.max_pool1d(scores[:, None], 3, stride=1, padding=1)[:, 0]
        count = int(0.25 * candidates.shape[1])
        best = pooled.sort(dim=-1, descending=True, stable=True).indices[:, :count].sort(dim=-1).values
        expected = candidates.gather(1, best[..., None].expand(-1, -1, candidates.shape[2]))
        torch.testing.assert_close(kept.keys[0, :, :count], expected, atol=0, rtol=0)


# The reference's Sparse-dLLM (dual mode, no refresh) keeps Algorithm 1's pivotal tokens: the candidates
# are the positions outside the block (Algorithm 5, prefix_sparse: before it); each candidate's score is
# the dot product of the block's mean query with its key, / sqrt(d) (the paper's A; Algorithm 1 leaves
# the positive scale out, which ranks alike); the scores are max-pooled over the candidates in their
# order (the block removed, nothing beyond either end) with width `kernel`; the top floor(ratio *
# candidates) pooled scores are kept; with prefix_sparse the whole suffix is kept as well. Where the
# docstring settles what the paper leaves open, the reference follows it: the count is the row's own
# candidates (a row alone: its padding is neither counted nor kept); ties go to the lower position; the
# paper keeps one set for all heads, its scores averaged over the query heads, and `per_head` keeps one
# set per KV head, its scores averaged over that head's query group. Sparse-dLLM scores in float32 and
# the reference in float64: an example where a pooled score lies within TIE (times the largest sum of
# |q_i k_i / sqrt(d)| over the scores) of the last kept one, or where a tie straddling the cut rests on
# a window whose two largest scores are that close, is skipped (hypothesis.assume). Sparse-dLLM has no
# window knob besides the pooling width `kernel`.

TIE = 1e-5


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


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=batches(), ratio=st.integers(1, 20), kernel=st.sampled_from([1, 3, 5]), delay=st.integers(0, 3),
       per_head=st.booleans(), prefix_sparse=st.booleans())
def test_sparse_dllm_matches_its_reference(batch, ratio, kernel, delay, per_head, prefix_sparse):
    """Random ratio (a multiple of 0.05), pooling width, delay, one set per KV head or one for all,
    and Algorithm 5."""
    select = Pivotal(ratio / 20, kernel, per_head, prefix_sparse)
    reference = ReferenceOutsideCache("dual", delay, 0, select)
    expected = decode_recording_logits(reference, *batch)
    assume(not select.fragile)
    method = get_method("sparse_dllm", ratio=ratio / 20, kernel=kernel, delay=delay, per_head=per_head,
                        prefix_sparse=prefix_sparse)
    assert_matches_reference(method, reference, expected, batch)
