"""DiffusionGemma's decoding loop (nanodllm/gemma_loop.py) against transformers 5.24's generate() on
tests/fixtures/diffusion_gemma_tiny: generate.json holds what generate() made of two prompts longer than
the sliding window, 12 steps at most per canvas (eager attention and experts, whose logits nanodllm's
equal bit for bit): tokens, tokens per forward, and each step's temperature, accepted positions and stop
decisions, for a seeded run, a deterministic one, one with early stops and a stop token inside a canvas,
and a left-padded one (`PYTHONPATH=<transformers 5.24> python scripts/make_fixtures.py diffusion_gemma`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from nanodllm import gemma_loop
from nanodllm.config import GenerationConfig
from nanodllm.gemma_loop import GemmaSampling
from nanodllm.generation import generate
from nanodllm.loader import load_reference
from nanodllm.methods import get_method
from tests.device import DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FIXTURE = Path(__file__).parent / "fixtures" / "diffusion_gemma_tiny"
RUNS = json.loads((FIXTURE / "generate.json").read_text())
MODEL = load_reference(FIXTURE, dtype=torch.float32)
STEPS = 12
PAD = 0


def decode(run: dict, monkeypatch=None):
    """(result, trace) of nanodllm decoding `run` as transformers did: each step's temperature, accepted
    positions and stop decisions, recorded where the loop calls its units."""
    trace = {"temperatures": [], "accepted": [], "stops": []}
    if monkeypatch is not None:
        recorded = lambda unit, keep: lambda *args: keep(unit(*args))
        for name, keep in (("temperature", lambda t: trace["temperatures"].append(float(t)) or t),
                           ("accepted", lambda a: trace["accepted"].append(bits(a)) or a),
                           ("stopping", lambda s: trace["stops"].append(s[0].tolist()) or s)):
            monkeypatch.setattr(gemma_loop, name, recorded(getattr(gemma_loop, name), keep))
    knobs = {k: v for k, v in run["sampler"].items()}
    sampling = GemmaSampling(**knobs, sample=not run["deterministic"], seed=run["seed"])
    torch.manual_seed(run["seed"])
    result = generate(MODEL, run["prompts"], GenerationConfig(gen_length=run["canvases"] * 8, block_length=8,
                                                              steps=STEPS), stop_ids=run["stop_ids"], sampling=sampling)
    return result, trace


def bits(mask: torch.Tensor) -> list[str]:
    return ["".join(map(str, row)) for row in mask.int().tolist()]


def padded(tokens: list[int], width: int) -> list[int]:
    return tokens + [PAD] * (width - len(tokens))


# ------------------------------------------------------------------------------------------------
# against transformers


def test_the_runs_have_the_paths_the_parity_needs():
    early, sampled, ragged = RUNS["early_stop"], RUNS["sampled"], RUNS["ragged"]
    assert all(len(p) > MODEL.cfg.gemma.sliding_window for run in RUNS.values() if "prompts" in run
               for p in run["prompts"])
    assert early["finished"][1] == [True, False] and early["finished"][-1] == [True, False]  # stops a canvas apart
    assert len(early["temperatures"]) < early["canvases"] * STEPS  # canvases cut short by the stop rule
    assert any(sum(finished) == 1 for finished in sampled["finished"][:-1])  # a row done, the other not
    assert len({len(p) for p in ragged["prompts"]}) == 2


@pytest.mark.parametrize("name", ["sampled", "deterministic", "early_stop", "ragged"])
def test_generation_matches_transformers_token_for_token(name):
    run = RUNS[name]
    result, _ = decode(run)
    width = run["canvases"] * 8
    assert [padded(tokens, width) for tokens in result.tokens] == run["sequences"]
    for tokens, expected in zip(result.tokens, run["sequences"]):
        assert tokens[-1] in run["stop_ids"] or len(tokens) == width and not set(tokens) & set(run["stop_ids"])
    for row, (steps, expected) in enumerate(zip(result.steps_per_canvas, run["tokens_per_forward"])):
        real = sum(token != PAD for token in run["sequences"][row])  # transformers counts all but pads
        assert real / sum(steps) == pytest.approx(expected, rel=1e-6)
        assert result.tokens_per_forward[row] == len(result.tokens[row]) / sum(steps)


@pytest.mark.parametrize("name", ["sampled", "deterministic", "early_stop", "ragged"])
def test_the_tokens_outlast_float32_rounding(name, monkeypatch):
    """The parity above holds on any CPU: logits moved by 3e-5 (about what another CPU's float32 matmuls
    change) decode the same tokens, as the fixture's contracting self-conditioning keeps them."""
    head, generator = MODEL.head, torch.Generator().manual_seed(0)
    shaken = lambda *args: (lambda z: z + 3e-5 * (2 * torch.rand(z.shape, generator=generator) - 1))(head(*args))
    monkeypatch.setattr(MODEL, "head", shaken)
    result, _ = decode(RUNS[name])
    width = RUNS[name]["canvases"] * 8
    assert [padded(tokens, width) for tokens in result.tokens] == RUNS[name]["sequences"]


