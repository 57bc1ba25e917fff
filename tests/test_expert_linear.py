"""kernels/expert_linear.py (each expert's linear layer over its grouped rows, optionally gated) against
one F.linear per expert. Both are held against the float64 result: the kernel must come as close as the
per-expert torch path does in the same dtype (tests/test_norm_linear.py's bound). Groups are drawn
empty, of one row, longer than a tile and long enough for its wider row tiles; rows past the last group
(another rank's experts) must stay unwritten: outputs are allocated NaN-filled. Off the GPU the kernel
runs in Triton's interpreter (float16 and float32, whose dots it computes correctly)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanodllm.kernels.expert_linear import (GLUS, expert_linear, expert_linear_reference, group_by_expert,  # noqa: E402
                                            group_by_expert_reference, tile_shape)
from nanodllm.kernels.norm_linear import SHARED_SLACK  # noqa: E402
from tests.device import DEVICE  # noqa: E402
from tests.test_norm_linear import nan_empty, within  # noqa: E402

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def inputs(sizes, trailing, dim, width, dtype, glu, seed):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)
    x = make(sum(sizes) + trailing, dim)
    weight = make(len(sizes), 2 * width if glu else width, dim, scale=dim**-0.5)
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    return x, weight, ends


def errors(out, x, weight, ends, glu):
    """max |out - float64 result| over the grouped rows and the per-expert torch path's, in x's dtype."""
    written = int(ends[-1])
    exact = expert_linear_reference(x.double(), weight.double(), ends, glu)[:written]
    torch_path = expert_linear_reference(x, weight, ends, glu)[:written]
    return ((out[:written].double() - exact).abs().max().item(), (torch_path.double() - exact).abs().max().item(),
            exact)


@settings(deadline=None, max_examples=20)
@given(sizes=st.lists(st.sampled_from([0, 0, 1, 2, 3, 17, 35, 90]), min_size=1, max_size=5).filter(any),
       trailing=st.integers(0, 3), dim=st.sampled_from([16, 40, 200]), width=st.sampled_from([8, 24, 100, 130]),
       dtype=st.sampled_from(DTYPES), glu=st.sampled_from(GLUS), seed=st.integers(0, 2**16))
def test_expert_linear_comes_as_close_as_one_linear_per_expert(sizes, trailing, dim, width, dtype, glu, seed):
    check(sizes, trailing, dim, width, dtype, glu, seed)


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("per_token, tokens, held", [(2, 9, None), (4, 30, range(3, 6)), (1, 5, None), (8, 40, None)])
def test_rows_gathered_as_they_load_equal_the_gathered_copy(per_token, tokens, held, glu):
    """With pairs (group_by_expert's order), grouped row r is token pairs[r] // per_token, read in place:
    bit for bit the kernel on the gathered rows (the same tiles); 40 tokens x 8 take 64-row tiles."""
    generator = torch.Generator().manual_seed(per_token)
    x = torch.randn(tokens, 40, generator=generator).to(DEVICE, torch.float16)
    weight = (torch.randn(8, 48 if glu else 24, 40, generator=generator) * 40**-0.5).to(DEVICE, torch.float16)
    chosen = torch.randint(0, 8, (tokens, per_token), generator=generator).to(DEVICE)
    held_weight = weight if held is None else weight[held.start:held.stop]
    order, ends, _ = group_by_expert(chosen, 8, held)
    with nan_empty():
        gathered = expert_linear(x, held_weight, ends, glu, order, per_token)
        copied = expert_linear(x[order // per_token], held_weight, ends, glu)
    assert gathered.shape == copied.shape == (tokens * per_token, 24)
    written = int(ends[-1])
    assert torch.equal(gathered[:written], copied[:written]) and gathered[written:].isnan().all()


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("sizes, tile", [([3, 20, 0, 40] + [0] * 12, 16), ([5, 30, 0, 45, 0, 0, 0, 70], 32),
                                         ([40, 70, 10, 150, 0, 0, 0, 0], 64), ([90, 200, 50], 128)])
def test_each_row_tile_width(sizes, tile, glu):
    """At each tile some expert's rows overflow it: tiles twice as tall up to 128 rows (once, and twice for
    the busiest), a second 128-row tile; from 32 rows one expert's fit half a tile (the kernel's narrower
    branch); the others fit one."""
    assert tile_shape(sum(sizes) + 2, len(sizes), 40, glu, 2, None)["BLOCK_M"] == tile
    check(sizes, 2, 40, 24, torch.float16, glu, tile)


def check(sizes, trailing, dim, width, dtype, glu, seed):
    x, weight, ends = inputs(sizes, trailing, dim, width, dtype, glu, seed)
    with nan_empty():
        out = expert_linear(x, weight, ends, glu)
    assert out.shape == (len(x), width) and out.dtype == dtype
    assert out[int(ends[-1]):].isnan().all(), "rows past the last group are left unwritten"
    out_error, torch_error, exact = errors(out, x, weight, ends, glu)
    assert within(out_error, torch_error, exact, dtype, dim), (out_error, torch_error)


@pytest.mark.parametrize("group", [group_by_expert, group_by_expert_reference])
@pytest.mark.parametrize("num_experts, held, tokens", [(3, None, 50), (256, None, 50), (300, None, 50),
                                                       (300, range(120), 50), (300, range(150, 300), 50),
                                                       (40000, None, 50), (16, range(4, 8), 700), (16, None, 0)])
def test_group_by_expert_sorts_the_pairs_stably_by_expert(num_experts, held, tokens, group):
    """Ids from 0 to num_experts - 1 (the top one drawn too, whatever type holds it): each held expert's group
    holds its (token, slot) pairs in their order, and group_ends counts the rows up to each group's end; a
    share's groups are its experts', numbered from its first, the other experts' pairs after them; slot_of
    is order's inverse. The kernel (a sort past its limit: 40,000 experts) and the sort; 2,800 pairs span
    several of the kernel's blocks; no pairs, empty groups."""
    generator = torch.Generator().manual_seed(num_experts)
    experts = torch.randint(0, num_experts, (tokens, 4), generator=generator)
    if tokens:
        experts[0, 0], experts[-1, -1] = num_experts - 1, 0
    order, ends, slot_of = group(experts.to(DEVICE), num_experts, held)
    start = 0 if held is None else held.start
    ids = [(i - start) % num_experts for i in experts.flatten().tolist()]
    assert order.dtype == slot_of.dtype == torch.int64 and ends.dtype == torch.int32
    assert order.tolist() == sorted(range(len(ids)), key=lambda pair: (ids[pair], pair))
    assert [slot_of.tolist()[pair] for pair in order.tolist()] == list(range(len(ids))), "slot_of: order's inverse"
    groups = num_experts if held is None else len(held)
    assert ends.tolist() == [sum(i <= e for i in ids) for e in range(groups)]


