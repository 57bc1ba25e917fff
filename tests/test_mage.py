"""MAGE (methods/mage.py): the selection is eq. 3's top-k, each layer selects its own and attends to
it, a budget covering the prefix equals dense and a tiny one does not, the stages follow the capture
step, what selection states (chosen now, then read) and the kv_kept the meter counts from it, a row
decodes alone as in a batch and a reused object as a fresh one, the kernel path decodes what the
torch path decodes, side streams change nothing, and the engine with MAGE equals a plain-torch
reference of the paper (tests/block_references.py) on random decodes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.kernels.decode_attention import decode_attention_reference, decode_partials
from nanodllm.kernels.key_scores import key_scores, key_scores_reference
from nanodllm.kernels.sparse_decode_attention import sparse_decode_attention
from nanodllm.cache import KVCache
from nanodllm.config import GenerationConfig
from nanodllm.eval import agreement
from nanodllm.generation import generate
from nanodllm.methods import get_method, parse_knobs
from nanodllm.methods.base import StepContext
from nanodllm.methods.common import select_top_k, sparse_cache_attention
from nanodllm.methods.mage import block_probabilities
from tests.block_references import (GEN8, Recompute, as_sets, assert_matches_reference, decodes, keys_read, run,
                                    selections, sparse_layers, step_lengths)
from tests.device import DEVICE
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), block=st.integers(1, 6),
       prefixes=st.lists(st.integers(0, 40), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_block_probabilities_match_the_kernel_reference(batch, group, block, prefixes, seed):
    generator = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = 2, 8
    prefix_lengths = torch.tensor(prefixes[:batch])
    q = torch.randn(batch, kv_heads * group, block, head_dim, generator=generator, dtype=torch.float64)
    k_cache = torch.randn(batch, 50, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    got = block_probabilities(q, k_cache, prefix_lengths)
    _, lse = decode_attention_reference(q, k_cache, k_cache, prefix_lengths)  # over each row's prefix alone
    if int(prefix_lengths.max()) == 0:
        assert got.shape == (batch, kv_heads, 0)
        return
    expected = key_scores_reference(q, k_cache, prefix_lengths, lse.float())
    torch.testing.assert_close(got, expected.to(got.dtype), atol=1e-6, rtol=1e-4)
    for rows in (1, 2):  # query rows scored at a time (the last chunk short where they do not divide)
        per_chunk = rows * batch * kv_heads * int(prefix_lengths.max())
        chunked = block_probabilities(q, k_cache, prefix_lengths, scores_per_chunk=per_chunk)
        torch.testing.assert_close(chunked, got, atol=1e-6, rtol=1e-5)
    # eq. 3: a mean of per-query distributions over the prefix, so each row with a prefix sums to 1
    has_prefix = (prefix_lengths > 0).to(got.dtype)[:, None].expand(-1, kv_heads)
    torch.testing.assert_close(got.sum(-1), has_prefix, atol=1e-6, rtol=0)  # fp32 scores


def test_select_top_k_keeps_the_best_keys_in_order():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.9, 0.3]], [[0.8, 0.1, 0.7, 0.0, 0.0]]])
    indices, counts = select_top_k(scores, torch.tensor([5, 3]), k=2, on_kernels=False)
    assert indices.tolist() == [[[1, 3]], [[0, 2]]]
    assert counts.tolist() == [[2], [2]]
    indices, counts = select_top_k(scores, torch.tensor([5, 3]), k=4, on_kernels=False)
    assert counts.tolist() == [[4], [3]]
    assert indices[0, 0].tolist() == [1, 2, 3, 4]
    assert indices[1, 0, :3].tolist() == [0, 1, 2]  # row 1 keeps its whole 3-token prefix


@pytest.mark.parametrize("sparse_commit", [False, True])
def test_full_budget_equals_dense(sparse_commit):
    model = tiny_model("sdar")
    prompts = [random_prompt(26, seed=1), random_prompt(26, seed=2)]
    dense = run(model, prompts, get_method("dense"))
    result = run(model, prompts, get_method("mage", k=64, exact_layers=0, sparse_commit=sparse_commit))
    assert result.tokens == dense.tokens
    assert result.stats["kv_kept"] == 1.0
    for layer in range(model.cfg.num_layers):  # the cache the commits built is the dense one (float64)
        torch.testing.assert_close(result.cache.keys[layer], dense.cache.keys[layer], atol=1e-12, rtol=0)


def test_tiny_budget_differs():
    model = tiny_model("sdar")
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    dense = run(model, prompts, get_method("dense"))
    result = run(model, prompts, get_method("mage", k=1, exact_layers=0))
    assert result.tokens != dense.tokens
    assert 0 < result.stats["kv_kept"] < 0.4  # step 0 of each block (1 of 4 steps) reads everything


def test_exact_layers_stay_exact():
    """On a 3-layer model with exact_layers = 2 only layer 2 ever attends to a selection; with every
    layer exact the tokens are dense's whatever k."""
    model = tiny_model("sdar", num_hidden_layers=3)
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    mage = get_method("mage", k=1, exact_layers=2)
    attend_selected, sparse_layers_seen = mage.attend_selected, set()

    def spy(layer, *args):
        sparse_layers_seen.add(layer)
        return attend_selected(layer, *args)

    mage.attend_selected = spy
    run(model, prompts, mage)
    assert sparse_layers_seen == {2}
    dense = run(model, prompts, get_method("dense"))
    assert run(model, prompts, get_method("mage", k=1, exact_layers=3)).tokens == dense.tokens


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="k must be"):
        get_method("mage", k=0)
    with pytest.raises(ValueError, match="exact_layers"):
        get_method("mage", exact_layers=-1)


