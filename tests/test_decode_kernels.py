"""Block-decode kernels (dense, sparse, key scores) against their torch references.

Off the GPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before the
kernel modules are imported (it is read when @triton.jit decorates them); conftest.py sets it, and
so does this module, so that it also runs on its own. The interpreter's bf16 tl.dot is wrong, so
CPU runs draw float16 and float32 only.

Every buffer the wrappers allocate for a kernel starts as NaN (DEBUG_POISON) and the cache slots
past each row's keys hold NaN: an element a kernel forgets to write, or a key it should not read,
fails the comparison.
"""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels import decode_attention as decode_module  # noqa: E402
from nanodllm.kernels.decode_attention import (decode_attention, decode_attention_reference,  # noqa: E402
                                               decode_partials, merge_splits)
from nanodllm.kernels.key_scores import key_scores, key_scores_reference  # noqa: E402
from nanodllm.kernels.sparse_decode_attention import (sparse_decode_attention,  # noqa: E402
                                                      sparse_decode_attention_reference)
from tests.device import DEVICE

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
LSE_TOLERANCE = 1e-4  # fp32 scores of exact fp16/bf16 products in every dtype: only the summation order differs


@pytest.fixture(autouse=True)
def poison_new_buffers(monkeypatch):
    monkeypatch.setattr(decode_module, "DEBUG_POISON", True)


@dataclass
class Case:
    """One batch: per-row cached prefix lengths; the block's L keys follow each prefix."""

    prefixes: list
    num_kv_heads: int = 1
    group: int = 1
    num_queries: int = 1
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def tensors(self):
        """q, k_cache, v_cache, cache_lengths; cache slots past prefix + L are NaN."""
        gen = torch.Generator().manual_seed(self.seed)
        batch, heads = len(self.prefixes), self.num_kv_heads * self.group
        capacity = max(self.prefixes) + self.num_queries + 3
        q = torch.randn(batch, heads, self.num_queries, self.head_dim, generator=gen)
        k = torch.randn(batch, capacity, self.num_kv_heads, self.head_dim, generator=gen)
        v = torch.randn(batch, capacity, self.num_kv_heads, self.head_dim, generator=gen)
        for row, prefix in enumerate(self.prefixes):
            k[row, prefix + self.num_queries:] = float("nan")
            v[row, prefix + self.num_queries:] = float("nan")
        cache_lengths = torch.tensor(self.prefixes)
        return [t.to(DEVICE) for t in (q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), cache_lengths)]


@st.composite
def cases(draw, max_prefix=150):
    batch = draw(st.integers(1, 3))
    return Case(
        prefixes=draw(st.lists(st.integers(0, max_prefix), min_size=batch, max_size=batch)),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        num_queries=draw(st.integers(1, 33)),
        head_dim=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=10 * tol)


def assert_lse_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=LSE_TOLERANCE, rtol=LSE_TOLERANCE)


# Edge cases always run: prefix 0 with L = 1; 8 x 64 query rows = 4 query tiles; ragged rows whose
# later key slices are empty.
EDGE_CASES = [
    Case(prefixes=[0], num_queries=1),
    Case(prefixes=[5, 0], num_kv_heads=1, group=8, num_queries=64, head_dim=64, dtype=torch.float16),
    Case(prefixes=[300, 3], num_kv_heads=2, group=4, num_queries=7, head_dim=128, dtype=torch.float16),
]


