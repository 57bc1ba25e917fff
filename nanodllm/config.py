"""Model and generation configuration.

`ModelConfig.from_dir(path)` reads a checkpoint's config.json, one of seven families (a field the
config lacks, such as the block size or the mask id, takes the family's released default):
- `llada`: LLaDA-8B-Base/-Instruct, LLaDA-1.5. OLMo field names, fully bidirectional attention.
- `sdar`: SDAR-*-Chat, TraDo. Qwen3 field names, q/k norm, block-causal attention.
- `Dream`: Dream-v0-7B. Qwen2 field names, q/k/v biases, no q/k norm, bidirectional, logits shifted
  (position i is predicted from hidden state i-1).
- `Fast_dLLM_Qwen`: Fast-dLLM v2 7B. Dream's layout, block-causal with `bd_size`, logits shifted.
- `llada2_moe`: LLaDA2.0/2.1-mini and -flash. Mixture of experts, per-head q/k norm, RoPE on the
  first `partial_rotary_factor` of each head's dims, block-causal.
- `sdar_moe`: SDAR-30B-A3B. Qwen3-MoE field names with SDAR's block-causal attention.
- `diffusion_gemma`: DiffusionGemma. Text fields under text_config, its layers in `GemmaConfig`.
Everything inside nanodllm uses the one internal vocabulary of this dataclass (the loader maps tensor
names the same way). `preset(name)` gives real 8B-class shapes, for benchmarks with random weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llada", "sdar", "Dream", "Fast_dLLM_Qwen", "llada2_moe", "sdar_moe", "diffusion_gemma")
ROUTER_SCORES = ("softmax", "sigmoid")
ATTENTION_KINDS = ("bidirectional", "block_causal", "encoder_decoder")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (nanodllm/mlp.py): which layers have one and how tokens are routed."""

    num_experts: int
    experts_per_token: int
    expert_size: int  # each routed expert's intermediate width
    score: str  # "softmax" over the experts (Qwen3-MoE) or a "sigmoid" per expert (LLaDA2)
    normalize: bool  # the chosen experts' scores divided by their sum
    scale: float = 1.0  # routed_scaling_factor, applied after normalising
    groups: int = 1  # n_group: the experts in `groups` equal groups, of which the choice may use
    groups_kept: int = 1  # topk_group, ranked by the sum of each group's two best scores
    expert_bias: bool = False  # a learned bias added to the scores for the choice only
    shared_size: int = 0  # the shared expert's intermediate width (0: none)
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (of the model's intermediate_size)

    def __post_init__(self):
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"router score function {self.score!r} is not implemented; "
                             f"supported: {', '.join(ROUTER_SCORES)}")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token must be in [1, num_experts={self.num_experts}], "
                             f"got {self.experts_per_token}")
        if self.groups < 1 or self.num_experts % self.groups:
            raise ValueError(f"n_group={self.groups} must divide num_experts={self.num_experts}")
        per_group = self.num_experts // self.groups
        if self.groups > 1 and per_group < 2:
            raise ValueError(f"group-limited routing ranks groups by their two best experts; "
                             f"n_group={self.groups} leaves {per_group} per group")
        if not 0 < self.groups_kept <= self.groups:
            raise ValueError(f"topk_group={self.groups_kept} must be in [1, n_group={self.groups}]")
        if self.experts_per_token > self.groups_kept * per_group:
            raise ValueError(f"{self.experts_per_token} experts per token do not fit in topk_group="
                             f"{self.groups_kept} groups of {per_group}")


