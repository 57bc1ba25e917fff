"""Steps replayed from CUDA graphs (nanodllm/graphs.py): which steps share a recording (a method's
step_kind and the engine's shapes), the recordings' bookkeeping and replays on a CPU through a stand-in
graph (FakeGraph), and, on a GPU, that graphed generation equals eager generation."""

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

import nanodllm.graphs as graphs_module
from nanodllm.cache import KVCache
from nanodllm.generation import generate
from nanodllm.graphs import Recordings, Replayed, recordable, step_key
from nanodllm.kernels.tuning import MeasuringWhileRecording, Tuner
from nanodllm.methods import get_method
from nanodllm.methods.base import Method, StepContext


def block_context(cache, block_index, step, steps=8, size=4, phase="step"):
    tokens = torch.zeros(1, size, dtype=torch.long)
    positions = torch.arange(size)[None] + cache.max_length
    return StepContext(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), torch.tensor([3]),
                       block=block_index, step=step, steps_per_block=steps, cache=cache, block_length=size,
                       phase=phase)


def key(method, ctx):
    """The recording ctx's step would replay (None: it runs eagerly), the device checks aside."""
    ctx = replace(ctx, kind=method.step_kind(ctx))
    return None if ctx.kind is None else step_key(ctx)


def test_step_kinds_say_which_steps_share_a_recording():
    cache = KVCache(2, 1, 256, 2, 8, "cpu", torch.float32)
    cache.advance(torch.tensor([101]))
    dense, mage, sparsed = get_method("dense"), get_method("mage", k=4), get_method("sparsed", k=4)
    keys = [key(dense, block_context(cache, 1, step)) for step in range(8)]
    assert len(set(keys)) == 1 and keys[0] is not None  # every step of a block: one recording
    assert key(dense, block_context(cache, 1, 7, phase="commit")) not in keys  # the commit has its own
    select = key(mage, block_context(cache, 1, 0))  # the selecting step: a recording of its own
    assert len({key(mage, block_context(cache, 1, step)) for step in range(1, 8)} | {select}) == 2
    capture = sparsed.capture_step(block_context(cache, 1, 0))
    assert capture == 1  # 20% of 8 steps: steps 0 and 1 exact, selection at 1
    exact, selecting = key(sparsed, block_context(cache, 1, 0)), key(sparsed, block_context(cache, 1, 1))
    assert len({exact, selecting, key(sparsed, block_context(cache, 1, 2))}) == 3
    # a commit's step is the steps its block took: with sparse_commit it reads the selection (a kind of its
    # own) only if the block reached its capture step
    committing = get_method("sparsed", k=4, sparse_commit=True)
    commits = [key(committing, block_context(cache, 1, steps, phase="commit")) for steps in (1, 2, 8)]
    assert commits[0] == key(sparsed, block_context(cache, 1, 8, phase="commit")) and commits[1] == commits[2]
    assert len(set(commits)) == 2
    # ... the next blocks replay the same recordings while the launch bound (101 + 4 -> 112) holds ...
    launch = cache.launch_length(4)
    assert launch == 112
    cache.advance(torch.tensor([4]))
    assert cache.launch_length(4) == launch and key(dense, block_context(cache, 2, 0)) == keys[0]
    assert key(sparsed, block_context(cache, 2, 0)) == exact
    assert key(committing, block_context(cache, 2, 8, phase="commit")) == commits[2]
    # ... and record new ones when it moves
    cache.advance(torch.tensor([8]))
    assert cache.launch_length(4) == 120 and key(dense, block_context(cache, 4, 0)) != keys[0]


def test_with_an_empty_cache_every_step_is_exact_and_of_its_own_recording():
    """No prefix to select from (a prompt shorter than one block, so its first block has an empty
    cache): MAGE's and SparseD's steps and commits are all exact, one recording for every step, not
    the one of a step with a prefix whose launch bound is the same."""
    empty, cached = (KVCache(2, 1, 256, 2, 8, "cpu", torch.float32) for _ in range(2))
    cached.advance(torch.tensor([1]))
    assert empty.launch_length(17) == cached.launch_length(17) == 18  # blocks of 17: both bounds round to 18
    context = lambda cache, step, phase="step": block_context(cache, 0, step, size=17, phase=phase)
    for method in (get_method("mage", k=4), get_method("sparsed", k=4, sparse_commit=True)):
        assert {method.step_kind(context(empty, step)) for step in range(8)} == {("exact",)}
        assert method.step_kind(context(empty, 8, "commit")) == ("exact",)
        assert len({key(method, context(empty, step)) for step in range(8)}) == 1
        assert key(method, context(empty, 0)) not in {key(method, context(cached, step)) for step in range(8)}


