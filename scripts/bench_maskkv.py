"""`python scripts/bench.py maskkv`: decoding speed and peak memory of the masked engine on the llada-8b
preset (random bf16 weights) after 8K-32K prompts: vanilla, dllm_cache and MaskKV
(docs/results/bench_maskkv.md).

A generation is 256 tokens in 256 steps, block length 8. Vanilla forwards the whole canvas every
step; dllm_cache and MaskKV run one of four kinds of step by the step index t (methods/dllm_cache.py):
the first, a full refresh, a response refresh and a drift step. Each kind is timed on its own, as the
engine runs it (one Replayed per method: drift steps and response refreshes replay CUDA graphs), and
a generation assembled as the sum of count x time; one real generation per method at the shortest
context checks the assembly. Floors: harness.step_floor. Peak memory = max allocated (weights
included), for vanilla as we run it (logits of the block only) and as LLaDA's reference loop does
(logits and their softmax over the whole canvas every step).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

import nanodllm.graphs as graphs_module
from harness import QUICK_LLADA, canvas_context, logits, peak_gib, random_prompts, step_floor, wall_us
from nanodllm.config import GenerationConfig
from nanodllm.generation import generate
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense
from nanodllm.methods.maskkv import PROFILE_NAME, layer_importance

FULL = dict(contexts=(8192, 16384, 32768), gen_length=256, block_length=8, budget=256)
QUICK = dict(contexts=(96, 200), gen_length=16, block_length=4, budget=16)
GENERATION_COLUMNS = ("ms / generation", "tokens/s", "speedup vs vanilla", "eager tokens/s", "eager speedup", "x floor",
                      "peak GiB", "peak vs vanilla", "peak vs reference vanilla", "KV GiB")


def step_kind(t: int, method) -> str:
    if t == 0:
        return "first"
    prompt, response = t % method.prompt_interval == 0, t % method.response_interval == 0
    return {(True, True): "full refresh", (True, False): "prompt refresh", (False, True): "response refresh",
            (False, False): "drift"}[(prompt, response)]


def time_kinds(model, ctx, method, steps, timer, device) -> tuple[dict, dict, float]:
    """For every kind of step the schedule uses, each call at its step index t: GPU microseconds (drift
    and response refresh as the Timer's CUDA graphs, host overhead excluded), engine microseconds (host
    overhead included, through one Replayed, as the engine runs them) and the first step's peak GiB."""
    engine = Replayed(method)
    pinned = lambda t: logits(engine, model, replace(ctx, t=t))
    first_peak = peak_gib(lambda: pinned(0), device)  # t = 0 starts the caches afresh
    gpu = {"first": wall_us(lambda: pinned(0), device, tries=1)}
    eager = dict(gpu)
    for t in range(1, steps):
        kind = step_kind(t, method)
        if kind in gpu:
            continue
        eager[kind] = gpu[kind] = wall_us(lambda t=t: pinned(t), device)
        if kind in ("drift", "response refresh") and device.type == "cuda":  # no host syncs in these
            graphs_module.GRAPHS_ENABLED = False  # the timer records the step itself
            gpu[kind] = timer(lambda t=t: pinned(t))
            graphs_module.GRAPHS_ENABLED = True
    return gpu, eager, first_peak


def generation_row(context, method, **values) -> dict:
    return {"context": context, "method": method, **dict.fromkeys(GENERATION_COLUMNS, float("nan")), **values}


def measured_profile(model, ctx) -> str:
    """MaskKV's layer importance measured once on this canvas (its online variant) as a profile file, so
    the timed steps and generations reuse it, as runs of a calibrated model do."""
    importance = layer_importance(model, ctx.tokens, ctx.positions, ctx.valid)[0]
    path = Path(tempfile.mkdtemp(prefix="nanodllm-maskkv-")) / PROFILE_NAME
    path.write_text(json.dumps({"layer_importance": importance}))
    return str(path)