@dataclass(frozen=True)
class GemmaConfig:
    """What DiffusionGemma's layers add to ModelConfig, whose head_dim, num_kv_heads and rope_theta are
    its sliding layers' (nanodllm/gemma.py)."""

    layer_types: tuple[str, ...]  # per layer, "sliding_attention" or "full_attention"
    sliding_window: int  # a sliding layer's query sees the last sliding_window positions, itself included
    global_head_dim: int  # a full layer's head_dim
    global_kv_heads: int  # a full layer's KV heads, whose values are their keys (K = V: no v_proj)
    global_rope_theta: float
    global_rotary_fraction: float  # proportional RoPE: of a global_head_dim RoPE, the first
    # int(fraction * global_head_dim // 2) frequency pairs rotate, the others stay still
    logit_softcap: float  # logits = softcap * tanh(logits / softcap)
    canvas_length: int  # the tokens one denoising pass refines (a block)
    pad_token_id: int = 0  # what follows a stop token in a finished row's canvases

    @property
    def global_rotated_pairs(self) -> int:
        return int(self.global_rotary_fraction * self.global_head_dim // 2)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    attention: str  # "bidirectional", "block_causal" or "encoder_decoder" (DiffusionGemma's two passes)
    block_size: int | None  # block-causal block length (sdar), the canvas (gemma); None when bidirectional
    mask_token_id: int | None  # None: no mask token (DiffusionGemma's noise is uniform over the vocabulary)
    eos_token_ids: tuple[int, ...]
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3, SDAR); "projection": over the whole
    # q and k projections before they are split into heads (OLMo's attention_layer_norm)
    qkv_bias: bool = False
    logit_shift: bool = False
    tie_word_embeddings: bool = False
    rope_ntk_factor: float = 1.0  # > 1 stretches RoPE (NTK-aware) beyond the trained context
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim = factor * head_dim dims
    moe: MoEConfig | None = None  # a mixture-of-experts MLP in every layer but moe.dense_layers
    gemma: GemmaConfig | None = None  # DiffusionGemma's sliding and full layers, softcap, canvas

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if (self.attention == "encoder_decoder") != (self.gemma is not None):
            raise ValueError("encoder_decoder attention goes with a GemmaConfig, and only with it")
        if self.attention == "block_causal" and not self.block_size:
            raise ValueError("block_causal attention needs a positive block_size")
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"RoPE's width (head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.partial_rotary_factor}) must be even and in [2, head_dim]")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_base(self) -> float:
        """RoPE base after NTK-aware scaling: base * factor^(d / (d - 2)), d the rotated width."""
        if self.rope_ntk_factor == 1.0:
            return self.rope_theta
        d = self.rotary_dim
        return self.rope_theta * self.rope_ntk_factor ** (d / (d - 2))

    @property
    def context_length(self) -> int:
        """Longest sequence the positions are meant for (trained length times the NTK factor)."""
        return int(self.max_position_embeddings * self.rope_ntk_factor)

    def with_context(self, length: int) -> "ModelConfig":
        """A copy whose NTK factor stretches RoPE to `length` tokens (unchanged if it already fits)."""
        factor = max(1.0, length / self.max_position_embeddings)
        if int(self.max_position_embeddings * factor) < length:  # the quotient rounded down: one ulp up
            factor = math.nextafter(factor, math.inf)
        factor = max(factor, self.rope_ntk_factor)
        return dataclasses.replace(self, rope_ntk_factor=factor)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file} holds {'null' if raw is None else 'a ' + type(raw).__name__}, "
                             "not a JSON object of fields")
        try:
            return cls.from_dict(raw, source=str(config_file))
        except ValueError as err:  # the checks of __post_init__ name a field, not the file
            raise ValueError(str(err) if str(config_file) in str(err) else f"{config_file}: {err}") from None

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        _check_numbers(raw, source)
        model_type = raw.get("model_type")
        if model_type == "llada":
            return _from_olmo_fields(raw, source)
        if model_type == "sdar":
            return _from_qwen3_fields(raw, source)
        if model_type in ("Dream", "Fast_dLLM_Qwen"):
            return _from_qwen2_fields(raw, source)
        if model_type == "llada2_moe":
            return _from_llada2_fields(raw, source)
        if model_type == "sdar_moe":
            return _from_qwen3_moe_fields(raw, source)
        if model_type == "diffusion_gemma":
            return _from_diffusion_gemma_fields(raw, source)
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


