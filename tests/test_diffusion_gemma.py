"""DiffusionGemma (nanodllm/gemma.py): parity with transformers on tests/fixtures/diffusion_gemma_tiny,
its config and loader. The fixture and its goldens come from transformers' own classes
(`PYTHONPATH=<transformers 5.24> python scripts/make_fixtures.py diffusion_gemma`): random weights with
norms, router scales and both sets of layer scalars away from 1, a prompt longer than the sliding window,
full layers of another head_dim and KV head count; float32 logits of a prefill + first denoising step,
a self-conditioned step and a step after a commit, and every layer's cache after the prefill and the
commit. These tests need only torch + safetensors. Run with `pytest -s` to see the max differences.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import nanodllm.experts as experts_module
import nanodllm.gemma as gemma_module
from nanodllm.kernels.expert_linear import expert_linear, group_by_expert_reference
from nanodllm.config import ModelConfig
from nanodllm.fused import FusedModel
from nanodllm.gemma import DiffusionGemma, GemmaExperts, GemmaRMSNorm, GemmaRope, attend, attend_keys
from nanodllm.gemma_cache import GemmaCache
from nanodllm.loader import CheckpointError, build_empty, build_random, load_model, load_reference
from nanodllm.parallel import Group
from tests.device import DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FIXTURE = Path(__file__).parent / "fixtures" / "diffusion_gemma_tiny"
RAW = json.loads((FIXTURE / "config.json").read_text())
GOLDEN = load_file(str(FIXTURE / "golden.safetensors"))
MODEL = load_reference(FIXTURE, dtype=torch.float32)
LOGITS_TOLERANCE = 2e-4  # float32 noise on logits of scale ~20 (transformers' own eager and sdpa differ ~1e-4)
CACHE_TOLERANCE = 1e-5


def close(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert got.dtype == torch.float32 and got.shape == expected.shape, (name, got.shape, expected.shape)
    diff = (got - expected).abs().max().item()
    print(f"\n{name}: max |nanodllm - transformers| = {diff:.2e} (scale {expected.abs().max():.1f})")
    assert diff < tolerance, f"{name}: {diff:.2e} >= {tolerance}"


@torch.no_grad()
def first_step(model: DiffusionGemma = MODEL) -> tuple[torch.Tensor, GemmaCache]:
    cache = model.empty_cache(GOLDEN["prompt"].shape[0])
    model.encode(GOLDEN["prompt"], cache)
    return model.denoise(GOLDEN["canvas"], cache), cache


def check_cache(cache: GemmaCache, when: str) -> None:
    cfg = MODEL.cfg
    for layer in range(cfg.num_layers):
        keys, values = cache.in_order(layer)
        close(f"{when} keys {layer}", keys, GOLDEN[f"{when}.keys.{layer}"], CACHE_TOLERANCE)
        close(f"{when} values {layer}", values, GOLDEN[f"{when}.values.{layer}"], CACHE_TOLERANCE)
        if cfg.gemma.is_sliding(layer):
            assert keys.shape[2] == cfg.gemma.sliding_window - 1 < cache.length


# ------------------------------------------------------------------------------------------------
# parity with transformers


def test_the_fixture_has_the_shapes_the_parity_needs():
    g = MODEL.cfg.gemma
    assert GOLDEN["prompt"].shape[1] > g.sliding_window and g.global_head_dim != MODEL.cfg.head_dim
    assert g.global_kv_heads != MODEL.cfg.num_kv_heads and 0 < g.global_rotated_pairs < g.global_head_dim // 2
    for layer in MODEL.layers:
        assert (layer.encoder_scalar != layer.denoiser_scalar).all() and (layer.input_layernorm.weight != 1).any()


def test_prefill_and_first_step_match_transformers():
    logits, cache = first_step()
    close("first step logits", logits, GOLDEN["first_step"], LOGITS_TOLERANCE)
    assert torch.equal(logits.argmax(-1), GOLDEN["first_step"].argmax(-1))
    check_cache(cache, "prefill")


@torch.no_grad()
def test_self_conditioned_step_matches_transformers():
    _, cache = first_step()
    logits = MODEL.denoise(GOLDEN["renoised"], cache, GOLDEN["first_step"])
    close("self-conditioned step logits", logits, GOLDEN["self_conditioned_step"], LOGITS_TOLERANCE)
    assert torch.equal(logits.argmax(-1), GOLDEN["committed"])
    unconditioned = MODEL.denoise(GOLDEN["renoised"], cache)
    assert (unconditioned - GOLDEN["self_conditioned_step"]).abs().max() > 1e-2, "self-conditioning takes effect"


@torch.no_grad()
def test_a_certain_distribution_self_conditions_as_its_tokens_embedding():
    """softmax(logits) E sqrt(hidden) of logits sure of one token is that token's embedding, scale included
    (the pre_norm after it all but hides a missing scale from the goldens)."""
    ids = torch.tensor([[3, 0, 255, 17]])
    sure = torch.zeros(1, 4, MODEL.cfg.vocab_size).scatter(-1, ids[..., None], 1e4)
    torch.testing.assert_close(MODEL.soft_embedding(sure), MODEL.embed(ids), rtol=1e-3, atol=1e-5)


@torch.no_grad()
def test_commit_and_next_step_match_transformers():
    _, cache = first_step()
    MODEL.encode(GOLDEN["committed"], cache)
    assert cache.length == GOLDEN["prompt"].shape[1] + GOLDEN["committed"].shape[1]
    check_cache(cache, "commit")
    close("step after commit logits", MODEL.denoise(GOLDEN["next_canvas"], cache), GOLDEN["step_after_commit"],
          LOGITS_TOLERANCE)


@torch.no_grad()
def test_a_row_decodes_as_it_would_alone():
    """In float64, where the other row's presence could show above the rounding."""
    model = load_reference(FIXTURE, dtype=torch.float64)
    logits, _ = first_step(model)
    cache = model.empty_cache(1)
    model.encode(GOLDEN["prompt"][1:], cache)
    assert (model.denoise(GOLDEN["canvas"][1:], cache) - logits[1:]).abs().max() < 1e-9