def test_row_tiles_grow_with_the_rows_per_expert():
    """A block step's few rows per expert take 16-row tiles; a canvas's dozens take tiles that hold an
    expert's rows whole (its weights read once), up to 128."""
    tile = lambda rows, experts: tile_shape(rows, experts, 2816, "gelu_tanh", 2, None)["BLOCK_M"]
    assert [tile(32 * 8, 128), tile(256 * 8, 128), tile(1024 * 8, 128), tile(8192 * 8, 128)] == [16, 32, 128, 128]


@pytest.mark.parametrize("limit", [232448, 101376])  # sm_90, consumer GPUs
@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("element_size", [2, 4])
def test_every_row_tile_fits_the_shared_memory(limit, glu, element_size):
    """The tiles tile_shape picks fit the device's shared memory at a busy expert's twice-as-tall rows (up
    to 128): stages x (weight rows + x rows) x BLOCK_K."""
    for rows_per_expert in (1, 8, 16, 24, 64):
        shape = tile_shape(rows_per_expert * 128, 128, 2816, glu, element_size, limit)
        rows = shape["BLOCK_N"] * (2 if glu else 1) + min(2 * shape["BLOCK_M"], 128)
        used = shape["num_stages"] * rows * shape["BLOCK_K"] * element_size + SHARED_SLACK
        assert used <= limit and shape["BLOCK_K"] >= 16 and shape["num_stages"] >= 2, (rows_per_expert, shape)


@pytest.mark.parametrize("mistake", ["neighbour's weights", "halves", "activation"])
def test_the_comparison_catches_a_wrong_expert_or_formula(mistake):
    """The bound above fails rows sent through the next expert, gate and up swapped, or the other activation."""
    x, weight, ends = inputs([3, 17, 2], 0, 40, 24, torch.float16, "gelu_tanh", 5)
    wrong = weight.roll(1, dims=0) if mistake == "neighbour's weights" else torch.cat(weight.chunk(2, dim=1)[::-1], 1)
    out = expert_linear(*((x, weight, ends, "silu") if mistake == "activation" else (x, wrong, ends, "gelu_tanh")))
    out_error, torch_error, exact = errors(out, x, weight, ends, "gelu_tanh")
    assert not within(out_error, torch_error, exact, torch.float16, 40)


def test_bad_inputs_are_refused():
    x, weight, ends = inputs([2, 3], 0, 16, 8, torch.float16, False, 0)
    cases = [
        ((x, weight[:, :, :8], ends), "weight \\[E, N, K\\]"),
        ((x, weight, ends[:1]), "group_ends \\[E\\]"),
        ((x.float(), weight, ends), "share one of"),
        ((x, weight, ends.long()), "int32"),
        ((x, weight[:, :7], ends, "silu"), "even N"),
        ((x, weight, ends, "relu"), "glu must be one of"),
        ((x, weight, ends, None, ends), "pairs must be \\[R\\] int64"),
        ((x, weight, ends, None, ends.long(), 0), "per_token at least 1"),
        ((x.t().contiguous().t(), weight, ends), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            expert_linear(*args)