@pytest.mark.parametrize("name", ["sampled", "early_stop", "ragged"])
def test_each_step_of_the_sampler_matches_transformers(name, monkeypatch):
    """The temperature; the accepted positions and the stop decision of each row still denoising (a done
    row's are computed and dropped: transformers feeds it its last canvas again, nanodllm its new one)."""
    run = RUNS[name]
    _, trace = decode(run, monkeypatch)
    assert trace["temperatures"] == run["temperatures"]
    done = None
    for step, temperature in enumerate(run["temperatures"]):
        if temperature == run["temperatures"][0]:
            done = [False] * len(run["prompts"])  # a new canvas
        for key in ("accepted", "stops"):
            assert [got for got, d in zip(trace[key][step], done) if not d] == [
                expected for expected, d in zip(run[key][step], done) if not d], (key, step)
        done = [d or stop for d, stop in zip(done, run["stops"][step])]
    assert len(trace["stops"]) == len(run["stops"])


@pytest.mark.parametrize("threshold", ["0", "1", "2"])
def test_the_stop_rule_matches_transformers(threshold):
    rule = RUNS["stop_rule"]
    sampling = GemmaSampling(stability_threshold=int(threshold), confidence_threshold=6.0)
    history = torch.full((int(threshold), 2, 2), -1)
    entropies = torch.full((2, 2), float(torch.log(torch.tensor(256.0))))  # uniform: under 6
    for argmax, expected in zip(rule["argmax"], rule["stops"][threshold], strict=True):
        stop, history = gemma_loop.stopping(history, torch.tensor(argmax), entropies, sampling)
        assert stop.tolist() == expected


# ------------------------------------------------------------------------------------------------
# against a plain loop


@torch.no_grad()
def plain_argmax_loop(prompts, canvases: int, seed: int, sampling: GemmaSampling) -> list[list[int]]:
    """The deterministic mode spelled out: argmax tokens, noise from one seeded generator, positions
    accepted lowest entropy first while the entropies before them sum to at most the bound, a row done
    once its argmax canvas repeats (stability 1; 0: at once) with a mean entropy under the threshold."""
    generator = torch.Generator().manual_seed(seed)
    batch, vocab = len(prompts), MODEL.cfg.vocab_size
    cache = MODEL.empty_cache(batch)
    MODEL.encode(torch.tensor(prompts), cache)
    generated = [[] for _ in prompts]
    for _ in range(canvases):
        x = torch.randint(0, vocab, (batch, 8), generator=generator)
        logits, previous, done, committed = None, None, [False] * batch, [None] * batch
        for left in range(STEPS, 0, -1):
            temperature = sampling.t_min + (sampling.t_max - sampling.t_min) * torch.tensor(left / STEPS)
            z = MODEL.denoise(x, cache, logits) / temperature
            entropy = torch.distributions.Categorical(logits=z).entropy()
            noise = torch.randint(0, vocab, (batch, 8), generator=generator)
            for row in range(batch):
                before = torch.tensor(0.0)
                for position in entropy[row].argsort().tolist():
                    if before > sampling.entropy_bound:
                        x[row, position] = noise[row, position]
                    else:
                        x[row, position] = z[row, position].softmax(-1).argmax()
                    before = before + entropy[row, position]
                argmax = z[row].argmax(-1)
                if not done[row]:
                    committed[row] = argmax
                    repeated = sampling.stability_threshold == 0 or previous is not None and torch.equal(
                        argmax, previous[row])
                    done[row] = repeated and entropy[row].mean() < sampling.confidence_threshold
            previous, logits = z.argmax(-1), z
            if all(done):
                break
        cache_input = torch.stack(committed)
        MODEL.encode(cache_input, cache)
        for row in range(batch):
            generated[row] += cache_input[row].tolist()
    return generated


