"""The training objectives of scripts/train_tiny.py show the model exactly what the engines show it."""

import importlib.util
from pathlib import Path

import torch

from nanodllm.attention import attention, block_causal_mask
from tiny_models import MASK_ID, random_prompt, tiny_model

spec = importlib.util.spec_from_file_location("train_tiny", Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py")
train_tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_tiny)
BLOCK = train_tiny.BLOCK


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
    ids, lengths, valid = train_tiny.collate(pairs, pad_id=0)
    all_masked = torch.ones(len(pairs))
    tokens, positions, mask, loss_at, targets = train_tiny.sdar_batch(ids, lengths, valid, MASK_ID, all_masked)
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
    pairs = [(random_prompt(9, seed=1), random_prompt(16, seed=2)), (random_prompt(5, seed=3), random_prompt(32, seed=4))]
    ids, lengths, valid = train_tiny.collate(pairs, pad_id=0)
    tokens, positions, mask, loss_at, _ = train_tiny.llada_batch(ids, lengths, valid, MASK_ID, torch.ones(2))
    logits = model(tokens, positions, lambda layer, q, k, v: attention(q, k, v, mask))
    for row, (prompt, response) in enumerate(pairs):
        canvas = torch.tensor([prompt + [MASK_ID] * len(response)])
        expected = model(canvas, torch.arange(canvas.shape[1])[None], lambda layer, q, k, v: attention(q, k, v))
        torch.testing.assert_close(logits[row, : canvas.shape[1]], expected[0])
        assert loss_at[row].sum() == len(response)
