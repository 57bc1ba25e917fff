"""Config parsing, shape presets, NTK scaling, and the model's optional architecture flags."""

import dataclasses
import math
import re

import pytest
import torch

from nanodllm.attention import attention
from nanodllm.config import PRESETS, GenerationConfig, ModelConfig, default_block_length, default_threshold, preset
from nanodllm.loader import build_empty, random_weights
from nanodllm.model import Model, RMSNorm, Rope
from tiny_models import tiny_config, tiny_model

# Totals with a separate LM head (Qwen3-4B and -1.7B tie it and publish 4.0B and 1.7B).
# Dream-7B and Fast-dLLM v2 7B are Qwen2.5-7B's shape (7.62B, untied head). LLaDA2.0-mini is
# Ling-mini-2.0's shape (16.26B total), LLaDA2.0-flash 102.9B ("100B", docs/formats.md); SDAR-30B-A3B is
# Qwen3-30B-A3B's (30.5B).
EXPECTED_PARAMS = {"llada-8b": 8.02e9, "sdar-8b": 8.19e9, "sdar-4b": 4.41e9, "sdar-1.7b": 2.03e9,
                   "dream-7b": 7.62e9, "fast-dllm-v2-7b": 7.62e9, "llada2-mini": 16.26e9, "llada2-flash": 102.9e9,
                   "sdar-30b-a3b": 30.5e9, "diffusiongemma-26b-a4b": 25.25e9}  # DiffusionGemma: its text model


@pytest.mark.parametrize("name", PRESETS)
def test_presets_have_the_released_shapes(name):
    cfg = preset(name)
    model = build_empty(cfg, device="meta")  # no memory: the GPU path allocates exactly once the same way
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - EXPECTED_PARAMS[name]) / EXPECTED_PARAMS[name] < 0.01, params
    assert cfg.head_dim == (256 if cfg.gemma else 128)  # DiffusionGemma's sliding layers; its full ones 512
    kinds = {"llada-8b": "bidirectional", "dream-7b": "bidirectional", "diffusiongemma-26b-a4b": "encoder_decoder"}
    assert cfg.attention == kinds.get(name, "block_causal")


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
    with pytest.raises(ValueError,
                       match="unsupported model_type 'gpt2'; supported: llada, sdar, Dream, Fast_dLLM_Qwen"):
        ModelConfig.from_dict({"model_type": "gpt2"})


def test_unknown_preset_lists_them():
    with pytest.raises(ValueError, match="choose from llada-8b"):
        preset("llama-70b")


@pytest.mark.parametrize("field,value,message", [
    ("include_bias", True, "include_bias=true is not supported"),
    ("block_type", "sequential", "block_type 'sequential' is not supported"),
    ("layer_norm_type", "default", "layer_norm_type 'default' is not supported"),
    ("attention_layer_norm_with_affine", False, "attention_layer_norm without affine weights"),
])
def test_unsupported_llada_options_are_named(field, value, message):
    raw = dict(model_type="llada", d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64, vocab_size=10,
               attention_layer_norm=True)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, field: value})


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_model(model_type: str, **overrides) -> Model:
    """tiny_model's weights (std 0.3, float64) in the reference model, whose q/k/v projections these
    tests read (the fused model's equality with it: tests/test_fused.py)."""
    model = random_weights(build_empty(tiny_config(model_type, **overrides), dtype=torch.float64))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return model


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llada_attention_layer_norm_normalises_the_whole_projection(kv_heads):
    """OLMo's attention_layer_norm: one RMSNorm over all of q's heads (d_model wide) and one over k's
    (kv_heads * head_dim), before the split into heads and RoPE; not SDAR's per-head norm."""
    model = reference_model("llada", attention_layer_norm=True, n_kv_heads=kv_heads)
    cfg, layer = model.cfg, model.layers[0]
    assert cfg.qk_norm == "projection" and tiny_config("llada").qk_norm is None
    attn = layer.self_attn
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (kv_heads * 8,)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()))
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    h[..., :8] *= 10  # heads of very different size: a per-head norm would give other q and k
    rope = Rope(torch.arange(5)[None].expand(2, -1), cfg.head_dim, cfg.rope_base)
    q, k, _ = layer.qkv(h, rope)

    def expected(proj, norm):
        normed = rms(proj(h), norm.weight, cfg.rms_norm_eps)
        return rope.apply(normed.view(2, 5, -1, 8).transpose(1, 2))

    torch.testing.assert_close(q, expected(attn.q_proj, attn.q_norm))
    torch.testing.assert_close(k, expected(attn.k_proj, attn.k_norm))
    torch.testing.assert_close(layer.query(h, rope), q)
    per_head = rope.apply(rms(attn.q_proj(h).view(2, 5, -1, 8), attn.q_norm.weight.view(4, 8), cfg.rms_norm_eps)
                          .transpose(1, 2))
    assert (per_head - q).abs().max() > 0.1


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
    hidden = model.hidden(ids, positions, dense)  # a forward over columns 5.. reads column 4 through `before`
    torch.testing.assert_close(model.head(hidden[:, 5:], 0, 4, before=hidden[:, 4:5]), shifted[:, 5:9])