def test_launch_length_is_a_close_upper_bound_that_moves_rarely():
    cache = KVCache(1, 1, 1 << 20, 1, 8, "cpu", torch.float32)
    bounds = []
    for n in range(1, 70000, 37):
        cache.host_lengths = [n]
        bound = cache.launch_length(32)
        assert n + 32 <= bound <= max((n + 32) * 1.125, n + 32)
        bounds.append(bound)
    assert len(set(bounds)) < 110  # a few per doubling, not one per block
    cache = KVCache(1, 1, 1000, 1, 8, "cpu", torch.float32)
    cache.host_lengths = [960]
    assert cache.launch_length(32) == 1000  # capped at the capacity


def test_no_graphs_on_the_cpu_nor_for_the_dense_canvas():
    cache = KVCache(2, 1, 32, 2, 8, "cpu", torch.bfloat16)
    assert not recordable(block_context(cache, 0, 0))
    masked_engine = replace(block_context(cache, 0, 0), cache=None)
    assert get_method("dense").step_kind(masked_engine) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.parametrize("copy_outputs", [True, False])
def test_a_replay_gives_its_inputs_result_copied_out_or_in_place(copy_outputs):
    """Each call gives fn of its own inputs; copied out, a result outlives later replays, else a replay hands
    back the recording's own tensor, which the next replay overwrites."""
    recordings, fn = Recordings(size=1, copy_outputs=copy_outputs), lambda x: x * 2 + 1
    inputs = [torch.full((4,), float(i), device="cuda") for i in range(4)]
    results = [recordings("key", fn, x) for x in inputs]
    assert recordings.replays == 3
    for i, result in enumerate(results[1:-1], 1):
        expected = fn(inputs[-1] if not copy_outputs else inputs[i])
        assert torch.equal(result, expected)
    assert torch.equal(results[-1], fn(inputs[-1])) and torch.equal(results[0], fn(inputs[0]))
    assert (results[1].data_ptr() == results[2].data_ptr()) != copy_outputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # a recording the tuner stopped before any kernel
def test_a_recording_that_would_measure_a_setting_runs_first_and_the_gpu_carries_on():
    """A key taken as run before whose kernel still has a launch setting to measure is not recorded at
    once: the tuner refuses to measure while recording, the step runs eagerly (measuring) and is recorded
    after, and the other keys record and replay in the same pool."""
    tuner, scales = Tuner("graphs test"), [{"scale": 3.0}, {"scale": 3.0, "shift": 0.0}]

    def tuned(x):  # x * 3 - 1, its setting chosen by the tuner
        launch = lambda setting: x * setting["scale"] - 1
        return launch(tuner.choose(("key",), scales, launch, x.device))

    recordings, affine_gpu = Recordings(size=2, ran={((), "b")}), lambda x: x * 2 + 1
    inputs = [torch.full((4,), float(i), device="cuda") for i in range(6)]
    assert torch.equal(recordings("a", affine_gpu, inputs[0]), affine_gpu(inputs[0]))
    assert torch.equal(recordings("b", tuned, inputs[1]), inputs[1] * 3 - 1) and tuner.measured == 1
    assert "a" in recordings and "b" in recordings and recordings.replays == 0
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(recordings("c", affine_gpu, inputs[2]), affine_gpu(inputs[2]))
    for key, fn, x in [("b", tuned, inputs[3]), ("c", affine_gpu, inputs[4]), ("b", tuned, inputs[5])]:
        assert torch.equal(recordings(key, fn, x), fn(x))
    assert recordings.replays == 3 and tuner.measured == 1
    with pytest.raises(MeasuringWhileRecording), torch.cuda.graph(torch.cuda.CUDAGraph()):
        tuner.choose(("a key not measured",), scales, lambda setting: inputs[0] * 2, inputs[0].device)


