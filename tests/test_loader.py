"""Loader: every tensor read exactly once into the right parameter, and clear errors that name the
problem. Broken checkpoints are copies of tests/fixtures/{llada_tiny,sdar_tiny} edited in tmp_path."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanodllm.loader as loader
from nanodllm.attention import attention, block_causal_mask
from nanodllm.config import ModelConfig
from nanodllm.loader import CheckpointError, load_model

FIXTURES = Path(__file__).parent / "fixtures"
LLADA = FIXTURES / "llada_tiny"
SDAR = FIXTURES / "sdar_tiny"
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    (dst / "golden.safetensors").unlink()
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_single(path: Path, edit) -> None:
    """Rewrite model.safetensors with edit(tensors) applied (edit mutates the dict)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("model*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def message(excinfo) -> str:
    return str(excinfo.value)


# ------------------------------------------------------------------------------------------------
# loading exactly once, into the right place


class CountingHandle:
    def __init__(self, handle, file, counts):
        self._handle, self._file, self._counts = handle, file, counts

    def get_tensor(self, name):
        self._counts[name] += 1
        return self._handle.get_tensor(name)

    def __getattr__(self, attr):
        return getattr(self._handle, attr)


@pytest.mark.parametrize("path", [LLADA, SDAR], ids=["llada", "sdar"])
def test_every_tensor_read_once_into_its_parameter(path, monkeypatch):
    counts = collections.Counter()
    real_open = loader._open
    monkeypatch.setattr(loader, "_open", lambda file: CountingHandle(real_open(file), file, counts))
    model = loader.load_reference(path, dtype=torch.float32)

    tensors = checkpoint_tensors(path)
    assert dict(counts) == {name: 1 for name in tensors}, "each checkpoint tensor must be read exactly once"

    params = dict(model.named_parameters())
    targets = {name: loader.internal_names(model.cfg.model_type, name) for name in tensors}
    loaded = [t for names in targets.values() for t in names]
    assert sorted(loaded) == sorted(params), "checkpoint names must map one-to-one onto the parameters"
    for source, names in targets.items():
        assert all(params[t].dtype == torch.float32 for t in names)
        stacked = torch.cat([params[t] for t in names])
        assert torch.equal(stacked, tensors[source].float()), f"{names} != {source}"
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    assert norms and all((p != 1).any() for p in norms), "fixture norms should not be all ones"


def test_llada_names_map_to_the_right_modules():
    model = loader.load_reference(LLADA, dtype=torch.float32)
    tensors = checkpoint_tensors(LLADA)
    layer = model.layers[1]
    pairs = {
        "model.transformer.wte.weight": model.embed_tokens.weight,
        "model.transformer.blocks.1.attn_norm.weight": layer.input_layernorm.weight,
        "model.transformer.blocks.1.q_proj.weight": layer.self_attn.q_proj.weight,
        "model.transformer.blocks.1.k_proj.weight": layer.self_attn.k_proj.weight,
        "model.transformer.blocks.1.v_proj.weight": layer.self_attn.v_proj.weight,
        "model.transformer.blocks.1.attn_out.weight": layer.self_attn.o_proj.weight,
        "model.transformer.blocks.1.ff_norm.weight": layer.post_attention_layernorm.weight,
        "model.transformer.blocks.1.ff_proj.weight": layer.mlp.gate_proj.weight,
        "model.transformer.blocks.1.up_proj.weight": layer.mlp.up_proj.weight,
        "model.transformer.blocks.1.ff_out.weight": layer.mlp.down_proj.weight,
        "model.transformer.ln_f.weight": model.norm.weight,
        "model.transformer.ff_out.weight": model.lm_head.weight,
    }
    for name, param in pairs.items():
        assert torch.equal(param, tensors[name].float()), name
    assert model.cfg.intermediate_size == 160, "mlp_hidden_size wins over mlp_ratio"
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()


def test_bf16_load_is_bit_exact():
    model = loader.load_reference(SDAR)  # default dtype bf16, the storage dtype
    tensors = checkpoint_tensors(SDAR)
    for name, param in model.named_parameters():
        source = "lm_head.weight" if name == "lm_head.weight" else "model." + name
        assert param.dtype == torch.bfloat16 and torch.equal(param, tensors[source]), name


# ------------------------------------------------------------------------------------------------
# errors that name the problem


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as excinfo:
        load_model(missing)
    assert str(missing) in message(excinfo) and "not found" in message(excinfo)


def test_missing_config(tmp_path):
    path = copy(SDAR, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        load_model(path)
    assert "config.json" in message(excinfo) and str(path) in message(excinfo)


def test_invalid_config_json(tmp_path):
    path = copy(SDAR, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError) as excinfo:
        load_model(path)
    assert "config.json" in message(excinfo) and "JSON" in message(excinfo)


@pytest.mark.parametrize("path", [LLADA, SDAR], ids=["llada", "sdar"])
def test_missing_weights(path, tmp_path):
    path = copy(path, tmp_path)
    for file in path.glob("model*.safetensors*"):
        file.unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        load_model(path)
    assert "model.safetensors" in message(excinfo) and "index.json" in message(excinfo)
    assert str(path) in message(excinfo)


def test_missing_shard(tmp_path):
    path = copy(LLADA, tmp_path)
    (path / SHARD_2).unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        load_model(path)
    assert SHARD_2 in message(excinfo) and SHARD_1 not in message(excinfo)


def test_invalid_index(tmp_path):
    path = copy(LLADA, tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert "model.safetensors.index.json" in message(excinfo) and "weight_map" in message(excinfo)


def test_index_lists_tensor_absent_from_its_shard(tmp_path):
    path = copy(LLADA, tmp_path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.transformer.blocks.1.attn_out.weight"
    assert index["weight_map"][name] == SHARD_2
    index["weight_map"][name] = SHARD_1  # points at the wrong shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert name in message(excinfo)


def _truncate(file: Path):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _garble_header(file: Path):
    data = bytearray(file.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header starts at byte 8
    file.write_bytes(bytes(data))


def _empty(file: Path):
    file.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_truncate, _garble_header, _empty], ids=["truncated", "garbled", "empty"])
@pytest.mark.parametrize("path, file", [(SDAR, "model.safetensors"), (LLADA, SHARD_2)], ids=["single", "shard"])
def test_corrupt_safetensors(path, file, corrupt, tmp_path):
    path = copy(path, tmp_path)
    corrupt(path / file)
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert str(path / file) in message(excinfo) and "cannot read" in message(excinfo)


def test_unknown_model_type(tmp_path):
    path = copy(SDAR, tmp_path)
    edit_config(path, model_type="dream")
    with pytest.raises(ValueError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "'dream'" in text and "llada" in text and "sdar" in text


def test_missing_model_type(tmp_path):
    path = copy(LLADA, tmp_path)
    edit_config(path, model_type=None)
    with pytest.raises(ValueError) as excinfo:
        load_model(path)
    assert "model_type" in message(excinfo) and "llada" in message(excinfo) and "sdar" in message(excinfo)


def test_required_config_field_named(tmp_path):
    path = copy(LLADA, tmp_path)
    edit_config(path, d_model=None)
    with pytest.raises(ValueError) as excinfo:
        load_model(path)
    assert "'d_model'" in message(excinfo)


def test_missing_tensor_sdar(tmp_path):
    path = copy(SDAR, tmp_path)
    edit_single(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "missing (1 tensor): model.layers.1.mlp.up_proj.weight" in text
    assert "unexpected" not in text and "misshapen" not in text


def test_missing_tensor_llada_shard(tmp_path):
    path = copy(LLADA, tmp_path)
    shard = path / SHARD_2
    tensors = load_file(str(shard))
    del tensors["model.transformer.blocks.1.up_proj.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.transformer.blocks.1.up_proj.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "missing (1 tensor): model.transformer.blocks.1.up_proj.weight" in text  # the checkpoint's own name


def single_file_llada(tmp_path, edit) -> Path:
    """The llada fixture as one model.safetensors, with edit(tensors) applied."""
    path = copy(LLADA, tmp_path)
    single = checkpoint_tensors(path)
    edit(single)
    for file in path.glob("model*.safetensors*"):
        file.unlink()
    save_file(single, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_llada_without_head_is_an_error(tmp_path):
    """weight_tying is false for LLaDA: a missing ff_out is an error, not a silent tie."""
    path = single_file_llada(tmp_path, lambda t: t.pop("model.transformer.ff_out.weight"))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert "missing (1 tensor): model.transformer.ff_out.weight" in message(excinfo)


def test_llada_attention_layer_norm_tensors_load_and_are_required(tmp_path):
    """attention_layer_norm=true: blocks.i.q_norm / k_norm (d_model and kv_heads * head_dim wide) load into
    the q/k norms; without them the checkpoint is refused, naming them."""
    norms = {f"model.transformer.blocks.{i}.{name}.weight": torch.rand(64, dtype=torch.bfloat16) + 0.5
             for i in range(2) for name in ("q_norm", "k_norm")}
    path = single_file_llada(tmp_path, lambda t: t.update(norms))
    edit_config(path, attention_layer_norm=True)
    model = load_model(path, dtype=torch.float32)
    assert model.cfg.qk_norm == "projection"
    assert torch.equal(model.layers[1].self_attn.k_norm.weight,
                       norms["model.transformer.blocks.1.k_norm.weight"].float())
    assert torch.equal(model.layers[0].self_attn.q_norm.weight,
                       norms["model.transformer.blocks.0.q_norm.weight"].float())
    edit_single(path, lambda t: t.pop("model.transformer.blocks.1.q_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing \(\d+ tensors?\): model.transformer.blocks.1.q_norm.weight"):
        load_model(path)
    edit_config(path, attention_layer_norm=False)  # norms stored but the config has none: unexpected
    with pytest.raises(CheckpointError, match=r"unexpected \(\d+ tensors?\): model.transformer.blocks.0.k_norm.weight"):
        load_model(path)


def test_unexpected_tensor(tmp_path):
    path = copy(SDAR, tmp_path)
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_single(path, lambda t: t.update({extra: torch.ones(8)}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "unexpected" in text and extra in text and "missing" not in text


def test_unexpected_tensor_llada(tmp_path):
    extra = "model.transformer.blocks.2.attn_norm.weight"  # a layer beyond n_layers
    path = single_file_llada(tmp_path, lambda t: t.update({extra: torch.ones(64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert "unexpected" in message(excinfo) and extra in message(excinfo)


def test_misshapen_tensor(tmp_path):
    path = copy(SDAR, tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    edit_single(path, lambda t: t.update({name: torch.zeros(161, 64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "misshapen" in text and name in text and "[161, 64]" in text and "[160, 64]" in text


def test_a_checkpoint_of_another_size_is_named_by_count_and_first_tensors(tmp_path):
    """Every tensor misshapen (a config of another model size): the error names how many and the first
    three, one line per kind of problem, not thousands of characters."""
    path = copy(SDAR, tmp_path)
    edit_single(path, lambda t: t.update({name: torch.zeros(t[name].shape[0] + 1, *t[name].shape[1:])
                                          for name in list(t) if name.endswith("proj.weight")}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    lines = message(excinfo).splitlines()
    count = sum(name.endswith("proj.weight") for name in checkpoint_tensors(path))
    assert lines[1].strip().startswith(f"misshapen ({count} tensors): model.layers.0.mlp.down_proj.weight has shape")
    assert lines[1].endswith(f"; and {count - 3} more") and all(len(line) < 400 for line in lines)


def test_all_problems_reported_together(tmp_path):
    path = copy(SDAR, tmp_path)

    def edit(t):
        del t["model.norm.weight"]
        t["model.layers.0.bogus.weight"] = torch.ones(3)
        t["model.layers.1.self_attn.k_norm.weight"] = torch.ones(17)

    edit_single(path, edit)
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    for needle in ("norm.weight", "model.layers.0.bogus.weight", "model.layers.1.self_attn.k_norm.weight",
                   "[17]", "[16]"):
        assert needle in text, needle


def test_gqa_shape_mismatch_named(tmp_path):
    """A config whose num_key_value_heads disagrees with the weights is reported, not mis-viewed."""
    path = copy(SDAR, tmp_path)
    edit_config(path, num_key_value_heads=4)
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    text = message(excinfo)
    assert "model.layers.0.self_attn.k_proj.weight" in text and "[32, 64]" in text and "[64, 64]" in text


# ------------------------------------------------------------------------------------------------
# SDAR defaults and tied head


def test_sdar_defaults_when_config_lacks_fields(tmp_path):
    path = copy(SDAR, tmp_path)
    edit_config(path, mask_token_id=None, block_size=None)
    cfg = ModelConfig.from_dir(path)  # (a model of this 256-token vocabulary cannot load with that mask id)
    assert cfg.mask_token_id == 151669 and cfg.block_size == 4 and cfg.attention == "block_causal"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 1e6 and isinstance(cfg.rope_theta, float)


def test_configured_values_win_over_defaults():
    sdar, llada = load_model(SDAR).cfg, load_model(LLADA).cfg
    assert (sdar.mask_token_id, sdar.block_size) == (250, 4)
    assert llada.mask_token_id == 250 and 251 in llada.eos_token_ids and llada.rope_theta == 500000.0
    assert (llada.num_heads, llada.num_kv_heads, llada.head_dim, llada.rms_norm_eps) == (4, 4, 16, 1e-5)


@pytest.mark.parametrize("tie_in_config", [None, False, True], ids=["unset", "false", "true"])
def test_sdar_without_head_ties_to_embedding(tie_in_config, tmp_path):
    path = copy(SDAR, tmp_path)
    edit_single(path, lambda t: t.pop("lm_head.weight"))
    edit_config(path, tie_word_embeddings=tie_in_config)
    model = load_model(path, dtype=torch.float32)
    assert model.cfg.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    embed = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.equal(model.embed_tokens.weight, embed)

    g = load_file(str(SDAR / "golden.safetensors"))
    ids, pos = g["input_ids"], g["positions"]
    mask = block_causal_mask(pos, pos, 4)
    with torch.no_grad():
        hidden = model.hidden(ids, pos, lambda layer, q, k, v: attention(q, k, v, mask))
        logits = model.head(hidden)
        expected = model.norm(hidden) @ embed.T
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_sdar_config_tying_but_head_stored_loads_the_stored_head(tmp_path):
    path = copy(SDAR, tmp_path)
    edit_config(path, tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32)
    stored = load_file(str(path / "model.safetensors"))
    assert not model.cfg.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"].float())
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


@pytest.mark.parametrize("fields, expected", [
    ({"hidden_size": "64"}, "hidden_size must be a number, got '64'"),
    ({"rope_theta": [1e6]}, "rope_theta must be a number, got [1000000.0]"),
    ({"mask_token_id": 10**6}, "mask_token_id 1000000 is outside the vocabulary (vocab_size"),
])
def test_a_config_field_of_the_wrong_kind_is_named_before_any_weight_is_read(tmp_path, fields, expected):
    path = copy(SDAR, tmp_path)
    edit_config(path, **fields)
    with pytest.raises(ValueError) as excinfo:
        load_model(path)
    assert expected in message(excinfo) and "config.json" in message(excinfo)


def test_nan_weights_are_refused_by_name(tmp_path):
    path = copy(SDAR, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_single(path, lambda t: t[name].view(-1)[7:9].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=r"NaN or infinite values \(1 tensor\): " + name):
        load_model(path)


def test_a_parameter_two_checkpoint_tensors_would_load_is_refused_naming_both(tmp_path):
    path = copy(SDAR, tmp_path)
    edit_single(path, lambda t: t.update({"model.lm_head.weight": t["lm_head.weight"].clone()}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert "lm_head.weight and model.lm_head.weight both load lm_head.weight" in message(excinfo)


@pytest.mark.parametrize("offset, refused", [(-1, False), (0, True), (-257, True)])
def test_the_mask_id_is_refused_exactly_outside_the_vocabulary(tmp_path, offset, refused):
    """The last id (vocab_size - 1) is a mask id; vocab_size and a negative id are not."""
    path = copy(SDAR, tmp_path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    edit_config(path, mask_token_id=vocab + offset)
    if not refused:
        assert load_model(path).cfg.mask_token_id == vocab - 1
        return
    with pytest.raises(CheckpointError, match="is outside the vocabulary"):
        load_model(path)


def test_llada2_fused_qkv_rows_load_q_then_k_then_v():
    """query_key_value stacks q (heads x head_dim rows), then k and v (kv_heads x head_dim rows each)."""
    model = loader.load_reference(FIXTURES / "llada2_tiny", dtype=torch.float32)
    qkv = checkpoint_tensors(FIXTURES / "llada2_tiny")["model.layers.1.attention.query_key_value.weight"].float()
    attn, cfg = model.layers[1].self_attn, model.cfg
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert q_rows != kv_rows, "the fixture's q and k widths must differ to tell them apart"
    assert torch.equal(attn.q_proj.weight, qkv[:q_rows])
    assert torch.equal(attn.k_proj.weight, qkv[q_rows : q_rows + kv_rows])
    assert torch.equal(attn.v_proj.weight, qkv[q_rows + kv_rows :])


def test_a_transposed_weight_is_misshapen(tmp_path):
    """A weight stored [in, out] instead of [out, in] holds as many numbers, but is refused by name."""
    path = copy(SDAR, tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    edit_single(path, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(path)
    assert f"misshapen (1 tensor): {name} has shape [64, 160], expected [160, 64]" in message(excinfo)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_weights_are_refused_by_name(tmp_path, value):
    path = copy(SDAR, tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    edit_single(path, lambda t: t[name].view(-1)[3:4].fill_(value))
    with pytest.raises(CheckpointError, match=r"NaN or infinite values \(1 tensor\): " + name):
        load_model(path)


def test_a_short_list_of_problems_is_named_whole():
    """Up to three items are listed without a count of more; a fourth is counted, not named."""
    assert loader.first_few("missing", ["a"]) == "missing (1 tensor): a"
    assert loader.first_few("missing", ["a", "b", "c"]) == "missing (3 tensors): a; b; c"
    assert loader.first_few("missing", ["a", "b", "c", "d"]) == "missing (4 tensors): a; b; c; and 1 more"


def test_random_weights_set_every_norm_scale_and_layer_scalar_to_one():
    """random_weights draws the matrices and sets the norms', scales' and (DiffusionGemma's) layer scalars
    to 1, so a random model's layers are not scaled away."""
    model = loader.random_weights(loader.build_empty(ModelConfig.from_dir(FIXTURES / "diffusion_gemma_tiny"),
                                                     dtype=torch.float32))
    ones = [name for name, _ in model.named_parameters() if name.endswith(("norm.weight", "scale", "scalar"))]
    assert any(name.endswith("scalar") for name in ones)
    for name, p in model.named_parameters():
        if name in ones:
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.numel() > 1:
            assert p.std() > 0.01, name  # drawn N(0, 0.02)


def test_diffusion_gemma_loads_up_to_its_unstretched_context_and_no_further():
    """DiffusionGemma's RoPE is not stretched: a context of max_position_embeddings loads, one more is refused."""
    path = FIXTURES / "diffusion_gemma_tiny"
    limit = ModelConfig.from_dir(path).max_position_embeddings
    assert loader.load_reference(path, dtype=torch.float32, context=limit).cfg.max_position_embeddings == limit
    with pytest.raises(ValueError, match=f"a context of {limit + 1} tokens exceeds max_position_embeddings {limit}"):
        loader.load_reference(path, dtype=torch.float32, context=limit + 1)


def test_diffusion_gemma_skips_its_whole_vision_side_and_keeps_the_text():
    """Only the text model runs: every tensor of DiffusionGemma's vision tower and of its vision embedding
    is skipped, and no other."""
    files = loader.checkpoint_files(FIXTURES / "diffusion_gemma_tiny")
    kept, skipped = loader.vision_skipped("diffusion_gemma", files)
    vision = sorted(name for name in files if "vision" in name)
    assert any("embed_vision" in name for name in vision) and any("vision_tower" in name for name in vision)
    assert skipped == vision and sorted(kept) == sorted(set(files) - set(vision))
