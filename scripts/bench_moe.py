"""`python scripts/bench.py moe`: one layer's mixture-of-experts MLP on the llada2-mini and
sdar-30b-a3b presets (random bf16 weights), for a block step's rows (32 x batch 1, 4 and 16) and a
32K-token prefill: the fused layer (nanodllm/fused.py FusedMoE; CUDA graph, L2 flushed) with its
experts on kernels/expert_linear.py (block steps only) and on torch's grouped matmuls, and the
per-expert loop (nanodllm/mlp.py MoE, which asks the host which experts were chosen: eager), next
to the floor: max(the bytes of the touched experts, the shared expert and the router / copy
bandwidth, FLOPs / matmul rate). docs/results/bench_moe.md.

`--generate MODEL`: block.generate on that preset at 32K-128K, batch 1 and 4, CUDA graphs on: ms
per block (CUDA events as each block begins; the median of the blocks after the first) of the exact
engine, the exact engine on torch SDPA, MAGE at k = 1024 and 512, Quest and SparseD at k = 1024,
each next to its floor (block_floor_ms); with --quick one 4K prompt, 8 steps a block (the preset's
weights all the same). docs/results/bench_moe_MODEL.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from functools import partial

import torch
import torch.nn.functional as F

import nanodllm.experts as experts_module
import nanodllm.graphs as graphs_module
from harness import (GENERATION_BLOCKS, QUICK_MOE, block_floor_ms, config_of, kv_bytes, random_prompts,
                     timed_generation, too_big, touched_experts_per_forward)
from nanodllm.kernels.expert_linear import (FEW_ROWS_PER_EXPERT, beats_grouped_mm, expert_linear, glu_reference,
                                           group_by_expert, tile_shape)
from nanodllm.loader import build_random
from nanodllm.methods import Dense, get_method
from nanodllm.mlp import MoE

FULL = dict(presets=("llada2-mini", "sdar-30b-a3b"), step_rows=(32, 128, 512), prefill_rows=32768,
            expert_presets=("llada2-mini", "sdar-30b-a3b", "diffusiongemma-26b-a4b"),
            expert_tokens=(32, 256, 1024, 2048), expert_pools=(1, 4))
QUICK = dict(presets=("quick",), step_rows=(8, 16), prefill_rows=64, expert_presets=("quick",), expert_tokens=(8, 64),
             expert_pools=(1, 4))
GENERATE = {"llada2-mini": dict(contexts=(32768, 65536, 131072), batches=(1, 4), ks=(1024, 512), block=32, steps=32),
            "sdar-30b-a3b": dict(contexts=(32768, 65536), batches=(1, 4), ks=(1024, 512), block=32, steps=32)}
QUICK_GENERATE = dict(contexts=(4096,), batches=(1,), ks=(1024,), block=32, steps=8)  # the preset's weights


def timed_path(timer, moe_layer, x, on_kernel: bool) -> float:
    """Microseconds of the fused layer with its experts on expert_linear or on torch's grouped matmuls
    (nanodllm/experts.py's beats_grouped_mm set to pick the one)."""
    saved, experts_module.beats_grouped_mm = experts_module.beats_grouped_mm, lambda *sizes: on_kernel
    try:
        return timer(lambda: moe_layer(x))
    finally:
        experts_module.beats_grouped_mm = saved


@torch.no_grad()
def mlp_row(cfg, moe_layer, rows, step, setup) -> dict:
    (bandwidth, matmul_rate), dtype = setup.ceilings, setup.dtype
    x = torch.randn(1, rows, cfg.hidden_size, device=setup.device, dtype=dtype)
    touched = int(moe_layer.gate(x.view(rows, -1))[0].unique().numel())
    model_on_kernel = beats_grouped_mm(rows * cfg.moe.experts_per_token, cfg.moe.num_experts)
    on_kernel = step or model_on_kernel  # a long prefill's rows: grouped_mm's only
    expert_us = timed_path(setup.timer, moe_layer, x, True) if on_kernel else None
    grouped_mm_us = timed_path(setup.timer, moe_layer, x, False)
    loop_us = setup.timer.eager(lambda: MoE.forward(moe_layer, x))
    path = "expert_linear" if model_on_kernel else "grouped_mm"
    model_us = expert_us if path == "expert_linear" else grouped_mm_us
    moe, h, element = cfg.moe, cfg.hidden_size, torch.finfo(dtype).bits // 8
    shared_and_router = 3 * h * moe.shared_size + moe.num_experts * h
    bytes_us = (touched * 3 * h * moe.expert_size + shared_and_router) * element / bandwidth / 1e3
    flops_us = 2 * rows * (moe.experts_per_token * 3 * h * moe.expert_size + shared_and_router) / matmul_rate / 1e6
    floor_us = max(bytes_us, flops_us)
    return {"rows": rows, "experts touched": f"{touched}/{moe.num_experts}", "expert_linear us": expert_us or "-",
            "grouped_mm us": grouped_mm_us,
            "grouped_mm / expert_linear": grouped_mm_us / expert_us if on_kernel else "-", "model runs": path,
            "per-expert loop us": loop_us, "loop / model's": loop_us / model_us, "floor us": floor_us,
            "model's / floor": model_us / floor_us, "floor bound": "bytes" if bytes_us >= flops_us else "FLOPs"}


class TorchSdpa(Dense):
    """The exact engine with its cached steps on torch's scaled_dot_product_attention instead of our
    split-KV kernel: the cache read in place up to its launch bound, each row's keys past its length
    hidden by a mask (so the step can be recorded as a graph). The prefill stays on our kernel."""

    def attend(self, layer, q, k, v, ctx):
        if ctx.phase == "prefill":
            return super().attend(layer, q, k, v, ctx)
        cache, block = ctx.cache, k.shape[2]
        cache.write(layer, k, v)
        n = cache.launch_length(block)
        visible = torch.arange(n, device=q.device)[None, :] < (cache.lengths + block)[:, None]
        keys, values = cache.keys[layer][:, :n].transpose(1, 2), cache.values[layer][:, :n].transpose(1, 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], enable_gqa=True)