@given(case=cases(), num_splits=st.none() | st.integers(1, 6),
       tiles=st.sampled_from([None, None, {"BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 32}]), same_length=st.booleans())
@example(case=EDGE_CASES[0], num_splits=None, tiles=None, same_length=False)
@example(case=EDGE_CASES[1], num_splits=None, tiles=None, same_length=False)
@example(case=EDGE_CASES[2], num_splits=6, tiles=None, same_length=False)
@example(case=EDGE_CASES[2], num_splits=None, tiles=None, same_length=True)
@example(case=Case(prefixes=[70, 3], num_kv_heads=2, group=1, num_queries=200, head_dim=64, dtype=torch.float16),
         num_splits=3, tiles=None, same_length=True)  # 200 queries: two query tiles, each reading the keys
@example(case=Case(prefixes=[40, 0], num_kv_heads=2, group=2, num_queries=100, head_dim=64, dtype=torch.float16),
         num_splits=None, tiles=None, same_length=False)  # GQA past 64 queries: 200 rows, ragged
@example(case=Case(prefixes=[0], group=4, num_queries=9, head_dim=128, dtype=torch.float32), num_splits=None,
         tiles=None, same_length=False)  # float32 at D = 128: 4 stages of K + V would overflow sm_90's shared memory
def test_decode_attention_matches_reference(case, num_splits, tiles, same_length):
    q, k, v, prefixes = case.tensors()
    lengths = prefixes + case.num_queries
    if same_length:  # one int for every row: the shortest row's length (longer rows stop early)
        lengths = int(lengths.min())
    out, lse = decode_attention(q, k, v, lengths, num_splits=num_splits, check_lengths=True, tiles=tiles)
    expected_out, expected_lse = decode_attention_reference(q, k, v, lengths)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous()  # [batch, L, heads, D] in memory: o_proj reads it as is
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)


@given(case=cases(), num_splits=st.none() | st.integers(1, 6), same_length=st.booleans())
@example(case=EDGE_CASES[1], num_splits=None, same_length=False)  # a row with an empty prefix
@example(case=EDGE_CASES[2], num_splits=3, same_length=False)  # ragged: a short row's prefix slices are empty
def test_block_apart_keeps_the_attention_and_gives_the_prefix_lse(case, num_splits, same_length):
    """With the block's keys in a slice of their own the merge is still the whole attention, and the
    other slices merge to each query's LSE over its row's prefix alone (-inf where that is empty):
    as a logsumexp here, and inside key_scores, whose part_lse scores equal the reference's
    normalised by the prefix's LSE (MAGE's eq. 3)."""
    q, k, v, prefixes = case.tensors()
    lengths = prefixes + case.num_queries
    if same_length:
        lengths = int(lengths.min())
        prefixes = torch.full_like(prefixes, lengths - case.num_queries)
    partials = decode_partials(q, k, v, lengths, num_splits=num_splits, block_apart=True)
    out, lse = merge_splits(*partials, q)
    expected_out, expected_lse = decode_attention_reference(q, k, v, lengths)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)
    _, expected_prefix_lse = decode_attention_reference(q, k, v, prefixes)
    prefix_lse = torch.logsumexp(partials[1][:, :-1] * math.log(2), dim=1).view(expected_prefix_lse.shape)
    assert_lse_close(prefix_lse, expected_prefix_lse)
    if int(prefixes.max()) > 0:
        scores = key_scores(q, k, prefixes, part_lse=partials[1])
        torch.testing.assert_close(scores, key_scores_reference(q, k, prefixes, expected_prefix_lse),
                                   atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_rows", [1, 36, 128, 512])
@pytest.mark.parametrize("stages", [3, decode_module.DENSE_STAGES])
def test_default_tiles_fit_shared_memory(element_size, head_dim, num_rows, stages):
    tiles = decode_module.default_tiles(num_rows, head_dim, element_size, stages)
    stage = 2 * tiles["BLOCK_N"] * head_dim * element_size
    resident = tiles["BLOCK_M"] * head_dim * element_size
    assert 1 <= tiles["num_stages"] <= stages
    assert tiles["num_stages"] * stage + resident <= decode_module.SHARED_MEMORY_BUDGET
    if element_size == 2:  # bf16 / fp16 keep the stages asked for (DENSE_STAGES: 160 KB at D = 128)
        assert tiles["num_stages"] == stages


def launch_bytes(tiles, head_dim, element_size):
    """Shared memory of a decode launch: its K + V stages and the query tile."""
    return (tiles["num_stages"] * 2 * tiles["BLOCK_N"] + tiles["BLOCK_M"]) * head_dim * element_size


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_rows", [1, 36, 128, 512])
def test_dense_tiles_fit_sm90(element_size, head_dim, num_rows):
    """decode_attention's own launch (wide key tiles at D = 128 in 16 bits) fits sm_90's 227 KB."""
    tiles = decode_module.dense_tiles(num_rows, head_dim, element_size, 227 * 1024)
    assert tiles["num_stages"] >= 1 and launch_bytes(tiles, head_dim, element_size) <= 227 * 1024


@pytest.mark.parametrize("num_rows", [1, 36, 128, 512])
@pytest.mark.parametrize("shared_limit", [None, 227 * 1024, 163 * 1024])
def test_wide_key_tiles_only_where_they_fit(num_rows, shared_limit):
    """At D = 128 in 16 bits the 128-key tiles are taken where the device's shared memory holds them (sm_90,
    or the interpreter's None); sm_80's 163 KB gets the 64-key tiles, which fit it."""
    tiles = decode_module.dense_tiles(num_rows, 128, 2, shared_limit)
    assert (tiles["BLOCK_N"] == 128) == (shared_limit != 163 * 1024)
    assert launch_bytes(tiles, 128, 2) <= (shared_limit or 227 * 1024)


def test_decode_attention_strided_q_return_lse_false_and_scale():
    q, k, v, prefixes = Case(prefixes=[40, 70], num_kv_heads=2, group=2, num_queries=3).tensors()
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [batch, L, heads, D] memory, as a projection gives
    lengths = prefixes + 3
    out = decode_attention(q, k, v, lengths, scale=0.3, return_lse=False, max_length=73)
    assert isinstance(out, torch.Tensor)
    assert_close(out, decode_attention_reference(q, k, v, lengths, scale=0.3, return_lse=False), torch.float32)


def draw_count(draw, n):
    kind = draw(st.sampled_from(["empty", "full", "random"]))
    return 0 if kind == "empty" else n if kind == "full" else draw(st.integers(0, n))


def random_index_lists(draw, prefixes, num_kv_heads, index_block, gen):
    """Duplicate-free lists per (row, KV head): empty, full or a random subset, in random order;
    entries past each count are garbage."""
    units = [-(-prefix // index_block) for prefix in prefixes]  # key blocks (or tokens) per prefix
    counts = [[draw_count(draw, n) for _ in range(num_kv_heads)] for n in units]
    width = max(units) + draw(st.integers(0, 3))
    indices = torch.randint(-5, 10**6, (len(prefixes), num_kv_heads, width), generator=gen)
    for row, n in enumerate(units):
        for head in range(num_kv_heads):
            count = counts[row][head]
            indices[row, head, :count] = torch.randperm(n, generator=gen)[:count]
    return indices, torch.tensor(counts)


@given(case=cases(), index_block=st.sampled_from([1, 1, 3, 16, 64, 100, 128]),
       index_dtype=st.sampled_from(["int32", "int64"]),
       num_splits=st.none() | st.integers(1, 6), data=st.data())
def test_sparse_decode_attention_matches_reference(case, index_block, index_dtype, num_splits, data):
    q, k, v, prefixes = case.tensors()
    gen = torch.Generator().manual_seed(case.seed)
    indices, counts = random_index_lists(data.draw, case.prefixes, case.num_kv_heads, index_block, gen)
    indices, counts = indices.to(DEVICE, getattr(torch, index_dtype)), counts.to(DEVICE)
    out, lse = sparse_decode_attention(q, k, v, prefixes, indices, counts, index_block=index_block,
                                       check_indices=True, num_splits=num_splits)
    expected_out, expected_lse = sparse_decode_attention_reference(q, k, v, prefixes, indices, counts,
                                                                   index_block=index_block)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)


def test_sparse_key_block_clipped_across_whole_tiles():
    """Block 1 of 200 tokens is clipped to 10 and listed first: with 128-position slices, slice 1
    starts with a tile of no valid key (running max still -inf) before block 0's keys arrive."""
    case = Case(prefixes=[210], group=2, num_queries=3, dtype=torch.float16)
    q, k, v, prefixes = case.tensors()
    indices, counts = torch.tensor([[[1, 0]]], device=DEVICE), torch.tensor([[2]], device=DEVICE)
    out, lse = sparse_decode_attention(q, k, v, prefixes, indices, counts, index_block=200, num_splits=4)
    expected_out, expected_lse = sparse_decode_attention_reference(q, k, v, prefixes, indices, counts, index_block=200)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("index_block", [64, 128])
def test_sparse_whole_tile_key_blocks(index_block):
    """Key blocks that are whole multiples of the 64-key tile take one list entry per tile (WHOLE_TILES):
    the last block is clipped and listed first, an entry past counts is garbage, and 3 slices cut the
    lists inside a block (mid-block at 128)."""
    case = Case(prefixes=[2 * index_block + 22, index_block + 6], group=2, num_queries=5, dtype=torch.float16)
    q, k, v, prefixes = case.tensors()
    indices = torch.tensor([[[2, 0, 1]], [[1, 0, 7]]], device=DEVICE)
    counts = torch.tensor([[3], [2]], device=DEVICE)
    out, lse = sparse_decode_attention(q, k, v, prefixes, indices, counts, index_block=index_block, num_splits=3)
    expected_out, expected_lse = sparse_decode_attention_reference(q, k, v, prefixes, indices, counts,
                                                                   index_block=index_block)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)


@given(case=cases(max_prefix=100), index_block=st.sampled_from([1, 7, 64]))
@settings(max_examples=10)
def test_sparse_with_every_key_equals_dense(case, index_block):
    """Full index lists (any order) select the whole prefix: the sparse kernel is the dense one."""
    q, k, v, prefixes = case.tensors()
    batch, width = len(case.prefixes), max(-(-p // index_block) for p in case.prefixes)
    indices = torch.zeros(batch, case.num_kv_heads, width, dtype=torch.long)
    counts = torch.zeros(batch, case.num_kv_heads, dtype=torch.long)
    for row, prefix in enumerate(case.prefixes):
        n = -(-prefix // index_block)
        indices[row, :, :n] = torch.arange(n).flip(0)
        counts[row] = n
    sparse = sparse_decode_attention(q, k, v, prefixes, indices.to(DEVICE), counts.to(DEVICE), index_block=index_block)
    dense = decode_attention(q, k, v, prefixes + case.num_queries)
    assert_close(sparse[0], dense[0], case.dtype)
    assert_lse_close(sparse[1], dense[1])


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan")])
def test_a_scale_that_is_not_positive_is_refused(scale):
    """The kernels scale a row's largest raw score to get its largest scaled one: true for a positive scale only."""
    q, k, v, prefixes = Case(prefixes=[5], num_queries=2).tensors()
    indices, counts = torch.arange(5, device=DEVICE).view(1, 1, 5), torch.tensor([[5]], device=DEVICE)
    with pytest.raises(ValueError, match="scale must be positive"):
        decode_attention(q, k, v, prefixes + 2, scale=scale)
    with pytest.raises(ValueError, match="scale must be positive"):
        sparse_decode_attention(q, k, v, prefixes, indices, counts, scale=scale)


@given(case=cases(), reduce=st.sampled_from(["mean", "sum"]), with_dots=st.booleans(),
       num_chunks=st.none() | st.integers(1, 5))
@example(case=EDGE_CASES[1], reduce="sum", with_dots=True, num_chunks=None)
@example(case=Case(prefixes=[0, 0], num_kv_heads=2), reduce="mean", with_dots=True, num_chunks=None)
@example(case=Case(prefixes=[150, 7], num_kv_heads=2, group=8, num_queries=20, dtype=torch.float16), reduce="mean",
         with_dots=True, num_chunks=None)  # 160 query rows: a second query tile, partly padding
def test_key_scores_match_reference(case, reduce, with_dots, num_chunks):
    q, k, v, prefixes = case.tensors()
    _, lse = decode_attention_reference(q, k, v, prefixes + case.num_queries)
    got = key_scores(q, k, prefixes, lse, reduce=reduce, with_dots=with_dots, num_chunks=num_chunks)
    expected = key_scores_reference(q, k, prefixes, lse, reduce=reduce, with_dots=with_dots)
    for actual, wanted in zip(got, expected) if with_dots else [(got, expected)]:
        assert actual.shape == (len(case.prefixes), case.num_kv_heads, max(case.prefixes))
        torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-3)


def test_key_scores_sum_with_block_is_one_per_query():
    """reduce='sum' over prefix keys plus the block keys' probabilities = group * L (each query's
    probabilities sum to 1), with the LSE taken from the decode kernel."""
    case = Case(prefixes=[90, 33], num_kv_heads=2, group=4, num_queries=5)
    q, k, v, prefixes = case.tensors()
    _, lse = decode_attention(q, k, v, prefixes + 5)
    scores = key_scores(q, k, prefixes, lse, reduce="sum")
    for row, prefix in enumerate(case.prefixes):
        block_keys = k[row, prefix:prefix + 5].float().transpose(0, 1).repeat_interleave(4, 0)  # [heads, 5, D]
        block_probs = torch.exp(q[row].float() @ block_keys.transpose(1, 2) * 64**-0.5 - lse[row][..., None])
        total = scores[row, :, :prefix].sum(-1) + block_probs.view(2, 4 * 5, 5).sum((1, 2))
        torch.testing.assert_close(total, torch.full_like(total, 4 * 5.0), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def valid_inputs():
    q, k, v, prefixes = Case(prefixes=[10, 20], num_kv_heads=2, group=2, num_queries=4).tensors()
    return dict(q=q, k_cache=k, v_cache=v, lengths=prefixes + 4)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(k_cache=a["k_cache"].half()), "dtype"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :-1]), "v_cache shape"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
    (lambda a: a.update(q=a["q"][..., :32], k_cache=a["k_cache"][..., :32], v_cache=a["v_cache"][..., :32]),
     "head_dim"),
    (lambda a: a.update(q=a["q"].repeat(1, 1, 65, 1)), "queries"),  # 260 > DENSE_MAX_QUERIES
    (lambda a: a.update(q=a["q"].double(), k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()), "dtype"),
    (lambda a: a.update(lengths=a["lengths"][:1]), "lengths must have shape"),
    (lambda a: a.update(lengths=a["lengths"].float()), "int32 or int64"),
    (lambda a: a.update(lengths=torch.tensor([3, 24], device=DEVICE), check_lengths=True), r"\[L, capacity\]"),
    (lambda a: a.update(lengths=3), r"lengths 3 must lie in \[L, capacity\]"),
    (lambda a: a.update(lengths=24, max_length=10), "below lengths"),  # splits sized for 10 keys would skip 14
    (lambda a: a.update(max_length=10, check_lengths=True), "below lengths"),  # a tensor's, checked on request
    (lambda a: a.update(tiles={"BLOCK_K": 32}), "tiles may set"),
])
def test_decode_attention_rejects_bad_inputs(change, message):
    args = valid_inputs()
    change(args)
    with pytest.raises(ValueError, match=message):
        decode_attention(**args)


def sparse_inputs():
    args = valid_inputs()
    args["cache_lengths"] = args.pop("lengths") - 4
    args["indices"] = torch.tensor([[[0, 1, 2], [9, 8, 7]], [[5, 4, 0], [19, 0, 0]]], device=DEVICE)
    args["counts"] = torch.tensor([[3, 3], [2, 1]], device=DEVICE)
    return args


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(indices=a["indices"][0]), "indices must be"),
    (lambda a: a.update(counts=a["counts"][:, :1]), "counts must have shape"),
    (lambda a: a.update(indices=a["indices"].float()), "int32 or int64"),
    (lambda a: a.update(index_block=0), "index_block"),
    (lambda a: a["indices"].__setitem__((1, 0, 1), 20), r"indices\[1, 0, 1\] = 20 .* \[0, 20\)"),
    (lambda a: a["indices"].__setitem__((0, 1, 2), -1), r"indices\[0, 1, 2\] = -1"),
    (lambda a: a.update(index_block=4), r"indices\[0, 1, 0\] = 9 is not a key block of 4 .* \[0, 3\)"),
    (lambda a: a["counts"].__setitem__((1, 1), 4), r"counts\[1, 1\] = 4"),
    (lambda a: a.update(cache_lengths=a["cache_lengths"] + 5), "capacity"),
    # 68 > MAX_QUERIES: the dense kernel alone takes more
    (lambda a: a.update(q=a["q"].repeat(1, 1, 17, 1)), "queries"),
])
def test_sparse_decode_attention_rejects_bad_inputs(change, message):
    args = sparse_inputs()
    change(args)
    with pytest.raises(ValueError, match=message):
        sparse_decode_attention(**args, check_indices=True)