@torch.no_grad()
@pytest.mark.parametrize("pieces", [(1,) * 21, (3, 5, 2, 11), (13, 8)])
def test_encoding_in_pieces_equals_encoding_at_once(pieces):
    """The ring of a sliding layer, written a few tokens at a time (wrapping around), holds what one pass
    leaves, and the denoiser reads the same from it (float64)."""
    model = load_reference(FIXTURE, dtype=torch.float64)
    tokens = torch.cat([GOLDEN["prompt"], GOLDEN["committed"]], dim=1)
    whole, pieced = model.empty_cache(2), model.empty_cache(2)
    model.encode(tokens, whole)
    for start, length in zip(torch.tensor((0,) + pieces).cumsum(0).tolist(), pieces):
        model.encode(tokens[:, start:start + length], pieced)
    for layer in range(model.cfg.num_layers):
        for got, expected in zip(pieced.in_order(layer), whole.in_order(layer)):
            assert (got - expected).abs().max() < 1e-10
    canvas = GOLDEN["next_canvas"]
    assert (model.denoise(canvas, pieced) - model.denoise(canvas, whole)).abs().max() < 1e-9


@torch.no_grad()
def test_a_commit_refills_the_windows_where_they_lie():
    """Once the rings are full a commit lays each sliding layer's window out again in the same storage (a step's
    graph reads it there in later canvases): the ring by position, and the device-side position moves with it."""
    model = load_reference(FIXTURE, dtype=torch.float64)
    cache = model.empty_cache(2)
    model.encode(GOLDEN["prompt"], cache)
    storage = [(keys.data_ptr(), values.data_ptr()) for keys, values in filter(None, cache.windows)]
    model.encode(GOLDEN["committed"], cache)
    assert [(keys.data_ptr(), values.data_ptr()) for keys, values in filter(None, cache.windows)] == storage
    for layer, window in enumerate(cache.windows):
        if window is not None:
            for laid_out, ring in zip(window, cache.ring_in_order(layer)):
                assert torch.equal(laid_out[:, :, : cache.window_width], ring)
    assert int(cache.start) == cache.length == GOLDEN["prompt"].shape[1] + GOLDEN["committed"].shape[1]