def assert_graphed_equals_eager(monkeypatch, name, knobs, decode):
    """decode(method) -> GenerationResults (nanodllm.generation.generate's), run with a fresh method
    eagerly and then with graphs: the same tokens, the same stats of each generation, and the graphed
    run replayed recordings."""
    runs = {}
    for graphed in (False, True):
        monkeypatch.setattr(graphs_module, "GRAPHS_ENABLED", graphed)
        results = decode(get_method(name, **knobs))
        runs[graphed] = ([r.tokens for r in results], [r.stats for r in results], sum(r.replays for r in results))
    assert runs[True][0] == runs[False][0]
    for graphed_stats, eager_stats in zip(runs[True][1], runs[False][1], strict=True):
        assert eager_stats and graphed_stats.keys() == eager_stats.keys()
        for stat, value in eager_stats.items():
            assert graphed_stats[stat] == pytest.approx(value), stat
    assert runs[False][2] == 0 and runs[True][2] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.parametrize("name, knobs", [("dense", {}), ("mage", {"k": 64}), ("quest", {"k": 64}),
                                         ("sparsed", {"k": 64}), ("mage", {"k": 64, "sparse_commit": True}),
                                         ("quest", {"k": 64, "sparse_commit": True})])
def test_graphed_generation_equals_eager(monkeypatch, name, knobs):
    from nanodllm import tasks
    from nanodllm.eval import Runner, resolve_model

    runner = Runner(resolve_model("tiny-sdar"), "cuda", torch.bfloat16, None)
    samples = tasks.make_samples("passkey", 1024, 2, seed=3, count_tokens=runner.count_tokens)
    prompts = [runner.tokenizer.chat([{"role": "user", "content": s.prompt}]) for s in samples]
    prompts[1] = prompts[1][:-37]  # a ragged batch: rows at different cache lengths
    assert_graphed_equals_eager(monkeypatch, name, knobs, lambda method: [generate(
        runner.model, prompts, runner.gen, method, stop_ids=())])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.parametrize("name, knobs", [("dense", {}), ("mage", {"k": 16, "exact_layers": 0}),
                                         ("sparsed", {"k": 16, "exact_layers": 0})])
def test_graphed_fast_dllm_v2_equals_eager(monkeypatch, name, knobs):
    """Fast-dLLM v2's loop (sub-blocks, threshold decoding) calls the same step: graphed equals eager."""
    from nanodllm.config import GenerationConfig, ModelConfig
    from nanodllm.loader import build_random
    from tests.tiny_models import random_prompt

    cfg = ModelConfig.from_dict(dict(model_type="Fast_dLLM_Qwen", hidden_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                     vocab_size=256, mask_token_id=250, bos_token_id=251, eos_token_id=251,
                                     bd_size=8, max_position_embeddings=4096, rms_norm_eps=1e-6))
    model = build_random(cfg, device="cuda", dtype=torch.bfloat16, seed=3)
    prompts = [random_prompt(70, seed=1), random_prompt(45, seed=2)]
    gen = GenerationConfig(gen_length=32, block_length=8, steps=8, threshold=0.9)
    assert_graphed_equals_eager(monkeypatch, name, knobs, lambda method: [generate(
        model, prompts, gen, method, stop_ids=())])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.parametrize("name, knobs", [("dense", {}), ("mage", {"k": 16, "exact_layers": 0}),
                                         ("quest", {"k": 16, "page_size": 4, "exact_layers": 0}),
                                         ("sparsed", {"k": 16, "exact_layers": 0, "sparse_commit": True})])
def test_graphed_short_prompt_and_reused_method_equal_eager(monkeypatch, name, knobs):
    """A prompt shorter than one block (the first block's cache is empty for that row, and, alone, for
    the whole batch), and one method object running two generations: graphed equals eager."""
    from nanodllm.config import GenerationConfig, ModelConfig
    from nanodllm.loader import build_random
    from tests.tiny_models import random_prompt

    cfg = ModelConfig.from_dict(dict(model_type="sdar", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=256,
                                     mask_token_id=250, block_size=8, max_position_embeddings=4096))
    model = build_random(cfg, device="cuda", dtype=torch.bfloat16, seed=5)
    batches = [[random_prompt(5, seed=1)], [random_prompt(5, seed=2), random_prompt(45, seed=3)]]
    gen = GenerationConfig(gen_length=32, block_length=8, steps=8)
    assert_graphed_equals_eager(monkeypatch, name, knobs, lambda method: [
        generate(model, prompts, gen, method, stop_ids=()) for prompts in batches])


