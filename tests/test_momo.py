"""MOMO (methods/momo.py, the torch reference): k covering every key block equals dense for every
mask and top-k variant, a small k differs, the top-k variants return what they claim, Algorithm 2's
union and trim (and the "mass" trim), the engines decode dense's tokens with a full budget, and
scripts/momo_mass.py's chunked block masses are the dense ones."""

import importlib.util
import math
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.kernels.qsa_estimate import golden_strides, last_blocks
from nanodllm.attention import CanvasMask, attention_reference
from nanodllm.methods import get_method
from nanodllm.methods.momo import (block_lists, delta_corrected, dense_mask, diagonal_blocks,
                                   estimated_top_k, exact_top_k, expand_blocks, kept_blocks, kept_lists, momo_attention,
                                   scaled_scores, trim_values, union_and_trim)
from tests.device import DEVICE, TF32_DOTS, FP32_OUT_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MASKS = ["bidirectional", "padding", "block-causal", "causal"]


def make_mask(kind, valid):
    return {"bidirectional": None, "padding": CanvasMask(valid=valid),
            "block-causal": CanvasMask(valid=valid, block_size=8), "causal": CanvasMask(block_size=1)}[kind]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(8, 120), gamma=st.sampled_from([1, 2, 4]), per_block=st.sampled_from([1, 2, 4]),
       beta=st.sampled_from([4, 8, 16]), kind=st.sampled_from(MASKS),
       top_k=st.sampled_from(["exact", "tree", "estimated"]), trim=st.sampled_from(["mean", "mass"]),
       group=st.sampled_from([1, 2]), scale=st.sampled_from([None, 1.0]), seed=st.integers(0, 999))
def test_k_covering_every_block_equals_dense(n, gamma, per_block, beta, kind, top_k, trim, group, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * group, n, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, n - n // 3 :] = False  # row 1 right-padded, as the block engine's prefill
    mask = make_mask(kind, valid)
    dense_mask = None if mask is None else mask.dense(n, n, q.device)
    blocks = -(-n // beta)
    out = momo_attention(q, k, v, mask, gamma=gamma, chi=gamma * per_block, beta=beta, k_blocks=blocks,
                         k_exact=min(2, blocks), top_k=top_k, trim=trim, scale=scale)
    expected = attention_reference(q, k, v, dense_mask, scale)
    real = valid if kind in ("padding", "block-causal") else torch.ones_like(valid)
    torch.testing.assert_close(out[real[:, None].expand(-1, q.shape[1], -1)],
                               expected[real[:, None].expand(-1, q.shape[1], -1)], atol=1e-10, rtol=1e-10)


def test_diagonal_blocks_are_the_key_blocks_under_each_query_blocks_rows():
    # query blocks of chi = 100 rows over 250 rows; key blocks of beta = 64: 0-63, 64-127, 128-191, 192-249
    assert diagonal_blocks(250, 100, 64, "cpu").tolist() == [[True, True, False, False],  # rows 0-99
                                                             [False, True, True, True],  # rows 100-199
                                                             [False, False, False, True]]  # rows 200-249
    assert diagonal_blocks(128, 64, 64, "cpu").tolist() == [[True, False], [False, True]]


def test_delta_correction_gives_the_sampled_rows_their_exact_output_and_shifts_their_window():
    """eq. 3 with gamma = 3 over 7 rows: rows 0, 3, 6 take O_gamma; rows 1-2 and 4-5 move by their
    window's correction O_gamma[w] - O_*[3 w]."""
    o_sparse = torch.arange(7.0).reshape(1, 1, 7, 1) * 10  # O_*: 0, 10, ..., 60
    o_gamma = torch.tensor([1.0, 35.0, 62.0]).reshape(1, 1, 3, 1)  # exact outputs of rows 0, 3, 6
    out = delta_corrected(o_sparse, o_gamma, 3).flatten().tolist()
    assert out == [1.0, 11.0, 21.0, 35.0, 45.0, 55.0, 62.0]


@pytest.mark.parametrize("top_k,trim", [("exact", "mean"), ("estimated", "mean"), ("exact", "mass")])
def test_small_k_differs(top_k, trim):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    out = momo_attention(q, k, v, None, gamma=4, chi=16, beta=16, k_blocks=2, k_exact=1, top_k=top_k, trim=trim)
    assert (out - attention_reference(q, k, v)).abs().max() > 1e-3


def test_exact_top_k_breaks_ties_to_the_lower_block():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0]])
    assert exact_top_k(scores, 2).tolist() == [[1, 2]]
    assert exact_top_k(scores, 5).tolist() == [[1, 2, 4, 0, -1]]  # the invisible block is never chosen
    # an invisible block 0 takes no slot: the tie nudge of -inf at column 0 was 0 * inf = NaN, which topk ranks first
    assert exact_top_k(torch.tensor([[float("-inf"), 5.0, 3.0]]), 2).tolist() == [[1, 2]]


