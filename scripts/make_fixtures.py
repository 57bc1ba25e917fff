"""Write the tiny parity fixtures under tests/fixtures/: small random checkpoints in the exact on-disk
format of each real family (the names nanodllm/loader.py maps), each with golden.safetensors holding
fixed input ids and the float32 logits Hugging Face transformers (an independent implementation)
computes for them under the family's mask; and the Qwen2 tokenizer goldens. Seeded, rerunnable.

    python scripts/make_fixtures.py                   # llada, sdar, dream, fast_dllm_v2 tiny (transformers 5.x)
    python scripts/make_fixtures.py moe               # llada2_tiny and sdar_moe_tiny (transformers 5.x)
    python scripts/make_fixtures.py qwen2_bpe         # tokenizers/qwen2_bpe/ (transformers 4.x's slow tokenizer)
    python scripts/make_fixtures.py diffusion_gemma   # diffusion_gemma_tiny (transformers 5.24)

Golden models run in float32, eager attention, on the bf16 weights upcast, positions 0..T-1 with T = 13
(not a multiple of the block size); custom masks go in as 4D additive float masks, each checked to take
effect before anything is written. Norm weights are random (not ones) so a mis-mapped norm shows. Dream
and Fast-dLLM v2 goldens are shifted as both decode (position i takes the logits of i - 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanodllm.cli import help_text, run_main  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"

BATCH, LENGTH = 2, 13
BLOCK = 4
VOCAB = 256
STORAGE_DTYPE = torch.bfloat16  # released LLaDA/SDAR checkpoints are bf16
MAX_FIXTURE_BYTES = 300 * 1024

# configs (real field names and the usual extra fields of the released config.json files)

LLADA_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64,
    "embedding_dropout": 0.0, "embedding_size": VOCAB, "eos_token_id": 251, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 250, "max_sequence_length": 4096, "mlp_hidden_size": 160,
    "mlp_ratio": 4,  # deliberately inconsistent with mlp_hidden_size (4 * 64 != 160): must be ignored
    "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2,
    "pad_token_id": 251, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
    "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": VOCAB, "weight_tying": False,
}
QWEN_FIELDS = {  # what SDAR's and Qwen2's (Dream's, Fast-dLLM v2's) config.json share
    "attention_dropout": 0.0, "eos_token_id": 251, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 160, "mask_token_id": 250, "max_window_layers": 2, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB,
}
SDAR_CONFIG = {
    **QWEN_FIELDS, "architectures": ["SDARForCausalLM"], "attention_bias": False,
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "block_size": BLOCK, "bos_token_id": 252, "head_dim": 16, "max_position_embeddings": 40960, "model_type": "sdar",
    "rope_theta": 1000000, "transformers_version": "4.52.4",
}
QWEN2_CONFIG = {**QWEN_FIELDS, "bos_token_id": 251, "max_position_embeddings": 131072, "pad_token_id": 251,
                "rope_theta": 1000000.0, "transformers_version": "4.46.2"}
DREAM_CONFIG = {
    **QWEN2_CONFIG, "architectures": ["DreamModel"], "model_type": "Dream",
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
}
FAST_DLLM_V2_CONFIG = {
    **QWEN2_CONFIG, "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": BLOCK, "model_type": "Fast_dLLM_Qwen",
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
}

# The mixture-of-experts families, both 3 layers of width 32 with 16 experts of width 16, 4 per token.
MOE_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "norm_topk_prob": True,
             "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 3, "output_router_logits": False}
# LLaDA2's config.json as released (BailingMoeV2 field names) plus block_size and mask_token_id, which the
# tiny vocabulary and the 13-token input need (the released model decodes blocks of 32 with mask 156895).
# Its router: 16 experts in 4 groups, 2 groups kept.
LLADA2_CONFIG = {
    **MOE_SHAPE, "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "block_size": BLOCK, "embedding_dropout": 0.0, "eos_token_id": 251, "first_k_dense_replace": 1, "head_dim": 16,
    "hidden_act": "silu", "initializer_range": 0.02, "mask_token_id": 250, "max_position_embeddings": 32768,
    "max_window_layers": 3, "model_type": "llada2_moe", "moe_router_enable_expert_bias": True, "n_group": 4,
    "norm_head": False, "norm_softmax": False, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_shared_experts": 1, "output_dropout": 0.0, "pad_token_id": 251, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000, "routed_scaling_factor": 2.5,
    "router_dtype": "fp32", "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 2,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.3", "use_bias": False, "use_cache": True,
    "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True, "vocab_size": VOCAB,
}
# SDAR-30B-A3B: SDAR's fields plus Qwen3-MoE's. Layer 1 is dense (mlp_only_layers) to exercise the rule.
SDAR_MOE_CONFIG = {
    **SDAR_CONFIG, **MOE_SHAPE, "architectures": ["SDARMoeForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig", "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                 "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "model_type": "sdar_moe", "router_aux_loss_coef": 0.001,
}

# LLaDA's config.json fields (values) under the names transformers' Llama and Qwen configs share (keys)
LLADA_FIELDS = {"vocab_size": "embedding_size", "hidden_size": "d_model", "intermediate_size": "mlp_hidden_size",
                "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                "max_position_embeddings": "max_sequence_length", "rms_norm_eps": "rms_norm_eps",
                "rope_theta": "rope_theta"}
# LLaDA's checkpoint names of Llama's modules: model.transformer.<name>, in layer i model.transformer.blocks.<i>.<name>
LLADA_MODULES = {"model.embed_tokens": "wte", "model.norm": "ln_f", "lm_head": "ff_out",
                 "input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
                 "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out", "post_attention_layernorm": "ff_norm",
                 "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}


def qwen_shape(c: dict) -> dict:
    """A config.json's shape fields as transformers' Llama and Qwen configs name them (LLaDA's renamed), head_dim
    among them."""
    names = LLADA_FIELDS if c["model_type"] == "llada" else {field: field for field in LLADA_FIELDS}
    shape = {field: c[name] for field, name in names.items()}
    return {**shape, "head_dim": c.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]}


# random weights


def _linear(gen, out_features, in_features, gain=1.0):
    return torch.randn(out_features, in_features, generator=gen) * (gain / in_features**0.5)


def _norm(gen, dim):
    return 0.5 + torch.rand(dim, generator=gen)  # in [0.5, 1.5): never all ones


def _swiglu(gen, prefix, d, f) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's gate, up and down weights, drawn in that order."""
    return {f"{prefix}gate_proj.weight": _linear(gen, f, d), f"{prefix}up_proj.weight": _linear(gen, f, d),
            f"{prefix}down_proj.weight": _linear(gen, d, f)}


def qwen_weights(gen, config: dict, qk_norm=False, qkv_bias=False, qk_gain=1.0) -> dict[str, torch.Tensor]:
    """Llama-named tensors of config in the order the real shards hold them: with Qwen3's q/k norms (qk_norm)
    or Qwen2's q/k/v biases (qkv_bias); LLaDA's q and k drawn sharper (qk_gain 2) so that masks matter more."""
    c = qwen_shape(config)
    d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    w = {"model.embed_tokens.weight": torch.randn(v, d, generator=gen)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _norm(gen, d)
        w[p + "self_attn.q_proj.weight"] = _linear(gen, q, d, qk_gain)
        w[p + "self_attn.k_proj.weight"] = _linear(gen, kv, d, qk_gain)
        w[p + "self_attn.v_proj.weight"] = _linear(gen, kv, d)
        w[p + "self_attn.o_proj.weight"] = _linear(gen, d, q)
        if qkv_bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.5 * torch.randn(size, generator=gen)
        if qk_norm:
            # q/k norm weights scale q.k directly (q/k are RMS-normalised per head): ~2 gives peaked attention
            w[p + "self_attn.q_norm.weight"] = 2 * _norm(gen, hd)
            w[p + "self_attn.k_norm.weight"] = 2 * _norm(gen, hd)
        w[p + "post_attention_layernorm.weight"] = _norm(gen, d)
        w.update(_swiglu(gen, p + "mlp.", d, f))
    w["model.norm.weight"] = _norm(gen, d)
    w["lm_head.weight"] = _linear(gen, v, d)
    return {k: t.to(STORAGE_DTYPE).contiguous() for k, t in w.items()}


def llada_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama-named tensors under LLaDA's checkpoint names, in the same order."""
    renamed = {}
    for name, tensor in weights.items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        module = f"blocks.{layer[1]}.{LLADA_MODULES[layer[2]]}" if layer else LLADA_MODULES[name[:-len(".weight")]]
        renamed[f"model.transformer.{module}.weight"] = tensor
    return renamed


def moe_weights(gen, prefix: str, c: dict, expert_bias=False) -> dict[str, torch.Tensor]:
    """A sharp router (with an expert bias large enough to change the choice), then one gate/up/down tensor per
    expert, as the released MoE checkpoints store them."""
    w = {prefix + "gate.weight": _linear(gen, c["num_experts"], c["hidden_size"], gain=3.0)}
    if expert_bias:
        w[prefix + "gate.expert_bias"] = 0.3 * torch.randn(c["num_experts"], generator=gen)
    for e in range(c["num_experts"]):
        w.update(_swiglu(gen, f"{prefix}experts.{e}.", c["hidden_size"], c["moe_intermediate_size"]))
    return w


def llada2_weights(gen) -> dict[str, torch.Tensor]:
    """LLaDA2 tensors: fused query_key_value, q/k layernorms, layer 0 dense, then MoE layers with a shared expert."""
    c = LLADA2_CONFIG
    d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    w = {"model.word_embeddings.weight": torch.randn(v, d, generator=gen)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _norm(gen, d)
        w[p + "attention.query_key_value.weight"] = _linear(gen, q + 2 * kv, d)
        w[p + "attention.query_layernorm.weight"] = 2 * _norm(gen, hd)
        w[p + "attention.key_layernorm.weight"] = 2 * _norm(gen, hd)
        w[p + "attention.dense.weight"] = _linear(gen, d, q)
        w[p + "post_attention_layernorm.weight"] = _norm(gen, d)
        if i < c["first_k_dense_replace"]:
            w.update(_swiglu(gen, p + "mlp.", d, f))
        else:
            w.update(moe_weights(gen, p + "mlp.", c, expert_bias=True))
            w.update(_swiglu(gen, p + "mlp.shared_experts.", d, c["moe_intermediate_size"] * c["num_shared_experts"]))
    w["model.norm.weight"] = _norm(gen, d)
    w["lm_head.weight"] = _linear(gen, v, d)
    return {k: t.to(STORAGE_DTYPE).contiguous() for k, t in w.items()}


def sdar_moe_weights(gen) -> dict[str, torch.Tensor]:
    """Qwen3-MoE tensors: SDAR's (all drawn), then each sparse layer's MLP replaced by a router and its experts."""
    c = SDAR_MOE_CONFIG
    w = qwen_weights(gen, c, qk_norm=True)
    for i in range(c["num_hidden_layers"]):
        if i not in c["mlp_only_layers"]:
            p = f"model.layers.{i}.mlp."
            for name in ("gate_proj", "up_proj", "down_proj"):
                del w[p + name + ".weight"]
            w.update(moe_weights(gen, p, c))
    return {k: t.to(STORAGE_DTYPE).contiguous() for k, t in w.items()}


# writing


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})  # one key: safetensors orders metadata keys arbitrarily


def write_json(path: Path, data, **options) -> None:
    path.write_text(json.dumps(data, **options) + "\n")


def write_sharded(out: Path, weights: dict[str, torch.Tensor], num_shards: int = 2) -> None:
    """Split in order at (about) equal bytes, like HF's save_pretrained(max_shard_size=...); read back."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    running = 0
    for name, tensor in weights.items():
        shards[min(num_shards - 1, running * num_shards // total)][name] = tensor
        running += tensor.numel() * tensor.element_size()
    weight_map, reloaded = {}, {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save(shard, out / file)
        weight_map.update({name: file for name in shard})
        reloaded.update(load_file(str(out / file)))
    assert reloaded.keys() == weights.keys() and all(torch.equal(reloaded[k], weights[k]) for k in weights)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index, indent=2, sort_keys=True)


def fresh_dir(name: str) -> Path:
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def write_checkpoint(name: str, config: dict, weights: dict, tokenizer: str | None, ids, logits, sharded=False):
    """A fixture folder: config.json, the weights (sharded: in two files), the word-level tokenizer of the family
    (None: none) and golden.safetensors."""
    out = fresh_dir(name)
    write_json(out / "config.json", config, indent=2, sort_keys=True)
    if sharded:
        write_sharded(out, weights)
    else:
        save(weights, out / "model.safetensors")
    if tokenizer:
        write_tokenizer(out, tokenizer, config["mask_token_id"], config["eos_token_id"])
    positions = torch.arange(ids.shape[1])[None].expand_as(ids).contiguous()
    save({"input_ids": ids.contiguous(), "positions": positions, "logits": logits.float().contiguous()},
         out / "golden.safetensors")


def report_sizes(names, limit: int = MAX_FIXTURE_BYTES) -> int:
    for name in names:
        folder = FIXTURES / name
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        print(f"{name}: {size} bytes ({', '.join(sorted(p.name for p in folder.iterdir()))})")
        assert size < limit, f"{name} is {size} bytes, over {limit}"
    return 0


# golden logits: transformers' models (an LLaDA2 forward transcribed here) under masks checked to take effect


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, q, k] (True = may attend) -> float32 additive mask for eager attention."""
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def block_causal_allowed(batch: int, length: int, block: int) -> torch.Tensor:
    """May attend: the keys of the query's block and of earlier ones (block = length: bidirectional)."""
    pos = torch.arange(length)
    allowed = (pos[None, :] // block) <= (pos[:, None] // block)  # [q, k]
    return allowed[None, None].expand(batch, 1, length, length).clone()


def hf_causal_lm(name: str, state: dict[str, torch.Tensor], config: dict, **fields):
    """transformers' <name>ForCausalLM in float32, eager attention (and experts), holding state (in its names,
    loaded strictly: biases are there or not as in the weights), shaped by qwen_shape(config) and fields; its
    RoPE checked to be plain over the whole head at config's theta."""
    import transformers

    shape = qwen_shape(config)
    theta = float(shape.pop("rope_theta"))
    hf_config = getattr(transformers, f"{name}Config")(
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=False,
        use_cache=False, use_sliding_window=False, **shape, **fields)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    model = getattr(transformers, f"{name}ForCausalLM")(hf_config).float().eval()
    model.load_state_dict({k: t.float() for k, t in state.items()}, strict=True)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "head got tied"
    rotary_dim = shape["head_dim"]
    expected = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    got = model.model.rotary_emb.inv_freq
    assert torch.allclose(got, expected), f"transformers built RoPE with another theta: {got} vs {expected}"
    assert model.model.rotary_emb.attention_scaling == 1.0
    return model


def fused_experts(weights: dict[str, torch.Tensor], prefix: str, count: int) -> dict[str, torch.Tensor]:
    """transformers' expert layout: experts.gate_up_proj [experts, 2 * size, hidden] (gate rows, then up) and
    experts.down_proj [experts, hidden, size]."""
    def get(e, name):
        return weights[f"{prefix}experts.{e}.{name}.weight"].float()

    return {"experts.gate_up_proj": torch.stack([torch.cat([get(e, "gate_proj"), get(e, "up_proj")])
                                                 for e in range(count)]),
            "experts.down_proj": torch.stack([get(e, "down_proj") for e in range(count)])}


def hf_qwen3_moe(weights: dict[str, torch.Tensor]):
    """transformers' Qwen3MoeForCausalLM holding the SDAR-MoE weights, each layer's experts fused."""
    c = SDAR_MOE_CONFIG
    state = {k: t for k, t in weights.items() if ".experts." not in k}
    for i in range(c["num_hidden_layers"]):
        if i not in c["mlp_only_layers"]:
            prefix = f"model.layers.{i}.mlp."
            state.update({prefix + name: t for name, t in fused_experts(weights, prefix, c["num_experts"]).items()})
    return hf_causal_lm("Qwen3Moe", state, c, **{k: c[k] for k in (
        "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
        "mlp_only_layers")})


def hf_deepseek_v3_moe(weights: dict[str, torch.Tensor], layer: int, group_limit: bool = True, bias: bool = True):
    """transformers' DeepseekV3MoE (the same router: group-limited sigmoid choice with a bias, unbiased
    weights normalised and scaled; plus a shared expert) holding one LLaDA2 MoE layer, in float32.
    group_limit=False and bias=False give the router without either, to show both matter."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    c = LLADA2_CONFIG
    config = DeepseekV3Config(
        hidden_size=c["hidden_size"], moe_intermediate_size=c["moe_intermediate_size"],
        n_routed_experts=c["num_experts"], n_shared_experts=c["num_shared_experts"],
        num_experts_per_tok=c["num_experts_per_tok"], routed_scaling_factor=c["routed_scaling_factor"],
        n_group=c["n_group"] if group_limit else 1, topk_group=c["topk_group"] if group_limit else 1,
        norm_topk_prob=True, hidden_act="silu",
    )
    config._experts_implementation = "eager"
    moe = DeepseekV3MoE(config).float().eval()
    p = f"model.layers.{layer}.mlp."
    state = {"gate.weight": weights[p + "gate.weight"].float(),
             "gate.e_score_correction_bias": weights[p + "gate.expert_bias"].float() * bias,
             **fused_experts(weights, p, c["num_experts"]),
             **{f"shared_experts.{n}.weight": weights[p + f"shared_experts.{n}.weight"].float()
                for n in ("gate_proj", "up_proj", "down_proj")}}
    moe.load_state_dict(state, strict=True)
    return moe


def llada2_logits(weights: dict[str, torch.Tensor], ids: torch.Tensor, allowed: torch.Tensor, **router) -> torch.Tensor:
    """LLaDA2's forward transcribed from its modeling file, in float32: fused q/k/v rows, per-head q/k
    RMSNorm, rotate-half RoPE on the first partial_rotary_factor * head_dim dims (frequencies over that
    width), eager attention with an additive mask; layer 0 a SwiGLU MLP, the others DeepseekV3MoE."""
    c = LLADA2_CONFIG
    w = {k: t.float() for k, t in weights.items()}
    heads, kv_heads, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    rotary = int(hd * c["partial_rotary_factor"])
    b, t = ids.shape
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):
        rot, rest = x[..., :rotary], x[..., rotary:]
        half = torch.cat([-rot[..., rotary // 2:], rot[..., : rotary // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)

    x = w["model.word_embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = (rms(x, w[p + "input_layernorm.weight"]) @ w[p + "attention.query_key_value.weight"].T)
        qkv = qkv.view(b, t, heads + 2 * kv_heads, hd).transpose(1, 2)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        q = rope(rms(q, w[p + "attention.query_layernorm.weight"]))
        k = rope(rms(k, w[p + "attention.key_layernorm.weight"]))
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
        scores = q @ k.transpose(-1, -2) * hd**-0.5 + additive(allowed)
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * hd)
        x = x + o @ w[p + "attention.dense.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if i < c["first_k_dense_replace"]:
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        else:
            x = x + hf_deepseek_v3_moe(weights, i, **router)(h)
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def hf_logits(model, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    out = model(input_ids=ids, attention_mask=additive(allowed), position_ids=positions, use_cache=False)
    return out.logits.float()


def golden_logits(forward, ids: torch.Tensor, block: int) -> torch.Tensor:
    """forward(ids, allowed)'s logits under the mask of blocks of `block` (LENGTH: bidirectional), checked to take
    effect: the same again; an edit of any token changes its own block (earlier positions in it too) and the later
    ones but no earlier block; the bidirectional and the causal mask give other logits."""
    b, t = ids.shape
    allowed = block_causal_allowed(b, t, block)
    logits = forward(ids, allowed)
    assert torch.equal(forward(ids, allowed), logits), "not deterministic on this input"
    for edit_at in range(t):
        edited = ids.clone()
        edited[:, edit_at] = (edited[:, edit_at] + 1) % VOCAB
        changed = (forward(edited, allowed) - logits).abs().amax(-1) > 1e-5  # [b, t]
        block_start = edit_at // block * block
        assert not changed[:, :block_start].any(), f"editing {edit_at} changed an earlier block: {changed}"
        assert changed[:, block_start:].all(), f"editing {edit_at} left later/same-block positions: {changed}"
    for other in sorted({1, t} - {block}):
        moved = (forward(ids, block_causal_allowed(b, t, other)) - logits).abs().max()
        assert moved > 1e-2, f"blocks of {other} give the same logits ({moved:.2e}): mask ignored"
    return logits


def draw(seed: int, weights_fn) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A family's weights, then its input ids, from one generator."""
    gen = torch.Generator().manual_seed(seed)
    weights = weights_fn(gen)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    ids[0, 9:] = LLADA_CONFIG["mask_token_id"]  # some masked positions, as in diffusion decoding
    ids[1, 5:7] = LLADA_CONFIG["mask_token_id"]
    return weights, ids


# A word-level tokenizer whose ids fit the fixtures' 256-token vocabulary, so the demo and the
# tokenizer code run end to end on them (the models are random: their text is noise).
SPECIAL_TOKENS = {
    "llada": ["<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "sdar": ["<|im_start|>", "<|im_end|>"],
    "llada2_moe": ["<|startoftext|>", "<role>", "</role>", "<|role_end|>"],
}
WORDS = ("user assistant system what is the capital of france paris a an and or not to in on at for with "
         "this that it be are was were one two three four five six seven eight nine ten hello world "
         "question answer key value number find say tell me you we they he she").split()
GEMMA_TOKENS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105,
                "<turn|>": 106}  # Gemma 4's ids


def write_tokenizer(out: Path, family: str, mask_id: int = 0, eos_id: int = 0) -> None:
    """tokenizer.json: WORDS after [UNK], the family's special tokens at 240 on, its mask and eos tokens at
    mask_id and eos_id; or (family "gemma") WORDS after Gemma 4's special tokens, at their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if family == "gemma":
        free = (i for i in range(len(GEMMA_TOKENS), VOCAB) if i not in GEMMA_TOKENS.values())
        vocab = {**GEMMA_TOKENS, **dict(zip(WORDS + ["model", "thought", ".", ",", "?", "!"], free))}
        unk, specials = "<unk>", list(GEMMA_TOKENS)
    else:
        vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS + [".", ",", "?", "!"])}}
        specials = SPECIAL_TOKENS[family] + ["<|mdm_mask|>" if family == "llada" else "<|MASK|>", "<|endoftext|>"]
        for offset, token in enumerate(SPECIAL_TOKENS[family]):
            vocab[token] = 240 + offset
        vocab[specials[-2]], vocab[specials[-1]] = mask_id, eos_id
        unk = "[UNK]"
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(out / "tokenizer.json"))


DENSE = [  # folder, config.json, seed, transformers' class, qwen_weights' options, block (LENGTH: bidirectional),
    # tokenizer (None: none)
    ("llada_tiny", LLADA_CONFIG, 1234, "Llama", {"qk_gain": 2.0}, LENGTH, "llada"),
    ("sdar_tiny", SDAR_CONFIG, 5678, "Qwen3", {"qk_norm": True}, BLOCK, "sdar"),
    ("dream_tiny", DREAM_CONFIG, 91011, "Qwen2", {"qkv_bias": True}, LENGTH, None),
    ("fast_dllm_v2_tiny", FAST_DLLM_V2_CONFIG, 121314, "Qwen2", {"qkv_bias": True}, BLOCK, None),
]


def write_models() -> int:
    """The dense families against transformers' Llama (LLaDA: its layers made bidirectional by the mask, its
    weights stored under its own names in two shards), Qwen3 (SDAR) and Qwen2 (Dream, Fast-dLLM v2)."""
    for name, config, seed, hf_class, options, block, tokenizer in DENSE:
        weights, ids = draw(seed, partial(qwen_weights, config=config, **options))
        logits = golden_logits(partial(hf_logits, hf_causal_lm(hf_class, weights, config)), ids, block)
        if config["model_type"] == "llada":
            weights = llada_names(weights)
        if config["model_type"] in ("Dream", "Fast_dLLM_Qwen"):  # position i takes the logits of i - 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        write_checkpoint(name, config, weights, tokenizer, ids, logits, sharded=name == "llada_tiny")
    return report_sizes([name for name, *_ in DENSE])


def write_moe_models() -> int:
    """llada2_tiny (sharded, against the transcribed float32 forward with DeepseekV3MoE layers) and
    sdar_moe_tiny (one file, against Qwen3MoeForCausalLM), both block-causal with blocks of 4."""
    weights, ids = draw(2468, llada2_weights)
    logits = golden_logits(partial(llada2_logits, weights), ids, BLOCK)
    for ablation in ({"group_limit": False}, {"bias": False}):  # the router's group limit and bias must both matter
        moved = (llada2_logits(weights, ids, block_causal_allowed(*ids.shape, BLOCK), **ablation) - logits).abs().max()
        assert moved > 1e-2, f"the router without {ablation} gives the same logits ({moved:.2e})"
    write_checkpoint("llada2_tiny", LLADA2_CONFIG, weights, "llada2_moe", ids, logits, sharded=True)
    weights, ids = draw(1357, sdar_moe_weights)
    logits = golden_logits(partial(hf_logits, hf_qwen3_moe(weights)), ids, BLOCK)
    write_checkpoint("sdar_moe_tiny", SDAR_MOE_CONFIG, weights, "sdar", ids, logits)
    return report_sizes(("llada2_tiny", "sdar_moe_tiny"))


# Qwen2 vocabulary (Dream, Fast-dLLM v2, SDAR) from vocab.json + merges.txt: golden encodings of the
# slow transformers tokenizer

QWEN2_BPE_VOCAB_SIZE = 400
QWEN2_BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what they'd say, isn't it? We're sure you'll see.",
    "Diffusion language models unmask many tokens in parallel; the answer is 42 and 1234 + 5678 = 6912.",
    "def tokenize(text):\n    return [token for token in text.split()]  # simple\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\u3002 "
    "Line one\r\nLine two\n\nHello   world!",
]
QWEN2_ADDED_TOKENS = (  # (content, special), ids after the vocabulary in this order
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
    ("<|beginoftext|>", True), ("<|mask|>", True),
)
QWEN2_GOLDEN_TEXTS = [
    "Hello world", " Hello world", "Hello  world", "   leading and trailing   ", "",
    "   ", "\n\n\n", "trailing newline\n", "line one\nline two\n\nline four", "windows\r\nline\r\n\r\nend",
    "tabs\tand\t\tmore \t tabs", "I'm sure you've seen they'll, we'd, she's, it's, we're",
    "I'M SURE YOU'VE SEEN IT'S", "don't'S can't've", "12345678901234567890", "3.14159 and 2,718 and 1e-9",
    "mixed123numbers456and789letters", "x\u00b2+y\u00b3=z\u2074 \u00bd \u2460 \u2167 \u0663\u0664",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9", "cafe\u0301 (combining accent: NFC composes it)",
    "\ufb01 ligature and \u212b (angstrom sign, NFC maps it to \u00c5)",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u8fd8\u6709\u6807\u70b9\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\ud55c\uad6d\uc5b4 \ubb38\uc7a5",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0438 \u0440\u0443\u0441\u0441\u043a\u0438\u0439",
    "emoji \U0001f642\U0001f44d\U0001f3fd and \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
    "\u00a0non-breaking\u00a0space\u3000ideographic", "a\u200bzero\u200dwidth", "\x00\x01 control \x7f",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more",
    "a<|mask|><|mask|>b", "<|beginoftext|>start", "  <|im_end|>  spaces around", "<|im_end", "<|im_end|>>",
    '<tool_call>{"name": "f"}</tool_call>', "def f(x):\n    return x ** 2  # square",
    "if (a != b) { return a->c; }", "https://example.com/path?q=1&r=2 email@example.org",
    "!!!???...--- $100.00 (50%) #tag @user", 'He said: "don\'t" \u2014 and \u2018left\u2019.',
    "supercalifragilisticexpialidocious",
]
# decoded from their byte tokens: each holds bytes that are no complete UTF-8 character
QWEN2_GOLDEN_BYTES = [b"\xf0\x9f", b"ab\xe4\xb8", b"\xff\xfe", b"\xe4\xb8\xad\xf0"]


def write_qwen2_bpe() -> int:
    """tokenizers/qwen2_bpe/: a byte-level BPE trained here with Qwen2's pre-tokenizer (its vocabulary
    files) and golden.json: what the slow Qwen2Tokenizer makes of varied strings and of ids ending inside
    a UTF-8 character."""
    import transformers
    from transformers import PreTrainedTokenizer, Qwen2Tokenizer

    if not issubclass(Qwen2Tokenizer, PreTrainedTokenizer):
        raise SystemExit("the qwen2_bpe step needs transformers 4.x, whose Qwen2Tokenizer is the slow python "
                         "tokenizer (5.x only has the tokenizers-backed one): pip install 'transformers<5'")
    out = fresh_dir("tokenizers/qwen2_bpe")
    vocab_size = write_qwen2_vocab(out)
    slow = Qwen2Tokenizer.from_pretrained(str(out))
    assert not slow.is_fast
    for offset, (token, _) in enumerate(QWEN2_ADDED_TOKENS):
        assert slow.convert_tokens_to_ids(token) == vocab_size + offset, token
    byte_ids = {byte: slow.encoder[char] for byte, char in slow.byte_encoder.items()}

    def case(ids: list[int], **fields) -> dict:
        return {**fields, "ids": ids, "decoded": slow.decode(ids),
                "decoded_skip_special": slow.decode(ids, skip_special_tokens=True)}

    golden = {
        "source": f"transformers {transformers.__version__} slow Qwen2Tokenizer on this directory "
                  "(scripts/make_fixtures.py qwen2_bpe)",
        "encode": [case(slow.encode(text, add_special_tokens=False), text=text) for text in QWEN2_GOLDEN_TEXTS],
        "decode": [case([byte_ids[b] for b in data]) for data in QWEN2_GOLDEN_BYTES],
    }
    write_json(out / "golden.json", golden, indent=1, ensure_ascii=False)
    return report_sizes(["tokenizers/qwen2_bpe"], limit=64 * 1024)


def write_qwen2_vocab(out: Path) -> int:
    """Train the byte-level BPE with Qwen2's pre-tokenizer; write its files. Returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=QWEN2_BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(QWEN2_BPE_CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    assert list(vocab.values()) == list(range(len(vocab))) and len(vocab) >= 256
    write_json(out / "vocab.json", vocab, ensure_ascii=False)
    merges = "".join(f"{left} {right}\n" for left, right in model["merges"])
    (out / "merges.txt").write_text("#version: 0.2\n" + merges)
    added = {str(len(vocab) + offset): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": special}
             for offset, (token, special) in enumerate(QWEN2_ADDED_TOKENS)}
    config = {  # additional_special_tokens: the slow tokenizer's skip_special_tokens drops only tokens named
        # there or in the *_token entries
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": "<|beginoftext|>",
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "mask_token": "<|mask|>", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    write_json(out / "tokenizer_config.json", config, indent=2)
    return len(vocab)


# DiffusionGemma: transformers' own classes (5.24's models/diffusion_gemma), their logits and KV cache

GEMMA_WINDOW, GEMMA_CANVAS, GEMMA_PROMPT = 8, 8, 13  # a prompt longer than the sliding window
GEMMA_STEPS = 12  # the most denoising steps per canvas in the generation goldens
GEMMA_CONFIG = {  # the released config.json's fields (global_head_dim, not transformers' per_layer_config)
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 255999, "canvas_length": GEMMA_CANVAS,
    "dtype": "bfloat16", "eoi_token_id": 258882, "eos_token_id": [1, 106], "image_token_id": 258880,
    "initializer_range": 0.02, "model_type": "diffusion_gemma", "tie_word_embeddings": True,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "dtype": "bfloat16", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "global_head_dim": 16, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "max_position_embeddings": 512, "model_type": "diffusion_gemma_text", "moe_intermediate_size": 8,
        "num_attention_heads": 4, "num_experts": 8, "num_global_key_value_heads": 1, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": GEMMA_WINDOW, "tie_word_embeddings": True, "top_k_experts": 2,
        "use_bidirectional_attention": "vision", "vocab_size": VOCAB},
    "vision_config": {"global_head_dim": 8, "head_dim": 8, "hidden_size": 16, "intermediate_size": 32,
                      "model_type": "gemma4_vision", "num_attention_heads": 2, "num_hidden_layers": 1,
                      "num_key_value_heads": 2, "patch_size": 4, "pooling_kernel_size": 1,
                      "position_embedding_size": 8},
}


