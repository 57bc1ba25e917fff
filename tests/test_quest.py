"""Quest (methods/quest.py), per-block pages from per-page key bounds: the page bound really bounds,
incremental bounds equal recomputed ones, each layer pages from its own bounds and attends to them,
a budget covering the prefix equals dense and a tiny one does not, what selection states (whole pages
of k, none at exact layers or on an empty cache) and the kv_kept the meter counts from it, the kernel
reads the page lists as the torch gather does, a row decodes alone as in a batch and a reused object
as a fresh one, and the engine with Quest equals a plain-torch reference (tests/block_references.py)
on random decodes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.methods import get_method
from nanodllm.methods.quest import page_bounds, page_scores
from tests.block_references import (GEN8, Recompute, assert_matches_reference, decodes, keys_read, run, selections,
                                    sparse_layers, step_lengths)
from tests.device import DEVICE
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
    result = run(model, prompts, quest)
    cache = result.cache
    assert quest.bounds
    for layer, bounds in quest.bounds.items():
        # the last update saw the cache before the final commit: the last block is not in the bounds
        assert bounds.summarised == [n - 4 for n in cache.host_lengths]
        width = -(-max(bounds.summarised) // 4)
        low, high = page_bounds(cache.keys[layer][:, : width * 4], torch.tensor(bounds.summarised), 4)
        torch.testing.assert_close(bounds.low[:, :, :width], low, atol=0, rtol=0)
        torch.testing.assert_close(bounds.high[:, :, :width], high, atol=0, rtol=0)


@pytest.mark.parametrize("knobs", [dict(k=64, page_size=4), dict(k=64, page_size=16)])
def test_full_budget_equals_dense(knobs):
    model = tiny_model("sdar")
    prompts = [random_prompt(9, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    dense = run(model, prompts, get_method("dense"))
    for sparse_commit in (False, True):
        method = get_method("quest", exact_layers=0, sparse_commit=sparse_commit, **knobs)
        assert run(model, prompts, method).tokens == dense.tokens


def test_tiny_budget_differs():
    model = tiny_model("sdar")
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    dense = run(model, prompts, get_method("dense"))
    result = run(model, prompts, get_method("quest", k=2, page_size=2, exact_layers=0))
    assert result.tokens != dense.tokens
    assert 0 < result.stats["kv_kept"] < 0.5


def test_selection_states_whole_pages_of_k_and_nothing_at_exact_layers():
    """Quest.selection after each step's layer: None at the exact layers; else this step's pages as key
    blocks of page_size, read at this step (not chosen_now), at most k // page_size pages, so at most
    most = k // page_size * page_size keys (k = 7, pages of 2: 3 pages, 6 keys)."""
    model = tiny_model("sdar", num_hidden_layers=3)
    _, seen = selections(get_method("quest", k=7, page_size=2, exact_layers=1), model,
                         [random_prompt(n, seed=n) for n in (9, 14, 6)])
    assert {layer for (_, _, layer), (_, chosen) in seen.items() if chosen is None} == {0}
    for (block, step, layer), (lengths, chosen) in seen.items():
        if layer == 0:
            continue
        assert (chosen.index_block, chosen.most, chosen.chosen_now) == (2, 6, False)
        assert chosen.counts.tolist() == [[min(3, -(-n // 2))] * chosen.counts.shape[1] for n in lengths]


def test_kv_kept_counts_every_key_at_exact_layers_and_at_most_whole_pages_of_k_at_the_others():
    """The meter's kv_kept equals a hand count over the steps: the exact layers read each row's n prefix
    keys at every step, the others min(k // page_size * page_size, n) (k = 7, pages of 2: 6)."""
    model = tiny_model("sdar", num_hidden_layers=3)
    result, steps = step_lengths(get_method("quest", k=7, page_size=2, exact_layers=1), model,
                                 [random_prompt(5, seed=1), random_prompt(21, seed=2)])
    expected = keys_read(steps, 3, lambda step, layer: layer < 1, 6)
    assert {n < 6 for _, lengths in steps for n in lengths} == {True, False}
    assert 0 < expected < 1 and result.stats["kv_kept"] == pytest.approx(expected, rel=1e-12)


def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch():
    """DESIGN.md: a row's result must not depend on the batch. At k = 8 every row loses keys (the 6-token
    prompt once its first block is committed), so the tokens are not dense's."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(6, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    batch = run(model, prompts, get_method("quest", k=8, page_size=2, exact_layers=0), GEN8)
    assert batch.stats["kv_kept"] < 1
    assert batch.tokens != run(model, prompts, get_method("dense"), GEN8).tokens
    for row, prompt in enumerate(prompts):
        alone = run(model, [prompt], get_method("quest", k=8, page_size=2, exact_layers=0), GEN8)
        assert alone.tokens[0] == batch.tokens[row]


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="page_size"):
        get_method("quest", page_size=0)
    with pytest.raises(ValueError, match="k must be"):
        get_method("quest", k=8, page_size=16)


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
        indices, counts = quest.pages[layer]
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
    run(model, prompts, quest)
    assert set(checked) == set(range(exact_layers, model.cfg.num_layers)) and len(checked) >= 3 * 4 * 2


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """Nothing of one generation (the page bounds, the pages chosen) leaks into the next: after decoding
    two prompts, the method decodes two others of the same lengths as a new one does."""
    model = tiny_model("sdar")
    reused = get_method("quest", k=4, page_size=2, exact_layers=0)
    run(model, [random_prompt(30, seed=10), random_prompt(17, seed=11)], reused)
    prompts = [random_prompt(30, seed=12), random_prompt(17, seed=13)]
    fresh = run(model, prompts, get_method("quest", k=4, page_size=2, exact_layers=0))
    assert run(model, prompts, reused).tokens == fresh.tokens


def test_quest_reports_no_pages_before_a_reused_instance_chooses_any():
    """The first block of a new generation attends exactly (its cache is empty): a Quest reused after
    another prompt states no pages there (Quest.selection, as the meter asks after each step), not the
    last generation's."""
    model = tiny_model("sdar")
    quest = get_method("quest", k=4, page_size=2, exact_layers=0)
    run(model, [random_prompt(20, seed=1)], quest)
    seen, selection = [], quest.selection
    quest.selection = lambda layer, ctx: seen.append((ctx.cache.max_length, selection(layer, ctx))) or seen[-1][1]
    run(model, [random_prompt(3, seed=2)], quest)
    assert any(cached == 0 for cached, _ in seen) and any(cached > 0 for cached, _ in seen)
    assert all(chosen is None for cached, chosen in seen if cached == 0)


class ReferenceQuest(Recompute):
    """Quest per block, as MAGE's paper adapts it (methods/quest.py). At every step, each layer from
    exact_layers on cuts the row's prefix into pages of page_size keys (the last one clipped), bounds
    each page per KV head by sum_d max(q_d min_d, q_d max_d) (min and max: channel-wise over the page's
    keys), averages the bound over the block's queries and the group's heads, and attends to the
    k // page_size pages of highest bound and the block's own keys (read, not chosen from exact
    attention). The commit is exact unless sparse_commit, when it chooses the same way from its own
    queries."""

    def __init__(self, k, page_size, exact_layers, sparse_commit):
        super().__init__(k, exact_layers, sparse_commit)
        self.page_size = page_size

    def prefix_keys(self, row, layer, q, k, ctx):
        if layer < self.exact_layers or (ctx.phase == "commit" and not self.sparse_commit):
            return None, None
        p, (kv_heads, n) = self.page_size, k.shape[:2]
        queries = q.unflatten(0, (kv_heads, -1)).flatten(1, 2)  # [kv_heads, group * L, d]
        bounds = torch.zeros(kv_heads, -(-n // p), dtype=q.dtype)
        for page, start in enumerate(range(0, n, p)):
            low, high = k[:, start : start + p].amin(1), k[:, start : start + p].amax(1)  # [kv_heads, d]
            bounds[:, page] = torch.maximum(queries * low[:, None], queries * high[:, None]).sum(-1).mean(-1)
        best = bounds.topk(min(self.k // p, bounds.shape[1]), dim=-1).indices
        attended = torch.zeros(kv_heads, n, dtype=torch.bool)
        for head in range(kv_heads):
            for page in best[head].tolist():
                attended[head, page * p : (page + 1) * p] = True
        return attended, (tuple(frozenset(pages.tolist()) for pages in best), False)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(), page_size=st.integers(1, 6), pages=st.integers(1, 4), extra=st.integers(0, 5),
       sparse_commit=st.booleans(), data=st.data())
def test_quest_matches_its_reference(decoding, page_size, pages, extra, sparse_commit, data):
    """k need not be a multiple of the page size (k // page_size pages are kept)."""
    knobs = dict(k=pages * page_size + extra % page_size, page_size=page_size,
                 exact_layers=data.draw(sparse_layers(decoding[0])), sparse_commit=sparse_commit)
    assert_matches_reference(get_method("quest", **knobs), ReferenceQuest(**knobs), *decoding)


def test_incremental_bounds_of_pages_longer_than_a_block_equal_recomputed_bounds():
    """Pages of 8 keys over blocks of 4: the longest row's last page is partial when the bounds are last
    brought up to date, and its bounds are those of the keys it holds then, as recomputed."""
    model = tiny_model("sdar")
    prompts = [random_prompt(9, seed=1), random_prompt(26, seed=2)]
    quest = get_method("quest", k=16, page_size=8, exact_layers=0)
    cache = run(model, prompts, quest).cache
    assert quest.bounds
    for layer, bounds in quest.bounds.items():
        assert max(bounds.summarised) % 8  # the longest row's last page was partial
        width = -(-max(bounds.summarised) // 8)
        low, high = page_bounds(cache.keys[layer][:, : width * 8], torch.tensor(bounds.summarised), 8)
        torch.testing.assert_close(bounds.low[:, :, :width], low, atol=0, rtol=0)
        torch.testing.assert_close(bounds.high[:, :, :width], high, atol=0, rtol=0)
