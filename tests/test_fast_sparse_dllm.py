"""Fast-dLLM's caches and Sparse-dLLM (methods/fast_dllm.py, sparse_dllm.py): a full forward every
step equals dense, a cached step on the canvas its cache came from equals the full forward, ratio 1
equals the dual cache with the same delay, a small ratio differs, the cached steps' decode-kernel path
decodes what the torch path does, threshold decoding on the cached steps, Algorithm 1's selection,
and a row decodes alike alone and in a ragged batch."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.attention import CanvasMask
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.base import StepContext
from nanodllm.methods.sparse_dllm import pivotal_tokens
from tests.tiny_models import (MASK_ID, MASKED_GEN, MASKED_MODEL, RAGGED_PROMPTS, differing, random_prompt,
                               refuses_block_causal, tiny_model)
from tests.tiny_models import masked_tokens as generate
from tests.device import DEVICE

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(3, 24), min_size=1, max_size=3), mode=st.sampled_from(["dual", "prefix"]),
       cfg_scale=st.sampled_from([0.0, 1.0]), threshold=st.sampled_from([None, 0.5]), seed=st.integers(0, 1000))
def test_a_full_forward_every_step_equals_dense(lengths, mode, cfg_scale, threshold, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8, cfg_scale=cfg_scale, threshold=threshold)
    assert generate(get_method("fast_dllm", mode=mode, refresh=1), prompts, gen) == \
        generate(get_method("dense"), prompts, gen)


def canvas_context(prompts, step, block=1, block_length=4, gen_length=12):
    """The masked engine's context for `block` of a canvas of left-padded prompts + masks."""
    width = max(map(len, prompts)) + gen_length
    tokens = torch.full((len(prompts), width), MASK_ID)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        start = width - gen_length - len(prompt)
        tokens[row, start : start + len(prompt)] = torch.tensor(prompt)
        valid[row, start:] = True
    positions = (torch.arange(width)[None] - (~valid).sum(1, keepdim=True)).clamp(min=0)
    start = width - gen_length + block * block_length
    return StepContext(tokens, positions, valid, torch.tensor([len(p) for p in prompts]), block=block, step=step,
                       mask_id=MASK_ID, attn_mask=CanvasMask(valid=valid), logits_start=start,
                       logits_stop=start + block_length, block_length=block_length)


@pytest.mark.parametrize("name,knobs", [("fast_dllm", {"mode": "dual"}), ("fast_dllm", {"mode": "prefix"}),
                                        ("sparse_dllm", {"ratio": 0.5})])
def test_threshold_decoding_runs_on_the_cached_steps(name, knobs):
    """Threshold decoding combined with the caches. With a threshold of 1 each step unmasks only its
    most confident position (no position here is certain), so the cached method decodes what it
    decodes one token per step without a threshold; a low threshold unmasks several per step."""
    from nanodllm import masked

    one_per_step = GenerationConfig(gen_length=16, block_length=4, steps=16)
    never = GenerationConfig(gen_length=16, block_length=4, steps=16, threshold=1.0)
    expected = masked.generate(MODEL, PROMPTS, one_per_step, get_method(name, **knobs))
    result = masked.generate(MODEL, PROMPTS, never, get_method(name, **knobs))
    assert result.tokens == expected.tokens and result.forwards == expected.forwards == 16
    parallel = masked.generate(MODEL, PROMPTS, GenerationConfig(gen_length=16, block_length=4, steps=16,
                                                                threshold=0.05), get_method(name, **knobs))
    assert parallel.forwards < 16 and all(MASK_ID not in row for row in parallel.tokens)


@pytest.mark.parametrize("name,knobs", [("fast_dllm", {"mode": "dual"}), ("fast_dllm", {"mode": "prefix"}),
                                        ("sparse_dllm", {"ratio": 1.0, "delay": 0})])
