"""nanodllm/recall.py: the estimation accuracy and union diagnostics of selecting methods, recorded at
the denoising steps' layers that read or chose a selection (Method.selection), never at a commit."""

import pytest
import torch

from nanodllm import block, recall
from nanodllm.config import GenerationConfig
from nanodllm.eval import main as eval_main
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense, Selection
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GEN = GenerationConfig(gen_length=12, block_length=4, steps=4, remasking="low_confidence_static")


def test_token_mask_expands_blocks_and_clips_to_the_prefix():
    indices = torch.tensor([[[1, 3, 0]], [[0, 2, 2]]])
    counts = torch.tensor([[2], [1]])
    mask = recall.token_mask(indices, counts, torch.tensor([7, 5]), 7, 2)
    assert mask[0, 0].nonzero().flatten().tolist() == [2, 3, 6]  # block 3 = tokens 6, 7: 7 is past the prefix
    assert mask[1, 0].nonzero().flatten().tolist() == [0, 1]


def test_union_ratio_is_one_when_every_query_is_the_same():
    q = torch.randn(1, 1, 1, 8).expand(1, 2, 3, 8)  # one KV head, group 2, every query the same
    k_cache = torch.randn(1, 20, 1, 8)
    assert recall.union_ratio(q, k_cache, torch.tensor([12]), 4) == 1.0
    spread = recall.union_ratio(torch.randn(1, 2, 3, 8), k_cache, torch.tensor([12]), 4)
    assert 1.0 <= spread <= 3.0  # at most the whole 12-token prefix


def test_a_row_shorter_than_k_adds_only_its_own_keys_to_the_union():
    """Every query the same: a row of 12 keys unites k = 4 of them (1.0), a row of 2 its 2 (0.5 of k)."""
    q = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(0)).expand(2, 2, 3, 8)
    k_cache = torch.randn(2, 20, 1, 8, generator=torch.Generator().manual_seed(1))
    assert recall.union_ratio(q, k_cache, torch.tensor([12, 2]), 4) == 0.75


def test_the_summary_averages_each_bucket_of_consecutive_steps():
    """Steps 1-4 and 5-8 of a layer in two rows of the table, each the mean of its own steps' accuracy."""
    accuracies = [1.0, 0.75, 1.0, 0.75, 0.5, 0.25, 0.5, 0.25]
    records = [recall.Record(0, step, 1, a, (a,), None) for step, a in enumerate(accuracies)]
    lines = recall.summarise(records).splitlines()
    assert lines[:4] == ["| steps | layer 1 |", "|---|---|", "| 1-4 | 0.875 |", "| 5-8 | 0.375 |"]


def run(method, prompts):
    records = recall.attach(method)
    block.generate(tiny_model("sdar"), prompts, GEN, method=method, stop_ids=())
    return records


def test_full_budget_recalls_everything_and_a_tiny_budget_does_not():
    prompts = [random_prompt(30, seed=1), random_prompt(19, seed=2)]
    for name in ("mage", "quest", "sparsed"):
        full = run(get_method(name, k=64, exact_layers=0), prompts)
        assert full and all(r.accuracy == 1.0 for r in full)
    tiny = run(get_method("mage", k=2, exact_layers=0), prompts)
    assert all(r.accuracy == 1.0 for r in tiny if r.step == 0)  # the oracle of step 1 is MAGE's own choice
    assert any(r.accuracy < 1.0 for r in tiny if r.step > 0)
    assert all(r.union_ratio >= 1.0 for r in tiny if r.step == 0)


