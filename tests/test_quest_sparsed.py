"""Quest (per-block pages) and SparseD (capture after 20% of the steps), the MAGE paper's baselines:
page bounds really bound, incremental bounds equal recomputed ones, full budget equals dense, tiny
budget differs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm import block
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.quest import page_bounds, page_scores
from tests.tiny_models import random_prompt, tiny_model
from tests.device import DEVICE

GEN = GenerationConfig(gen_length=12, block_length=4, steps=4, remasking="low_confidence_static")


def generate(model, prompts, method):
    return block.generate(model, prompts, GEN, method=method, stop_ids=())


@settings(max_examples=30, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 16]), pages=st.integers(1, 5), group=st.sampled_from([1, 2]),
       fill=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_page_score_is_quests_bound_on_the_block_mean_of_each_query_best_key(page_size, pages, group, fill, seed):
    generator = torch.Generator().manual_seed(seed)
    n, kv_heads, head_dim, block_len = pages * page_size, 2, 8, 3
    lengths = torch.tensor([max(1, round(fill * n)), n])
    keys = torch.randn(2, n, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    q = torch.randn(2, kv_heads * group, block_len, head_dim, generator=generator, dtype=torch.float64)
    low, high = page_bounds(keys, lengths, page_size)
    scores = page_scores(q, low, high)  # [2, kv_heads, pages]
    rows = q.reshape(2, kv_heads, group * block_len, head_dim)
    for b in range(2):
        for page in range((int(lengths[b]) + page_size - 1) // page_size):
            tokens = keys[b, page * page_size : min((page + 1) * page_size, int(lengths[b]))].transpose(0, 1)
            best = (rows[b] @ tokens.transpose(1, 2)).amax(-1).mean(-1)  # [kv_heads]
            assert (scores[b, :, page] >= best - 1e-5 * (1 + best.abs())).all()  # scores are float32
            # and it is Quest's bound itself, sum_d max(q_d min_d, q_d max_d), averaged over the rows
            low_d, high_d = tokens.amin(1)[:, None], tokens.amax(1)[:, None]  # [kv_heads, 1, D]
            bound = torch.maximum(rows[b] * low_d, rows[b] * high_d).sum(-1).mean(-1)
            torch.testing.assert_close(scores[b, :, page].double(), bound, atol=1e-5, rtol=1e-5)


def test_incremental_bounds_equal_recomputed_bounds():
    model = tiny_model("sdar")
    prompts = [random_prompt(9, seed=1), random_prompt(22, seed=2)]
    quest = get_method("quest", k=8, page_size=4, exact_layers=0)
    result = generate(model, prompts, quest)
    cache = result.cache
    assert quest.bounds
    for layer, bounds in quest.bounds.items():
        # the last update saw the cache before the final commit: the last block is not in the bounds
        assert bounds.summarised == [n - 4 for n in cache.host_lengths]
        width = -(-max(bounds.summarised) // 4)
        low, high = page_bounds(cache.keys[layer][:, : width * 4], torch.tensor(bounds.summarised), 4)
        torch.testing.assert_close(bounds.low[:, :, :width], low, atol=0, rtol=0)
        torch.testing.assert_close(bounds.high[:, :, :width], high, atol=0, rtol=0)


@pytest.mark.parametrize("name,knobs", [("quest", dict(k=64, page_size=4)), ("quest", dict(k=64, page_size=16)),
                                        ("sparsed", dict(k=64)), ("sparsed", dict(k=64, exact_fraction=0.5))])
def test_full_budget_equals_dense(name, knobs):
    model = tiny_model("sdar")
    prompts = [random_prompt(9, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    dense = generate(model, prompts, get_method("dense"))
    for sparse_commit in (False, True):
        method = get_method(name, exact_layers=0, sparse_commit=sparse_commit, **knobs)
        assert generate(model, prompts, method).tokens == dense.tokens


@pytest.mark.parametrize("name,knobs,kept_below", [("quest", dict(k=2, page_size=2), 0.5),
                                                   ("sparsed", dict(k=1, exact_fraction=0.5), 0.6)])
def test_tiny_budget_differs(name, knobs, kept_below):
    """SparseD at half of 4 steps: steps 0-1 exact (all keys read), captured at step 1, so not MAGE."""
    model = tiny_model("sdar")
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    dense = generate(model, prompts, get_method("dense"))
    method = get_method(name, exact_layers=0, **knobs)
    assert generate(model, prompts, method).tokens != dense.tokens
    assert 0 < method.stats["kv_kept"] < kept_below


def test_sparsed_captures_after_a_fifth_of_the_steps():
    sparsed = get_method("sparsed")
    capture = lambda steps: sparsed.capture_step(type("Ctx", (), {"steps_per_block": steps})())
    assert [capture(t) for t in (1, 4, 32)] == [0, 0, 5]  # 32 steps: 6 exact (0..5), capture at 5
    assert get_method("sparsed", exact_fraction=1.0).capture_step(type("Ctx", (), {"steps_per_block": 8})()) == 7


# Blocks of 8 tokens over 8 steps: SparseD's default 20% gives capture step max(1, round(1.6)) - 1 = 1 and
# exact_fraction 0.5 step 3, where GEN's 4 steps give step 0 for both (SparseD is then MAGE, step for step).
GEN8 = GenerationConfig(gen_length=16, block_length=8, steps=8, remasking="low_confidence_static")


def generate8(model, prompts, method):
    return block.generate(model, prompts, GEN8, method=method, stop_ids=())


@pytest.mark.parametrize("exact_fraction,capture", [(0.2, 1), (0.5, 3)])
def test_sparsed_capturing_after_step_0_is_not_mage(exact_fraction, capture):
    """A later capture: exact steps before it (more keys read than MAGE), a selection from partly
    unmasked queries (other tokens than MAGE's at the same tiny k), and dense's tokens at a full k."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    sparsed = get_method("sparsed", k=1, exact_fraction=exact_fraction, exact_layers=0)
    assert sparsed.capture_step(type("Ctx", (), {"steps_per_block": GEN8.steps})()) == capture
    mage = get_method("mage", k=1, exact_layers=0)
    mage_tokens = generate8(model, prompts, mage).tokens
    assert generate8(model, prompts, sparsed).tokens != mage_tokens
    assert mage.stats["kv_kept"] < sparsed.stats["kv_kept"] < 1
    dense = generate8(model, prompts, get_method("dense"))
    full = get_method("sparsed", k=64, exact_fraction=exact_fraction, exact_layers=0)
    assert generate8(model, prompts, full).tokens == dense.tokens


@pytest.mark.parametrize("name,knobs", [("mage", dict(k=8)), ("quest", dict(k=8, page_size=2)), ("sparsed", dict(k=8))])
def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch(name, knobs):
    """DESIGN.md: a row's result must not depend on the batch. At k = 8 every row loses keys (the 6-token
    prompt once its first block is committed), so the tokens are not dense's."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(6, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    method = get_method(name, exact_layers=0, **knobs)
    batch = generate8(model, prompts, method).tokens
    assert method.stats["kv_kept"] < 1
    assert batch != generate8(model, prompts, get_method("dense")).tokens
    for row, prompt in enumerate(prompts):
        assert generate8(model, [prompt], get_method(name, exact_layers=0, **knobs)).tokens[0] == batch[row]


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="page_size"):
        get_method("quest", page_size=0)
    with pytest.raises(ValueError, match="k must be"):
        get_method("quest", k=8, page_size=16)
    with pytest.raises(ValueError, match="exact_fraction"):
        get_method("sparsed", exact_fraction=1.5)


def test_page_lists_on_the_kernel_match_torch(kernels_on, monkeypatch):
    """Quest's key-block lists (the last page partial) through kernels/sparse_decode_attention (float16;
    interpreted on a CPU, compiled on a GPU) against the torch gather."""
    import nanodllm.attention as attention_module
    from nanodllm.methods.common import sparse_cache_attention

    generator = torch.Generator().manual_seed(11)
    batch, kv_heads, group, block_len, head_dim, page = 2, 2, 2, 4, 64, 4
    prefix_lengths = torch.tensor([13, 30], device=DEVICE)  # 4 and 8 pages, row 0's last page holds 1 key
    q = torch.randn(batch, kv_heads * group, block_len, head_dim, generator=generator).half().to(DEVICE)
    k_cache, v_cache = (torch.randn(batch, 40, kv_heads, head_dim, generator=generator).half().to(DEVICE)
                        for _ in range(2))
    slots = prefix_lengths[:, None] + torch.arange(block_len, device=DEVICE)
    rows = torch.arange(batch, device=DEVICE)[:, None]
    k_block, v_block = k_cache[rows, slots].transpose(1, 2), v_cache[rows, slots].transpose(1, 2)
    indices = torch.tensor([[[0, 3, 0], [1, 2, 3]], [[2, 5, 7], [0, 6, 0]]], dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([[2, 3], [3, 2]], dtype=torch.int32, device=DEVICE)
    args = (q, k_block, v_block, k_cache, v_cache, prefix_lengths, indices, counts, page)
    with torch.no_grad():
        monkeypatch.setattr(attention_module, "KERNELS_ENABLED", False)  # the torch gather, on a GPU too
        expected = sparse_cache_attention(*args)
        monkeypatch.setattr(attention_module, "KERNELS_ENABLED", True)
        got = sparse_cache_attention(*args)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def quest_pages(q, keys, n: int, page_size: int, pages: int) -> list[set[int]]:
    """Quest's choice for one row as its paper states it, in float64: per KV head, the pages of highest
    bound sum_d max(q_d min_d, q_d max_d), averaged over the block's queries and the group's heads,
    where min and max run over the page's keys (the last page clipped to the prefix)."""
    num_heads, kv_heads = q.shape[0], keys.shape[1]
    group, chosen = num_heads // kv_heads, []
    for h in range(kv_heads):
        queries = q[h * group : (h + 1) * group].double().reshape(-1, q.shape[-1])  # [group * L, d]
        bounds = []
        for start in range(0, n, page_size):
            page = keys[start : min(start + page_size, n), h].double()
            low, high = page.min(0).values, page.max(0).values
            bounds.append(torch.maximum(queries * low, queries * high).sum(-1).mean())
        chosen.append(set(torch.stack(bounds).topk(min(pages, len(bounds))).indices.tolist()))
    return chosen


