"""The contract every registered method keeps, on each engine it lists (METHODS[name].engines):

1. full budget equals dense: with the knobs that make its computation exact (its module docstring's
   "Equals dense" line) it decodes dense's tokens, token for token, on a float64 tiny model;
2. a tiny budget differs: with knobs that keep little it decodes other tokens than (1)'s reference;
3. a ragged batch equals its rows run alone: at the tiny knobs, [prompt_a, prompt_b] (lengths 30 and
   21, neither a multiple of the block, so one row is padded) decodes row by row what each prompt
   decodes alone, with a fresh method object each time; "dense" included; and so does BETWEEN, a batch
   of three whose longest row is neither first nor last;
4. nothing leaks from one generate() to the next: a method object that first decoded other prompts (of
   the same shapes, or of other lengths and batch size) decodes PROMPTS as a fresh one does, the same
   tokens and every step's logits, over at least three blocks (so per-block state is exercised too).

A newly registered method (or engine) without an entry in CONTRACT fails here, by name. The tiny
knobs differ from the full ones only in the budget (k, budget, ratio, tau, intervals, refresh), so
(2) shows that the budget is what (1) exercised, not a disabled method."""

from dataclasses import dataclass, field
from functools import cache

import pytest
import torch

from nanodllm import block, gemma_loop, masked
from nanodllm.config import GenerationConfig
from nanodllm.loader import load_reference
from nanodllm.methods import METHODS, get_method
from tests.tiny_models import GEMMA_FIXTURE, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODELS = {"masked": tiny_model("llada"), "block": tiny_model("sdar", block_size=4),
          "gemma": load_reference(GEMMA_FIXTURE, dtype=torch.float64)}  # one full layer, a window of 8
GENS = {"masked": GenerationConfig(gen_length=16, block_length=4, steps=16),  # 4 blocks of 4 steps
        "block": GenerationConfig(gen_length=12, block_length=4, steps=4),  # 3+ blocks, one token per step
        "gemma": GenerationConfig(gen_length=24, block_length=8, steps=4)}  # 3 canvases of 8, 4 steps each
GEMMA_SAMPLING = gemma_loop.GemmaSampling(sample=False, seed=0)  # argmax tokens, seeded noise
# Long enough that k = 1-2 or budget = 2 drops most of the prefix; 30 and 21 are not multiples of the
# block (4), so the block engine's first block holds each prompt's tail and the masked engine's
# canvas left-pads row 1 by 9 columns.
PROMPTS = [random_prompt(30, seed=1), random_prompt(21, seed=2)]
# (3)'s second batch: the 21-token row first, then the longest, then a 27-token one: left pads 9, 0 and 3
# on the masked canvas, tails of 1, 2 and 3 tokens in the block engine's first block.
BETWEEN = [PROMPTS[1], PROMPTS[0], random_prompt(27, seed=3)]
# (4): what a reused method decodes first. "same_shapes": other tokens in PROMPTS' shapes, so state
# left over fits and would be read silently; "other_shapes": three rows, one longer than any of PROMPTS,
# so state sized by the last generation would not fit them.
EARLIER = {"same_shapes": [random_prompt(30, seed=5), random_prompt(21, seed=6)],
           "other_shapes": [random_prompt(9, seed=7), random_prompt(37, seed=8), random_prompt(26, seed=9)]}


@dataclass(frozen=True)
class Contract:
    full: dict | None  # knobs under which the method is exact (None: nothing to check, dense itself)
    tiny: dict  # knobs under which it keeps little
    reference: tuple = ("dense", ())  # (method, knob items) that `full` equals and `tiny` does not
    why: str = field(default="", compare=False)


DUAL_DELAY_1 = ("fast_dllm", (("mode", "dual"), ("delay", 1)))
# MOMO: key blocks of 4 tokens (a 28-token prefill spans 7), every 2nd row sampled, query blocks of 8
# rows: wider than the engine's block, so a padded row's last query block holds real and pad rows
# (block engine prefill: rows 20-23 of the 20-token prefix next to a 28-token one), and the masked
# engine's left pad of 9 is not a multiple of the grid.
MOMO_GRID = dict(gamma=2, chi=8, beta=4, k_exact=1)