NUMBER_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "mlp_ratio", "embedding_size",
                 "max_sequence_length", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "vocab_size",
                 "mask_token_id", "block_size", "bd_size", "rope_theta", "rms_norm_eps", "partial_rotary_factor",
                 "moe_intermediate_size", "num_experts", "num_experts_per_tok", "num_shared_experts", "n_group",
                 "topk_group", "routed_scaling_factor", "first_k_dense_replace", "decoder_sparse_step",
                 "shared_expert_intermediate_size", "sliding_window", "global_head_dim", "num_global_key_value_heads",
                 "top_k_experts", "final_logit_softcapping", "canvas_length")  # read as numbers, by every family


def _check_numbers(raw: dict, source: str) -> None:
    for name in NUMBER_FIELDS:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{source}: {name} must be a number, got {value!r}")


def _require(raw: dict, name: str, source: str):
    if raw.get(name) is None:
        raise ValueError(f"{source}: required field {name!r} is missing")
    return raw[name]


def _given(raw: dict, name: str, default):
    """raw[name], or default where the field is absent or null (a 0 stays 0, to be refused by name)."""
    return default if raw.get(name) is None else raw[name]


def _stop_ids(raw: dict, source: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """The config's eos id(s) followed by the family's documented stop tokens that fit its vocabulary
    (a smaller model of the family lists its own in eos_token_id), without repeats."""
    value = raw.get("eos_token_id")
    from_config = tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in from_config):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    vocab = raw.get("embedding_size") or raw.get("vocab_size")
    fitting = tuple(i for i in default if not isinstance(vocab, int) or i < vocab)
    return tuple(dict.fromkeys(int(i) for i in from_config + fitting))


def _from_olmo_fields(raw: dict, source: str) -> ModelConfig:
    """LLaDA (OLMo field names). attention_layer_norm (RMSNorm over the whole q and k projections) is
    false in the released checkpoints and true in tiny-llada."""
    for flag in ("include_bias", "include_qkv_bias", "alibi"):
        if raw.get(flag):
            raise ValueError(f"{source}: {flag}=true is not supported (released LLaDA checkpoints set it false)")
    if raw.get("attention_layer_norm") and raw.get("attention_layer_norm_with_affine") is False:
        raise ValueError(f"{source}: attention_layer_norm without affine weights is not supported "
                         "(attention_layer_norm_with_affine=false)")
    if (raw.get("layer_norm_type") or "rms") != "rms":
        raise ValueError(f"{source}: layer_norm_type {raw['layer_norm_type']!r} is not supported; only 'rms'")
    if raw.get("rope") is False:
        raise ValueError(f"{source}: rope=false is not supported (released LLaDA checkpoints use RoPE)")
    if raw.get("block_type", "llama") != "llama":
        raise ValueError(f"{source}: block_type {raw['block_type']!r} is not supported; only 'llama'")
    d_model = _require(raw, "d_model", source)
    n_heads = _require(raw, "n_heads", source)
    mlp_hidden = raw.get("mlp_hidden_size") or int(_require(raw, "mlp_ratio", source) * d_model)
    return ModelConfig(
        model_type="llada",
        vocab_size=raw.get("embedding_size") or _require(raw, "vocab_size", source),
        hidden_size=d_model,
        intermediate_size=mlp_hidden,
        num_layers=_require(raw, "n_layers", source),
        num_heads=n_heads,
        num_kv_heads=_given(raw, "n_kv_heads", n_heads),
        head_dim=d_model // n_heads,
        rope_theta=float(_given(raw, "rope_theta", 10000.0)),
        rms_norm_eps=float(_given(raw, "rms_norm_eps", 1e-5)),
        max_position_embeddings=_given(raw, "max_sequence_length", 4096),
        attention="bidirectional",
        block_size=None,
        mask_token_id=_given(raw, "mask_token_id", 126336),
        eos_token_ids=_stop_ids(raw, source, default=(126081, 126348)),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        qk_norm="projection" if raw.get("attention_layer_norm") else None,
    )