def test_the_knobs_default_to_the_papers_and_refuse_a_bool_for_a_count():
    """k = 1024 keys, exact_layers = 2, sparse_commit off (the paper's); True is no count of keys or layers."""
    mage = get_method("mage")
    assert (mage.k, mage.exact_layers, mage.sparse_commit) == (1024, 2, False)
    for knob in ("k", "exact_layers"):
        with pytest.raises(ValueError, match=f"{knob} must be an integer"):
            get_method("mage", **{knob: True})


def test_knobs_parse_from_the_command_line():
    assert parse_knobs("k=64,exact_layers=2,sparse_commit=true") == {"k": 64, "exact_layers": 2, "sparse_commit": True}
    assert parse_knobs(None) == {}
    with pytest.raises(ValueError, match="name=value"):
        parse_knobs("k64")


def context(cache, step, phase="step", steps=4):
    tokens = torch.zeros(1, 4, dtype=torch.long)
    return StepContext(tokens, torch.arange(4)[None] + cache.max_length, torch.ones_like(tokens, dtype=torch.bool),
                       torch.tensor([3]), step=step, steps_per_block=steps, cache=cache, block_length=4, phase=phase)


def test_stage_is_exact_without_a_prefix_then_select_at_the_capture_step_and_sparse_after():
    """Mage.stage from ctx alone: an empty cache is exact throughout; else step 0 selects, later steps
    read the selection, and a commit (its step: the steps its block took) reads it only with
    sparse_commit."""
    cache = KVCache(2, 1, 64, 2, 8, "cpu", torch.float32)
    mage, committing = get_method("mage", k=4), get_method("mage", k=4, sparse_commit=True)
    for method in (mage, committing):
        assert {method.stage(context(cache, step)) for step in range(4)} == {"exact"}
        assert method.stage(context(cache, 4, "commit")) == "exact"
    cache.advance(torch.tensor([9]))
    assert [mage.stage(context(cache, step)) for step in range(4)] == ["select", "sparse", "sparse", "sparse"]
    assert [mage.step_kind(context(cache, step)) for step in range(3)] == [("select",), ("sparse",), ("sparse",)]
    assert [mage.stage(context(cache, steps, "commit")) for steps in (1, 4)] == ["exact", "exact"]
    assert [committing.stage(context(cache, steps, "commit")) for steps in (1, 4)] == ["sparse", "sparse"]