CONTRACT: dict[tuple[str, str], Contract] = {
    ("dense", "masked"): Contract(None, {}),
    ("dense", "block"): Contract(None, {}),
    ("dllm_cache", "masked"): Contract(
        dict(prompt_interval=1, response_interval=1),
        dict(prompt_interval=5, response_interval=3),  # rho 0.25: drift steps between refreshes
        why="every step refreshes prompt and response = dense; stale features between refreshes differ"),
    ("dyllm", "masked"): Contract(
        dict(tau=1.5, full_steps=1, full_period=1),
        dict(tau=0.5, full_steps=1, full_period=4),
        why="tau > 1 makes every row salient and full_period 1 feeds the whole canvas; tau 0.5 with "
            "response-only steps updates most rows approximately"),
    ("fast_dllm", "masked"): Contract(
        dict(refresh=1),
        dict(),  # the dual cache lives for the whole block; the canvas changes under it (2 layers)
        why="refresh = 1 forwards the canvas every step"),
    ("mage", "block"): Contract(dict(k=64, exact_layers=0), dict(k=1, exact_layers=0),
                                why="k >= every prefix selects the whole prefix"),
    ("sparsed", "block"): Contract(
        dict(k=64, exact_layers=0, exact_fraction=0.5), dict(k=1, exact_layers=0, exact_fraction=0.5),
        why="k >= every prefix; exact_fraction 0.5 captures at step 1 of 4 (not MAGE's step 0)"),
    ("quest", "block"): Contract(dict(k=64, page_size=2, exact_layers=0), dict(k=2, page_size=2, exact_layers=0),
                                 why="k >= every prefix rounded up to pages; k = one page of 2 keys"),
    ("maskkv", "masked"): Contract(
        dict(budget=64, prompt_interval=1, response_interval=1),
        dict(budget=2, prompt_interval=1, response_interval=1),
        why="budget >= both prompts keeps everything; with the cache exact only the budget differs"),
    ("snapkv", "masked"): Contract(
        dict(budget=64, window=1, prompt_interval=1, response_interval=1),
        dict(budget=2, window=1, prompt_interval=1, response_interval=1),
        why="as maskkv; window 1 so that budget 2 still chooses a token beyond the window"),
    ("momo", "masked"): Contract(
        dict(MOMO_GRID, k=64, canvas=True), dict(MOMO_GRID, k=1, canvas=True),
        why="canvas=True: every full canvas step attends through MOMO; k = 64 covers every key block"),
    ("momo", "block"): Contract(dict(MOMO_GRID, k=64), dict(MOMO_GRID, k=1),
                                why="the prompt's prefill attends through MOMO; k = 64 covers every key block"),
    # Sparse-dLLM has no knob that makes it equal dense without disabling it: it is Fast-dLLM's dual
    # cache (mode and refresh fixed by its constructor: the cache lives for the whole block), and a
    # delay >= the block's steps - 1 would leave no cached step at all. So ratio = 1 is checked against
    # fast_dllm mode="dual" with the same delay (its docstring's claim), and a tiny ratio must differ
    # from that, not merely from dense; test_dual_cache_at_full_ratio_equals_dense_on_a_one_layer_model
    # checks both against dense on a model where the dual cache is exact.
    ("sparse_dllm", "masked"): Contract(dict(ratio=1.0, delay=1), dict(ratio=0.1, delay=1), reference=DUAL_DELAY_1,
                                        why="ratio 1 keeps every key the dual cache keeps"),
}

# DiffusionGemma's loop: the block engine's knobs, selecting on its full layers (4 steps a canvas, as a block)
CONTRACT.update({(name, "gemma"): CONTRACT[name, "block"] for name in ("dense", "mage", "sparsed", "quest")})
CONTRACT["momo", "gemma"] = Contract(dict(MOMO_GRID, k=64), dict(MOMO_GRID, k=1),
                                     why="the prompt's encoder pass attends through MOMO on the full layers, scale 1")