def _from_qwen3_fields(raw: dict, source: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for sdar checkpoints")
    return ModelConfig(
        model_type="sdar",
        **_qwen_shape(raw, source),
        attention="block_causal",
        block_size=4 if raw.get("block_size") is None else raw["block_size"],
        mask_token_id=151669 if raw.get("mask_token_id") is None else raw["mask_token_id"],
        eos_token_ids=_stop_ids(raw, source, default=(151645, 151643)),
        qk_norm="head",
    )


def _from_qwen3_moe_fields(raw: dict, source: str) -> ModelConfig:
    """SDAR-MoE: SDAR's fields plus Qwen3-MoE's. A layer is dense if listed in mlp_only_layers or if
    (layer + 1) is not a multiple of decoder_sparse_step, as Qwen3-MoE decides. Softmax router, no
    shared expert."""
    sdar = _from_qwen3_fields(raw, source)
    if raw.get("shared_expert_intermediate_size"):
        raise ValueError(f"{source}: shared_expert_intermediate_size is not part of the Qwen3-MoE layout")
    layers, step = sdar.num_layers, raw.get("decoder_sparse_step") or 1
    only_mlp = set(raw.get("mlp_only_layers") or ())
    moe = MoEConfig(
        num_experts=_require(raw, "num_experts", source),
        experts_per_token=_require(raw, "num_experts_per_tok", source),
        expert_size=_require(raw, "moe_intermediate_size", source),
        score="softmax",
        normalize=bool(raw.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step),
    )
    return dataclasses.replace(sdar, model_type="sdar_moe", moe=moe)


def _from_llada2_fields(raw: dict, source: str) -> ModelConfig:
    """LLaDA2 (BailingMoeV2 field names). The router scores with a sigmoid, chooses on the scores plus
    expert_bias within the topk_group best of n_group groups, and weighs the chosen by their unbiased
    scores normalised to sum 1 (when more than one is chosen), times routed_scaling_factor. A shared
    expert; the first first_k_dense_replace layers are dense."""
    for flag in ("use_qkv_bias", "use_bias", "norm_head"):
        if raw.get(flag):
            raise ValueError(f"{source}: {flag}=true is not supported (the released LLaDA2 checkpoints set it false)")
    if raw.get("score_function", "sigmoid") != "sigmoid":
        raise ValueError(f"{source}: score_function {raw['score_function']!r} is not implemented for "
                         "llada2_moe; only 'sigmoid'")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
    shape = _qwen_shape(raw, source)
    experts_per_token = _require(raw, "num_experts_per_tok", source)
    dense = min(raw.get("first_k_dense_replace") or 0, shape["num_layers"])
    moe = MoEConfig(
        num_experts=_require(raw, "num_experts", source),
        experts_per_token=experts_per_token,
        expert_size=_require(raw, "moe_intermediate_size", source),
        score="sigmoid",
        normalize=experts_per_token > 1,
        scale=float(raw.get("routed_scaling_factor", 1.0)),
        groups=_require(raw, "n_group", source),
        groups_kept=_require(raw, "topk_group", source),
        expert_bias=bool(_given(raw, "moe_router_enable_expert_bias", True)),
        shared_size=(raw.get("num_shared_experts") or 0) * raw["moe_intermediate_size"],
        dense_layers=tuple(range(dense)),
    )
    return ModelConfig(
        model_type="llada2_moe",
        **shape,
        attention="block_causal",
        block_size=32 if raw.get("block_size") is None else raw["block_size"],
        mask_token_id=156895 if raw.get("mask_token_id") is None else raw["mask_token_id"],
        eos_token_ids=_stop_ids(raw, source, default=(156892,)),
        qk_norm="head" if raw.get("use_qk_norm") else None,
        partial_rotary_factor=float(raw.get("partial_rotary_factor", 1.0)),
        moe=moe,
    )


def _qwen_shape(raw: dict, source: str) -> dict:
    """The ModelConfig fields Qwen2 and Qwen3 configs name alike."""
    if raw.get("rope_scaling"):
        raise ValueError(
            f"{source}: rope_scaling={raw['rope_scaling']!r} is not supported; nanodllm applies NTK scaling itself"
        )
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (the released checkpoints set it false)")
    hidden = _require(raw, "hidden_size", source)
    n_heads = _require(raw, "num_attention_heads", source)
    return dict(
        vocab_size=_require(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", source),
        num_layers=_require(raw, "num_hidden_layers", source),
        num_heads=n_heads,
        num_kv_heads=_given(raw, "num_key_value_heads", n_heads),
        head_dim=raw.get("head_dim") or hidden // n_heads,
        rope_theta=float(raw.get("rope_theta", 1e6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _from_qwen2_fields(raw: dict, source: str) -> ModelConfig:
    """Dream and Fast-dLLM v2: Qwen2 layout (q/k/v biases, no q/k norm), shifted logits."""
    dream = raw["model_type"] == "Dream"
    block_size = None if dream else (32 if raw.get("bd_size") is None else raw["bd_size"])
    default_mask = 151666 if dream else 151665
    return ModelConfig(
        model_type=raw["model_type"],
        **_qwen_shape(raw, source),
        attention="bidirectional" if dream else "block_causal",
        block_size=block_size,
        mask_token_id=default_mask if raw.get("mask_token_id") is None else raw["mask_token_id"],
        eos_token_ids=_stop_ids(raw, source, default=(151645, 151643)),
        qkv_bias=True,
        logit_shift=True,
    )



GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def _from_diffusion_gemma_fields(raw: dict, source: str) -> ModelConfig:
    """DiffusionGemma: the text model's fields under text_config (vision_config is not read), defaults as
    transformers' DiffusionGemmaTextConfig. A full layer's head_dim and KV heads come from global_head_dim
    (default 512) and num_global_key_value_heads (default num_key_value_heads), as the released config.json
    states them, or from the per_layer_config transformers writes when it saves one; a last layer that is
    not full is made full, as transformers makes it."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: text_config (the text model's fields) is missing")
    where = f"{source} text_config"
    _check_numbers(text, where)
    refuse = lambda name, why: ValueError(f"{where}: {name} {why}")
    for name, value, allowed in (("hidden_activation", text.get("hidden_activation", "gelu_pytorch_tanh"),
                                  ("gelu_pytorch_tanh",)),
                                 ("use_bidirectional_attention", text.get("use_bidirectional_attention"),
                                  (None, "vision")),
                                 ("attention_bias", bool(text.get("attention_bias")), (False,)),
                                 ("tie_word_embeddings", raw.get("tie_word_embeddings", True), (True,))):
        if value not in allowed:
            raise refuse(name, f"{value!r} is not supported; only {' or '.join(map(repr, allowed))}")
    layers, heads = _require(text, "num_hidden_layers", where), _require(text, "num_attention_heads", where)
    layer_types = list(text.get("layer_types") or
                       ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
    if len(layer_types) != layers or not set(layer_types) <= set(LAYER_TYPES):
        raise refuse("layer_types", f"must list {layers} of {', '.join(LAYER_TYPES)}, got {layer_types!r}")
    layer_types[-1] = "full_attention"
    rope = {kind: _gemma_rope(text, kind, where) for kind in LAYER_TYPES}
    global_head_dim, global_kv_heads = _gemma_full_layer_shape(text, layer_types, where)
    experts, top_k = _require(text, "num_experts", where), _require(text, "top_k_experts", where)
    if not 0 < top_k <= experts:
        raise refuse("top_k_experts", f"must be in [1, num_experts={experts}], got {top_k}")
    if global_kv_heads < 1 or heads % global_kv_heads:
        raise refuse("num_global_key_value_heads", f"{global_kv_heads} must divide num_attention_heads={heads}")
    gemma = GemmaConfig(layer_types=tuple(layer_types), sliding_window=text.get("sliding_window", 512),
                        global_head_dim=global_head_dim, global_kv_heads=global_kv_heads,
                        global_rope_theta=float(rope["full_attention"]["rope_theta"]),
                        global_rotary_fraction=float(rope["full_attention"].get("partial_rotary_factor", 1.0)),
                        logit_softcap=float(30.0 if text.get("final_logit_softcapping") is None
                                            else text["final_logit_softcapping"]),
                        canvas_length=raw.get("canvas_length", 256), pad_token_id=text.get("pad_token_id") or 0)
    for name, value, least in (("sliding_window", gemma.sliding_window, 2), ("global_head_dim", global_head_dim, 2),
                               ("canvas_length", gemma.canvas_length, 1), ("final_logit_softcapping",
                                                                           gemma.logit_softcap, 1e-9)):
        if value < least:
            raise refuse(name, f"must be >= {least}, got {value}")
    if global_head_dim % 2 or not 0 < gemma.global_rotated_pairs <= global_head_dim // 2:
        raise refuse("global_head_dim", f"{global_head_dim} with partial_rotary_factor "
                     f"{gemma.global_rotary_fraction} must be even and rotate at least one pair")
    stops = {"eos_token_id": raw.get("eos_token_id", text.get("eos_token_id")), "vocab_size": text.get("vocab_size")}
    return ModelConfig(
        model_type="diffusion_gemma",
        vocab_size=_require(text, "vocab_size", where),
        hidden_size=_require(text, "hidden_size", where),
        intermediate_size=_require(text, "intermediate_size", where),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_require(text, "num_key_value_heads", where),
        head_dim=_require(text, "head_dim", where),
        rope_theta=float(rope["sliding_attention"]["rope_theta"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=text.get("max_position_embeddings", 131072),
        attention="encoder_decoder",
        block_size=gemma.canvas_length,
        mask_token_id=None,
        eos_token_ids=_stop_ids(stops, source, default=(1, 106)),
        qk_norm="head",
        tie_word_embeddings=True,
        moe=MoEConfig(num_experts=experts, experts_per_token=top_k, score="softmax", normalize=True,
                      expert_size=_require(text, "moe_intermediate_size", where)),
        gemma=gemma,
    )


def _gemma_rope(text: dict, kind: str, where: str) -> dict:
    """rope_parameters[kind]: the released kinds only (default RoPE on sliding layers, proportional on full)."""
    params = (text.get("rope_parameters") or GEMMA_ROPE).get(kind)
    expected = GEMMA_ROPE[kind]["rope_type"]
    if not isinstance(params, dict) or params.get("rope_type") != expected or params.get("rope_theta") is None:
        raise ValueError(f"{where}: rope_parameters.{kind} must be a {expected!r} RoPE with a rope_theta, "
                         f"got {params!r}")
    fraction = params.get("partial_rotary_factor", 1.0)
    if params.get("factor", 1.0) != 1.0 or (kind == "sliding_attention" and fraction != 1.0):
        raise ValueError(f"{where}: rope_parameters.{kind} {params!r}: scaling factors are not supported")
    if not 0 < fraction <= 1:
        raise ValueError(f"{where}: rope_parameters.{kind}.partial_rotary_factor must be in (0, 1], got {fraction}")
    return params


def _gemma_full_layer_shape(text: dict, layer_types: list[str], where: str) -> tuple[int, int]:
    """(head_dim, KV heads) of the full layers: per_layer_config where transformers saved one (one shape for
    every full layer, none for a sliding one), else global_head_dim and num_global_key_value_heads."""
    kv_heads = _require(text, "num_key_value_heads", where)
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        global_kv = text.get("num_global_key_value_heads")
        keep = global_kv is None or text.get("attention_k_eq_v") is False  # transformers: no override then
        return text.get("global_head_dim", 512), kv_heads if keep else global_kv
    full = {str(i) for i, kind in enumerate(layer_types) if kind == "full_attention"}
    shapes = {(entry.get("head_dim", text.get("head_dim")), entry.get("num_key_value_heads", kv_heads))
              for entry in per_layer.values()} if isinstance(per_layer, dict) else set()
    if not isinstance(per_layer, dict) or set(map(str, per_layer)) != full or len(shapes) != 1:
        raise ValueError(f"{where}: per_layer_config must give one shape to exactly the full layers "
                         f"({', '.join(sorted(full, key=int))}), got {per_layer!r}")
    return shapes.pop()

_PRESETS = {
    "llada-8b": dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                     mlp_hidden_size=12288, vocab_size=126464, embedding_size=126464, rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_sequence_length=4096),
    "sdar-8b": dict(model_type="sdar", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936),
    "sdar-4b": dict(model_type="sdar", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936),
    "sdar-1.7b": dict(model_type="sdar", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936),
    "dream-7b": dict(model_type="Dream", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                     max_position_embeddings=131072),
    "fast-dllm-v2-7b": dict(model_type="Fast_dLLM_Qwen", hidden_size=3584, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                            vocab_size=152064, bd_size=32),
    "llada2-mini": dict(model_type="llada2_moe", hidden_size=2048, num_hidden_layers=20, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, intermediate_size=5120, moe_intermediate_size=512,
                        num_experts=256, num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
                        partial_rotary_factor=0.5, rope_theta=600000.0, vocab_size=157184),
    # LLaDA2.0-flash: inclusionAI/dFactory configs/model_configs/llada2_flash/config.json (docs/formats.md)
    "llada2-flash": dict(model_type="llada2_moe", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, intermediate_size=9216, moe_intermediate_size=1024,
                         num_experts=256, num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4,
                         routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
                         partial_rotary_factor=0.5, rope_theta=600000.0, max_position_embeddings=16384,
                         vocab_size=157184),
    "sdar-30b-a3b": dict(model_type="sdar_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
    # DiffusionGemma 26B-A4B: the released config.json's text fields (docs/formats.md, DiffusionGemma)
    "diffusiongemma-26b-a4b": dict(model_type="diffusion_gemma", canvas_length=256, eos_token_id=[1, 106],
                                   text_config=dict(
        vocab_size=262144, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, num_global_key_value_heads=2, global_head_dim=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, sliding_window=1024, num_experts=128,
        top_k_experts=8, rms_norm_eps=1e-6, final_logit_softcapping=30.0, max_position_embeddings=262144,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2, eos_token_id=1)),
}
PRESETS = tuple(_PRESETS)


def preset(name: str, context: int | None = None, block_size: int | None = None) -> ModelConfig:
    """The config of a released model's shape, optionally NTK-stretched to `context` tokens."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    raw = dict(_PRESETS[name])
    if block_size is not None:
        raw["block_size"] = block_size
    config = ModelConfig.from_dict(raw, source=f"preset {name}")
    return config.with_context(context) if context else config


def default_block_length(cfg: ModelConfig, gen_length: int) -> int:
    """The block length a model decodes with unless told otherwise: the config's block size on the
    block engine (SDAR, Fast-dLLM v2) and DiffusionGemma's canvas, the whole response for Dream (its loop
    decodes one block), else LLaDA's 32 tokens (at most gen_length)."""
    if cfg.attention in ("block_causal", "encoder_decoder"):
        return cfg.block_size
    return gen_length if cfg.model_type == "Dream" else min(32, gen_length)


def default_threshold(cfg: ModelConfig) -> float | None:
    """The confidence threshold a model's reference loop decodes with: LLaDA2's generate() unmasks every
    position above 0.95 when at least the scheduled count clear it; the others use none by default."""
    return 0.95 if cfg.model_type == "llada2_moe" else None


@dataclass
class GenerationConfig:
    """Decoding knobs shared by both engines (each engine documents which it reads)."""

    gen_length: int = 128
    block_length: int = 32
    steps: int = 128
    temperature: float = 0.0
    threshold: float | None = None  # confidence-threshold parallel decoding when set
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0

    def __post_init__(self):
        for name in ("gen_length", "block_length", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.temperature < 0 or math.isnan(self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
