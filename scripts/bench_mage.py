"""`python scripts/bench.py mage`: time per output block of the block engine on the sdar-8b preset
(random bf16 weights) at long contexts, exact vs MAGE and its baselines.

Each kind of denoising step is timed on its own as a CUDA graph (scripts/bench.py Timer: L2
evicted, host launch overhead excluded; eager steps are host-bound, see docs/results/bench_mage.md
"A real generation"), then a block of T steps + the commit forward is assembled:

    SDPA exact  T x step(torch SDPA)                    + commit
    exact       T x step(our kernels)                   + commit
    MAGE        step 1 (exact + selection) + (T-1) x sparse step         + commit
    MAGE, sparse commit   the same, its commit on the selection (sparse_commit=True)
    Quest       T x Quest step (page bounds + top pages + sparse)        + commit
    SparseD     (c-1) x exact + capture step + (T-c) x sparse step       + commit, c = round(0.2 T)

The commit forward is an exact step over the same shapes (timed as one); MAGE's with sparse_commit
reads the block's selection, so it is timed as one sparse step. A step is run as the engine runs
it, through nanodllm/graphs.py Replayed (one per method), with the engine's graphs off: the Timer
records the step as its own graph. Then, as a user runs it, `block.generate` itself at the first
context, batch 1: milliseconds per block (CUDA events as each block begins, the median of the blocks
after the first, where the engine records its graphs; the prefill is not in them), with the engine's
host loop and sampling and every forward replaying a graph, next to the assembled figure; with
graphs off for exact and MAGE. On a GPU the selection's top-k is also timed alone, torch (topk +
sort) against kernels/top_k.py, and each kind of step is profiled once, eagerly, its kernel time
split into attention, selection and the rest. Floors: weight bytes read (embedding rows aside) plus
the KV bytes each step reads (exact: the whole prefix in every layer; sparse: the exact layers'
prefix plus k keys per KV head elsewhere), over the measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

import nanodllm.attention as attention_module
import nanodllm.graphs as graphs_module
from kernels.top_k import top_k_positions
from nanodllm.cache import KVCache
from nanodllm.config import GenerationConfig, ModelConfig, preset
from nanodllm.loader import build_random
from nanodllm.generation import generate
from nanodllm.graphs import Replayed
from nanodllm.methods import Dense, Mage, Quest, get_method
from nanodllm.methods.base import StepContext

FULL = dict(contexts=(32768, 65536, 131072), batches=(1, 4), block=32, steps=32, k=1024)
QUICK = dict(contexts=(96, 200), batches=(1, 2), block=8, steps=4, k=32)
QUICK_MODEL = dict(model_type="sdar", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=256, vocab_size=256, mask_token_id=255,
                   block_size=8, max_position_embeddings=1024)
HEADROOM_BYTES = 6 << 30  # activations, graph pools, the allocator's slack


def fill_cache(cfg, batch, context, block, device, dtype) -> KVCache:
    cache = KVCache.for_model(cfg, batch, context + block, device, dtype)
    for layer in range(cfg.num_layers):
        cache.keys[layer][:, :context].normal_()
        cache.values[layer][:, :context].normal_()
    cache.advance(torch.full((batch,), context, device=device))
    return cache


def block_context(cfg, cache, batch, context, block, steps, device) -> StepContext:
    columns = context + torch.arange(block, device=device)[None].expand(batch, -1)
    tokens = torch.full_like(columns, cfg.mask_token_id)
    return StepContext(tokens, columns, torch.ones_like(columns, dtype=torch.bool),
                       torch.full((batch,), context, device=device), cache=cache, block_length=block,
                       steps_per_block=steps)


def logits(steps: Replayed, model, ctx):
    """A denoising step as the loops run it: the method's step, then its logits."""
    return steps.logits(model, steps.step(model, ctx), ctx)


def step_times(model, ctx, timer, knobs) -> dict:
    """Microseconds of each kind of step, one CUDA graph each (eager on a CPU)."""
    exact = Replayed(Dense())
    times = {}
    with torch.no_grad():
        for enabled, name in ((False, "sdpa"), (True, "exact")):
            attention_module.KERNELS_ENABLED = enabled
            times[name] = timer(lambda: logits(exact, model, ctx))
        attention_module.KERNELS_ENABLED = True

        selecting, sparse = replace(ctx, step=0), replace(ctx, step=1)
        serial = Replayed(Mage(**knobs))
        graphs_module.STREAMS_ENABLED = False
        times["select one stream"] = timer(lambda: logits(serial, model, selecting))
        graphs_module.STREAMS_ENABLED = True
        mage = Replayed(Mage(**knobs))
        mage.begin_block(selecting)
        times["select"] = timer(lambda: logits(mage, model, selecting))  # exact attention, top-k on the side stream
        times["sparse"] = timer(lambda: logits(mage, model, sparse))  # attends to the step-0 selection

        quest = Replayed(Quest(**knobs))
        first = replace(ctx, step=0, block=0)
        quest.begin_block(first)
        times["quest"] = timer(lambda: logits(quest, model, first))  # page bounds updated in the warm-up call
    return times


