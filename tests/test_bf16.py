"""bfloat16 on the CPU (torch's bf16 matmuls, plain-torch attention) against float32, for both engines
and every registered method at its defaults.

For each engine (masked: a tiny LLaDA; block: a tiny SDAR) and each method listed for it, the same
generation runs on a float32 tiny model and on that model cast with .to(torch.bfloat16) (its stacked
q/k/v and gate/up weights are Parameters of their own, cast as any other), and:

1. the first step's logits agree within a relative Frobenius error of LOGITS_RTOL;
2. the generated tokens agree on at least TOKENS_AGREE of the positions.

Knobs are each method's defaults (knob_defaults), unscaled: every default runs on the tiny models.
Budgets larger than the prompt (MAGE, Quest, SparseD k = 1024; MaskKV, SnapKV budget = 256; MOMO
k = 128) then keep every key, so those methods' sparse selection is dense here; the caches
(dllm_cache, fast_dllm, sparse_dllm, maskkv, snapkv, dyllm) do reuse stale features at their default
intervals, so their later steps are not dense.

Why these bounds (measured with these models, schedules and prompts, seeds 0-7 of tiny_model):
- bf16 keeps 8 significant bits (a relative rounding error up to 2**-9 = 2e-3 at each rounding
  point); through two layers of std-0.3 random weights, which amplify it, the first step's logits
  differ from float32 by 1.0-3.5% (Frobenius, relative) over the eight seeds, 2.4% (masked) and 2.6%
  (block) at seed 0, the one tested. LOGITS_RTOL = 4e-2 is above every seed's error; a bf16 path that
  reads the wrong format (bf16 bits read as float16 in the attention: a relative error of 1.3) is off
  by far more. Step 0 is the same dense forward for every method, so it also
  checks that a method's hooks keep bf16 working; later steps are not compared since one flipped
  token changes the canvas they see.
- A token that flips under bf16 changes every later step's input, so agreement falls by more than one
  position per flip: at seed 0 it is 0.78-1.0 (sparse_dllm lowest), over the eight seeds 0.31-1.0.
  TOKENS_AGREE = 0.5 leaves room for that cascade at seed 0; a broken bf16 path decodes tokens that
  agree with float32's about as often as random ones (1 in 62).
One rounding too many (a norm, a softmax or RoPE's angles computed in bf16 rather than float32) adds
an error of bf16's own size, which these end-to-end bounds cannot tell from bf16 itself on a 32-wide
model with prompts of 30 tokens: such bugs pass here.
"""

import copy
from functools import cache

import pytest
import torch

from nanodllm import block, masked
from nanodllm.config import GenerationConfig
from nanodllm.methods import METHODS, get_method
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LOGITS_RTOL = 4e-2
TOKENS_AGREE = 0.5

GENS = {"masked": GenerationConfig(gen_length=16, block_length=4, steps=16),  # 4 blocks of 4 steps
        "block": GenerationConfig(gen_length=12, block_length=4, steps=4)}
PROMPTS = [random_prompt(30, seed=1), random_prompt(21, seed=2)]  # ragged: one row padded
# DiffusionGemma's loop (engine "gemma") is not here: these bounds were measured on the two tiny models
PAIRS = [(name, engine) for name, cls in METHODS.items() for engine in cls.engines if engine in GENS]


@cache
def models(engine: str) -> dict:
    """The engine's float32 tiny model and its bf16 cast (a copy: .to casts a module in place)."""
    float32 = tiny_model("llada", dtype=torch.float32) if engine == "masked" else \
        tiny_model("sdar", dtype=torch.float32, block_size=4)
    return {torch.float32: float32, torch.bfloat16: copy.deepcopy(float32).to(torch.bfloat16)}


def generate(engine: str, name: str, dtype: torch.dtype):
    """Tokens a fresh `name` at its defaults decodes from PROMPTS, and its first step's logits."""
    method = get_method(name)
    logits, head = [], method.logits

    def recorded(model, hidden, ctx):
        logits.append(head(model, hidden, ctx))
        return logits[-1]

    method.logits = recorded
    model = models(engine)[dtype]
    if engine == "masked":
        tokens = masked.generate(model, PROMPTS, GENS[engine], method).tokens
    else:
        tokens = block.generate(model, PROMPTS, GENS[engine], method, stop_ids=()).tokens
    return tokens, logits[0]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of generated positions where a and b hold the same token (a missing one differs)."""
    positions = sum(max(len(row_a), len(row_b)) for row_a, row_b in zip(a, b, strict=True))
    same = sum(x == y for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b))
    return same / positions


def test_the_bf16_model_is_a_cast_of_the_float32_one():
    """Every parameter of the bf16 model is its float32 counterpart rounded to bf16, and the two have
    the same parameters, stacked alike (so the comparison is of arithmetic only)."""
    for engine in GENS:
        float32, bf16 = models(engine)[torch.float32], models(engine)[torch.bfloat16]
        params = dict(float32.named_parameters())
        assert {n: p.shape for n, p in bf16.named_parameters()} == {n: p.shape for n, p in params.items()}
        for name, param in bf16.named_parameters():
            assert param.dtype == torch.bfloat16, name
            assert torch.equal(param, params[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("name,engine", PAIRS, ids=[f"{name}-{engine}" for name, engine in PAIRS])
def test_bf16_matches_float32_at_the_defaults(name, engine):
    tokens32, logits32 = generate(engine, name, torch.float32)
    tokens16, logits16 = generate(engine, name, torch.bfloat16)
    assert logits32.dtype == torch.float32 and logits16.dtype == torch.bfloat16
    assert logits16.shape == logits32.shape
    error = ((logits16.double() - logits32.double()).norm() / logits32.double().norm()).item()
    assert error <= LOGITS_RTOL, f"first step's logits: bf16 vs float32 relative error {error:.4f} > {LOGITS_RTOL}"
    agree = agreement(tokens16, tokens32)
    assert agree >= TOKENS_AGREE, f"bf16 tokens agree with float32's on {agree:.3f} of positions < {TOKENS_AGREE}"
