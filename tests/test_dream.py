"""Dream's decoding (nanodllm/dream.py) against a transcription of Dream's diffusion_generate / _sample
on the tiny Dream-format checkpoint (tests/fixtures/dream_tiny), ragged batches, every algorithm, and
the sampling filters."""

import math
from pathlib import Path

import pytest
import torch

from nanodllm import masked
from nanodllm.attention import attention
from nanodllm.config import GenerationConfig
from nanodllm.decoding import filtered
from nanodllm.dream import DreamSampling
from nanodllm.generation import generate
from nanodllm.loader import load_model
from nanodllm.methods import get_method
from tests.tiny_models import random_prompt

MODEL = load_model(Path(__file__).parent / "fixtures" / "dream_tiny", dtype=torch.float32)
MASK, PAD = MODEL.cfg.mask_token_id, MODEL.cfg.eos_token_ids[0]
PROMPTS = [random_prompt(9, seed=1), random_prompt(5, seed=2)]


@torch.no_grad()
def reference(prompts, gen_length, steps, alg, alg_temp=0.0, eps=1e-3):
    """Dream's loop at temperature 0 without top-p / top-k, as its generation_utils writes it: left-padded
    input_ids with an attention mask, x padded with masks, tok_idx = cumsum - 1 (pads 1), logits of the
    whole canvas shifted by one, the batch-mean transfer count, topk (or multinomial) over the canvas.
    Pads are hidden as keys only (the reference also blanks pad queries, whose outputs nobody reads)."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    x = torch.nn.functional.pad(input_ids, (0, gen_length), value=MASK)
    attention_mask = torch.nn.functional.pad(attention_mask, (0, gen_length), value=1)
    tok_idx = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    keys = attention_mask.bool()[:, None, None, :]
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        hidden = MODEL.hidden(x, tok_idx, lambda layer, q, k, v: attention(q, k, v, keys))
        logits = MODEL.lm_head(MODEL.norm(hidden))
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + MASK
            transfer_index_t_s = torch.rand(*x0.shape) < p_transfer
            x0[transfer_index_t_s] = mask_logits[transfer_index_t_s].softmax(-1).max(dim=-1).indices
            x[mask_index] = x0.clone()
            continue
        probs = mask_logits.softmax(-1)
        confidence, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            ranked = probs.sort(dim=-1, descending=True).values
            confidence = ranked[:, 0] - ranked[:, 1]
        elif alg == "entropy":
            confidence = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            if alg_temp == 0:
                _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
            else:
                weights = torch.softmax(full_confidence / alg_temp, dim=-1)
                transfer_index = torch.multinomial(weights, num_samples=number_transfer_tokens)
            x_ = torch.zeros_like(x) + MASK
            x_[mask_index] = x0.clone()
            row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    return [row[width:].tolist() for row in x]


def decode(prompts, gen_length, steps, **sampling):
    from nanodllm import dream

    gen = GenerationConfig(gen_length=gen_length, block_length=gen_length, steps=steps)
    return dream.generate(MODEL, prompts, gen, sampling=DreamSampling(**sampling)).tokens


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("gen_length,steps", [(12, 12), (12, 5), (8, 3)])
def test_confidence_algorithms_decode_the_references_tokens(alg, gen_length, steps):
    assert decode(PROMPTS, gen_length, steps, alg=alg) == reference(PROMPTS, gen_length, steps, alg)


@pytest.mark.parametrize("alg,alg_temp,eps", [("origin", 0.0, 1e-3), ("maskgit_plus", 0.5, 1e-3), ("origin", 0.0, 0.5)])
def test_random_algorithms_follow_the_references_draws(alg, alg_temp, eps):
    """eps 0.5: the last step's 1 - s / t is 0.2, and the last step still takes every position."""
    torch.manual_seed(7)
    ours = decode(PROMPTS, 10, 4, alg=alg, alg_temp=alg_temp, eps=eps)
    torch.manual_seed(7)
    assert ours == reference(PROMPTS, 10, 4, alg, alg_temp=alg_temp, eps=eps)
    assert all(MASK not in row for row in ours)  # the last step decodes everything


def test_generate_picks_dreams_loop_and_the_masked_engine_refuses_dream():
    gen = GenerationConfig(gen_length=8, block_length=8, steps=4)
    assert generate(MODEL, PROMPTS, gen).tokens == reference(PROMPTS, 8, 4, "entropy")
    with pytest.raises(ValueError, match="one block"):
        generate(MODEL, PROMPTS, GenerationConfig(gen_length=8, block_length=4, steps=4))
    with pytest.raises(ValueError, match="runs on the block and gemma engines"):
        generate(MODEL, PROMPTS, gen, get_method("mage"))
    with pytest.raises(NotImplementedError, match="shifted logits"):
        masked.generate(MODEL, PROMPTS, gen)


