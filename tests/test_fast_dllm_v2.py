"""Fast-dLLM v2's decoding (nanodllm/fast_dllm_v2.py) against a transcription of its model's generate()
(no sub-block cache, temperature 0) on the tiny Fast-dLLM v2 checkpoint (bd_size 4): prompts
shorter than, ending inside and ending on a block, thresholds from one token per step to many, sub-
blocks, stop tokens, ragged batches; and the block-engine methods on it (full budget = dense, tiny
budget differs). The transcription has no KV cache: every forward runs the
whole sequence under the block-causal mask, which is what the exact cache gives the active block."""

from pathlib import Path

import pytest
import torch

from nanodllm import block, fast_dllm_v2, generation
from nanodllm.attention import attention, block_causal_mask
from nanodllm.config import GenerationConfig
from nanodllm.fast_dllm_v2 import generate
from nanodllm.loader import load_model
from nanodllm.methods import get_method
from tests.tiny_models import random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODEL = load_model(Path(__file__).parent / "fixtures" / "fast_dllm_v2_tiny", dtype=torch.float32)
SIZE, MASK = MODEL.cfg.block_size, MODEL.cfg.mask_token_id
PROMPTS = [random_prompt(n, seed=n) for n in (3, 6, 8, 9)]  # inside the first block, inside, on a boundary, inside


@torch.no_grad()
def logits_of(ids):
    """Unshifted logits of a forward over ids [1, t] under the block-causal mask."""
    positions = torch.arange(ids.shape[1])[None]
    mask = block_causal_mask(positions, positions, SIZE)
    return MODEL.lm_head(MODEL.norm(MODEL.hidden(ids, positions, lambda layer, q, k, v: attention(q, k, v, mask))))