def without_sync_checks(fn):
    """fn, run with torch's sync debug mode off and then set back as it was."""
    def run(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return run


def watch_blocks(monkeypatch, method, watched):
    """Raise at any call that waits for the GPU from the begin of each block b with watched(b) on, until
    the next begin or commit (recording a graph aside)."""
    def watched_begin(ctx):
        begin(ctx)
        torch.cuda.set_sync_debug_mode("error" if watched(ctx.block) else "default")

    def unwatched_commit(model, ctx):
        torch.cuda.set_sync_debug_mode("default")
        return commit(model, ctx)

    begin, commit = method.begin_block, method.commit
    monkeypatch.setattr(method, "begin_block", watched_begin)
    monkeypatch.setattr(method, "commit", unwatched_commit)
    monkeypatch.setattr(graphs_module.Recordings, "capture", without_sync_checks(graphs_module.Recordings.capture))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's syncs; run on a GPU machine")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
@pytest.mark.parametrize("name, knobs", [("dense", {}), ("mage", {"k": 16, "exact_layers": 0}),
                                         ("quest", {"k": 16, "page_size": 4, "exact_layers": 0}),
                                         ("sparsed", {"k": 16, "exact_layers": 0})])
def test_the_block_engines_steps_never_wait_for_the_device(monkeypatch, name, knobs):
    """From the second block on, a block's steps (the replayed forward, the sampler, the choice of what to
    unmask) make no call that waits for the GPU, so the host queues each step while the last one runs:
    torch's sync debug mode raises at one from a block's begin to its commit (recording a graph aside). A
    ragged batch, no threshold (a threshold's stop asks the device each step, as the references do)."""
    from nanodllm.config import GenerationConfig, ModelConfig
    from nanodllm.loader import build_random
    from tests.tiny_models import random_prompt

    cfg = ModelConfig.from_dict(dict(model_type="sdar", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=256,
                                     mask_token_id=250, block_size=8, max_position_embeddings=4096))
    model = build_random(cfg, device="cuda", dtype=torch.bfloat16, seed=5)
    method = get_method(name, **knobs)
    watch_blocks(monkeypatch, method, lambda block: block > 0)
    try:
        result = generate(model, [random_prompt(45, seed=1), random_prompt(30, seed=2)],
                          GenerationConfig(gen_length=32, block_length=8, steps=8), method, stop_ids=())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.replays > 0 and all(len(tokens) >= 32 for tokens in result.tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's syncs; run on a GPU machine")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
@pytest.mark.parametrize("name, knobs", [("dense", {}), ("maskkv", {"budget": 16}),
                                         ("snapkv", {"budget": 16, "window": 2}), ("dllm_cache", {})])
def test_the_masked_engines_steps_never_wait_for_the_device(monkeypatch, name, knobs):
    """The masked engine's blocks after the first and before the last (their steps, the sampler, the
    choice by the host's schedule) make no call that waits for the GPU. A ragged batch, no threshold.
    Fast-dLLM's cache and DyLLM's salient rows are sized on the host (once a block, once a step)."""
    from nanodllm.config import GenerationConfig, ModelConfig
    from nanodllm.loader import build_random
    from tests.tiny_models import random_prompt

    cfg = ModelConfig.from_dict(dict(model_type="llada", d_model=256, n_layers=2, n_heads=4, n_kv_heads=4,
                                     mlp_hidden_size=512, vocab_size=256, mask_token_id=250, eos_token_id=251,
                                     max_sequence_length=4096))
    model = build_random(cfg, device="cuda", dtype=torch.bfloat16, seed=5)
    method = get_method(name, **knobs)
    watch_blocks(monkeypatch, method, lambda block: 0 < block < 3)  # the last block's end reads the tokens
    try:
        result = generate(model, [random_prompt(45, seed=1), random_prompt(30, seed=2)],
                          GenerationConfig(gen_length=32, block_length=8, steps=32), method)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(tokens) == 32 for tokens in result.tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs; run on a GPU machine")
@pytest.mark.parametrize("name, knobs", [("dllm_cache", {"prompt_interval": 5, "response_interval": 3}),
                                         ("maskkv", {"budget": 16, "prompt_interval": 5, "response_interval": 3}),
                                         ("snapkv", {"budget": 16, "prompt_interval": 5, "response_interval": 3}),
                                         ("fast_dllm", {}), ("fast_dllm", {"mode": "prefix"}), ("sparse_dllm", {}),
                                         ("dyllm", {"salient_cap": 0.5, "full_steps": 2}),
                                         ("dyllm", {"salient_fraction": 0.25, "full_steps": 2, "full_period": 3})])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_graphed_masked_engine_methods_equal_eager(monkeypatch, name, knobs, model_type):
    """The masked engine's cached methods (LLaDA's loop, and Dream's, whose shifted logits read a row
    kept from an earlier step), a ragged batch and a reused method object: graphed equals eager."""
    from nanodllm.config import GenerationConfig, ModelConfig
    from nanodllm.loader import build_random
    from tests.tiny_models import random_prompt

    shape = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=256, mask_token_id=250, eos_token_id=251,
                 max_position_embeddings=4096)
    if model_type == "llada":
        shape = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=512, vocab_size=256,
                     mask_token_id=250, eos_token_id=251, max_sequence_length=4096)
    model = build_random(ModelConfig.from_dict(dict(shape, model_type=model_type)), device="cuda",
                         dtype=torch.bfloat16, seed=7)
    batches = [[random_prompt(70, seed=1), random_prompt(45, seed=2)], [random_prompt(60, seed=3)]]
    gen = GenerationConfig(gen_length=32, block_length=32 if model_type == "Dream" else 8, steps=32)
    assert_graphed_equals_eager(monkeypatch, name, knobs, lambda method: [
        generate(model, prompts, gen, method) for prompts in batches])