def test_sparse_decode_garbage_past_counts_is_ignored():
    """Entries past a list's count are neither checked nor read: out-of-range values there leave the
    output and LSE exactly as they were."""
    args = sparse_inputs()
    clean_out, clean_lse = sparse_decode_attention(**args, check_indices=True)
    args["indices"][1, 1, 1:] = 10**6
    out, lse = sparse_decode_attention(**args, check_indices=True)
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(lse=a["lse"][:, :1]), "lse must be"),
    (lambda a: a.update(lse=a["lse"].double()), "lse must be"),
    (lambda a: a.update(reduce="max"), "reduce"),
    (lambda a: a.update(max_length=10**6), "capacity"),
    (lambda a: a.update(part_lse=torch.zeros(4, 3, 8, device=DEVICE)), "exactly one"),
    (lambda a: a.update(lse=None, part_lse=torch.zeros(4, 3, 7, device=DEVICE)), "part_lse must be"),
    (lambda a: a.update(lse=None, part_lse=torch.zeros(4, 1, 8, device=DEVICE)), "slices >= 2"),
    (lambda a: a.update(lse=None), "exactly one"),
])
def test_key_scores_rejects_bad_inputs(change, message):
    args = valid_inputs()
    args = dict(q=args["q"], k_cache=args["k_cache"], cache_lengths=args["lengths"] - 4,
                lse=torch.zeros(args["q"].shape[:3], device=DEVICE))
    change(args)
    with pytest.raises(ValueError, match=message):
        key_scores(**args)