def test_eval_recall_prints_a_table(capsys):
    assert eval_main(["--model", "tiny-sdar", "--method", "mage", "--recall", "--knobs", "k=32",
                      "--lengths", "512", "--n", "2", "--gen-length", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "## mage" in out and "| steps | layer 2 | layer 3 |" in out


def test_exact_steps_before_the_capture_are_not_recorded():
    """SparseD attends exactly before its capture step; in later blocks it still holds the previous
    block's selection, which those steps do not use and the records must not score."""
    method = get_method("sparsed", k=4, exact_layers=0, exact_fraction=0.5)  # capture at step 1 of 0..3
    records = run(method, [random_prompt(30, seed=1)])
    assert len({r.block for r in records}) >= 3
    assert all(r.step >= 1 for r in records)


def test_per_head_accuracy_averages_to_the_overall_accuracy():
    prompts = [random_prompt(30, seed=1), random_prompt(25, seed=2), random_prompt(27, seed=3)]  # 3 rows, 2 heads
    records = run(get_method("mage", k=3, exact_layers=0), prompts)
    heads = tiny_model("sdar").cfg.num_kv_heads
    assert all(len(r.head_accuracy) == heads for r in records)
    for r in records:  # every row has a prefix here, so the overall mean is the mean of the heads'
        assert abs(sum(r.head_accuracy) / heads - r.accuracy) < 1e-6
    assert any(max(r.head_accuracy) > min(r.head_accuracy) for r in records)
    assert "| layer | head 0 | head 1 |" in recall.summarise(records)


def test_only_the_calls_that_read_a_selection_are_recorded():
    """Method.selection: dense reads every key (no records); the selecting methods' exact layers read
    every key too, their other layers a selection."""
    prompts = [random_prompt(30, seed=1)]
    assert run(get_method("dense"), prompts) == []
    layers = tiny_model("sdar").cfg.num_layers
    for name in ("mage", "quest", "sparsed"):
        records = run(get_method(name, k=16, exact_layers=1), prompts)
        assert {r.layer for r in records} == set(range(1, layers)), name


def test_a_commit_is_never_recorded():
    """With sparse_commit a commit reads a selection too (MAGE's block selection, Quest's pages from its
    own queries), but only the denoising steps are scored: one record per step and sparse layer."""
    prompts = [random_prompt(30, seed=1)]
    layers = tiny_model("sdar").cfg.num_layers
    for name, knobs in (("mage", {}), ("quest", {"page_size": 2})):
        method = get_method(name, k=4, exact_layers=0, sparse_commit=True, **knobs)
        steps, head = [], method.logits
        method.logits = lambda model, hidden, ctx: steps.append((ctx.block, ctx.step)) or head(model, hidden, ctx)
        records = run(method, prompts)
        assert sorted((r.block, r.step, r.layer) for r in records) == sorted(
            (block, step, layer) for block, step in steps for layer in range(layers)), name


class EveryKeyAsASelection(Dense):
    """Dense attention, stated as a selection of every prefix key, against an oracle of k = 2 keys."""

    k = 2

    def selection(self, layer, ctx):
        lengths, kv_heads = ctx.cache.lengths, ctx.cache.keys[layer].shape[2]
        indices = torch.arange(ctx.cache.max_length).expand(len(lengths), kv_heads, -1)
        return Selection(indices, lengths[:, None].expand(-1, kv_heads), 1, ctx.cache.max_length)


def test_a_selection_holding_every_oracle_key_recalls_everything():
    """Accuracy is the share of the oracle's keys selected: 1 for a superset of them, however large."""
    records = run(EveryKeyAsASelection(), [random_prompt(30, seed=1), random_prompt(19, seed=2)])
    assert records and all(r.accuracy == 1.0 for r in records)


def test_the_union_is_relative_to_k_when_every_row_is_shorter_than_k():
    """Every query the same: rows of 2 and 3 keys unite all their keys, 2/4 and 3/4 of k = 4 (mean 0.625),
    however short the longest row."""
    q = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(0)).expand(2, 2, 3, 8)
    k_cache = torch.randn(2, 20, 1, 8, generator=torch.Generator().manual_seed(1))
    assert recall.union_ratio(q, k_cache, torch.tensor([2, 3]), 4) == 0.625


def test_a_row_without_prefix_keys_is_left_out_of_the_union_mean():
    """A row with an empty prefix has no top-k to unite: the mean is over the other rows (1.0 here)."""
    q = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(0)).expand(2, 2, 3, 8)
    k_cache = torch.randn(2, 20, 1, 8, generator=torch.Generator().manual_seed(1))
    assert recall.union_ratio(q, k_cache, torch.tensor([12, 0]), 4) == 1.0


def test_each_rows_union_is_the_one_it_has_alone():
    """The rows are independent: a batch's union ratio is the mean of each row's own, so a short row next to
    a long one unites only its own keys, whatever the queries."""
    generator = torch.Generator().manual_seed(2)
    q, k_cache = torch.randn(2, 4, 5, 8, generator=generator), torch.randn(2, 24, 2, 8, generator=generator)
    lengths = torch.tensor([16, 3])
    alone = [recall.union_ratio(q[row:row + 1], k_cache[row:row + 1], lengths[row:row + 1], 4) for row in range(2)]
    assert recall.union_ratio(q, k_cache, lengths, 4) == pytest.approx(sum(alone) / 2)