class FakeGraph:
    """A CUDA graph's contract on the CPU: the kernels launched while it records are kept, not run, each
    bound to the tensors it reads and writes, and a replay runs them again on those same tensors."""

    recording = None

    def __init__(self):
        self.kernels = []

    def replay(self):
        for kernel in self.kernels:
            kernel()


@contextmanager
def fake_capture(graph, pool=None):
    FakeGraph.recording = graph
    try:
        yield
    finally:
        FakeGraph.recording = None


def launch(kernel):
    """kernel() writes its outputs in place: kept by the graph that records, else run now."""
    if FakeGraph.recording is not None:
        FakeGraph.recording.kernels.append(kernel)
    else:
        kernel()


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)


def affine(x):
    """2x + 1 as one launched kernel."""
    out = torch.empty_like(x)
    launch(lambda: torch.add(x * 2, 1, out=out))
    return out


def counted(fn, eager_runs: list):
    """fn, appending its inputs to eager_runs where it runs now (not while a graph records)."""
    def run(*inputs):
        if FakeGraph.recording is None:
            eager_runs.append(inputs)
        return fn(*inputs)
    return run


def test_recordings_keep_the_most_recently_used_keys_and_each_call_gets_its_own_result(fake_graphs):
    """Up to `size` recordings live; a new key evicts the least recently used one (a replay makes its key
    the most recently used), and an evicted key is recorded again without running eagerly; every call,
    recorded or replayed, gives fn of its own inputs, copied out so that later replays leave it be;
    without the copy a replay gives the recording's own tensor."""
    recordings, used, eager = Recordings(size=2), [], []  # used: the live keys, least recently used first
    calls = ["a", "b", "a", "c", "a", "b", "c", "c", "b"]
    inputs = [torch.full((3,), float(i)) for i in range(len(calls))]
    results = []
    for i, (key, x) in enumerate(zip(calls, inputs)):
        before, seen = recordings.replays, key in calls[:i]
        results.append(recordings(key, counted(affine, eager), x))
        assert recordings.replays == before + seen and len(eager) == len(set(calls[: i + 1]))
        used = [k for k in used if k != key] + [key]
        used = used[-2:]
        assert {k for k in "abc" if k in recordings} == set(used)
    assert recordings.replays == 6
    for x, result in zip(inputs, results):
        assert torch.equal(result, x * 2 + 1)
    in_place = Recordings(size=1, copy_outputs=False)
    first, second, third = (in_place("key", affine, x) for x in inputs[:3])
    assert torch.equal(first, inputs[0] * 2 + 1) and second is third and torch.equal(third, inputs[2] * 2 + 1)


