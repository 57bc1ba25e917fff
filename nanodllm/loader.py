"""Checkpoint directory -> Model.

A checkpoint is config.json plus either model.safetensors or shards listed in
model.safetensors.index.json. Tensors are streamed one at a time (safe_open) straight into the
parameters of a model allocated on the target device, so loading needs little more host memory than
the largest tensor. Each family's tensor names are mapped onto the internal (Qwen3) names by one
rename table. Before anything is read, every name and shape is checked: a missing, unexpected or
misshapen tensor is an error that names all of them, and no model is returned half-loaded.
Tied embeddings: when the checkpoint has no LM head and the config ties (or does not say), the head
is the embedding matrix.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .fused import build_empty
from .model import Model

# (checkpoint name, internal name) patterns, tried in order; {i} is a layer index, {name} any rest.
RENAMES = {
    "llada": [
        ("model.transformer.wte.weight", "embed_tokens.weight"),
        ("model.transformer.blocks.{i}.attn_norm.weight", "layers.{i}.input_layernorm.weight"),
        ("model.transformer.blocks.{i}.q_proj.weight", "layers.{i}.self_attn.q_proj.weight"),
        ("model.transformer.blocks.{i}.k_proj.weight", "layers.{i}.self_attn.k_proj.weight"),
        ("model.transformer.blocks.{i}.v_proj.weight", "layers.{i}.self_attn.v_proj.weight"),
        ("model.transformer.blocks.{i}.q_norm.weight", "layers.{i}.self_attn.q_norm.weight"),
        ("model.transformer.blocks.{i}.k_norm.weight", "layers.{i}.self_attn.k_norm.weight"),
        ("model.transformer.blocks.{i}.attn_out.weight", "layers.{i}.self_attn.o_proj.weight"),
        ("model.transformer.blocks.{i}.ff_norm.weight", "layers.{i}.post_attention_layernorm.weight"),
        ("model.transformer.blocks.{i}.ff_proj.weight", "layers.{i}.mlp.gate_proj.weight"),
        ("model.transformer.blocks.{i}.up_proj.weight", "layers.{i}.mlp.up_proj.weight"),
        ("model.transformer.blocks.{i}.ff_out.weight", "layers.{i}.mlp.down_proj.weight"),
        ("model.transformer.ln_f.weight", "norm.weight"),
        ("model.transformer.ff_out.weight", "lm_head.weight"),
    ],
    "sdar": [
        ("lm_head.weight", "lm_head.weight"),
        ("model.{name}", "{name}"),
    ],
}
RENAMES["Dream"] = RENAMES["Fast_dLLM_Qwen"] = RENAMES["sdar"]  # Qwen2 names (+ q/k/v biases) are Qwen3's
QWEN_FAMILIES = ("sdar", "Dream", "Fast_dLLM_Qwen")


def _rename(name: str, source: str, target: str) -> str | None:
    pattern = re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{name\}", r"(?P<name>.+)")
    match = re.fullmatch(pattern, name)
    return target.format(**match.groupdict()) if match else None


def internal_name(model_type: str, checkpoint_name: str) -> str | None:
    """The model parameter a checkpoint tensor loads into (None if the family has no such tensor)."""
    for source, target in RENAMES[model_type]:
        renamed = _rename(checkpoint_name, source, target)
        if renamed is not None:
            return renamed
    return None


def checkpoint_name(model_type: str, parameter: str) -> str:
    """The tensor name a model parameter is stored under in the family's checkpoints."""
    for source, target in RENAMES[model_type]:
        renamed = _rename(parameter, target, source)
        if renamed is not None:
            return renamed
    return parameter


class CheckpointError(ValueError):
    """The checkpoint's files do not match what its config.json describes."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """checkpoint tensor name -> the safetensors file holding it."""
    index_file = path / "model.safetensors.index.json"
    single_file = path / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index_file} is not a valid safetensors index: {err!r}") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise FileNotFoundError(f"shards listed in {index_file} are missing: {', '.join(missing)}")
        return {name: path / file for name, file in weight_map.items()}
    if single_file.is_file():
        return {name: single_file for name in _open(single_file).keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Read every tensor's shape from the headers (no data)."""
    shapes = {}
    for file in sorted(set(files.values())):
        handle = _open(file)
        for name in handle.keys():
            if files.get(name) == file:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    absent = sorted(set(files) - set(shapes))
    if absent:
        raise CheckpointError(f"tensors listed in the index are not in their shard: {', '.join(absent)}")
    return shapes


def plan(model: Model, files: dict[str, Path]) -> dict[str, str]:
    """internal parameter name -> checkpoint name, after checking names and shapes.

    Raises CheckpointError listing every missing, unexpected and misshapen tensor."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    shapes = _shapes(files)
    mapping, unexpected, duplicated = {}, [], []
    for name in sorted(shapes):
        target = internal_name(cfg.model_type, name)
        if target not in params:
            unexpected.append(name)
        elif target in mapping:
            duplicated.append(f"{mapping[target]} and {name} both load {target}")
        else:
            mapping[target] = name
    missing = sorted(checkpoint_name(cfg.model_type, n) for n in set(params) - set(mapping))
    misshapen = [
        f"{mapping[n]} has shape {list(shapes[mapping[n]])}, expected {list(params[n].shape)}"
        for n in sorted(mapping)
        if shapes[mapping[n]] != tuple(params[n].shape)
    ]
    problems = []
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(sorted(unexpected)))
    if misshapen:
        problems.append("misshapen: " + "; ".join(misshapen))
    if duplicated:
        problems.append("duplicated: " + "; ".join(duplicated))
    if problems:
        raise CheckpointError(f"checkpoint does not match a {cfg.model_type} model of its config: " + " | ".join(problems))
    return mapping


def load_model(path, device="cpu", dtype=torch.bfloat16, context: int | None = None) -> Model:
    """Load a checkpoint directory. `context` stretches RoPE (NTK) to that many tokens if needed."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = checkpoint_files(path)
    has_head = any(internal_name(cfg.model_type, name) == "lm_head.weight" for name in files)
    if has_head and cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # a stored head is used as stored
    if not has_head and cfg.model_type in QWEN_FAMILIES:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # Qwen rule: no head -> the embedding
    if context:
        cfg = cfg.with_context(context)
    model = build_empty(cfg, device, dtype)
    mapping = plan(model, files)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(set(files.values())):
            handle = _open(file)
            for target, source in mapping.items():
                if files[source] == file:
                    params[target].copy_(handle.get_tensor(source))
    return model
