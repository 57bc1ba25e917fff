"""MAGE, Quest and SparseD (methods/mage.py, quest.py, sparsed.py) against plain-torch references of
their papers, on the block engine: float64 tiny SDAR models on the CPU, random budgets and knobs,
ragged batches, several blocks. A reference is written from the method's docstring and paper alone
(nothing of nanodllm/methods but the Method hooks): it keeps no KV cache and recomputes every row
alone, from its first token, at every step and commit, with an explicit mask per layer and KV head
and every score formed. The engine with the real method must decode the same tokens, give the same
logits at every step, choose the same keys (pages) per layer and KV head at every step, and leave
the same KV cache as the reference's recomputation of the final sequences.

Where a docstring settles what the paper leaves open, the reference follows the docstring: the
commit attends exactly unless sparse_commit; SparseD's exact phase is per block; the block's own
keys are always attended. The methods rank their scores in float32 (kernels/top_k.py's reference,
block_scores), the references in float64: the examples here keep the k-th and (k+1)-th scores at
least 1e-5 apart relative, far from a float32 tie."""

from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanodllm import block
from nanodllm.config import GenerationConfig
from nanodllm.methods import Method, get_method
from tests.tiny_models import random_prompt, tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def masked_attention(q, k, v, visible):
    """softmax(q k^T / sqrt(d)) v over the visible keys. q [heads, t, d]; k, v [kv_heads, t, d];
    visible [kv_heads, t, t] bool (query head h reads KV head h // group)."""
    group = q.shape[0] // k.shape[0]
    scores = q @ k.repeat_interleave(group, 0).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(group, 0)


class Recompute(Method):
    """What the three references share, none of it a method's idea. Each row's committed tokens are kept
    as segments: the prompt's complete blocks (prefilled exactly) and one segment per committed block,
    with the prefix keys each layer's KV heads attended at its commit (absent: all of them). Every step
    and commit forwards each row alone, from its first token: a query sees its own block whole and,
    of the earlier blocks, what its block was given (block-causal when nothing was selected). A
    subclass says, in prefix_keys, which prefix keys the active block's queries see."""

    name, engines = "reference", ("block",)

    def __init__(self, k, exact_layers, sparse_commit):
        super().__init__()
        self.k, self.exact_layers, self.sparse_commit = k, exact_layers, sparse_commit
        self.prefilled = None
        self.records = {}  # (block, step, layer, row) -> what prefix_keys chose at that step

    def prefix_keys(self, row, layer, q, k, ctx):
        """(attended: bool [kv_heads, n] over the row's n prefix keys, None for all of them; chosen: the
        selection this call reports, a tuple over KV heads of key (or page) index sets, or None).
        q [heads, L, d]: the active block's queries at this layer; k [kv_heads, n, d]: the prefix's keys."""
        raise NotImplementedError

    def prefill(self, model, ctx):
        size = ctx.block_length
        self.prefilled = [(ctx.tokens[row, :n].tolist(), [(b, b + size, {}) for b in range(0, n, size)])
                          for row, n in enumerate(ctx.counts.tolist())]

    def begin_block(self, ctx):
        if ctx.block == 0:
            rows = self.prefilled or [([], [])] * ctx.tokens.shape[0]
            self.tokens, self.segments = [list(t) for t, _ in rows], [list(s) for _, s in rows]
            self.prefilled = None

    def step(self, model, ctx):
        return self.forward(model, ctx)[0]

    def commit(self, model, ctx):
        hidden, attended = self.forward(model, ctx)
        for row, count in enumerate(ctx.counts.tolist()):
            if count:
                n = len(self.tokens[row])
                self.segments[row].append((n, n + count, attended[row]))
                self.tokens[row] += ctx.tokens[row].tolist()
        return hidden

    def forward(self, model, ctx):
        """Hidden states [batch, L, hidden] of the active block, and per row {layer: attended prefix keys}."""
        hidden, attended = [], []
        for row in range(ctx.tokens.shape[0]):
            x, _, chosen = self.forward_row(model, row, ctx.tokens[row], ctx.positions[row], ctx)
            hidden.append(x[0, len(self.tokens[row]):])
            attended.append(chosen)
        return torch.stack(hidden), attended

    def forward_row(self, model, row, block_tokens, block_positions, ctx):
        """One row: its committed tokens then block_tokens, every layer with an explicit mask. Returns
        (hidden [1, t, hidden], per layer (keys, values) [kv_heads, t, d], {layer: attended prefix keys})."""
        n = len(self.tokens[row])
        ids = torch.tensor(self.tokens[row] + block_tokens.tolist())[None]
        positions = torch.cat([torch.arange(n), block_positions.cpu()])[None]
        x, rope = model.embed(ids), model.rope(positions)
        kv, attended = [], {}
        for layer_index, layer in enumerate(model.layers):
            q, k, v = (t[0] for t in layer.qkv(layer.attn_norm(x), rope))
            segments = list(self.segments[row])
            if len(block_tokens):
                prefix, chosen = self.prefix_keys(row, layer_index, q[:, n:], k[:, :n], ctx)
                if ctx.phase == "step" and n > 0:
                    self.records[ctx.block, ctx.step, layer_index, row] = chosen
                if prefix is not None:
                    attended[layer_index] = prefix
                segments.append((n, ids.shape[1], attended))
            visible = torch.zeros(k.shape[0], ids.shape[1], ids.shape[1], dtype=torch.bool)
            for start, stop, seen in segments:
                visible[:, start:stop, start:stop] = True
                visible[:, start:stop, :start] = seen[layer_index][:, None] if layer_index in seen else True
            x = x + layer.out(masked_attention(q, k, v, visible)[None])
            x = x + layer.mlp(layer.mlp_norm(x))
            kv.append((k, v))
        return x, kv, attended

    def final_cache(self, model, row):
        """Per layer (keys, values) [kv_heads, n, d] of the row's committed sequence, recomputed."""
        return self.forward_row(model, row, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None)[1]