@settings(max_examples=20, deadline=None)
@given(blocks=st.integers(1, 40), k=st.integers(1, 12), seed=st.integers(0, 999), data=st.data())
def test_estimated_top_k_keeps_the_exact_part_and_at_most_k(blocks, k, seed, data):
    k_exact = data.draw(st.integers(0, k))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, blocks, generator=generator, dtype=torch.float64)
    scores[0, blocks // 2 :] = float("-inf")  # a causal-like row
    chosen = estimated_top_k(scores, k, k_exact)
    exact = exact_top_k(scores, k)
    for row in range(3):
        picked = [int(i) for i in chosen[row] if i >= 0]
        assert len(picked) == len(set(picked)) <= k
        assert all(scores[row, i] > float("-inf") for i in picked)
        assert {int(i) for i in exact_top_k(scores[row : row + 1], k_exact)[0] if i >= 0} <= set(picked)
        if k_exact == k:
            assert set(picked) == {int(i) for i in exact[row] if i >= 0}
        visible = int((scores[row] > float("-inf")).sum())
        if visible <= k:
            assert len(picked) == visible  # room for everything: everything is taken


def test_estimated_top_k_visits_each_row_in_golden_strides():
    # a group of rows scans T = 10 blocks (its last row's), stride 7 (10 / 1.618 = 6 shares a factor
    # with 10): blocks 0 7 4 1 8 5 2 9 6 3. Equal scores never beat the running mean, so blocks are
    # taken once the free slots cover the row's own blocks left: the last ones it visits
    scores = torch.zeros(2, 10, dtype=torch.float64)
    scores[1, 6:] = float("-inf")  # row 1 sees blocks 0-5: 0 4 1 5 2 3 of the scan
    assert estimated_top_k(scores, 3, 0).tolist() == [[9, 6, 3], [5, 2, 3]]
    assert estimated_top_k(scores, 4, 1).tolist() == [[0, 9, 6, 3], [0, 5, 2, 3]]  # the exact slot keeps the first seen


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 5000))
def test_golden_strides_visit_every_block_once(total):
    stride = int(golden_strides(total, torch.device("cpu"))[total])
    assert sorted((step * stride) % total for step in range(total)) == list(range(total))
    nearest = max(1, round(total / ((1 + 5**0.5) / 2)))
    assert stride >= nearest and all(math.gcd(skipped, total) > 1 for skipped in range(nearest, stride))


def test_union_and_trim_ranks_by_mean_score():
    # one query block of two sampled rows over 4 key blocks; row 0 chose {0, 1}, row 1 chose {1, 3}
    chosen = torch.tensor([[[[0, 1], [1, 3]]]])
    chosen_scores = torch.tensor([[[[5.0, 1.0], [4.0, 3.5]]]])
    keep = union_and_trim(chosen, chosen_scores, blocks=4, rows_per_block=2, k_trim=2)
    assert keep[0, 0, 0].tolist() == [True, False, False, True]  # means: 5, 2.5, -, 3.5
    keep = union_and_trim(torch.tensor([[[[0, -1], [-1, -1]]]]), chosen_scores, blocks=4, rows_per_block=2, k_trim=2)
    assert keep[0, 0, 0].tolist() == [True, False, False, False]  # empty slots choose nothing
    keep = union_and_trim(torch.tensor([[[[1, 2], [2, 3]]]]), chosen_scores, blocks=4, rows_per_block=2, k_trim=3)
    assert keep[0, 0, 0].tolist() == [False, True, True, True]  # an unchosen block 0 takes no place


