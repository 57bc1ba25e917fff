"""MOMO (methods/momo.py) against a plain-torch reference of its paper ("Measure Once, Mask Once",
Algorithms 1-2, eq. 2-7), at random knobs (gamma, chi, beta, k, k_exact, k_trim, top_k, trim): the key
blocks kept per query block, layer and query head, the attention output, and the tokens and logits
of whole generations, on float64 tiny models on the CPU.

The reference is written from the paper and the docstrings of methods/momo.py and
kernels/qsa_estimate.py alone: of nanodllm/methods it uses only the Method hooks (momo.py is the code
under test; its selection is read by wrapping measure_and_mask, or kept_lists on the kernel path). It
keeps no KV cache: every forward runs each row alone from its first token, with an explicit mask and
every score formed, and the selection is plain Python over the block scores. Only its MOMO results,
a pure function of q, k, v and the mask, are looked up when those inputs recur (byte for byte).

Where the paper leaves something open, the reference follows the docstrings:
- every query head selects its own blocks (the attention of a head is its own);
- "exact" and "tree" keep the k visible blocks of highest eq. 4 score, ties to the lower block;
- "estimated" (qsa_estimate.py): a row's blocks are visited in golden-ratio strides over T blocks,
  T the largest 1 + last visible block among its group of ORDER_ROWS sampled rows; each visible
  block updates Welford's running mean and sample variance, M2 / (count - 1), then meets a k_exact
  exact buffer (it replaces the first lowest slot when strictly higher), and what the buffer rejects
  or displaces takes a free slot of the other k - k_exact when erf((s - m) / (sigma sqrt 2)) > 2p - 1
  (s > m while sigma = 0) or p <= 0, p = 1 - free slots / the row's blocks left;
- the trim keeps the k_trim (default k) best blocks of the union, ties to the lower block, ranked by
  the mean eq. 4 score over the rows that chose a block ("mean", Algorithm 2) or by the sum over them
  of its share of the row's attention, exp(S(j) - logsumexp of the row) ("mass"), and adds the
  diagonal blocks: the key blocks overlapping the query block's own rows;
- a batch's row computes what it computes alone (the reference runs every row alone, on its real
  tokens, under the mask the batch gives them): its grid (sampled rows, query and key blocks) starts
  at its first real token and padded rows choose nothing;
- MOMO is the block engine's prefill attention (the prompt's complete blocks, block-causal), the
  later steps and commits attend exactly; on the masked engine with canvas=True it is the attention
  of every step, over each row's whole canvas."""

import math
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nanodllm.methods.momo as momo
from nanodllm.kernels.qsa_estimate import ORDER_ROWS
from nanodllm import block, masked
from nanodllm.attention import CanvasMask
from nanodllm.config import GenerationConfig
from nanodllm.methods import Method, get_method
from tests.device import DEVICE, FP32_OUT_TOLERANCE, TF32_DOTS
from tests.tiny_models import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GOLDEN = (1 + 5**0.5) / 2
INF = float("inf")


def exact_choice(scores, k):
    """The k visible blocks of highest score, ties to the lower block."""
    return sorted((j for j, s in enumerate(scores) if s > -INF), key=lambda j: (-scores[j], j))[:k]


def estimated_choice(scores, k, k_exact, scan):
    """eq. 6-7 with a k_exact exact part over one row's block scores, visiting `scan` blocks."""
    last = max((j + 1 for j, s in enumerate(scores) if s > -INF), default=0)
    stride = max(1, round(scan / GOLDEN)) if scan else 1
    while scan and math.gcd(stride, scan) != 1:
        stride += 1
    exact, greedy = [(-INF, -1)] * k_exact, []
    count, mean, m2 = 0, 0.0, 0.0
    for step in range(scan):
        block = step * stride % scan
        score = scores[block] if block < len(scores) else -INF
        if score == -INF:
            continue
        count += 1
        delta = score - mean
        mean += delta / count
        m2 += delta * (score - mean)
        offered = (score, block)
        if k_exact:
            slot = min(range(k_exact), key=lambda t: exact[t][0])
            if score > exact[slot][0]:
                offered, exact[slot] = exact[slot], offered
        free = k - k_exact - len(greedy)
        if offered[1] < 0 or free <= 0:
            continue
        p = 1 - free / max(last - (count - 1), 1)
        sigma = math.sqrt(m2 / max(count - 1, 1))
        beats = math.erf((offered[0] - mean) / (sigma * math.sqrt(2))) > 2 * p - 1 if sigma > 0 else offered[0] > mean
        if p <= 0 or beats:
            greedy.append(offered[1])
    return [b for _, b in exact if b >= 0] + greedy