@pytest.mark.parametrize("knobs", [{}, {"stability_threshold": 0, "confidence_threshold": 0.6}])
def test_the_deterministic_mode_equals_a_plain_argmax_loop(knobs):
    sampling = GemmaSampling(**knobs, sample=False, seed=7)
    prompts = RUNS["sampled"]["prompts"]
    result = generate(MODEL, prompts, GenerationConfig(gen_length=24, block_length=8, steps=STEPS), stop_ids=(),
                      sampling=sampling)
    assert result.tokens == plain_argmax_loop(prompts, 3, 7, sampling)
    assert (max(map(sum, result.steps_per_canvas)) < 3 * STEPS) == bool(knobs)


@pytest.mark.parametrize("threshold", [0, 1, 2])
def test_a_canvas_ends_no_sooner_than_its_argmax_has_held_for_the_stability_threshold(threshold):
    """Every step confident (a threshold above log 256): a canvas ends at its first step with stability 0,
    after at least 1 + threshold steps else (the argmax canvas equal to the last `threshold` ones)."""
    sampling = GemmaSampling(stability_threshold=threshold, confidence_threshold=6.0, sample=False, seed=7)
    result = generate(MODEL, RUNS["sampled"]["prompts"], GenerationConfig(gen_length=16, block_length=8, steps=4),
                      stop_ids=(), sampling=sampling)
    steps = [n for row in result.steps_per_canvas for n in row]
    assert all(n == 1 for n in steps) if threshold == 0 else all(n >= 1 + threshold for n in steps)


def test_a_length_between_canvases_decodes_the_canvas_it_reaches_into():
    """gen_length 12 of canvases of 8: two whole canvases, the tokens a length of 16 decodes."""
    sampling = GemmaSampling(sample=False, seed=3)
    prompts = RUNS["sampled"]["prompts"]
    run = lambda length: generate(MODEL, prompts, GenerationConfig(gen_length=length, block_length=8, steps=2),
                                  stop_ids=(), sampling=sampling)
    result = run(12)
    assert [len(tokens) for tokens in result.tokens] == [16, 16] and len(result.steps_per_canvas[0]) == 2
    assert result.tokens == run(16).tokens


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("name, knobs, match", [
    ("maskkv", {}, "'maskkv'.*MASK.*diffusion_gemma"), ("dyllm", {}, "'dyllm'.*MASK"),
    ("fast_dllm", {}, "'fast_dllm' runs on the masked engine .*MASK.*; this diffusion_gemma model .* gemma engine"),
    ("mage", {"sparse_commit": True}, "mage: sparse_commit.*encoder pass")])
def test_a_method_without_a_diffusion_gemma_meaning_is_refused_by_name(name, knobs, match):
    gen = GenerationConfig(gen_length=8, block_length=8, steps=2)
    with pytest.raises(ValueError, match=match) as excinfo:
        generate(MODEL, [[5, 6, 7]], gen, get_method(name, **knobs))
    assert len(str(excinfo.value).splitlines()) == 1


@pytest.mark.parametrize("knobs, match", [({"t_min": 0.8, "t_max": 0.4}, "t_max"), ({"entropy_bound": 0}, "entropy"),
                                          ({"stability_threshold": -1}, "stability")])
