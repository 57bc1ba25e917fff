"""Fast-dLLM's caches and Sparse-dLLM (methods/fast_dllm.py, sparse_dllm.py): a full forward every
step equals dense, a cached step on the canvas its cache came from equals the full forward, ratio 1
equals the dual cache with the same delay, a small ratio differs, the cached steps' decode-kernel path
decodes what the torch path does, and Algorithm 1's selection."""

import pytest
import torch
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
                                        ("sparse_dllm", {"ratio": 1.0, "delay": 0})])
def test_a_cached_step_on_an_unchanged_canvas_equals_the_full_forward(name, knobs):
    method = get_method(name, **knobs)
    ctx = canvas_context(PROMPTS, step=0)
    method.begin_block(ctx)
    full = method.step(MODEL, ctx)  # builds the cache
    ctx.step = 1
    torch.testing.assert_close(method.step(MODEL, ctx), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_steps_through_the_decode_kernel_equal_the_torch_path(mode, monkeypatch):
    """Unpadded rows: a dual cached step feeds the block (4 tokens) to the split-KV decode kernel
    (interpreted on a CPU), prefix feeds 4 + the suffix; the kept K/V stay in place between steps."""
    import nanodllm.attention as attention_module

    model = tiny_model("llada", dtype=torch.float32, d_model=128, n_heads=2, n_kv_heads=2)  # head_dim 64
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


def test_pivotal_tokens_pool_neighbours_and_skip_padding():
    q_mean = torch.tensor([[[1.0, 0.0]]])  # one head, d = 2: a key's score is its first coordinate
    keys = torch.tensor([[[[0.0, 0], [5, 0], [0, 0], [0, 0], [0, 0], [3, 0], [0, 0], [9, 0]]]])
    valid = torch.tensor([[True, True, True, True, True, True, True, False]])  # the 9 is padding
    indices, keep = pivotal_tokens(q_mean, keys, valid, ratio=0.5, kernel=1, per_head=False)
    picked = indices[0, 0].tolist()
    assert len(picked) == 4 and {1, 5} <= set(picked) and 7 not in picked and picked == sorted(picked)
    indices, keep = pivotal_tokens(q_mean, keys, valid, ratio=0.75, kernel=3, per_head=False)
    assert set(indices[0, 0].tolist()) == {0, 1, 2, 4, 5, 6}  # the 5 and the 3 spread to their neighbours
    assert bool(keep.all())
    indices, keep = pivotal_tokens(q_mean, keys, torch.ones_like(valid), ratio=0.25, kernel=1, per_head=False)
    assert indices.tolist() == [[[1, 7]]]


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