def test_the_mass_trim_ranks_by_the_choosing_rows_summed_attention_share():
    # row 0 (logsumexp 9) chose {0, 1}; row 1 (logsumexp 3) chose {1, 3}. By mean score block 0
    # (score 5) wins; its share of row 0's attention is e^(5 - 9) = 0.018, while block 1 holds
    # e^(1 - 9) + e^(2 - 3) = 0.368 and block 3 e^(1.5 - 3) = 0.223
    chosen = torch.tensor([[[[0, 1], [1, 3]]]])
    chosen_scores = torch.tensor([[[[5.0, 1.0], [2.0, 1.5]]]])
    lse = torch.tensor([[[9.0, 3.0]]])
    values, summed = trim_values(chosen, chosen_scores, lse, "mean")
    assert not summed and union_and_trim(chosen, values, 4, 2, k_trim=1)[0, 0, 0].tolist() == [
        True, False, False, False]
    values, summed = trim_values(chosen, chosen_scores, lse, "mass")
    torch.testing.assert_close(values[0, 0], torch.tensor([[math.exp(-4), math.exp(-8)],
                                                           [math.exp(-1), math.exp(-1.5)]],
                                                          dtype=torch.float64))
    assert summed and union_and_trim(chosen, values, 4, 2, k_trim=1, summed=True)[0, 0, 0].tolist() == [
        False, True, False, False]
    assert union_and_trim(chosen, values, 4, 2, k_trim=2, summed=True)[0, 0, 0].tolist() == [False, True, False, True]
    values, _ = trim_values(torch.tensor([[[[0, -1], [-1, -1]]]]), chosen_scores,
                            torch.tensor([[[9.0, float("-inf")]]]), "mass")
    assert values[0, 0].tolist() == [[math.exp(-4), 0.0], [0.0, 0.0]]  # empty slots and blind rows share nothing


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 1500), gamma=st.sampled_from([4, 8, 16]), chi=st.sampled_from([16, 32, 64]),
       beta=st.sampled_from([16, 32, 64]), k=st.integers(1, 6), k_trim=st.integers(1, 12), summed=st.booleans(),
       seed=st.integers(0, 999))
