"""nanodllm/fused.py against nanodllm/model.py: the fused model gives the reference's results.

fuse() builds it once from a reference model: its stacked Parameters hold the reference's rows in order
and move and cast as one. Off the kernels every fused primitive runs the reference's own ops on slices
of them (bit for bit). On the kernels (here: Triton's interpreter, float32, whose dots it computes
exactly) the stacked matmuls, the fused norms, RoPE and SwiGLU, the few-row step and the carried
residual give the reference's values up to the order of the RMS sums and exp's last bit, and the
engines decode the same tokens.
"""

import copy
import dataclasses

import pytest
import torch

import nanodllm.kernels.expert_linear as expert_module
import nanodllm.kernels.first_use as first_use
import nanodllm.kernels.norm_linear as norm_linear_module
import nanodllm.kernels.rmsnorm as rmsnorm_module
import nanodllm.kernels.rope as rope_module
import nanodllm.kernels.silu_mul as silu_mul_module
import nanodllm.fused as fused_module
import nanodllm.fused_mlp as fused_mlp_module
import nanodllm.experts as experts_module
from nanodllm.kernels.expert_linear import expert_linear
from nanodllm.kernels.norm_linear import MAX_ROWS, norm_linear
from nanodllm.kernels.rmsnorm import rms_norm
from nanodllm.kernels.rope import apply_rope, rope_qk
from nanodllm.kernels.silu_mul import silu_mul
from nanodllm import block, masked
from nanodllm.attention import attention
from nanodllm.config import GenerationConfig, ModelConfig
from nanodllm.fused import FusedLayer, FusedMLP, FusedModel, FusedRMSNorm, fuse
from nanodllm.loader import build_empty, build_random
from nanodllm.model import Model, RMSNorm
from tests.device import DEVICE
from tests.tiny_models import random_prompt, tiny_config, tiny_model

QWEN2_RAW = dict(model_type="Dream", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=300)
dense = lambda layer, q, k, v: attention(q, k, v)


def random_weights(model, seed=0, scale=0.3):
    """Every weight random, norms around 1 (so a dropped norm weight shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale + (1.0 if param.dim() == 1 else 0.0))
    return model


def fused_and_reference(cfg: ModelConfig, dtype=torch.float64, seed=0):
    """A fused model (built as the loader builds it: a reference model, fused) and that reference."""
    reference = random_weights(build_empty(cfg, dtype=dtype), seed)
    return fuse(copy.deepcopy(reference)).to(DEVICE), reference.to(DEVICE)


def owns_its_storage(param: torch.Tensor) -> bool:
    return param.untyped_storage().nbytes() == param.numel() * param.element_size()


@pytest.mark.parametrize("cfg", [tiny_config("sdar"), ModelConfig.from_dict(QWEN2_RAW),
                                 tiny_config("sdar", tie_word_embeddings=True)], ids=["sdar", "Dream", "tied"])
def test_the_stacked_parameters_hold_the_reference_rows_and_move_as_one(cfg):
    """qkv_proj holds q's, k's and v's rows (and biases), gate_up_proj gate's and up's, each its own
    Parameter over its own storage; .to(dtype) and .to(device) keep them so (and the tied head the
    embedding), and the cast model still computes what the reference cast the same way computes."""
    model, reference = fused_and_reference(cfg)
    assert type(model) is FusedModel and type(reference) is Model
    layer, reference_layer = model.layers[0], reference.layers[0]
    attn, reference_attn = layer.self_attn, reference_layer.self_attn
    projections = [reference_attn.q_proj, reference_attn.k_proj, reference_attn.v_proj]
    assert torch.equal(attn.qkv_proj.weight, torch.cat([p.weight for p in projections]))
    assert (attn.qkv_proj.bias is None) == (not cfg.qkv_bias)
    if cfg.qkv_bias:
        assert torch.equal(attn.qkv_proj.bias, torch.cat([p.bias for p in projections]))
    mlp = reference_layer.mlp
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert torch.equal(layer.mlp.down_proj.weight, mlp.down_proj.weight)
    ids = torch.arange(9)[None].to(DEVICE) % cfg.vocab_size
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            model, reference = model.to(dtype).to(DEVICE), reference.to(dtype).to(DEVICE)
            assert torch.equal(model(ids, ids, dense), reference(ids, ids, dense))
        params = dict(model.named_parameters())
        assert all(isinstance(p, torch.nn.Parameter) and p.dtype == dtype and owns_its_storage(p)
                   for p in params.values())
        rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        assert params["layers.0.self_attn.qkv_proj.weight"].shape == (rows, cfg.hidden_size)
        assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_the_fused_model_is_built_of_its_own_classes_and_fusing_takes_the_reference_layers():
    """fuse constructs the fused modules (no class swapped on a reference module) and empties the
    reference's layer list as it goes, so that each reference layer can be freed once converted."""
    reference = random_weights(build_empty(tiny_config("sdar"), dtype=torch.float32))
    model = fuse(reference)
    assert len(reference.layers) == 0
    assert all(type(layer) is FusedLayer and type(layer.mlp) is FusedMLP for layer in model.layers)
    assert (type(model.norm) is type(model.layers[0].input_layernorm) is type(model.layers[1].self_attn.k_norm)
            is FusedRMSNorm)
    with torch.device("meta"):
        constructed = FusedModel(model.cfg)
    assert ([(n, p.shape) for n, p in constructed.named_parameters()]
            == [(n, p.shape) for n, p in model.named_parameters()])


