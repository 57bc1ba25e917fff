"""The training objectives of scripts/train_tiny.py show the model exactly what the engines show it."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from nanodllm import tasks
from nanodllm.attention import attention, block_causal_mask
from tiny_models import MASK_ID, random_prompt, tiny_model

spec = importlib.util.spec_from_file_location("train_tiny",
                                              Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py")
train_tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_tiny)
BLOCK = train_tiny.BLOCK
TINY_SDAR = Path(__file__).resolve().parents[1] / "nanodllm" / "assets" / "tiny-sdar"


def uncached_logits(model, ids, size):
    positions = torch.arange(ids.shape[1])[None]
    mask = block_causal_mask(positions, positions, size)
    return model(ids, positions, lambda layer, q, k, v: attention(q, k, v, mask))


def test_sdar_noisy_blocks_see_what_the_block_engine_shows():
    model = tiny_model("sdar", block_size=BLOCK)
    pairs = []
    for prompt_length in (40, 70):
        prompt = random_prompt(prompt_length, seed=prompt_length)
        response_length = -(-(prompt_length + 32) // BLOCK) * BLOCK - prompt_length
        pairs.append((prompt, random_prompt(response_length, seed=1 + prompt_length)))
    ids, lengths, valid, groups = train_tiny.collate([(p, r, range(1, len(r) + 1)) for p, r in pairs], pad_id=0)
    all_masked = torch.ones(len(pairs))
    tokens, positions, mask, loss_at, targets = train_tiny.sdar_batch(ids, lengths, valid, groups, MASK_ID,
                                                                      all_masked)
    logits = model(tokens, positions, lambda layer, q, k, v: attention(q, k, v, mask))
    width = ids.shape[1]
    for row, (prompt, response) in enumerate(pairs):
        start = len(prompt) // BLOCK * BLOCK
        # first active block at inference: clean prompt blocks, then prompt tail + masks
        canvas = torch.tensor([prompt + [MASK_ID] * (start + BLOCK - len(prompt))])
        expected = uncached_logits(model, canvas, BLOCK)[0, start:]
        torch.testing.assert_close(logits[row, width : width + BLOCK], expected)
        # second block: the first one committed clean, the second all masks
        canvas = torch.tensor([prompt + response[: start + BLOCK - len(prompt)] + [MASK_ID] * BLOCK])
        expected = uncached_logits(model, canvas, BLOCK)[0, start + BLOCK :]
        torch.testing.assert_close(logits[row, width + BLOCK : width + 2 * BLOCK], expected)
        assert loss_at[row, width:].sum() == len(response)  # every response token is a target at t=1


def test_llada_noisy_canvas_is_the_masked_engine_canvas():
    model = tiny_model("llada")
    pairs = [(random_prompt(9, seed=1), random_prompt(16, seed=2)),
             (random_prompt(5, seed=3), random_prompt(32, seed=4))]
    ids, lengths, valid, groups = train_tiny.collate([(p, r, range(1, len(r) + 1)) for p, r in pairs], pad_id=0)
    tokens, positions, mask, loss_at, _ = train_tiny.llada_batch(ids, lengths, valid, groups, MASK_ID, torch.ones(2))
    logits = model(tokens, positions, lambda layer, q, k, v: attention(q, k, v, mask))
    for row, (prompt, response) in enumerate(pairs):
        canvas = torch.tensor([prompt + [MASK_ID] * len(response)])
        expected = model(canvas, torch.arange(canvas.shape[1])[None], lambda layer, q, k, v: attention(q, k, v))
        torch.testing.assert_close(logits[row, : canvas.shape[1]], expected[0])
        assert loss_at[row].sum() == len(response)


@pytest.fixture(scope="module")
def encoder():
    return train_tiny.Encoder(TINY_SDAR, "sdar")


@pytest.mark.parametrize("task", tasks.TASKS)
def test_piece_cache_encodes_task_text_as_the_tokenizer_does(encoder, task):
    rng = random.Random(task)
    for length in (64, 300, 1000):
        sample = tasks.make_sample(task, length, rng.random(), rng.randrange(2**31))
        message = encoder.tokenizer.chat_text([{"role": "user", "content": sample.prompt}])
        for text in (message, sample.answer, sample.prompt[: rng.randrange(len(sample.prompt))], "a  b 1 \n"):
            assert encoder.pieces.encode(text) == encoder.tokenizer.encode(text)
            assert encoder.count_tokens(text) == len(encoder.tokenizer.encode(text))


@pytest.mark.parametrize("task", ["multikey", "kv"])
def test_drill_restates_needles_and_masks_only_their_numbers_whole(encoder, task):
    rng = random.Random(7)
    sample = tasks.make_sample(task, 400, 0.5, 11, encoder.count_tokens)
    prompt, response, groups = encoder.drill(sample, rng)
    message = encoder.tokenizer.decode(prompt)
    assert "What is" not in message and "Recite" in message
    assert len(prompt) + len(response) == -(-(len(prompt) + train_tiny.DRILL_RESPONSE_LENGTH) // BLOCK) * BLOCK
    end = response.index(encoder.end_of_turn)
    restated = encoder.tokenizer.decode(response[:end])
    if task == "multikey":
        names = [sample.meta["key"], *(name for name, _ in sample.meta["distractors"])]
        numbers = [sample.answer, *(number for _, number in sample.meta["distractors"])]
        expected = {tasks.MULTIKEY_NEEDLE.format(name=n, number=v) for n, v in zip(names, numbers)}
        assert set(restated.removesuffix(".").split(". ")) == {needle.removesuffix(".") for needle in expected}
    else:
        lines = restated.split("\n")
        assert len(lines) == train_tiny.DRILL_KV_LINES and all(line in sample.prompt for line in lines)
    digits = [encoder.tokenizer.decode([token]).isdigit() for token in response]
    assert [group > 0 for group in groups] == digits
    width = len(sample.answer)  # every restated number has the answer's digit count
    numbered = [group for group in groups if group]
    assert numbered == [number for number in range(1, len(numbered) // width + 1) for _ in range(width)]
    regular = encoder.encode(sample)
    ids, lengths, valid, batch_groups = train_tiny.collate([regular, (prompt, response, groups)], encoder.pad)
    _, _, _, masked, _ = train_tiny.llada_batch(ids, lengths, valid, batch_groups, encoder.mask_id, torch.ones(2))
    assert masked[0].sum() == len(regular[1]) and masked[1].sum() == sum(digits)  # t = 1: all that may be
    torch.manual_seed(0)
    counts = set()
    for _ in range(20):  # at t = 0.5 a number is masked whole or not at all, and how many varies
        _, _, _, masked, _ = train_tiny.llada_batch(ids, lengths, valid, batch_groups, encoder.mask_id,
                                                    torch.full((2,), 0.5))
        whole = [masked[1, batch_groups[1] == number] for number in range(1, max(groups) + 1)]
        assert all(m.all() or not m.any() for m in whole)
        counts.add(sum(bool(m.all()) for m in whole))
    assert len(counts) > 2


def test_sdar_checkpoint_converts_to_llada_carrying_every_weight(tmp_path):
    """--init with an sdar checkpoint for llada: every tensor carried over (per-head q/k norm weights tiled
    over the projection, the mask embedding moved to LLaDA's mask id), and the result saves and loads as a
    LLaDA-format checkpoint."""
    from tokenizers import Tokenizer as HFTokenizer

    from nanodllm.loader import load_reference

    sdar = load_reference(TINY_SDAR, dtype=torch.float32)
    bpe = HFTokenizer.from_file(str(train_tiny.ASSETS / "tokenizer.json"))
    vocab = {token: bpe.token_to_id(token) for token in train_tiny.SPECIAL_TOKENS}
    template = train_tiny.family_config("llada", vocab, sdar.cfg.vocab_size)
    config = train_tiny.llada_config_from_sdar(template, json.loads((TINY_SDAR / "config.json").read_text()))
    model = train_tiny.llada_from_sdar(sdar, config)
    assert model.cfg.qk_norm == "projection" and model.cfg.num_kv_heads == sdar.cfg.num_kv_heads == 2
    assert model.cfg.attention == "bidirectional" and model.cfg.rope_theta == sdar.cfg.rope_theta
    theirs = dict(sdar.named_parameters())
    for name, ours in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(ours.view(-1, sdar.cfg.head_dim),
                               theirs[name].expand(ours.numel() // sdar.cfg.head_dim, -1)), name
        elif name == "embed_tokens.weight":
            assert torch.equal(ours[model.cfg.mask_token_id], theirs[name][sdar.cfg.mask_token_id])
            others = torch.ones(ours.shape[0], dtype=torch.bool)
            others[model.cfg.mask_token_id] = False
            assert torch.equal(ours[others], theirs[name][others])
        else:
            assert torch.equal(ours, theirs[name]), name
    train_tiny.save_checkpoint(model, "llada", tmp_path / "converted", config, train_tiny.ASSETS / "tokenizer.json")
    loaded = load_reference(tmp_path / "converted", dtype=torch.float32)
    for (name, ours), theirs in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(ours, theirs), name
    with pytest.raises(SystemExit, match="d_model=256 vs hidden_size=128"):
        train_tiny.llada_config_from_sdar(template, dict(json.loads((TINY_SDAR / "config.json").read_text()),
                                                         hidden_size=128))


def test_diffusion_gemma_canvases_see_what_its_loop_shows():
    """The training pass's logits for each canvas (two per row, prompts longer than the sliding window, rows of
    two lengths) equal the model's own encode-then-denoise of that canvas after the prompt and the canvases
    before it, clean, without and with self-conditioning logits."""
    from nanodllm.loader import load_reference

    model = load_reference(Path(__file__).parent / "fixtures" / "diffusion_gemma_tiny", dtype=torch.float64)
    canvas_length, vocab = model.cfg.gemma.canvas_length, model.cfg.vocab_size
    assert model.cfg.gemma.sliding_window < 10
    pairs = [(random_prompt(13, seed=1), random_prompt(2 * canvas_length, seed=2)),
             (random_prompt(10, seed=3), random_prompt(2 * canvas_length, seed=4))]
    ids, lengths, valid, groups = train_tiny.collate([(p, r, range(1, len(r) + 1)) for p, r in pairs], pad_id=0)
    canvas, canvas_valid, clean = train_tiny.gemma_batch(ids, lengths, valid, groups, vocab, torch.full((2,), 0.5))
    assert canvas_valid.all() and torch.equal(clean, torch.tensor([r for _, r in pairs]))
    last = torch.randn(2, 2 * canvas_length, vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        for conditioning in (None, last):
            logits = train_tiny.gemma_logits(model, ids, lengths, valid, canvas, canvas_valid, conditioning)
            for row, (prompt, response) in enumerate(pairs):
                cache = model.empty_cache(1, 64)
                model.encode(torch.tensor([prompt]), cache)
                for c in range(2):
                    part = slice(c * canvas_length, (c + 1) * canvas_length)
                    fed = None if conditioning is None else conditioning[row : row + 1, part]
                    expected = model.denoise(canvas[row : row + 1, part], cache, fed)
                    torch.testing.assert_close(logits[row : row + 1, part], expected)
                    model.encode(torch.tensor([response[part]]), cache)