@torch.no_grad()
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_encoding_a_few_queries_at_a_time_equals_all_at_once(chunk, monkeypatch):
    """ENCODE_CHUNK query rows at a time, each against the keys in its reach (a sliding layer's window,
    reaching back into the ring of an earlier pass; a left-padded row): the caches and the denoiser's
    logits of one pass (float64)."""
    model = load_reference(FIXTURE, dtype=torch.float64)
    valid = torch.ones_like(GOLDEN["prompt"], dtype=torch.bool)
    valid[1, :4] = False

    def encoded():
        cache = model.empty_cache(2)
        model.encode(GOLDEN["prompt"], cache, valid)
        model.encode(GOLDEN["committed"], cache)
        return cache

    whole = encoded()
    monkeypatch.setattr(gemma_module, "ENCODE_CHUNK", chunk)
    chunked = encoded()
    for layer in range(model.cfg.num_layers):
        for got, expected in zip(chunked.in_order(layer), whole.in_order(layer)):
            assert (got - expected).abs().max() < 1e-10
    canvas = GOLDEN["next_canvas"]
    assert (model.denoise(canvas, chunked) - model.denoise(canvas, whole)).abs().max() < 1e-9


def model_of_wide_full_layers() -> DiffusionGemma:
    """Random float16 weights of the fixture's shapes but full layers of head_dim 64, which the kernels take."""
    raw = copy.deepcopy(RAW)
    raw["text_config"]["global_head_dim"] = 64
    torch.manual_seed(0)
    return build_random(ModelConfig.from_dict(raw, source="test"), device=DEVICE, dtype=torch.float16)


def prompt_and_commit(model) -> GemmaCache:
    """A cache after the golden prompt (its second row with 4 left pads) and a commit; the full layers' slots that
    no row has written hold noise, which no key may read."""
    cache = model.empty_cache(2)
    for buffer in filter(lambda x: x is not None, cache.full.keys + cache.full.values):
        buffer.normal_(generator=torch.Generator(DEVICE).manual_seed(1))
    prompt = GOLDEN["prompt"].to(DEVICE)
    valid = torch.ones_like(prompt, dtype=torch.bool)
    valid[1, :4] = False
    model.encode(prompt, cache, valid)
    model.encode(GOLDEN["committed"].to(DEVICE), cache)
    return cache


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("wide_from", [512, 64])
def test_the_encoders_full_layers_on_the_kernel_equal_attend(wide_from, monkeypatch):
    """flash_attention (causal, scale 1, a left-padded row's pads hidden) in a prompt's pass, and in a commit's
    the cached keys read in place up to the launch bound (on flash_attention, or wide_attention from
    head_dim wide_from) merged with the new ones' causal part (attend_after_cache), float16 (Triton's
    interpreter on a CPU), against attend: every layer's cache after both, on random weights with full
    layers of head_dim 64."""
    import nanodllm.attention as attention_module
    import nanodllm.gemma as gemma_module

    monkeypatch.setattr(gemma_module, "WIDE_FROM", wide_from)
    model = model_of_wide_full_layers()
    encoded = lambda: [prompt_and_commit(model).in_order(layer) for layer in range(model.cfg.num_layers)]
    expected = encoded()
    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))
    for layer, (got, want) in enumerate(zip(encoded(), expected)):
        for a, b in zip(got, want):
            assert (a.float() - b.float()).abs().max() < 2e-2 * b.float().abs().max(), layer


@torch.no_grad()  # the kernels run outside autograd
def test_a_prompts_full_layers_in_chunks_equal_attend(monkeypatch):
    """A prompt without pads at a head_dim that takes wide_attention: its full layers attend in chunks of
    PROMPT_CHUNK queries (here 4; the keys before each chunk on wide_attention, the chunk itself causally on
    flash_attention, merged), float16 (Triton's interpreter on a CPU), against attend: the last hidden state
    and every layer's cache, on random weights with full layers of head_dim 64."""
    import nanodllm.attention as attention_module
    import nanodllm.gemma as gemma_module

    model = model_of_wide_full_layers()
    prompt = GOLDEN["prompt"].to(DEVICE)

    def encoded():
        cache = model.empty_cache(2)
        hidden = model.encode(prompt, cache)
        return [hidden] + [x for layer in range(model.cfg.num_layers) for x in cache.in_order(layer)]

    expected = encoded()
    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gemma_module, "WIDE_FROM", 64)
    monkeypatch.setattr(gemma_module, "PROMPT_CHUNK", 4)
    assert prompt.shape[1] > 2 * gemma_module.PROMPT_CHUNK
    for got, want in zip(encoded(), expected):
        assert (got.float() - want.float()).abs().max() < 2e-2 * want.float().abs().max()


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("wide_from", [512, 64])
def test_the_denoisers_full_layers_on_the_kernel_equal_attend(wide_from, monkeypatch):
    """A denoising step's full layers on flash_attention (or wide_attention from head_dim wide_from) read every
    slot of the cache, each row's own tokens then the canvas, the slots after (noise here) hidden
    (GemmaCache.full_launch): float16 (Triton's interpreter on a CPU) against attend over the keys by
    position, the logits after a left-padded prompt and a commit, on random weights with full layers of
    head_dim 64."""
    import nanodllm.attention as attention_module
    import nanodllm.gemma as gemma_module

    monkeypatch.setattr(gemma_module, "WIDE_FROM", wide_from)
    model = model_of_wide_full_layers()

    def denoised():
        cache = prompt_and_commit(model)
        return model.denoise(GOLDEN["next_canvas"].to(DEVICE), cache), cache.full.capacity - cache.length - 8

    expected, _ = denoised()
    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))
    got, hidden_tail = denoised()
    assert hidden_tail > 0 and (got - expected).abs().max() < 2e-2 * expected.abs().max()