def test_the_selection_is_as_wide_as_the_launch_bound_allows():
    """On the torch path as on the kernels a selection holds min(k, the cache's launch bound) entries, the
    first min(k, prefix) of them counted: its width moves only with the bound, on which a step's graph is
    keyed (the loops replay sparse steps that read the selection's tensors)."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(2, 1, 64, 2, 8, "cpu", torch.float32)
    cache.keys[1].normal_(generator=generator)
    cache.advance(torch.tensor([9]))
    mage = get_method("mage", k=32, exact_layers=0)
    q, k, v = (torch.randn(1, heads, 4, 8, generator=generator) for heads in (4, 2, 2))
    mage.begin_block(context(cache, 0))
    mage.attend(1, q, k, v, context(cache, 0))
    indices, counts = mage.chosen[1]
    assert indices.shape[-1] == min(32, cache.launch_length(4)) > 9 and counts.tolist() == [[9, 9]]


def as_lists(chosen):
    """A Selection's keys per row and KV head, as sets."""
    return [[set(indices[:count].tolist()) for indices, count in zip(*row)]
            for row in zip(chosen.indices, chosen.counts)]


def test_selection_is_chosen_now_at_the_capture_step_and_read_after_it():
    """Mage.selection after each step's layer: None at the exact layers and wherever the cache is empty;
    at step 0 the layer's new top-k (min(k, n) keys per row and KV head, chosen_now: this step read
    every key), at the block's later steps that same selection, read (at most k keys a row)."""
    model = tiny_model("sdar", num_hidden_layers=3)
    k = 3
    _, seen = selections(get_method("mage", k=k, exact_layers=1), model, [random_prompt(n, seed=n) for n in (9, 14, 6)])
    assert {key[2] for key, (_, chosen) in seen.items() if chosen is None} == {0}
    renewed = 0
    for (block, step, layer), (lengths, chosen) in seen.items():
        if layer == 0:
            continue
        assert (chosen.index_block, chosen.most, chosen.chosen_now) == (1, k, step == 0)
        assert chosen.counts.tolist() == [[min(k, n)] * chosen.counts.shape[1] for n in lengths]
        captured = seen[block, 0, layer][1]
        assert torch.equal(chosen.indices, captured.indices) and torch.equal(chosen.counts, captured.counts)
        if step == 0 and block > 0:
            before = seen[block - 1, max(s for b, s, _ in seen if b == block - 1), layer][1]
            renewed += as_lists(chosen) != as_lists(before)
    assert renewed > 0  # step 0 states the block's new choice, not the previous block's
    _, alone = selections(get_method("mage", k=k, exact_layers=0), model, [random_prompt(3, seed=1)])
    empty = [chosen for (lengths, chosen) in alone.values() if max(lengths) == 0]
    assert empty and all(chosen is None for chosen in empty)


