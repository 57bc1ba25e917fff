"""What the block-engine selecting methods' tests share (tests/test_mage.py, test_sparsed.py,
test_quest.py): their schedules, a decode through nanodllm.generation.generate, what a method states
it read (Method.selection) per step and layer, and the machinery of their plain-torch references.

A reference (a subclass of Recompute in the method's test file) is written from the method's
docstring and paper alone (nothing of nanodllm/methods but the Method hooks): it keeps no KV cache
and recomputes every row alone, from its first token, at every step and commit, with an explicit mask
per layer and KV head and every score formed. assert_matches_reference decodes with the real method
and with the reference on float64 tiny SDAR models: the same tokens, the same logits at every step,
the same keys (pages) chosen per layer and KV head at every step, stated as chosen this step or read,
and the same KV cache as the reference's recomputation of the final sequences. The methods rank their
scores in float32 (kernels/top_k.py's reference, block_scores), the references in float64: the drawn
examples keep the k-th and (k+1)-th scores at least 1e-5 apart relative, far from a float32 tie.
"""

from functools import lru_cache

import torch
from hypothesis import strategies as st

from nanodllm.config import GenerationConfig
from nanodllm.generation import generate
from nanodllm.methods import Method
from tests.tiny_models import random_prompt, tiny_model

GEN = GenerationConfig(gen_length=12, block_length=4, steps=4, remasking="low_confidence_static")
# Blocks of 8 tokens over 8 steps: SparseD's default 20% gives capture step max(1, round(1.6)) - 1 = 1 and
# exact_fraction 0.5 step 3, where GEN's 4 steps give step 0 for both (SparseD is then MAGE, step for step).
GEN8 = GenerationConfig(gen_length=16, block_length=8, steps=8, remasking="low_confidence_static")


def run(model, prompts, method, gen=GEN):
    """The GenerationResult of decoding `prompts` with `method` (stats included), no stop tokens."""
    return generate(model, prompts, gen, method, stop_ids=())


def selections(method, model, prompts, gen=GEN):
    """run's result, and per step's attention call (block, step, layer): (the cache's host lengths, what
    method.selection(layer, ctx) states right after that layer's attention, its tensors copied)."""
    seen, attend = {}, method.attend

    def recording(layer, q, k, v, ctx):
        out = attend(layer, q, k, v, ctx)
        if ctx.phase == "step":
            chosen = method.selection(layer, ctx)
            if chosen is not None:
                chosen = chosen._replace(indices=chosen.indices.clone(), counts=chosen.counts.clone())
            seen[ctx.block, ctx.step, layer] = (list(ctx.cache.host_lengths), chosen)
        return out

    method.attend = recording
    return run(model, prompts, method, gen), seen


def step_lengths(method, model, prompts, gen=GEN):
    """run's result, and per denoising step (the step's index in its block, the cache's host lengths)."""
    steps, head = [], method.logits

    def recording(model, hidden, ctx):
        steps.append((ctx.step, list(ctx.cache.host_lengths)))
        return head(model, hidden, ctx)

    method.logits = recording
    return run(model, prompts, method, gen), steps


def keys_read(steps, layers: int, exact, most: int) -> float:
    """kv_kept counted by hand: per step, layer and row, every one of the row's n prefix keys where
    exact(step, layer) says the layer attended exactly (or chose this step), else min(most, n)."""
    read = total = 0
    for step, lengths in steps:
        for layer in range(layers):
            whole = exact(step, layer) or max(lengths) == 0
            read += sum(n if whole else min(most, n) for n in lengths)
            total += sum(lengths)
    return read / total


def masked_attention(q, k, v, visible):
    """softmax(q k^T / sqrt(d)) v over the visible keys. q [heads, t, d]; k, v [kv_heads, t, d];
    visible [kv_heads, t, t] bool (query head h reads KV head h // group)."""
    group = q.shape[0] // k.shape[0]
    scores = q @ k.repeat_interleave(group, 0).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(group, 0)


class Recompute(Method):
    """What the references share, none of it a method's idea. Each row's committed tokens are kept as
    segments: the prompt's complete blocks (prefilled exactly) and one segment per committed block,
    with the prefix keys each layer's KV heads attended at its commit (absent: all of them). Every step
    and commit forwards each row alone, from its first token: a query sees its own block whole and,
    of the earlier blocks, what its block was given (block-causal when nothing was selected). A
    subclass says, in prefix_keys, which prefix keys the active block's queries see."""

    name, engines = "reference", ("block",)

    def __init__(self, k, exact_layers, sparse_commit):
        self.k, self.exact_layers, self.sparse_commit = k, exact_layers, sparse_commit
        self.prefilled = None
        self.records = {}  # (block, step, layer, row) -> what prefix_keys chose at that step

    def prefix_keys(self, row, layer, q, k, ctx):
        """(attended: bool [kv_heads, n] over the row's n prefix keys, None for all of them; chosen: the
        selection this call states, (a tuple over KV heads of key (or page) index sets, whether it was
        chosen at this step from exact attention), or None where the call attends exactly).
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
    """{row: (sets of key (page) indices per KV head, chosen_now), or None} of what the real method
    states this step's layer read or chose (Method.selection), for the rows with a prefix."""
    selection = method.selection(layer, ctx)
    rows = [row for row, n in enumerate(ctx.cache.host_lengths) if n > 0]
    if selection is None:
        return dict.fromkeys(rows)
    indices, counts = selection.indices, selection.counts
    return {row: (tuple(frozenset(indices[row, h, : int(counts[row, h])].tolist()) for h in range(indices.shape[1])),
                  selection.chosen_now) for row in rows}


def decode(method, model, prompts, gen):
    """The result with `method`, the logits of each of its steps, and the selection of each step per
    (block, step, layer, row): the reference's records, or what the real method states."""
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
    result = run(model, prompts, method, gen)
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
        assert chosen[key] == want, (f"(block, step, layer, row) {key}: the method chose {chosen[key]}, "
                                     f"the reference {want}")
    for row, length in enumerate(result.cache.host_lengths):
        for layer, (keys, values) in enumerate(reference.final_cache(model, row)):
            assert keys.shape[1] == length
            for cached, recomputed in ((result.cache.keys[layer], keys), (result.cache.values[layer], values)):
                torch.testing.assert_close(cached[row, :length].transpose(0, 1), recomputed, atol=1e-9, rtol=1e-9)
    return result, chosen
