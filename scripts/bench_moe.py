"""`python scripts/bench.py moe`: the mixture-of-experts MLP, and real generations on the MoE presets.

1. One layer's MoE MLP (llada2-mini: 256 experts of 512, 8 per token, a shared expert; sdar-30b-a3b:
   128 experts of 768, 8 per token) on random bf16 weights, for the rows of a block step (32 x batch
   1 and 4) and a 32K-token prefill: the grouped path (nanodllm/fused.py FusedMoE: the rows sorted by
   expert, one grouped matmul per projection, no host sync; CUDA graph, L2 flushed) against the
   per-expert loop (nanodllm/mlp.py MoE, the reference, which asks the host which experts were chosen:
   timed eagerly). Floor: the larger of the bytes the rows must read (the experts they touch, the
   shared expert, the router) over the copy bandwidth and the FLOPs over the matmul rate.
2. A real generation: block.generate on llada2-mini, batch 1 and 4, CUDA graphs on, prompts of 32K,
   64K and 128K tokens (RoPE stretched past the trained 32K): milliseconds per block (CUDA events as
   each block begins; median of the blocks after the first, where the graphs are recorded), exact,
   MAGE at k = 1024 and 512, Quest and SparseD at k = 1024.
--quick runs a tiny MoE model on the CPU: a smoke test, its numbers mean nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench_mage import GENERATION_BLOCKS, block_clock, mark
from nanodllm import block as block_engine
from nanodllm.config import GenerationConfig, ModelConfig, preset
from nanodllm.fused import build_random
from nanodllm.methods import get_method
from nanodllm.mlp import MoE

FULL = dict(presets=("llada2-mini", "sdar-30b-a3b"), step_rows=(32, 128), prefill_rows=32768,
            contexts=(32768, 65536, 131072), batches=(1, 4), max_prefill_tokens=262144, ks=(1024, 512),
            block=32, steps=32)
QUICK = dict(presets=("quick",), step_rows=(8, 16), prefill_rows=64, contexts=(96,), batches=(1, 2),
             max_prefill_tokens=1024, ks=(16,), block=8, steps=4)
QUICK_MODEL = dict(model_type="llada2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                   num_experts=16, num_experts_per_tok=4, num_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5,
                   vocab_size=256, mask_token_id=255, block_size=8, max_position_embeddings=1024)


def moe_config(name: str, context: int | None = None, block: int | None = None) -> ModelConfig:
    if name == "quick":
        return ModelConfig.from_dict(QUICK_MODEL, source="bench moe --quick")
    return preset(name, context=context, block_size=block)


def one_moe_layer(cfg: ModelConfig, device, dtype) -> MoE:
    """The first MoE layer of a random model of cfg's shape cut after that layer."""
    first_moe = next(i for i in range(cfg.num_layers) if i not in cfg.moe.dense_layers)
    model = build_random(dataclasses.replace(cfg, num_layers=first_moe + 1), device=device, dtype=dtype)
    return model.layers[first_moe].mlp


