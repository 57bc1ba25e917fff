"""The block (SDAR) engine: exact cache, equality with a cache-free recompute, batches, errors."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from nanodllm import block
from nanodllm.attention import attention, block_causal_mask
from nanodllm.config import GenerationConfig
from tiny_models import EOS_ID, MASK_ID, VOCAB, random_prompt, tiny_model

MODEL = tiny_model("sdar")


def block_causal_forward(model, x, size, record=None):
    """Uncached forward over x [1, t] with the block-causal mask; optionally records each layer's K, V."""
    positions = torch.arange(x.shape[1])[None]
    mask = block_causal_mask(positions, positions, size)

    def attend(layer, q, k, v):
        if record is not None:
            record.append((k, v))
        return attention(q, k, v, mask)

    return model(x, positions, attend)


def cache_free_generate(model, prompt, gen, stop_ids=()):
    """SDAR's block_diffusion_generate loop, recomputing the whole prefix at every step."""
    size = gen.block_length
    total = math.ceil((len(prompt) + gen.gen_length) / size) * size
    x = torch.full((1, total), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    schedule = [size // gen.steps + (i < size % gen.steps) for i in range(gen.steps)]
    end = len(prompt)
    undecided = torch.arange(total) >= len(prompt)  # tracked, so a prompt token equal to [MASK] stays
    for start in range(len(prompt) // size * size, total, size):
        for step in range(gen.steps + 1):
            masked = undecided[start : start + size]
            if not masked.any():
                break
            logits = block_causal_forward(model, x[:, : start + size], size)[0, start:]
            probs = logits.softmax(-1)
            x0 = probs.index_fill(-1, torch.tensor([MASK_ID]), 0.0).argmax(-1)  # [MASK] never wins
            conf = torch.where(masked, probs.gather(-1, x0[:, None])[:, 0], float("-inf"))
            k = min(schedule[step], int(masked.sum()))
            transfer = torch.zeros(size, dtype=torch.bool)
            if gen.remasking == "sequential":
                transfer[masked.nonzero()[:k, 0]] = True
            elif gen.threshold is not None and int((conf > gen.threshold).sum()) >= k:
                transfer = conf > gen.threshold
            else:
                transfer[torch.topk(conf, k).indices] = True
            x[0, start : start + size] = torch.where(transfer, x0, x[0, start : start + size])
            undecided[start : start + size] &= ~transfer
        end = start + size
        if any(int(t) in stop_ids for t in x[0, len(prompt) : end]):
            break
    return x[0, len(prompt) : end].tolist()


CASES = [
    dict(gen_length=8, block_length=4, steps=4),
    dict(gen_length=12, block_length=4, steps=2),
    dict(gen_length=10, block_length=8, steps=3),
    dict(gen_length=8, block_length=4, steps=4, threshold=0.5, remasking="low_confidence_dynamic"),
    dict(gen_length=8, block_length=4, steps=2, remasking="sequential"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt_length", [3, 4, 9])
def test_tokens_equal_cache_free_recompute(case, prompt_length):
    gen = GenerationConfig(**case)
    prompt = random_prompt(prompt_length, seed=prompt_length)
    result = block.generate(MODEL, [prompt], gen, stop_ids=())
    assert result.tokens[0] == cache_free_generate(MODEL, prompt, gen)
    assert MASK_ID not in result.tokens[0]


@pytest.mark.parametrize("prompt_length", [1, 4, 7])
def test_cache_equals_one_block_causal_forward(prompt_length):
    gen = GenerationConfig(gen_length=9, block_length=4, steps=2)
    prompt = random_prompt(prompt_length, seed=7)
    result = block.generate(MODEL, [prompt], gen, stop_ids=())
    final = torch.tensor([prompt + result.tokens[0]])
    cache = result.cache
    assert int(cache.lengths[0]) == final.shape[1]
    record = []
    block_causal_forward(MODEL, final, 4, record)
    for layer, (k, v) in enumerate(record):
        cached_k, cached_v = cache.view(layer)
        torch.testing.assert_close(cached_k, k, rtol=0, atol=1e-12)
        torch.testing.assert_close(cached_v, v, rtol=0, atol=1e-12)


def test_stops_after_the_block_with_a_stop_token():
    gen = GenerationConfig(gen_length=40, block_length=4, steps=4)
    prompt = random_prompt(5, seed=1)
    free = block.generate(MODEL, [prompt], gen, stop_ids=()).tokens[0]
    stop = free[6]  # a token generated in the second block
    stopped = block.generate(MODEL, [prompt], gen, stop_ids=(stop,)).tokens[0]
    first_block_end = next(i for i in range(len(free)) if (len(prompt) + i + 1) % 4 == 0 and stop in free[: i + 1])
    assert stopped == free[: first_block_end + 1]
    assert stopped == cache_free_generate(MODEL, prompt, gen, stop_ids=(stop,))


@pytest.mark.parametrize("prompt_length", [5, 6, 7])
def test_a_stop_token_in_the_prompts_last_block_is_not_a_stop(prompt_length):
    """The prompt's tail shares the first decoded block (a chat template's end-of-turn token sits there):
    only generated tokens stop a generation. The stop id is one the generation never produces, so
    the whole length comes out; scanning the block from its start would stop after the first block."""
    gen = GenerationConfig(gen_length=12, block_length=4, steps=4)
    for stop in range(VOCAB - 2):
        prompt = random_prompt(prompt_length, seed=3)[:-1] + [stop]
        free = cache_free_generate(MODEL, prompt, gen)
        if stop not in free:
            break
    stopped = block.generate(MODEL, [prompt], gen, stop_ids=(stop,)).tokens[0]
    assert stopped == free and len(free) > 4


@given(lengths=st.lists(st.integers(1, 11), min_size=2, max_size=4),
       threshold=st.sampled_from([None, 0.4]))
def test_batch_rows_equal_batch_of_one(lengths, threshold):
    prompts = [random_prompt(n, seed=200 + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, threshold=threshold)
    stop_ids = (EOS_ID, 5)
    together = block.generate(MODEL, prompts, gen, stop_ids=stop_ids).tokens
    alone = [block.generate(MODEL, [p], gen, stop_ids=stop_ids).tokens[0] for p in prompts]
    assert together == alone


def test_mask_first_token_of_block_sees_its_last_and_nothing_later():
    positions = torch.arange(12)[None]
    mask = block_causal_mask(positions, positions, 4)[0, 0]
    for start in (0, 4, 8):
        assert mask[start, start + 3]  # first token of a block sees the block's last token
        assert not mask[start : start + 4, start + 4 :].any()  # no token sees a later block
        assert mask[start : start + 4, : start + 4].all()  # but sees everything up to its block's end


def test_bad_inputs_are_named():
    llada = tiny_model("llada")
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4)
    with pytest.raises(ValueError, match="needs a block-causal model"):
        block.generate(llada, [[1, 2]], gen)
    with pytest.raises(ValueError, match="remasking must be one of"):
        block.generate(MODEL, [[1, 2]], GenerationConfig(remasking="random"))
    with pytest.raises(ValueError, match="needs a threshold"):
        block.generate(MODEL, [[1, 2]], GenerationConfig(remasking="low_confidence_dynamic"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        block.generate(MODEL, [random_prompt(250, seed=0)], gen)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        block.generate(MODEL, [[]], gen)