def test_a_cached_step_on_an_unchanged_canvas_equals_the_full_forward(name, knobs):
    method = get_method(name, **knobs)
    ctx = canvas_context(PROMPTS, step=0)
    method.begin_block(ctx)
    full = method.logits(MODEL, method.step(MODEL, ctx), ctx)  # builds the cache
    ctx.step = 1
    torch.testing.assert_close(method.logits(MODEL, method.step(MODEL, ctx), ctx), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_steps_through_the_decode_kernel_equal_the_torch_path(mode, monkeypatch):
    """Unpadded rows: a dual cached step feeds the block (4 tokens) to the split-KV decode kernel
    (interpreted on a CPU, compiled on a GPU), prefix feeds 4 + the suffix; the kept K/V stay in place
    between steps. The torch path is float32's own on a GPU too (use_kernels takes float16 / bfloat16)."""
    import nanodllm.attention as attention_module

    model = tiny_model("llada", dtype=torch.float32, d_model=128, n_heads=2, n_kv_heads=2).to(DEVICE)  # head_dim 64
    prompts = [random_prompt(20, seed=3), random_prompt(20, seed=4)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8)
    torch_path = generate(get_method("fast_dllm", mode=mode), prompts, gen, model=model)
    monkeypatch.setattr(attention_module, "use_kernels", lambda q: True)
    assert generate(get_method("fast_dllm", mode=mode), prompts, gen, model=model) == torch_path


@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("knobs", [{}, {"per_head": True}, {"prefix_sparse": True}])
def test_ratio_one_equals_the_dual_cache(delay, knobs):
    dual = generate(get_method("fast_dllm", mode="dual", delay=delay))
    method = get_method("sparse_dllm", ratio=1.0, delay=delay, **knobs)
    assert generate(method) == dual
    assert method.stats["kv_kept"] == 1.0


def test_small_ratio_differs_and_keeps_its_share():
    dual = generate(get_method("fast_dllm", mode="dual", delay=1))
    method = get_method("sparse_dllm", ratio=0.1)
    assert differing(generate(method), dual) > 0
    assert 0.05 < method.stats["kv_kept"] < 0.15


@pytest.mark.parametrize("name,knobs", [("sparse_dllm", {}), ("sparse_dllm", {"ratio": 0.25}),
                                        ("sparse_dllm", {"per_head": True}),
                                        ("sparse_dllm", {"ratio": 0.25, "prefix_sparse": True})])
def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch(name, knobs):
    """DESIGN.md: a row's result must not depend on the batch. The short prompt, left-padded next to a
    longer one, keeps floor(ratio * its own candidates), as it does alone (Algorithm 1 line 9)."""
    alone = generate(get_method(name, **knobs), [PROMPTS[1]])[0]
    assert generate(get_method(name, **knobs), PROMPTS)[1] == alone


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


def test_bad_knobs_and_block_causal_models_are_named():
    with pytest.raises(ValueError, match="mode"):
        get_method("fast_dllm", mode="suffix")
    with pytest.raises(ValueError, match="delay"):
        get_method("fast_dllm", delay=-1)
    with pytest.raises(ValueError, match="ratio"):
        get_method("sparse_dllm", ratio=0.0)
    with pytest.raises(ValueError, match="kernel"):
        get_method("sparse_dllm", kernel=2)
    assert "block-causal" in refuses_block_causal(get_method("fast_dllm"))


@pytest.mark.parametrize("delay", [0, 2])
def test_the_dual_cache_equals_its_plain_reference_in_every_block(delay):
    """Fast-dLLM's dual cache as its paper states it, recomputed here with nothing kept by the method:
    at a block's step `delay` the full forward (whose K/V outside the block are recorded), and at every
    later step of that block the block's tokens attending to those recorded K/V plus their own. Each
    step's hidden states equal the reference's, block after block, on a ragged batch."""
    from nanodllm.attention import attention

    method = get_method("fast_dllm", mode="dual", delay=delay)
    step, recorded, checked = method.step, {}, []

    def checked_step(model, ctx):
        hidden = step(model, ctx)
        low, high = ctx.logits_start, ctx.logits_stop
        if ctx.step <= delay:
            keys = []
            expected = model.hidden(ctx.tokens, ctx.positions,
                                    lambda layer, q, k, v: keys.append((k, v)) or attention(q, k, v, ctx.attn_mask))
            if ctx.step == delay:
                outside = torch.cat([ctx.valid[:, :low], ctx.valid[:, high:]], dim=1)
                recorded.update(keys=keys, outside=outside)
        else:
            def attend(layer, q, k, v):
                kept_k, kept_v = recorded["keys"][layer]
                keys = torch.cat([kept_k[:, :, :low], kept_k[:, :, high:], k], dim=2)
                values = torch.cat([kept_v[:, :, :low], kept_v[:, :, high:], v], dim=2)
                visible = torch.cat([recorded["outside"], torch.ones_like(ctx.valid[:, low:high])], dim=1)
                return attention(q, keys, values, visible[:, None, None, :])

            expected = model.hidden(ctx.tokens[:, low:high], ctx.positions[:, low:high], attend)
        torch.testing.assert_close(hidden, expected, atol=1e-10, rtol=0)
        checked.append(ctx.step)
        return hidden

    method.step = checked_step
    generate(method)
    assert checked.count(delay + 1) == MASKED_GEN.gen_length // MASKED_GEN.block_length  # every block was checked


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
