"""`python scripts/bench.py mage`: time per output block of the block engine on the sdar-8b preset
(random bf16 weights) at 32K-128K, exact vs MAGE, Quest and SparseD (docs/results/bench_mage.md).

Each kind of denoising step runs as the engine runs it (a nanodllm/graphs.py Replayed, the engine's
graphs off) and is timed as one CUDA graph by the Timer; a block of T steps + the commit forward (an
exact step) is assembled: SDPA exact and exact = T + 1 steps; MAGE = its selecting step 1 + (T - 1)
sparse steps + commit (with sparse_commit, the commit is one more sparse step); Quest = T Quest steps
+ commit; SparseD = (c - 1) exact + the capture + (T - c) sparse steps + commit, c = round(0.2 T).
Floors: the weights read (embedding aside) + the KV bytes a step reads (exact: the whole prefix in
every layer; sparse: the exact layers' prefix, k keys per KV head elsewhere), over copy bandwidth.
On a GPU the selection's top-k is timed alone (torch topk + sort vs kernels/top_k.py), and
block.generate itself at the first context, batch 1: ms per block (CUDA events as each block
begins; the median of the blocks after the first, where the engine records its graphs).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

import nanodllm.attention as attention_module
import nanodllm.graphs as graphs_module
from harness import GENERATION_BLOCKS, QUICK_SDAR, logits, random_prompts, read_bytes, timed_generation, too_big
from nanodllm.cache import KVCache
from nanodllm.graphs import Replayed
from nanodllm.kernels.top_k import top_k_positions
from nanodllm.methods import Dense, Mage, Quest, get_method
from nanodllm.methods.base import StepContext

FULL = dict(contexts=(32768, 65536, 131072), batches=(1, 4), block=32, steps=32, k=1024)
QUICK = dict(contexts=(96, 200), batches=(1, 2), block=8, steps=4, k=32)


def block_context(cfg, batch, context, block, steps, device, dtype) -> StepContext:
    """The context of a block's step after `context` cached tokens of random keys and values."""
    cache = KVCache.for_model(cfg, batch, context + block, device, dtype)
    for layer in range(cfg.num_layers):
        cache.keys[layer][:, :context].normal_()
        cache.values[layer][:, :context].normal_()
    cache.advance(torch.full((batch,), context, device=device))
    columns = context + torch.arange(block, device=device)[None].expand(batch, -1)
    return StepContext(torch.full_like(columns, cfg.mask_token_id), columns, torch.ones_like(columns, dtype=torch.bool),
                       torch.full((batch,), context, device=device), cache=cache, block_length=block,
                       steps_per_block=steps)


@torch.no_grad()
def step_times(model, ctx, timer, knobs) -> dict:
    """Microseconds of each kind of step, one CUDA graph each (eager on a CPU)."""
    exact, times = Replayed(Dense(), model), {}
    for enabled, name in ((False, "sdpa"), (True, "exact")):
        attention_module.KERNELS_ENABLED = enabled
        times[name] = timer(lambda: logits(exact, model, ctx))
    attention_module.KERNELS_ENABLED = True
    selecting, sparse = replace(ctx, step=0), replace(ctx, step=1)
    serial = Replayed(Mage(**knobs), model)
    graphs_module.STREAMS_ENABLED = False
    times["select one stream"] = timer(lambda: logits(serial, model, selecting))
    graphs_module.STREAMS_ENABLED = True
    mage = Replayed(Mage(**knobs), model)
    mage.begin_block(selecting)
    times["select"] = timer(lambda: logits(mage, model, selecting))  # exact attention, top-k on the side stream
    times["sparse"] = timer(lambda: logits(mage, model, sparse))  # attends to the step-0 selection
    quest, first = Replayed(Quest(**knobs), model), replace(ctx, step=0, block=0)
    quest.begin_block(first)
    times["quest"] = timer(lambda: logits(quest, model, first))  # page bounds updated in the warm-up call
    return times