def reference(prompt, max_new_tokens, threshold, small_block_size, stop_token):
    """generate() of Fast-dLLM v2's modeling file, batch 1, use_block_cache=False, temperature 0, with
    nanodllm's one deliberate change: [MASK] is never the chosen token (the tiny random model does
    predict it; the reference then leaves the position masked, or loops forever when it is the best)."""
    input_ids = torch.tensor([prompt])
    num_blocks, original_input_length = max_new_tokens // SIZE, input_ids.shape[1]
    if input_ids.shape[1] > SIZE:
        logits = logits_of(input_ids[:, : input_ids.shape[1] // SIZE * SIZE])
        if input_ids.shape[1] % SIZE == 0:
            input_ids = torch.cat([input_ids, logits[:, -1:].argmax(dim=-1)], dim=1)

    def stopped(x_t, prompt_length):
        generated = x_t[0, prompt_length:]
        if stop_token not in generated:
            return False
        stop_at = int((generated == stop_token).nonzero()[0][0])
        return int((generated[:stop_at] == MASK).sum()) == 0

    for _ in range(num_blocks):
        if stop_token in input_ids[0, original_input_length:]:
            break
        prompt_length = input_ids.shape[1]
        x_t = torch.cat([input_ids, torch.full((1, SIZE - prompt_length % SIZE), MASK)], dim=1)
        while True:
            if stopped(x_t, prompt_length):
                break
            if int((x_t[:, -SIZE:] == MASK).sum()) == 0:
                x_t = torch.cat([x_t, logits_of(x_t)[:, -1:].argmax(dim=-1)], dim=1)
                break
            for small in range(SIZE // small_block_size):
                start = -SIZE + small * small_block_size
                end = None if SIZE == (small + 1) * small_block_size else start + small_block_size
                while True:
                    mask_idx = x_t[:, -SIZE:] == MASK
                    if int(mask_idx[:, start:end].sum()) == 0 or stopped(x_t, prompt_length):
                        break
                    logits = logits_of(x_t)[:, -SIZE:]
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[:, start:end]
                    p_1t = logits.softmax(dim=-1)
                    x_1 = p_1t.index_fill(-1, torch.tensor([MASK]), 0.0).argmax(dim=-1)  # nanodllm's one guard
                    x1_p = torch.where(mask_idx[:, start:end], p_1t.gather(-1, x_1[..., None]).squeeze(-1), -torch.inf)
                    unmask_idx = x1_p > threshold
                    unmask_idx[torch.arange(1), x1_p.argmax(dim=-1)] = True
                    unmask_idx &= mask_idx[:, start:end]
                    x_t[:, start:end][unmask_idx] = x_1[unmask_idx]
        input_ids = x_t
    generated = input_ids[0, original_input_length:].tolist()
    return generated[: generated.index(stop_token) + 1] if stop_token in generated else generated


def ours(prompts, max_new_tokens, threshold, sub_block, stop_token):
    gen = GenerationConfig(gen_length=max_new_tokens, block_length=SIZE, steps=1, threshold=threshold)
    return generate(MODEL, prompts, gen, stop_ids=(stop_token,), sub_block=sub_block).tokens


@pytest.mark.parametrize("threshold", [1.0, 0.2, 0.02])
@pytest.mark.parametrize("sub_block", [2, 4])
def test_decodes_the_references_tokens(threshold, sub_block):
    want = [reference(p, 12, threshold, sub_block, stop_token=MODEL.cfg.eos_token_ids[0]) for p in PROMPTS]
    assert [ours([p], 12, threshold, sub_block, MODEL.cfg.eos_token_ids[0])[0] for p in PROMPTS] == want
    assert ours(PROMPTS, 12, threshold, sub_block, MODEL.cfg.eos_token_ids[0]) == want  # ragged batch


def test_stop_tokens_end_a_row_as_in_the_reference():
    free = [reference(p, 12, 0.2, 2, stop_token=-1) for p in PROMPTS]
    for prompt, tokens in zip(PROMPTS, free):
        for stop_token in {tokens[0], tokens[3], tokens[6]}:  # an AR first token, mid-block tokens
            want = reference(prompt, 12, 0.2, 2, stop_token)
            assert want[-1] == stop_token and len(want) < len(tokens)
            assert ours([prompt], 12, 0.2, 2, stop_token) == [want]


def test_a_stop_token_in_the_prompt_stops_nothing():
    """Only generated tokens stop a row, as in the reference: a prompt whose last block holds the stop
    token (as a chat prompt's <|im_end|> sits in its last block), at its first column or mid-block."""
    stop_token = MODEL.cfg.eos_token_ids[0]
    prompts = [random_prompt(5, seed=5)[:4] + [stop_token], random_prompt(7, seed=7)[:5] + [stop_token, 3]]
    want = [reference(prompt, 12, 0.2, 2, stop_token) for prompt in prompts]
    assert all(len(tokens) > 1 for tokens in want)
    assert ours(prompts, 12, 0.2, 2, stop_token) == want

def test_generate_picks_this_loop_and_the_block_engine_refuses_fast_dllm_v2():
    gen = GenerationConfig(gen_length=8, block_length=SIZE, steps=1, threshold=0.2)
    picked = generation.generate(MODEL, PROMPTS, gen).tokens
    assert picked == ours(PROMPTS, 8, 0.2, SIZE, MODEL.cfg.eos_token_ids[0])
    with pytest.raises(ValueError, match="block_length"):
        generation.generate(MODEL, PROMPTS, GenerationConfig(gen_length=8, block_length=8, steps=1))
    with pytest.raises(ValueError, match="runs on the masked engine"):
        generation.generate(MODEL, PROMPTS, gen, get_method("dllm_cache"))
    with pytest.raises(NotImplementedError, match="shifted logits"):
        block.generate(MODEL, PROMPTS, gen)


LONG_PROMPTS = [random_prompt(n, seed=n) for n in (30, 37, 44)]
GEN = GenerationConfig(gen_length=12, block_length=SIZE, steps=1, threshold=0.05)


@pytest.mark.parametrize("name,knobs", [("mage", dict(k=64, exact_layers=0)),
                                        ("quest", dict(k=64, page_size=4, exact_layers=0)),
                                        ("sparsed", dict(k=64, exact_fraction=0.5, exact_layers=0)),
                                        ("mage", dict(k=64, exact_layers=0, sparse_commit=True)),
                                        ("momo", dict(gamma=2, chi=4, beta=4, k=16, k_exact=16))])
def test_block_methods_with_a_full_budget_decode_dense_tokens(name, knobs):
    dense = generate(MODEL, LONG_PROMPTS, GEN).tokens
    assert generate(MODEL, LONG_PROMPTS, GEN, get_method(name, **knobs)).tokens == dense


@pytest.mark.parametrize("name,knobs", [("mage", dict(k=1, exact_layers=0)), ("quest", dict(k=2, page_size=2,
                                                                                           exact_layers=0)),
                                        ("sparsed", dict(k=1, exact_fraction=0.25, exact_layers=0)),
                                        ("momo", dict(gamma=2, chi=4, beta=4, k=1, k_exact=1))])
def test_block_methods_with_a_tiny_budget_differ(name, knobs):
    dense = generate(MODEL, LONG_PROMPTS, GEN).tokens
    assert generate(MODEL, LONG_PROMPTS, GEN, get_method(name, **knobs)).tokens != dense


def test_threshold_zero_unmasks_each_sub_block_in_one_step_as_the_reference():
    """Threshold 0 is a threshold (every masked position of the sub-block clears it), not "unset"
    (1: one token a step)."""
    stop_token = MODEL.cfg.eos_token_ids[0]
    want = [reference(p, 12, 0.0, 2, stop_token) for p in PROMPTS]
    assert ours(PROMPTS, 12, 0.0, 2, stop_token) == want
    assert want != [reference(p, 12, 1.0, 2, stop_token) for p in PROMPTS]


def test_a_gen_length_between_blocks_decodes_its_whole_blocks_as_the_reference():
    """gen_length // B blocks, as the reference's max_new_tokens // bd_size: 10 tokens are two blocks."""
    stop_token = MODEL.cfg.eos_token_ids[0]
    assert ours(PROMPTS, 10, 0.2, 2, stop_token) == [reference(p, 10, 0.2, 2, stop_token) for p in PROMPTS]


def test_a_probability_equal_to_the_threshold_does_not_clear_it(monkeypatch):
    """Positions are unmasked above the threshold (the reference's x1_p > threshold): with every
    probability at 0.5, threshold 0.5 takes one token a step, as 0.75 does."""
    original = fast_dllm_v2.sample_with_top_p

    def halves(*args, **kwargs):
        tokens, probs = original(*args, **kwargs)
        return tokens, torch.full_like(probs, 0.5)

    monkeypatch.setattr(fast_dllm_v2, "sample_with_top_p", halves)
    at, above = (generate(MODEL, PROMPTS, GenerationConfig(gen_length=8, block_length=SIZE, steps=1, threshold=t),
                          stop_ids=(), sub_block=2) for t in (0.5, 0.75))
    assert at.tokens == above.tokens and at.forwards == above.forwards