@pytest.mark.parametrize("dim", [-1, 0])
def test_a_cache_of_another_shape_is_refused(dim):
    """Caches twice q's head dim (64 against 128, each a valid head dim alone) or twice its batch (its rows
    would be read against the wrong cache rows): named by every block-decode kernel before it reads a
    cache row as if it were q's."""
    args = valid_inputs()
    args["k_cache"], args["v_cache"] = (torch.cat([args[name]] * 2, dim=dim) for name in ("k_cache", "v_cache"))
    with pytest.raises(ValueError, match="does not match q"):
        decode_attention(**args)
    args = sparse_inputs()
    args["k_cache"], args["v_cache"] = (torch.cat([args[name]] * 2, dim=dim) for name in ("k_cache", "v_cache"))
    with pytest.raises(ValueError, match="does not match q"):
        sparse_decode_attention(**args)
    lse = torch.zeros(args["q"].shape[:3], device=DEVICE)
    with pytest.raises(ValueError, match="does not match q"):
        key_scores(args["q"], args["k_cache"], args["cache_lengths"], lse)


def test_a_cache_filled_to_capacity_is_taken():
    """Keys up to the last slot of the cache are within the contract (L <= lengths <= capacity; a prefix of
    max_length <= capacity): an int length equal to the capacity (attention.py's cache-free path gives
    k.shape[2]), checked lengths and checked index lists that reach it, and key scores of a prefix that
    fills the cache are computed, as their references give them."""
    case = Case(prefixes=[20, 13], num_kv_heads=2, group=2, num_queries=4)
    q, k, v, prefixes = case.tensors()
    full = k[:, :24], v[:, :24]  # row 0's prefix + L fills all 24 slots
    every = [cache.nan_to_num() for cache in full]  # one int length: row 1 attends to all 24 slots too
    out, lse = decode_attention(q, *every, 24)
    expected_out, expected_lse = decode_attention_reference(q, *every, 24)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)
    out, lse = decode_attention(q, *full, prefixes + 4, check_lengths=True)
    expected_out, expected_lse = decode_attention_reference(q, *full, prefixes + 4)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)
    indices = torch.tensor([[[19, 3, 0], [7, 19, 2]], [[12, 0, 0], [5, 6, 0]]], device=DEVICE)
    counts = torch.tensor([[3, 2], [1, 2]], device=DEVICE)
    out, lse = sparse_decode_attention(q, *full, prefixes, indices, counts, check_indices=True)
    expected_out, expected_lse = sparse_decode_attention_reference(q, *full, prefixes, indices, counts)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)
    prefix_cache = k[:, :20]  # row 0's prefix is the whole cache
    scores = key_scores(q, prefix_cache, prefixes, expected_lse, max_length=20)
    torch.testing.assert_close(scores, key_scores_reference(q, prefix_cache, prefixes, expected_lse),
                               atol=1e-5, rtol=1e-3)