def as_sets(mask):
    """bool [kv_heads, n] -> a tuple over KV heads of the selected positions."""
    return tuple(frozenset(torch.nonzero(m).flatten().tolist()) for m in mask)


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
            return None, as_sets(self.kept[row, layer])  # the capture step itself attends exactly
        return self.kept[row, layer], as_sets(self.kept[row, layer])


class ReferenceSparseD(ReferenceMage):
    """SparseD as MAGE's paper adapts it (methods/sparsed.py): MAGE's per-block eq. 3 selection, captured
    at the last of the block's max(1, round(exact_fraction * T)) exact steps (T: steps per block)
    instead of at its first; a block decoded before that step stays exact, its commit too."""

    def __init__(self, k, exact_fraction, exact_layers, sparse_commit):
        super().__init__(k, exact_layers, sparse_commit)
        self.exact_fraction = exact_fraction

    def capture_step(self, ctx):
        return max(1, round(self.exact_fraction * ctx.steps_per_block)) - 1


class ReferenceQuest(Recompute):
    """Quest per block, as MAGE's paper adapts it (methods/quest.py). At every step, each layer from
    exact_layers on cuts the row's prefix into pages of page_size keys (the last one clipped), bounds
    each page per KV head by sum_d max(q_d min_d, q_d max_d) (min and max: channel-wise over the page's
    keys), averages the bound over the block's queries and the group's heads, and attends to the
    k // page_size pages of highest bound and the block's own keys. The commit is exact unless
    sparse_commit, when it chooses the same way from its own queries."""

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
        return attended, tuple(frozenset(pages.tolist()) for pages in best)


@lru_cache(maxsize=None)
def model_of(layers, kv_heads, block_length):
    return tiny_model("sdar", num_hidden_layers=layers, num_key_value_heads=kv_heads, block_size=block_length)


@st.composite
def decodes(draw, block_lengths=(4, 8, 2), min_steps=1):
    """(model, ragged prompts, schedule): 2-3 layers, GQA groups 4, 2 or 1, blocks of block_lengths
    tokens over 2-3 generated blocks in min_steps to block_length steps, static or threshold
    remasking, 1-3 prompts of 1-32 tokens."""
    block_length = draw(st.sampled_from(block_lengths))
    model = model_of(draw(st.integers(2, 3)), draw(st.sampled_from([2, 1, 4])), block_length)
    dynamic = draw(st.booleans())
    gen = GenerationConfig(gen_length=draw(st.integers(2, 3)) * block_length, block_length=block_length,
                           steps=block_length - draw(st.integers(0, block_length - min_steps)),
                           threshold=0.5 if dynamic else None,
                           remasking="low_confidence_dynamic" if dynamic else "low_confidence_static")
    seed = draw(st.integers(0, 2**16))
    lengths = draw(st.lists(st.integers(1, 32), min_size=1, max_size=3))
    return model, [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)], gen


