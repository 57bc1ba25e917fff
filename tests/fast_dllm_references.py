"""What the Fast-dLLM and Sparse-dLLM tests share (tests/test_fast_dllm.py, test_sparse_dllm.py): a
step context of the masked engine built by hand, and a plain-torch float64 reference of the caches that
keep the K/V outside the fed range (methods/fast_dllm.py, sparse_dllm.py), with what it takes to compare
a method against it.

The reference (ReferenceOutsideCache) decodes every batch row alone, from the row's own tokens (its
prompt without the padding, then the whole generated region, positions from 0), with an explicit
softmax over an explicit key mask in every layer. Per block, at step s within it and since = s - delay:
    since < 0                   a full forward of the row, nothing kept;
    since == 0, or refresh > 0 and since % refresh == 0
                                a full forward of the row; each layer keeps the K/V of a set of the
                                row's positions per KV head (`select`: Fast-dLLM's in test_fast_dllm.py,
                                Sparse-dLLM's in test_sparse_dllm.py), the others zeroed and hidden;
    otherwise                   a cached step: only the fed range is forwarded (the block in dual mode,
                                the block and everything after it in prefix mode); its queries attend
                                to the kept K/V and the fed range's own fresh K/V, nothing else.
A new block drops what was kept. Where the docstrings settle what the papers leave open, the reference
follows the docstrings: `delay` and `refresh` count steps within the block from the building step.

The data: tiny float64 LLaDA models (1, 2 or 4 KV heads for 4 query heads), ragged batches of 2-3
left-padded prompts, 3 blocks of 4 steps or threshold decoding, with or without classifier-free
guidance (a doubled batch). Both run in the engine (the reference through the base Method hooks only):
every step's logits must agree within 1e-9, both must decode the same tokens, and at every step that
builds a cache the method must keep the reference's positions per block, step, layer, batch row and KV
head (read from the K buffers it keeps, matched to the canvas's keys)."""

from functools import lru_cache

import torch
from hypothesis import strategies as st

from nanodllm.attention import CanvasMask
from nanodllm.config import GenerationConfig
from nanodllm.generation import generate
from nanodllm.methods.base import Method, StepContext
from tests.tiny_models import MASK_ID, random_prompt, tiny_model

BLOCKS = 3


def canvas_context(prompts, step, block=1, block_length=4, gen_length=12):
    """The masked engine's context for `block` of a canvas of left-padded prompts + masks (one step per
    token, so step t of the generation is block * block_length + step)."""
    prompt_width = max(map(len, prompts))
    width = prompt_width + gen_length
    tokens = torch.full((len(prompts), width), MASK_ID)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        start = prompt_width - len(prompt)
        tokens[row, start : start + len(prompt)] = torch.tensor(prompt)
        valid[row, start:] = True
    positions = (torch.arange(width)[None] - (~valid).sum(1, keepdim=True)).clamp(min=0)
    start = prompt_width + block * block_length
    return StepContext(tokens, positions, valid, torch.tensor([len(p) for p in prompts]), prompt_width=prompt_width,
                       block=block, step=step, steps_per_block=block_length, t=block * block_length + step,
                       mask_id=MASK_ID, attn_mask=CanvasMask(valid=valid), logits_start=start,
                       logits_stop=start + block_length, block_length=block_length)


@lru_cache(maxsize=None)
def model_of(kv_heads):
    return tiny_model("llada", seed=5, n_kv_heads=kv_heads)


def attend(q, keys, values, visible):
    """Explicit softmax(q k^T / sqrt(d)) v over the visible keys only: q [heads, m, d], keys and values
    [kv_heads, n, d], visible [kv_heads, n] bool."""
    group = q.shape[0] // keys.shape[0]
    k, v, seen = (x.repeat_interleave(group, 0) for x in (keys, values, visible))
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~seen[:, None, :], float("-inf"))
    return scores.softmax(-1) @ v


