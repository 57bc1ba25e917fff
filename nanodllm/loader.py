"""Checkpoint directory -> the fused model (nanodllm/fused.py); or random weights of a config's shape.

A checkpoint is config.json plus either model.safetensors or shards listed in
model.safetensors.index.json. Tensors are streamed one at a time (safe_open) straight into the
parameters of a reference model allocated on the target device, so loading needs little more host
memory than the largest tensor; fuse() then stacks its weights layer by layer. Each family's tensor
names are mapped onto the internal (Qwen3) names by one rename table; a fused tensor (LLaDA2's
query_key_value) renames to several parameters, which take its rows in order. Before anything is read,
every name and shape is checked: a missing, unexpected or misshapen tensor is an error that names all
of them, and no model is returned half-loaded. Experts load one tensor per expert, as released (stacked
for DiffusionGemma); other layouts are refused by name. Tied embeddings: when the checkpoint has no LM
head and the config ties (or does not say), the head is the embedding matrix. build_random stands for a
loaded model in benchmarks and tests. Both return once the first-use warm-up has finished. Given a group
(nanodllm/parallel.py), each rank checks the whole checkpoint but reads only its parts. DiffusionGemma
loads text only, into its reference model (nanodllm/gemma.py), unfused.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanodllm.kernels import first_use

from .config import ModelConfig
from .fused import FusedModel, fuse
from .gemma import DiffusionGemma
from .model import Model
from .parallel import SINGLE, Group, group_of, local_config, shard
from .shards import local_part

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
RENAMES["llada2_moe"] = [
    ("model.word_embeddings.weight", "embed_tokens.weight"),
    ("model.layers.{i}.attention.query_key_value.weight", ("layers.{i}.self_attn.q_proj.weight",
                                                           "layers.{i}.self_attn.k_proj.weight",
                                                           "layers.{i}.self_attn.v_proj.weight")),
    ("model.layers.{i}.attention.query_layernorm.weight", "layers.{i}.self_attn.q_norm.weight"),
    ("model.layers.{i}.attention.key_layernorm.weight", "layers.{i}.self_attn.k_norm.weight"),
    ("model.layers.{i}.attention.dense.weight", "layers.{i}.self_attn.o_proj.weight"),
    ("model.layers.{i}.mlp.shared_experts.{name}", "layers.{i}.mlp.shared_expert.{name}"),
    *RENAMES["sdar"],
]
# Qwen2 names (+ q/k/v biases) and Qwen3-MoE's (mlp.gate, mlp.experts.{e}.*_proj) are Qwen3's
RENAMES["Dream"] = RENAMES["Fast_dLLM_Qwen"] = RENAMES["sdar_moe"] = RENAMES["sdar"]
# the encoder's weights are the decoder's (stored once, under model.decoder), but for its layer scalars
RENAMES["diffusion_gemma"] = [
    ("model.encoder.language_model.layers.{i}.layer_scalar", "layers.{i}.encoder_scalar"),
    ("model.decoder.layers.{i}.layer_scalar", "layers.{i}.denoiser_scalar"),
    ("model.decoder.{name}", "{name}"),
]
QWEN_FAMILIES = ("sdar", "Dream", "Fast_dLLM_Qwen", "sdar_moe")
STACKED_EXPERTS = ("diffusion_gemma",)  # families released with each layer's experts in one tensor
SKIPPED = {"diffusion_gemma": ("model.encoder.vision_tower.", "model.encoder.embed_vision.")}  # vision tower
FUSED_EXPERTS = re.compile(r".*\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3|w13)(\.weight)?")


def _rename(name: str, source: str, target: str) -> str | None:
    pattern = re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{name\}", r"(?P<name>.+)")
    match = re.fullmatch(pattern, name)
    return target.format(**match.groupdict()) if match else None


def _targets(target: str | tuple[str, ...]) -> tuple[str, ...]:
    return target if isinstance(target, tuple) else (target,)


def internal_names(model_type: str, checkpoint_name: str) -> tuple[str, ...]:
    """The model parameters a checkpoint tensor loads into, in row order (empty if none)."""
    for source, target in RENAMES[model_type]:
        renamed = tuple(_rename(checkpoint_name, source, t) for t in _targets(target))
        if None not in renamed:
            return renamed
    return ()


def checkpoint_name(model_type: str, parameter: str) -> str:
    """The tensor name a model parameter is stored under in the family's checkpoints."""
    for source, target in RENAMES[model_type]:
        for one in _targets(target):
            renamed = _rename(parameter, one, source)
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


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; weights of other kinds are refused


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Read every tensor's shape from the headers (no data); a tensor of integers or bools is refused."""
    shapes = {}
    for file in sorted(set(files.values())):
        handle = _open(file)
        for name in handle.keys():
            if files.get(name) == file:
                stored = handle.get_slice(name)
                if stored.get_dtype() not in FLOAT_DTYPES:
                    raise CheckpointError(f"{file}: {name} holds {stored.get_dtype()} numbers; nanodllm loads "
                                          f"floating-point weights ({', '.join(FLOAT_DTYPES)})")
                shapes[name] = tuple(stored.get_shape())
    absent = sorted(set(files) - set(shapes))
    if absent:
        raise CheckpointError(f"tensors listed in the index are not in their shard: {', '.join(absent)}")
    return shapes


