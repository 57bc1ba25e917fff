"""`python scripts/bench.py maskkv`: decoding speed and peak memory of the masked engine on the
llada-8b preset (random bf16 weights) with long prompts: vanilla, dllm_cache and MaskKV.

A generation of G tokens takes S steps (G = S = 256, block length 8). Vanilla forwards the whole
canvas every step. dllm_cache and MaskKV run one of four kinds of step, fixed by the step index t
(methods/dllm_cache.py): the first (exact; MaskKV also votes and evicts), a full refresh (t % T_p ==
0), a response refresh (t % T_r == 0) and a drift step (the rest). Each kind is timed on its own
(long steps eagerly with CUDA events, short ones as CUDA graphs with L2 evicted) and a generation is
assembled as sum over kinds of count x time; the engine's own per-step work (softmax and top-k over
8 x vocab logits) is left out. One real end-to-end generation at the shortest context checks the
assembly (as the engine runs it: host launch overhead included, drift steps and response refreshes
replayed from CUDA graphs, nanodllm/graphs.py).

Floors per step: max(weight bytes / copy bandwidth, FLOPs / matmul rate), FLOPs = 2 x non-embedding
parameters x rows forwarded + 4 x layers x hidden x (query rows x keys attended); a generation's
floor is the same sum of counts.
Peak memory = max allocated during a configuration (weights included), for vanilla as we run it
(logits of the active block only) and as LLaDA's reference loop computes it (logits and their
softmax over the whole canvas every step).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import nanodllm.graphs as graphs_module
from nanodllm.config import GenerationConfig, ModelConfig, preset
from nanodllm.loader import build_random
from nanodllm.generation import generate
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense, StepContext
from nanodllm.methods.maskkv import PROFILE_NAME, layer_importance

FULL = dict(contexts=(8192, 16384, 32768), gen_length=256, block_length=8, budget=256)
QUICK = dict(contexts=(96, 200), gen_length=16, block_length=4, budget=16)
QUICK_MODEL = dict(model_type="llada", d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, mlp_hidden_size=256,
                   vocab_size=256, mask_token_id=255, eos_token_id=254, max_sequence_length=1024)


def step_kind(t: int, method) -> str:
    if t == 0:
        return "first"
    prompt, response = t % method.prompt_interval == 0, t % method.response_interval == 0
    return {(True, True): "full refresh", (True, False): "prompt refresh", (False, True): "response refresh",
            (False, False): "drift"}[(prompt, response)]


def canvas_context(cfg, prompt, gen_length, block_length, device, batch=1, block=0) -> StepContext:
    """The masked engine's step context for `block` of a canvas of random prompt tokens + masks
    (shared by the masked-engine benchmarks)."""
    width = prompt + gen_length
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.mask_token_id, (batch, width), device=device, generator=generator)
    tokens[:, prompt:] = cfg.mask_token_id
    start = prompt + block * block_length
    return StepContext(tokens, torch.arange(width, device=device)[None].expand(batch, -1),
                       torch.ones_like(tokens, dtype=torch.bool), torch.full((batch,), prompt, device=device),
                       prompt_width=prompt, block=block, steps_per_block=block_length, mask_id=cfg.mask_token_id,
                       logits_start=start, logits_stop=start + block_length, block_length=block_length)


def logits(steps: Replayed, model, ctx):
    """A denoising step as the loops run it: the method's step, then its logits."""
    return steps.logits(model, steps.step(model, ctx), ctx)