def generation_rows(model, name, context, batch, shapes, bandwidth) -> list[dict]:
    """block.generate for each method (harness.timed_generation), one random prompt of `context` tokens
    per row: ms/block, the median of the blocks after the first. A warm-up generation of the exact
    engine, eager, first compiles and tunes every shape the prefill and the exact steps use and counts
    the experts each step touches."""
    cfg, prompts, ks = model.cfg, random_prompts(model.cfg, context, batch), shapes["ks"]
    run = lambda method, blocks: timed_generation(model, prompts, method, shapes["block"], shapes["steps"], blocks)
    touched = statistics.mean(touched_experts_per_forward(model, prompts, shapes["block"], shapes["steps"]))
    sparse = lambda method, k: partial(get_method, method, k=k, exact_layers=2)
    methods = [("exact", Dense), ("exact, torch SDPA", TorchSdpa), *((f"MAGE k={k}", sparse("mage", k)) for k in ks),
               (f"Quest k={ks[0]}", sparse("quest", ks[0])), (f"SparseD k={ks[0]}", sparse("sparsed", ks[0]))]
    rows = []
    for label, make in methods:
        method = make()
        torch.cuda.reset_peak_memory_stats()
        block_ms, prefill_s, result = run(method, GENERATION_BLOCKS)
        ms = statistics.median(block_ms)
        kv_fraction = result.stats.get("kv_kept", 1.0)  # plus Quest's page bounds: a min and a max of K per page
        if label.startswith("Quest"):
            kv_fraction += (cfg.num_layers - method.exact_layers) / cfg.num_layers / method.page_size
        floor = block_floor_ms(model, context, batch, shapes["steps"], touched, kv_fraction, bandwidth)
        rows.append({"model": name, "context": context, "batch": batch, "method": label, "ms/block": ms,
                     "min-max ms/block": f"{min(block_ms):.0f}-{max(block_ms):.0f}", "floor ms/block": floor,
                     "ms / floor": ms / floor, "prefill s": prefill_s,
                     "peak GiB": torch.cuda.max_memory_allocated() / 2**30})
    for row in rows:
        row.update({"vs exact": rows[0]["ms/block"] / row["ms/block"], "vs torch SDPA": rows[1]["ms/block"] /
                    row["ms/block"], "experts touched per layer": f"{touched:.0f}/{cfg.moe.num_experts}"})
    torch.cuda.empty_cache()
    return rows