def plan(model: Model, files: dict[str, Path]) -> dict[str, tuple[str, ...]]:
    """checkpoint name -> the internal parameters it loads (in row order), after checking names and
    shapes against `model` (the whole model, also on a rank that holds a share: whole_model). Raises
    CheckpointError listing every missing, unexpected and misshapen tensor."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    shapes = _shapes(files)
    fused = sorted(name for name in shapes if FUSED_EXPERTS.fullmatch(name))
    if fused and cfg.model_type not in STACKED_EXPERTS:
        raise CheckpointError(f"{fused[0]} holds every expert in one tensor; nanodllm loads the released "
                              "layout, one tensor per expert (mlp.experts.{e}.gate_proj.weight, ...)")
    mapping, loaded_by, unexpected, duplicated = {}, {}, [], []
    for name in sorted(shapes):
        targets = internal_names(cfg.model_type, name)
        if not targets or any(t not in params for t in targets):
            unexpected.append(name)
            continue
        for target in targets:
            if target in loaded_by:
                duplicated.append(f"{loaded_by[target]} and {name} both load {target}")
            loaded_by[target] = name
        mapping[name] = targets
    missing = sorted({checkpoint_name(cfg.model_type, n) for n in set(params) - set(loaded_by)})
    expected = {name: _rows_of(params, targets) for name, targets in mapping.items()}
    misshapen = [
        f"{name} has shape {list(shapes[name])}, expected {list(expected[name])}"
        for name in sorted(mapping)
        if shapes[name] != expected[name]
    ]
    problems = [first_few(kind, items) for kind, items in
                (("missing", missing), ("unexpected", sorted(unexpected)), ("misshapen", misshapen),
                 ("duplicated", duplicated)) if items]
    if problems:
        raise CheckpointError(f"checkpoint does not match a {cfg.model_type} model of its config:\n  "
                              + "\n  ".join(problems))
    return mapping


def first_few(kind: str, items: list[str], shown: int = 3) -> str:
    """'misshapen (12 tensors): a; b; c; and 9 more': a long list named by its count and first items."""
    more = f"; and {len(items) - shown} more" if len(items) > shown else ""
    return f"{kind} ({len(items)} tensor{'s' * (len(items) != 1)}): " + "; ".join(items[:shown]) + more


def _rows_of(params: dict, targets: tuple[str, ...]) -> tuple[int, ...]:
    """The shape of the targets' parameters stacked along their first dim."""
    first = tuple(params[targets[0]].shape)
    return (sum(params[t].shape[0] for t in targets), *first[1:])


def build_empty(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16, group: Group = SINGLE) -> Model | DiffusionGemma:
    """A reference model with uninitialised parameters allocated once, in `dtype`, directly on `device`
    (built on the meta device first, so no CPU or fp32 copy of an 8B model is ever made); of a split
    model, this rank's share."""
    with torch.device("meta"):
        reference = DiffusionGemma if cfg.gemma is not None else Model
        model = shard(reference(local_config(cfg, group.world)), cfg, group).to(dtype)
    model.to_empty(device=device)
    if cfg.gemma is None:
        model.tie_weights()
    return model.eval()


def fuse_or_reference(model):
    """The fused model of a reference one; DiffusionGemma's reference model as it is, said once on stderr
    (its fused path is not written: fused.py and the kernels assume the other families' layers)."""
    if model.cfg.gemma is None:
        return fuse(model)
    print(f"nanodllm: {model.cfg.model_type} runs on its reference model (nanodllm/gemma.py), not the fused "
          "one", file=sys.stderr)
    return model


def vision_skipped(model_type: str, files: dict[str, Path]) -> tuple[dict[str, Path], list[str]]:
    """(files without the tensors nanodllm does not run, those tensors' names)."""
    prefixes = SKIPPED.get(model_type, ())
    skipped = sorted(name for name in files if name.startswith(prefixes)) if prefixes else []
    return {name: file for name, file in files.items() if name not in skipped}, skipped


def whole_model(model: Model) -> Model:
    """The model itself, or of a split model the whole one on the meta device (its names and shapes)."""
    return model if group_of(model).world == 1 else build_empty(model.cfg, "meta")