@pytest.mark.parametrize("k, page_size, exact_layers", [(2, 2, 0), (4, 2, 1), (6, 3, 0)])
def test_quest_pages_each_layer_from_its_own_bounds_and_attends_to_them(k, page_size, exact_layers):
    """Every sparse layer, step and block: the chosen pages equal Quest's bound computed from that
    layer's queries and its own cached keys, and the output equals plain attention over exactly those
    pages' keys plus the block's own, on a ragged batch."""
    model = tiny_model("sdar", num_hidden_layers=3)
    prompts = [random_prompt(n, seed=n) for n in (9, 14, 6)]
    quest = get_method("quest", k=k, page_size=page_size, exact_layers=exact_layers)
    attend, checked = quest.attend, []

    def checked_attend(layer, q, k_, v, ctx):
        out = attend(layer, q, k_, v, ctx)
        cache = ctx.cache
        if ctx.phase != "step" or layer < exact_layers or cache.max_length == 0:
            return out
        indices, counts = quest.selection[layer]
        group = q.shape[1] // cache.keys[layer].shape[2]
        for row in range(q.shape[0]):
            n = int(cache.lengths[row])
            pages = quest_pages(q[row], cache.keys[layer][row], n, page_size, k // page_size)
            for h, expected in enumerate(pages):
                assert set(indices[row, h, : int(counts[row, h])].tolist()) == expected
            for head in range(q.shape[1]):
                pages_of_head = sorted(pages[head // group])
                slots = [s for page in pages_of_head for s in range(page * page_size, min((page + 1) * page_size, n))]
                slots += list(range(n, n + q.shape[2]))
                keys = cache.keys[layer][row, slots, head // group].double()
                values = cache.values[layer][row, slots, head // group].double()
                probs = (q[row, head].double() @ keys.T * q.shape[-1] ** -0.5).softmax(-1)
                torch.testing.assert_close(out[row, head].double(), probs @ values, atol=1e-10, rtol=0)
        checked.append(layer)
        return out

    quest.attend = checked_attend
    generate(model, prompts, quest)
    assert set(checked) == set(range(exact_layers, model.cfg.num_layers)) and len(checked) >= 3 * 4 * 2


@pytest.mark.parametrize("name,knobs", [("quest", dict(k=4, page_size=2)), ("mage", dict(k=4)), ("sparsed", dict(k=4))])
def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does(name, knobs):
    """Nothing of one generation (Quest's page bounds, the block selections) leaks into the next: after
    decoding two prompts, the method decodes two others of the same lengths as a new one does."""
    model = tiny_model("sdar")
    reused = get_method(name, exact_layers=0, **knobs)
    generate(model, [random_prompt(30, seed=10), random_prompt(17, seed=11)], reused)
    prompts = [random_prompt(30, seed=12), random_prompt(17, seed=13)]
    fresh = generate(model, prompts, get_method(name, exact_layers=0, **knobs))
    assert generate(model, prompts, reused).tokens == fresh.tokens


def test_quest_reports_no_pages_before_a_reused_instance_chooses_any():
    """The first block of a new generation attends exactly (its cache is empty): a Quest reused after
    another prompt reports no chosen pages there, not the last generation's."""
    model = tiny_model("sdar")
    quest = get_method("quest", k=4, page_size=2, exact_layers=0)
    generate(model, [random_prompt(20, seed=1)], quest)
    seen = []
    attended_selection = quest.attended_selection
    quest.attended_selection = lambda layer, ctx: seen.append(
        (ctx.cache.max_length, attended_selection(layer, ctx))) or seen[-1][1]
    quest_attend = quest.attend
    quest.attend = lambda layer, q, k, v, ctx: (quest.attended_selection(layer, ctx), quest_attend(layer, q, k, v, ctx))[1]
    generate(model, [random_prompt(3, seed=2)], quest)
    assert seen and all(chosen is None for cached, chosen in seen if cached == 0)