ATTENTION_KERNELS = ("attention", "decode_split", "merge_splits", "fmha", "flash", "sdpa")
SELECTION_KERNELS = ("key_scores", "topk", "sort", "radix")


def kernel_bucket(name: str) -> str:
    """Which part of a step a GPU kernel belongs to, by its name: attention (ours or SDPA's, with the
    split-KV merge), selection (key scores, top-k and the sorts it runs) or rest (projections, FFN,
    norms, RoPE, cache writes, element-wise)."""
    lowered = name.lower()
    if any(part in lowered for part in SELECTION_KERNELS):
        return "selection"
    if any(part in lowered for part in ATTENTION_KERNELS):
        return "attention"
    return "rest"


def breakdown(fn, device) -> dict:
    """GPU kernel milliseconds of one eager call of fn by kernel_bucket (CUDA only: {} elsewhere). Kernels
    on MAGE's side stream are counted in full although they overlap the FFN."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    parts = {"attention": 0.0, "selection": 0.0, "rest": 0.0}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            parts[kernel_bucket(event.name)] += event.device_time / 1e3
    return parts


def step_breakdowns(model, ctx, knobs) -> dict:
    """breakdown() of an exact step, MAGE's step 1 and step 2..T, and a Quest step, as step_times runs them."""
    device = ctx.tokens.device
    with torch.no_grad():
        exact = Replayed(Dense())
        parts = {"exact": breakdown(lambda: logits(exact, model, ctx), device)}
        mage = Replayed(Mage(**knobs))
        selecting, sparse = replace(ctx, step=0), replace(ctx, step=1)
        mage.begin_block(selecting)
        parts["MAGE step 1"] = breakdown(lambda: logits(mage, model, selecting), device)
        parts["MAGE step 2..T"] = breakdown(lambda: logits(mage, model, sparse), device)
        quest = Replayed(Quest(**knobs))
        first = replace(ctx, step=0, block=0)
        quest.begin_block(first)
        parts["Quest"] = breakdown(lambda: logits(quest, model, first), device)
    return parts


def selection_times(batch, num_kv_heads, context, k, timer, device) -> dict:
    """Microseconds of one layer's top-k selection for probability-like scores (skewed, all distinct) of
    every prefix key: torch's topk, then a sort of the chosen positions, against kernels/top_k.py, which
    must pick the same positions."""
    generator = torch.Generator(device=device).manual_seed(context + batch)
    scores = torch.rand(batch, num_kv_heads, context, device=device, generator=generator).pow(8) / context
    lengths = torch.full((batch,), context, device=device)
    torch_top_k = lambda: scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return {"torch": timer(torch_top_k), "kernel": timer(lambda: top_k_positions(scores, lengths, k)),
            "same picks": torch.equal(top_k_positions(scores, lengths, k)[0], torch_top_k().to(torch.int32))}


def block_times(times: dict, steps: int, exact_fraction: float) -> dict:
    capture = max(1, round(exact_fraction * steps))
    commit = times["exact"]
    return {
        "SDPA exact": steps * times["sdpa"] + times["sdpa"],
        "exact": steps * times["exact"] + commit,
        "MAGE": times["select"] + (steps - 1) * times["sparse"] + commit,
        "MAGE, sparse commit": times["select"] + steps * times["sparse"],
        "Quest": steps * times["quest"] + commit,
        "SparseD": (capture - 1) * times["exact"] + times["select"] + (steps - capture) * times["sparse"] + commit,
    }


GENERATION_BLOCKS = 7  # per timed generation: the first (recordings) and six timed blocks


def mark(events: list):
    """Append a CUDA event recorded now on the current stream."""
    events.append(torch.cuda.Event(enable_timing=True))
    events[-1].record()


def block_clock(method, events: list):
    """Make method.begin_block mark `events` as each block begins."""
    begin = method.begin_block

    def begin_timed(ctx):
        mark(events)
        begin(ctx)

    method.begin_block = begin_timed
    return method


