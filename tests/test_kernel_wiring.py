"""The engines' attention routed through the Triton kernels (as on a GPU in float16 / bfloat16) gives
what the torch path gives. On the CPU the kernels run in Triton's interpreter: nanodllm.attention's
`use_kernels`, which every attention kernel's caller asks through attention_on_kernels, is switched
on for float16 tensors, whose dots the interpreter computes correctly (the model's fused norms stay
on torch: tests/test_fused.py has them). On a GPU the same tests run on CUDA tensors, the torch side
with the kernels switched off."""

import pytest
import torch

import nanodllm.attention as attention_module
from nanodllm import block, masked
from nanodllm.attention import CanvasMask, attention, cache_attention
from nanodllm.config import GenerationConfig
from tests.tiny_models import random_prompt, tiny_model
from tests.device import DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CALLS = []


@pytest.fixture
def attention_kernels_on(monkeypatch):
    """use_kernels(q) is True for float16 tensors; records each routed call's query shape."""

    def use_kernels(q):
        CALLS.append(tuple(q.shape))
        return q.dtype == torch.float16 and q.shape[-1] in attention_module.KERNEL_HEAD_DIMS

    CALLS.clear()
    monkeypatch.setattr(attention_module, "use_kernels", use_kernels)
    yield


def qkv(batch, heads, kv_heads, n_q, n_k, seed):
    generator = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(batch, h, n, 64, generator=generator).half().to(DEVICE)
    return make(heads, n_q), make(kv_heads, n_k), make(kv_heads, n_k)


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_canvas_mask_kernel_equals_dense_mask(attention_kernels_on, block_size, padded):
    q, k, v = qkv(2, 4, 2, 13, 13, seed=1)
    valid = torch.ones(2, 13, dtype=torch.bool, device=DEVICE)
    if padded:
        valid[1, 9:] = False  # right padding, as the block engine's prefill has
    mask = CanvasMask(valid=valid if padded else None, block_size=block_size)
    out = attention(q, k, v, mask)
    reference = attention_module.attention_reference(q, k, v, mask.dense(13, 13, q.device))
    rows = valid[:, None, :, None].expand_as(out)  # padded query rows are never read
    torch.testing.assert_close(out[rows], reference[rows], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("padded", [False, True])
def test_a_canvas_mask_over_the_last_queries_equals_the_kernels(attention_kernels_on, padded):
    """Queries are the canvas's last q_len columns: the dense mask of 5 queries over 13 keys (block-causal,
    blocks of 4) is the one flash_attention applies."""
    q, k, v = qkv(2, 4, 2, 5, 13, seed=7)
    valid = torch.ones(2, 13, dtype=torch.bool, device=DEVICE)
    if padded:
        valid[1, 11:] = False
    mask = CanvasMask(valid=valid if padded else None, block_size=4)
    out = attention(q, k, v, mask)
    reference = attention_module.attention_reference(q, k, v, mask.dense(5, 13, q.device))
    rows = valid[:, None, -5:, None].expand_as(out)  # padded query rows are never read
    torch.testing.assert_close(out[rows], reference[rows], atol=2e-3, rtol=2e-3)


def spy_on_kernels(monkeypatch, *names):
    """Wrap kernels/<name>.py's function <name> for each name, in every module that holds it; returns
    the list their calls append their names to."""
    import importlib
    import sys

    called = []
    for name in names:
        kernel = getattr(importlib.import_module(f"nanodllm.kernels.{name}"), name)
        spy = lambda *a, kernel=kernel, name=name, **kw: called.append(name) or kernel(*a, **kw)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("nanodllm") and getattr(module, name, None) is kernel:
                monkeypatch.setattr(module, name, spy)
    return called


@pytest.mark.parametrize("case, expected_kernel", [
    ("few queries, many keys", "decode_attention"),  # split over the keys
    ("many queries, many keys", "flash_attention"),
    ("few queries, few keys", "flash_attention"),
    ("more queries than keys", "flash_attention"),
    ("key mask per KV head", "flash_attention"),
    ("key mask shared by the heads", "flash_attention"),
    ("mask per query", None),  # torch
])
def test_attention_routes_and_equals_reference(attention_kernels_on, monkeypatch, case, expected_kernel):
    """attention() picks the kernel by shape and mask (SPLIT_MIN_KEYS and SPLIT_MAX_QUERIES lowered
    to 24 keys and 8 queries so the interpreter stays fast) and gives the reference's output, with
    GQA and ragged key masks."""
    monkeypatch.setattr(attention_module, "SPLIT_MIN_KEYS", 24)
    monkeypatch.setattr(attention_module, "SPLIT_MAX_QUERIES", 8)
    called = spy_on_kernels(monkeypatch, "decode_attention", "flash_attention")
    n_q, n_k = {"few queries, many keys": (8, 40), "many queries, many keys": (9, 40),
                "more queries than keys": (30, 20)}.get(case, (5, 20))
    q, k, v = qkv(2, 4, 2, n_q, n_k, seed=4)
    generator = torch.Generator().manual_seed(5)
    heads = {"key mask per KV head": 2, "mask per query": 1}.get(case, 1)
    mask = torch.rand(2, heads, n_q if case == "mask per query" else 1, n_k, generator=generator).to(DEVICE) < 0.6
    mask[..., 0] = True  # every query sees a key
    if case in ("few queries, many keys", "many queries, many keys", "few queries, few keys", "more queries than keys"):
        mask = None
    out = attention(q, k, v, mask)
    assert called == ([expected_kernel] if expected_kernel else [])
    torch.testing.assert_close(out, attention_module.attention_reference(q, k, v, mask), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n_q, n_k, expected_kernel", [(8, 40, "decode_attention"), (5, 20, "flash_attention")])
def test_a_custom_scale_reaches_every_attention_kernel(attention_kernels_on, monkeypatch, n_q, n_k, expected_kernel):
    """A score scale other than head_dim^-1/2 is applied on the split-KV route and on flash_attention alike
    (SPLIT_MIN_KEYS and SPLIT_MAX_QUERIES lowered as in test_attention_routes_and_equals_reference)."""
    monkeypatch.setattr(attention_module, "SPLIT_MIN_KEYS", 24)
    monkeypatch.setattr(attention_module, "SPLIT_MAX_QUERIES", 8)
    called = spy_on_kernels(monkeypatch, "decode_attention", "flash_attention")
    q, k, v = qkv(2, 4, 2, n_q, n_k, seed=6)
    out = attention(q, k, v, scale=0.05)
    assert called == [expected_kernel]
    torch.testing.assert_close(out, attention_module.attention_reference(q, k, v, scale=0.05), atol=2e-3, rtol=2e-3)


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("masked_per_kv_head", [False, True])
def test_head_dims_only_flash_takes_route_to_flash(kernels_on, monkeypatch, head_dim, masked_per_kv_head):
    """DiffusionGemma's head_dim 256 and 512: attention() reads them on flash_attention, few queries
    against many keys included (decode_attention takes 64 and 128 only), and gives the reference's
    output, keys hidden per KV head or none."""
    monkeypatch.setattr(attention_module, "SPLIT_MIN_KEYS", 24)
    monkeypatch.setattr(attention_module, "SPLIT_MAX_QUERIES", 8)
    called = spy_on_kernels(monkeypatch, "decode_attention", "flash_attention")
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (0.3 * torch.randn(2, heads, n, head_dim, generator=generator).half().to(DEVICE)
               for heads, n in ((4, 8), (2, 40), (2, 40)))
    mask = None
    if masked_per_kv_head:
        mask = (torch.rand(2, 2, 1, 40, generator=generator) < 0.6).to(DEVICE)
        mask[..., 0] = True
    out = attention(q, k, v, mask)
    assert called == ["flash_attention"]
    torch.testing.assert_close(out, attention_module.attention_reference(q, k, v, mask), atol=2e-3, rtol=2e-3)


def test_routing_limits_stay_within_the_kernels():
    """attention() and MaskKV's vote size their calls by their own copies of the kernels' limits:
    past a limit a call would raise instead of routing."""
    from nanodllm.kernels import decode_attention as decode_module
    from nanodllm.kernels import decode_inputs
    from nanodllm.methods import common

    assert attention_module.SPLIT_MAX_QUERIES <= decode_module.DENSE_MAX_QUERIES
    assert common.MASK_VOTE_QUERIES <= decode_inputs.MAX_QUERIES


def test_only_4d_bool_masks_reach_flash_attention():
    q, k, _ = qkv(2, 4, 2, 5, 20, seed=1)
    assert attention_module.as_kernel_mask(torch.ones(2, 2, 1, 20, dtype=torch.bool, device=DEVICE), q, k) is not None
    for mask in (torch.zeros(2, 1, 1, 20, device=DEVICE),  # additive
                 torch.ones(2, 20, dtype=torch.bool, device=DEVICE),  # not [batch, heads, queries, keys]
                 torch.ones(1, 1, 1, 20, dtype=torch.bool, device=DEVICE)):  # broadcast over the batch
        assert attention_module.as_kernel_mask(mask, q, k) is None


def test_cache_attention_kernel_equals_masked_torch(attention_kernels_on):
    q, _, _ = qkv(2, 4, 2, 5, 5, seed=2)
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(2, 40, 2, 64, generator=generator).half().to(DEVICE) for _ in range(2))
    lengths = torch.tensor([23, 37], device=DEVICE)
    out = cache_attention(q, k_cache, v_cache, lengths, 37, ragged=True)
    for row, n in enumerate(lengths.tolist()):
        keys, values = k_cache[row : row + 1, :n].transpose(1, 2), v_cache[row : row + 1, :n].transpose(1, 2)
        reference = attention_module.attention_reference(q[row : row + 1], keys, values)
        torch.testing.assert_close(out[row : row + 1], reference, atol=2e-3, rtol=2e-3)


def generate_both_ways(engine, model, prompts, gen, monkeypatch, make_method=None, **kwargs):
    """Tokens on torch, then on the kernels (attention_module.use_kernels switched; a fresh method
    from make_method for each run when given)."""
    run = lambda: engine.generate(model, prompts, gen, **kwargs, **({"method": make_method()} if make_method else {}))
    monkeypatch.setattr(attention_module, "use_kernels", lambda q: False)
    torch_tokens = run().tokens
    CALLS.clear()
    monkeypatch.setattr(attention_module, "use_kernels",
                        lambda q: CALLS.append(tuple(q.shape)) or q.dtype == torch.float16)
    kernel_tokens = run().tokens
    assert CALLS, "the engine never asked for attention"
    return torch_tokens, kernel_tokens


def test_block_engine_tokens_equal_on_kernels(monkeypatch):
    model = tiny_model("sdar", dtype=torch.float16, head_dim=64, block_size=4).to(DEVICE)
    prompts = [random_prompt(9, seed=4), random_prompt(14, seed=5)]  # ragged: prefill padding, per-row caches
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, remasking="low_confidence_static")
    torch_tokens, kernel_tokens = generate_both_ways(block, model, prompts, gen, monkeypatch, stop_ids=())
    assert kernel_tokens == torch_tokens


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_masked_engine_tokens_equal_on_kernels(monkeypatch, cfg_scale):
    model = tiny_model("llada", dtype=torch.float16, d_model=128, n_heads=2, n_kv_heads=2).to(DEVICE)  # head_dim 64
    prompts = [random_prompt(7, seed=6), random_prompt(12, seed=7)]  # left padding, hidden keys
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4, cfg_scale=cfg_scale)
    torch_tokens, kernel_tokens = generate_both_ways(masked, model, prompts, gen, monkeypatch)
    assert kernel_tokens == torch_tokens