def test_kv_kept_counts_every_key_at_exact_layers_and_the_capture_step_and_at_most_k_after():
    """The meter's kv_kept equals a hand count over the steps: the exact layers and step 0 read each
    row's n prefix keys, the other layers min(k, n); rows of prefixes below, at and above k."""
    model = tiny_model("sdar", num_hidden_layers=3)
    k, exact_layers = 8, 1
    result, steps = step_lengths(get_method("mage", k=k, exact_layers=exact_layers), model,
                                 [random_prompt(6, seed=1), random_prompt(21, seed=2)])
    expected = keys_read(steps, 3, lambda step, layer: layer < exact_layers or step == 0, k)
    assert {n < k for _, lengths in steps for n in lengths} == {True, False}
    assert 0 < expected < 1 and result.stats["kv_kept"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("prefixes,k", [([21, 34], 6), ([3, 40], 8), ([0, 17], 32)])
def test_kernel_selection_and_sparse_attention_match_torch(prefixes, k):
    """The CUDA path's pieces (decode LSE -> key_scores -> top-k -> sparse_decode_attention), run in
    the interpreter in float16, against the torch pieces."""
    generator = torch.Generator().manual_seed(sum(prefixes) + k)
    batch, kv_heads, group, block, head_dim = 2, 2, 2, 4, 64
    prefix_lengths = torch.tensor(prefixes, device=DEVICE)
    q = torch.randn(batch, kv_heads * group, block, head_dim, generator=generator).half().to(DEVICE)
    k_cache, v_cache = (torch.randn(batch, 50, kv_heads, head_dim, generator=generator).half().to(DEVICE)
                        for _ in range(2))
    slots = prefix_lengths[:, None] + torch.arange(block, device=DEVICE)  # the block's keys, stored after each prefix
    rows = torch.arange(batch, device=DEVICE)[:, None]
    k_block, v_block = k_cache[rows, slots].transpose(1, 2), v_cache[rows, slots].transpose(1, 2)
    prefix = int(prefix_lengths.max())

    partials = decode_partials(q, k_cache, v_cache, prefix_lengths + block, max_length=prefix + block,
                               block_apart=True)
    kernel_scores = key_scores(q, k_cache, prefix_lengths, part_lse=partials[1], max_length=prefix)
    torch_scores = block_probabilities(q, k_cache, prefix_lengths)
    torch.testing.assert_close(kernel_scores, torch_scores, atol=1e-6, rtol=1e-3)
    indices, counts = select_top_k(torch_scores.cpu(), prefix_lengths.cpu(), k, on_kernels=False)
    indices, counts = indices.to(DEVICE), counts.to(DEVICE)
    assert counts.tolist() == [[min(k, n)] * kv_heads for n in prefixes]

    expected = sparse_cache_attention(q, k_block, v_block, k_cache, v_cache, prefix_lengths, indices, counts)
    got = sparse_decode_attention(q, k_cache, v_cache, prefix_lengths, indices, counts, return_lse=False)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_engine_routes_mage_through_the_kernels(monkeypatch):
    """On the kernel path the block engine runs MAGE end to end (float16 in the interpreter); tokens
    may differ from the torch path only where float16 rounding flips a near tie."""
    import nanodllm.attention as attention_module
    import nanodllm.methods.common as common_module

    model = tiny_model("sdar", dtype=torch.float16, head_dim=64).to(DEVICE)
    prompts = [random_prompt(21, seed=6), random_prompt(34, seed=7)]
    monkeypatch.setattr(attention_module, "KERNELS_ENABLED", False)  # the torch path, on a GPU too
    torch_tokens = run(model, prompts, get_method("mage", k=6, exact_layers=1)).tokens
    monkeypatch.setattr(attention_module, "KERNELS_ENABLED", True)
    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))  # float16: the interpreter's own
    sparse_calls = []
    original = common_module.sparse_decode_attention
    monkeypatch.setattr(common_module, "sparse_decode_attention",
                        lambda *args, **kwargs: sparse_calls.append(1) or original(*args, **kwargs))
    kernel_tokens = run(model, prompts, get_method("mage", k=6, exact_layers=1)).tokens
    assert sparse_calls
    assert agreement(kernel_tokens, torch_tokens) >= 0.8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream is CUDA's; run on a GPU machine")
def test_side_stream_selection_is_identical(monkeypatch):
    """Every block's selection (read when the next block begins, after its steps' graphs ran) and the
    tokens are the same with side streams on and off (nanodllm.graphs.STREAMS_ENABLED), over three
    generated blocks; with them on, the selecting steps did hand their top-k to the side stream."""
    import nanodllm.graphs as graphs_module
    from nanodllm import tasks
    from nanodllm.eval import Runner, resolve_model

    runner = Runner(resolve_model("tiny-sdar"), "cuda", torch.bfloat16, None)
    samples = tasks.make_samples("passkey", 2048, 8, seed=5, count_tokens=runner.count_tokens)
    prompts = [runner.tokenizer.chat([{"role": "user", "content": s.prompt}]) for s in samples]
    gen = GenerationConfig(gen_length=96, block_length=32, steps=96)
    copy_of = lambda chosen: {layer: [t.cpu() for t in pair] for layer, pair in chosen.items()}
    forks, fork = [], graphs_module.SideStream.__call__
    monkeypatch.setattr(graphs_module.SideStream, "__call__", lambda *args: forks.append(1) or fork(*args))
    outputs = {}
    for streams in (True, False):
        monkeypatch.setattr(graphs_module, "STREAMS_ENABLED", streams)
        forks.clear()
        method = get_method("mage", k=64)
        chosen = []

        def begin_block(ctx, method=method, chosen=chosen, begin=method.begin_block):
            chosen.append(copy_of(method.chosen))  # the block before's, after its steps ran
            begin(ctx)

        method.begin_block = begin_block
        result = generate(runner.model, prompts, gen, method, stop_ids=())
        chosen.append(copy_of(method.chosen))  # the last block's
        outputs[streams] = (result.tokens, chosen, len(forks))
    assert outputs[True][2] > 0 and outputs[False][2] == 0
    assert outputs[True][0] == outputs[False][0]
    assert sum(bool(chosen) for chosen in outputs[False][1]) >= 3  # a selection from each generated block
    for with_side, without in zip(*(outputs[streams][1] for streams in (True, False)), strict=True):
        assert with_side.keys() == without.keys()
        for layer, (indices, counts) in without.items():
            assert torch.equal(with_side[layer][0], indices) and torch.equal(with_side[layer][1], counts)