def write_diffusion_gemma() -> int:
    """diffusion_gemma_tiny: DiffusionGemmaForBlockDiffusion with random weights (norms, router scales and both
    sets of layer scalars away from their initial ones), saved by save_pretrained in bf16 beside the released
    config.json, reloaded from there; golden.safetensors holds what it computes in float32 (eager attention and
    experts): the logits of a prefill + denoise step, a self-conditioned step, and a step after an encoder pass
    over a committed canvas, and every layer's cache after the prefill and after the commit; a word-level
    tokenizer in Gemma 4's special ids. Run with transformers 5.24 outside the venv: PYTHONPATH=<its --target
    folder>."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

    gen = torch.Generator().manual_seed(2626)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**GEMMA_CONFIG)).eval()
    for name, param in sorted(model.named_parameters()):
        std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5  # logits of scale ~20 (cap 30)
        drawn = torch.randn(param.shape, generator=gen)
        param.copy_(1 + 0.3 * drawn if param.dim() == 1 or "scale" in name else std * drawn)
    # a contracting self-conditioning loop: at full gain float32 rounding grows tenfold a step and decides the
    # tokens, so that another CPU's BLAS would decode others; at a tenth it stays in the logits' last digits
    model.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("layer_scalar"):
            buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
    out = fresh_dir("diffusion_gemma_tiny")
    model.to(STORAGE_DTYPE).save_pretrained(out)
    write_json(out / "config.json", GEMMA_CONFIG, indent=2, sort_keys=True)
    (out / "generation_config.json").unlink()  # transformers' all-null one; the released defaults are the loop's
    write_tokenizer(out, "gemma")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=torch.float32).eval()
    text, layers = model.config.text_config, model.model.decoder.layers
    assert text.per_layer_config[1].head_dim == 16 and text.per_layer_config[1].num_key_value_heads == 1
    assert model.model.encoder.language_model.layers[0].mlp.up_proj.weight is layers[0].mlp.up_proj.weight
    encoder_scalars = [layer.layer_scalar for layer in model.model.encoder.language_model.layers]
    assert all((e != d.layer_scalar).all() and (e != 1).all() for e, d in zip(encoder_scalars, layers))

    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    golden = gemma_golden(model, DynamicCache, gen)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("grouped_mm")
    again = gemma_golden(model, DynamicCache, torch.Generator().manual_seed(0), golden)
    for name in golden:  # within float32 noise of the goldens (logits of scale ~20)
        assert (again[name].float() - golden[name].float()).abs().max() < 2e-4, f"sdpa / grouped_mm differ: {name}"
    assert golden["prefill.keys.0"].shape[2] == golden["commit.keys.0"].shape[2] == GEMMA_WINDOW - 1
    assert golden["commit.keys.1"].shape[2] == GEMMA_PROMPT + GEMMA_CANVAS
    save({name: tensor.contiguous() for name, tensor in golden.items()}, out / "golden.safetensors")
    model.set_attn_implementation("eager")  # the path whose logits nanodllm's equal bit for bit
    model.set_experts_implementation("eager")
    runs = gemma_generations(model, golden["prompt"].tolist())
    write_json(out / "generate.json", runs, indent=1, sort_keys=True)
    return report_sizes(["diffusion_gemma_tiny"])


GEMMA_SAMPLER_DEFAULTS = {"entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
                          "confidence_threshold": 0.005}  # the released generation_config.json


def gemma_generations(model, prompts: list[list[int]]) -> dict:
    """What generate() makes of the two golden prompts (13 tokens, over the sliding window of 8), 12 steps at
    most per canvas: its tokens, tokens per forward, each row's steps per canvas, and its sampler's units:
    each step's temperature, accepted positions and stop decisions (the stable-and-confident rule's, before
    a done row's are discarded). Runs: `sampled` (torch.manual_seed: the first seed where one row stops a
    canvas before the other), `deterministic` (torch.multinomial patched to an argmax, the canvas noise drawn
    from a seeded generator), `early_stop` (no stability wait, a confidence every row meets within a few steps,
    a stop token inside row 0's second canvas), `ragged` (row 1 cut to 10 tokens, left-padded). `stop_rule`:
    the rule itself on a made-up argmax sequence."""
    from unittest import mock

    from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf_model

    def run(prompts, seed, canvases, deterministic=False, stop_ids=(1, 106), **sampler):
        knobs = {**GEMMA_SAMPLER_DEFAULTS, **sampler}
        trace = {"temperatures": [], "accepted": [], "stops": [], "finished": []}
        accept, stop, finish = (hf.EntropyBoundSampler.accept_canvas, hf.StableAndConfidentStoppingCriteria.__call__,
                                hf.DiffusionGemmaGenerationMixin._finalize_canvas)

        def recorded_accept(self, current, drawn, logits, step):
            temperature = knobs["t_min"] + (knobs["t_max"] - knobs["t_min"]) * (step / GEMMA_STEPS)  # float32
            trace["temperatures"].append(float(temperature))
            out = accept(self, current, drawn, logits, step)
            trace["accepted"].append(["".join(map(str, row)) for row in self.accepted_token_mask.int().tolist()])
            return out

        def recorded_stop(self, argmax, logits, **kwargs):
            decision = stop(self, argmax, logits, **kwargs)
            trace["stops"].append(decision.tolist())
            return decision

        def recorded_finish(*args, **kwargs):
            ids, finished = finish(*args, **kwargs)
            trace["finished"].append(finished.tolist())
            return ids, finished

        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        noise = torch.Generator().manual_seed(seed)
        mixin = hf.DiffusionGemmaGenerationMixin
        patches = [mock.patch.object(hf.EntropyBoundSampler, "accept_canvas", recorded_accept),
                   mock.patch.object(hf.StableAndConfidentStoppingCriteria, "__call__", recorded_stop),
                   mock.patch.object(mixin, "_finalize_canvas", staticmethod(recorded_finish))]
        decoder_mask = hf_model.DiffusionGemmaDecoderModel.create_diffusion_decoder_attention_mask
        float_mask = lambda config, inputs_embeds, **kwargs: decoder_mask(config, inputs_embeds.float(), **kwargs)
        patches.append(mock.patch.object(hf_model.DiffusionGemmaDecoderModel, "create_diffusion_decoder_attention_mask",
                                         staticmethod(float_mask)))  # 5.24 asks an integer dtype of the eager mask
        if deterministic:
            patches += [mock.patch.object(torch, "multinomial", lambda p, *n, **k: p.argmax(-1, keepdim=True)),
                        mock.patch.object(hf.EntropyBoundSampler, "initialize_canvas", lambda self, batch_size, device:
                                          torch.randint(0, self.vocab_size, (batch_size, self.canvas_length),
                                                        generator=noise, device=device))]
        torch.manual_seed(seed)
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=canvases * GEMMA_CANVAS,
                                 max_denoising_steps=GEMMA_STEPS, eos_token_id=list(stop_ids), pad_token_id=0,
                                 sampler_config=hf.EntropyBoundSamplerConfig(entropy_bound=knobs["entropy_bound"]),
                                 **{k: v for k, v in knobs.items() if k != "entropy_bound"})
        return {"prompts": prompts, "seed": seed, "canvases": canvases, "deterministic": deterministic,
                "stop_ids": list(stop_ids), "sampler": knobs, "sequences": out.sequences[:, width:].tolist(),
                "tokens_per_forward": out.tokens_per_forward.tolist(), **trace}

    one_row_stops = lambda r: any(sum(finished) == 1 for finished in r["finished"][:-1])
    sampled = next(r for r in (run(prompts, seed, 3) for seed in range(100)) if one_row_stops(r))
    runs = {"sampled": sampled, "deterministic": run(prompts, 1, 3, deterministic=True)}
    early = dict(seed=3, canvases=4, stability_threshold=0, confidence_threshold=0.6)
    free = run(prompts, stop_ids=(), **early)["sequences"]  # a stop token inside row 0's second canvas, nowhere else
    stop = next(t for t in free[0][GEMMA_CANVAS + 3:2 * GEMMA_CANVAS]
                if t not in free[0][:GEMMA_CANVAS + 3] and t not in free[1])
    runs["early_stop"] = run(prompts, stop_ids=(stop,), **early)
    runs["ragged"] = run([prompts[0], prompts[1][3:]], 4, 3)
    sequence = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 5]], [[1, 2], [3, 5]], [[1, 2], [3, 5]], [[1, 2], [6, 5]]])
    logits = torch.zeros(2, 2, VOCAB)  # uniform: every row confident under a threshold above log(VOCAB)
    rule = {}
    for threshold in (0, 1, 2):
        criterion = hf.StableAndConfidentStoppingCriteria(stability_threshold=threshold, confidence_threshold=6.0)
        rule[str(threshold)] = [criterion(argmax, logits).tolist() for argmax in sequence]
    runs["stop_rule"] = {"argmax": sequence.tolist(), "stops": rule}
    return runs


def gemma_golden(model, cache_class, gen, ids: dict | None = None) -> dict[str, torch.Tensor]:
    """The inputs (drawn from gen, or `ids`' own) and what model computes for them, by name."""
    draw = lambda length: torch.randint(0, VOCAB, (BATCH, length), generator=gen)
    ids = ids or {"prompt": draw(GEMMA_PROMPT), "canvas": draw(GEMMA_CANVAS), "renoised": draw(GEMMA_CANVAS),
                  "next_canvas": draw(GEMMA_CANVAS)}
    result = {name: ids[name] for name in ("prompt", "canvas", "renoised", "next_canvas")}
    snapshot = lambda when, cache: {f"{when}.{kind}.{i}": getattr(layer, kind).clone()
                                    for i, layer in enumerate(cache.layers) for kind in ("keys", "values")}
    cache = cache_class(config=model.config.text_config)
    first = model(input_ids=ids["prompt"], cache=cache, decoder_input_ids=ids["canvas"]).logits
    result.update(snapshot("prefill", cache), first_step=first)
    conditioning = ids.get("first_step", first)  # the golden's own: each step's noise alone, not compounded
    second = model(cache=cache, decoder_input_ids=ids["renoised"], self_conditioning_logits=conditioning).logits
    result["committed"] = ids.get("committed", second.argmax(-1))
    model.model.encoder(input_ids=result["committed"], cache=cache)  # at the positions the canvas had
    after = model(cache=cache, decoder_input_ids=ids["next_canvas"]).logits
    assert (model(cache=cache, decoder_input_ids=ids["next_canvas"], self_conditioning_logits=first).logits
            - after).abs().max() > 1e-2, "self-conditioning takes effect"
    return {**result, **snapshot("commit", cache), "self_conditioned_step": second, "step_after_commit": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", nargs="?", choices=("models", "moe", "qwen2_bpe", "diffusion_gemma"), default="models",
                        help="models: the four dense tiny checkpoints; moe: llada2_tiny and sdar_moe_tiny "
                             "(both transformers 5.x); qwen2_bpe: the tokenizer goldens (transformers 4.x); "
                             "diffusion_gemma: diffusion_gemma_tiny (transformers 5.24)")
    step = parser.parse_args().step
    torch.manual_seed(0)  # transformers' initialisation, which the loaded weights replace, and DiffusionGemma's
    torch.set_grad_enabled(False)
    writers = {"models": write_models, "moe": write_moe_models, "qwen2_bpe": write_qwen2_bpe,
               "diffusion_gemma": write_diffusion_gemma}
    return writers[step]()


if __name__ == "__main__":
    sys.exit(run_main(main))