def read_parts(handle, source: str, targets: tuple[str, ...], rows: list[int],
               cfg: ModelConfig, group: Group):
    """(whole parameter, this rank's part of it, the tensor) for each target of checkpoint tensor `source`
    (the targets' rows stacked, `rows` each) that this rank holds: the tensor read at once where the rank
    holds all of it, else each part alone, so that no rank reads what it does not keep."""
    parts = [local_part(target, cfg, group) for target in targets]
    if all(part is not None and part.dim is None for part in parts):
        return zip(targets, parts, handle.get_tensor(source).split(rows))
    stored, firsts = handle.get_slice(source), itertools.accumulate([0, *rows])
    return [(target, part, stored[part.index(first, n)])
            for target, part, first, n in zip(targets, parts, firsts, rows) if part is not None]


def load_reference(path, device="cpu", dtype=torch.bfloat16, context: int | None = None,
                   group: Group = SINGLE) -> Model | DiffusionGemma:
    """Load a checkpoint directory into the reference model (nanodllm/model.py), which load_model fuses;
    with a group of several ranks, this rank's share of it."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise CheckpointError(f"{path / 'config.json'}: mask_token_id {cfg.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {cfg.vocab_size})")
    files, skipped = vision_skipped(cfg.model_type, checkpoint_files(path))
    if skipped:
        print(f"nanodllm: {path}: {len(skipped)} vision tensors skipped (only the text model runs)", file=sys.stderr)
    has_head = any(internal_names(cfg.model_type, name) == ("lm_head.weight",) for name in files)
    if has_head and cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # a stored head is used as stored
    if not has_head and cfg.model_type in QWEN_FAMILIES:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # Qwen rule: no head -> the embedding
    if context and cfg.gemma is not None and context > cfg.max_position_embeddings:
        raise ValueError(f"{cfg.model_type}: a context of {context} tokens exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}, and its RoPE is not stretched")
    if context and cfg.gemma is None:
        cfg = cfg.with_context(context)
    model = build_empty(cfg, device, dtype, group)
    whole = whole_model(model)
    mapping = plan(whole, files)
    params, whole_params, loaded_as = dict(model.named_parameters()), dict(whole.named_parameters()), {}
    with torch.no_grad():
        for file in sorted(set(files.values())):
            handle = _open(file)
            for source, targets in mapping.items():
                if files[source] == file:
                    rows = [whole_params[t].shape[0] for t in targets]
                    for target, part, tensor in read_parts(handle, source, targets, rows, cfg, group):
                        params[part.name].copy_(tensor)
                        loaded_as[part.name] = target
        finite = torch.stack([p.isfinite().all() for p in params.values()]).tolist()  # one device sync
        broken = sorted({checkpoint_name(cfg.model_type, loaded_as[n]) for n, ok in zip(params, finite) if not ok})
    if broken:  # a NaN weight would decode to nothing, or to garbage, without a word
        raise CheckpointError(f"{path}: " + first_few("NaN or infinite values", broken))
    return model


def load_model(path, device="cpu", dtype=torch.bfloat16, context: int | None = None,
               group: Group = SINGLE) -> FusedModel | DiffusionGemma:
    """Load a checkpoint directory into the fused model. `context` stretches RoPE (NTK) to that many
    tokens if needed; `group` (nanodllm/parallel.py): this rank's share of the model."""
    first_use.start(device, dtype)  # on a GPU, overlaps the loading (kernels/first_use.py)
    try:
        return fuse_or_reference(load_reference(path, device, dtype, context, group))
    finally:
        first_use.wait()


def random_weights(model: Model, seed: int = 0) -> Model:
    """model's weights drawn in place: N(0, 0.02), the norms' and scales' 1. A rank's share of a split model draws
    every whole tensor in turn and keeps its part: the whole model's weights, sliced."""
    group, params = group_of(model), dict(model.named_parameters())
    weight = model.embed_tokens.weight
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, whole in whole_model(model).named_parameters():
            part = local_part(name, model.cfg, group)
            if name.endswith(("norm.weight", "scale", "scalar")):
                params[part.name].fill_(1.0)
            elif part is not None and part.dim is None:
                params[part.name].normal_(0.0, 0.02, generator=generator)
            else:  # a split tensor, or another rank's expert: drawn whole, this rank's part kept
                drawn = torch.empty(whole.shape, dtype=weight.dtype, device=weight.device)
                drawn.normal_(0.0, 0.02, generator=generator)
                if part is not None:
                    params[part.name].copy_(drawn[part.index(0, whole.shape[0])])
    return model


def build_random(cfg: ModelConfig, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                 group: Group = SINGLE) -> FusedModel | DiffusionGemma:
    """A fused model of cfg's shape with random weights (random_weights), built as load_model builds one;
    `group`: this rank's share of it."""
    first_use.start(device, dtype)  # on a GPU, overlaps the build (kernels/first_use.py)
    try:
        return fuse_or_reference(random_weights(build_empty(cfg, device, dtype, group), seed))
    finally:
        first_use.wait()
