"""Logit parity with transformers on tiny checkpoints in the real on-disk formats.

The fixtures (tests/fixtures/{llada_tiny,sdar_tiny,dream_tiny,fast_dllm_v2_tiny}) and their golden
logits are written by scripts/make_fixtures.py, which runs transformers' LlamaForCausalLM
(bidirectional mask), Qwen3ForCausalLM (block-causal mask, block 4) and Qwen2ForCausalLM (q/k/v
biases; bidirectional for Dream, block-causal 4 for Fast-dLLM v2, logits shifted by one position as
both decode) in float32. These tests need only torch + safetensors.
Run with `pytest -s` to see the max differences.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanodllm.attention import attention, block_causal_mask
from nanodllm.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures"
LLADA = FIXTURES / "llada_tiny"
SDAR = FIXTURES / "sdar_tiny"
DREAM = FIXTURES / "dream_tiny"
FAST_DLLM_V2 = FIXTURES / "fast_dllm_v2_tiny"
TOLERANCE = 1e-4


def golden(path: Path):
    g = load_file(str(path / "golden.safetensors"))
    return g["input_ids"], g["positions"], g["logits"]


def mask_for(model, positions):
    if model.cfg.attention == "bidirectional":
        return None
    return block_causal_mask(positions, positions, model.cfg.block_size)


@torch.no_grad()
def run(model, ids, positions, mask):
    return model(ids, positions, lambda layer, q, k, v: attention(q, k, v, mask))


@pytest.mark.parametrize(
    "path, family, attention_kind, block_size",
    [(LLADA, "llada", "bidirectional", None), (SDAR, "sdar", "block_causal", 4),
     (DREAM, "Dream", "bidirectional", None), (FAST_DLLM_V2, "Fast_dLLM_Qwen", "block_causal", 4)],
    ids=["llada", "sdar", "dream", "fast_dllm_v2"],
)
def test_logits_match_transformers(path, family, attention_kind, block_size):
    model = load_model(path, dtype=torch.float32)
    cfg = model.cfg
    assert (cfg.model_type, cfg.attention, cfg.block_size) == (family, attention_kind, block_size)
    ids, positions, expected = golden(path)
    assert ids.shape[1] % 4, "the fixture length should not be a multiple of the block size"
    logits = run(model, ids, positions, mask_for(model, positions))
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    diff = (logits - expected).abs().max().item()
    print(f"\n{family}: max |logits - transformers| = {diff:.3e} (logit scale {expected.abs().max():.2f})")
    assert diff < TOLERANCE, f"{family}: max abs logit difference {diff:.3e} >= {TOLERANCE}"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("path", [LLADA, SDAR, DREAM, FAST_DLLM_V2], ids=["llada", "sdar", "dream", "fast_dllm_v2"])
def test_wrong_mask_is_detected(path):
    """The fixtures are sensitive to the mask: another mask misses the golden logits by far."""
    model = load_model(path, dtype=torch.float32)
    ids, positions, expected = golden(path)
    wrong = [block_causal_mask(positions, positions, 1)]  # plain causal
    if model.cfg.attention == "block_causal":
        wrong += [None, block_causal_mask(positions, positions, 8)]
    else:
        wrong += [block_causal_mask(positions, positions, 4)]
    for mask in wrong:
        assert (run(model, ids, positions, mask) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("path", [DREAM, FAST_DLLM_V2], ids=["dream", "fast_dllm_v2"])
def test_unshifted_logits_and_missing_biases_are_detected(path):
    """The shift and the q/k/v biases each matter: without either the golden logits are missed."""
    import dataclasses

    model = load_model(path, dtype=torch.float32)
    ids, positions, expected = golden(path)
    assert model.cfg.qkv_bias and model.cfg.logit_shift and not model.cfg.qk_norm
    mask = mask_for(model, positions)
    model.cfg = dataclasses.replace(model.cfg, logit_shift=False)
    assert (run(model, ids, positions, mask)[:, 1:] - expected[:, 1:]).abs().max() > 1e-2
    model.cfg = dataclasses.replace(model.cfg, logit_shift=True)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias[: model.cfg.num_heads * model.cfg.head_dim].zero_()  # q's bias
    assert (run(model, ids, positions, mask) - expected).abs().max() > 1e-2


def test_the_shifted_head_reads_before_only_at_column_zero():
    """With logit_shift, head(hidden, start, stop, before) gives column i the logits of state i - 1:
    `before` stands in for state -1 in a window from column 0 only; a later window reads its own columns."""
    model = load_model(DREAM, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 7, model.cfg.hidden_size, generator=generator)
    before = torch.randn(1, 1, model.cfg.hidden_size, generator=generator)
    with torch.no_grad():
        whole = model.head(torch.cat([before, hidden], dim=1))[:, 1:]
        for start, stop in ((0, 7), (0, 3), (2, 5), (4, 7)):
            torch.testing.assert_close(model.head(hidden, start, stop, before=before), whole[:, start:stop])


def test_sharded_equals_single_file(tmp_path):
    tensors = {}
    for shard in sorted(LLADA.glob("model-*-of-*.safetensors")):
        part = load_file(str(shard))
        assert not tensors.keys() & part.keys()
        tensors.update(part)
    assert len(tensors) == 2 + 9 * 2 + 1
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(LLADA / "config.json", tmp_path / "config.json")

    sharded = load_model(LLADA, dtype=torch.float32)
    single = load_model(tmp_path, dtype=torch.float32)
    sharded_params, single_params = dict(sharded.named_parameters()), dict(single.named_parameters())
    assert sharded_params.keys() == single_params.keys()
    for name in sharded_params:
        assert torch.equal(sharded_params[name], single_params[name]), name

    ids, positions, _ = golden(LLADA)
    assert torch.equal(run(sharded, ids, positions, None), run(single, ids, positions, None))


def test_the_masked_engine_refuses_fast_dllm_v2():
    from nanodllm import masked
    from nanodllm.config import GenerationConfig

    model = load_model(FAST_DLLM_V2, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="shifted logits"):
        masked.generate(model, [[1, 2, 3]], GenerationConfig(gen_length=4, block_length=4, steps=4))