def eq3_top_k(q, k_cache, prefix_lengths, k: int) -> list[list[set[int]]]:
    """MAGE's selection as the paper states it, every score formed in float64: per row and KV head,
    the k prefix keys of highest attention probability averaged over the block's queries and the
    group's heads (softmax over the row's prefix alone)."""
    batch, num_heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    chosen = []
    for row in range(batch):
        n = int(prefix_lengths[row])
        keys = k_cache[row, :n].double()  # [n, kv_heads, d]
        heads = []
        for h in range(kv_heads):
            queries = q[row, h * group : (h + 1) * group].double()  # [group, L, d]
            probs = (queries @ keys[:, h].T * head_dim**-0.5).softmax(-1)  # [group, L, n]
            heads.append(set(probs.mean((0, 1)).topk(min(k, n)).indices.tolist()))
        chosen.append(heads)
    return chosen


@pytest.mark.parametrize("k, exact_layers", [(1, 0), (3, 1), (5, 0)])
def test_each_layer_selects_its_own_top_k_and_attends_to_it(k, exact_layers):
    """At every layer and block: the step-1 selection equals eq. 3's top-k computed from that layer's
    queries and cached keys, and each later step's output equals plain attention over exactly that
    layer's selection plus the block's own keys, on a ragged batch across several blocks."""
    model = tiny_model("sdar", num_hidden_layers=3)
    prompts = [random_prompt(n, seed=n) for n in (9, 14, 6)]
    mage = get_method("mage", k=k, exact_layers=exact_layers)
    expected, checked = {}, {"select": 0, "sparse": 0}
    attend_and_select, attend_selected = mage.attend_and_select, mage.attend_selected

    def select(layer, q, k_, v, ctx):
        out = attend_and_select(layer, q, k_, v, ctx)
        lengths = ctx.cache.lengths
        expected[layer] = eq3_top_k(q, ctx.cache.keys[layer], lengths, k)
        indices, counts = mage.chosen[layer]
        for row in range(q.shape[0]):
            for h in range(indices.shape[1]):
                assert set(indices[row, h, : int(counts[row, h])].tolist()) == expected[layer][row][h]
        checked["select"] += 1
        return out

    def selected(layer, q, k_, v, ctx):
        out = attend_selected(layer, q, k_, v, ctx)
        cache, block_len = ctx.cache, q.shape[2]
        group = q.shape[1] // cache.keys[layer].shape[2]
        for row in range(q.shape[0]):
            n = int(cache.lengths[row])
            for head in range(q.shape[1]):
                h = head // group
                slots = sorted(expected[layer][row][h]) + list(range(n, n + block_len))
                keys, values = cache.keys[layer][row, slots, h].double(), cache.values[layer][row, slots, h].double()
                probs = (q[row, head].double() @ keys.T * q.shape[-1] ** -0.5).softmax(-1)
                torch.testing.assert_close(out[row, head].double(), probs @ values, atol=1e-10, rtol=0)
        checked["sparse"] += 1
        return out

    mage.attend_and_select, mage.attend_selected = select, selected
    run(model, prompts, mage)
    sparse_layer_count = model.cfg.num_layers - exact_layers
    assert checked["select"] >= 3 * sparse_layer_count and checked["sparse"] >= 3 * 3 * sparse_layer_count