def test_a_key_that_ran_before_is_recorded_at_once_and_a_failed_recording_runs_it_first(fake_graphs):
    """Recordings sharing `ran` remember the keys that ran eagerly under their scope: a later Recordings of
    that scope records such a key without running it and replays it for the call's result; another scope
    runs it first. Where that recording fails (a kernel still to tune waits for the device), the call runs
    eagerly and records after, and its result is fn's all the same."""
    ran, eager = set(), []
    x, y, z = (torch.full((3,), float(i)) for i in (1, 2, 3))
    first = Recordings(size=2, ran=ran, scope="model")
    assert torch.equal(first("a", counted(affine, eager), x), x * 2 + 1) and len(eager) == 1
    later = Recordings(size=2, ran=ran, scope="model")
    assert torch.equal(later("a", counted(affine, eager), y), y * 2 + 1)
    assert len(eager) == 1 and later.replays == 1 and "a" in later
    other = Recordings(size=2, ran=ran, scope="other model")
    assert torch.equal(other("a", counted(affine, eager), z), z * 2 + 1) and len(eager) == 2 and other.replays == 0

    tuned = []

    def tuning(x):  # a launch setting to measure, while recording, until it has run once
        if FakeGraph.recording is not None and not tuned:
            raise MeasuringWhileRecording("measured outside a CUDA graph recording")
        tuned.append(True)
        return affine(x)

    fresh = Recordings(size=2, ran={("model", "b")}, scope="model")
    assert torch.equal(fresh("b", counted(tuning, eager), y), y * 2 + 1) and len(eager) == 3
    assert "b" in fresh and fresh.replays == 0
    assert torch.equal(fresh("b", counted(tuning, eager), z), z * 2 + 1) and len(eager) == 3 and fresh.replays == 1


def test_a_generation_remembers_the_keys_its_process_ran_for_the_same_model_and_method_class(fake_graphs,
                                                                                           monkeypatch):
    """graphs.remembering: a key one generation ran eagerly is recorded at once by a later generation of the
    same model with a method of the same class (knobs aside), and run first for another model or class."""
    monkeypatch.setattr(graphs_module, "EAGER_RUNS", set())
    model, other_model, eager = object(), object(), []
    x = torch.ones(3)
    graphs_module.remembering(model, get_method("mage"))("a", counted(affine, eager), x)
    for later_model, method, runs_first in [(model, get_method("mage", k=16), False),
                                            (other_model, get_method("mage"), True),
                                            (model, get_method("quest"), True)]:
        before = len(eager)
        assert torch.equal(graphs_module.remembering(later_model, method)("a", counted(affine, eager), x), x * 2 + 1)
        assert len(eager) == before + runs_first


class Launched(Method):
    """A method whose steps and commits (each of one kind) are kernels of the fed tokens and positions."""

    def step(self, model, ctx):
        out = torch.empty(ctx.tokens.shape)
        launch(lambda: torch.add(ctx.tokens * 10, ctx.positions, out=out))
        return out

    def commit(self, model, ctx):
        out = torch.empty(ctx.tokens.shape)
        launch(lambda: torch.sub(ctx.tokens * 10, ctx.positions, out=out))
        return out

    def step_kind(self, ctx):
        return ()


def test_replayed_steps_and_commits_compute_their_own_contexts(fake_graphs, monkeypatch):
    """A wrapped method's steps and commits, recorded once per kind and shape and replayed after: each
    gives its hook's result on its own tokens and positions, not on those of the step recorded."""
    monkeypatch.setattr(graphs_module, "recordable", lambda ctx: True)
    replayed = Replayed(Launched(), None)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        tokens = torch.randint(0, 100, (2, 5), generator=generator)
        positions = torch.arange(5)[None].repeat(2, 1) + step * 5
        ctx = StepContext(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), torch.tensor([3, 4]),
                          step=step)
        assert torch.equal(replayed.step(None, ctx), (tokens * 10 + positions).float())
        commit = replayed.commit(None, replace(ctx, phase="commit"))
        assert torch.equal(commit, (tokens * 10 - positions).float())
    assert replayed.replays == 6  # each of the two recordings, replayed in the last three steps