def test_qkv_bias_is_used():
    cfg = tiny_config("sdar")
    model = reference_model("sdar")
    biased = reference_model("sdar")
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


QWEN2_RAW = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=300)


@pytest.mark.parametrize("model_type,attention,block_size,mask_id", [
    ("Dream", "bidirectional", None, 151666), ("Fast_dLLM_Qwen", "block_causal", 32, 151665)])
def test_qwen2_families_get_their_documented_defaults(model_type, attention, block_size, mask_id):
    cfg = ModelConfig.from_dict({**QWEN2_RAW, "model_type": model_type})
    assert (cfg.attention, cfg.block_size, cfg.mask_token_id) == (attention, block_size, mask_id)
    assert cfg.qkv_bias and cfg.logit_shift and not cfg.qk_norm
    assert cfg.eos_token_ids == () and cfg.head_dim == 16  # the family's stop ids lie past a 300-token vocabulary
    assert ModelConfig.from_dict({**QWEN2_RAW, "model_type": model_type, "vocab_size": 152064}).eos_token_ids == (
        151645, 151643)
    assert ModelConfig.from_dict({**QWEN2_RAW, "model_type": model_type, "mask_token_id": 7}).mask_token_id == 7
    assert ModelConfig.from_dict({**QWEN2_RAW, "model_type": "Fast_dLLM_Qwen", "bd_size": 8}).block_size == 8


@pytest.mark.parametrize("field,value,message", [
    ("use_sliding_window", True, "use_sliding_window=true is not supported"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling=.* is not supported"),
    ("hidden_size", None, "required field 'hidden_size' is missing"),
])
def test_unsupported_qwen2_options_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**QWEN2_RAW, "model_type": "Dream", field: value})


@pytest.mark.parametrize("model_type", ["llada", "sdar", "Dream"])  # no q/k norm, per-head q/k norm, biases
def test_qk_and_kv_equal_their_share_of_qkv(model_type):
    """Layer.qk projects q and k alone and Layer.kv k and v alone, and give what qkv gives for them."""
    if model_type == "Dream":
        model = Model(ModelConfig.from_dict(dict(QWEN2_RAW, model_type=model_type))).to(torch.float64)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(
                    param.numel())) * 0.3)
    else:
        model = tiny_model(model_type)
    layer, ids = model.layers[0], torch.arange(6)[None]
    with torch.no_grad():
        h = torch.randn(1, 6, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        q, k = layer.qk(h, model.rope(ids))
        q_all, k_all, v_all = layer.qkv(h, model.rope(ids))
        k_alone, v_alone = layer.kv(h, model.rope(ids))
    for alone, shared in ((q, q_all), (k, k_all), (k_alone, k_all), (v_alone, v_all)):
        assert torch.equal(alone, shared)


# ------------------------------------------------------------------------------------------------
# fields at values other than the fixtures'


@pytest.mark.parametrize("step, only, dense", [(1, [], ()), (2, [], (0, 2)), (3, [], (0, 1, 3)), (2, [1], (0, 1, 2))])
def test_qwen3_moe_layers_are_dense_by_decoder_sparse_step_and_mlp_only_layers(step, only, dense):
    """Qwen3-MoE: layer i is dense if listed in mlp_only_layers or (i + 1) is not a multiple of the step."""
    from nanodllm.mlp import MLP

    cfg = tiny_config("sdar_moe", num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=only)
    assert cfg.moe.dense_layers == dense
    model = build_empty(cfg, "meta")
    assert tuple(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MLP)) == dense


def routed(cfg, seed: int):
    """(the router logits of 20 random float64 rows under a random router of cfg, its choice, its weights)."""
    from nanodllm.mlp import Router

    router = Router(cfg.hidden_size, cfg.moe).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(20, cfg.hidden_size, generator=generator, dtype=torch.float64)
    return x @ router.weight.T, *router(x)


@pytest.mark.parametrize("normalize", [False, True])
def test_norm_topk_prob_decides_whether_the_chosen_weights_sum_to_one(normalize):
    logits, chosen, weights = routed(tiny_config("sdar_moe", norm_topk_prob=normalize), seed=3)
    scores = logits.softmax(dim=-1).gather(-1, chosen)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) if normalize else scores)
    assert (weights.sum(-1) < 1 - 1e-3).any() != normalize