@pytest.mark.parametrize("head_dim", [16, 512])
def test_attention_of_grouped_heads_with_and_without_a_mask(head_dim):
    """attend on the test device (SDPA over each KV head's group on a GPU) against softmax(q k^T + mask) v
    in float64, GQA 8:1 as the full layers', a pad key hidden from every query and a query seeing one key."""
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(2, heads, 5, head_dim, generator=generator) for heads in (16, 2, 2))
    visible = torch.ones(2, 5, 5, dtype=torch.bool)
    visible[1, :, 0], visible[0, 2] = False, torch.arange(5) == 3
    for mask in (None, visible):
        scores = q.double().view(2, 2, 8, 5, head_dim) @ k.double()[:, :, None].transpose(-1, -2)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        expected = (scores.softmax(-1) @ v.double()[:, :, None]).view(2, 16, 5, head_dim)
        got = attend(*(x.to(DEVICE) for x in (q, k, v)), None if mask is None else mask.to(DEVICE))
        assert (got.cpu().double() - expected).abs().max() < 2e-3  # TF32 dots on a GPU


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("head_dim", [256, 512])
def test_the_denoisers_attention_on_the_kernel_equals_attend(head_dim, monkeypatch):
    """attend_keys where the kernels run (float16; Triton's interpreter on a CPU): the flash kernel at scale 1,
    GQA 8:1 and one row's first keys hidden, against attend's float64 sums."""
    import nanodllm.attention as attention_module

    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (0.5 * torch.randn(2, heads, n, head_dim, generator=generator)
               for heads, n in ((16, 8), (2, 20), (2, 20)))
    key_valid = torch.ones(2, 20, dtype=torch.bool)
    key_valid[1, :4] = False
    q, k, v = (x.half() for x in (q, k, v))
    got = attend_keys(*(x.to(DEVICE) for x in (q, k, v)), key_valid.to(DEVICE))
    expected = attend(q.double(), k.double(), v.double(), key_valid[:, None, :].expand(-1, 8, -1))
    assert (got.cpu().double() - expected).abs().max() < 2e-3


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("weighted", [True, False])
def test_the_norms_on_the_kernel_equal_their_torch_form(weighted, kernels_on):
    """GemmaRMSNorm through kernels/rmsnorm.py (float16; Triton's interpreter on a CPU), on the residual
    stream and on a head-major view of projected heads: x * rstd * w rounded once, as in torch."""
    generator = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(64, 1e-6, weight=weighted).to(DEVICE)
    if weighted:
        norm.weight.data = (1 + torch.randn(64, generator=generator)).to(DEVICE)
    norm = norm.half()
    stream = (3 * torch.randn(2, 9, 64, generator=generator)).half().to(DEVICE)
    heads = (3 * torch.randn(2, 9, 4, 64, generator=generator)).half().to(DEVICE).transpose(1, 2)
    for x in (stream, heads):
        got = norm(x)
        with torch.enable_grad():  # the kernels run outside autograd: this is the torch form
            expected = norm(x).detach()
        assert got.dtype == x.dtype and int((got != expected).sum()) <= 1 + got.numel() // 100
        assert (got.float() - expected.float()).abs().max() <= 2e-3 * expected.float().abs().max()


