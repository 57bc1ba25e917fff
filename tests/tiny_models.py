"""Small random models for engine and method tests (float64 so that cached and uncached paths agree
to ~1e-15 and confidence ties cannot flip a top-k)."""

import torch

from nanodllm.config import ModelConfig
from nanodllm.model import build_random

VOCAB = 64
MASK_ID = 63
EOS_ID = 62


def tiny_config(model_type: str, block_size: int = 4, **overrides) -> ModelConfig:
    if model_type == "llada":
        raw = dict(model_type="llada", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                   mlp_hidden_size=64, vocab_size=VOCAB, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                   max_sequence_length=256)
    else:
        raw = dict(model_type="sdar", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                   mask_token_id=MASK_ID, block_size=block_size, max_position_embeddings=256,
                   eos_token_id=EOS_ID)
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float64, **overrides):
    """Random weights with std 0.3 so predictions are confident and tokens vary."""
    model = build_random(tiny_config(model_type, **overrides), dtype=dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return model


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 2, (length,), generator=generator).tolist()