def test_inputs_are_read_through_their_strides():
    """Every tensor a block-decode kernel takes is read through its own strides: a V cache laid out
    head-major ([batch, kv_heads, capacity, D] in memory) next to a K cache that is not, index lists and
    counts as transposed views, and q and lse sliced out of a wider block (common.py's mask votes pass
    such slices) give what their contiguous copies give the references."""
    case = Case(prefixes=[37, 21], num_kv_heads=2, group=2, num_queries=8, dtype=torch.float16)
    q_wide, k, v, prefixes = case.tensors()
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, head-major in memory
    assert v.stride() != k.stride()
    q = q_wide[:, :, 4:]  # the block's last 4 queries, a view of the 8
    assert not q.is_contiguous()
    out, lse = decode_attention(q, k, v, prefixes + 8, tiles={"BLOCK_N": 16})  # whole tiles and a partial one
    expected_out, expected_lse = decode_attention_reference(q.contiguous(), k, v.contiguous(), prefixes + 8)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)

    indices = torch.tensor([[[0, 32, 5, 9], [2, 30, 8, 0]], [[16, 1, 0, 0], [4, 11, 12, 15]]], device=DEVICE)
    counts = torch.tensor([[4, 3], [2, 4]], device=DEVICE)
    strided_indices = indices.transpose(1, 2).contiguous().transpose(1, 2)
    strided_counts = counts.t().contiguous().t()
    assert not strided_counts.is_contiguous() and not strided_indices.is_contiguous()
    out, lse = sparse_decode_attention(q, k, v, prefixes - 4, strided_indices, strided_counts, check_indices=True)
    expected_out, expected_lse = sparse_decode_attention_reference(q.contiguous(), k, v.contiguous(), prefixes - 4,
                                                                   indices, counts)
    assert_close(out, expected_out, case.dtype)
    assert_lse_close(lse, expected_lse)

    _, wide_lse = decode_attention_reference(q_wide, k, v, prefixes + 8)
    lse = wide_lse[:, :, 4:]  # the 4 queries' LSEs, a view
    assert not lse.is_contiguous()
    for reduce in ("mean", "sum"):
        scores, dots = key_scores(q, k, prefixes, lse, reduce=reduce, with_dots=True)
        expected = key_scores_reference(q.contiguous(), k, prefixes, lse.contiguous(), reduce=reduce, with_dots=True)
        torch.testing.assert_close(scores, expected[0], atol=1e-5, rtol=1e-3)
        torch.testing.assert_close(dots, expected[1], atol=1e-5, rtol=1e-3)