def test_kept_lists_are_the_lists_of_kept_blocks(n, gamma, chi, beta, k, k_trim, summed, seed):
    # the kernel path's lists (compact union, trim and diagonal merge where the key blocks outnumber a
    # query block's candidates, about half of the drawn cases) against the dense mask's
    generator = torch.Generator().manual_seed(seed)
    rows, blocks = -(-n // gamma), -(-n // beta)
    chosen = torch.randint(-1, blocks, (2, 3, rows, k), generator=generator)
    chosen = torch.where(torch.rand(chosen.shape, generator=generator) < 0.2, -1, chosen)
    chosen = torch.where(chosen >= 0, (chosen * 7919 + torch.arange(k)) % blocks, -1)  # few duplicates in a row
    scores = torch.randint(-4, 4, chosen.shape, generator=generator).double()  # many ties
    scores = torch.where(chosen >= 0, scores, float("-inf"))
    if summed:  # the mass trim's values: shares in [0, 1] (quarters: many tied sums), 0 in empty slots
        scores = torch.where(chosen >= 0, (scores + 4) / 8, 0.0)
    expected = block_lists(kept_blocks(chosen, scores, n, gamma, chi, beta, k_trim, summed))
    assert torch.equal(kept_lists(chosen, scores, n, gamma, chi, beta, k_trim, summed), expected)


@pytest.mark.parametrize("kind,top_k,trim,scale", [
    ("bidirectional", "exact", "mean", None), ("padding", "exact", "mean", None),
    ("block-causal", "exact", "mean", None),
    ("padding", "tree", "mean", None), ("block-causal", "estimated", "mean", None), ("padding", "exact", "mass", None),
    ("causal", "exact", "mass", 0.5)])  # DiffusionGemma's prefill: causal, its own scale (1: too peaked for 16 dims)
def test_the_kernel_pipeline_computes_what_the_torch_pipeline_computes(monkeypatch, kind, top_k, trim, scale):
    import nanodllm.methods.momo as momo

    # 136 columns: query blocks of 64, 64 and 8 rows, 9 key blocks (the last of 8 keys); row 1 padded from
    # column 100, so its second query block is part padding and its third all padding
    generator = torch.Generator().manual_seed(1)
    on_grid = (lambda x: x.half().float()) if TF32_DOTS else (lambda x: x)
    q = on_grid(torch.randn(2, 4, 136, 16, generator=generator)).to(DEVICE)
    k, v = (on_grid(torch.randn(2, 2, 136, 16, generator=generator)).to(DEVICE) for _ in range(2))
    valid = torch.ones(2, 136, dtype=torch.bool, device=DEVICE)
    valid[1, 100:] = False
    knobs = dict(gamma=4, chi=64, beta=16, k_blocks=4, k_exact=2, top_k=top_k, trim=trim, scale=scale)
    expected = momo_attention(q, k, v, make_mask(kind, valid), **knobs)  # float32: torch on a GPU too
    # k_blocks = 4 of 9 leaves blocks out (in torch: the kernels would take as long again)
    assert (expected - momo_attention(q, k, v, make_mask(kind, valid), **{**knobs, "k_blocks": 9})).abs().max() > 1e-3
    monkeypatch.setattr(momo, "attention_on_kernels", lambda q: True)  # the Triton kernels (interpreted on a CPU)
    got = momo_attention(q, k, v, make_mask(kind, valid), **knobs)
    real = valid[:, None, :, None].expand_as(got) if kind != "bidirectional" else torch.ones_like(got, dtype=torch.bool)
    torch.testing.assert_close(got[real], expected[real], atol=FP32_OUT_TOLERANCE, rtol=FP32_OUT_TOLERANCE)


def test_the_kernel_pipeline_takes_diffusion_gemmas_wide_heads(monkeypatch):
    """Its full layers' prefill: head_dim 512, GQA 4, causal with a left-padded row, scale 1, on the
    kernels (fewer rows per program) as in torch."""
    import nanodllm.methods.momo as momo

    generator = torch.Generator().manual_seed(2)
    on_grid = (lambda x: x.half().float()) if TF32_DOTS else (lambda x: x)
    q = on_grid(torch.randn(2, 8, 136, 512, generator=generator) * 0.2).to(DEVICE)
    k, v = (on_grid(torch.randn(2, 2, 136, 512, generator=generator) * 0.2).to(DEVICE) for _ in range(2))
    valid = torch.ones(2, 136, dtype=torch.bool, device=DEVICE)
    valid[1, :40] = False
    knobs = dict(gamma=4, chi=64, beta=32, k_blocks=3, k_exact=3, scale=1.0)
    expected = momo_attention(q, k, v, CanvasMask(valid, block_size=1), **knobs)  # float32: torch
    monkeypatch.setattr(momo, "use_kernels", lambda q: True)  # the Triton kernels (interpreted on a CPU)
    on_kernels, calls = momo.momo_on_kernels, []
    monkeypatch.setattr(momo, "momo_on_kernels", lambda *args: calls.append(1) or on_kernels(*args))
    got = momo_attention(q, k, v, CanvasMask(valid, block_size=1), **knobs)
    assert calls == [1]
    real = valid[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], expected[real], atol=FP32_OUT_TOLERANCE, rtol=FP32_OUT_TOLERANCE)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="multiple of gamma"):
        get_method("momo", gamma=16, chi=100)
    with pytest.raises(ValueError, match="top_k"):
        get_method("momo", top_k="heap")
    with pytest.raises(ValueError, match="k_exact"):
        get_method("momo", k=8, k_exact=9)
    with pytest.raises(ValueError, match="trim must be 'mean' or 'mass'"):
        get_method("momo", trim="median")
    with pytest.raises(ValueError, match="k_trim must be an integer >= 1, got 0"):  # 0 once fell back to k
        get_method("momo", k_trim=0)


def test_a_budget_below_eight_blocks_takes_them_all_exactly():
    """k_exact defaults to the paper's 8, or k where k is smaller (no knob to set alongside a small k)."""
    assert get_method("momo", k=3).knobs["k_exact"] == 3 and get_method("momo").knobs["k_exact"] == 8


def load_mass_script():
    spec = importlib.util.spec_from_file_location("momo_mass",
                                                  Path(__file__).resolve().parents[1] / "scripts" / "momo_mass.py")
    momo_mass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(momo_mass)
    return momo_mass


