"""`python scripts/bench.py dyllm`: DyLLM's sparse steps on the llada-8b preset (random bf16 weights),
512-token prompts + 256 response tokens, batch 1 and 16, against vanilla and Fast-dLLM's dual cache
(docs/results/bench_dyllm.md). Random weights make saliency meaningless, so the salient fraction is
fixed per layer (the `salient_fraction` knob) at 10%, 25%, 50% or --fractions. Each kind of step is
timed with CUDA events, host overhead included, as the engine runs it (one Replayed per method: the
dual cache's cached step and DyLLM's sparse steps replay CUDA graphs; 'eager' rows: graphs off), and
a generation assembled. Floor per step: max(weight bytes / copy bandwidth, FLOPs / matmul rate),
FLOPs as DyLLM computes them: Q and o_proj for every fed row, K/V and the FFN for the salient rows,
attention for the salient rows over all keys.

`python scripts/bench.py dyllm_salient`: the salient fraction of the fed rows per layer after each
sparse step of one tiny-llada generation over n passkey prompts (CPU float32; the paper's Fig. 7),
written to dyllm_salient.json for scripts/plot_results.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch

import nanodllm.graphs as graphs_module
from harness import QUICK_LLADA, canvas_context, logits, read_bytes, wall_us
from nanodllm import tasks
from nanodllm.cli import write_whole
from nanodllm.eval import Runner, resolve_model
from nanodllm.graphs import Replayed
from nanodllm.methods import get_method
from nanodllm.methods.base import Dense

FULL = dict(prompt=512, gen_length=256, block_length=32, batches=(1, 16), fractions=(0.1, 0.25, 0.5))
QUICK = dict(prompt=48, gen_length=16, block_length=4, batches=(1, 2), fractions=(0.25,))
FULL_STEPS = 4  # DyLLM's dense steps before the sparse ones


def graphs_on_and_off(name):
    """Yields the row name with CUDA graphs on, then off ('<name> eager'); leaves them on."""
    for enabled in (True, False):
        graphs_module.GRAPHS_ENABLED = enabled
        yield name if enabled else f"{name} eager"
    graphs_module.GRAPHS_ENABLED = True


@torch.no_grad()
def dyllm(setup):
    device, shapes = setup.device, setup.shapes(QUICK, FULL)
    fractions = setup.meta["fractions"] = tuple(setup.args.fractions or shapes["fractions"])
    model = setup.random_model(QUICK_LLADA, "llada-8b")
    cfg, (bandwidth, matmul_rate), weight_bytes = model.cfg, setup.ceilings, read_bytes(model)
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers  # FLOPs per row, all layers:
    q_and_o = 4 * layers * h * cfg.num_heads * d
    kv_and_ffn = layers * (4 * h * cfg.num_kv_heads * d + 6 * h * cfg.intermediate_size)
    width, response, block = shapes["prompt"] + shapes["gen_length"], shapes["gen_length"], shapes["block_length"]

    def floor_us(batch, fed, salient, attended_rows):
        flops = batch * (fed * q_and_o + salient * kv_and_ffn + 4 * layers * cfg.num_heads * d * attended_rows * width)
        return max(weight_bytes / bandwidth / 1e3, flops / matmul_rate / 1e6)

    steps = response
    canvas_steps = sum(t >= FULL_STEPS and t % 4 == 0 for t in range(steps))  # feed the whole canvas
    response_steps = steps - FULL_STEPS - canvas_steps
    setup.say_ceilings(f"Prompt {shapes['prompt']} + {response} generated tokens, {steps} steps, blocks of {block}. "
                       f"DyLLM: {FULL_STEPS} full steps, then {canvas_steps} sparse steps over the whole canvas and "
                       f"{response_steps} over the response.")
    step_rows, rows = [], []
    for batch in shapes["batches"]:
        ctx = canvas_context(cfg, shapes["prompt"], response, block, device, batch=batch)
        dense = Replayed(Dense(), model)
        full_us, full_floor = wall_us(lambda: logits(dense, model, ctx), device), floor_us(batch, width, width, width)
        dual = Replayed(get_method("fast_dllm", mode="dual"), model)
        dual.begin_block(ctx)
        build_us = wall_us(lambda: (dual.begin_block(ctx), logits(dual, model, ctx)), device)
        times, floors = {"vanilla": steps * full_us}, {"vanilla": steps * full_floor}
        step_rows += [{"batch": batch, "method": "vanilla", "step": "full", "us": full_us, "floor us": full_floor},
                      {"batch": batch, "method": "fast_dllm dual", "step": "build", "us": build_us,
                       "floor us": float("nan")}]
        cached, cached_floor = replace(ctx, step=1), floor_us(batch, block, block, block)
        for name in graphs_on_and_off("fast_dllm dual"):
            cached_us = wall_us(lambda: logits(dual, model, cached), device, warmups=3)
            times[name] = steps // block * (build_us + (block - 1) * cached_us)
            step_rows.append({"batch": batch, "method": name, "step": "cached", "us": cached_us,
                              "floor us": cached_floor})
        for fraction in fractions:
            method = get_method("dyllm", salient_fraction=fraction)
            sparse = Replayed(method, model)
            method.begin_block(ctx)
            for t in range(FULL_STEPS):
                logits(sparse, model, replace(ctx, t=t))
            for name in graphs_on_and_off(f"dyllm {fraction:.0%}"):
                times[name], floors[name] = FULL_STEPS * full_us, FULL_STEPS * full_floor
                for label, t, fed, count in (("whole canvas", 8, width, canvas_steps),
                                             ("response only", 5, response, response_steps)):
                    # 3 warm-ups: a graphed step records once per capacity of its first layer's salient set
                    us = wall_us(lambda t=t: logits(sparse, model, replace(ctx, t=t)), device, warmups=3)
                    salient = int(fraction * fed + 0.999)
                    floor = floor_us(batch, fed, salient, salient)
                    step_rows.append({"batch": batch, "method": name, "step": label, "us": us, "floor us": floor})
                    times[name] += count * us
                    floors[name] += count * floor
        rows += [{"batch": batch, "method": name, "tokens/s": batch * response / (us / 1e6),
                  "speedup vs vanilla": times["vanilla"] / us, "vs fast_dllm dual": times["fast_dllm dual"] / us,
                  "x floor": us / floors[name] if name in floors else float("nan")} for name, us in times.items()]
        setup.free()
    setup.report.table("Steps", step_rows, "Microseconds per step of the whole model, host overhead included; "
                       "'eager' rows: CUDA graphs off. Floors: max(weight bytes / copy bandwidth, FLOPs of the rows "
                       "computed / matmul rate).")
    setup.report.table("Per generation", rows, "Assembled from the step times; tokens/s counts every row of the batch.")
    return "bench_dyllm"


def dyllm_salient(setup):
    """One generation's per-layer salient fractions (a batch of n passkey prompts; 32 tokens, one block of
    32 steps). Steps t % full_period == 0 feed the whole canvas, the others the response only: their
    fractions are of different row counts. The first full_steps steps are dense (not recorded)."""
    args = setup.args
    length, n = (256, 2) if setup.quick else (args.length, args.n)
    runner = Runner(resolve_model("tiny-llada"), "cpu", torch.float32, None)
    runner.knobs = {"tau": args.tau}
    samples = tasks.make_samples("passkey", length, n, seed=1234, count_tokens=runner.count_tokens)
    methods, history = [], []  # history: (step, each layer's salient fraction of the fed rows) per sparse step

    def record(method):
        """Keep what the method states after each sparse step (its rows_computed, which the meter reads)."""
        stated = method.rows_computed
        method.rows_computed = lambda ctx: noted(ctx, stated(ctx))
        methods.append(method)

    def noted(ctx, computed):
        if computed is not None:
            history.append((ctx.t, computed[0].tolist()))
        return computed

    outcome = runner.generate(samples, "dyllm", prepare=record)
    accuracy, period = sum(outcome.scores) / len(outcome.scores), methods[0].full_period
    result = {"model": "tiny-llada", "length": length, "n": n, "tau": args.tau, "accuracy": accuracy,
              "full_period": period, "steps": [t for t, _ in history], "per_layer": [f for _, f in history]}
    out = args.out / ("dyllm_salient_quick.json" if setup.quick else "dyllm_salient.json")
    args.out.mkdir(parents=True, exist_ok=True)
    write_whole(out, lambda partial: partial.write_text(json.dumps(result, indent=1) + "\n"))
    layers = len(result["per_layer"][0])
    print(f"tiny-llada, passkey {length}, n {n}, tau {args.tau}: accuracy {accuracy:.3f}\n")
    print("| step | fed | " + " | ".join(f"layer {i}" for i in range(layers)) + " |\n|---|---|" + "---|" * layers)
    for t, fractions in history:
        print(f"| {t} | {'canvas' if t % period == 0 else 'response'} | " + " | ".join(f"{f:.2f}" for f in fractions)
              + " |")
    print(f"\nwrote {out}")
