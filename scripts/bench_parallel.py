"""`bench.py parallel`: tensor and expert parallelism over every rank torchrun starts (one GPU each):

    python -m torch.distributed.run --nproc-per-node 4 scripts/bench.py parallel [--only flash | scaling | gemma]

1. llada2-flash (random bf16 weights, split over every rank): ms per block of 32 (32 steps + the commit)
   at 32K and 128K, batch 1 and 4, exact and MAGE, beside the per-GPU floor: what one GPU must read per
   block (in each MoE layer the touched experts of the rank that holds the most of them, which the layer's
   all-reduce waits for, counted; the rest of its share of the weights, its KV heads' cache) over GPU 0's
   copy bandwidth, plus the measured collectives of a block (a forward's all-reduces and the LM head's
   all-gather, replayed from a CUDA graph, times the forwards).
2. Scaling: llada2-mini and sdar-8b over the first 1, 2 and 4 ranks: ms per block at batch 1 and the
   tokens per second at batch 16, and how many tokens equal the 1-GPU generation's.
3. DiffusionGemma (diffusiongemma-26b-a4b: experts split, heads over 2) over the first 1, 2 and 4 ranks: ms of the
   exact denoising step replayed from a CUDA graph, its cache filled with random K/V (bench_gemma).
Times: a CUDA event as each block begins; the median of the blocks after the first (where the engine
records its graphs). Rank 0 writes the tables. --quick: a tiny model over CPU processes on gloo.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

from bench_gemma import FIXTURE, PRESET, exact_step_ms, filled_cache
from harness import (QUICK_MOE, Clock, block_floor_ms, config_of, kilo, random_prompts, timed_generation,
                     touched_experts_per_forward)
from nanodllm.config import ModelConfig, preset
from nanodllm.loader import build_random
from nanodllm.methods import get_method
from nanodllm.parallel import Group, from_torchrun

FULL = dict(flash=("llada2-flash", (32768, 131072), (1, 4)), scaling=(("sdar-8b", 131072), ("llada2-mini", 32768)),
            throughput=(8192, 16), block=32, steps=32, blocks=4, k=1024,
            gemma=(PRESET, ((8192, 1), (32768, 1), (131072, 1), (32768, 4))))
QUICK = dict(flash=("quick", (48,), (1, 2)), scaling=(("quick", 48),), throughput=(24, 4), block=8, steps=8,
             blocks=3, k=8, gemma=(FIXTURE, ((40, 1), (40, 2))))


def config(name, context: int, shapes: dict) -> ModelConfig:
    if name == FIXTURE:
        return ModelConfig.from_dir(FIXTURE)
    if name == PRESET:
        return preset(PRESET)
    return config_of(name, QUICK_MOE, context=context + (shapes["blocks"] + 2) * shapes["block"],
                     block_size=shapes["block"])


def collectives_ms(model, rows: int, group: Group) -> float:
    """Milliseconds of one forward's collectives over `rows` tokens: an all-reduce of [rows, hidden] per
    embedding, attention output and MLP, and the decision's all-gather of 3 numbers a row (decoding.most_likely),
    from a CUDA graph (median of 5)."""
    cfg, weight = model.cfg, model.embed_tokens.weight
    x = torch.randn(rows, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    logits = torch.randn(1, 3, rows, device=weight.device)

    def forward_collectives():
        for _ in range(2 * cfg.num_layers + 1):
            group.all_reduce(x)
        group.all_gather(logits, dim=0)

    forward_collectives()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward_collectives()
    clock = Clock(True)
    for _ in range(6):
        clock.mark()
        graph.replay()
    clock.mark()
    return statistics.median(clock.between()[1:])


def flash_rows(shapes, group: Group, setup) -> list[dict]:
    name, contexts, batches = shapes["flash"]
    cuda, rows, report = torch.cuda.is_available(), [], setup.report
    model = build_random(config(name, max(contexts), shapes), setup.device, setup.dtype, group=group)
    bandwidth = setup.ceilings[0]
    report.say(f"GPU 0's copy bandwidth: {bandwidth:.0f} GB/s (measured now, read + written bytes).\n")
    for context in contexts:
        for batch in batches:
            prompts = random_prompts(model.cfg, context, batch)
            collectives = collectives_ms(model, batch * shapes["block"], group) * (shapes["steps"] + 1) if cuda else 0
            try:  # each layer's all-reduce waits for its busiest rank: the floor reads that rank's experts
                counts = touched_experts_per_forward(model, prompts, shapes["block"], shapes["steps"])
            except torch.OutOfMemoryError as error:  # every rank runs out at the same allocation
                report.failure(f"{context} tokens x batch {batch}", error)
                torch.cuda.empty_cache()
                continue
            per_rank = group.all_gather(torch.tensor([counts], dtype=torch.float32, device=setup.device), dim=0)
            touched, busiest = statistics.mean(counts), per_rank.amax(dim=0).mean().item()
            for label, method in (("exact", "dense"), (f"MAGE k={shapes['k']}", "mage")):
                knobs = dict(k=shapes["k"], exact_layers=2) if method == "mage" else {}
                result = None  # the last run's KV cache goes before this one allocates its own
                try:
                    block_ms, _, result = timed_generation(model, prompts, get_method(method, **knobs),
                                                           shapes["block"], shapes["steps"], shapes["blocks"])
                except torch.OutOfMemoryError as error:  # every rank runs out at the same allocation
                    report.failure(f"{context} tokens x batch {batch}, {label}", error)
                    torch.cuda.empty_cache()
                    break
                kv_fraction = result.stats.get("kv_kept", 1.0)
                floor = block_floor_ms(model, context, batch, shapes["steps"], busiest, kv_fraction, bandwidth)
                ms = statistics.median(block_ms)
                held = len(model.layers[-1].mlp.experts.held)
                rows.append({"context": context, "batch": batch, "method": label, "ms/block": ms,
                             "min-max": f"{min(block_ms):.0f}-{max(block_ms):.0f}", "floor ms": floor,
                             "collectives ms": collectives, "ms / (floor + collectives)": ms / (floor + collectives),
                             "experts touched (GPU 0)": f"{touched:.0f}/{held}",
                             "(busiest rank)": f"{busiest:.0f}/{held}"})
                print(rows[-1], flush=True)
    del model
    return rows


def gpu_counts(group: Group) -> list[int]:
    """The GPU counts a scaling table compares: 1, 2 and 4, as many as the ranks reach."""
    return [w for w in (1, 2, 4) if w <= group.world]


def over(counts: list[int]) -> str:
    """'1, 2 and 4 GPUs' for [1, 2, 4]."""
    if len(counts) == 1:
        return f"{counts[0]} GPU"
    return f"{', '.join(map(str, counts[:-1]))} and {counts[-1]} GPUs"


def scaling_rows(shapes, group: Group, setup) -> list[dict]:
    rows = []
    throughput_context, throughput_batch = shapes["throughput"]
    worlds = gpu_counts(group)
    subgroups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank creates every group
    for name, context in shapes["scaling"]:
        first = {}
        for world in worlds:
            if group.rank < world:
                sub = Group(group.rank, world, subgroups[world])
                model = build_random(config(name, context, shapes), setup.device, setup.dtype, group=sub)
                for length, batch in ((context, 1), (throughput_context, throughput_batch)):
                    prompts = random_prompts(model.cfg, length, batch)
                    block_ms, _, result = timed_generation(model, prompts, get_method("dense"), shapes["block"],
                                                           shapes["steps"], shapes["blocks"])
                    tokens = result.tokens
                    ms = statistics.median(block_ms)
                    first.setdefault(batch, (ms, tokens))
                    same = sum(a == b for row, ref in zip(tokens, first[batch][1]) for a, b in zip(row, ref))
                    rows.append({"model": name, "context": length, "batch": batch, "GPUs": world, "ms/block": ms,
                                 "tokens/s": batch * shapes["block"] / ms * 1e3, "vs 1 GPU": first[batch][0] / ms,
                                 "tokens = 1 GPU's": f"{same}/{sum(map(len, tokens))}"})
                    print(rows[-1], flush=True)
                del model
                setup.free()
            dist.barrier()
    return rows


def gemma_rows(shapes, group: Group, setup) -> list[dict]:
    rows, first = [], {}
    name, cases = shapes["gemma"]
    worlds = gpu_counts(group)
    subgroups = {w: dist.new_group(list(range(w))) for w in worlds}
    for world in worlds:
        if group.rank < world:
            model = build_random(config(name, 0, shapes), setup.device, setup.dtype,
                                 group=Group(group.rank, world, subgroups[world]))
            for context, batch in cases:
                torch.manual_seed(context + batch)  # every rank draws the same canvas and cache
                canvas = torch.randint(0, model.cfg.vocab_size, (batch, model.cfg.gemma.canvas_length),
                                       device=setup.device)
                logits = torch.randn(*canvas.shape, model.cfg.vocab_size, device=setup.device, dtype=setup.dtype)
                cache = filled_cache(model, batch, context)
                with torch.no_grad():
                    ms = exact_step_ms(model, canvas, logits, cache, tries=5)
                first.setdefault((context, batch), ms)
                rows.append({"context": kilo(context), "batch": batch, "GPUs": world, "step ms": ms,
                             "vs 1 GPU": first[(context, batch)] / ms})
                print(rows[-1], flush=True)
                del cache
            del model
            setup.free()
        dist.barrier()
    return rows


def parallel(setup) -> str | None:
    group, args = from_torchrun("gloo" if setup.quick else None), setup.args
    if setup.quick:  # CPU processes, also beside a GPU (which the ranks cannot share on gloo)
        setup.device, setup.dtype = torch.device("cpu"), torch.float32
        setup.meta.update(device="CPU", dtype="float32")
    if group.rank:  # rank 0 prints and writes the tables
        sys.stdout = open(os.devnull, "w")
    shapes, report = QUICK if setup.quick else FULL, setup.report
    setup.meta["ranks"] = group.world
    report.say(f"# Tensor and expert parallelism over {group.world} ranks: {setup.meta['device']}, torch "
               f"{setup.meta['torch']}, {setup.meta['dtype']}\n")
    report.say(f"    python -m torch.distributed.run --nproc-per-node {group.world} scripts/bench.py parallel"
               f"{' --only ' + args.only if args.only else ''}\n")
    if args.only in (None, "flash"):
        report.table(f"{shapes['flash'][0]} over {group.world} GPUs", flash_rows(shapes, group, setup),
                     "block.generate, blocks of 32, 32 steps each, CUDA graphs on: the median of the blocks after "
                     "the first. Floor: a GPU's reads per block, each MoE layer's experts those of its busiest rank, "
                     "over GPU 0's copy bandwidth; collectives: a forward's, from a CUDA graph, times the block's "
                     "forwards.")
    if args.only in (None, "scaling"):
        report.table(f"Scaling over {over(gpu_counts(group))}", scaling_rows(shapes, group, setup),
                     "The dense engine (exact), the first N ranks holding the model.")
    if args.only in (None, "gemma"):
        report.table(f"DiffusionGemma's step over {over(gpu_counts(group))}", gemma_rows(shapes, group, setup),
                     "Its experts split over the first N ranks, and its heads where they divide (2 ranks; dense MLP "
                     "and vocabulary on each whole); "
                     "the exact denoising step replayed from a CUDA graph, host included (median of 5).")
    dist.barrier()
    return None if group.rank else "bench_parallel"