@torch.no_grad()  # the kernels run outside autograd
def test_the_head_and_the_soft_embedding_on_the_kernels_equal_their_torch_form(kernels_on, monkeypatch):
    """The softcapped head and the self-conditioning's softmax through kernels/vocab_rows.py (float16;
    Triton's interpreter on a CPU) give the torch form's logits and embedding."""
    generator = torch.Generator().manual_seed(5)
    model = load_reference(FIXTURE, device=DEVICE, dtype=torch.float16)
    hidden = torch.randn(2, 7, model.cfg.hidden_size, generator=generator).half().to(DEVICE)
    z = (4 * torch.randn(2, 7, model.cfg.vocab_size, generator=generator)).half().to(DEVICE)
    calls = []
    for name in ("softcap", "soft_probs"):
        kernel = getattr(gemma_module, name)
        monkeypatch.setattr(gemma_module, name, lambda *a, kernel=kernel: calls.append(kernel) or kernel(*a))
    got = model.head(hidden, 2), model.soft_embedding(z)
    with torch.enable_grad():  # the kernels run outside autograd: this is the torch form
        expected = model.head(hidden, 2).detach(), model.soft_embedding(z).detach()
    assert len(calls) == 2
    torch.testing.assert_close(got[0], expected[0], rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=2e-3, atol=2e-3)


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("head_dim, pairs", [(64, 32), (128, 16)])  # full turn; proportional (a quarter)
def test_rope_on_the_kernel_equals_its_torch_form_bit_for_bit(head_dim, pairs, kernels_on):
    """GemmaRope through kernels/rope.py (float16; Triton's interpreter on a CPU) on a head-major view of
    projected heads: its 16-bit tables and products rounded as torch rounds them, so the same bits."""
    generator = torch.Generator().manual_seed(head_dim)
    rope = GemmaRope(torch.arange(5, 14).to(DEVICE), head_dim, 10000.0, pairs, torch.float16)
    x = (3 * torch.randn(2, 9, 4, head_dim, generator=generator)).half().to(DEVICE).transpose(1, 2)
    got = rope.apply(x)
    with torch.enable_grad():  # the kernels run outside autograd: this is the torch form
        expected = rope.apply(x)
    assert torch.equal(got, expected)


def experts_layer(kernels: bool, request) -> tuple[torch.nn.Module, torch.dtype]:
    """The fixture's second layer in float32, or on the kernels in bfloat16 on a GPU (float16 in Triton's
    interpreter), and its dtype."""
    if not kernels:
        return MODEL.layers[1], torch.float32
    request.getfixturevalue("kernels_on")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    return copy.deepcopy(MODEL.layers[1]).to(DEVICE, dtype), dtype


