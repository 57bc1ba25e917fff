"""Small random models for engine and method tests (float64 so that cached and uncached paths agree
to ~1e-15 and confidence ties cannot flip a top-k)."""

from pathlib import Path

import torch

from nanodllm import masked
from nanodllm.config import GenerationConfig, ModelConfig
from nanodllm.fused import fuse
from nanodllm.generation import generate
from nanodllm.loader import build_empty, random_weights

VOCAB = 64
GEMMA_FIXTURE = Path(__file__).parent / "fixtures" / "diffusion_gemma_tiny"  # DiffusionGemma, real format
MASK_ID = 63
EOS_ID = 62


def tiny_config(model_type: str, block_size: int = 4, **overrides) -> ModelConfig:
    if model_type == "llada":
        raw = dict(model_type="llada", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                   mlp_hidden_size=64, vocab_size=VOCAB, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                   max_sequence_length=256)
    elif model_type in ("llada2_moe", "sdar_moe"):  # layer 0 dense, layer 1 eight experts, two per token
        raw = dict(model_type=model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                   num_experts=8, num_experts_per_tok=2, vocab_size=VOCAB, mask_token_id=MASK_ID,
                   block_size=block_size, max_position_embeddings=256, eos_token_id=EOS_ID)
        raw.update(dict(num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5)
                   if model_type == "llada2_moe" else dict(mlp_only_layers=[0], norm_topk_prob=True))
    else:
        raw = dict(model_type="sdar", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                   mask_token_id=MASK_ID, block_size=block_size, max_position_embeddings=256,
                   eos_token_id=EOS_ID)
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float64, **overrides):
    """Random weights with std 0.3 so predictions are confident and tokens vary."""
    model = random_weights(build_empty(tiny_config(model_type, **overrides), dtype=dtype), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return fuse(model)


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 2, (length,), generator=generator).tolist()


# The masked-engine method tests share one float64 model, schedule and ragged batch (row 1 left-padded).
MASKED_MODEL = tiny_model("llada")
MASKED_GEN = GenerationConfig(gen_length=16, block_length=4, steps=16)
RAGGED_PROMPTS = [random_prompt(20, seed=1), random_prompt(13, seed=2)]


def masked_decode(method, prompts=RAGGED_PROMPTS, gen=MASKED_GEN, model=MASKED_MODEL):
    """nanodllm.generate's result (tokens, steps, stats) with `method` on the masked-engine tiny model."""
    return generate(model, prompts, gen, method)


def masked_tokens(method, prompts=RAGGED_PROMPTS, gen=MASKED_GEN, model=MASKED_MODEL):
    """What the masked engine decodes with `method`."""
    return masked_decode(method, prompts, gen, model).tokens


def differing(a, b) -> int:
    """How many generated positions two decodes disagree on."""
    return sum(x != y for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def refuses_block_causal(method) -> str:
    """The error a masked-engine method gives for a block-causal model ('' if none)."""
    try:
        masked.generate(tiny_model("sdar"), [random_prompt(8, 1)],
                        GenerationConfig(gen_length=4, block_length=4, steps=4), method, mask_id=MASK_ID)
    except ValueError as err:
        return str(err)
    return ""