def generation_times(model, cfg, context, shapes, knobs, assembled: dict) -> list[dict]:
    """Milliseconds per block of block.generate at batch 1 (random prompt, temperature 0, no stop
    token), timed inside one generation of GENERATION_BLOCKS blocks: a CUDA event as each block
    begins and one after the last, so the prefill and the first block (where the engine records
    its graphs) stay out of the timed blocks; their median and range. Graphed: every method;
    eager: exact and MAGE. A warm-up generation first compiles and autotunes."""
    prompt = torch.randint(0, cfg.mask_token_id, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    size, steps = shapes["block"], shapes["steps"]
    methods = [("exact", "dense", {}), ("MAGE", "mage", knobs), ("Quest", "quest", knobs),
               ("SparseD", "sparsed", knobs)]
    runs = [(label, name, method_knobs, True) for label, name, method_knobs in methods]
    runs += [(label, name, method_knobs, False) for label, name, method_knobs in methods[:2]]

    def run(name, method_knobs, blocks, events):
        gen = GenerationConfig(gen_length=blocks * size, block_length=size, steps=steps, temperature=0.0,
                               threshold=None)
        method = block_clock(get_method(name, **method_knobs), events)
        generate(model, [prompt], gen, method, stop_ids=())
        mark(events)
        torch.cuda.synchronize()

    rows = []
    for label, name, method_knobs, graphed in runs:
        graphs_module.GRAPHS_ENABLED = graphed
        # warm-up: compiles and autotunes (a compile in a later block would show in the range, not the median)
        run(name, method_knobs, 2, [])
        events = []
        run(name, method_knobs, GENERATION_BLOCKS, events)
        block_ms = sorted(a.elapsed_time(b) for a, b in zip(events[1:-1], events[2:]))
        ms = statistics.median(block_ms)
        rows.append({"context": context, "method": label, "graphs": graphed, "ms/block": ms,
                     "min-max ms/block": f"{block_ms[0]:.0f}-{block_ms[-1]:.0f}",
                     "ms per forward": ms / (steps + 1), "assembled ms/block": assembled[label] / 1e3,
                     "real / assembled": ms * 1e3 / assembled[label]})
    graphs_module.GRAPHS_ENABLED = True
    return rows


def bench_mage(args, timer, report, measure_rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        cfg = ModelConfig.from_dict(QUICK_MODEL, source="bench --quick")
    else:
        cfg = preset("sdar-8b", context=max(shapes["contexts"]) + 2 * shapes["block"], block_size=shapes["block"])
    knobs = dict(k=shapes["k"], exact_layers=2)
    bandwidth = measure_rates()
    meta.update(copy_GBps=bandwidth, shapes=shapes, knobs=knobs)
    start = time.perf_counter()
    model = build_random(cfg, device=device, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = weight_bytes - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    report.say(f"sdar-8b shapes ({cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, "
               f"d = {cfg.head_dim}), random {str(dtype).removeprefix('torch.')} weights: {weight_bytes / 1e9:.2f} GB, "
               f"built in {time.perf_counter() - start:.1f}s; one model for every context (NTK factor of the "
               f"longest; the RoPE base does not change the time); copy bandwidth {bandwidth:.0f} GB/s.\n")

    per_key = 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8  # K + V bytes, one layer
    sparse_layers = cfg.num_layers - knobs["exact_layers"]
    steps, rows, step_rows, breakdown_rows, selection_rows = shapes["steps"], [], [], [], []
    total_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    graphs_module.GRAPHS_ENABLED = False  # each step is timed as the Timer's graph (no graph inside a graph)
    first_blocks = None
    for context in shapes["contexts"]:
        for batch in shapes["batches"]:
            kv_bytes = batch * (context + shapes["block"]) * per_key * cfg.num_layers
            kv_bytes += kv_bytes // 16  # Quest's page bounds: min and max of K per 16 keys = (K + V) / 16
            if total_memory and weight_bytes + kv_bytes + HEADROOM_BYTES > total_memory:
                report.say(f"- context {context}, batch {batch}: skipped, weights {weight_bytes / 2**30:.1f} GiB + "
                           f"KV cache {kv_bytes / 2**30:.1f} GiB + {HEADROOM_BYTES >> 30} GiB headroom exceed the "
                           f"device's {total_memory / 2**30:.1f} GiB")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            cache = fill_cache(cfg, batch, context, shapes["block"], device, dtype)
            ctx = block_context(cfg, cache, batch, context, shapes["block"], steps, device)
            times = step_times(model, ctx, timer, knobs)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            for kind, parts in step_breakdowns(model, ctx, knobs).items():
                if parts:
                    breakdown_rows.append({"context": context, "batch": batch, "step": kind,
                                           **{f"{name} ms": ms for name, ms in parts.items()},
                                           "kernels ms": sum(parts.values())})
            if device.type == "cuda":
                chosen = selection_times(batch, cfg.num_kv_heads, context, knobs["k"], timer, device)
                selection_rows.append({"context": context, "batch": batch, "torch topk + sort us": chosen["torch"],
                                       "kernels/top_k.py us": chosen["kernel"],
                                       "speedup": chosen["torch"] / chosen["kernel"],
                                       "same positions": chosen["same picks"]})
            blocks = block_times(times, steps, 0.2)
            if first_blocks is None and batch == 1:
                first_blocks = (context, blocks)
            exact_floor = (read_bytes + batch * context * per_key * cfg.num_layers) / bandwidth / 1e3  # us
            kept = min(knobs["k"], context)
            sparse_floor = (read_bytes + batch * per_key * (context * knobs["exact_layers"] + kept * sparse_layers)
                            ) / bandwidth / 1e3
            step_rows.append({"context": context, "batch": batch, "SDPA step us": times["sdpa"],
                              "exact step us": times["exact"], "exact floor us": exact_floor,
                              "exact / floor": times["exact"] / exact_floor, "MAGE step 1 us": times["select"],
                              "step-1 overhead %": 100 * (times["select"] / times["exact"] - 1),
                              "step-1 overhead, one stream %": 100 * (times["select one stream"] / times["exact"] - 1),
                              "MAGE step 2..T us": times["sparse"], "sparse floor us": sparse_floor,
                              "MAGE 2..T / floor": times["sparse"] / sparse_floor, "Quest step us": times["quest"],
                              "peak GiB": peak})
            row = {"context": context, "batch": batch}
            row.update({f"{name} ms/block": us / 1e3 for name, us in blocks.items()})
            row.update({"MAGE vs SDPA exact": blocks["SDPA exact"] / blocks["MAGE"],
                        "MAGE vs exact": blocks["exact"] / blocks["MAGE"],
                        "MAGE vs Quest": blocks["Quest"] / blocks["MAGE"],
                        "MAGE vs SparseD": blocks["SparseD"] / blocks["MAGE"]})
            rows.append(row)
            del cache, ctx
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.table("Steps", step_rows,
                 f"Microseconds per denoising step of the whole model (CUDA graph, L2 flushed), k = {knobs['k']}, "
                 f"{knobs['exact_layers']} exact layers. Floors: weights read + the KV bytes the step must read, "
                 "over the copy bandwidth. 'step-1 overhead' = MAGE's first step (exact attention, then key "
                 "scores + top-k on a side stream overlapped with the FFN) over an exact step; 'one stream': the "
                 "same with side streams off (NANODLLM_STREAMS=0). Peak = max allocated during the configuration.")
    if breakdown_rows:
        report.table("Per-step breakdown", breakdown_rows,
                     "GPU kernel milliseconds of one eager call of each kind of step, by kernel: attention (our "
                     "decode / sparse decode / flash kernels with the split-KV merge), selection (key scores, "
                     "top-k, sorts), rest (projections, FFN, norms, RoPE, cache writes, element-wise). Side-stream "
                     "kernels are counted in full although they overlap the FFN; the sum can differ from the "
                     "graphed step time above by launch gaps.")
    if selection_rows:
        report.table("Top-k selection", selection_rows,
                     f"One layer's selection (k = {knobs['k']} of every prefix key per KV head, probability-like "
                     "scores): torch's topk, then a sort of the chosen positions, against the radix-select kernel "
                     "(kernels/top_k.py), which emits the positions in order; CUDA graph, L2 flushed.")
    report.table("Time per output block", rows,
                 f"B = {shapes['block']}, T = {steps} steps per block + the commit forward, assembled from the step "
                 "times above (see scripts/bench_mage.py).")
    graphs_module.GRAPHS_ENABLED = True
    if device.type == "cuda" and first_blocks is not None:
        context, blocks = first_blocks
        report.table("A real generation", generation_times(model, cfg, context, shapes, knobs, blocks),
                     f"block.generate at {context} tokens of prompt, batch 1, as a user runs it: milliseconds per "
                     f"block (the median of blocks 2-{GENERATION_BLOCKS} of one generation, each timed by CUDA events "
                     "as it begins; the prefill and the first block, where the graphs are recorded, are left out), "
                     "the engine's host loop and sampling included; 'graphs' = every "
                     "denoising step and commit replays a CUDA graph recorded once per generation (the default on "
                     "a GPU); without, each forward launches its kernels from Python. 'assembled' = the figure in "
                     "the table above.")