def selection_row(context, batch, num_kv_heads, k, timer, device) -> dict:
    """One layer's top-k over probability-like scores (skewed, all distinct) of every prefix key: torch's
    topk then a sort of the positions, against kernels/top_k.py, which must pick the same positions."""
    generator = torch.Generator(device=device).manual_seed(context + batch)
    scores = torch.rand(batch, num_kv_heads, context, device=device, generator=generator).pow(8) / context
    lengths = torch.full((batch,), context, device=device)
    torch_top_k = lambda: scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    torch_us, kernel_us = timer(torch_top_k), timer(lambda: top_k_positions(scores, lengths, k))
    return {"context": context, "batch": batch, "torch topk + sort us": torch_us, "kernels/top_k.py us": kernel_us,
            "speedup": torch_us / kernel_us,
            "same positions": torch.equal(top_k_positions(scores, lengths, k)[0], torch_top_k().to(torch.int32))}


def block_times(times: dict, steps: int, exact_fraction: float) -> dict:
    capture, commit = max(1, round(exact_fraction * steps)), times["exact"]
    return {
        "SDPA exact": steps * times["sdpa"] + times["sdpa"],
        "exact": steps * times["exact"] + commit,
        "MAGE": times["select"] + (steps - 1) * times["sparse"] + commit,
        "MAGE, sparse commit": times["select"] + steps * times["sparse"],
        "Quest": steps * times["quest"] + commit,
        "SparseD": (capture - 1) * times["exact"] + times["select"] + (steps - capture) * times["sparse"] + commit,
    }


def generation_times(model, context, shapes, knobs, assembled: dict) -> list[dict]:
    """Milliseconds per block of block.generate at batch 1 (random prompt, temperature 0, no stop token)
    inside one generation of GENERATION_BLOCKS blocks, after a warm-up generation that compiles and
    autotunes; their median and range. Graphed: every method; eager: exact and MAGE."""
    prompts, steps = random_prompts(model.cfg, context), shapes["steps"]
    methods = [("exact", "dense", {}), ("MAGE", "mage", knobs), ("Quest", "quest", knobs),
               ("SparseD", "sparsed", knobs)]
    run = lambda name, method_knobs, blocks: timed_generation(model, prompts, get_method(name, **method_knobs),
                                                              shapes["block"], steps, blocks)[0]
    rows = []
    for (label, name, method_knobs), graphed in [*((m, True) for m in methods), *((m, False) for m in methods[:2])]:
        graphs_module.GRAPHS_ENABLED = graphed
        run(name, method_knobs, 2)  # a compile in a later block would show in the range, not the median
        block_ms = run(name, method_knobs, GENERATION_BLOCKS)
        ms = statistics.median(block_ms)
        rows.append({"context": context, "method": label, "graphs": graphed, "ms/block": ms,
                     "min-max ms/block": f"{min(block_ms):.0f}-{max(block_ms):.0f}", "ms per forward": ms / (steps + 1),
                     "assembled ms/block": assembled[label] / 1e3, "real / assembled": ms * 1e3 / assembled[label]})
    graphs_module.GRAPHS_ENABLED = True
    return rows


