"""The masked (LLaDA) engine against a direct transcription of LLaDA's generate() and of Fast-dLLM's
threshold rule: whole-canvas logits every step, batch of one, no shortcuts."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from nanodllm import masked
from nanodllm.attention import attention
from nanodllm.config import GenerationConfig
from nanodllm.decoding import until_stop
from nanodllm.loader import load_model
from nanodllm.tokenizer import Tokenizer
from tiny_models import MASK_ID, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODEL = tiny_model("llada")


def canvas_logits(model, x):
    """Reference forward: the whole canvas, fully bidirectional, logits everywhere."""
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return model(x, positions, lambda layer, q, k, v: attention(q, k, v, None))


def reference_generate(model, prompt, steps, gen_length, block_length, temperature=0.0,
                       cfg_scale=0.0, remasking="low_confidence", threshold=None):
    """LLaDA generate.py, transcribed; `threshold` switches to Fast-dLLM's get_transfer_index."""
    x = torch.full((1, len(prompt) + gen_length), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    prompt_index = x != MASK_ID
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        block_start, block_end = len(prompt) + b * block_length, len(prompt) + (b + 1) * block_length
        block_mask_index = x[:, block_start:block_end] == MASK_ID
        n = block_mask_index.sum(dim=1, keepdim=True)
        schedule = torch.zeros(1, steps_per_block, dtype=torch.long) + n // steps_per_block
        for j in range(int(n % steps_per_block)):
            schedule[:, j] += 1
        i = 0
        while True:
            if threshold is None and i == steps_per_block:
                break
            if threshold is not None and (x[:, block_start:block_end] == MASK_ID).sum() == 0:
                break
            mask_index = x == MASK_ID
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = MASK_ID
                logits, un_logits = canvas_logits(model, torch.cat([x, un_x])).chunk(2)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = canvas_logits(model, x)
            if temperature > 0:
                logits64 = logits.to(torch.float64)
                noise = torch.rand_like(logits64)
                scores = logits64.exp() / (-torch.log(noise)) ** temperature
            else:
                scores = logits
            x0 = torch.argmax(scores.index_fill(-1, torch.tensor([MASK_ID]), float("-inf")), dim=-1)  # guard
            if remasking == "low_confidence":
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            else:
                x0_p = torch.rand((x0.shape[0], x0.shape[1]))
            x0_p[:, block_end:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if threshold is None:
                _, select = torch.topk(confidence[0], k=int(schedule[0, i]))
                transfer[0, select] = True
            else:
                k = int(mask_index.sum())
                _, select = torch.topk(confidence[0], k=k)
                transfer[0, select] = True
                for rank in range(1, k):
                    if confidence[0, select[rank]] < threshold:
                        transfer[0, select[rank]] = False
            x[transfer] = x0[transfer]
            i += 1
    return x[0, len(prompt):].tolist()


@pytest.mark.parametrize("gen_length,block_length,steps", [(8, 8, 8), (16, 4, 8), (12, 6, 8), (10, 10, 4),
                                                           (15, 5, 6), (8, 2, 4)])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_matches_reference_loop(gen_length, block_length, steps, remasking):
    prompt = random_prompt(7, seed=gen_length + steps)
    torch.manual_seed(0)
    expected = reference_generate(MODEL, prompt, steps, gen_length, block_length, remasking=remasking)
    torch.manual_seed(0)
    gen = GenerationConfig(gen_length=gen_length, block_length=block_length, steps=steps, remasking=remasking)
    result = masked.generate(MODEL, [prompt], gen)
    assert result.tokens[0] == expected
    assert MASK_ID not in expected
    assert result.forwards == steps


def test_matches_reference_with_cfg():
    prompt = random_prompt(6, seed=3)
    expected = reference_generate(MODEL, prompt, 8, 8, 4, cfg_scale=1.5)
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8, cfg_scale=1.5)
    assert masked.generate(MODEL, [prompt], gen).tokens[0] == expected


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.9, 1.0])
def test_matches_fast_dllm_threshold(threshold):
    prompt = random_prompt(5, seed=11)
    expected = reference_generate(MODEL, prompt, 16, 16, 8, threshold=threshold)
    gen = GenerationConfig(gen_length=16, block_length=8, steps=16, threshold=threshold)
    result = masked.generate(MODEL, [prompt], gen)
    assert result.tokens[0] == expected
    if threshold == 0.0:
        assert result.forwards == 2  # every masked token clears a zero threshold: one step per block
    if threshold == 1.0:
        assert result.forwards == 16  # nothing clears it: one token per step


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_a_threshold_run_counts_the_steps_it_took(threshold):
    """Under a threshold a block ends when no mask is left: the steps counted are the steps taken (one
    forward each), not the schedule's steps per block."""
    gen = GenerationConfig(gen_length=16, block_length=8, steps=16, threshold=threshold)
    result = masked.generate(MODEL, [random_prompt(5, seed=11)], gen)
    assert result.steps == result.forwards < 16