@pytest.mark.parametrize("name, knobs, lengths, kernels_called", [
    # unpadded: the drift steps' few queries take the split-KV kernel
    ("dllm_cache", dict(prompt_interval=3, response_interval=2), (12, 12),
     {"decode_attention", "flash_attention", "value_drift"}),
    # padded prompts and per-head kept slots: key masks, so flash_attention; the vote on key_scores
    ("maskkv", dict(budget=5, prompt_interval=3, response_interval=2), (7, 12),
     {"flash_attention", "key_scores", "value_drift"}),
])
def test_cached_masked_methods_decode_the_same_tokens_on_kernels(monkeypatch, name, knobs, lengths, kernels_called):
    """dLLM-Cache and MaskKV through every kernel they reach (interpreted on a CPU): attention routed
    by shape, MaskKV's vote, the drift kernels; the same tokens as on torch. SPLIT_MIN_KEYS and
    SPLIT_MAX_QUERIES are lowered so these short canvases reach both attention kernels."""
    import nanodllm.methods.dllm_cache as dllm_cache_module
    from nanodllm.methods import get_method

    model = tiny_model("llada", dtype=torch.float16, d_model=128, n_heads=2, n_kv_heads=2).to(DEVICE)  # head_dim 64
    prompts = [random_prompt(n, seed=6 + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=8, block_length=4, steps=8)
    monkeypatch.setattr(attention_module, "SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(attention_module, "SPLIT_MAX_QUERIES", 8)  # the 12 prompt rows stay on flash_attention
    # the vote switches with attention (attention_on_kernels); so does the drift test here
    monkeypatch.setattr(dllm_cache_module, "use_kernels", lambda x: attention_module.use_kernels(x))
    called = spy_on_kernels(monkeypatch, "decode_attention", "flash_attention", "key_scores", "value_drift")
    torch_tokens, kernel_tokens = generate_both_ways(masked, model, prompts, gen, monkeypatch,
                                                     make_method=lambda: get_method(name, **knobs))
    assert kernel_tokens == torch_tokens
    assert set(called) == kernels_called


def test_a_canvas_masks_last_queries_are_the_last_rows_of_the_whole_canvases_mask():
    """CanvasMask's queries are the last q_len of the n columns: the dense mask of the last 5 queries is
    the last 5 rows of the whole canvas's, also where the canvas is left-padded."""
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, :3] = False
    for block_size in (None, 4):
        mask = CanvasMask(valid=valid, block_size=block_size)
        assert torch.equal(mask.dense(5, 13, "cpu"), mask.dense(13, 13, "cpu")[:, :, -5:])


def test_padded_queries_of_a_dense_mask_see_every_key_and_valid_ones_the_valid_keys():
    """key_padding_mask: a valid query sees the valid keys; a padded query sees every key (its softmax is
    defined: no NaN in the output)."""
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    mask = attention_module.key_padding_mask(valid, valid)
    for row in range(2):
        for query in range(6):
            expected = valid[row] if valid[row, query] else torch.ones(6, dtype=torch.bool)
            assert torch.equal(mask[row, 0, query], expected)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    assert not attention(q, k, v, CanvasMask(valid=valid)).isnan().any()


def test_a_mask_that_differs_per_query_on_the_kernels_equals_the_reference(attention_kernels_on):
    """A bool mask [batch, 1, q_len, k_len] that hides different keys from different queries is applied
    per query on the kernel route too (not as one key mask)."""
    q, k, v = qkv(2, 4, 2, 5, 20, seed=3)
    mask = torch.rand(2, 1, 5, 20, generator=torch.Generator().manual_seed(4)).to(DEVICE) < 0.6
    mask[..., 0] = True  # every query sees a key
    out = attention(q, k, v, mask)
    torch.testing.assert_close(out, attention_module.attention_reference(q, k, v, mask), atol=2e-3, rtol=2e-3)


def test_a_repeated_canvas_mask_is_the_masks_of_the_batch_repeated():
    """CanvasMask.repeat(times) (classifier-free guidance) is the mask of the batch concatenated `times`
    times: its dense form is the dense form repeated, per-row positions included."""
    valid = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    positions = (torch.arange(6)[None, :] - torch.tensor([[1], [0]])).clamp(min=0)
    mask = CanvasMask(valid=valid, block_size=2, positions=positions)
    dense = mask.dense(6, 6, "cpu")
    assert torch.equal(mask.repeat(3).dense(6, 6, "cpu"), torch.cat([dense] * 3))