@pytest.mark.parametrize("mask_block", [1, 4, None])
def test_mass_script_chunks_give_the_dense_block_masses(mask_block):
    momo_mass = load_mass_script()
    n, chi, beta = 300, 32, 16  # chunks of 2 query blocks, the last one short
    q, k = momo_mass.structured_qk(n, heads=4, kv_heads=2, head_dim=32, seed=5)
    full = dense_mask(CanvasMask(block_size=mask_block), n, q.device)
    probs = scaled_scores(q, k, full).softmax(-1)
    mass = momo_mass.chunked_block_mass(q, k, mask_block, chi, beta, budget=2 * chi * n)
    torch.testing.assert_close(mass, momo_mass.block_mass(probs, chi, beta), atol=1e-6, rtol=1e-6)
    keep = torch.rand(mass.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    dense = float((probs * expand_blocks(keep, n, chi, beta, full)).sum(-1).mean())
    assert abs(momo_mass.captured(mass, keep, n) - dense) < 1e-5


def test_mass_script_k_trim_below_k_trims_the_union(tmp_path):
    """--k-trim below --k keeps fewer blocks per query block than k_trim = k: at most k_trim plus the
    query block's two diagonal key blocks (chi = 2 beta)."""
    momo_mass = load_mass_script()
    common = ["--synthetic", "--lengths", "1024", "--heads", "2", "--head-dim", "32", "--k", "6", "--mask", "causal",
              "--device", "cpu", "--dtype", "float32"]
    kept = {}
    for k_trim in (6, 3):
        out = tmp_path / f"{k_trim}.md"
        momo_mass.main(common + ["--k-trim", str(k_trim), "--out", str(out)])
        lines = out.read_text().splitlines()
        assert f"k = 6, k_trim = {k_trim} key blocks" in lines[0]
        kept[k_trim] = float(lines[-1].split("|")[8].split(" of ")[0])
    assert kept[3] < kept[6]
    assert kept[3] <= 3 + 2


def test_mass_script_oracle_with_diagonals_keeps_them_and_the_best_others():
    """mass_ratios: the oracle with diagonals holds the diagonal blocks and, to the same count, the
    others of most mass, so a mask that does exactly that scores 1 against it and no more than 1
    against the free oracle; a free oracle's pick scores 1 against the free oracle."""
    momo_mass = load_mass_script()
    n, chi, beta = 256, 64, 32
    mass = torch.rand(1, 2, n // chi, n // beta, generator=torch.Generator().manual_seed(3))
    diagonal = diagonal_blocks(n, chi, beta, "cpu")
    mass = torch.where(diagonal, mass / 10, mass)  # the diagonal blocks hold little: the two oracles differ
    counts = torch.full(mass.shape[:-1], 4)
    pooled = torch.zeros(mass.shape)
    with_diagonals = momo_mass.best_per_query_block(mass.masked_fill(diagonal, float("inf")), counts)
    ratios = momo_mass.mass_ratios(mass, with_diagonals, pooled, n, chi, beta)
    assert abs(ratios["momo diagonals"] - 1) < 1e-6 and ratios["momo"] < 1 - 1e-3
    free = momo_mass.best_per_query_block(mass, counts)
    assert abs(momo_mass.mass_ratios(mass, free, pooled, n, chi, beta)["momo"] - 1) < 1e-6


def plain_estimate(rows, k, k_exact):
    """estimated_top_k's docstring read in plain Python, for rows (lists of block scores) of one scan-order group:
    the group scans T blocks (its largest last_blocks) in golden strides; each visible block updates the mean and
    sample variance of the row's visible blocks, is offered to the exact slots, and what they pass on takes a free
    slot on the threshold erf((s - m) / (sigma sqrt 2)) > 2p - 1."""
    last = [max((i + 1 for i, s in enumerate(row) if s > -math.inf), default=0) for row in rows]
    total = max(last)
    stride = max(1, round(total / ((1 + 5**0.5) / 2)))
    while total and math.gcd(stride, total) != 1:
        stride += 1
    chosen = []
    for row, row_last in zip(rows, last):
        seen, exact, greedy = [], [(-math.inf, -1)] * k_exact, []
        for step in range(total):
            block = step * stride % total
            if row[block] == -math.inf:
                continue
            seen.append(row[block])
            mean, sigma = statistics.fmean(seen), statistics.stdev(seen) if len(seen) > 1 else 0.0
            offered = (row[block], block)
            if k_exact:
                slot = min(range(k_exact), key=lambda j: exact[j][0])  # the first of equals
                if row[block] > exact[slot][0]:
                    offered, exact[slot] = exact[slot], offered
            free = k - k_exact - len(greedy)
            p = 1 - free / max(row_last - (len(seen) - 1), 1)  # blocks left: last less the visible ones seen before
            if offered[1] >= 0 and free > 0:
                score = offered[0]
                beats = math.erf((score - mean) / (sigma * math.sqrt(2))) > 2 * p - 1 if sigma > 0 else score > mean
                if p <= 0 or beats:
                    greedy.append(offered[1])
        chosen.append([block for _, block in exact] + greedy + [-1] * (k - k_exact - len(greedy)))
    return chosen


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 30), k=st.integers(1, 8), seed=st.integers(0, 999),
       data=st.data())
