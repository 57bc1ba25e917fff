"""MOMO's kernels against their torch references, interpreted on a CPU (TRITON_INTERPRET=1) and
compiled on a GPU: kernels/qsa_attention.py (the sampled rows' outputs and LSE, and a top-k block set
that is a true top-k of the block scores) and kernels/block_sparse_attention.py (listed key blocks,
masks, empty list entries).

A float32 tl.dot is exact in the interpreter but TF32 on a GPU (inputs rounded to float16's 10 mantissa
bits). On a GPU the float32 inputs are therefore drawn on the float16 grid, which TF32 holds exactly:
the scores q.k, and with them the LSE and the block choices, are exact as in the interpreter. The p.v
dot still rounds the probabilities to 10 bits, so there float32 outputs (only they) get the float16
tolerance. CPU runs draw and compare exactly as before."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.kernels.block_sparse_attention import CUDA_TILES, block_sparse_attention, block_sparse_attention_reference
from nanodllm.kernels.qsa_attention import qsa_attention, qsa_attention_reference
from nanodllm.methods.momo import block_scores, scaled_scores
from tests.device import DEVICE, TF32_DOTS, FP32_OUT_TOLERANCE

BLOCK_M = CUDA_TILES["BLOCK_M"] if DEVICE == "cuda" else 16  # block_sparse_attention's rows per program


def randn(*shape, generator, dtype=torch.float32):
    """torch.randn in dtype on DEVICE; float32 on the float16 grid where dots are TF32 (see above)."""
    x = torch.randn(*shape, generator=generator)
    if TF32_DOTS and dtype == torch.float32:
        x = x.half().float()
    return x.to(dtype=dtype, device=DEVICE)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 160), gamma=st.sampled_from([1, 3, 4, 16]), beta=st.sampled_from([16, 32]),
       top_k=st.integers(1, 12), head_dim=st.sampled_from([16, 32, 64]), group=st.sampled_from([1, 2]),
       mask=st.sampled_from(["none", "causal", "block", "padding"]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 999))
def test_qsa_matches_the_reference(n, gamma, beta, top_k, head_dim, group, mask, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = randn(2, 2 * group, n, head_dim, generator=generator, dtype=dtype)
    k, v = (randn(2, 2, n, head_dim, generator=generator, dtype=dtype) for _ in range(2))
    valid = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    valid[1, (2 * n) // 3 :] = False
    masks = {"none": {}, "causal": {"causal": True}, "block": {"block_size": 8},
             "padding": {"k_valid": valid, "block_size": 8}}[mask]
    out, lse, top_index, top_score = qsa_attention(q, k, v, gamma=gamma, beta=beta, top_k=top_k, **masks)
    ref_out, ref_lse, _, _ = qsa_attention_reference(q, k, v, gamma=gamma, beta=beta, top_k=top_k, **masks)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-4
    out_tolerance = tolerance if dtype == torch.float16 else FP32_OUT_TOLERANCE
    seen = ref_lse > float("-inf")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=out_tolerance, rtol=out_tolerance)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=tolerance, rtol=tolerance)
    assert bool((lse[~seen] == float("-inf")).all())

    # every block score, to check the kernel's set is a top-k (near-ties may differ from torch.topk)
    positions = torch.arange(0, n, gamma, device=DEVICE)
    visible = None
    if mask != "none":
        size = 1 if mask == "causal" else 8
        visible = (torch.arange(n, device=DEVICE)[None, :] // size) <= (positions[:, None] // size)
        visible = visible[None, None] & (valid[:, None, None, :] if mask == "padding" else True)
    scores = block_scores(scaled_scores(q[:, :, positions], k, visible), beta)
    for b in range(2):
        for h in range(2 * group):
            for row in range(len(positions)):
                row_scores = scores[b, h, row]
                picked = top_index[b, h, row][top_index[b, h, row] >= 0].long()
                visible_blocks = int((row_scores > float("-inf")).sum())
                assert len(picked) == min(top_k, visible_blocks) == len(set(picked.tolist()))
                if len(picked):
                    kth = row_scores.sort(descending=True).values[len(picked) - 1]
                    assert bool((row_scores[picked] >= kth - tolerance * 10).all())
                    torch.testing.assert_close(top_score[b, h, row][top_index[b, h, row] >= 0],
                                               row_scores[picked].float(), atol=tolerance * 10, rtol=tolerance)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(16, 200), gamma=st.sampled_from([2, 4]), top_k=st.integers(2, 10), group=st.sampled_from([1, 2]),
       mask=st.sampled_from(["none", "causal", "padding", "padded rows"]), seed=st.integers(0, 999), data=st.data())
def test_estimated_top_k_in_the_kernel_matches_its_torch_form(n, gamma, top_k, group, mask, seed, data):
    """With "padded rows" (q_valid) the sampled rows at padded columns choose nothing, in both. Up to
    100 sampled rows: two scan-order groups at gamma 2 (the test below holds four)."""
    k_exact = data.draw(st.integers(0, top_k - 1))
    generator = torch.Generator().manual_seed(seed)
    q = randn(2, 2 * group, n, 16, generator=generator)
    k, v = (randn(2, 2, n, 16, generator=generator) for _ in range(2))
    valid = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    valid[1, (2 * n) // 3 :] = False
    masks = {"none": {}, "causal": {"causal": True}, "padding": {"k_valid": valid, "block_size": 8},
             "padded rows": {"k_valid": valid, "q_valid": valid, "block_size": 8}}[mask]
    _, _, got, got_scores = qsa_attention(q, k, v, gamma=gamma, beta=16, top_k=top_k, k_exact=k_exact, **masks)
    _, _, expected, _ = qsa_attention_reference(q, k, v, gamma=gamma, beta=16, top_k=top_k, k_exact=k_exact, **masks)
    if mask == "padded rows":
        padded = ~valid[:, ::gamma]
        assert bool((got[padded[:, None].expand(got.shape[:3])] == -1).all())
        assert bool((expected[padded[:, None].expand(expected.shape[:3])] == -1).all())
    same_set = (got.long().sort(-1).values == expected.long().sort(-1).values).all(-1)
    assert float(same_set.float().mean()) >= 0.95  # fp32 vs float64 may flip a decision at the threshold
    exact_got, exact_expected = got[..., :k_exact].long(), expected[..., :k_exact].long()
    assert torch.equal(exact_got.sort(-1).values, exact_expected.sort(-1).values)  # the exact part is exact
    assert bool(((got_scores > float("-inf")) == (got >= 0)).all())


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_the_estimate_scans_each_row_group_in_one_order_across_programs(mask):
    # 132 sampled rows: scan-order groups of 64, 64 and 4 rows, the first two each held by 4 programs of
    # 16 rows in the interpreter (1 of 64 on a GPU); every program must scan its group's order and count
    # its own rows. Padding from column 200: the second group's later rows and all the third's see less
    generator = torch.Generator().manual_seed(7)
    n, gamma = 264, 2
    q = randn(1, 2, n, 16, generator=generator)
    k, v = (randn(1, 1, n, 16, generator=generator) for _ in range(2))
    valid = torch.ones(1, n, dtype=torch.bool, device=DEVICE)
    valid[0, 200:] = False
    masks = {"causal": True} if mask == "causal" else {"k_valid": valid, "block_size": 8}
    _, _, got, _ = qsa_attention(q, k, v, gamma=gamma, beta=16, top_k=8, k_exact=2, **masks)
    _, _, expected, _ = qsa_attention_reference(q, k, v, gamma=gamma, beta=16, top_k=8, k_exact=2, **masks)
    same_set = (got.long().sort(-1).values == expected.long().sort(-1).values).all(-1)
    assert float(same_set.float().mean()) >= 0.97


def test_among_equal_block_scores_the_lower_block_stays():
    """Zero queries score every key 0, so the 4 key blocks tie: each sampled row keeps blocks 0 and 1,
    in the register buffer and the tournament tree as in the reference."""
    generator = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 2, 64, 16, device=DEVICE)
    k, v = (randn(1, 1, 64, 16, generator=generator) for _ in range(2))
    _, _, expected, _ = qsa_attention_reference(q, k, v, gamma=4, beta=16, top_k=2)
    assert expected.sort(-1).values.tolist() == [[[[0, 1]] * 16] * 2]
    for tree in (False, True):
        _, _, top_index, _ = qsa_attention(q, k, v, gamma=4, beta=16, top_k=2, tree=tree)
        assert top_index.sort(-1).values.tolist() == [[[[0, 1]] * 16] * 2]


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 128), gamma=st.sampled_from([1, 4]), top_k=st.integers(1, 20),
       mask=st.sampled_from(["none", "causal"]), seed=st.integers(0, 999))
def test_the_tournament_tree_keeps_the_exact_top_k(n, gamma, top_k, mask, seed):
    generator = torch.Generator().manual_seed(seed)
    q = randn(1, 2, n, 16, generator=generator)
    k, v = (randn(1, 1, n, 16, generator=generator) for _ in range(2))
    masks = {"causal": True} if mask == "causal" else {}
    _, _, tree, tree_scores = qsa_attention(q, k, v, gamma=gamma, beta=16, top_k=top_k, tree=True, **masks)
    _, _, buffer, _ = qsa_attention(q, k, v, gamma=gamma, beta=16, top_k=top_k, **masks)
    assert torch.equal(tree.long().sort(-1).values, buffer.long().sort(-1).values)
    assert bool(((tree_scores > float("-inf")) == (tree >= 0)).all())


def test_bad_arguments_are_named():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="beta"):
        qsa_attention(q, k, k, gamma=2, beta=24, top_k=2)
    with pytest.raises(ValueError, match="exclusive"):
        qsa_attention(q, k, k, gamma=2, beta=16, top_k=2, causal=True, block_size=4)
    with pytest.raises(ValueError, match="tournament tree"):
        qsa_attention(q, k, k, gamma=2, beta=16, top_k=4, k_exact=2, tree=True)
    with pytest.raises(ValueError, match="k_valid"):
        qsa_attention(q, k, k, gamma=2, beta=16, top_k=2, k_valid=torch.ones(1, 7, dtype=torch.bool))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 200), chi_tiles=st.integers(1, 3), beta=st.sampled_from([16, 32]), listed=st.integers(1, 6),
       mask=st.sampled_from(["none", "causal", "block", "padding"]), group=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 999))
def test_block_sparse_matches_the_reference(n, chi_tiles, beta, listed, mask, group, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    chi = BLOCK_M * chi_tiles  # a multiple of the kernel's BLOCK_M: 16 in the interpreter, 64 on a GPU
    q = randn(1, 2 * group, n, 16, generator=generator, dtype=dtype)
    k, v = (randn(1, 2, n, 16, generator=generator, dtype=dtype) for _ in range(2))
    key_blocks, query_blocks = -(-n // beta), -(-n // chi)
    lists = torch.stack([torch.randperm(key_blocks, generator=generator)[:listed]
                         for _ in range(2 * group * query_blocks)])
    lists = torch.nn.functional.pad(lists, (0, listed - lists.shape[1]), value=-1).view(1, 2 * group, query_blocks, -1)
    lists[..., -1] = torch.where(torch.rand(lists.shape[:3], generator=generator) < 0.3, -1, lists[..., -1])
    lists = torch.where(torch.rand(lists.shape, generator=generator) < 0.15, -1, lists)  # gaps inside a list too
    lists = lists.to(DEVICE)
    valid = torch.ones(1, n, dtype=torch.bool, device=DEVICE)
    valid[0, (2 * n) // 3 :] = False
    masks = {"none": {}, "causal": {"causal": True}, "block": {"block_size": 8}, "padding": {"k_valid": valid}}[mask]
    out, lse = block_sparse_attention(q, k, v, lists.int(), chi=chi, beta=beta, **masks)
    ref_out, ref_lse = block_sparse_attention_reference(q, k, v, lists.int(), chi=chi, beta=beta, **masks)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-4
    out_tolerance = tolerance if dtype == torch.float16 else FP32_OUT_TOLERANCE
    torch.testing.assert_close(out.float(), ref_out.float(), atol=out_tolerance, rtol=out_tolerance)
    seen = ref_lse > float("-inf")
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=tolerance, rtol=tolerance)
    assert bool((lse[~seen] == float("-inf")).all())


def test_block_sparse_key_padding_is_each_batch_rows_own():
    """Two batch rows padded differently (the first not at all, the second from key 40): each row's keys
    are hidden by its own k_valid, and read from its own K and V."""
    generator = torch.Generator().manual_seed(11)
    n = 3 * BLOCK_M
    q = randn(2, 2, n, 16, generator=generator, dtype=torch.float16)
    k, v = (randn(2, 1, n, 16, generator=generator, dtype=torch.float16) for _ in range(2))
    valid = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    valid[1, 40:] = False
    lists = torch.arange(-(-n // 16), dtype=torch.int32, device=DEVICE).expand(2, 2, 3, -1).contiguous()
    out, lse = block_sparse_attention(q, k, v, lists, chi=BLOCK_M, beta=16, k_valid=valid)
    ref_out, ref_lse = block_sparse_attention_reference(q, k, v, lists, chi=BLOCK_M, beta=16, k_valid=valid)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_block_sparse_gaps_read_nothing_and_empty_lists_see_nothing():
    """A list entry < 0 is skipped even where block 0 holds NaN values, and a list of length 0 gives
    every row out = 0 and lse = -inf."""
    generator = torch.Generator().manual_seed(3)
    q = randn(1, 2, 64, 16, generator=generator, dtype=torch.float16)
    k, v = (randn(1, 2, 64, 16, generator=generator, dtype=torch.float16) for _ in range(2))
    lists = torch.tensor([-1, 2, -1, 3], dtype=torch.int32, device=DEVICE).expand(1, 2, 64 // BLOCK_M, 4).contiguous()
    expected, _ = block_sparse_attention_reference(q, k, v, lists, chi=BLOCK_M, beta=16)
    v[:, :, :16] = float("nan")  # key block 0 (beta = 16), never listed
    out, _ = block_sparse_attention(q, k, v, lists, chi=BLOCK_M, beta=16)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    empty = lists[..., :0]
    out, lse = block_sparse_attention(q, k, v, empty, chi=BLOCK_M, beta=16)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_wide_heads_at_scale_one_match_the_references(head_dim, mask):
    """DiffusionGemma's full-layer heads (512; its sliding layers' 256) at its scale 1, GQA 4: each
    kernel against its reference, with fewer rows per program on a GPU (BLOCK_M 16 or 32)."""
    generator = torch.Generator().manual_seed(head_dim)
    n, gamma, beta, chi = 150, 4, 32, 64
    q = randn(1, 8, n, head_dim, generator=generator, dtype=torch.float16) * 0.2  # scores of unit spread at scale 1
    k, v = (randn(1, 2, n, head_dim, generator=generator, dtype=torch.float16) * 0.2 for _ in range(2))
    valid = torch.ones(1, n, dtype=torch.bool, device=DEVICE)
    valid[0, :30] = False  # a left-padded prompt
    masks = {"causal": {"causal": True}, "padding": {"k_valid": valid, "block_size": 1}}[mask]
    out, lse, top_index, _ = qsa_attention(q, k, v, gamma=gamma, beta=beta, top_k=3, scale=1.0, **masks)
    ref_out, ref_lse, ref_index, _ = qsa_attention_reference(q, k, v, gamma=gamma, beta=beta, top_k=3, scale=1.0,
                                                             **masks)
    seen = ref_lse > float("-inf")
    torch.testing.assert_close(out.float()[seen], ref_out.float()[seen], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=2e-3, rtol=2e-3)
    assert top_index.sort(dim=-1).values[seen].tolist() == ref_index.sort(dim=-1).values[seen].tolist()
    lists = top_index[:, :, :: chi // gamma].contiguous()  # each query block's first sampled row's blocks
    sparse_masks = {"causal": True} if mask == "causal" else {"k_valid": valid, "block_size": 1}
    out, lse = block_sparse_attention(q, k, v, lists, chi=chi, beta=beta, scale=1.0, **sparse_masks)
    ref_out, ref_lse = block_sparse_attention_reference(q, k, v, lists, chi=chi, beta=beta, scale=1.0, **sparse_masks)
    seen = ref_lse > float("-inf")
    torch.testing.assert_close(out.float()[seen], ref_out.float()[seen], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=2e-3, rtol=2e-3)


def test_a_wide_head_with_a_key_block_too_big_for_shared_memory_is_named():
    q = torch.randn(1, 2, 8, 512)
    with pytest.raises(ValueError, match="beta x head_dim must be at most 32768 at head_dim > 128, got 128 x 512"):
        qsa_attention(q, q, q, gamma=2, beta=128, top_k=2)


def test_block_sparse_reads_a_strided_list_through_its_strides():
    """Lists are read through their strides: every other entry of a wider buffer (the kept lists as a
    view, the way step 1's top-k is sliced) attends exactly the blocks the contiguous copy lists."""
    generator = torch.Generator().manual_seed(5)
    n = 8 * BLOCK_M  # 8 query blocks of chi = BLOCK_M rows, at least 8 key blocks of 16
    q = randn(1, 2, n, 16, generator=generator, dtype=torch.float16)
    k, v = (randn(1, 1, n, 16, generator=generator, dtype=torch.float16) for _ in range(2))
    key_blocks = -(-n // 16)
    wide = torch.stack([torch.randperm(key_blocks, generator=generator)[:6] for _ in range(2 * 8)]).view(1, 2, 8, 6)
    lists = wide.to(device=DEVICE, dtype=torch.int32)[..., ::2]  # entries 0, 2, 4 of each list
    assert lists.stride(-1) == 2
    out, lse = block_sparse_attention(q, k, v, lists, chi=BLOCK_M, beta=16)
    ref_out, ref_lse = block_sparse_attention_reference(q, k, v, lists.contiguous(), chi=BLOCK_M, beta=16)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_qsa_reads_key_padding_sliced_from_a_wider_mask():
    """k_valid is read through its strides: the last N columns of a wider [batch, W] mask (momo_on_kernels
    passes mask.valid[:, -N:]), each batch row padded differently, hide the keys its contiguous copy hides,
    in the sampled rows' outputs, LSEs and chosen blocks."""
    generator = torch.Generator().manual_seed(13)
    n = 96
    q = randn(2, 2, n, 16, generator=generator)
    k, v = (randn(2, 1, n, 16, generator=generator) for _ in range(2))
    wide = torch.ones(2, n + 40, dtype=torch.bool, device=DEVICE)
    wide[0, : 40 + 50] = False  # row 0: its first 50 keys hidden (left padding)
    wide[1, 40 + 70 :] = False  # row 1: its keys from 70 on hidden
    valid = wide[:, -n:]
    assert not valid.is_contiguous()
    got = qsa_attention(q, k, v, gamma=4, beta=16, top_k=3, k_valid=valid)
    expected = qsa_attention_reference(q, k, v, gamma=4, beta=16, top_k=3, k_valid=valid.contiguous())
    torch.testing.assert_close(got[0], expected[0], atol=FP32_OUT_TOLERANCE, rtol=FP32_OUT_TOLERANCE)
    torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=1e-4)
    assert got[2].sort(-1).values.tolist() == expected[2].sort(-1).values.tolist()