def test_bad_knobs_are_refused_in_one_line(knobs, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        GemmaSampling(**knobs)
    assert len(str(excinfo.value).splitlines()) == 1
    with pytest.raises(ValueError, match="temperature"):
        generate(MODEL, [[5, 6, 7]], GenerationConfig(gen_length=8, block_length=8, steps=2, temperature=0.5))
    with pytest.raises(ValueError, match="block_length"):
        generate(MODEL, [[5, 6, 7]], GenerationConfig(gen_length=8, block_length=4, steps=2))


SPARSE = [("mage", {"k": 4}), ("sparsed", {"k": 4, "exact_fraction": 0.5}), ("quest", {"k": 4, "page_size": 2})]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name, knobs", [("dense", {})] + SPARSE)
def test_replayed_steps_decode_what_eager_steps_decode(name, knobs, monkeypatch):
    """On a GPU (bfloat16) a step of a kind recorded before, in its canvas or an earlier one, replays a CUDA
    graph: the same tokens and steps per canvas as eager steps, in ragged batches over several canvases
    (the second's prompts long enough that graphs outlive a commit), dense and sparse."""
    from nanodllm.loader import load_model

    model, run = load_model(FIXTURE, "cuda", torch.bfloat16), RUNS["ragged"]
    long_prompts = [list(range(3, 123)), list(range(40, 152))]
    for prompts, canvases in ((run["prompts"], run["canvases"]), (long_prompts, 3)):
        gen = GenerationConfig(gen_length=canvases * 8, block_length=8, steps=STEPS)
        decode_here = lambda: generate(model, prompts, gen, get_method(name, **knobs), stop_ids=run["stop_ids"],
                                       sampling=GemmaSampling(**run["sampler"], sample=False, seed=run["seed"]))
        monkeypatch.setattr(gemma_loop, "GRAPHS_ENABLED", True)
        replayed = decode_here()
        monkeypatch.setattr(gemma_loop, "GRAPHS_ENABLED", False)
        eager = decode_here()
        assert replayed.replays > 0 and eager.replays == 0
        assert (replayed.tokens, replayed.steps_per_canvas) == (eager.tokens, eager.steps_per_canvas)


@contextlib.contextmanager
def no_host_reads():
    """Inside, a tensor asked for a number on the host raises: a CUDA graph replays a step without its
    Python, so a recorded step may not branch on, or size anything by, a device value."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    own = {name: torch.Tensor.__dict__.get(name) for name in names}

    def refused(name):
        def refuse(self, *args, **kwargs):
            raise AssertionError(f"a recorded step asked a tensor for a host number ({name})")
        return refuse

    for name in names:
        setattr(torch.Tensor, name, refused(name))
    try:
        yield
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


class Recorder:
    """graphs.Recordings on the CPU: a step handed to it runs now, its method's attention barred from host
    reads (no_host_reads); the keys are kept, a key seen before counted as a replay."""

    def __init__(self, size: int = 1):
        self.keys, self.replays, self.running = [], 0, False

    def __contains__(self, key) -> bool:
        return key in self.keys

    def __call__(self, key, fn, *inputs):
        self.replays += key in self.keys
        self.keys.append(key)
        self.running = True
        try:
            return fn(*inputs)
        finally:
            self.running = False


@torch.no_grad()  # the kernels run outside autograd
@pytest.mark.parametrize("name, knobs", [("dense", {})] + SPARSE)
def test_the_steps_a_gpu_replays_read_no_host_number(name, knobs, kernels_on, monkeypatch):
    """The steps the loop would record on a GPU (exact steps, a canvas's first included, and the repeats of a
    method's kind: MAGE's and SparseD's sparse steps, never a selecting one) and its commits (the encoder's
    pass over a canvas: the full layers in two parts, the windows' new tokens) with full layers of head_dim 256,
    which the decode kernels do not take (on a CPU in Triton's interpreter): their attention asks the host
    nothing, so a graph of a step replays in later canvases while its launch lasts (dense: a ragged batch
    over four canvases, whose steps' and commits' launches last; a method's two canvases, where the launch
    bound its attention is sized by moves). (That replays decode what eager steps decode is the GPU test's.)"""
    import copy

    from nanodllm.config import ModelConfig
    from nanodllm.gemma import DiffusionGemma
    from nanodllm.loader import build_random

    raw = json.loads((FIXTURE / "config.json").read_text())
    raw = copy.deepcopy(raw)
    raw["text_config"]["global_head_dim"] = 256
    torch.manual_seed(0)
    model = build_random(ModelConfig.from_dict(raw, source="test"), device=DEVICE, dtype=torch.float16)
    long = name == "dense"
    prompts = [list(range(3, 123)), list(range(40, 152))] if long else [list(range(3, 27)), list(range(40, 58))]
    gen = GenerationConfig(gen_length=32 if long else 16, block_length=8, steps=2 if long else 6)
    sampling = GemmaSampling(sample=False, seed=0, confidence_threshold=1e-9)  # every step runs

    recorder, method = Recorder(), get_method(name, **knobs)

    def checked(attend):
        def attend_checked(*args, **kwargs):
            with no_host_reads() if recorder.running else contextlib.nullcontext():
                return attend(*args, **kwargs)
        return attend_checked

    monkeypatch.setattr(method, "attend", checked(method.attend))
    monkeypatch.setattr(DiffusionGemma, "attend_denoising", staticmethod(checked(DiffusionGemma.attend_denoising)))
    monkeypatch.setattr(DiffusionGemma, "attend_encoding", checked(DiffusionGemma.attend_encoding))
    monkeypatch.setattr(gemma_loop, "remembering", lambda model, method, copy_outputs: recorder)
    monkeypatch.setattr(gemma_loop, "GRAPHS_ENABLED", True)
    monkeypatch.setattr(DiffusionGemma, "replayable", property(lambda self: True))
    generate(model, prompts, gen, method, stop_ids=(), sampling=sampling)
    steps = [key for key in recorder.keys if key[0] != "commit"]
    commits = [key for key in recorder.keys if key[0] == "commit"]  # one after each canvas but the last
    expected = {"dense": {()}, "mage": {("sparse",)}, "sparsed": {("exact",), ("sparse",)}, "quest": {()}}[name]
    assert recorder.replays > 0 and {key[0] for key in steps} == expected and len(commits) == gen.gen_length // 8 - 1
    first_steps = [key for key in steps if key[1]]  # one a canvas, where recorded
    assert not long or (len(set(first_steps)) < len(first_steps) == 4 and len(set(commits)) < len(commits))
    # a method's steps are keyed on the launch bound its attention is sized by, which the commit moved here
    assert long or len({key[-1] for key in steps}) == 2


@torch.no_grad()  # the kernels run outside autograd
def test_the_sampler_reads_the_logits_on_the_kernel(kernels_on, monkeypatch):
    """Where the model runs on the kernels the sampler's statistics come from kernels/softmax_stats.py
    (in Triton's interpreter here, float16): the fixture's ragged prompts decode the same tokens as with
    the torch form, a canvas of two steps, sampled."""
    from nanodllm.kernels.softmax_stats import softmax_stats, softmax_stats_reference
    from nanodllm.loader import load_model

    model, run = load_model(FIXTURE, DEVICE, torch.float16), RUNS["ragged"]
    gen = GenerationConfig(gen_length=8, block_length=8, steps=2)
    calls = []
    spy = lambda *args, **kwargs: calls.append(1) or softmax_stats(*args, **kwargs)

    def decode_with(stats):
        monkeypatch.setattr(gemma_loop, "softmax_stats", stats)
        torch.manual_seed(run["seed"])
        result = generate(model, run["prompts"], gen, stop_ids=(), sampling=GemmaSampling(**run["sampler"]))
        return result.tokens, result.steps_per_canvas

    assert decode_with(spy) == decode_with(softmax_stats_reference) and len(calls) == 2


def test_a_canvas_is_confident_by_its_mean_entropy():
    """The stop rule reads the mean of the canvas's entropies: a mean of 0.004 is under the threshold of 0.005
    though one position's entropy (0.007) is not; a mean of 0.006 is not."""
    sampling = GemmaSampling(stability_threshold=0, confidence_threshold=0.005)
    entropies = torch.tensor([[0.001, 0.007], [0.005, 0.007]])
    stop, _ = gemma_loop.stopping(torch.full((0, 2, 2), -1), torch.zeros(2, 2, dtype=torch.long), entropies, sampling)
    assert stop.tolist() == [True, False]