@pytest.mark.parametrize("name,knobs", [("dllm_cache", dict(prompt_interval=1, response_interval=1)),
                                        ("maskkv", dict(budget=64, prompt_interval=1, response_interval=1)),
                                        ("dyllm", dict(tau=1.5, full_period=1)),
                                        ("momo", dict(canvas=True, gamma=2, chi=4, beta=4, k=8, k_exact=8))])
def test_methods_in_their_exact_setting_decode_dense_tokens(name, knobs):
    gen = GenerationConfig(gen_length=12, block_length=12, steps=6)
    dense = generate(MODEL, PROMPTS, gen).tokens
    assert generate(MODEL, PROMPTS, gen, get_method(name, **knobs)).tokens == dense


@pytest.mark.parametrize("name,knobs", [("fast_dllm", dict(mode="dual")), ("fast_dllm", dict(mode="prefix")),
                                        ("sparse_dllm", dict(ratio=1.0, delay=0))])
def test_a_cached_step_on_an_unchanged_canvas_gives_the_full_forwards_logits(name, knobs):
    """The fed range starts one column before the response: its hidden state gives the first logits."""
    from dataclasses import replace

    from nanodllm.attention import CanvasMask
    from nanodllm.methods.base import StepContext

    prompt = PROMPTS[0]
    tokens = torch.tensor([prompt + [MASK] * 8])
    width = tokens.shape[1]
    ctx = StepContext(tokens, torch.arange(width)[None], torch.ones(1, width, dtype=torch.bool),
                      torch.tensor([len(prompt)]), prompt_width=len(prompt), mask_id=MASK, attn_mask=CanvasMask(),
                      logits_start=len(prompt), logits_stop=width, block_length=8)
    method = get_method(name, **knobs)
    method.begin_block(ctx)
    full = method.logits(MODEL, method.step(MODEL, ctx), ctx)
    ctx = replace(ctx, step=1, t=1)
    torch.testing.assert_close(method.logits(MODEL, method.step(MODEL, ctx), ctx), full, rtol=1e-5, atol=1e-5)
    changed = tokens.clone()
    changed[0, len(prompt) - 1] = (prompt[-1] + 1) % 200  # the fed column: the cached step sees the change
    ctx = replace(ctx, tokens=changed)
    assert not torch.allclose(method.logits(MODEL, method.step(MODEL, ctx), ctx)[:, 0], full[:, 0])


def test_filters_keep_what_they_promise():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    lowest = torch.finfo(torch.float32).min
    assert filtered(logits, None, 2).tolist() == [[4.0, 3.0, lowest, lowest, lowest]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, ...: top-p 0.7 keeps the token that crosses it
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert filtered(logits, 0.7, None).tolist() == [[4.0, 3.0, lowest, lowest, lowest]]
    assert torch.equal(filtered(logits, 1.0, None), logits)


@pytest.mark.parametrize("knobs,message", [({"alg": "greedy"}, "alg must be one of"), ({"top_p": 0.0}, "top_p"),
                                           ({"top_k": 0}, "top_k"), ({"eps": 1.0}, "eps"),
                                           ({"alg_temp": -1}, "alg_temp")])
def test_bad_sampling_knobs_are_named(knobs, message):
    with pytest.raises(ValueError, match=message):
        DreamSampling(**knobs)


def test_dyllm_takes_the_papers_tau_for_dream_unless_given():
    """DyLLM's tau defaults to the paper's per-model choice: 0.995 on Dream, 0.99 on LLaDA."""
    from tests.tiny_models import tiny_model

    gen = GenerationConfig(gen_length=12, block_length=12, steps=6)
    chosen = {}
    for label, model in (("dream", MODEL), ("llada", tiny_model("llada"))):
        method = get_method("dyllm")
        generate(model, PROMPTS, gen, method)
        chosen[label] = method.threshold
    assert chosen == {"dream": 0.995, "llada": 0.99}
    given = get_method("dyllm", tau=0.9)
    generate(MODEL, PROMPTS, gen, given)
    assert given.threshold == 0.9


@pytest.mark.parametrize("alg", ["maskgit_plus", "entropy"])
def test_the_top_k_and_top_p_filters_shape_the_confidence(alg):
    """The confidence is of the filtered distribution, as Dream's sample_tokens computes it: keeping the
    best two of e^4, e^3, ... leaves p = 1 / (1 + e^-1) for the best."""
    from nanodllm.dream import sample_tokens

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    p = 1 / (1 + math.exp(-1))
    want = p if alg == "maskgit_plus" else p * math.log(p) + (1 - p) * math.log(1 - p)
    for knobs in ({"top_k": 2}, {"top_p": 0.7}):
        confidence, tokens = sample_tokens(logits, 0.0, DreamSampling(alg=alg, **knobs))
        assert tokens.tolist() == [0, 4]
        torch.testing.assert_close(confidence, torch.full((2,), want), rtol=1e-5, atol=1e-6)