def test_estimated_top_k_follows_its_docstring_in_plain_python(rows, blocks, k, seed, data):
    """Welford's running mean and sample variance, the exact slots and the threshold, against a plain reading
    (statistics.fmean and stdev) of one scan-order group whose rows see different blocks."""
    k_exact = data.draw(st.integers(0, k))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, blocks, generator=generator, dtype=torch.float64)
    scores[torch.rand(rows, blocks, generator=generator) < 0.2] = float("-inf")  # hidden blocks
    for row in range(rows):
        scores[row, data.draw(st.integers(1, blocks)):] = float("-inf")  # causal-like: rows see fewer blocks
    assert estimated_top_k(scores, k, k_exact).tolist() == plain_estimate(scores.tolist(), k, k_exact)


@pytest.mark.parametrize("chi, beta", [(48, 32), (16, 64), (96, 64)])
def test_kept_lists_keep_every_diagonal_block_of_a_query_block_straddling_key_blocks(chi, beta):
    """Where the key blocks outnumber a query block's candidates (kept_lists' compact path) and chi is
    not a multiple of beta, a query block's rows overlap key blocks the grid does not line up with: each
    of them is kept, as in the dense mask's lists."""
    n, gamma = 1200, 16
    generator = torch.Generator().manual_seed(0)
    rows, blocks = -(-n // gamma), -(-n // beta)
    chosen = torch.randint(0, blocks, (1, 2, rows, 1), generator=generator)
    scores = torch.randn(chosen.shape, generator=generator, dtype=torch.float64)
    assert chi // gamma < blocks  # the compact path
    lists = kept_lists(chosen, scores, n, gamma, chi, beta, 2)
    assert torch.equal(lists, block_lists(kept_blocks(chosen, scores, n, gamma, chi, beta, 2)))
    for query_block, start in enumerate(range(0, n, chi)):
        overlapped = set(range(start // beta, (min(start + chi, n) - 1) // beta + 1))
        assert overlapped <= set(lists[0, 0, query_block].tolist())


def test_a_reused_momo_aligns_each_prefills_rows_by_that_prefills_padding():
    """Each row's grid starts at its first real token of the mask at hand: after a prefill with one
    row padding, a prefill whose row is padded otherwise gets what momo_attention gives its mask."""
    from nanodllm.methods.base import StepContext

    generator = torch.Generator().manual_seed(3)
    n = 64
    q = torch.randn(2, 2, n, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 8, generator=generator, dtype=torch.float64) for _ in range(2))

    def prefill(pad):
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, :pad] = False
        return StepContext(tokens=torch.zeros(2, n, dtype=torch.long), positions=torch.arange(n).expand(2, -1),
                           valid=valid, prompt_lengths=valid.sum(dim=1), attn_mask=CanvasMask(valid=valid),
                           phase="prefill")

    reused = get_method("momo", gamma=4, chi=16, beta=8, k=2)
    reused.attend(0, q, k, v, prefill(5))
    second = prefill(11)
    expected = momo_attention(q, k, v, second.attn_mask, gamma=4, chi=16, beta=8, k_blocks=2)
    torch.testing.assert_close(reused.attend(0, q, k, v, second), expected)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), gamma=st.sampled_from([1, 2, 3]), beta=st.sampled_from([1, 4, 8]),
       mask=st.sampled_from(["none", "causal", "block", "padding", "padded rows"]), seed=st.integers(0, 999))
def test_last_blocks_counts_each_sampled_rows_blocks_as_its_docstring(n, gamma, beta, mask, seed):
    """1 + the last key block a sampled row sees a key of: 0 where it sees none, and 0 for a row at a padded
    column (q_valid False), whatever it could see."""
    generator = torch.Generator().manual_seed(seed)
    valid = torch.rand(2, n, generator=generator) < 0.7
    causal, block_size = mask == "causal", 4 if mask in ("block", "padding", "padded rows") else None
    k_valid = valid if mask in ("padding", "padded rows") else None
    q_valid = valid if mask == "padded rows" else None
    got = last_blocks(n, gamma, beta, causal, block_size, k_valid, 2, "cpu", q_valid)
    expected = []
    for b in range(2):
        row = []
        for i in range(0, n, gamma):
            seen = [j for j in range(n) if (not causal or j <= i) and (block_size is None or j // 4 <= i // 4)
                    and (k_valid is None or bool(k_valid[b, j]))]
            row.append(0 if not seen or (q_valid is not None and not q_valid[b, i]) else seen[-1] // beta + 1)
        expected.append(row)
    assert got.dtype == torch.int32 and got.tolist() == expected
