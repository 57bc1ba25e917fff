"""Config parsing, shape presets, NTK scaling, and the model's optional architecture flags."""

import dataclasses

import pytest
import torch

from nanodllm.attention import attention
from nanodllm.config import PRESETS, ModelConfig, preset
from nanodllm.model import build_empty
from tiny_models import tiny_config, tiny_model

# Totals with a separate LM head (Qwen3-4B and -1.7B tie it and publish 4.0B and 1.7B).
EXPECTED_PARAMS = {"llada-8b": 8.02e9, "sdar-8b": 8.19e9, "sdar-4b": 4.41e9, "sdar-1.7b": 2.03e9}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_have_the_released_shapes(name):
    cfg = preset(name)
    model = build_empty(cfg, device="meta")  # no memory: the GPU path allocates exactly once the same way
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - EXPECTED_PARAMS[name]) / EXPECTED_PARAMS[name] < 0.01, params
    assert cfg.head_dim == 128
    assert cfg.attention == ("bidirectional" if name.startswith("llada") else "block_causal")


def test_ntk_scaling_stretches_the_rope_base():
    cfg = preset("sdar-8b")
    assert cfg.rope_base == cfg.rope_theta and cfg.context_length == 32768
    long = preset("sdar-8b", context=131072)
    factor = 131072 / 32768
    assert long.rope_ntk_factor == factor
    assert long.rope_base == pytest.approx(cfg.rope_theta * factor ** (128 / 126))
    assert long.context_length == 131072
    assert cfg.with_context(1000) == cfg  # fits already: unchanged


def test_ntk_scaling_changes_only_long_range_logits_a_little():
    model = tiny_model("llada", dtype=torch.float64)
    stretched = dataclasses.replace(model.cfg, rope_ntk_factor=2.0)
    ids = torch.arange(20)[None] % 60
    positions = torch.arange(20)[None]
    dense = lambda layer, q, k, v: attention(q, k, v)
    base_logits = model(ids, positions, dense)
    model.cfg = stretched
    assert not torch.equal(model(ids, positions, dense), base_logits)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llada, sdar"):
        ModelConfig.from_dict({"model_type": "gpt2"})


def test_unknown_preset_lists_them():
    with pytest.raises(ValueError, match="choose from llada-8b"):
        preset("llama-70b")


@pytest.mark.parametrize("field,value,message", [
    ("include_bias", True, "include_bias=true is not supported"),
    ("block_type", "sequential", "block_type 'sequential' is not supported"),
])
def test_unsupported_llada_options_are_named(field, value, message):
    raw = dict(model_type="llada", d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64, vocab_size=10)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, field: value})


def test_heads_must_divide():
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        tiny_config("sdar", num_key_value_heads=3)


def test_logit_shift_moves_logits_one_position_right():
    model = tiny_model("sdar")
    ids = torch.arange(12)[None]
    positions = torch.arange(12)[None]
    dense = lambda layer, q, k, v: attention(q, k, v)
    plain = model(ids, positions, dense)
    model.cfg = dataclasses.replace(model.cfg, logit_shift=True)
    shifted = model(ids, positions, dense)
    torch.testing.assert_close(shifted[:, 1:], plain[:, :-1])
    torch.testing.assert_close(shifted[:, :1], plain[:, :1])
    torch.testing.assert_close(model(ids, positions, dense, 5, 9), shifted[:, 5:9])


def test_qkv_bias_is_used():
    cfg = tiny_config("sdar")
    model = tiny_model("sdar")
    biased = tiny_model("sdar")
    biased.cfg = dataclasses.replace(cfg, qkv_bias=True)
    for layer in biased.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features, dtype=torch.float64))
    ids, positions = torch.arange(8)[None], torch.arange(8)[None]
    dense = lambda layer, q, k, v: attention(q, k, v)
    torch.testing.assert_close(biased(ids, positions, dense), model(ids, positions, dense))
    with torch.no_grad():
        biased.layers[0].self_attn.v_proj.bias.fill_(0.5)
    assert not torch.allclose(biased(ids, positions, dense), model(ids, positions, dense))