def test_transfer_schedule_is_split_evenly():
    from nanodllm.decoding import split_evenly

    schedule = split_evenly(torch.tensor([10, 3, 0]), 4)
    assert schedule.tolist() == [[3, 3, 2, 2], [1, 1, 1, 0], [0, 0, 0, 0]]


@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), threshold=st.sampled_from([None, 0.5]))
def test_batch_rows_equal_batch_of_one(lengths, threshold):
    prompts = [random_prompt(n, seed=100 + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, threshold=threshold)
    together = masked.generate(MODEL, prompts, gen).tokens
    alone = [masked.generate(MODEL, [p], gen).tokens[0] for p in prompts]
    assert together == alone


def test_bad_inputs_are_named():
    prompt = random_prompt(4, seed=0)
    with pytest.raises(ValueError, match="not a multiple of block_length"):
        masked.generate(MODEL, [prompt], GenerationConfig(gen_length=10, block_length=4, steps=4))
    with pytest.raises(ValueError, match="not a multiple of the number of blocks"):
        masked.generate(MODEL, [prompt], GenerationConfig(gen_length=8, block_length=4, steps=3))
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        masked.generate(MODEL, [random_prompt(249, seed=0)], GenerationConfig(gen_length=8, block_length=4, steps=4))
    filled = masked.generate(MODEL, [random_prompt(248, seed=0)],
                             GenerationConfig(gen_length=8, block_length=8, steps=1))
    assert len(filled.tokens[0]) == 8  # 248 + 8 fills the context exactly
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        masked.generate(MODEL, [prompt, []], GenerationConfig(gen_length=8, block_length=4, steps=4))
    with pytest.raises(ValueError, match="outside"):
        masked.generate(MODEL, [[1, 2, 999]], GenerationConfig(gen_length=8, block_length=4, steps=4))
    with pytest.raises(ValueError, match="gen_length must be a positive integer"):
        GenerationConfig(gen_length=0)


def test_until_stop_cuts_before_the_first_stop_token():
    assert until_stop([5, 6, 9, 7, 8], {8, 9}) == [5, 6]
    assert until_stop([5, 6], (9,)) == [5, 6] and until_stop([9, 5], (9,)) == []

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gumbel_noise_samples_the_softmax_at_the_temperature(temperature):
    """The argmax of gumbel_max_scores over logits (0, log 3) is token 1 with probability
    softmax(logits / T)[1] = 3^(1/T) / (1 + 3^(1/T)): 0.9, 0.75 and 0.634 at T = 0.5, 1 and 2."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(200_000, 1)
    drawn = masked.gumbel_max_scores(logits, temperature).argmax(dim=-1).double().mean()
    expected = 3 ** (1 / temperature) / (1 + 3 ** (1 / temperature))
    assert abs(float(drawn) - expected) < 0.01  # 200K draws: a standard error near 0.001


def test_a_block_causal_ragged_batch_equals_its_rows_alone():
    """On a block-causal model the canvas's positions decide the blocks: each row's count from its own
    first prompt token, so the 9-token row, left-padded by 5 columns (not a multiple of the block of 4)
    next to a 14-token one, decodes what it decodes alone."""
    model = tiny_model("sdar", block_size=4)
    prompts = [random_prompt(14, seed=1), random_prompt(9, seed=2)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8)
    together = masked.generate(model, prompts, gen).tokens
    assert together == [masked.generate(model, [prompt], gen).tokens[0] for prompt in prompts]


TINY_LLADA = Path(masked.__file__).resolve().parent / "assets" / "tiny-llada"
PASSKEY_INTRO = "There is a pass key hidden in this text. Find it and remember it. "
PASSKEY_QUESTION = "The pass key is {key}. Remember it. {key} is the pass key. What is the pass key?"


def test_llada_chat_prompts_on_tiny_llada_equal_the_reference(monkeypatch):
    """Prompts built with tiny-llada's own chat template (<|startoftext|>, header tokens, an <|eot_id|>
    ending every turn, a system turn in the second), 65 and 74 tokens, in one left-padded batch: each
    row equals the reference loop run on it alone, token for token; all 8 positions are decoded (the
    masked engine never stops early, stop ids in the prompt or not), and each row answers its own key
    followed by <|eot_id|>."""
    model, tokenizer = load_model(TINY_LLADA, dtype=torch.float64), Tokenizer.from_dir(TINY_LLADA, "llada")
    monkeypatch.setitem(globals(), "MASK_ID", tokenizer.mask_id)  # the reference's canvas filler
    end_of_turn = tokenizer.hf.token_to_id("<|eot_id|>")
    prompts = [tokenizer.chat([{"role": "user", "content": PASSKEY_INTRO + PASSKEY_QUESTION.format(key=52817)}]),
               tokenizer.chat([{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": PASSKEY_QUESTION.format(key=90210)}])]
    assert [len(prompt) for prompt in prompts] == [65, 74] and all(end_of_turn in prompt for prompt in prompts)
    tokens = masked.generate(model, prompts, GenerationConfig(gen_length=8, block_length=4, steps=4)).tokens
    assert tokens == [reference_generate(model, prompt, 4, 8, 4) for prompt in prompts]
    assert [len(row) for row in tokens] == [8, 8] and [row[5] for row in tokens] == [end_of_turn] * 2
    assert [tokenizer.decode(until_stop(row, tokenizer.stop_ids)) for row in tokens] == ["52817", "90210"]


@pytest.mark.parametrize("gen_length,block_length,steps", [(8, 8, 8), (16, 4, 8)])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_a_one_token_prompt_equals_the_reference(gen_length, block_length, steps, threshold):
    """A 1-token prompt: the canvas is that token and gen_length masks, the first block starts at
    column 1, and the tokens equal the reference's."""
    prompt = random_prompt(1, seed=50)
    gen = GenerationConfig(gen_length=gen_length, block_length=block_length, steps=steps, threshold=threshold)
    expected = reference_generate(MODEL, prompt, steps, gen_length, block_length, threshold=threshold)
    assert masked.generate(MODEL, [prompt], gen).tokens[0] == expected


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_a_batch_mixing_one_token_and_longer_prompts_equals_each_row_alone(threshold):
    """Rows of 1, 4, 8 and 13 tokens: every row decodes what it decodes alone, and the 1-token row,
    left-padded by 12 columns, what the reference decodes for it."""
    prompts = [random_prompt(n, seed=60 + n) for n in (1, 4, 8, 13)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, threshold=threshold)
    together = masked.generate(MODEL, prompts, gen).tokens
    assert together == [masked.generate(MODEL, [prompt], gen).tokens[0] for prompt in prompts]
    assert together[0] == reference_generate(MODEL, prompts[0], 4, 8, 4, threshold=threshold)


def test_prompt_ids_are_checked_exactly_against_the_vocabulary():
    """check_prompts takes ids in [0, vocab_size): the last id is a token, vocab_size and -1 are refused."""
    from nanodllm.decoding import check_prompts

    assert check_prompts([[0, 99]], vocab_size=100, context_length=64, extra=8) == [[0, 99]]
    for bad in (100, -1):
        with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
            check_prompts([[1, bad]], vocab_size=100, context_length=64, extra=8)
