"""`python scripts/bench.py sparse_dllm`: throughput and peak memory of the masked engine on the
llada-8b preset (random bf16 weights) at sequence lengths 1K-32K: vanilla, Fast-dLLM's prefix and
dual caches, Sparse-dLLM (the paper's Fig. 5, as a table).

A sequence of N tokens is a prompt of N - G tokens and G = 256 generated ones, 8 blocks of 32, 32
steps per block. Per block, vanilla runs 32 full steps; fast_dllm one full step that builds its cache
and 31 cached steps; sparse_dllm (delay 1) a full step, a full step that builds the pruned cache and
30 cached steps. Each kind of step is timed on its own, eagerly with CUDA events as the engine runs it
(through one nanodllm/graphs.py Replayed per method: the cached steps replay a CUDA graph, recorded by
the first call, outside the timing), and a generation is assembled from them; the prefix cache's
cached steps feed the block and the suffix, so they are timed in every block. Peak memory = max
allocated (weights included) over a method's building and cached steps, vanilla's over a full step.
One real generation per method at the shortest length checks the assembly (host overhead included;
the second of two by one method object, so compiling and autotuning kernels is left out; each
generation records its own graphs).
Floors per step: max(weight bytes / copy bandwidth, FLOPs / matmul rate) as in bench_maskkv.py.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from bench_maskkv import canvas_context, eager_us, generation_seconds, logits, peak_gib, step_flops
from nanodllm.config import GenerationConfig, ModelConfig, preset
from nanodllm.loader import build_random
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense, StepContext

FULL = dict(lengths=(1024, 4096, 8192, 16384, 32768), gen_length=256, block_length=32)
QUICK = dict(lengths=(96, 160), gen_length=16, block_length=4)
QUICK_MODEL = dict(model_type="llada", d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, mlp_hidden_size=256,
                   vocab_size=256, mask_token_id=255, eos_token_id=254, max_sequence_length=1024)
METHODS = {"fast_dllm prefix": ("fast_dllm", {"mode": "prefix"}), "fast_dllm dual": ("fast_dllm", {"mode": "dual"}),
           "sparse_dllm": ("sparse_dllm", {})}


def block_context(cfg, length, block, shapes, device) -> StepContext:
    return canvas_context(cfg, length - shapes["gen_length"], shapes["gen_length"], shapes["block_length"], device,
                          block=block)


def method_block(model, ctx, steps, device):
    """(us of the building step, us of a cached step, peak GiB) for one block; steps: the method's Replayed."""
    method = steps.method
    building, cached_ctx = replace(ctx, step=method.delay), replace(ctx, step=method.delay + 1)
    method.begin_block(building)
    build = lambda: (method.begin_block(building), logits(steps, model, building))
    peak = peak_gib(build, device)
    build_us = eager_us(build, device, tries=1)
    cached = lambda: logits(steps, model, cached_ctx)
    peak = max(peak, peak_gib(cached, device))
    cached_us = eager_us(cached, device)
    return build_us, cached_us, peak