def eager_us(fn, device, tries=3) -> float:
    fn()
    times = []
    for _ in range(tries):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
    return sorted(times)[len(times) // 2]


def peak_gib(fn, device) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 2**30


def time_kinds(model, ctx, method, steps, timer, device) -> tuple[dict, dict, float]:
    """For every kind of step the schedule uses: GPU microseconds (short kinds as CUDA graphs, host
    overhead excluded) and engine microseconds (host overhead included, as the engine runs them,
    through one Replayed: drift steps and response refreshes replay CUDA graphs), and the peak memory
    of the first step, each call at its step index t."""
    engine = Replayed(method)
    pinned = lambda t: logits(engine, model, replace(ctx, t=t))
    first_peak = peak_gib(lambda: pinned(0), device)  # t = 0 starts the caches afresh
    gpu = {"first": eager_us(lambda: pinned(0), device, tries=1)}
    eager = dict(gpu)
    for t in range(1, steps):
        kind = step_kind(t, method)
        if kind in gpu:
            continue
        eager[kind] = gpu[kind] = eager_us(lambda t=t: pinned(t), device)
        if kind in ("drift", "response refresh") and device.type == "cuda":  # no host syncs in these
            graphs_module.GRAPHS_ENABLED = False  # the timer records the step itself
            gpu[kind] = timer(lambda t=t: pinned(t))
            graphs_module.GRAPHS_ENABLED = True
    return gpu, eager, first_peak


def step_flops(cfg, rows, keys_attended, linear_params) -> float:
    return 2 * linear_params * rows + 4 * cfg.num_layers * cfg.hidden_size * keys_attended


@torch.no_grad()
def bench_maskkv(args, timer, report, measure_rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps, gen = shapes["gen_length"], shapes["gen_length"]
    longest = max(shapes["contexts"]) + gen
    cfg = ModelConfig.from_dict(QUICK_MODEL) if args.quick else preset("llada-8b", context=longest)
    bandwidth, matmul_rate = measure_rates()
    meta.update(copy_GBps=bandwidth, matmul_TFLOPs=matmul_rate, shapes=shapes)
    model = build_random(cfg, device=device, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read_bytes = weight_bytes - embed.numel() * embed.element_size()
    linear_params = read_bytes // embed.element_size()
    report.say(f"llada-8b shapes ({cfg.num_layers} layers, {cfg.num_heads} heads, hidden {cfg.hidden_size}), random "
               f"{str(dtype).removeprefix('torch.')} weights {weight_bytes / 1e9:.2f} GB; copy {bandwidth:.0f} GB/s, "
               f"matmul {matmul_rate:.0f} TFLOP/s. Generation: {gen} tokens, {steps} steps, block length "
               f"{shapes['block_length']}; dllm_cache and MaskKV at their defaults (T_p = 50, T_r = 5, rho = 0.25), "
               f"MaskKV budget {shapes['budget']} per head (layer profile measured once per context on its canvas: "
               "random weights).\n")

    def floor_us(rows, keys_attended):
        flops = step_flops(cfg, rows, keys_attended, linear_params)
        return max(read_bytes / bandwidth / 1e3, flops / matmul_rate / 1e6)

    step_rows, gen_rows = [], []
    for context in shapes["contexts"]:
        ctx = canvas_context(cfg, context, shapes["gen_length"], shapes["block_length"], device)
        width, budget = context + gen, min(shapes["budget"], context)
        dense = Dense()
        vanilla = Replayed(dense)
        vanilla_us = eager_us(lambda: logits(vanilla, model, ctx), device)
        vanilla_peak = peak_gib(lambda: logits(vanilla, model, ctx), device)
        reference_peak = peak_gib(lambda: model.head(model.hidden(ctx.tokens, ctx.positions,
                                                                  lambda i, q, k, v: dense.attend(i, q, k, v, ctx))
                                                     ).softmax(dim=-1), device)
        floors = {"vanilla": floor_us(width, width * width),
                  "first": floor_us(width, width * width),
                  "full refresh": {"dllm_cache": floor_us(width, width * width),
                                   "maskkv": floor_us(width, width * (budget + gen))},
                  "prompt refresh": {"dllm_cache": floor_us(context, context * width),
                                     "maskkv": floor_us(context, context * (budget + gen))},
                  "response refresh": {"dllm_cache": floor_us(gen, gen * width), "maskkv": floor_us(gen, gen * (budget + gen))},
                  "drift": {"dllm_cache": floor_us(gen // 4, gen // 4 * width),
                            "maskkv": floor_us(gen // 4, gen // 4 * (budget + gen))}}
        totals = {"vanilla": (steps * vanilla_us, steps * vanilla_us, steps * floors["vanilla"], vanilla_peak)}
        step_rows.append({"context": context, "method": "vanilla", "kind": "every step", "count": steps,
                          "us": vanilla_us, "eager us": vanilla_us, "floor us": floors["vanilla"],
                          "x floor": vanilla_us / floors["vanilla"]})
        maskkv_knobs = {"budget": shapes["budget"], "profile": measured_profile(model, ctx)}
        for name in ("dllm_cache", "maskkv"):
            method = get_method(name, **(maskkv_knobs if name == "maskkv" else {}))
            gpu, eager, first_peak = time_kinds(model, ctx, method, steps, timer, device)
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
            gen_rows.append({"context": context, "method": name, "ms / generation": total / 1e3,
                             "tokens/s": gen / (total / 1e6), "speedup vs vanilla": totals["vanilla"][0] / total,
                             "eager tokens/s": gen / (eager_total / 1e6),
                             "eager speedup": totals["vanilla"][1] / eager_total,
                             "x floor": total / floor_total, "peak GiB": peak,
                             "peak vs vanilla": peak / vanilla_peak, "peak vs reference vanilla": peak / reference_peak,
                             "KV GiB": cache[0] if cache else float("nan")})
        gen_rows.append(blank_row(context, "reference vanilla (full logits)", **{
            "peak GiB": reference_peak, "peak vs vanilla": reference_peak / vanilla_peak, "peak vs reference vanilla": 1.0}))
        print(f"[maskkv bench] {context} tokens done", file=sys.stderr, flush=True)
        if context == min(shapes["contexts"]):
            gen_rows += end_to_end(model, cfg, context, shapes, device, totals, maskkv_knobs)
        del ctx
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.table("Steps", step_rows, "Microseconds per step of the whole model, by kind; 'count' = steps of that "
                 "kind in one generation; 'us' = GPU time (drift and response refresh: CUDA graph replay, L2 "
                 "evicted; the long kinds eagerly with events), 'eager us' = one eager call, host launch overhead "
                 "included (drift steps and response refreshes: CUDA graphs replayed, as the engine runs them). "
                 "Floors: max(weight bytes / copy bandwidth, FLOPs / matmul rate).")
    report.table("Per generation", gen_rows, "Assembled from the step times (sum of count x us; 'eager' columns from "
                 "the eager step times, as the engine runs today); peak = max allocated (weights included) during "
                 "vanilla's step or the method's first step, the highest of its steps. KV GiB = the method's cached "
                 "K/V after the generation's last timed step, all layers.")


def blank_row(context, method, **values) -> dict:
    row = dict.fromkeys(["ms / generation", "tokens/s", "speedup vs vanilla", "eager tokens/s", "eager speedup",
                         "x floor", "peak GiB", "peak vs vanilla", "peak vs reference vanilla", "KV GiB"], float("nan"))
    return {"context": context, "method": method, **{**row, **values}}


def measured_profile(model, ctx) -> str:
    """MaskKV's layer importance measured once on this canvas (its online variant) as a profile file,
    so the timed steps and generations reuse it, as runs of a calibrated model do."""
    importance = layer_importance(model, ctx.tokens, ctx.positions, ctx.valid)[0]
    path = Path(tempfile.mkdtemp(prefix="nanodllm-maskkv-")) / PROFILE_NAME
    path.write_text(json.dumps({"layer_importance": importance}))
    return str(path)


def end_to_end(model, cfg, context, shapes, device, totals, maskkv_knobs) -> list[dict]:
    """A real generation per method as the engine runs it (host overhead included), against the
    assembled time."""
    prompt = torch.randint(0, cfg.mask_token_id, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = GenerationConfig(gen_length=shapes["gen_length"], block_length=shapes["block_length"],
                           steps=shapes["gen_length"])
    rows = []
    for name in ("dllm_cache", "maskkv"):
        method = get_method(name, **(maskkv_knobs if name == "maskkv" else {}))
        seconds = generation_seconds(model, prompt, gen, method, device)
        rows.append(blank_row(context, f"{name}, end to end", **{
            "ms / generation": seconds * 1e3, "eager tokens/s": gen.gen_length / seconds,
            "eager speedup": totals["vanilla"][0] / (seconds * 1e6)}))
    return rows


def generation_seconds(model, prompt, gen, method, device) -> float:
    """Wall time of the second of two generations by one method object. The first pays for compiling
    and autotuning kernels; the engine records its CUDA graphs again in the timed one (each generation
    records its own)."""
    generate(model, [prompt], gen, method)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    generate(model, [prompt], gen, method)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