@torch.no_grad()
@pytest.mark.parametrize("kernels", [False, True])
def test_the_grouped_experts_equal_the_per_expert_loop(kernels, request, monkeypatch):
    """The GPU's path (two grouped matmuls over the rows sorted by expert, then their weighted sum in torch;
    on the kernels kernels/expert_linear.py's and kernels/moe_combine.py) against transformers' order on the
    fixture's experts: many tokens, every expert chosen, and a few, some experts idle. float32, on the
    kernels bfloat16 on a GPU and float16 in the interpreter, to the dtype's rounding."""
    layer, dtype = experts_layer(kernels, request)
    device = layer.experts.down_proj.device
    calls = []
    monkeypatch.setattr(experts_module, "expert_linear", lambda *a: calls.append((a[3:4], len(a))) or expert_linear(*a))
    for tokens in (200, 3):
        x = torch.randn(tokens, MODEL.cfg.hidden_size,
                        generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
        chosen, weights = layer.router(x)
        with monkeypatch.context() as loop_only:
            loop_only.setattr(gemma_module, "GROUPED_MM", None)
            expected = layer.experts(x, chosen, weights).float()
        error = (layer.experts.grouped(x, chosen, weights).float() - expected).abs().max()
        assert error <= (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max()
    gate_up_then_down = [(("gelu_tanh",), 6), ((), 3)]  # gate/up gathers the tokens' rows as it loads them
    assert calls == (gate_up_then_down * 2 if kernels else []), "few rows per expert: gate/up, then down"


@torch.no_grad()
@pytest.mark.parametrize("kernels", [False, True])
def test_the_ranks_shares_of_the_experts_sum_to_the_layer(kernels, request):
    """A model split over ranks holds the experts in ranges (nanodllm/parallel.py): each share's grouped path
    (the other ranks' rows after its last group, zeroed) and its loop give its experts' part, and the shares
    sum to the whole layer's; no share alone is the whole. Two and four ranks, 200 tokens and 3."""
    whole, dtype = experts_layer(kernels, request)
    device, count = whole.experts.down_proj.device, MODEL.cfg.moe.num_experts
    for world, tokens in ((2, 200), (4, 3)):
        x = torch.randn(tokens, MODEL.cfg.hidden_size, generator=torch.Generator().manual_seed(world)).to(device, dtype)
        chosen, weights = whole.router(x)
        expected = whole.experts.grouped(x, chosen, weights).float()
        grouped, looped = [], []
        for rank in range(world):
            held = range(rank * count // world, (rank + 1) * count // world)
            share = GemmaExperts(MODEL.cfg, held).to(device, dtype)
            share.gate_up_proj.copy_(whole.experts.gate_up_proj[held.start : held.stop])
            share.down_proj.copy_(whole.experts.down_proj[held.start : held.stop])
            grouped.append(share.grouped(x, chosen, weights).float())
            looped.append(share(x.float(), chosen, weights).float() if not kernels else grouped[-1])
        tolerance = (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max()
        assert (sum(grouped) - expected).abs().max() <= tolerance and (sum(looped) - expected).abs().max() <= tolerance
        assert all((share - expected).abs().max() > tolerance for share in grouped)


@torch.no_grad()
def test_the_experts_take_a_long_pass_in_pieces(monkeypatch):
    """Past GROUPED_TOKENS tokens the grouped path runs piece by piece (a long prompt's gathered rows would
    not fit): the same outputs as in one piece, to float32 rounding (the matmuls' shapes change)."""
    layer, x = MODEL.layers[1], torch.randn(50, MODEL.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    chosen, weights = layer.router(x)
    whole = layer.experts.grouped(x, chosen, weights)
    pieces = []
    monkeypatch.setattr(gemma_module, "GROUPED_TOKENS", 16)
    monkeypatch.setattr(experts_module, "group_by_expert_reference",  # float32 on the CPU: off the kernels
                        lambda c, *n: pieces.append(len(c)) or group_by_expert_reference(c, *n))
    assert (layer.experts.grouped(x, chosen, weights) - whole).abs().max() <= 1e-6 * whole.abs().max()
    assert pieces == [16, 16, 16, 2]


@torch.no_grad()
def test_the_fixture_catches_each_mistake():
    """Swapped encoder and denoiser scalars, a sliding layer reading the last W (not W - 1) cached tokens,
    a norm of x * (1 + w), a router on the normed residual: each misses the goldens by far."""
    expected = GOLDEN["first_step"]
    wrong_window = dataclasses.replace(MODEL.cfg.gemma, sliding_window=MODEL.cfg.gemma.sliding_window + 1)
    cache = GemmaCache(dataclasses.replace(MODEL.cfg, gemma=wrong_window), 2, 64, "cpu", torch.float32)
    MODEL.encode(GOLDEN["prompt"], cache)
    assert (MODEL.denoise(GOLDEN["canvas"], cache) - expected).abs().max() > 1e-2
    mistakes = {
        "scalars": lambda layer: setattr(layer, "encoder_scalar", layer.denoiser_scalar),
        "norm": lambda layer: layer.post_attention_layernorm.weight.add_(1.0),
        "router": lambda layer: setattr(layer.router, "norm", layer.pre_feedforward_layernorm_2),
    }
    for name, mistake in mistakes.items():
        model = copy.deepcopy(MODEL)
        for layer in model.layers:
            mistake(layer)
        assert (first_step(model)[0] - expected).abs().max() > 1e-2, name


# ------------------------------------------------------------------------------------------------
# config and loader


def test_the_config_reads_the_released_fields_and_transformers_saved_ones():
    cfg = ModelConfig.from_dict(RAW)
    assert (cfg.model_type, cfg.attention, cfg.mask_token_id, cfg.eos_token_ids) == (
        "diffusion_gemma", "encoder_decoder", None, (1, 106))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (8, 2, 1e4)
    assert cfg.gemma.layer_types == ("sliding_attention", "full_attention") * 2
    assert (cfg.gemma.global_head_dim, cfg.gemma.global_kv_heads, cfg.gemma.global_rotated_pairs) == (16, 1, 2)
    assert (cfg.gemma.logit_softcap, cfg.gemma.canvas_length, cfg.moe.experts_per_token) == (30.0, 8, 2)
    saved = copy.deepcopy(RAW)  # what transformers' save_pretrained writes instead of the two global fields
    text = saved["text_config"]
    del text["global_head_dim"], text["num_global_key_value_heads"], text["final_logit_softcapping"]
    text["per_layer_config"] = {"1": {"head_dim": 16, "num_key_value_heads": 1}, "3": {"head_dim": 16,
                                                                                       "num_key_value_heads": 1}}
    assert ModelConfig.from_dict(saved) == cfg


def test_without_layer_types_every_sixth_layer_and_the_last_are_full():
    """transformers' default layer_types: layer i is full where (i + 1) % 6 == 0 (the 6th, the 12th), the
    others sliding, and a last layer that is not full is made full."""
    raw = copy.deepcopy(RAW)
    del raw["text_config"]["layer_types"]
    full = lambda layers: [i for i, kind in enumerate(ModelConfig.from_dict(
        {**raw, "text_config": {**raw["text_config"], "num_hidden_layers": layers}}).gemma.layer_types)
        if kind == "full_attention"]
    assert full(12) == [5, 11] and full(14) == [5, 11, 13] and full(3) == [2]


@pytest.mark.parametrize("field, value", [
    ("sliding_window", 1), ("top_k_experts", 9), ("num_global_key_value_heads", 3), ("global_head_dim", 15),
    ("final_logit_softcapping", 0), ("use_bidirectional_attention", "all"), ("hidden_activation", "silu"),
    ("layer_types", ["sliding_attention"] * 3), ("per_layer_config", {"0": {"head_dim": 16}}),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6}}),
])
def test_a_field_out_of_range_is_refused_by_name(field, value):
    raw = copy.deepcopy(RAW)
    raw["text_config"][field] = value
    with pytest.raises(ValueError, match=field) as excinfo:
        ModelConfig.from_dict(raw, source="config.json")
    assert len(str(excinfo.value).splitlines()) == 1


def test_without_text_config_or_tied_embeddings_it_is_refused():
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"model_type": "diffusion_gemma"})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        ModelConfig.from_dict({**RAW, "tie_word_embeddings": False})