def moe(setup):
    if setup.args.generate is not None:  # bench.py: --generate on a GPU
        return moe_generation(setup)
    shapes = setup.shapes(QUICK, FULL)
    setup.report.say(f"Copy bandwidth {setup.ceilings[0]:.0f} GB/s, matmul {setup.ceilings[1]:.0f} TFLOP/s "
                     "(measured now).\n")
    rows = []
    for name in shapes["presets"]:
        cfg = config_of(name, QUICK_MOE)
        first_moe = next(i for i in range(cfg.num_layers) if i not in cfg.moe.dense_layers)  # the model cut after it
        model = build_random(dataclasses.replace(cfg, num_layers=first_moe + 1), device=setup.device, dtype=setup.dtype)
        for count in (*shapes["step_rows"], shapes["prefill_rows"]):
            rows.append({"model": name, **mlp_row(cfg, model.layers[first_moe].mlp, count,
                                                  count in shapes["step_rows"], setup)})
        del model
        setup.free()
    setup.report.table("The MoE MLP of one layer", rows,
                       "Microseconds per call for `rows` tokens (a block step is 32 x batch; the last row is a "
                       "prefill). The fused layer with its experts on kernels/expert_linear.py or torch's grouped "
                       f"matmuls (the model runs the first up to a mean of {FEW_ROWS_PER_EXPERT} rows per "
                       "expert), CUDA graph, L2 flushed. Loop: the reference, eager (it syncs the host per call). "
                       "Floor: max(bytes of touched experts + shared expert + router / copy bandwidth, FLOPs / "
                       "matmul rate).")
    rows = [experts_row(name, tokens, pool, setup) for name in shapes["expert_presets"]
            for pool in shapes["expert_pools"] for tokens in shapes["expert_tokens"]]
    setup.report.table("The experts alone, by rows per expert", rows,
                       "Microseconds of the two expert projections and the gate's activation for `tokens` tokens "
                       "routed uniformly at random to all experts or to a quarter of them (every fourth: a block whose "
                       "tokens pick the same few), on kernels/expert_linear.py (its row tiles as it picks them) and "
                       "on torch's grouped matmuls, CUDA graph, L2 flushed; floor: the touched experts' bytes / copy "
                       f"bandwidth. The models take the first up to a mean of {FEW_ROWS_PER_EXPERT} rows per expert "
                       "(kernels/expert_linear.py beats_grouped_mm; DiffusionGemma's experts too).")
    return "bench_moe"


@torch.no_grad()
def experts_row(name: str, tokens: int, pool: int, setup) -> dict:
    cfg, (bandwidth, _) = config_of(name, QUICK_MOE), setup.ceilings
    moe, hidden, make = cfg.moe, cfg.hidden_size, partial(torch.randn, device=setup.device, dtype=setup.dtype)
    gate_up = make(moe.num_experts, 2 * moe.expert_size, hidden) / 50
    down = make(moe.num_experts, hidden, moe.expert_size) / 50
    routed = moe.num_experts // pool  # every pool-th expert
    chosen = torch.rand(tokens, routed, device=setup.device).topk(moe.experts_per_token, dim=1).indices * pool
    ends = group_by_expert(chosen, moe.num_experts)[1]
    x = make(chosen.numel(), hidden)
    glu = "gelu_tanh" if cfg.gemma else "silu"

    def grouped_mm():
        hidden = glu_reference(experts_module.GROUPED_MM(x, gate_up.mT, offs=ends), glu)
        return experts_module.GROUPED_MM(hidden, down.mT, offs=ends)

    kernel_us = setup.timer(lambda: expert_linear(expert_linear(x, gate_up, ends, glu), down, ends))
    grouped_mm_us = setup.timer(grouped_mm)
    touched = int(chosen.unique().numel())
    floor_us = touched * 3 * hidden * moe.expert_size * x.element_size() / bandwidth / 1e3
    return {"model": name, "tokens": tokens, "experts routed to": routed, "rows per expert": len(x) / moe.num_experts,
            "row tile": tile_shape(len(x), moe.num_experts, hidden, glu, x.element_size(), None)["BLOCK_M"],
            "expert_linear us": kernel_us, "grouped_mm us": grouped_mm_us, "floor us": floor_us,
            "grouped_mm / expert_linear": grouped_mm_us / kernel_us, "expert_linear / floor": kernel_us / floor_us}


def moe_generation(setup):
    name, report = setup.args.generate, setup.report
    shapes, bandwidth = setup.shapes(QUICK_GENERATE, GENERATE[name]), setup.ceilings[0]
    report.say(f"Copy bandwidth {bandwidth:.0f} GB/s (measured now).\n")
    cfg = config_of(name, QUICK_MOE, context=max(shapes["contexts"]) + (GENERATION_BLOCKS + 2) * shapes["block"],
                    block_size=shapes["block"])
    model = build_random(cfg, device=setup.device, dtype=torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for context in shapes["contexts"]:
        rows = []
        for batch in shapes["batches"]:
            tokens = batch * (context + (GENERATION_BLOCKS + 1) * shapes["block"])
            if why := too_big(setup.device, weight_bytes, kv_bytes(cfg, tokens, 2)):
                report.say(f"- {context} tokens x batch {batch}: skipped, {why}\n")
                continue
            try:
                rows += generation_rows(model, name, context, batch, shapes, bandwidth)
            except torch.OutOfMemoryError as error:
                graphs_module.GRAPHS_ENABLED = True
                torch.cuda.empty_cache()
                report.failure(f"{context} tokens x batch {batch}", error)
        report.table(f"A real generation on {name}, {context // 1024}K", rows,
                     f"block.generate, blocks of {shapes['block']}, {shapes['steps']} steps per block, CUDA graphs "
                     f"on: the median of blocks 2-{GENERATION_BLOCKS} of one generation; every sparse method with 2 "
                     "exact layers. Floor: the weights a forward reads with the experts its tokens touch (counted in "
                     "the exact warm-up), the LM head at each step and the KV share the method reads, over copy "
                     "bandwidth.")
    return f"bench_moe_{name}"
