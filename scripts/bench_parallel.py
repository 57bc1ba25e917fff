"""`bench.py parallel`: tensor and expert parallelism over every rank torchrun starts (one GPU each):

    python -m torch.distributed.run --nproc-per-node 4 scripts/bench.py parallel [--only flash | scaling]

1. llada2-flash (random bf16 weights, split over every rank): ms per block of 32 (32 steps + the commit)
   at 32K and 128K, batch 1 and 4, exact and MAGE, beside the per-GPU floor: what one GPU must read per
   block (its experts that the block's tokens touch, counted, the rest of its share of the weights, its
   KV heads' cache) over its copy bandwidth, plus the measured collectives of a block (a forward's
   all-reduces and the LM head's all-gather, replayed from a CUDA graph, times the forwards).
2. Scaling: llada2-mini and sdar-8b over the first 1, 2 and 4 ranks: ms per block at batch 1 and the
   tokens per second at batch 16, and how many tokens equal the 1-GPU generation's.
Times: a CUDA event as each block begins; the median of the blocks after the first (where the engine
records its graphs). Rank 0 writes the tables. --quick: a tiny model over CPU processes on gloo.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from nanodllm.config import GenerationConfig, ModelConfig, preset
from nanodllm.generation import generate
from nanodllm.loader import build_random
from nanodllm.methods import get_method
from nanodllm.mlp import MoE
from nanodllm.parallel import Group, from_torchrun

FULL = dict(flash=("llada2-flash", (32768, 131072), (1, 4)), scaling=(("sdar-8b", 131072), ("llada2-mini", 32768)),
            throughput=(8192, 16), block=32, steps=32, blocks=4, k=1024)
QUICK = dict(flash=("quick", (48,), (1, 2)), scaling=(("quick", 48),), throughput=(24, 4), block=8, steps=8,
             blocks=3, k=8)
QUICK_MODEL = dict(model_type="llada2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                   num_experts=16, num_experts_per_tok=4, num_shared_experts=1, n_group=4, topk_group=2,
                   first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5, vocab_size=256,
                   mask_token_id=255, block_size=8, max_position_embeddings=1024)


def config(name: str, context: int, shapes: dict) -> ModelConfig:
    if name == "quick":
        return ModelConfig.from_dict(QUICK_MODEL, source="bench_parallel --quick")
    return preset(name, context=context + (shapes["blocks"] + 2) * shapes["block"], block_size=shapes["block"])


class Clock:
    """Marks in time (CUDA events on a GPU, the host's clock on a CPU) and the milliseconds between them."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def between(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in pairs]


def timed_generation(model, prompts, method, shapes, blocks: int):
    """(ms of each block after the first, sorted; the GenerationResult) of block.generate, temperature 0,
    no stop token."""
    size, clock = shapes["block"], Clock(model.embed_tokens.weight.is_cuda)
    begin = method.begin_block
    method.begin_block = lambda ctx: (clock.mark(), begin(ctx))[1]
    gen = GenerationConfig(gen_length=blocks * size, block_length=size, steps=shapes["steps"])
    result = generate(model, prompts, gen, method, stop_ids=())
    clock.mark()
    return sorted(clock.between()[1:]), result


def count_touched_experts(model, rows: int) -> tuple[list[int], callable]:
    """Hooks on every router recording, for each eager forward over `rows` tokens (a step or a commit, not
    the prefill; graph replays run no Python), how many of this rank's experts its tokens chose; and a
    function removing them."""
    counts = []

    def recorder(held: range):
        def record(router, inputs, output):
            capturing = inputs[0].is_cuda and torch.cuda.is_current_stream_capturing()
            if inputs[0].shape[0] == rows and not capturing:
                counts.append(sum(int(e) in held for e in output[0].unique()))
        return record

    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    hooks = [moe.gate.register_forward_hook(recorder(moe.experts.held)) for moe in moe_layers]
    return counts, lambda: [hook.remove() for hook in hooks]


def floor_ms(model, context: int, batch: int, shapes, touched: float, kv_fraction: float, bandwidth: float) -> float:
    """What this rank reads per block over `bandwidth` (bytes/s): per forward (the steps and the commit) its
    weights but the embedding, the LM head and the experts, its `touched` experts per MoE layer and its KV
    heads' cache (kv_fraction of it at a step, all of it at the commit); the LM head at each step."""
    local, steps = model.layers[0].cfg, shapes["steps"]
    element = model.embed_tokens.weight.element_size()
    params = dict(model.named_parameters())
    fixed = sum(p.numel() for n, p in params.items() if ".experts." not in n and not n.startswith(("embed", "lm_head")))
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    expert = moe_layers[0].experts.gate_up_proj[0].numel() * 3 // 2 if moe_layers else 0
    weights = (fixed + len(moe_layers) * touched * expert) * element
    kv = batch * context * local.num_layers * 2 * local.num_kv_heads * local.head_dim * element
    head = model.lm_head.weight.numel() * element
    return ((steps + 1) * weights + steps * head + (steps * kv_fraction + 1) * kv) / bandwidth * 1e3


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
    model = build_random(config(name, max(contexts), shapes), device="cuda" if cuda else "cpu",
                         dtype=torch.bfloat16 if cuda else torch.float32, group=group)
    bandwidth = setup.ceilings[0] * 1e9  # bytes/s, read + written
    report.say(f"GPU 0's copy bandwidth: {bandwidth / 1e9:.0f} GB/s (measured now, read + written bytes).\n")
    for context in contexts:
        for batch in batches:
            prompts = [torch.randint(0, model.cfg.mask_token_id, (context,), generator=torch.Generator().manual_seed(r))
                       .tolist() for r in range(batch)]
            collectives = collectives_ms(model, batch * shapes["block"], group) * (shapes["steps"] + 1) if cuda else 0
            for label, method in (("exact", "dense"), (f"MAGE k={shapes['k']}", "mage")):
                knobs = dict(k=shapes["k"], exact_layers=2) if method == "mage" else {}
                counts, remove_hooks = count_touched_experts(model, batch * shapes["block"])
                try:
                    block_ms, result = timed_generation(model, prompts, get_method(method, **knobs), shapes,
                                                        shapes["blocks"])
                except torch.OutOfMemoryError as error:  # every rank runs out at the same allocation
                    report.failure(f"{context} tokens x batch {batch}, {label}", error)
                    torch.cuda.empty_cache()
                    break
                finally:
                    remove_hooks()
                touched = statistics.mean(counts) if method == "dense" else touched
                floor = floor_ms(model, context, batch, shapes, touched, result.stats.get("kv_kept", 1.0), bandwidth)
                ms = statistics.median(block_ms)
                rows.append({"context": context, "batch": batch, "method": label, "ms/block": ms,
                             "min-max": f"{block_ms[0]:.0f}-{block_ms[-1]:.0f}", "floor ms (GPU 0)": floor,
                             "collectives ms": collectives, "ms / (floor + collectives)": ms / (floor + collectives),
                             "experts touched (GPU 0)": f"{touched:.0f}/{len(model.layers[-1].mlp.experts.held)}"})
                print(rows[-1], flush=True)
    del model
    return rows


def scaling_rows(shapes, group: Group) -> list[dict]:
    cuda, rows = torch.cuda.is_available(), []
    throughput_context, throughput_batch = shapes["throughput"]
    worlds = [w for w in (1, 2, 4) if w <= group.world]
    subgroups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank creates every group
    for name, context in shapes["scaling"]:
        first = {}
        for world in worlds:
            if group.rank < world:
                sub = Group(group.rank, world, subgroups[world])
                model = build_random(config(name, context, shapes), device="cuda" if cuda else "cpu",
                                     dtype=torch.bfloat16 if cuda else torch.float32, group=sub)
                for length, batch in ((context, 1), (throughput_context, throughput_batch)):
                    prompts = [torch.randint(0, model.cfg.mask_token_id, (length,),
                                             generator=torch.Generator().manual_seed(r)).tolist() for r in range(batch)]
                    block_ms, result = timed_generation(model, prompts, get_method("dense"), shapes, shapes["blocks"])
                    tokens = result.tokens
                    ms = statistics.median(block_ms)
                    first.setdefault(batch, (ms, tokens))
                    same = sum(a == b for row, ref in zip(tokens, first[batch][1]) for a, b in zip(row, ref))
                    rows.append({"model": name, "context": length, "batch": batch, "GPUs": world, "ms/block": ms,
                                 "tokens/s": batch * shapes["block"] / ms * 1e3, "vs 1 GPU": first[batch][0] / ms,
                                 "tokens = 1 GPU's": f"{same}/{sum(map(len, tokens))}"})
                    print(rows[-1], flush=True)
                del model
                if cuda:
                    torch.cuda.empty_cache()
            dist.barrier()
    return rows


def parallel(setup) -> str | None:
    group, args = from_torchrun("gloo" if setup.quick else None), setup.args
    if group.rank:  # rank 0 prints and writes the tables
        sys.stdout = open(os.devnull, "w")
    shapes, report = QUICK if setup.quick else FULL, setup.report
    setup.meta["ranks"] = group.world
    report.say(f"# Tensor and expert parallelism over {group.world} ranks: {setup.meta['device']}, torch "
               f"{setup.meta['torch']}, {setup.meta['dtype']}\n")
    report.say(f"    python -m torch.distributed.run --nproc-per-node {group.world} scripts/bench.py parallel"
               f"{' --only ' + args.only if args.only else ''}\n")
    if args.only != "scaling":
        report.table(f"{shapes['flash'][0]} over {group.world} GPUs", flash_rows(shapes, group, setup),
                     "block.generate, blocks of 32, 32 steps each, CUDA graphs on: the median of the blocks after "
                     "the first. Floor: GPU 0's reads per block over its copy bandwidth; collectives: a forward's, "
                     "from a CUDA graph, times the block's forwards.")
    if args.only != "flash":
        report.table("Scaling over 1, 2 and 4 GPUs", scaling_rows(shapes, group),
                     "The dense engine (exact), the first N ranks holding the model.")
    dist.barrier()
    return None if group.rank else "bench_parallel"
