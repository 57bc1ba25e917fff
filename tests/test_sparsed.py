"""SparseD (methods/sparsed.py), MAGE's mechanism captured after a fifth of each block's steps: the
capture step, a budget covering the prefix equals dense and a tiny one does not, a later capture is
not MAGE, what selection states before, at and after the capture and the kv_kept the meter counts
from it, a commit attends exactly when its block ended before the capture step, a row decodes alone
as in a batch and a reused object as a fresh one, and the engine with SparseD equals a plain-torch
reference (tests/block_references.py) on random decodes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm.cache import KVCache
from nanodllm.config import GenerationConfig
from nanodllm.methods import get_method
from nanodllm.methods.base import StepContext
from tests.block_references import (GEN, GEN8, assert_matches_reference, decodes, keys_read, model_of, run, selections,
                                    sparse_layers, step_lengths)
from tests.test_mage import ReferenceMage
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def steps_of(steps_per_block: int):
    """A stand-in context: capture_step reads only the block's nominal steps."""
    return type("Ctx", (), {"steps_per_block": steps_per_block})()


@pytest.mark.parametrize("knobs", [dict(k=64), dict(k=64, exact_fraction=0.5)])
def test_full_budget_equals_dense(knobs):
    model = tiny_model("sdar")
    prompts = [random_prompt(9, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    dense = run(model, prompts, get_method("dense"))
    for sparse_commit in (False, True):
        method = get_method("sparsed", exact_layers=0, sparse_commit=sparse_commit, **knobs)
        assert run(model, prompts, method).tokens == dense.tokens


def test_tiny_budget_differs():
    """At half of 4 steps: steps 0-1 exact (all keys read), captured at step 1, so not MAGE."""
    model = tiny_model("sdar")
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    dense = run(model, prompts, get_method("dense"))
    result = run(model, prompts, get_method("sparsed", k=1, exact_fraction=0.5, exact_layers=0))
    assert result.tokens != dense.tokens
    assert 0 < result.stats["kv_kept"] < 0.6


def test_sparsed_captures_after_a_fifth_of_the_steps():
    sparsed = get_method("sparsed")
    # 32 steps: 6 exact (0..5), capture at 5
    assert [sparsed.capture_step(steps_of(t)) for t in (1, 4, 32)] == [0, 0, 5]
    assert get_method("sparsed", exact_fraction=1.0).capture_step(steps_of(8)) == 7


@pytest.mark.parametrize("exact_fraction,capture", [(0.2, 1), (0.5, 3)])
def test_sparsed_capturing_after_step_0_is_not_mage(exact_fraction, capture):
    """A later capture: exact steps before it (more keys read than MAGE), a selection from partly
    unmasked queries (other tokens than MAGE's at the same tiny k), and dense's tokens at a full k."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    sparsed = get_method("sparsed", k=1, exact_fraction=exact_fraction, exact_layers=0)
    assert sparsed.capture_step(steps_of(GEN8.steps)) == capture
    mage = run(model, prompts, get_method("mage", k=1, exact_layers=0), GEN8)
    result = run(model, prompts, sparsed, GEN8)
    assert result.tokens != mage.tokens
    assert mage.stats["kv_kept"] < result.stats["kv_kept"] < 1
    dense = run(model, prompts, get_method("dense"), GEN8)
    full = get_method("sparsed", k=64, exact_fraction=exact_fraction, exact_layers=0)
    assert run(model, prompts, full, GEN8).tokens == dense.tokens


def test_selection_is_none_before_the_capture_step_then_chosen_now_then_read():
    """SparseD.selection after each step's layer (capture at step 3 of 8): None at the exact layers and
    at steps 0-2, which attend exactly; at step 3 the new top-k, chosen_now; after it that selection."""
    model = tiny_model("sdar", num_hidden_layers=3, block_size=8)
    k = 3
    sparsed = get_method("sparsed", k=k, exact_fraction=0.5, exact_layers=1)
    _, seen = selections(sparsed, model, [random_prompt(n, seed=n) for n in (9, 14, 6)], GEN8)
    assert {step for (_, step, _) in seen} == set(range(8))
    for (block, step, layer), (lengths, chosen) in seen.items():
        if layer == 0 or step < 3:
            assert chosen is None, (block, step, layer)
            continue
        assert (chosen.index_block, chosen.most, chosen.chosen_now) == (1, k, step == 3)
        assert chosen.counts.tolist() == [[min(k, n)] * chosen.counts.shape[1] for n in lengths]
        captured = seen[block, 3, layer][1]
        assert torch.equal(chosen.indices, captured.indices) and torch.equal(chosen.counts, captured.counts)


def test_kv_kept_counts_every_key_up_to_the_capture_step_and_at_most_k_after():
    """The meter's kv_kept equals a hand count over the steps: the exact layers and steps 0..3 (capture
    at 3) read each row's n prefix keys, the other layers' later steps min(k, n)."""
    model = tiny_model("sdar", num_hidden_layers=3, block_size=8)
    k, exact_layers = 8, 1
    result, steps = step_lengths(get_method("sparsed", k=k, exact_fraction=0.5, exact_layers=exact_layers), model,
                                 [random_prompt(6, seed=1), random_prompt(21, seed=2)], GEN8)
    expected = keys_read(steps, 3, lambda step, layer: layer < exact_layers or step <= 3, k)
    assert {n < k for _, lengths in steps for n in lengths} == {True, False}
    assert 0 < expected < 1 and result.stats["kv_kept"] == pytest.approx(expected, rel=1e-12)


def test_a_commit_attends_exactly_when_its_block_ended_before_the_capture_step():
    """With sparse_commit a commit reads the block's selection only if the block reached its capture
    step (the commit's ctx.step, the steps the block took, > capture_step). Threshold decoding ends
    some blocks at step 0 or 1 (capture at 1), after earlier blocks that selected: their commits
    attend exactly (not the stale selection), and the decode equals the plain reference's."""
    knobs = dict(k=2, exact_fraction=0.25, exact_layers=0, sparse_commit=True)
    sparsed = get_method("sparsed", **knobs)
    cache = KVCache(1, 1, 64, 2, 8, "cpu", torch.float32)
    cache.advance(torch.tensor([16]))
    commit = lambda steps: StepContext(torch.zeros(1, 8, dtype=torch.long), torch.arange(16, 24)[None],
                                       torch.ones(1, 8, dtype=torch.bool), torch.tensor([16]), step=steps,
                                       steps_per_block=8, cache=cache, block_length=8, phase="commit")
    assert sparsed.capture_step(commit(1)) == 1
    assert [sparsed.stage(commit(steps)) for steps in (1, 2, 8)] == ["exact", "sparse", "sparse"]

    model = model_of(2, 2, 8)
    gen = GenerationConfig(gen_length=40, block_length=8, steps=8, threshold=0.2, remasking="low_confidence_dynamic")
    commits, attend_selected, commit_hook = [], sparsed.attend_selected, sparsed.commit

    def counting_attend_selected(layer, q, k, v, ctx):
        if ctx.phase == "commit":
            commits[-1][2] += 1
        return attend_selected(layer, q, k, v, ctx)

    def recording_commit(model, ctx):
        commits.append([ctx.step, ctx.cache.max_length, 0])  # steps taken, prefix, layers read a selection
        return commit_hook(model, ctx)

    sparsed.attend_selected, sparsed.commit = counting_attend_selected, recording_commit
    assert_matches_reference(sparsed, ReferenceSparseD(**knobs), model, [random_prompt(20, seed=3),
                                                                         random_prompt(29, seed=5)], gen)
    early = [i for i, (steps, prefix, _) in enumerate(commits) if steps <= 1 and prefix > 0]
    late = [i for i, (steps, prefix, _) in enumerate(commits) if steps > 1 and prefix > 0]
    assert early and late and min(late) < max(early)  # an early block after one that selected
    assert all(commits[i][2] == 0 for i in early)
    assert all(commits[i][2] == model.cfg.num_layers for i in late)


def test_a_row_decodes_the_same_alone_and_in_a_ragged_batch():
    """DESIGN.md: a row's result must not depend on the batch. At k = 8 every row loses keys (the 6-token
    prompt once its first block is committed), so the tokens are not dense's."""
    model = tiny_model("sdar", block_size=8)
    prompts = [random_prompt(6, seed=3), random_prompt(30, seed=4), random_prompt(17, seed=5)]
    batch = run(model, prompts, get_method("sparsed", k=8, exact_layers=0), GEN8)
    assert batch.stats["kv_kept"] < 1
    assert batch.tokens != run(model, prompts, get_method("dense"), GEN8).tokens
    for row, prompt in enumerate(prompts):
        assert run(model, [prompt], get_method("sparsed", k=8, exact_layers=0), GEN8).tokens[0] == batch.tokens[row]


def test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does():
    """Nothing of one generation (the block selections) leaks into the next: after decoding two
    prompts, the method decodes two others of the same lengths as a new one does."""
    model = tiny_model("sdar")
    reused = get_method("sparsed", k=4, exact_layers=0)
    run(model, [random_prompt(30, seed=10), random_prompt(17, seed=11)], reused, GEN)
    prompts = [random_prompt(30, seed=12), random_prompt(17, seed=13)]
    fresh = run(model, prompts, get_method("sparsed", k=4, exact_layers=0), GEN)
    assert run(model, prompts, reused, GEN).tokens == fresh.tokens


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="exact_fraction"):
        get_method("sparsed", exact_fraction=1.5)
    with pytest.raises(ValueError, match="k must be"):
        get_method("sparsed", k=0)


class ReferenceSparseD(ReferenceMage):
    """SparseD as MAGE's paper adapts it (methods/sparsed.py): MAGE's per-block eq. 3 selection, captured
    at the last of the block's max(1, round(exact_fraction * T)) exact steps (T: steps per block)
    instead of at its first; a block decoded before that step stays exact, its commit too."""

    def __init__(self, k, exact_fraction, exact_layers, sparse_commit):
        super().__init__(k, exact_layers, sparse_commit)
        self.exact_fraction = exact_fraction

    def capture_step(self, ctx):
        return max(1, round(self.exact_fraction * ctx.steps_per_block)) - 1


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(block_lengths=(8, 4), min_steps=3), k=st.integers(1, 16),
       exact_fraction=st.sampled_from([0.5, 0.2, 0.0, 0.3, 0.75, 1.0]), sparse_commit=st.booleans(), data=st.data())
def test_sparsed_matches_its_reference(decoding, k, exact_fraction, sparse_commit, data):
    """Blocks of 3-8 steps, so that the capture step (the last exact one) mostly comes after step 0."""
    knobs = dict(k=k, exact_fraction=exact_fraction, exact_layers=data.draw(sparse_layers(decoding[0])),
                 sparse_commit=sparse_commit)
    assert_matches_reference(get_method("sparsed", **knobs), ReferenceSparseD(**knobs), *decoding)
