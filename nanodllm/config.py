"""Model and generation configuration.

`ModelConfig.from_dir(path)` reads a checkpoint's config.json. Four families are understood:

- `llada`: LLaDA-8B-Base/-Instruct, LLaDA-1.5. OLMo field names (d_model, n_layers, ...),
  fully bidirectional attention; `attention_layer_norm` (RMSNorm over the whole q and k projections,
  false in the released checkpoints, true in tiny-llada) is read too.
- `sdar`: SDAR-*-Chat, TraDo. Qwen3 field names, q/k norm, block-causal attention with
  `block_size` (default 4) and `mask_token_id` (default 151669) when the config lacks them.
- `Dream`: Dream-v0-7B. Qwen2 field names, q/k/v biases, no q/k norm, bidirectional, logits shifted
  (position i is predicted from hidden state i-1), mask 151666 by default.
- `Fast_dLLM_Qwen`: Fast-dLLM v2 7B. The same Qwen2 layout, block-causal with `bd_size` (default
  32), logits shifted, mask 151665 by default.

Everything inside nanodllm uses the one internal vocabulary of this dataclass; the loader maps tensor
names the same way. `preset(name)` gives the real 8B-class shapes so benchmarks can build a model
with random weights directly on the GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llada", "sdar", "Dream", "Fast_dLLM_Qwen")


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
    attention: str  # "bidirectional" or "block_causal"
    block_size: int | None  # block-causal block length (sdar), None when bidirectional
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3, SDAR); "projection": over the whole
    # q and k projections before they are split into heads (OLMo's attention_layer_norm)
    qkv_bias: bool = False
    logit_shift: bool = False
    tie_word_embeddings: bool = False
    rope_ntk_factor: float = 1.0  # > 1 stretches RoPE (NTK-aware) beyond the trained context

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.attention not in ("bidirectional", "block_causal"):
            raise ValueError(f"attention must be 'bidirectional' or 'block_causal', got {self.attention!r}")
        if self.attention == "block_causal" and not self.block_size:
            raise ValueError("block_causal attention needs a positive block_size")
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")

    @property
    def rope_base(self) -> float:
        """RoPE base after NTK-aware scaling: base * factor^(d / (d - 2))."""
        if self.rope_ntk_factor == 1.0:
            return self.rope_theta
        d = self.head_dim
        return self.rope_theta * self.rope_ntk_factor ** (d / (d - 2))

    @property
    def context_length(self) -> int:
        """Longest sequence the positions are meant for (trained length times the NTK factor)."""
        return int(self.max_position_embeddings * self.rope_ntk_factor)

    def with_context(self, length: int) -> "ModelConfig":
        """A copy whose NTK factor stretches RoPE to `length` tokens (unchanged if it already fits)."""
        factor = max(1.0, length / self.max_position_embeddings)
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
        return cls.from_dict(raw, source=str(config_file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type == "llada":
            return _from_olmo_fields(raw, source)
        if model_type == "sdar":
            return _from_qwen3_fields(raw, source)
        if model_type in ("Dream", "Fast_dLLM_Qwen"):
            return _from_qwen2_fields(raw, source)
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _require(raw: dict, name: str, source: str):
    if raw.get(name) is None:
        raise ValueError(f"{source}: required field {name!r} is missing")
    return raw[name]


def _stop_ids(raw: dict, default: tuple[int, ...]) -> tuple[int, ...]:
    """The config's eos id(s) followed by the family's documented stop tokens, without repeats."""
    value = raw.get("eos_token_id")
    from_config = tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))
    return tuple(dict.fromkeys(int(i) for i in from_config + default))


def _from_olmo_fields(raw: dict, source: str) -> ModelConfig:
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
        num_kv_heads=raw.get("n_kv_heads") or n_heads,
        head_dim=d_model // n_heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        attention="bidirectional",
        block_size=None,
        mask_token_id=raw.get("mask_token_id", 126336),
        eos_token_ids=_stop_ids(raw, default=(126081, 126348)),
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
        eos_token_ids=_stop_ids(raw, default=(151645, 151643)),
        qk_norm="head",
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
        num_kv_heads=raw.get("num_key_value_heads") or n_heads,
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
        eos_token_ids=_stop_ids(raw, default=(151645, 151643)),
        qkv_bias=True,
        logit_shift=True,
    )


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
    block engine (SDAR, Fast-dLLM v2), the whole response for Dream (its loop decodes one block), else
    LLaDA's 32 tokens (at most gen_length)."""
    if cfg.attention == "block_causal":
        return cfg.block_size
    return gen_length if cfg.model_type == "Dream" else min(32, gen_length)


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