class ReferenceOutsideCache(Method):
    """The cache of the module's docstring, per batch row, with what each layer keeps chosen by
    select(q, k, block, fed) -> keep [kv_heads, n] bool. kept_sets: (block, step, layer, batch row, KV
    head, kept positions of the row) at every building step."""

    name = "reference_outside_cache"
    engines = ("masked",)

    def __init__(self, mode, delay, refresh, select):
        self.mode, self.delay, self.refresh, self.select = mode, delay, refresh, select
        self.cache, self.kept_sets = {}, []

    def begin_block(self, ctx):
        self.cache = {}

    def step(self, model, ctx):
        since = ctx.step - self.delay
        if since == 0 or (since > 0 and self.refresh > 0 and since % self.refresh == 0):
            phase = "build"
        else:
            phase = "cached" if since > 0 else "full"
        hidden = torch.zeros(*ctx.tokens.shape, model.cfg.hidden_size, dtype=torch.float64)
        for b in range(ctx.tokens.shape[0]):
            columns = ctx.valid[b].nonzero()[:, 0]
            pad = int(columns[0])
            block = range(ctx.logits_start - pad, ctx.logits_stop - pad)
            fed = range(block.start, block.stop if self.mode == "dual" else len(columns))
            rows = fed if phase == "cached" else range(len(columns))
            if phase == "build":
                self.cache[b] = []
            x = self.forward(model, ctx.tokens[b, columns], rows, block, fed, phase, self.cache.get(b))
            hidden[b, columns[rows.start : rows.stop]] = x
            if phase == "build":
                for i, (keep, _, _) in enumerate(self.cache[b]):
                    for h, positions in enumerate(keep):
                        self.kept_sets.append((ctx.block, ctx.step, i, b, h, tuple(positions.nonzero()[:, 0].tolist())))
        return hidden

    def forward(self, model, ids, rows, block, fed, phase, cache):
        """The row's hidden states at `rows`: all its tokens, or, on a cached step, the fed range. cache:
        the row's (kept positions [kv_heads, n], keys, values) per layer, which a building step fills."""
        positions = torch.arange(rows.start, rows.stop)
        x, rope = model.embed(ids[positions][None]), model.rope(positions[None])
        for i, layer in enumerate(model.layers):
            q, k, v = (t[0] for t in layer.qkv(layer.attn_norm(x), rope))
            if phase == "cached":
                keep, keys, values = cache[i]
                keys, values, visible = keys.clone(), values.clone(), keep.clone()
                keys[:, fed.start : fed.stop], values[:, fed.start : fed.stop] = k, v
                visible[:, fed.start : fed.stop] = True
            else:
                keys, values, visible = k, v, torch.ones(k.shape[:2], dtype=torch.bool)
            if phase == "build":
                keep = self.select(q, k, block, fed)
                cache.append((keep, k * keep[..., None], v * keep[..., None]))
            x = x + layer.out(attend(q, keys, values, visible)[None])
            x = x + layer.mlp(layer.mlp_norm(x))
        return x[0]


def kept_positions(kept, k, ctx, layer):
    """The method's kept key set at a building step: (block, step, layer, batch row, KV head, positions
    of the row) for every unmasked slot of its K buffer, each found among the canvas's keys k by exact
    equality (a padding column gives a negative position)."""
    sets = []
    for b in range(k.shape[0]):
        pad = int((~ctx.valid[b]).sum())
        for h in range(k.shape[1]):
            shown = torch.ones(kept.keys.shape[2], dtype=torch.bool) if kept.mask is None else \
                kept.mask[b, h % kept.mask.shape[1], 0]
            matches = (kept.keys[b, h, shown][:, None] == k[b, h][None]).all(-1)
            assert matches.any(1).all(), "a kept key is none of the canvas's keys"
            columns = matches.int().argmax(1)  # the first matching column
            sets.append((ctx.block, ctx.step, layer, b, h, tuple(sorted((columns - pad).tolist()))))
    return sets


def with_kept_sets(method):
    """The method, its keep wrapped to record every kept key set (method.kept_sets)."""
    method.kept_sets, keep = [], method.keep

    def recorded_keep(layer, q, k, v, ctx):
        kept = keep(layer, q, k, v, ctx)
        method.kept_sets += kept_positions(kept, k, ctx, layer)
        return kept

    method.keep = recorded_keep
    return method


def decode_recording_logits(method, model, prompts, gen):
    """The tokens generate() decodes with `method`, whose logits at every step are recorded
    (method.seen_logits)."""
    method.seen_logits, logits = [], method.logits

    def recorded_logits(model, hidden, ctx):
        out = logits(model, hidden, ctx)
        method.seen_logits.append(out.clone())
        return out

    method.logits = recorded_logits
    return generate(model, prompts, gen, method).tokens


@st.composite
def batches(draw):
    """(model, 2-3 ragged prompts of 2-14 tokens, not all of one length, a schedule of 3 blocks of 4
    tokens: 4 steps each or threshold decoding, with or without classifier-free guidance)."""
    model = model_of(draw(st.sampled_from([1, 2, 4])))
    first = draw(st.integers(2, 14))
    offsets = draw(st.lists(st.integers(1, 12), min_size=1, max_size=2))
    lengths = [first] + [2 + (first - 2 + offset) % 13 for offset in offsets]  # the second differs from the first
    seed = draw(st.integers(0, 2**16))
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    gen = GenerationConfig(gen_length=4 * BLOCKS, block_length=4, steps=4 * BLOCKS,
                           threshold=draw(st.sampled_from([None, 0.15])), cfg_scale=draw(st.sampled_from([0.0, 1.0])))
    return model, prompts, gen


def assert_matches_reference(method, reference, expected, batch):
    """The method's decode against the reference's (expected: its tokens): the same logits at every
    step, the same tokens, the same kept key sets."""
    model, prompts, gen = batch
    tokens = decode_recording_logits(with_kept_sets(method), model, prompts, gen)
    assert len(method.seen_logits) == len(reference.seen_logits)
    for step, (got, want) in enumerate(zip(method.seen_logits, reference.seen_logits)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert tokens == expected
    assert sorted(method.kept_sets) == sorted(reference.kept_sets)