def reference_momo(q, k, v, visible, gamma, chi, beta, k_blocks, k_exact, k_trim, top_k, trim):
    """Algorithm 1 for one row: q [heads, n, d], k, v [kv_heads, n, d], visible [n, n] bool. Returns
    (out [heads, n, d], kept: per head, per query block, the frozenset of kept key blocks)."""
    heads, n, d = q.shape
    group = heads // k.shape[0]
    keys, values = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ keys.transpose(-1, -2) * d**-0.5).masked_fill(~visible, -INF)  # [heads, n, n]
    exact_out = torch.nan_to_num(scores.softmax(-1), nan=0.0) @ values
    sampled = list(range(0, n, gamma))
    blocks = -(-n // beta)
    eq4 = torch.stack([scores[:, sampled, j * beta : (j + 1) * beta].logsumexp(-1) for j in range(blocks)], -1).tolist()
    row_lse = scores[:, sampled].logsumexp(-1).tolist()
    lasts = [max((j + 1 for j, s in enumerate(row) if s > -INF), default=0) for row in eq4[0]]  # the mask is per row
    kept_per_head, allowed = [], torch.zeros(heads, n, n, dtype=torch.bool)
    for head in range(heads):
        chosen = []
        for r in range(len(sampled)):
            group_rows = range(r // ORDER_ROWS * ORDER_ROWS, min((r // ORDER_ROWS + 1) * ORDER_ROWS, len(sampled)))
            if top_k == "estimated":
                chosen.append(estimated_choice(eq4[head][r], k_blocks, k_exact, max(lasts[g] for g in group_rows)))
            else:
                chosen.append(exact_choice(eq4[head][r], k_blocks))
        kept = []
        for start in range(0, n, chi):
            stop = min(start + chi, n)
            votes = {}
            for r in range(len(sampled)):
                if start <= sampled[r] < stop:
                    for j in chosen[r]:
                        s = eq4[head][r][j]
                        votes.setdefault(j, []).append(s if trim == "mean" else math.exp(s - row_lse[head][r]))
            rank = {j: sum(vs) / len(vs) if trim == "mean" else sum(vs) for j, vs in votes.items()}
            best = sorted(rank, key=lambda j: (-rank[j], j))[: k_trim or k_blocks]
            diagonal = {j for j in range(blocks) if j * beta < stop and (j + 1) * beta > start}
            kept.append(frozenset(best) | diagonal)
            for j in kept[-1]:
                allowed[head, start:stop, j * beta : (j + 1) * beta] = True
        kept_per_head.append(tuple(kept))
    sparse = scores.masked_fill(~allowed, -INF)
    o_sparse = torch.nan_to_num(sparse.softmax(-1), nan=0.0) @ values
    window = torch.arange(n) // gamma * gamma  # each row's sampled row
    return o_sparse + exact_out[:, window] - o_sparse[:, window], tuple(kept_per_head)


def block_causal(n, size):
    positions = torch.arange(n)
    return (positions[None, :] // size) <= (positions[:, None] // size)


def masked_attention(q, k, v, visible):
    group = q.shape[0] // k.shape[0]
    scores = q @ k.repeat_interleave(group, 0).transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~visible, -INF).softmax(-1) @ v.repeat_interleave(group, 0)


def engine_knobs(knobs):
    """momo_attention's names for a Momo's knobs."""
    return {("k_blocks" if name == "k" else name): value for name, value in knobs.items()}


@st.composite
def momo_knobs(draw, betas=(2, 3, 4, 5, 8), gammas=(1, 2, 3, 4)):
    gamma, beta, k = draw(st.sampled_from(gammas)), draw(st.sampled_from(betas)), draw(st.integers(1, 8))
    return dict(gamma=gamma, chi=gamma * draw(st.integers(1, 4)), beta=beta, k=k, k_exact=draw(st.integers(0, k)),
                k_trim=draw(st.none() | st.integers(1, 8)), top_k=draw(st.sampled_from(["exact", "tree", "estimated"])),
                trim=draw(st.sampled_from(["mean", "mass"])))


def kept_sets(keep, row, length, chi, beta):
    """The batch's keep [batch, heads, query blocks, key blocks] of one row (of `length` real tokens from
    column 0 of MOMO's grid) as the reference gives it: only its own query and key blocks."""
    query_blocks, key_blocks = -(-length // chi), -(-length // beta)
    return tuple(tuple(frozenset(torch.nonzero(keep[row, head, m, :key_blocks]).flatten().tolist())
                       for m in range(query_blocks)) for head in range(keep.shape[1]))


def recording_selection(monkeypatch):
    """A list that collects the keep of every torch MOMO call, in call order."""
    calls, measure = [], momo.measure_and_mask

    def recorded(*args, **kwargs):
        o_gamma, keep = measure(*args, **kwargs)
        calls.append(keep)
        return o_gamma, keep

    monkeypatch.setattr(momo, "measure_and_mask", recorded)
    return calls


LAYOUTS = ["left-padded", "right-padded block-causal", "left-padded block-causal",
           "left-padded block-causal from column 0"]


def ragged_inputs(lengths, heads, kv_heads, layout, size, seed, head_dim=8):
    """q, k, v of a batch whose row r holds lengths[r] real tokens, and its CanvasMask: left-padded (the
    masked engine's canvas; block-causal with per-row positions, or with blocks from column 0 as a
    CanvasMask without positions has them) or right-padded (the prefill)."""
    generator = torch.Generator().manual_seed(seed)
    batch, n = len(lengths), max(lengths)
    q = torch.randn(batch, heads, n, head_dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, n, head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    pads = torch.tensor([n - length for length in lengths])[:, None]
    columns = torch.arange(n)[None, :]
    if layout.startswith("left"):
        valid, positions = columns >= pads, (columns - pads).clamp(min=0)
    else:
        valid, positions = columns < n - pads, columns.expand(batch, -1)
    block_size = size if "block-causal" in layout else None
    return q, k, v, CanvasMask(valid, block_size, positions if layout == "left-padded block-causal" else None)


def alone(mask, row):
    """(the row's real columns, the mask among them [t, t])."""
    columns, n = torch.nonzero(mask.valid[row]).flatten(), mask.valid.shape[1]
    return columns, mask.dense(n, n, "cpu")[row, 0][columns][:, columns]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), heads=st.sampled_from([(4, 2), (4, 4), (2, 1)]),
       layout=st.sampled_from(LAYOUTS), size=st.integers(1, 6), knobs=momo_knobs(), seed=st.integers(0, 2**16))
def test_attention_matches_the_reference_row_by_row(lengths, heads, layout, size, knobs, seed):
    """momo_attention on a ragged batch: each row's real outputs and kept blocks (per query block and
    head) are the reference's for its real tokens alone, under the mask the batch gives them."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = recording_selection(monkeypatch)
        q, k, v, mask = ragged_inputs(lengths, *heads, layout, size, seed)
        out = momo.momo_attention(q, k, v, mask, **engine_knobs(knobs))
    assert len(calls) == 1
    for row, length in enumerate(lengths):
        columns, visible = alone(mask, row)
        expected, kept = reference_momo(q[row][:, columns], k[row][:, columns], v[row][:, columns], visible,
                                        **engine_knobs(knobs))
        assert kept_sets(calls[0], row, length, knobs["chi"], knobs["beta"]) == kept
        torch.testing.assert_close(out[row][:, columns], expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("layout,knobs", [
    ("left-padded", dict(gamma=4, chi=64, beta=16, k=2, k_exact=2, k_trim=None, top_k="exact", trim="mean")),
    ("right-padded block-causal", dict(gamma=8, chi=64, beta=16, k=3, k_exact=3, k_trim=2, top_k="tree", trim="mass")),
    ("left-padded block-causal", dict(gamma=32, chi=64, beta=16, k=3, k_exact=1, k_trim=None, top_k="estimated",
                                      trim="mean"))])
def test_the_kernel_path_matches_the_reference_row_by_row(monkeypatch, layout, knobs):
    """The Triton pipeline (interpreted on a CPU) on a ragged float32 batch: each row's kept blocks are
    the reference's for the row alone (in float64 from the same inputs), and so are its outputs. With
    gamma 32 > beta the padded sampled rows of rows 1 and 2 see a key block more than their last real
    sampled row, so the estimate's scan order holds only if they stay out of it."""
    calls, lists_of = [], momo.kept_lists
    monkeypatch.setattr(momo, "kept_lists", lambda *args: calls.append(lists_of(*args)) or calls[-1])
    monkeypatch.setattr(momo, "attention_on_kernels", lambda q: True)
    lengths = [150, 85, 117]
    q, k, v, mask = ragged_inputs(lengths, 4, 2, layout, 8, seed=3, head_dim=16)
    q, k, v = (x.half().double() if TF32_DOTS else x.float().double() for x in (q, k, v))  # what the kernels read
    positions = None if mask.positions is None else mask.positions.to(DEVICE)
    out = momo.momo_attention(*(x.float().to(DEVICE) for x in (q, k, v)),
                              CanvasMask(mask.valid.to(DEVICE), mask.block_size, positions),
                              **engine_knobs(knobs)).cpu()
    (lists,) = calls
    for row, length in enumerate(lengths):
        columns, visible = alone(mask, row)
        expected, kept = reference_momo(q[row][:, columns], k[row][:, columns], v[row][:, columns], visible,
                                        **engine_knobs(knobs))
        key_blocks = -(-length // knobs["beta"])
        got = tuple(tuple(frozenset(j for j in lists[row, head, m].tolist() if 0 <= j < key_blocks)
                          for m in range(-(-length // knobs["chi"]))) for head in range(4))
        assert got == kept
        torch.testing.assert_close(out[row][:, columns].double(), expected, atol=FP32_OUT_TOLERANCE,
                                   rtol=FP32_OUT_TOLERANCE)


class ReferenceMomo(Method):
    """MOMO as the paper states it, recomputing every row alone from its first token at every forward.
    Block engine: the prompt's complete blocks (the prefix) attend through reference_momo among
    themselves (block-causal), every later token exactly. Masked engine (canvas=True): each row's
    canvas, its real columns only, attends through reference_momo at every layer of every step.
    records: (forward, layer, row) -> the kept blocks (block engine: forward 0, the prefill's)."""

    name, engines = "momo_reference", ("block", "masked")

    def __init__(self, knobs):
        super().__init__()
        self.knobs = engine_knobs(knobs)
        self.records, self.forwards, self.memo = {}, 0, {}
        self.prefix = None

    def momo(self, layer, row, q, k, v, visible):
        key = (layer, *(x.numpy().tobytes() for x in (q, k, v, visible)))
        if key not in self.memo:
            self.memo[key] = reference_momo(q, k, v, visible, **self.knobs)
        out, kept = self.memo[key]
        self.records.setdefault((self.forwards, layer, row), kept)
        return out

    def prefill(self, model, ctx):
        self.prefix = [ctx.tokens[row, :n].tolist() for row, n in enumerate(ctx.counts.tolist())]

    def begin_block(self, ctx):
        if ctx.block == 0 and ctx.cache is not None:
            self.tokens = [list(t) for t in self.prefix] if self.prefix else [[] for _ in range(ctx.tokens.shape[0])]
            self.prefix_lengths = [len(t) for t in self.tokens]
            self.forwards = 0  # the prefill's selection is recorded at the first forward

    def step(self, model, ctx):
        return self.forward(model, ctx) if ctx.cache is not None else self.canvas(model, ctx)

    def commit(self, model, ctx):
        hidden = self.forward(model, ctx)
        for row, count in enumerate(ctx.counts.tolist()):
            if count:
                self.tokens[row] += ctx.tokens[row].tolist()
        return hidden

    def forward(self, model, ctx):
        """Block engine: [batch, L, hidden] of the active block, each row from its first token."""
        hidden = []
        for row in range(ctx.tokens.shape[0]):
            n, prefix = len(self.tokens[row]), self.prefix_lengths[row]
            ids = torch.tensor(self.tokens[row] + ctx.tokens[row].tolist())[None]
            positions = torch.cat([torch.arange(n), ctx.positions[row]])[None]
            visible = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool)
            visible[:n, n:] = False
            visible[:n, :n] = block_causal(n, ctx.block_length)
            x = self.layers(model, row, ids, positions, visible, prefix)
            hidden.append(x[0, n:])
        self.forwards += 1
        return torch.stack(hidden)

    def canvas(self, model, ctx):
        """Masked engine: [batch, width, hidden], each row's real columns alone (zeros at the pads)."""
        hidden = torch.zeros(*ctx.tokens.shape, model.cfg.hidden_size, dtype=torch.float64)
        for row in range(ctx.tokens.shape[0]):
            columns = torch.nonzero(ctx.valid[row]).flatten()
            visible = torch.ones(len(columns), len(columns), dtype=torch.bool)
            if model.cfg.attention == "block_causal":  # positions count from the row's first real token
                visible = block_causal(len(columns), model.cfg.block_size)
            ids, positions = ctx.tokens[row, columns][None], ctx.positions[row, columns][None]
            hidden[row, columns] = self.layers(model, row, ids, positions, visible, len(columns))[0]
        self.forwards += 1
        return hidden

    def layers(self, model, row, ids, positions, visible, sparse):
        """Every layer over one row: rows < sparse attend among themselves through reference_momo, the
        others exactly; visible [t, t] is the row's mask."""
        x, rope = model.embed(ids), model.rope(positions)
        for layer_index, layer in enumerate(model.layers):
            q, k, v = (t[0] for t in layer.qkv(layer.attn_norm(x), rope))
            out = masked_attention(q, k, v, visible)
            if sparse:
                out[:, :sparse] = self.momo(layer_index, row, q[:, :sparse], k[:, :sparse], v[:, :sparse],
                                            visible[:sparse, :sparse])
            x = x + layer.out(out[None])
            x = x + layer.mlp(layer.mlp_norm(x))
        return x


def recorded_decode(method, generate):
    """generate(method)'s result and the logits of each of its steps."""
    logits, head = [], method.logits
    method.logits = lambda model, hidden, ctx: logits.append(head(model, hidden, ctx)) or logits[-1]
    return generate(method), logits


def assert_same_decode(got, expected):
    (result, logits), (expected_result, expected_logits) = got, expected
    assert result.tokens == expected_result.tokens
    assert len(logits) == len(expected_logits)
    for step, (a, b) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda text: f"step {step}: {text}")


@lru_cache(maxsize=None)
def block_model(layers, kv_heads, block_length):
    return tiny_model("sdar", num_hidden_layers=layers, num_key_value_heads=kv_heads, block_size=block_length)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(block_length=st.sampled_from([4, 8, 2]), layers=st.integers(2, 3), kv_heads=st.sampled_from([2, 1, 4]),
       blocks=st.integers(2, 3), dynamic=st.booleans(), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       knobs=momo_knobs(), seed=st.integers(0, 2**16), data=st.data())
def test_the_block_engine_matches_the_reference(block_length, layers, kv_heads, blocks, dynamic, lengths,
                                                knobs, seed, data):
    """The block engine with MOMO's prefill against ReferenceMomo on a ragged batch: the same tokens,
    the same logits at every step, and per layer, row and head the prefill's kept blocks."""
    model = block_model(layers, kv_heads, block_length)
    gen = GenerationConfig(gen_length=blocks * block_length, block_length=block_length,
                           steps=data.draw(st.integers(1, block_length)), threshold=0.5 if dynamic else None,
                           remasking="low_confidence_dynamic" if dynamic else "low_confidence_static")
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    run = lambda method: block.generate(model, prompts, gen, method=method, stop_ids=())
    reference = ReferenceMomo(knobs)
    expected = recorded_decode(reference, run)
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = recording_selection(monkeypatch)
        assert_same_decode(recorded_decode(get_method("momo", **knobs), run), expected)
    prefixes = [n // block_length * block_length for n in lengths]
    assert len(calls) == (layers if max(prefixes) else 0)
    for layer, keep in enumerate(calls):
        for row, prefix in enumerate(prefixes):
            if prefix:
                assert kept_sets(keep, row, prefix, knobs["chi"], knobs["beta"]) == reference.records[0, layer, row]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=3), model_type=st.sampled_from(["llada", "sdar"]),
       knobs=momo_knobs(), seed=st.integers(0, 2**16))
def test_the_masked_engine_with_canvas_matches_the_reference(lengths, model_type, knobs, seed):
    """The masked engine with MOMO on every canvas step (canvas=True) against ReferenceMomo on a
    left-padded ragged batch, of a bidirectional model or a block-causal one (per-row positions): the
    same tokens, logits at every step, and kept blocks per step, layer, row and head."""
    model, gen = masked_model(model_type), GenerationConfig(gen_length=8, block_length=4, steps=4)
    prompts = [random_prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
    run = lambda method: masked.generate(model, prompts, gen, method)
    reference = ReferenceMomo(knobs)
    expected = recorded_decode(reference, run)
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = recording_selection(monkeypatch)
        assert_same_decode(recorded_decode(get_method("momo", **knobs, canvas=True), run), expected)
    layers = model.cfg.num_layers
    assert len(calls) == reference.forwards * layers == 4 * layers
    for call, keep in enumerate(calls):
        for row, length in enumerate(lengths):
            assert kept_sets(keep, row, length + gen.gen_length, knobs["chi"], knobs["beta"]) == \
                reference.records[call // layers, call % layers, row]


@lru_cache(maxsize=None)
def masked_model(model_type):
    return tiny_model(model_type)
