"""`python scripts/bench.py dyllm`: DyLLM's sparse steps on the llada-8b preset (random bf16 weights),
512-token prompts + 256 response tokens, batch 1 and 16, against vanilla and Fast-dLLM's dual cache.

Random weights make saliency meaningless, so the sparse steps run with the salient fraction fixed
per layer (the `salient_fraction` knob: the lowest-cosine rows of each layer) at 10%, 25% and 50%
(and at whatever `--fractions` lists, e.g. those measured on tiny-llada). A generation is 256 steps,
blocks of 32 (LLaDA's setting, one token per step): vanilla runs 256 full steps; DyLLM 4 full steps,
then sparse steps that feed the whole canvas when t % 4 == 0 and only the response otherwise;
fast_dllm dual per block one building full step and 31 cached steps. Each kind of step is timed with
CUDA events, host overhead included, and the generation assembled. Steps run as the engine runs
them, through one nanodllm/graphs.py Replayed per method: Fast-dLLM's cached step and DyLLM's
fixed-fraction sparse steps (fixed shapes, no host syncs) replay CUDA graphs; each is also timed with
graphs off ("eager" rows), in the same run.
Floor per step: max(weight bytes / copy bandwidth, FLOPs / matmul rate), FLOPs counted per row as
DyLLM computes them: Q and o_proj for every fed row, K/V and the FFN for the salient rows, exact
attention for the salient rows over all keys.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import nanodllm.graphs as graphs_module
from bench_maskkv import canvas_context, eager_us, logits
from nanodllm.config import ModelConfig, preset
from nanodllm.loader import build_random
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense

FULL = dict(prompt=512, gen_length=256, block_length=32, batches=(1, 16), fractions=(0.1, 0.25, 0.5))
QUICK = dict(prompt=48, gen_length=16, block_length=4, batches=(1, 2), fractions=(0.25,))
QUICK_MODEL = dict(model_type="llada", d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, mlp_hidden_size=256,
                   vocab_size=256, mask_token_id=255, eos_token_id=254, max_sequence_length=1024)


def linear_flops(cfg) -> dict:
    """FLOPs per row of each projection group, all layers."""
    h, d, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    per_layer = {"q": 2 * h * cfg.num_heads * d, "kv": 4 * h * kv * d, "o": 2 * cfg.num_heads * d * h,
                 "ffn": 6 * h * cfg.intermediate_size}
    return {name: flops * cfg.num_layers for name, flops in per_layer.items()}


def graphs_on_and_off(name):
    """Yields (row name, enabled) with CUDA graphs on, then off ('<name> eager'); leaves them on."""
    for enabled in (True, False):
        graphs_module.GRAPHS_ENABLED = enabled
        yield (name if enabled else f"{name} eager"), enabled
    graphs_module.GRAPHS_ENABLED = True


def timed_twice_warm(fn, device) -> float:
    """eager_us after two more calls: a graphed step records once per capacity of its first layer's
    salient set (all rows right after a full step, then the fixed fraction)."""
    fn()
    fn()
    return eager_us(fn, device)


@torch.no_grad()
def bench_dyllm(args, timer, report, measure_rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    fractions = tuple(args.fractions) if getattr(args, "fractions", None) else shapes["fractions"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(QUICK_MODEL) if args.quick else preset("llada-8b")
    bandwidth, matmul_rate = measure_rates()
    meta.update(copy_GBps=bandwidth, matmul_TFLOPs=matmul_rate, shapes=shapes, fractions=fractions)
    model = build_random(cfg, device=device, dtype=dtype)
    embed = model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    flops = linear_flops(cfg)
    width, response = shapes["prompt"] + shapes["gen_length"], shapes["gen_length"]
    attention_flops = lambda rows, keys: 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * keys

    def floor_us(batch, fed, salient, attended_rows):
        total = batch * (fed * (flops["q"] + flops["o"]) + salient * (flops["kv"] + flops["ffn"])
                         + attention_flops(attended_rows, width))
        return max(weight_bytes / bandwidth / 1e3, total / matmul_rate / 1e6)

    steps = shapes["gen_length"]
    blocks = steps // shapes["block_length"]
    full_kinds = [t for t in range(steps) if t >= 4 and t % 4 == 0]
    report.say(f"llada-8b shapes, random {str(dtype).removeprefix('torch.')} weights; copy {bandwidth:.0f} GB/s, "
               f"matmul {matmul_rate:.0f} TFLOP/s. Prompt {shapes['prompt']} + {response} generated tokens, {steps} "
               f"steps, blocks of {shapes['block_length']}. DyLLM: 4 full steps, then {len(full_kinds)} sparse "
               f"steps over the whole canvas and {steps - 4 - len(full_kinds)} over the response only.\n")
    step_rows, rows = [], []
    for batch in shapes["batches"]:
        ctx = canvas_context(cfg, shapes["prompt"], shapes["gen_length"], shapes["block_length"], device, batch=batch)
        dense = Replayed(Dense())
        full_us = eager_us(lambda: logits(dense, model, ctx), device)
        full_floor = floor_us(batch, width, width, width)
        dual = Replayed(get_method("fast_dllm", mode="dual"))
        dual.begin_block(ctx)
        build_us = eager_us(lambda: (dual.begin_block(ctx), logits(dual, model, ctx)), device)
        times, floors = {"vanilla": steps * full_us}, {"vanilla": steps * full_floor}
        step_rows += [{"batch": batch, "method": "vanilla", "step": "full", "us": full_us, "floor us": full_floor},
                      {"batch": batch, "method": "fast_dllm dual", "step": "build",
                       "us": build_us, "floor us": float("nan")}]
        cached = replace(ctx, step=1)
        cached_floor = floor_us(batch, shapes["block_length"], shapes["block_length"], shapes["block_length"])
        for name, enabled in graphs_on_and_off("fast_dllm dual"):
            cached_us = timed_twice_warm(lambda: logits(dual, model, cached), device)
            times[name] = blocks * (build_us + (shapes["block_length"] - 1) * cached_us)
            step_rows.append({"batch": batch, "method": name, "step": "cached", "us": cached_us,
                              "floor us": cached_floor})
        for fraction in fractions:
            method = get_method("dyllm", salient_fraction=fraction)
            dyllm_steps = Replayed(method)
            method.begin_block(ctx)
            for t in range(4):  # the full steps
                logits(dyllm_steps, model, replace(ctx, t=t))
            for name, enabled in graphs_on_and_off(f"dyllm {fraction:.0%}"):
                kinds = {}
                floors[name] = 4 * full_floor
                for label, t in (("whole canvas", 8), ("response only", 5)):
                    fed = width if label == "whole canvas" else response
                    kinds[label] = timed_twice_warm(lambda t=t: logits(dyllm_steps, model, replace(ctx, t=t)), device)
                    salient = int(fraction * fed + 0.999)
                    floor = floor_us(batch, fed, salient, salient)
                    step_rows.append({"batch": batch, "method": name, "step": label, "us": kinds[label],
                                      "floor us": floor})
                    floors[name] += (len(full_kinds) if label == "whole canvas" else steps - 4 - len(full_kinds)) * floor
                times[name] = (4 * full_us + len(full_kinds) * kinds["whole canvas"]
                               + (steps - 4 - len(full_kinds)) * kinds["response only"])
        for name, us in times.items():
            rows.append({"batch": batch, "method": name, "tokens/s": batch * response / (us / 1e6),
                         "speedup vs vanilla": times["vanilla"] / us,
                         "vs fast_dllm dual": times["fast_dllm dual"] / us,
                         "x floor": us / floors[name] if name in floors else float("nan")})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.table("Steps", step_rows, "Microseconds per step of the whole model, host overhead included; "
                 "'eager' rows: CUDA graphs off. "
                 "Floors: max(weight bytes / copy bandwidth, FLOPs of the rows computed / matmul rate).")
    report.table("Per generation", rows, "Assembled from the step times; tokens/s counts every row of the batch.")
