"""Fast-dLLM's prefix and dual caches (methods/fast_dllm.py) on the masked engine: a full forward every
step equals dense, a cached step on the canvas its cache came from equals the full forward, threshold
decoding runs on the cached steps, the decode-kernel path decodes what the torch path does, every step
of the dual cache equals its paper's recomputation block after block, and every step's logits and kept
K/V equal a plain-torch float64 reference (tests/fast_dllm_references.py) over random knobs."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.attention import attention
from nanodllm.config import GenerationConfig
from nanodllm.loader import load_model
from nanodllm.methods import get_method
from tests.device import DEVICE
from tests.fast_dllm_references import (ReferenceOutsideCache, assert_matches_reference, batches, canvas_context,
                                        decode_recording_logits)
from tests.tiny_models import (MASKED_GEN, MASKED_MODEL, MASK_ID, RAGGED_PROMPTS, random_prompt, tiny_model,
                               masked_decode as decode, masked_tokens as generate)

MODEL, GEN, PROMPTS = MASKED_MODEL, MASKED_GEN, RAGGED_PROMPTS



@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(3, 24), min_size=1, max_size=3), mode=st.sampled_from(["dual", "prefix"]),
       cfg_scale=st.sampled_from([0.0, 1.0]), threshold=st.sampled_from([None, 0.5]), seed=st.integers(0, 1000))
def test_a_full_forward_every_step_equals_dense(lengths, mode, cfg_scale, threshold, seed):
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8, cfg_scale=cfg_scale, threshold=threshold)
    assert generate(get_method("fast_dllm", mode=mode, refresh=1), prompts, gen) == \
        generate(get_method("dense"), prompts, gen)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_threshold_decoding_runs_on_the_cached_steps(mode):
    """Threshold decoding combined with the caches. With a threshold of 1 each step unmasks only its
    most confident position (no position here is certain), so the cached method decodes what it
    decodes one token per step without a threshold; a low threshold unmasks several per step."""
    one_per_step = GenerationConfig(gen_length=16, block_length=4, steps=16)
    never = GenerationConfig(gen_length=16, block_length=4, steps=16, threshold=1.0)
    expected = decode(get_method("fast_dllm", mode=mode), gen=one_per_step)
    result = decode(get_method("fast_dllm", mode=mode), gen=never)
    assert result.tokens == expected.tokens and result.forwards == expected.forwards == 16
    parallel = decode(get_method("fast_dllm", mode=mode),
                      gen=GenerationConfig(gen_length=16, block_length=4, steps=16, threshold=0.05))
    assert parallel.forwards < 16 and all(MASK_ID not in row for row in parallel.tokens)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_a_cached_step_on_an_unchanged_canvas_equals_the_full_forward(mode):
    method = get_method("fast_dllm", mode=mode)
    ctx = canvas_context(PROMPTS, step=0)
    method.begin_block(ctx)
    full = method.logits(MODEL, method.step(MODEL, ctx), ctx)  # builds the cache
    ctx = replace(ctx, step=1, t=ctx.t + 1)
    torch.testing.assert_close(method.logits(MODEL, method.step(MODEL, ctx), ctx), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_a_cached_step_on_a_shifted_logit_model_reads_the_column_before_the_block(mode):
    """On Dream (logit_shift) the block's first logits come from the column before the block: the fed range
    starts there, so a cached step on the canvas its cache came from still gives the full forward's logits."""
    model = load_model(Path(__file__).parent / "fixtures" / "dream_tiny", dtype=torch.float64)
    method = get_method("fast_dllm", mode=mode)
    ctx = canvas_context(PROMPTS, step=0)
    method.begin_block(ctx)
    full = method.logits(model, method.step(model, ctx), ctx)
    ctx = replace(ctx, step=1, t=ctx.t + 1)
    torch.testing.assert_close(method.logits(model, method.step(model, ctx), ctx), full, rtol=1e-10, atol=1e-10)


def test_a_cached_step_feeds_the_block_dual_and_the_block_with_its_suffix_prefix():
    """Block 1 of a 12-column response: dual feeds its 4 columns and keeps the other 32 (20 prompt + 4 + 8)
    K/V, prefix feeds the block and the 4 columns after it and keeps the 24 before."""
    for mode, fed in (("dual", 4), ("prefix", 8)):
        method = get_method("fast_dllm", mode=mode)
        ctx = canvas_context(PROMPTS, step=0)
        method.begin_block(ctx)
        method.step(MODEL, ctx)
        assert method.step(MODEL, replace(ctx, step=1, t=ctx.t + 1)).shape[1] == fed
        assert {kept.keys.shape[2] - kept.room for kept in method.kept} == {ctx.tokens.shape[1] - fed}


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


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="mode"):
        get_method("fast_dllm", mode="suffix")
    with pytest.raises(ValueError, match="delay"):
        get_method("fast_dllm", delay=-1)
    with pytest.raises(ValueError, match="refresh"):
        get_method("fast_dllm", refresh=-1)


def test_a_new_block_drops_the_last_blocks_cache():
    """The cache lives for one block: begin_block frees it, so a block's steps before `delay` hold none."""
    method = get_method("fast_dllm", delay=2)
    ctx = canvas_context(PROMPTS, 0, block=0)
    method.begin_block(ctx)
    for step in range(3):  # steps 0 and 1 run in full, step 2 builds the cache
        method.step(MODEL, replace(ctx, step=step, t=step))
    assert len(method.kept) == MODEL.cfg.num_layers
    method.begin_block(canvas_context(PROMPTS, 0, block=1))
    assert method.kept == []


@pytest.mark.parametrize("delay", [0, 2])
def test_the_dual_cache_equals_its_plain_reference_in_every_block(delay):
    """Fast-dLLM's dual cache as its paper states it, recomputed here with nothing kept by the method:
    at a block's step `delay` the full forward (whose K/V outside the block are recorded), and at every
    later step of that block the block's tokens attending to those recorded K/V plus their own. Each
    step's hidden states equal the reference's, block after block, on a ragged batch."""
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


class Outside:
    """Fast-dLLM's kept set for the reference: every position outside the fed range, for every KV head."""

    def __call__(self, q, k, block, fed):
        keep = torch.ones(k.shape[:2], dtype=torch.bool)
        keep[:, fed.start : fed.stop] = False
        return keep


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=batches(), mode=st.sampled_from(["dual", "prefix"]), delay=st.integers(0, 3),
       refresh=st.integers(0, 4))
def test_fast_dllm_matches_its_reference(batch, mode, delay, refresh):
    reference = ReferenceOutsideCache(mode, delay, refresh, Outside())
    expected = decode_recording_logits(reference, *batch)
    method = get_method("fast_dllm", mode=mode, delay=delay, refresh=refresh)
    assert_matches_reference(method, reference, expected, batch)


@pytest.mark.parametrize("mode, refresh", [("dual", 0), ("prefix", 2)])
def test_kv_kept_counts_every_real_token_outside_the_fed_range_once(mode, refresh):
    """Fast-dLLM keeps every real token's K/V outside the fed range at each build (padding hidden, the
    room for the fed tokens not counted): stats["kv_kept"] is 1 in a ragged batch as for one row."""
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8)
    for prompts in (PROMPTS, PROMPTS[:1]):
        assert decode(get_method("fast_dllm", mode=mode, refresh=refresh), prompts, gen).stats == {"kv_kept": 1.0}