def mage(setup):
    device, dtype, shapes = setup.device, setup.dtype, setup.shapes(QUICK, FULL)
    knobs = setup.meta["knobs"] = dict(k=shapes["k"], exact_layers=2)
    model = setup.random_model(QUICK_SDAR, "sdar-8b", context=max(shapes["contexts"]) + 2 * shapes["block"],
                               block_size=shapes["block"])
    cfg, (bandwidth, _) = model.cfg, setup.ceilings
    weight_bytes, weights_read = sum(p.numel() * p.element_size() for p in model.parameters()), read_bytes(model)
    setup.report.say(f"{cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, d = "
                     f"{cfg.head_dim}, random weights {weight_bytes / 1e9:.2f} GB; copy bandwidth {bandwidth:.0f} "
                     "GB/s.\n")
    per_key = 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8  # K + V bytes, one layer
    sparse_layers = cfg.num_layers - knobs["exact_layers"]
    steps, rows, step_rows, selection_rows, first_blocks = shapes["steps"], [], [], [], None
    graphs_module.GRAPHS_ENABLED = False  # each step is timed as the Timer's graph (no graph inside a graph)
    for context, batch in ((context, batch) for context in shapes["contexts"] for batch in shapes["batches"]):
        kv_bytes = batch * (context + shapes["block"]) * per_key * cfg.num_layers
        kv_bytes += kv_bytes // 16  # Quest's page bounds: min and max of K per 16 keys = (K + V) / 16
        if why := too_big(device, weight_bytes, kv_bytes):
            setup.report.say(f"- context {context}, batch {batch}: skipped, {why}")
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ctx = block_context(cfg, batch, context, shapes["block"], steps, device, dtype)
        times = step_times(model, ctx, setup.timer, knobs)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        if device.type == "cuda":
            selection_rows.append(selection_row(context, batch, cfg.num_kv_heads, knobs["k"], setup.timer, device))
        blocks = block_times(times, steps, 0.2)
        if first_blocks is None and batch == 1:
            first_blocks = (context, blocks)
        exact_floor = (weights_read + batch * context * per_key * cfg.num_layers) / bandwidth / 1e3  # us
        sparse_kv = batch * per_key * (context * knobs["exact_layers"] + min(knobs["k"], context) * sparse_layers)
        sparse_floor = (weights_read + sparse_kv) / bandwidth / 1e3
        step_rows.append({"context": context, "batch": batch, "SDPA step us": times["sdpa"],
                          "exact step us": times["exact"], "exact floor us": exact_floor,
                          "exact / floor": times["exact"] / exact_floor, "MAGE step 1 us": times["select"],
                          "step-1 overhead %": 100 * (times["select"] / times["exact"] - 1),
                          "step-1 overhead, one stream %": 100 * (times["select one stream"] / times["exact"] - 1),
                          "MAGE step 2..T us": times["sparse"], "sparse floor us": sparse_floor,
                          "MAGE 2..T / floor": times["sparse"] / sparse_floor, "Quest step us": times["quest"],
                          "peak GiB": peak})
        rows.append({"context": context, "batch": batch, **{f"{n} ms/block": us / 1e3 for n, us in blocks.items()},
                     **{f"MAGE vs {n}": blocks[n] / blocks["MAGE"] for n in ("SDPA exact", "exact", "Quest",
                                                                              "SparseD")}})
        del ctx
        setup.free()
    setup.report.table("Steps", step_rows,
                       f"Microseconds per denoising step of the whole model (CUDA graph, L2 flushed), k = "
                       f"{knobs['k']}, {knobs['exact_layers']} exact layers. 'step-1 overhead' = MAGE's first step "
                       "(exact attention, then key scores + top-k on a side stream) over an exact step; 'one stream': "
                       "side streams off. Peak = max allocated during the configuration.")
    if selection_rows:
        setup.report.table("Top-k selection", selection_rows,
                           f"One layer's selection (k = {knobs['k']} of every prefix key per KV head): torch's topk + "
                           "a sort of the positions against kernels/top_k.py; CUDA graph, L2 flushed.")
    setup.report.table("Time per output block", rows, f"B = {shapes['block']}, T = {steps} steps per block + the "
                       "commit forward, assembled from the step times above.")
    graphs_module.GRAPHS_ENABLED = True
    if device.type == "cuda" and first_blocks is not None:
        context, blocks = first_blocks
        setup.report.table("A real generation", generation_times(model, context, shapes, knobs, blocks),
                           f"block.generate at {context} tokens of prompt, batch 1: the median ms per block of blocks "
                           f"2-{GENERATION_BLOCKS} of one generation, host loop and sampling included; 'graphs' = "
                           "every forward replays a CUDA graph (the default on a GPU). 'assembled': the table above.")
    return "bench_mage"