def sparse_layers(model):
    """exact_layers leaving at least one layer sparse."""
    return st.integers(0, model.cfg.num_layers - 1)


def reported(method, layer, ctx):
    """{row: sets of key (page) indices per KV head, or None} of what the real method reports it chose
    at this step's layer (attended_selection), for the rows with a prefix."""
    selection = method.attended_selection(layer, ctx)
    rows = [row for row, n in enumerate(ctx.cache.host_lengths) if n > 0]
    if selection is None:
        return dict.fromkeys(rows)
    indices, counts, _ = selection
    return {row: tuple(frozenset(indices[row, h, : int(counts[row, h])].tolist()) for h in range(indices.shape[1]))
            for row in rows}


def decode(method, model, prompts, gen):
    """The engine's result with `method`, the logits of each of its steps, and the selection of each
    step per (block, step, layer, row): the reference's records, or what the real method reports."""
    logits, chosen, head = [], {}, method.logits
    method.logits = lambda model, hidden, ctx: logits.append(head(model, hidden, ctx)) or logits[-1]
    if not isinstance(method, Recompute):
        attend = method.attend

        def recording(layer, q, k, v, ctx):
            out = attend(layer, q, k, v, ctx)
            if ctx.phase == "step":
                for row, sets in reported(method, layer, ctx).items():
                    chosen[ctx.block, ctx.step, layer, row] = sets
            return out

        method.attend = recording
    result = block.generate(model, prompts, gen, method=method, stop_ids=())
    return result, logits, method.records if isinstance(method, Recompute) else chosen


def assert_matches_reference(method, reference, model, prompts, gen):
    """Same tokens, same logits at every step, same selection at every step's layers (rows with a
    prefix), and the engine's final KV cache equal to the reference's recomputation of it."""
    result, logits, chosen = decode(method, model, prompts, gen)
    expected, expected_logits, expected_chosen = decode(reference, model, prompts, gen)
    assert result.tokens == expected.tokens
    assert len(logits) == len(expected_logits)
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert chosen.keys() == expected_chosen.keys()
    for key, want in expected_chosen.items():
        assert chosen[key] == want, f"(block, step, layer, row) {key}: the method chose {chosen[key]}, the reference {want}"
    for row, length in enumerate(result.cache.host_lengths):
        for layer, (keys, values) in enumerate(reference.final_cache(model, row)):
            assert keys.shape[1] == length
            for cached, recomputed in ((result.cache.keys[layer], keys), (result.cache.values[layer], values)):
                torch.testing.assert_close(cached[row, :length].transpose(0, 1), recomputed, atol=1e-9, rtol=1e-9)
    return chosen


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(), k=st.integers(1, 16), sparse_commit=st.booleans(), data=st.data())
def test_mage_matches_its_reference(decoding, k, sparse_commit, data):
    knobs = dict(k=k, exact_layers=data.draw(sparse_layers(decoding[0])), sparse_commit=sparse_commit)
    assert_matches_reference(get_method("mage", **knobs), ReferenceMage(**knobs), *decoding)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(block_lengths=(8, 4), min_steps=3), k=st.integers(1, 16),
       exact_fraction=st.sampled_from([0.5, 0.2, 0.0, 0.3, 0.75, 1.0]), sparse_commit=st.booleans(), data=st.data())
def test_sparsed_matches_its_reference(decoding, k, exact_fraction, sparse_commit, data):
    """Blocks of 3-8 steps, so that the capture step (the last exact one) mostly comes after step 0."""
    knobs = dict(k=k, exact_fraction=exact_fraction, exact_layers=data.draw(sparse_layers(decoding[0])),
                 sparse_commit=sparse_commit)
    assert_matches_reference(get_method("sparsed", **knobs), ReferenceSparseD(**knobs), *decoding)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(decoding=decodes(), page_size=st.integers(1, 6), pages=st.integers(1, 4), extra=st.integers(0, 5),
       sparse_commit=st.booleans(), data=st.data())
def test_quest_matches_its_reference(decoding, page_size, pages, extra, sparse_commit, data):
    """k need not be a multiple of the page size (k // page_size pages are kept)."""
    knobs = dict(k=pages * page_size + extra % page_size, page_size=page_size,
                 exact_layers=data.draw(sparse_layers(decoding[0])), sparse_commit=sparse_commit)
    assert_matches_reference(get_method("quest", **knobs), ReferenceQuest(**knobs), *decoding)