PAIRS = [(name, engine) for name, cls in METHODS.items() for engine in cls.engines]
PAIR_IDS = [f"{name}-{engine}" for name, engine in PAIRS]
# (3) holds where a row's noise is its own: DiffusionGemma's loop draws each canvas's noise for the whole
# batch, as transformers' does, so its rows decode otherwise alone; (1) and (2) run its ragged PROMPTS.
ALONE_PAIRS = [pair for pair in PAIRS if pair[1] != "gemma"]
ALONE_IDS = [f"{name}-{engine}" for name, engine in ALONE_PAIRS]
METHOD_PAIRS = [pair for pair in PAIRS if pair[0] != "dense"]  # dense is (1)'s and (2)'s reference
METHOD_IDS = [f"{name}-{engine}" for name, engine in METHOD_PAIRS]


def contract(name: str, engine: str) -> Contract:
    if (name, engine) not in CONTRACT:
        pytest.fail(f"method {name!r} on the {engine} engine has no contract entry: add it to the contract "
                    f"table (CONTRACT in tests/test_contract.py) with its exact and its tiny-budget knobs")
    return CONTRACT[name, engine]


def decode(engine: str, name: str, knobs, prompts=PROMPTS, model=None) -> list[list[int]]:
    """Tokens `name` (a fresh object) decodes with `knobs` on the engine's tiny float64 model."""
    return run(engine, get_method(name, **dict(knobs)), prompts, model)


def run(engine: str, method, prompts=PROMPTS, model=None) -> list[list[int]]:
    """Tokens `method` decodes on the engine's tiny float64 model (or `model`)."""
    model = MODELS[engine] if model is None else model
    if engine == "masked":
        return masked.generate(model, prompts, GENS[engine], method).tokens
    if engine == "gemma":
        return gemma_loop.generate(model, prompts, GENS[engine], method, stop_ids=(), sampling=GEMMA_SAMPLING).tokens
    return block.generate(model, prompts, GENS[engine], method, stop_ids=()).tokens


def run_recording(engine: str, method, prompts=PROMPTS):
    """run's tokens, the logits of each of its steps and the blocks those steps were in."""
    logits, blocks, head = [], set(), method.logits

    def recorded(model, hidden, ctx):
        blocks.add(ctx.block)
        logits.append(head(model, hidden, ctx))
        return logits[-1]

    method.logits = recorded
    try:
        return run(engine, method, prompts), logits, blocks
    finally:
        del method.logits


@cache
def reference_tokens(engine: str, name: str, knob_items: tuple) -> list[list[int]]:
    return decode(engine, name, knob_items)


@cache
def alone_tokens(engine: str, name: str, prompt: tuple) -> list[int]:
    """What a fresh `name` at its tiny knobs decodes for `prompt` as a batch of one."""
    return decode(engine, name, contract(name, engine).tiny, [list(prompt)])[0]


@cache
def fresh_recording(engine: str, name: str):
    """run_recording of PROMPTS by a fresh `name` at its tiny knobs."""
    return run_recording(engine, get_method(name, **contract(name, engine).tiny))


