"""The block (SDAR) engine: exact cache, equality with a cache-free recompute, batches, errors."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from nanodllm import block, decoding, fast_dllm_v2
from nanodllm.attention import attention, block_causal_mask
from nanodllm.config import GenerationConfig
from nanodllm.decoding import until_stop
from nanodllm.loader import load_model
from nanodllm.methods import get_method
from nanodllm.tokenizer import Tokenizer
from tiny_models import EOS_ID, MASK_ID, VOCAB, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODEL = tiny_model("sdar")
FAST_DLLM_V2 = Path(__file__).parent / "fixtures" / "fast_dllm_v2_tiny"


def generation_of(model_type: str):
    """The loop that decodes the family: the block engine, or Fast-dLLM v2's own."""
    return block.generate if model_type == "sdar" else fast_dllm_v2.generate


def block_causal_forward(model, x, size, record=None):
    """Uncached forward over x [1, t] with the block-causal mask; optionally records each layer's K, V."""
    positions = torch.arange(x.shape[1])[None]
    mask = block_causal_mask(positions, positions, size)

    def attend(layer, q, k, v):
        if record is not None:
            record.append((k, v))
        return attention(q, k, v, mask)

    return model(x, positions, attend)


def cache_free_generate(model, prompt, gen, stop_ids=(), trace=None):
    """SDAR's block_diffusion_generate loop, recomputing the whole prefix at every step. trace: a list
    that gets (scheduled count, positions over the threshold, positions unmasked) per step."""
    size = gen.block_length
    total = math.ceil((len(prompt) + gen.gen_length) / size) * size
    x = torch.full((1, total), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    schedule = [size // gen.steps + (i < size % gen.steps) for i in range(gen.steps)]
    end = len(prompt)
    undecided = torch.arange(total) >= len(prompt)  # tracked, so a prompt token equal to [MASK] stays
    dynamic = gen.threshold is not None and gen.remasking != "low_confidence_static"
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
            elif dynamic and int((conf > gen.threshold).sum()) >= k:
                transfer = conf > gen.threshold
            else:
                transfer[torch.topk(conf, k).indices] = True
            if trace is not None:
                trace.append((k, int((conf > gen.threshold).sum()) if dynamic else None, int(transfer.sum())))
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


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("remasking", ["low_confidence", "low_confidence_dynamic", "low_confidence_static"])
@pytest.mark.parametrize("model_type", ["sdar", "llada2_moe"])
def test_the_threshold_rule_unmasks_several_tokens_a_step_as_the_reference(model_type, remasking, steps):
    """LLaDA2 and SDAR decode with a threshold: a step unmasks every position over it when at least the
    scheduled count are, else the scheduled count of most confident ones (low_confidence_static: always
    those). At threshold 0.2 the tiny models' confidences put more positions than the count over it in
    some steps and (2 steps: 4 a step) fewer in others; steps below the block length schedule several, the
    prompt's last partial block holds the mask id twice: a prompt token, never decoded. The tokens and
    the cache equal the cache-free reference's."""
    model = tiny_model(model_type)
    gen = GenerationConfig(gen_length=20, block_length=8, steps=steps, threshold=0.2, remasking=remasking)
    prompt = random_prompt(12, seed=4)
    prompt[9] = prompt[11] = MASK_ID
    trace = []
    expected = cache_free_generate(model, prompt, gen, trace=trace)
    result = block.generate(model, [prompt], gen, stop_ids=())
    assert result.tokens[0] == expected and MASK_ID not in expected
    assert max(unmasked for _, _, unmasked in trace) > 1
    if remasking != "low_confidence_static":
        assert any(over > count for count, over, _ in trace), "all over the threshold, more than the count"
        assert steps != 2 or any(0 < over < count for count, over, _ in trace), "too few over it: the count"
    record = []
    block_causal_forward(model, torch.tensor([prompt + expected]), 8, record)
    for layer, (k, v) in enumerate(record):
        torch.testing.assert_close(result.cache.view(layer)[0], k, rtol=0, atol=1e-12)


@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=3), seed=st.integers(0, 2**16), told=st.booleans())
def test_top_confident_marks_each_rows_count_most_confident(counts, seed, told):
    """Row r keeps the counts[r] positions torch.topk ranks first, whether the host is told the counts or not."""
    confidence = torch.randn(len(counts), 6, generator=torch.Generator().manual_seed(seed))
    transfer = decoding.top_confident(confidence, counts if told else torch.tensor(counts))
    for row, count in enumerate(counts):
        expected = torch.zeros(6, dtype=torch.bool)
        expected[torch.topk(confidence[row], count).indices] = True
        assert torch.equal(transfer[row], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's syncs; run on a GPU machine")
def test_top_confident_told_the_counts_never_waits_for_the_device():
    """With the counts on the host, choosing what to unmask makes no call that waits for the GPU (torch's
    sync debug mode raises at one), so the engines queue the next step while one runs."""
    confidence = torch.randn(3, 32, device="cuda")
    counts = [4, 0, 32]
    torch.cuda.set_sync_debug_mode("error")
    try:
        transfer = decoding.top_confident(confidence, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert transfer.sum(dim=1).tolist() == counts


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


TINY_SDAR = Path(block.__file__).resolve().parent / "assets" / "tiny-sdar"
PASSKEY_INTRO = "There is a pass key hidden in this text. Find it and remember it. "
PASSKEY_QUESTION = "The pass key is {key}. Remember it. {key} is the pass key. What is the pass key?"


@pytest.fixture(scope="module")
def tiny_sdar():
    """The shipped tiny-sdar (blocks of 32) in float64, so cached and cache-free forwards agree to
    ~1e-15, and its tokenizer."""
    return load_model(TINY_SDAR, dtype=torch.float64), Tokenizer.from_dir(TINY_SDAR, "sdar")


def first_stop(tokens, stop_ids) -> int:
    return next(i for i, token in enumerate(tokens) if token in stop_ids)


def test_a_qwen3_chat_prompt_decodes_like_the_reference_past_its_own_end_of_turn(tiny_sdar, monkeypatch):
    """tiny-sdar's own chat template gives a 61-token prompt ending <|im_end|>\\n<|im_start|>assistant\\n:
    its end-of-turn token (a stop id) sits in the prompt's last partial block [32, 64), which leaves 3
    positions to generate. The model writes the 5-digit key, so its <|im_end|> comes 2 tokens into the
    next block: 3 + 32 tokens come back (the whole stopping block, as the reference returns it), equal
    to the cache-free reference token for token. Taking the prompt's <|im_end|> for a stop would end
    after 3 tokens, "528"."""
    model, tokenizer = tiny_sdar
    monkeypatch.setitem(globals(), "MASK_ID", tokenizer.mask_id)  # the reference's canvas filler
    prompt = tokenizer.chat([{"role": "user", "content": PASSKEY_INTRO + PASSKEY_QUESTION.format(key=52817)}])
    end_of_turn = tokenizer.hf.token_to_id("<|im_end|>")
    assert end_of_turn in tokenizer.stop_ids and len(prompt) == 61 and prompt[-10] == end_of_turn
    gen = GenerationConfig(gen_length=32, block_length=32, steps=8)
    tokens = block.generate(model, [prompt], gen, stop_ids=tokenizer.stop_ids).tokens[0]
    assert tokens == cache_free_generate(model, prompt, gen, stop_ids=tokenizer.stop_ids)
    assert len(tokens) == 35 and first_stop(tokens, tokenizer.stop_ids) == 5
    assert tokenizer.decode(until_stop(tokens, tokenizer.stop_ids)) == "52817"


def test_a_ragged_chat_batch_stops_each_row_after_its_own_stopping_block(tiny_sdar, monkeypatch):
    """Chat prompts of 45 and 61 tokens, both with their <|im_end|> in the last partial block [32, 64).
    The 45-token row writes its key and <|im_end|> in that block, mid-block (column 50 of 32..63), and
    stops with the block's 19 generated tokens, the ones after the stop included (the reference's
    rule: stop after the block). The 61-token row has 3 positions there and stops 2 tokens into the
    next block, with 35 tokens, while the finished row stays as it was. Each row equals the cache-free
    reference. (Judging the second row by the first row's prompt length would see its prompt's
    <|im_end|> at column 51 and stop it after 3 tokens.)"""
    model, tokenizer = tiny_sdar
    monkeypatch.setitem(globals(), "MASK_ID", tokenizer.mask_id)
    prompts = [tokenizer.chat([{"role": "user", "content": PASSKEY_QUESTION.format(key=90210)}]),
               tokenizer.chat([{"role": "user", "content": PASSKEY_INTRO + PASSKEY_QUESTION.format(key=52817)}])]
    assert [len(prompt) for prompt in prompts] == [45, 61]
    gen = GenerationConfig(gen_length=32, block_length=32, steps=8)
    tokens = block.generate(model, prompts, gen, stop_ids=tokenizer.stop_ids).tokens
    assert tokens == [cache_free_generate(model, prompt, gen, stop_ids=tokenizer.stop_ids) for prompt in prompts]
    assert [len(row) for row in tokens] == [19, 35]
    assert [first_stop(row, tokenizer.stop_ids) for row in tokens] == [5, 5]
    assert [tokenizer.decode(until_stop(row, tokenizer.stop_ids)) for row in tokens] == ["90210", "52817"]


@pytest.mark.parametrize("case", [dict(gen_length=8, block_length=4, steps=4),
                                  dict(gen_length=10, block_length=8, steps=3),
                                  dict(gen_length=8, block_length=4, steps=4, threshold=0.5)])
@pytest.mark.parametrize("prompt_length", [1, 8, 16])
def test_one_token_and_whole_block_prompts_equal_cache_free_recompute(case, prompt_length):
    """A 1-token prompt has no complete block to prefill: its first block starts at column 0 with that
    token. A prompt of exactly k blocks (8 or 16 tokens: 2 or 4 blocks of 4, 1 or 2 blocks of 8) is
    prefilled whole and decoding starts on a block of masks only. Either way the tokens equal the
    cache-free reference's, and they fill the canvas after the prompt up to whole blocks."""
    gen = GenerationConfig(**case)
    prompt = random_prompt(prompt_length, seed=30 + prompt_length)
    result = block.generate(MODEL, [prompt], gen, stop_ids=())
    assert result.tokens[0] == cache_free_generate(MODEL, prompt, gen)
    size = gen.block_length
    assert len(result.tokens[0]) == math.ceil((prompt_length + gen.gen_length) / size) * size - prompt_length
    assert int(result.cache.lengths[0]) == prompt_length + len(result.tokens[0])


def test_a_batch_of_one_token_and_whole_block_prompts_equals_each_row_alone():
    """Rows of 1, 4 (one block), 8 (two blocks) and 6 tokens prefill 0, 1, 2 and 1 blocks and start
    decoding at columns 0, 4, 8 and 4: each row decodes what it decodes alone, to its own canvas end."""
    prompts = [random_prompt(n, seed=40 + n) for n in (1, 4, 8, 6)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4)
    together = block.generate(MODEL, prompts, gen, stop_ids=()).tokens
    assert together == [block.generate(MODEL, [prompt], gen, stop_ids=()).tokens[0] for prompt in prompts]
    assert [len(row) for row in together] == [11, 8, 8, 10]


@pytest.mark.parametrize("name", ["dense", "mage", "quest", "momo"])
@pytest.mark.parametrize("model_type", ["sdar", "fast_dllm_v2"])
def test_a_prefill_a_row_at_a_time_decodes_and_caches_as_one_pass(name, model_type, monkeypatch):
    """decoding.PREFILL_TOKENS so small that each row of a ragged batch prefills alone (into its rows of
    the cache): the same tokens, and the same cache where both wrote, as the whole batch at once."""
    model = MODEL if model_type == "sdar" else load_model(FAST_DLLM_V2, dtype=torch.float32)
    prompts = [random_prompt(n, seed=300 + n) for n in (11, 3, 8)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4)
    run = generation_of(model_type)
    whole = run(model, prompts, gen, method=get_method(name), stop_ids=())
    monkeypatch.setattr(decoding, "PREFILL_TOKENS", 1)
    calls = []
    original = decoding.KVCache.rows
    monkeypatch.setattr(decoding.KVCache, "rows", lambda self, *span: calls.append(span) or original(self, *span))
    apart = run(model, prompts, gen, method=get_method(name), stop_ids=())
    assert calls == [(0, 1), (1, 2), (2, 3)]
    assert apart.tokens == whole.tokens
    if model_type == "sdar":
        for mine, theirs in zip(apart.cache.keys, whole.cache.keys):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remasking", ["low_confidence", "low_confidence_dynamic"])
def test_a_confidence_equal_to_the_threshold_does_not_clear_it(remasking):
    """The threshold rule counts the positions strictly above it (LLaDA2's and SDAR's confidence >
    threshold): three at 0.5 and one at 0.9 put one over 0.5, enough for a count of 1, too few for 2."""
    confidence = torch.tensor([[0.5, 0.5, 0.9, 0.5, float("-inf")]])
    masked = torch.tensor([[True, True, True, True, False]])
    one = block.choose(confidence, masked, torch.tensor([1]), remasking, 0.5)
    assert one.tolist() == [[False, False, True, False, False]]
    two = block.choose(confidence, masked, torch.tensor([2]), remasking, 0.5)
    assert two.sum().item() == 2 and two[0, 2]


@given(left=st.lists(st.integers(0, 8), min_size=1, max_size=4), scheduled=st.integers(0, 6))
def test_masks_left_caps_each_rows_count_at_what_it_has_left(left, scheduled):
    """MasksLeft.capped: this step's scheduled count per row, never more than the masks the row has left;
    take() then leaves each row the difference, never below zero."""
    masked = torch.tensor([[i < n for i in range(8)] for n in left])
    counts = decoding.MasksLeft(masked, followed=True).capped(scheduled)
    assert counts == [min(scheduled, n) for n in left]
    tracker = decoding.MasksLeft(masked, followed=True)
    tracker.take(tracker.capped(scheduled))
    assert tracker.host == [n - min(scheduled, n) for n in left] and min(tracker.host) >= 0
