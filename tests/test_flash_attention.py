"""kernels/flash_attention.py against its plain-torch reference.

Without a GPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), with small
tiles drawn per example so that small shapes cross many tile edges. The interpreter's bf16 tl.dot is
wrong, so bf16 is only drawn on a GPU. Outputs are allocated NaN-filled: an element the kernel never
writes fails the comparison.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nanodllm.kernels.decode_attention as da
import nanodllm.kernels.flash_attention as fa
from nanodllm.kernels.flash_attention import flash_attention, flash_attention_reference
from tests.device import DEVICE

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# fp32 runs exact dots in the interpreter but TF32 ones on a GPU.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3}
LSE_TOLERANCE = {torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3}
# (BLOCK_M, BLOCK_N, V_PARTS): V_PARTS = 2 splits a head's output columns over two programs
INTERPRETER_TILES = [(16, 16, 1), (32, 16, 1), (16, 32, 1), (64, 32, 1), (32, 16, 2), (16, 32, 2)]
LAYOUTS = ["contiguous", "seq_major", "every_other_d"]


@contextmanager
def poisoned_outputs(tiles=(32, 16)):
    """Run with NaN-filled outputs (the key slices' partials too) and, in the interpreter, the given
    (BLOCK_M, BLOCK_N[, V_PARTS])."""
    def nan_output(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    with mock.patch.object(fa, "_output", nan_output), mock.patch.object(da, "DEBUG_POISON", True), \
            mock.patch.dict(fa.INTERPRETER_TILES, BLOCK_M=tiles[0], BLOCK_N=tiles[1], V_PARTS=(*tiles, 1)[2]):
        yield


@contextmanager
def sliced_keys(sms=64, min_keys=16):
    """A GPU of `sms` SMs and slices of at least min_keys keys, so small shapes take the key-sliced path
    (several slices per query tile, then merge_splits)."""
    with mock.patch.object(da, "INTERPRETER_SMS", sms), mock.patch.object(da, "sm_count", lambda device: sms), \
            mock.patch.object(fa, "MIN_KEYS_PER_SLICE", min_keys):
        yield


def random_heads(batch, heads, length, head_dim, dtype, layout, generator):
    """[batch, heads, length, head_dim] laid out as
    "contiguous":    itself;
    "seq_major":     the transposed view of a [batch, length, heads, head_dim] buffer, as a fused
                     projection or the KV cache gives;
    "every_other_d": every other element of a buffer with twice the head dim (head-dim stride 2)."""
    if layout == "seq_major":
        x = torch.randn(batch, length, heads, head_dim, generator=generator).to(dtype=dtype, device=DEVICE)
        return x.transpose(1, 2)
    if layout == "every_other_d":
        x = torch.randn(batch, heads, length, 2 * head_dim, generator=generator).to(dtype=dtype, device=DEVICE)
        return x[..., ::2]
    return torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype=dtype, device=DEVICE)


def padded_keys(pads, sides, n_k, sliced: bool):
    """k_valid [batch, n_k]: row r hides pads[r] keys on the left or right (a whole row if
    pads[r] == n_k). sliced gives a view into a wider tensor, so the batch stride is not n_k."""
    columns = torch.arange(n_k)
    rows = [columns >= pad if side == "left" else columns < n_k - pad for pad, side in zip(pads, sides)]
    valid = torch.stack(rows)
    if sliced:
        wide = torch.zeros(len(pads), n_k + 3, dtype=torch.bool)
        wide[:, 3:] = valid
        valid = wide[:, 3:]
    return valid.to(DEVICE)


def check_against_reference(q, k, v, tiles=(32, 16), **kwargs):
    with poisoned_outputs(tiles):
        out, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
    expected_out, expected_lse = flash_attention_reference(q, k, v, return_lse=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # [batch, N_q, heads, D] in memory: o_proj reads it as is
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), expected_out.float(), atol=tol, rtol=tol)
    lse_tol = LSE_TOLERANCE[q.dtype]
    torch.testing.assert_close(lse, expected_lse, atol=lse_tol, rtol=lse_tol)


@st.composite
def attention_cases(draw):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    num_kv_heads = 1 if group == 8 else draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([64, 128]))
    n_k = draw(st.integers(1, 72))
    mask = draw(st.sampled_from(["none", "causal", "block"]))
    # Under a (block-)causal mask the queries are the last N_q keys; without one they may outnumber them.
    queries = draw(st.sampled_from(["prefill", "one", "suffix"] + (["more"] if mask == "none" else [])))
    n_q = {"prefill": n_k, "one": 1}.get(queries) or draw(st.integers(1, n_k) if queries == "suffix" else
                                                           st.integers(n_k + 1, n_k + 40))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    seed = draw(st.integers(0, 2**16))

    kwargs = {"causal": True} if mask == "causal" else {}
    if mask == "block":
        kwargs["block_size"] = draw(st.sampled_from([1, 3, 4, 32]))
    key_mask = draw(st.sampled_from(["none", "padding", "per_kv_head"]))
    if key_mask == "padding":
        pads = draw(st.lists(st.integers(0, n_k), min_size=batch, max_size=batch))
        sides = draw(st.lists(st.sampled_from(["left", "right"]), min_size=batch, max_size=batch))
        kwargs["k_valid"] = padded_keys(pads, sides, n_k, sliced=draw(st.booleans()))
    elif key_mask == "per_kv_head":  # each KV head hides its own keys (a cache keeping different keys per head)
        shown = draw(st.sampled_from([0.2, 0.7, 1.0]))
        mask_generator = torch.Generator().manual_seed(seed + 1)
        kwargs["k_valid"] = (torch.rand(batch, num_kv_heads, n_k, generator=mask_generator) < shown).to(DEVICE)
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.sampled_from([0.05, 0.3]))

    generator = torch.Generator().manual_seed(seed)
    q = random_heads(batch, group * num_kv_heads, n_q, head_dim, dtype, layout, generator)
    k = random_heads(batch, num_kv_heads, n_k, head_dim, dtype, layout, generator)
    v = random_heads(batch, num_kv_heads, n_k, head_dim, dtype, layout, generator)
    tiles = draw(st.sampled_from(INTERPRETER_TILES))
    return q, k, v, tiles, kwargs


@given(attention_cases())
def test_matches_reference(case):
    q, k, v, tiles, kwargs = case
    check_against_reference(q, k, v, tiles, **kwargs)


@settings(max_examples=15, deadline=None)  # the unsliced path's property test draws the rest of the space
@given(attention_cases())
def test_key_slices_merge_to_the_reference(case):
    """Every mask and key mask with the keys cut into slices (rows no slice shows a key to included)."""
    q, k, v, tiles, kwargs = case
    with sliced_keys():
        check_against_reference(q, k, v, tiles, **kwargs)


def test_few_query_tiles_take_key_slices():
    """A canvas at batch 1 (few query tiles) against many keys cuts them; many query tiles do not. On a GPU a
    first call lets the tuner measure its candidates (each launch a merge) before the merges are counted."""
    calls = []
    merge = fa.merge_splits
    generator = torch.Generator().manual_seed(3)
    q = random_heads(1, 2, 8, 64, torch.float32, "contiguous", generator)
    k, v = (random_heads(1, 1, 300, 64, torch.float32, "seq_major", generator) for _ in range(2))
    k_valid = padded_keys([30], ["left"], 300, sliced=False)
    with sliced_keys(sms=8):
        check_against_reference(q, k, v, (16, 16), k_valid=k_valid)
    with mock.patch.object(fa, "merge_splits", lambda *a: calls.append(a[0].shape) or merge(*a)):
        with sliced_keys(sms=8):
            check_against_reference(q, k, v, (16, 16), k_valid=k_valid)
        # 2 programs on 8 SMs: 4 slices of 96 keys in the interpreter; on a GPU whole tiles of the tuner's
        # BLOCK_N (at most 128: 3 slices or more)
        assert len(calls) == 1 and calls[0][0] == 2
        assert calls[0][1] == 4 if DEVICE == "cpu" else calls[0][1] > 1
        with sliced_keys(sms=2):
            check_against_reference(q, k, v, (16, 16))
        assert len(calls) == 1


MASKS = [{}, {"causal": True}, {"block_size": 32}, {"block_size": 4}]


def gpu_tile_case(head_dim=128):
    """Several query and key tiles at the CUDA tile sizes, queries a suffix of the keys and the first
    row left-padded, so the unmasked and masked key loops both run at that size."""
    generator = torch.Generator().manual_seed(0)
    n_q, n_k = 200, 300
    q = random_heads(2, 4, n_q, head_dim, torch.float16, "contiguous", generator)
    k = random_heads(2, 2, n_k, head_dim, torch.float16, "seq_major", generator)
    v = random_heads(2, 2, n_k, head_dim, torch.float16, "seq_major", generator)
    return q, k, v, padded_keys([37, 0], ["left", "right"], n_k, sliced=False)


@pytest.mark.parametrize("tiles", [(128, 64), (64, 64)])
@pytest.mark.parametrize("mask", MASKS)
def test_matches_reference_with_gpu_tiles(mask, tiles):
    """The prefill tile (128 x 64) and the few-row one (64 x 64), in the interpreter on a CPU (on a
    GPU the tuner picks; the test below runs each of its tiles)."""
    q, k, v, k_valid = gpu_tile_case()
    check_against_reference(q, k, v, tiles, k_valid=k_valid, **mask)


@pytest.mark.parametrize("v_parts", [1, 2])
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_diffusion_gemmas_head_dims_at_scale_one(head_dim, dtype, v_parts):
    """DiffusionGemma's denoiser: head_dim 256 (sliding layers) and 512 (full: 8 query heads per KV head),
    scale 1, a canvas of queries against more keys, one row's first keys hidden; a head's output in one
    program or split over two."""
    generator = torch.Generator().manual_seed(head_dim)
    q = random_heads(2, 16, 24, head_dim, dtype, "contiguous", generator).mul_(0.5)  # scale 1: scores of a few units
    k, v = (random_heads(2, 2, 40, head_dim, dtype, "seq_major", generator).mul_(0.5) for _ in range(2))  # a cache's
    check_against_reference(q, k, v, (16, 16, v_parts), scale=1.0,
                            k_valid=padded_keys([5, 0], ["left", "right"], 40, sliced=False))


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuner's tiles compile for the GPU only")
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("mask", MASKS)
def test_every_tile_of_the_tuning_space_matches_reference(mask, head_dim):
    q, k, v, k_valid = gpu_tile_case(head_dim)
    for tiles in fa._TUNING_SPACE[head_dim] + fa._FEW_ROW_TILES[head_dim]:
        with mock.patch.object(fa.TUNER, "choose", lambda *args, tiles=tiles: tiles):
            check_against_reference(q, k, v, k_valid=k_valid, **mask)


@pytest.mark.parametrize("slices", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_key_tiles_outside_the_visible_keys_are_never_read(side, slices):
    """Left padding or a hidden tail (a cache's slots past its length): the tiles wholly before a row's
    first visible key or after its last are skipped, so NaN there (which a read would leak, 0 * NaN)
    leaves the output equal to the reference on clean keys, key slices (split-KV) included."""
    generator = torch.Generator().manual_seed(2)
    q = random_heads(2, 2, 40, 64, torch.float32, "contiguous", generator)
    k = random_heads(2, 1, 300, 64, torch.float32, "contiguous", generator)
    v = random_heads(2, 1, 300, 64, torch.float32, "contiguous", generator)
    k_valid = padded_keys([280, 0], [side, side], 300, sliced=False)
    expected = flash_attention_reference(q, k, v, k_valid=k_valid)
    k_nan, v_nan = k.clone(), v.clone()
    unread = slice(0, 256) if side == "left" else slice(128, 300)  # whole tiles of 16, 64 or 128 keys
    k_nan[0, :, unread], v_nan[0, :, unread] = float("nan"), float("nan")
    with poisoned_outputs(tiles=(16, 16)), sliced_keys() if slices else sliced_keys(sms=1):
        out = flash_attention(q, k_nan, v_nan, k_valid=k_valid)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("slices", [False, True])
def test_rows_without_visible_keys_are_zero(slices):
    generator = torch.Generator().manual_seed(1)
    q = random_heads(2, 2, 20, 64, torch.float32, "contiguous", generator)
    k = random_heads(2, 1, 20, 64, torch.float32, "contiguous", generator)
    v = random_heads(2, 1, 20, 64, torch.float32, "contiguous", generator)
    k_valid = padded_keys([20, 6], ["right", "left"], 20, sliced=False)
    with poisoned_outputs(tiles=(16, 16)), sliced_keys() if slices else sliced_keys(sms=1):
        out, lse = flash_attention(q, k, v, causal=True, k_valid=k_valid, return_lse=True)
    # Row 0 hides every key; in row 1 the first 6 queries (causal) see only hidden keys.
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1, :, :6], torch.zeros_like(out[1, :, :6])) and torch.isneginf(lse[1, :, :6]).all()
    assert torch.isfinite(lse[1, :, 6:]).all()


def test_without_lse_returns_only_the_output():
    q = torch.randn(1, 2, 5, 64, device=DEVICE)
    out = flash_attention(q, q[:, :1], q[:, :1])
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert isinstance(flash_attention_reference(q, q[:, :1], q[:, :1]), torch.Tensor)


def _inputs(n_q=4, n_k=6, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16):
    q = torch.randn(1, heads, n_q, head_dim, dtype=dtype)
    k = torch.randn(1, kv_heads, n_k, head_dim, dtype=dtype)
    return q, k, k.clone()


BAD_CALLS = [
    ("3-d q", lambda q, k, v: (q[0], k, v), {}, "4-d tensor"),
    ("head_dim 96", lambda q, k, v: _inputs(head_dim=96), {}, "head_dim must be one of 64, 128, 256, 512, got 96"),
    ("k and v differ", lambda q, k, v: (q, k, k[:, :, :5]), {}, "same shape"),
    ("batch differs", lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), {}, "batch or head_dim"),
    ("heads not a multiple", lambda q, k, v: _inputs(heads=3, kv_heads=2), {}, "multiple of num_kv_heads"),
    ("dtype mismatch", lambda q, k, v: (q, k.float(), v), {}, "share a dtype"),
    ("float64", lambda q, k, v: (q.double(), k.double(), v.double()), {}, "float16, bfloat16 or float32"),
    ("device mismatch", lambda q, k, v: (q, k.to("meta"), v), {}, "one device"),
    ("empty", lambda q, k, v: _inputs(n_q=0), {}, "empty"),
    ("causal and block", None, {"causal": True, "block_size": 4}, "exclusive"),
    ("block_size 0", None, {"block_size": 0}, "positive int"),
    ("block_size float", None, {"block_size": 4.0}, "positive int"),
    ("more queries than keys, causal", lambda q, k, v: _inputs(n_q=7, n_k=6), {"causal": True},
     r"N_q \(7\) must be <= N_k \(6\)"),
    ("scale 0", None, {"scale": 0.0}, "scale must be positive"),
    ("k_valid shape", None, {"k_valid": torch.ones(1, 5, dtype=torch.bool)}, r"k_valid must have shape \(1, 6\)"),
    ("k_valid heads", None, {"k_valid": torch.ones(1, 3, 6, dtype=torch.bool)}, r"or \(1, 2, 6\)"),
    ("k_valid dtype", None, {"k_valid": torch.ones(1, 6)}, "bool tensor"),
]


@pytest.mark.parametrize("change, kwargs, message", [case[1:] for case in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("function", [flash_attention, flash_attention_reference])
def test_rejects_bad_inputs(function, change, kwargs, message):
    q, k, v = _inputs()
    if change is not None:
        q, k, v = change(q, k, v)
    with pytest.raises(ValueError, match=message):
        function(q, k, v, **kwargs)