@torch.no_grad()
def bench_sparse_dllm(args, timer, report, measure_rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen, block, blocks = shapes["gen_length"], shapes["block_length"], shapes["gen_length"] // shapes["block_length"]
    cfg = ModelConfig.from_dict(QUICK_MODEL) if args.quick else preset("llada-8b", context=max(shapes["lengths"]))
    bandwidth, matmul_rate = measure_rates()
    meta.update(copy_GBps=bandwidth, matmul_TFLOPs=matmul_rate, shapes=shapes)
    model = build_random(cfg, device=device, dtype=dtype)
    embed = model.embed_tokens.weight
    read_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    linear_params = read_bytes // embed.element_size()
    floor_us = lambda rows, keys: max(read_bytes / bandwidth / 1e3,
                                      step_flops(cfg, rows, keys, linear_params) / matmul_rate / 1e6)
    report.say(f"llada-8b shapes ({cfg.num_layers} layers, hidden {cfg.hidden_size}), random "
               f"{str(dtype).removeprefix('torch.')} weights; copy {bandwidth:.0f} GB/s, matmul {matmul_rate:.0f} "
               f"TFLOP/s. {gen} generated tokens in {blocks} blocks of {block}, {block} steps per block; "
               "sparse_dllm at the paper's defaults (r = 0.5, kernel 3, delay 1).\n")
    rows, step_rows = [], []
    for length in shapes["lengths"]:
        middle = block_context(cfg, length, blocks // 2, shapes, device)
        vanilla = Replayed(Dense())
        full_us = eager_us(lambda: logits(vanilla, model, middle), device)
        vanilla_peak = peak_gib(lambda: logits(vanilla, model, middle), device)
        totals = {"vanilla": (gen * full_us, gen * floor_us(length, length * length), vanilla_peak)}
        step_rows.append({"length": length, "method": "vanilla", "step": "full", "us": full_us,
                          "floor us": floor_us(length, length * length)})
        for label, (name, knobs) in METHODS.items():
            method = get_method(name, **knobs)
            steps = Replayed(method)
            timed = [0] if label != "fast_dllm prefix" else range(blocks)  # dual caches cost the same in every block
            total = floor = 0.0
            peaks = []
            for b in timed:
                ctx = middle if label != "fast_dllm prefix" else block_context(cfg, length, b, shapes, device)
                build_us, cached_us, block_peak = method_block(model, ctx, steps, device)
                fed = block if method.mode == "dual" else length - ctx.logits_start
                if name == "sparse_dllm":
                    kept = int(method.ratio * (length - block))
                else:
                    kept = length - block if method.mode == "dual" else ctx.logits_start
                cached_floor = floor_us(fed, fed * (kept + fed))
                full_steps = method.delay  # full steps before the building one
                cached_steps = block - method.delay - 1
                share = blocks / len(timed)
                total += share * (full_steps * full_us + build_us + cached_steps * cached_us)
                floor += share * ((full_steps + 1) * floor_us(length, length * length) + cached_steps * cached_floor)
                peaks.append(block_peak)
                step_rows.append({"length": length, "method": label, "step": f"block {ctx.block}: build",
                                  "us": build_us, "floor us": floor_us(length, length * length)})
                step_rows.append({"length": length, "method": label, "step": f"block {ctx.block}: cached",
                                  "us": cached_us, "floor us": cached_floor})
            totals[label] = (total, floor, max(peaks))  # nan on a CPU
            del method, steps
        for label, (total, floor, peak) in totals.items():
            rows.append({"length": length, "method": label, "tokens/s": gen / (total / 1e6),
                         "speedup vs vanilla": totals["vanilla"][0] / total, "x floor": total / floor,
                         "peak GiB": peak, "peak vs vanilla": peak / vanilla_peak})
        print(f"[sparse_dllm bench] {length} tokens done", file=sys.stderr, flush=True)
        if length == min(shapes["lengths"]):
            rows += end_to_end(model, cfg, length, shapes, device, totals)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.table("Steps", step_rows, "Microseconds per step of the whole model, eager (the cached steps "
                 "replay a CUDA graph, as the engine runs them); the prefix cache is timed in every block, the others in the "
                 "middle one. Floors: max(weight bytes / copy bandwidth, FLOPs / matmul rate).")
    report.table("Per generation", rows, "Assembled from the step times (see scripts/bench_sparse_dllm.py); "
                 "'a real generation' rows time masked.generate end to end, eagerly (a second generation of one "
                 "method object).")


def end_to_end(model, cfg, length, shapes, device, totals) -> list[dict]:
    prompt = torch.randint(0, cfg.mask_token_id, (length - shapes["gen_length"],),
                           generator=torch.Generator().manual_seed(1)).tolist()
    gen = GenerationConfig(gen_length=shapes["gen_length"], block_length=shapes["block_length"],
                           steps=shapes["gen_length"])
    rows = []
    for label, (name, knobs) in METHODS.items():
        seconds = generation_seconds(model, prompt, gen, get_method(name, **knobs), device)
        rows.append({"length": length, "method": f"{label}, a real generation", "tokens/s": gen.gen_length / seconds,
                     "speedup vs vanilla": totals["vanilla"][0] / (seconds * 1e6), "x floor": float("nan"),
                     "peak GiB": float("nan"), "peak vs vanilla": float("nan")})
    return rows