def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch():
    """DESIGN.md: a row's result must not depend on the batch. At k = 8 every row loses keys (the 6-token
    prompt once its first block is committed), so the tokens are not dense's."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(6, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    batch = run(model, prompts, get_method("mage", k=8, exact_layers=0), GEN8)
    assert batch.stats["kv_kept"] < 1
    assert batch.tokens != run(model, prompts, get_method("dense"), GEN8).tokens
    for row, prompt in enumerate(prompts):
        assert run(model, [prompt], get_method("mage", k=8, exact_layers=0), GEN8).tokens[0] == batch.tokens[row]


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """Nothing of one generation (the block selections) leaks into the next: after decoding two
    prompts, the method decodes two others of the same lengths as a new one does."""
    model = tiny_model("sdar")
    reused = get_method("mage", k=4, exact_layers=0)
    run(model, [random_prompt(30, seed=10), random_prompt(17, seed=11)], reused)
    prompts = [random_prompt(30, seed=12), random_prompt(17, seed=13)]
    fresh = run(model, prompts, get_method("mage", k=4, exact_layers=0))
    assert run(model, prompts, reused).tokens == fresh.tokens


class ReferenceMage(Recompute):
    """MAGE as its paper states it (methods/mage.py). At the block's capture step (the first, whose
    queries are all [MASK] but for a prompt tail) each layer from exact_layers on attends exactly and
    keeps, per KV head, the k prefix keys of highest eq. 3 score: each of the block's queries'
    softmax over the prefix alone, averaged over the queries and the group's heads. The block's later
    steps, and its commit with sparse_commit, see those keys and the block's own; the exact layers,
    and the commit without sparse_commit, see every key."""

    def capture_step(self, ctx):
        return 0

    def begin_block(self, ctx):
        super().begin_block(ctx)
        self.kept = {}  # (row, layer) -> this block's selection, bool [kv_heads, n]

    def prefix_keys(self, row, layer, q, k, ctx):
        capture = self.capture_step(ctx)
        if layer < self.exact_layers:
            return None, None
        if ctx.phase == "commit":
            return (self.kept.get((row, layer)) if self.sparse_commit else None), None
        if ctx.step < capture:
            return None, None
        if ctx.step == capture:
            kv_heads, n = k.shape[:2]
            group = q.shape[0] // kv_heads
            scores = q @ k.repeat_interleave(group, 0).transpose(-1, -2) * q.shape[-1] ** -0.5  # [heads, L, n]
            eq3 = scores.softmax(-1).unflatten(0, (kv_heads, group)).mean((1, 2))  # [kv_heads, n]
            best = eq3.topk(min(self.k, n), dim=-1).indices
            self.kept[row, layer] = torch.zeros(kv_heads, n, dtype=torch.bool).scatter_(1, best, True)
            return None, (as_sets(self.kept[row, layer]), True)  # the capture step itself attends exactly
        return self.kept[row, layer], (as_sets(self.kept[row, layer]), False)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(), k=st.integers(1, 16), sparse_commit=st.booleans(), data=st.data())
def test_mage_matches_its_reference(decoding, k, sparse_commit, data):
    knobs = dict(k=k, exact_layers=data.draw(sparse_layers(decoding[0])), sparse_commit=sparse_commit)
    assert_matches_reference(get_method("mage", **knobs), ReferenceMage(**knobs), *decoding)


def test_a_commit_before_its_block_selected_is_exact():
    """A commit whose block took no denoising step (ctx.step 0) has no selection of its own to read:
    it attends exactly, with sparse_commit too; from one step on it reads the block's selection."""
    cache = KVCache(2, 1, 64, 2, 8, "cpu", torch.float32)
    cache.advance(torch.tensor([9]))
    committing = get_method("mage", k=4, sparse_commit=True)
    assert [committing.stage(context(cache, steps, "commit")) for steps in (0, 1)] == ["exact", "sparse"]