@torch.no_grad()
def maskkv(setup):
    device, shapes = setup.device, setup.shapes(QUICK, FULL)
    steps = gen = shapes["gen_length"]
    model = setup.random_model(QUICK_LLADA, "llada-8b", context=max(shapes["contexts"]) + gen)
    cfg, ceilings = model.cfg, setup.ceilings
    floor_us = step_floor(cfg, model, ceilings)
    setup.report.say(f"Copy {ceilings[0]:.0f} GB/s, matmul {ceilings[1]:.0f} TFLOP/s. {gen} tokens in {steps} steps, "
                     f"block length {shapes['block_length']}; MaskKV budget {shapes['budget']} per head, its layer "
                     "profile measured once per context on its canvas.\n")
    step_rows, gen_rows = [], []
    for context in shapes["contexts"]:
        ctx = canvas_context(cfg, context, gen, shapes["block_length"], device)
        width, budget = context + gen, min(shapes["budget"], context)
        dense = Dense()
        vanilla = Replayed(dense)
        vanilla_us = wall_us(lambda: logits(vanilla, model, ctx), device)
        vanilla_peak = peak_gib(lambda: logits(vanilla, model, ctx), device)
        reference_peak = peak_gib(lambda: model.head(model.hidden(ctx.tokens, ctx.positions,
                                                                  lambda i, q, k, v: dense.attend(i, q, k, v, ctx))
                                                     ).softmax(dim=-1), device)
        kept = {"dllm_cache": width, "maskkv": budget + gen}  # keys a refreshed row attends
        rows_of = {"full refresh": width, "prompt refresh": context, "response refresh": gen, "drift": gen // 4}
        floors = {"vanilla": floor_us(width, width * width), "first": floor_us(width, width * width),
                  **{kind: {name: floor_us(rows, rows * keys) for name, keys in kept.items()}
                     for kind, rows in rows_of.items()}}
        totals = {"vanilla": (steps * vanilla_us, steps * vanilla_us, steps * floors["vanilla"], vanilla_peak)}
        step_rows.append({"context": context, "method": "vanilla", "kind": "every step", "count": steps,
                          "us": vanilla_us, "eager us": vanilla_us, "floor us": floors["vanilla"],
                          "x floor": vanilla_us / floors["vanilla"]})
        maskkv_knobs = {"budget": shapes["budget"], "profile": measured_profile(model, ctx)}
        for name in ("dllm_cache", "maskkv"):
            method = get_method(name, **(maskkv_knobs if name == "maskkv" else {}))
            gpu, eager, first_peak = time_kinds(model, ctx, method, steps, setup.timer, device)
            counts = {kind: sum(step_kind(t, method) == kind for t in range(steps)) for kind in gpu}
            total = eager_total = floor_total = 0.0
            for kind, us in gpu.items():
                floor = floors[kind] if kind == "first" else floors[kind][name]
                total += counts[kind] * us
                eager_total += counts[kind] * eager[kind]
                floor_total += counts[kind] * floor
                step_rows.append({"context": context, "method": name, "kind": kind, "count": counts[kind], "us": us,
                                  "eager us": eager[kind], "floor us": floor, "x floor": us / floor})
            cache_gib = sum(c.keys.numel() * c.keys.element_size() * 2 for c in method.layers) / 2**30
            totals[name] = (total, eager_total, floor_total, first_peak, cache_gib)
            del method
        for name, (total, eager_total, floor_total, peak, *cache) in totals.items():
            gen_rows.append(generation_row(
                context, name, **{"ms / generation": total / 1e3, "tokens/s": gen / (total / 1e6),
                                  "speedup vs vanilla": totals["vanilla"][0] / total,
                                  "eager tokens/s": gen / (eager_total / 1e6),
                                  "eager speedup": totals["vanilla"][1] / eager_total, "x floor": total / floor_total,
                                  "peak GiB": peak, "peak vs vanilla": peak / vanilla_peak,
                                  "peak vs reference vanilla": peak / reference_peak, "KV GiB": cache[0] if cache
                                  else float("nan")}))
        gen_rows.append(generation_row(context, "reference vanilla (full logits)", **{
            "peak GiB": reference_peak, "peak vs vanilla": reference_peak / vanilla_peak,
            "peak vs reference vanilla": 1.0}))
        if context == min(shapes["contexts"]):  # a real generation per method, host overhead included
            prompt = random_prompts(cfg, context, seed=1)[0]
            config = GenerationConfig(gen_length=gen, block_length=shapes["block_length"], steps=gen)
            for name in ("dllm_cache", "maskkv"):
                method = get_method(name, **(maskkv_knobs if name == "maskkv" else {}))
                # the second of two generations: the first compiles and autotunes; each records its own graphs
                seconds = wall_us(lambda: generate(model, [prompt], config, method), device, tries=1) / 1e6
                gen_rows.append(generation_row(context, f"{name}, end to end", **{
                    "ms / generation": seconds * 1e3, "eager tokens/s": gen / seconds,
                    "eager speedup": totals["vanilla"][0] / (seconds * 1e6)}))
        setup.free()
    setup.report.table("Steps", step_rows, "Microseconds per step of the whole model, by kind; 'count' = steps of "
                       "that kind in a generation; 'us' = GPU time (drift and response refresh: CUDA graph, L2 "
                       "evicted; the others eager with events), 'eager us' = as the engine runs them, host overhead "
                       "included.")
    setup.report.table("Per generation", gen_rows, "Assembled from the step times (sum of count x us); peak = max "
                       "allocated during vanilla's step or the method's first step, the highest of its steps; KV GiB = "
                       "the method's cached K/V after its last timed step.")
    return "bench_maskkv"
