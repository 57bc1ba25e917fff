"""`python scripts/bench.py sparse_dllm`: throughput and peak memory of the masked engine on the
llada-8b preset (random bf16 weights) at 1K-32K: vanilla, Fast-dLLM's prefix and dual caches,
Sparse-dLLM (the paper's Fig. 5 as a table; docs/results/bench_sparse_dllm.md).

N tokens are a prompt of N - 256 and 256 generated ones, 8 blocks of 32 steps. Each kind of step
(vanilla's full step, a method's building and cached steps) is timed eagerly with CUDA events as
the engine runs it (one Replayed per method: cached steps replay a CUDA graph) and a generation is
assembled; the prefix cache's steps are timed in every block, the others' in the middle one. One
real generation per method at the shortest length checks the assembly. Floors: harness.step_floor.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness import QUICK_LLADA, canvas_context, generation_seconds, logits, peak_gib, step_floor, wall_us
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense

FULL = dict(lengths=(1024, 4096, 8192, 16384, 32768), gen_length=256, block_length=32)
QUICK = dict(lengths=(96, 160), gen_length=16, block_length=4)
METHODS = {"fast_dllm prefix": ("fast_dllm", {"mode": "prefix"}), "fast_dllm dual": ("fast_dllm", {"mode": "dual"}),
           "sparse_dllm": ("sparse_dllm", {})}


def method_block(model, ctx, steps, device):
    """(us of the building step, us of a cached step, peak GiB) for one block; steps: the method's Replayed."""
    method = steps.method
    building, cached_ctx = replace(ctx, step=method.delay), replace(ctx, step=method.delay + 1)
    method.begin_block(building)
    build = lambda: (method.begin_block(building), logits(steps, model, building))
    cached = lambda: logits(steps, model, cached_ctx)
    peak = peak_gib(build, device)
    build_us = wall_us(build, device, tries=1)
    return build_us, wall_us(cached, device), max(peak, peak_gib(cached, device))


@torch.no_grad()
def sparse_dllm(setup):
    device, shapes = setup.device, setup.shapes(QUICK, FULL)
    gen, block = shapes["gen_length"], shapes["block_length"]
    blocks = gen // block
    model = setup.random_model(QUICK_LLADA, "llada-8b", context=max(shapes["lengths"]))
    floor_us = step_floor(model.cfg, model, setup.ceilings, block)
    setup.say_ceilings(f"{gen} generated tokens in {blocks} blocks of {block}, {block} steps per block; "
                       "sparse_dllm at the paper's defaults.")
    context_of = lambda length, b: canvas_context(model.cfg, length - gen, gen, block, device, block=b)
    rows, step_rows = [], []
    for length in shapes["lengths"]:
        middle = context_of(length, blocks // 2)
        vanilla = Replayed(Dense(), model)
        full_us = wall_us(lambda: logits(vanilla, model, middle), device)
        vanilla_peak = peak_gib(lambda: logits(vanilla, model, middle), device)
        full_floor = floor_us(length, length * length)
        totals = {"vanilla": (gen * full_us, gen * full_floor, vanilla_peak)}
        step_rows.append({"length": length, "method": "vanilla", "step": "full", "us": full_us, "floor us": full_floor})
        for label, (name, knobs) in METHODS.items():
            method = get_method(name, **knobs)
            steps, prefix = Replayed(method, model), label == "fast_dllm prefix"
            timed = range(blocks) if prefix else [0]  # dual caches cost the same in every block
            total = floor = 0.0
            peaks = []
            for b in timed:
                ctx = context_of(length, b) if prefix else middle
                build_us, cached_us, block_peak = method_block(model, ctx, steps, device)
                fed = block if method.mode == "dual" else length - ctx.logits_start
                if name == "sparse_dllm":
                    kept = int(method.ratio * (length - block))
                else:
                    kept = length - block if method.mode == "dual" else ctx.logits_start
                cached_floor = floor_us(fed, fed * (kept + fed))
                cached_steps = block - method.delay - 1  # after method.delay full steps and the building one
                share = blocks / len(timed)
                total += share * (method.delay * full_us + build_us + cached_steps * cached_us)
                floor += share * ((method.delay + 1) * full_floor + cached_steps * cached_floor)
                peaks.append(block_peak)
                step_rows += [{"length": length, "method": label, "step": f"block {ctx.block}: {kind}", "us": us,
                               "floor us": kind_floor} for kind, us, kind_floor in
                              (("build", build_us, full_floor), ("cached", cached_us, cached_floor))]
            totals[label] = (total, floor, max(peaks))  # nan on a CPU
            del method, steps
        rows += [{"length": length, "method": label, "tokens/s": gen / (total / 1e6),
                  "speedup vs vanilla": totals["vanilla"][0] / total, "x floor": total / floor, "peak GiB": peak,
                  "peak vs vanilla": peak / vanilla_peak} for label, (total, floor, peak) in totals.items()]
        if length == min(shapes["lengths"]):  # a real generation per method, host overhead included
            for label, (name, knobs) in METHODS.items():
                seconds = generation_seconds(model, length - gen, gen, block, get_method(name, **knobs), device)
                rows.append({"length": length, "method": f"{label}, a real generation", "tokens/s": gen / seconds,
                             "speedup vs vanilla": totals["vanilla"][0] / (seconds * 1e6),
                             **dict.fromkeys(("x floor", "peak GiB", "peak vs vanilla"), float("nan"))})
        setup.free()
    setup.report.table("Steps", step_rows, "Microseconds per step of the whole model, eager (cached steps replay a "
                       "CUDA graph, as the engine runs them); the prefix cache is timed in every block, the others in "
                       "the middle one.")
    setup.report.table("Per generation", rows, "Assembled from the step times; 'a real generation' rows time "
                       "masked.generate end to end (the second generation of one method object).")
    return "bench_sparse_dllm"
