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
from harness import QUICK_LLADA, canvas_context, generation_seconds, logits, peak_gib, step_floor, wall_us
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense
from nanodllm.methods.maskkv import PROFILE_NAME, layer_importance

FULL = dict(contexts=(8192, 16384, 32768), gen_length=256, block_length=8, budget=256)
QUICK = dict(contexts=(96, 200), gen_length=16, block_length=4, budget=16)
GENERATION_COLUMNS = ("ms / generation", "tokens/s", "speedup vs vanilla", "eager tokens/s", "eager speedup", "x floor",
                      "peak GiB", "peak vs vanilla", "peak vs reference vanilla", "KV GiB")


def step_kind(t: int, method) -> str:
    prompt, response = t % method.prompt_interval == 0, t % method.response_interval == 0
    return "first" if t == 0 else {(True, True): "full refresh", (True, False): "prompt refresh",
                                   (False, True): "response refresh", (False, False): "drift"}[(prompt, response)]


def time_kinds(model, ctx, method, steps, timer, device) -> tuple[dict, dict, float]:
    """For every kind of step the schedule uses, each call at its step index t: GPU microseconds (drift
    and response refresh as the Timer's CUDA graphs, host overhead excluded), engine microseconds (host
    overhead included, through one Replayed, as the engine runs them) and the first step's peak GiB."""
    engine = Replayed(method, model)
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
    floor_us = step_floor(model.cfg, model, setup.ceilings, shapes["block_length"])
    setup.say_ceilings(f"{gen} tokens in {steps} steps, block length {shapes['block_length']}; MaskKV budget "
                       f"{shapes['budget']} per head, its layer profile measured once per context on its canvas.")
    step_rows, gen_rows = [], []
    row = lambda context, method, **values: {"context": context, "method": method,
                                             **dict.fromkeys(GENERATION_COLUMNS, float("nan")), **values}
    for context in shapes["contexts"]:
        ctx = canvas_context(model.cfg, context, gen, shapes["block_length"], device)
        width, dense = context + gen, Dense()
        vanilla = Replayed(dense, model)
        vanilla_us = wall_us(lambda: logits(vanilla, model, ctx), device)
        vanilla_peak = peak_gib(lambda: logits(vanilla, model, ctx), device)
        whole_logits = lambda: model.head(model.hidden(ctx.tokens, ctx.positions,
                                                       lambda i, q, k, v: dense.attend(i, q, k, v, ctx)))
        reference_peak = peak_gib(lambda: whole_logits().softmax(dim=-1), device)
        kept = {"dllm_cache": width, "maskkv": min(shapes["budget"], context) + gen}  # keys a refreshed row attends
        rows_of = {"first": width, "full refresh": width, "prompt refresh": context, "response refresh": gen,
                   "drift": gen // 4}
        floors = {kind: {name: floor_us(rows, rows * (width if kind == "first" else keys))
                         for name, keys in kept.items()} for kind, rows in rows_of.items()}
        vanilla_floor = floor_us(width, width * width)
        totals = {"vanilla": (steps * vanilla_us, steps * vanilla_us, steps * vanilla_floor, vanilla_peak, None)}
        step_rows.append({"context": context, "method": "vanilla", "kind": "every step", "count": steps,
                          "us": vanilla_us, "eager us": vanilla_us, "floor us": vanilla_floor,
                          "x floor": vanilla_us / vanilla_floor})
        knobs = {"dllm_cache": {}, "maskkv": {"budget": shapes["budget"], "profile": measured_profile(model, ctx)}}
        for name in knobs:
            method = get_method(name, **knobs[name])
            gpu, eager, first_peak = time_kinds(model, ctx, method, steps, setup.timer, device)
            counts = {kind: sum(step_kind(t, method) == kind for t in range(steps)) for kind in gpu}
            for kind, us in gpu.items():
                step_rows.append({"context": context, "method": name, "kind": kind, "count": counts[kind], "us": us,
                                  "eager us": eager[kind], "floor us": floors[kind][name],
                                  "x floor": us / floors[kind][name]})
            cache_gib = sum(c.keys.numel() * c.keys.element_size() * 2 for c in method.layers) / 2**30
            totals[name] = (*(sum(counts[kind] * times[kind] for kind in gpu) for times in (gpu, eager)),
                            sum(counts[kind] * floors[kind][name] for kind in gpu), first_peak, cache_gib)
            del method
        for name, (total, eager_total, floor_total, peak, cache_gib) in totals.items():
            gen_rows.append(row(context, name, **{
                "ms / generation": total / 1e3, "tokens/s": gen / (total / 1e6),
                "speedup vs vanilla": totals["vanilla"][0] / total, "eager tokens/s": gen / (eager_total / 1e6),
                "eager speedup": totals["vanilla"][1] / eager_total, "x floor": total / floor_total, "peak GiB": peak,
                "peak vs vanilla": peak / vanilla_peak, "peak vs reference vanilla": peak / reference_peak,
                "KV GiB": float("nan") if cache_gib is None else cache_gib}))
        gen_rows.append(row(context, "reference vanilla (full logits)", **{
            "peak GiB": reference_peak, "peak vs vanilla": reference_peak / vanilla_peak,
            "peak vs reference vanilla": 1.0}))
        if context == min(shapes["contexts"]):  # a real generation per method, host overhead included
            for name in knobs:
                seconds = generation_seconds(model, context, gen, shapes["block_length"],
                                             get_method(name, **knobs[name]), device)
                gen_rows.append(row(context, f"{name}, end to end", **{
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