def test_every_text_tensor_loads_once_and_the_vision_tower_is_skipped(capsys):
    model = load_reference(FIXTURE, dtype=torch.float32)
    assert "16 vision tensors skipped" in capsys.readouterr().err
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name).float() for name in f.keys()}
    params = dict(model.named_parameters())
    text = {name: t for name, t in stored.items() if not name.startswith("model.encoder.") or "layer_scalar" in name}
    assert len(text) == len(params) and not any("lm_head" in name for name in stored)
    layer = model.layers[1]
    assert torch.equal(layer.encoder_scalar, stored["model.encoder.language_model.layers.1.layer_scalar"])
    assert torch.equal(layer.denoiser_scalar, stored["model.decoder.layers.1.layer_scalar"])
    assert torch.equal(layer.experts.gate_up_proj, stored["model.decoder.layers.1.experts.gate_up_proj"])
    assert layer.self_attn.v_proj is None and model.layers[0].self_attn.v_proj is not None  # K = V: full layers
    assert torch.equal(model.embed_tokens.weight, stored["model.decoder.embed_tokens.weight"])


def test_a_missing_encoder_scalar_is_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.encoder.language_model.layers.2.layer_scalar"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.encoder\.language_model\.layers\.2\.layer_scalar"):
        load_reference(path)


def test_the_fused_path_is_not_used_for_it(capsys):
    model = load_model(FIXTURE, dtype=torch.float32)
    assert isinstance(model, DiffusionGemma) and not isinstance(model, FusedModel)
    assert "reference model" in capsys.readouterr().err


def test_random_weights_keep_scales_at_one_and_a_split_divides_the_experts(capsys):
    model = build_random(MODEL.cfg, dtype=torch.float32)
    assert isinstance(model, DiffusionGemma) and "reference model" in capsys.readouterr().err
    for name, param in model.named_parameters():
        if name.endswith(("scale", "scalar", "norm.weight")):
            assert (param == 1).all(), name
    share = build_empty(MODEL.cfg, "meta", group=Group(1, 2))
    assert share.layers[0].experts.held == range(4, 8) and share.layers[0].self_attn.q_proj.weight.shape == \
        model.layers[0].self_attn.q_proj.weight.shape  # its experts alone are split
    with pytest.raises(ValueError, match="over 3 ranks needs moe.num_experts divisible by 3; this model has "
                                         "moe.num_experts=8"):
        build_empty(MODEL.cfg, "meta", group=Group(0, 3))