def mlp_rows(cfg, moe_layer, rows, device, dtype, timer, bandwidth, matmul_rate) -> dict:
    x = torch.randn(1, rows, cfg.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        chosen, _ = moe_layer.gate(x.view(rows, -1))
        touched = int(chosen.unique().numel())
        grouped_us = timer(lambda: moe_layer(x))
        loop_us = timer.eager(lambda: MoE.forward(moe_layer, x))
    moe, element = cfg.moe, torch.finfo(dtype).bits // 8
    expert_bytes = 3 * cfg.hidden_size * moe.expert_size * element
    read = touched * expert_bytes + 3 * cfg.hidden_size * moe.shared_size * element + moe.num_experts * cfg.hidden_size * element
    flops = 2 * rows * (moe.experts_per_token * 3 * cfg.hidden_size * moe.expert_size
                        + 3 * cfg.hidden_size * moe.shared_size + moe.num_experts * cfg.hidden_size)
    floor_us = max(read / bandwidth / 1e3, flops / matmul_rate / 1e6)
    return {"rows": rows, "experts touched": f"{touched}/{moe.num_experts}", "grouped us": grouped_us,
            "per-expert loop us": loop_us, "loop / grouped": loop_us / grouped_us, "floor us": floor_us,
            "grouped / floor": grouped_us / floor_us, "floor bound": "bytes" if read / bandwidth / 1e3 >= flops / matmul_rate / 1e6 else "FLOPs"}


def generation_rows(model, name, context, batch, shapes) -> list[dict]:
    """ms per block of block.generate for each method, one prompt of `context` tokens per row."""
    cfg = model.cfg
    prompts = [torch.randint(0, cfg.mask_token_id, (context,), generator=torch.Generator().manual_seed(row)).tolist()
               for row in range(batch)]
    size, steps = shapes["block"], shapes["steps"]
    k = shapes["ks"][0]
    runs = [("exact", "dense", {})] + [(f"MAGE k={k}", "mage", dict(k=k, exact_layers=2)) for k in shapes["ks"]]
    runs += [(f"Quest k={k}", "quest", dict(k=k, exact_layers=2)), (f"SparseD k={k}", "sparsed", dict(k=k, exact_layers=2))]
    rows = []
    for label, method_name, knobs in runs:
        def generate(blocks, events):
            gen = GenerationConfig(gen_length=blocks * size, block_length=size, steps=steps, threshold=None)
            method = block_clock(get_method(method_name, **knobs), events)
            block_engine.generate(model, prompts, gen, method=method, stop_ids=())
            mark(events)
            torch.cuda.synchronize()

        generate(2, [])  # compiles, autotunes
        events = []
        start = time.perf_counter()
        generate(GENERATION_BLOCKS, events)
        wall = time.perf_counter() - start
        block_ms = sorted(a.elapsed_time(b) for a, b in zip(events[1:-1], events[2:]))
        rows.append({"model": name, "context": context, "batch": batch, "method": label,
                     "ms/block": statistics.median(block_ms), "min-max ms/block": f"{block_ms[0]:.0f}-{block_ms[-1]:.0f}",
                     "generation s (prefill + blocks)": wall})
    exact = rows[0]["ms/block"]
    for row in rows:
        row["vs exact"] = exact / row["ms/block"]
    torch.cuda.empty_cache()
    return rows


def bench_moe(args, timer, report, rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth, matmul_rate = rates()
    meta.update(copy_GBps=bandwidth, matmul_TFLOPs=matmul_rate, shapes=shapes)
    report.say(f"Copy bandwidth {bandwidth:.0f} GB/s, bf16 matmul {matmul_rate:.0f} TFLOP/s (measured now).\n")
    rows = []
    for name in shapes["presets"]:
        cfg = moe_config(name)
        moe_layer = one_moe_layer(cfg, device, dtype)
        for count in (*shapes["step_rows"], shapes["prefill_rows"]):
            rows.append({"model": name, **mlp_rows(cfg, moe_layer, count, device, dtype, timer, bandwidth, matmul_rate)})
        del moe_layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.table("The MoE MLP of one layer", rows,
                 "Microseconds per call for `rows` tokens (a block step is 32 x batch; the last row is a prefill). "
                 "Grouped: CUDA graph, L2 flushed. Loop: the reference, eager (it syncs the host per call). "
                 "Floor: max(bytes of touched experts + shared expert + router / copy bandwidth, FLOPs / matmul rate).")
    if device.type != "cuda":
        return
    name = "llada2-mini"
    cfg = moe_config(name, max(shapes["contexts"]) + (GENERATION_BLOCKS + 2) * shapes["block"], shapes["block"])
    model = build_random(cfg, device=device, dtype=dtype)
    for context in shapes["contexts"]:
        rows = []
        for batch in shapes["batches"]:
            if batch * context > shapes["max_prefill_tokens"]:
                report.say(f"- {context} tokens x batch {batch}: skipped, its prefill (one forward over every row) "
                           f"holds more than {shapes['max_prefill_tokens'] // 1024}K tokens' activations")
                continue
            rows += generation_rows(model, name, context, batch, shapes)
        report.table(f"A real generation on {name}, {context // 1024}K", rows,
                     f"block.generate, blocks of {shapes['block']}, {shapes['steps']} steps per block, CUDA graphs on: "
                     f"the median of blocks 2-{GENERATION_BLOCKS} of one generation; every sparse method with 2 exact "
                     "layers. One model for every context (RoPE stretched for the longest; the base does not change "
                     "the time).")