@pytest.mark.parametrize("count", [0, 1, 2])
def test_llada2_shared_expert_is_num_shared_experts_wide(count):
    """BailingMoeV2's shared experts are one MLP of num_shared_experts * moe_intermediate_size (none at 0)."""
    cfg = tiny_config("llada2_moe", num_shared_experts=count)
    shared = build_empty(cfg, "meta").layers[1].mlp.shared_expert
    assert cfg.moe.shared_size == count * 16
    assert shared is None if count == 0 else shared.gate_proj.out_features == count * 16


@pytest.mark.parametrize("per_token", [1, 2])
def test_llada2_weights_one_chosen_expert_by_its_score_unnormalised(per_token):
    """LLaDA2 normalises the chosen scores to sum 1 only when more than one expert is chosen (its
    modeling file: top_k > 1); a lone expert keeps its sigmoid score, times routed_scaling_factor."""
    logits, chosen, weights = routed(tiny_config("llada2_moe", num_experts_per_tok=per_token), seed=4)
    scores = logits.sigmoid().gather(-1, chosen)
    torch.testing.assert_close(weights, 2.5 * (scores if per_token == 1 else scores / scores.sum(-1, keepdim=True)))


@pytest.mark.parametrize("model_type, rotated", [("llada2_moe", 4), ("sdar", 8)])
def test_the_ntk_stretched_base_follows_the_rotated_width(model_type, rotated):
    """base * factor^(d / (d - 2)) with d the width RoPE rotates (LLaDA2: half of each 8-dim head), and
    the model's RoPE turns that width only, at that base."""
    cfg = tiny_config(model_type).with_context(2 * tiny_config(model_type).max_position_embeddings)
    assert cfg.rotary_dim == rotated and cfg.rope_ntk_factor == 2.0
    assert cfg.rope_base == pytest.approx(cfg.rope_theta * 2.0 ** (rotated / (rotated - 2)), rel=1e-12)
    x = torch.randn(1, 1, 3, cfg.head_dim, dtype=torch.float64)
    rope = Rope(torch.arange(3)[None], cfg.rotary_dim, cfg.rope_base)
    turned = rope.apply(x)
    assert torch.equal(turned[..., rotated:], x[..., rotated:])
    angle = 2 * cfg.rope_base ** (-2 * 0 / rotated)  # position 2, first frequency
    first, partner = x[0, 0, 2, 0], x[0, 0, 2, rotated // 2]
    torch.testing.assert_close(turned[0, 0, 2, 0], first * math.cos(angle) - partner * math.sin(angle))


@pytest.mark.parametrize("fields, refused", [
    (dict(n_group=4), None), (dict(n_group=8), "leaves 1 per group"),  # 8 experts: 2 a group, then 1
    (dict(topk_group=4), None), (dict(topk_group=5), "topk_group=5 must be in [1, n_group=4]"),
    (dict(topk_group=0), "topk_group=0 must be in [1, n_group=4]"),
    (dict(topk_group=1, num_experts_per_tok=2), None), (dict(topk_group=1, num_experts_per_tok=3), "do not fit"),
])
def test_llada2_routing_fields_are_refused_exactly_past_their_bounds(fields, refused):
    if refused is None:
        tiny_config("llada2_moe", **fields)
        return
    with pytest.raises(ValueError, match=re.escape(refused)):
        tiny_config("llada2_moe", **fields)


@pytest.mark.parametrize("model_type, block_length, threshold", [
    ("llada", 32, None), ("Dream", 100, None), ("sdar", 4, None), ("llada2_moe", 4, 0.95), ("Fast_dLLM_Qwen", 4, None)])
def test_each_family_decodes_with_its_reference_block_length_and_threshold(model_type, block_length, threshold):
    """Unless told: LLaDA's blocks of 32 (at most the response), Dream's whole response, the config's
    block size on the block engine; a threshold of 0.95 for LLaDA2 only (its generate())."""
    qwen2 = model_type in ("Dream", "Fast_dLLM_Qwen")
    cfg = ModelConfig.from_dict({**QWEN2_RAW, "model_type": model_type, "bd_size": 4}) if qwen2 else tiny_config(
        model_type)
    assert default_block_length(cfg, 100) == block_length
    assert default_block_length(cfg, 8) == (8 if model_type in ("llada", "Dream") else 4)
    assert default_threshold(cfg) == threshold


def test_with_context_only_ever_stretches_the_rope():
    """A config already stretched past a length keeps its stretch (a shorter context would shrink the
    positions it was asked to cover); a longer one stretches it further."""
    cfg = tiny_config("sdar")
    trained = cfg.max_position_embeddings
    stretched = cfg.with_context(4 * trained)
    assert stretched.rope_ntk_factor == 4.0 and stretched.context_length == 4 * trained
    assert stretched.with_context(2 * trained) == stretched
    assert stretched.with_context(8 * trained).rope_ntk_factor == 8.0


@pytest.mark.parametrize("length", [384, 576, 947])
def test_with_context_stretches_to_a_length_between_multiples_of_the_trained_one(length):
    """The NTK factor is the length over the trained context, not its whole multiples: 1.5 times the
    trained 256 positions gets factor 1.5 and a context of exactly that length (a power-of-two trained
    length, so no rounding), and so does any length past it."""
    cfg = tiny_config("sdar")
    assert cfg.max_position_embeddings == 256
    stretched = cfg.with_context(length)
    assert stretched.rope_ntk_factor == length / 256 and stretched.context_length == length


def test_with_context_covers_the_length_at_trained_lengths_not_a_power_of_two():
    """Stretched to any length, the context holds it: length / 100 rounded down would leave 113 tokens of
    100 trained positions a context of 112."""
    cfg = dataclasses.replace(tiny_config("sdar"), max_position_embeddings=100)
    assert all(cfg.with_context(length).context_length >= length for length in range(100, 1000))
    assert cfg.with_context(113).context_length == 113


def test_a_families_stop_id_fits_the_vocabulary_only_below_its_size():
    """A documented stop id is kept only where it is a token of the vocabulary (ids 0..vocab_size - 1):
    at vocab_size 151645 Dream keeps 151643 and drops 151645, one more token keeps both."""
    raw = {**QWEN2_RAW, "model_type": "Dream"}
    assert ModelConfig.from_dict({**raw, "vocab_size": 151645}).eos_token_ids == (151643,)
    assert ModelConfig.from_dict({**raw, "vocab_size": 151646}).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("raw", [
    {**QWEN2_RAW, "model_type": "Dream", "num_key_value_heads": 0},
    dict(model_type="llada", d_model=32, n_layers=1, n_heads=4, n_kv_heads=0, mlp_hidden_size=64, vocab_size=300),
])
def test_a_kv_head_count_of_zero_is_refused_not_taken_for_absent(raw):
    """A field given as 0 is refused by name; only an absent (or null) KV-head count defaults to the
    head count."""
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1, got 0"):
        ModelConfig.from_dict(raw)
    absent = {name: value for name, value in raw.items() if name not in ("num_key_value_heads", "n_kv_heads")}
    assert ModelConfig.from_dict(absent).num_kv_heads == 4


def test_llada2_chooses_experts_with_the_expert_bias_unless_the_config_turns_it_off():
    """BailingMoeV2's router adds its learned expert bias to the choice by default
    (moe_router_enable_expert_bias absent); only an explicit false leaves it out."""
    raw = dict(model_type="llada2_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
               intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, vocab_size=300)
    assert ModelConfig.from_dict(raw).moe.expert_bias is True
    assert ModelConfig.from_dict({**raw, "moe_router_enable_expert_bias": False}).moe.expert_bias is False
    assert ModelConfig.from_dict({**raw, "moe_router_enable_expert_bias": None}).moe.expert_bias is True  # absent


def test_llada_fields_given_as_null_take_their_defaults():
    """A null in LLaDA's config.json counts as absent, as in the other families: the default mask id,
    RoPE base, norm epsilon and trained length."""
    raw = dict(model_type="llada", d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64, vocab_size=300)
    nulls = dict.fromkeys(("mask_token_id", "rope_theta", "rms_norm_eps", "max_sequence_length"))
    assert ModelConfig.from_dict({**raw, **nulls}) == ModelConfig.from_dict(raw)


def test_rmsnorm_in_half_precision_casts_the_normed_row_then_weights_it():
    """RMSNorm in fp32, cast to the model's dtype, then the weight, as the references' RMSNorm
    (weight * normed.to(input_dtype)): the product of two bfloat16 factors, rounded once."""
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=generator))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(8, 64, generator=generator).to(torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(norm(x), norm.weight * normed)


@pytest.mark.parametrize("field", ["gen_length", "block_length", "steps"])
def test_a_generation_length_or_step_count_of_zero_is_refused(field):
    """gen_length, block_length and steps are positive integers: 0 is refused by name, 1 is taken."""
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
        GenerationConfig(**{field: 0})
    assert getattr(GenerationConfig(**{field: 1}), field) == 1


def test_a_tied_head_reads_the_embedding_as_it_is_loaded():
    """With tie_word_embeddings the LM head is the embedding matrix itself: weights written into the
    embedding (as the loader writes them) are the head's, the logits the normed hidden states times it."""
    model = Model(tiny_config("llada", weight_tying=True)).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=generator,
                                                    dtype=torch.float64))
    hidden = torch.randn(1, 3, model.cfg.hidden_size, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(model.head(hidden), model.norm(hidden) @ model.embed_tokens.weight.T)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Model(tiny_config("llada")).parameters(
        )) - model.embed_tokens.weight.numel()