def differing(a, b) -> int:
    return sum(x != y for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def test_the_contract_table_lists_exactly_the_registered_methods_and_engines():
    assert PAIRS, "no method registered"
    assert {engine for _, engine in PAIRS} <= {"masked", "block", "gemma"}
    missing = sorted(set(PAIRS) - set(CONTRACT))
    assert not missing, f"{missing}: add them to the contract table"
    stale = sorted(set(CONTRACT) - set(PAIRS))
    assert not stale, f"{stale} are in the contract table but not registered (or not on that engine)"


@pytest.mark.parametrize("name,engine", METHOD_PAIRS, ids=METHOD_IDS)
def test_full_budget_equals_dense(name, engine):
    entry = contract(name, engine)
    assert entry.full is not None, f"{name} needs exact knobs in the contract table"
    expected = reference_tokens(engine, *entry.reference)
    got = decode(engine, name, entry.full)
    assert differing(got, expected) == 0, \
        f"{name} {entry.full} ({entry.why}) vs {entry.reference[0]}: {got} != {expected}"


@pytest.mark.parametrize("name,engine", METHOD_PAIRS, ids=METHOD_IDS)
def test_tiny_budget_differs(name, engine):
    entry = contract(name, engine)
    got = decode(engine, name, entry.tiny)
    assert all(len(row) > 0 for row in got)
    assert differing(got, reference_tokens(engine, *entry.reference)) > 0, \
        f"{name} {entry.tiny} decodes exactly what {entry.reference[0]} does: the budget changed nothing"


@pytest.mark.parametrize("name,engine", ALONE_PAIRS, ids=ALONE_IDS)
def test_a_ragged_batch_equals_its_rows_run_alone(name, engine):
    entry = contract(name, engine)
    batched = decode(engine, name, entry.tiny)
    alone = [alone_tokens(engine, name, tuple(prompt)) for prompt in PROMPTS]
    for row, (got, expected) in enumerate(zip(batched, alone, strict=True)):
        assert got == expected, (f"row {row} (prompt of {len(PROMPTS[row])} tokens) in the batch: {got}, "
                                 f"alone: {expected}")


@pytest.mark.parametrize("name,engine", ALONE_PAIRS, ids=ALONE_IDS)
def test_a_row_between_a_longer_and_a_shorter_one_decodes_as_alone(name, engine):
    """Every row of BETWEEN (the shortest first, so row 0 is not the longest, and a row padded by 3,
    less than a block) decodes what it decodes alone at the tiny knobs."""
    batched = decode(engine, name, contract(name, engine).tiny, BETWEEN)
    for row, (prompt, got) in enumerate(zip(BETWEEN, batched, strict=True)):
        expected = alone_tokens(engine, name, tuple(prompt))
        assert got == expected, f"row {row} (prompt of {len(prompt)} tokens) in the batch: {got}, alone: {expected}"


@pytest.mark.parametrize("earlier", sorted(EARLIER))
@pytest.mark.parametrize("name,engine", PAIRS, ids=PAIR_IDS)
def test_a_method_reused_after_other_prompts_decodes_what_a_fresh_one_does(name, engine, earlier):
    """After decoding EARLIER[earlier], the same method object decodes PROMPTS at its tiny knobs as a
    new one does: the same tokens and, step by step, the same logits, over every block."""
    reused = get_method(name, **contract(name, engine).tiny)
    run(engine, reused, EARLIER[earlier])
    tokens, logits, blocks = run_recording(engine, reused)
    expected_tokens, expected_logits, expected_blocks = fresh_recording(engine, name)
    assert len(expected_blocks) >= 3, f"the generation spans blocks {sorted(expected_blocks)}: too few to carry state"
    assert blocks == expected_blocks and len(logits) == len(expected_logits)
    assert tokens == expected_tokens, f"reused after {earlier}: {tokens}, fresh: {expected_tokens}"
    for step, (got, expected) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0, msg=lambda text: f"step {step}: {text}")


@pytest.mark.parametrize("name,knobs,exact", [
    ("fast_dllm", dict(mode="dual"), True), ("fast_dllm", dict(mode="prefix"), True),
    ("sparse_dllm", dict(ratio=1.0, delay=1), True), ("sparse_dllm", dict(ratio=0.1, delay=1), False)],
    ids=["fast_dllm-dual", "fast_dllm-prefix", "sparse_dllm-ratio1", "sparse_dllm-ratio0.1"])
def test_dual_cache_at_full_ratio_equals_dense_on_a_one_layer_model(name, knobs, exact):
    """With one layer the K/V outside the block depend only on their own tokens and positions, which
    do not change while the block is denoised: the caches (refresh 0, so cached steps run) are exact,
    and Sparse-dLLM's ratio 1 equals dense itself; its tiny ratio still drops keys and differs."""
    one_layer = tiny_model("llada", n_layers=1)
    dense = decode("masked", "dense", {}, model=one_layer)
    assert (differing(decode("masked", name, knobs, model=one_layer), dense) == 0) == exact