def test_building_a_model_starts_no_first_use_thread(monkeypatch):
    """The first-use warm-up belongs to loading (load_model, build_random), not to the builders."""
    started = []
    monkeypatch.setattr(first_use, "start", lambda device, dtype: started.append(device))
    model = fuse(random_weights(build_empty(tiny_config("llada"), dtype=torch.float32)))
    assert started == [] and type(model) is FusedModel
    build_random(tiny_config("llada"), "cpu", torch.float32)
    assert started == ["cpu"]


@pytest.mark.parametrize("cfg", [tiny_config("sdar"), tiny_config("llada"),
                                 tiny_config("llada", attention_layer_norm=True),
                                 dataclasses.replace(tiny_config("sdar"), qkv_bias=True), tiny_config("llada2_moe"),
                                 tiny_config("sdar_moe")],
                         ids=["sdar", "llada", "llada-qk-norm", "sdar-bias", "llada2", "sdar-moe"])
def test_off_the_kernels_the_fused_model_is_the_reference(cfg):
    """float64 on the CPU: every fused primitive runs the reference's ops on slices of its stacked
    weights (the experts: MoE.forward's loop over them), bit for bit."""
    model, reference = fused_and_reference(cfg)
    ids = torch.arange(9)[None].to(DEVICE) % model.cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids, ids, dense), reference(ids, ids, dense))
        h = torch.randn(2, 9, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        h = h.to(DEVICE)
        rope, rope_ref = model.rope(ids.expand(2, -1)), reference.rope(ids.expand(2, -1))
        for primitive in ("qkv", "qk", "kv"):
            got, expected = (getattr(model.layers[0], primitive)(h, rope),
                             getattr(reference.layers[0], primitive)(h, rope_ref))
            assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
        for i in range(cfg.num_layers):  # tiny MoE configs: layer 0 dense, layer 1 experts
            layer, layer_ref = model.layers[i], reference.layers[i]
            assert torch.equal(layer.query(h, rope), layer_ref.query(h, rope_ref))
            assert torch.equal(layer.key(h, rope), layer_ref.key(h, rope_ref))
            assert torch.equal(layer.value(h), layer_ref.value(h))
            assert torch.equal(layer.mlp(h), layer_ref.mlp(h))
            assert torch.equal(layer(h, rope, lambda q, k, v: attention(q, k, v)),
                               layer_ref(h, rope_ref, lambda q, k, v: attention(q, k, v)))


@pytest.mark.parametrize("model_type, overrides", [("sdar", {}), ("llada", {}), ("sdar", {"qkv_bias": True}),
                                                   ("llada", {"qk_norm": "projection"})])
@pytest.mark.parametrize("rows", [(1, 8), (2, 16), (3, 11), (1, MAX_ROWS + 5)])
def test_on_the_kernels_the_fused_primitives_give_the_reference_values(kernels_on, monkeypatch, model_type, overrides,
                                                                       rows):
    """float32 in the interpreter: a layer's forward (over at most MAX_ROWS rows the few-row step, with
    norm_linear; over more the stacked matmuls and one-pass kernels), the whole model's hidden states
    (each MLP output carried into the next norm), qkv / qk / kv, and add_out, against the reference."""
    cfg = dataclasses.replace(tiny_config(model_type), **overrides)
    model, reference = fused_and_reference(cfg, torch.float32, seed=1)
    batch, t = rows
    generator = torch.Generator().manual_seed(batch * 100 + t)
    x = torch.randn(batch, t, cfg.hidden_size, generator=generator).to(DEVICE)
    o = torch.randn(batch, cfg.num_heads, t, cfg.head_dim, generator=generator).to(DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=generator).to(DEVICE)
    positions = torch.arange(t, device=DEVICE).expand(batch, t)
    attend = lambda q, k, v: attention(q, k, v)
    calls = []
    counted = lambda *args, **kwargs: calls.append(args[0].shape) or norm_linear(*args, **kwargs)
    monkeypatch.setattr(fused_module, "norm_linear", counted)
    monkeypatch.setattr(fused_module, "fills_device", lambda *args, **kwargs: True)  # a GPU too, at tiny widths
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        layer, layer_ref = model.layers[0], reference.layers[0]
        rope, rope_ref = model.rope(positions), reference.rope(positions)
        close(layer(x, rope, attend), layer_ref(x, rope_ref, attend))
        assert len(calls) == (2 if batch * t <= MAX_ROWS else 0)
        close(model.hidden(ids, positions, dense), reference.hidden(ids, positions, dense))
        for primitive in ("qkv", "qk", "kv"):
            for a, b in zip(getattr(layer, primitive)(x, rope), getattr(layer_ref, primitive)(x, rope_ref)):
                close(a, b)
        expected = x + layer_ref.out(o)
        added = x.clone()
        assert layer.add_out(added, o) is added
        close(added, expected)
        pending = torch.randn_like(x)
        summed = x.clone()
        close(layer.attn_norm(summed, pending), layer_ref.attn_norm(x + pending))
        close(summed, x + pending)  # the add is written into the stream


def test_the_few_row_step_adds_the_output_of_the_experts_before_it(kernels_on, monkeypatch):
    """A dense layer after a mixture of experts (SDAR-MoE's mlp_only_layers): the experts' output, carried
    to the next layer not yet added, is added in that layer's few-row step."""
    cfg = tiny_config("sdar_moe", num_hidden_layers=3, mlp_only_layers=[0, 2])
    model, reference = fused_and_reference(cfg, torch.float32, seed=3)
    calls = []
    counted = lambda *args, **kwargs: calls.append(args[0].shape) or norm_linear(*args, **kwargs)
    monkeypatch.setattr(fused_module, "norm_linear", counted)
    monkeypatch.setattr(fused_module, "fills_device", lambda *args, **kwargs: True)  # a GPU too, at tiny widths
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    positions = torch.arange(8, device=DEVICE)[None]
    with torch.no_grad():
        hidden, expected = model.hidden(ids, positions, dense), reference.hidden(ids, positions, dense)
    assert len(calls) == 4, "the two dense layers in the few-row step, the experts' layer not"
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [10, 13])
def test_a_long_input_goes_through_the_mlp_in_chunks(kernels_on, monkeypatch, tokens):
    """A prefill's MLP runs CHUNK_TOKENS rows at a time (the last chunk may be short): the same values
    as one pass, and one SwiGLU kernel call per chunk."""
    model, reference = fused_and_reference(tiny_config("sdar"), torch.float32, seed=2)
    x = torch.randn(1, tokens, model.cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    calls = []
    monkeypatch.setattr(fused_mlp_module, "silu_mul", lambda *args: calls.append(args[0].shape[0]) or silu_mul(*args))
    monkeypatch.setattr(fused_mlp_module, "CHUNK_TOKENS", 5)
    with torch.no_grad():
        chunked = model.layers[0].mlp(x)
        expected = reference.layers[0].mlp(x)
    assert calls == [5] * (tokens // 5) + ([tokens % 5] if tokens % 5 else [])
    torch.testing.assert_close(chunked, expected, rtol=1e-4, atol=1e-4)


def test_the_few_row_step_needs_few_rows_a_dense_mlp_and_weights_of_the_stream_dtype(kernels_on, monkeypatch):
    """... and projections that fill the GPU (kernels/norm_linear.py fills_device, asked of q/k/v and gate/up)."""
    model = random_weights(build_random(tiny_config("sdar"), dtype=torch.float32)).to(DEVICE)
    layer = model.layers[0]
    asked = []
    monkeypatch.setattr(fused_module, "fills_device", lambda weight, **kwargs: asked.append(weight) or True)
    with torch.no_grad():
        assert layer.takes_few_row_step(torch.zeros(1, MAX_ROWS, 32, device=DEVICE))
        projections = (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight)
        assert len(asked) == 2 and all(a is p for a, p in zip(asked, projections))
        for narrow in projections:
            monkeypatch.setattr(fused_module, "fills_device", lambda weight, narrow=narrow, **_: weight is not narrow)
            assert not layer.takes_few_row_step(torch.zeros(1, MAX_ROWS, 32, device=DEVICE))
        monkeypatch.setattr(fused_module, "fills_device", lambda *args, **kwargs: True)
        assert not layer.takes_few_row_step(torch.zeros(1, MAX_ROWS + 1, 32, device=DEVICE))
        assert not layer.takes_few_row_step(torch.zeros(1, 8, 64, device=DEVICE)[..., ::2])  # not contiguous
        assert not layer.takes_few_row_step(torch.zeros(1, 4, 32, device=DEVICE, dtype=torch.float16))
        gate_up = layer.mlp.gate_up_proj
        gate_up.weight = torch.nn.Parameter(gate_up.weight.double())  # a weight of another dtype
        assert not layer.takes_few_row_step(torch.zeros(1, 4, 32, device=DEVICE))
        moe = build_random(tiny_config("llada2_moe"), DEVICE, torch.float32)
        assert moe.layers[0].takes_few_row_step(torch.zeros(1, 4, 32, device=DEVICE))  # its dense layer
        assert not moe.layers[1].takes_few_row_step(torch.zeros(1, 4, 32, device=DEVICE))  # a mixture of experts


@pytest.mark.parametrize("model_type, overrides, kernels", [
    # per-head q/k norm fused into rope_qk; every forward has at most 32 rows: norms and SwiGLU in norm_linear
    ("sdar", {}, {"rms_norm", "rope_qk", "norm_linear"}),
    ("llada", {}, {"rms_norm", "rope_qk", "silu_mul"}),  # no q/k norm
    ("llada", {"attention_layer_norm": True}, {"rms_norm", "apply_rope", "silu_mul"}),  # norm over the projection
    # a dense layer (the few-row step), then experts; LLaDA2 rotates half of each head (rope_qk copies the rest)
    ("llada2_moe", {}, {"rms_norm", "rope_qk", "norm_linear", "silu_mul", "expert_linear"}),
    ("sdar_moe", {}, {"rms_norm", "rope_qk", "norm_linear", "expert_linear"}),
])
def test_engines_decode_the_same_tokens_on_the_fused_kernels(kernels_on, monkeypatch, model_type, overrides, kernels):
    """Tiny models (q/k norm on transposed views, block cache with gathered positions; the MoE models'
    dense layer in the few-row step, their experts on expert_linear, LLaDA2's half-rotated heads on
    rope_qk), float32 so that the interpreter's results are exact but for the RMS sums'
    order and exp's last bit."""
    model = tiny_model(model_type, dtype=torch.float32, block_size=4, **overrides).to(DEVICE)
    prompts = [random_prompt(9, seed=4), random_prompt(14, seed=5)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, remasking="low_confidence_static")
    decode = (lambda: block.generate(model, prompts, gen, stop_ids=()).tokens) if model_type != "llada" else (
        lambda: masked.generate(model, prompts, dataclasses.replace(gen, remasking="low_confidence")).tokens)
    calls = []
    counted = lambda fn: lambda *args, **kwargs: calls.append(fn.__name__) or fn(*args, **kwargs)
    for module, fn in ((rmsnorm_module, rms_norm), (rope_module, apply_rope), (rope_module, rope_qk),
                       (silu_mul_module, silu_mul), (norm_linear_module, norm_linear), (expert_module, expert_linear)):
        for fused_part in (fused_module, fused_mlp_module, experts_module):  # where the model calls them
            if hasattr(fused_part, fn.__name__):
                monkeypatch.setattr(fused_part, fn.__name__, counted(fn))
    monkeypatch.setattr(fused_module, "fills_device", lambda *args, **kwargs: True)  # a GPU too, at tiny widths
    monkeypatch.setattr("nanodllm.attention.KERNELS_ENABLED", False)
    torch_tokens = decode()
    assert not calls
    monkeypatch.setattr("nanodllm.attention.KERNELS_ENABLED", True)
    kernel_tokens = decode()
    assert set(calls) == kernels
    assert kernel_tokens == torch_tokens


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("cache_slice", [False, True])
def test_add_out_adds_o_proj_in_place(kernels_on, bias, contiguous, cache_slice):
    """FusedLayer.add_out: x += o_proj(o), through the matmul's epilogue (no bias, contiguous x; a
    batched matmul where o is a slice of a token-major cache, as DyLLM's response-only steps pass it)
    or a plain add; all give x + out(o) and return x itself."""
    model = tiny_model("llada", dtype=torch.float32)
    layer = model.layers[0]
    generator = torch.Generator().manual_seed(0)
    if bias:
        layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.randn(model.cfg.hidden_size, generator=generator))
    o = torch.randn(2, model.cfg.num_heads, 5, model.cfg.head_dim, generator=generator)
    if cache_slice:  # the last 5 of 9 rows of a [batch, rows, heads, d] cache, seen as [batch, heads, rows, d]
        cache = torch.randn(2, 9, model.cfg.num_heads, model.cfg.head_dim, generator=generator)
        o = cache.transpose(1, 2)[:, :, 4:]
    x = torch.randn(2, 5, model.cfg.hidden_size, generator=generator)
    if not contiguous:
        x = torch.randn(2, 10, model.cfg.hidden_size, generator=generator)[:, ::2]
    with torch.no_grad():
        expected = x + layer.out(o)
        assert layer.add_out(x, o) is x
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_adds_on_the_reference_path_too():
    """RMSNorm(x, add): x becomes x + add and the norm is of the sum."""
    norm = RMSNorm(16, 1e-6).double()
    generator = torch.Generator().manual_seed(1)
    x, add = (torch.randn(3, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    summed = x + add
    out = norm(x, add)
    assert torch.equal(x, summed)
    torch.testing.assert_close(out, norm(summed.clone()))
