"""bench.py diffusiongemma: DiffusionGemma's denoising step (diffusiongemma-26b-a4b, random bf16 weights).

Per context and batch: ms of one denoising step (a canvas of 256 against a cache filled with random K/V,
self-conditioned), exact as the loop runs it (replayed from a CUDA graph) and eager, and MAGE's sparse
step as the loop runs it (replayed; k = 1024 keys per KV head on the 5 full layers), ms of the encoder
pass that commits a canvas, and ms of a canvas as generate() runs it at the released generation_config's
48 steps (random weights never stop early): its replays, the sampler, its commit; and a step's full
layers' attention alone on flash_attention and on wide_attention (which the step runs).
Floor: the bytes a step reads (step_parts) over the measured copy bandwidth; roofline: the sum over the
step's parts of the slower of their bytes over that and their FLOPs over the measured matmul rate (at a
canvas of 256 rows the dense matmuls and the full layers' attention are compute). transformers: the
same step through DiffusionGemmaModel's decoder (5.24, SDPA, its default experts), its cache filled the
same way, when `transformers` imports (PYTHONPATH) and fits beside nothing else: it runs after ours.
Then, batch 1, seconds of the prompt's encoder pass into an empty cache, exact and with MOMO's prefill
on the full layers (its defaults).
"""

from __future__ import annotations

from functools import partial

import torch

from harness import REPO, kilo, timed_generation, wall_us
from nanodllm.config import ModelConfig, _PRESETS
from nanodllm.gemma import attention_shape
from nanodllm.gemma_loop import prompt_context
from nanodllm.graphs import Recordings
from nanodllm.kernels.flash_attention import flash_attention
from nanodllm.kernels.wide_attention import wide_attention
from nanodllm.loader import build_random, load_reference
from nanodllm.methods.base import Dense, StepContext
from nanodllm.methods.mage import Mage
from nanodllm.methods.momo import Momo

PRESET = "diffusiongemma-26b-a4b"
FIXTURE = REPO / "tests" / "fixtures" / "diffusion_gemma_tiny"
STEPS_PER_CANVAS = 48


def filled_cache(model, batch: int, context: int, room: int = 1):
    """A cache of `context` random tokens per row (no pads), room for `room` canvases more."""
    cache = model.empty_cache(batch, context + room * model.cfg.gemma.canvas_length)
    for layer, sliding in enumerate(cache.sliding):
        store = cache if sliding else cache.full
        buffers = (store.keys[layer], store.values[layer])
        for buffer in buffers:
            buffer.normal_(0, 1)
    cache.full.advance(torch.full((batch,), context, device=cache.full.lengths.device))
    cache.length = context
    cache.start.fill_(context)
    cache.valid = torch.ones(batch, context, dtype=torch.bool, device=cache.valid.device)
    positions = torch.arange(max(0, context - cache.ring), context, device=cache.valid.device)
    cache.slot_positions[positions % cache.ring] = positions
    cache.order_windows()
    return cache


def full_attention_ms(model, cache, batch: int) -> tuple[float, float]:
    """ms of a step's full layers' attention alone (a canvas of random queries against each row's cached keys
    and canvas), on flash_attention (the other slots masked) and on wide_attention, as the step runs it."""
    g, size = model.cfg.gemma, model.cfg.gemma.canvas_length
    keys, values, counts = cache.full_launch(cache.sliding.index(False), size)
    q = torch.randn(batch, model.cfg.num_heads, size, g.global_head_dim, device=keys.device, dtype=keys.dtype)
    valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < counts[:, None]
    flash = wall_us(lambda: flash_attention(q, keys, values, k_valid=valid, scale=1.0), keys.device) / 1e3
    wide = wall_us(lambda: wide_attention(q, keys, values, counts, scale=1.0), keys.device) / 1e3
    return flash * cache.sliding.count(False), wide * cache.sliding.count(False)


def step_parts(model, batch: int, context: int, touched: float) -> dict[str, tuple[float, float]]:
    """What one denoising step reads and computes, part by part: {part: (bytes, FLOPs)}. Bytes: every weight
    but the embedding, which it reads twice (the self-conditioning's soft embedding and the tied head), the
    experts the step's tokens route to, every cached K/V of the full layers and the sliding rings. FLOPs: 2
    a weight a row (a row's k experts' weights each), and q . k and p . v over the keys each query reads."""
    cfg, g = model.cfg, model.cfg.gemma
    element, rows = model.embed_tokens.weight.element_size(), batch * g.canvas_length
    experts = [p.numel() for name, p in model.named_parameters() if ".experts." in name]
    embedding = model.embed_tokens.weight.numel()
    dense = sum(p.numel() for name, p in model.named_parameters() if ".experts." not in name) - embedding
    full = sum(not s for s in (g.is_sliding(i) for i in range(cfg.num_layers)))
    full_kv = full * context * g.global_kv_heads * g.global_head_dim
    sliding_keys = min(context, g.sliding_window - 1)
    sliding_kv = (cfg.num_layers - full) * sliding_keys * cfg.num_kv_heads * cfg.head_dim
    queries = 4 * rows * cfg.num_heads  # 2 FLOPs a product, two products
    attention = queries * (full * (context + g.canvas_length) * g.global_head_dim
                           + (cfg.num_layers - full) * (sliding_keys + g.canvas_length) * cfg.head_dim)
    per_expert = sum(experts) / cfg.moe.num_experts
    return {"experts": (sum(experts) * touched * element, 2 * rows * cfg.moe.experts_per_token * per_expert),
            "dense": (dense * element, 2 * rows * dense),
            "embedding twice": (2 * embedding * element, 4 * rows * embedding),
            "attention": (2 * batch * (full_kv + sliding_kv) * element, attention)}


def floors_ms(parts: dict, bandwidth: float, matmul_rate: float) -> tuple[float, float]:
    """(bytes floor, roofline floor) in ms: all bytes over the copy bandwidth (GB/s); the sum over parts of
    the slower of their bytes over it and their FLOPs over the matmul rate (TFLOP/s)."""
    bytes_ms = [b / bandwidth / 1e6 for b, _ in parts.values()]
    flops_ms = [f / matmul_rate / 1e9 for _, f in parts.values()]
    return sum(bytes_ms), sum(map(max, bytes_ms, flops_ms))


def touched_experts(model, canvas, cache, logits) -> float:
    """The fraction of experts the step's tokens route to, over the layers."""
    counts = []
    hooks = [layer.router.register_forward_hook(lambda _, __, out: counts.append(out[0].unique().numel()))
             for layer in model.layers]
    model.denoise(canvas, cache, logits)
    for hook in hooks:
        hook.remove()
    return sum(counts) / len(counts) / model.cfg.moe.num_experts


def exact_step_ms(model, canvas, logits, cache, tries: int = 3) -> float:
    """ms of the exact denoising step as the loop runs it: replayed from a CUDA graph (on a CPU, eagerly)."""
    replay, step = Recordings(size=1, copy_outputs=False), lambda c, z: model.denoise(c, cache, z)
    timed = (lambda: replay("exact", step, canvas, logits)) if canvas.is_cuda else lambda: step(canvas, logits)
    return wall_us(timed, canvas.device, tries=tries, warmups=2) / 1e3


def mage_step(model, canvas, cache, logits, k: int):
    """MAGE's sparse step as the loop runs it: the selection made at a first step, then a step over it
    (timed; on a GPU replayed from a CUDA graph, as the loop replays a canvas's repeated sparse steps)."""
    mage, size = Mage(k=k, exact_layers=0), canvas.shape[1]
    context = lambda step: StepContext(canvas, model.positions(cache, size).expand(canvas.shape[0], -1),
                                       torch.ones_like(canvas, dtype=torch.bool), cache.full.lengths, step=step,
                                       steps_per_block=STEPS_PER_CANVAS, logits_stop=size, cache=cache.full)
    mage.begin_block(context(0))
    model.head(model.denoised(canvas, cache, None, lambda *a: mage.attend(*a, ctx=context(0))))
    step = lambda c, l: model.head(model.denoised(c, cache, l, lambda *a: mage.attend(*a, ctx=context(1))))
    replay = Recordings(size=1, copy_outputs=False)
    return (lambda: replay("sparse", step, canvas, logits)) if canvas.is_cuda else lambda: step(canvas, logits)


def loop_canvas_ms(model, batch: int, context: int) -> float:
    """ms of a canvas as the loop runs it: generate() after `batch` random prompts of `context` tokens, five
    canvases; the mean of the second to fourth, each from its first step to the end of its commit, which the
    next canvas begins with (the first measures launch settings and records the steps' and the commit's
    graphs, which the later ones replay; the last is never committed)."""
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, context)).tolist()
    times = timed_generation(model, prompts, Dense(), model.cfg.gemma.canvas_length, STEPS_PER_CANVAS, blocks=5)[0]
    return sum(times[:-1]) / len(times[:-1])


def prompt_passes(model, contexts: list[int], device) -> list[dict]:
    """Seconds of one prompt's encoder pass (batch 1, random tokens, an empty cache), exact and with
    MOMO's prefill attention on the full layers, as the loop runs them."""
    rows = []
    for context in contexts:
        ids = torch.randint(0, model.cfg.vocab_size, (1, context), device=device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        row = {"prompt": kilo(context)}
        for name, method in (("exact", None), ("MOMO", Momo())):
            def encode():
                cache = model.empty_cache(1, context)
                ctx = prompt_context(model, cache, ids, valid, torch.tensor([context], device=device))
                model.encode(ids, cache, valid, None if method is None else partial(method.attend, ctx=ctx))
            with torch.no_grad():
                row[f"{name} s"] = wall_us(encode, device, tries=1) / 1e6
        row["exact / MOMO"] = row["exact s"] / row["MOMO s"]
        rows.append(row)
    return rows


def hf_step(raw: dict, cfg, batch: int, contexts: list[int], device, dtype, quick: bool) -> dict:
    """ms of transformers' denoising step per context, its cache filled with random K/V."""
    import transformers

    if not transformers.__version__.startswith("5.24."):  # DiffusionGemma's classes and call as this measures them
        raise ImportError(f"transformers {transformers.__version__} is the one importable here; this compares 5.24")
    from transformers import DynamicCache
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as hf

    if quick:
        model = hf.DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE, dtype=dtype).to(device)
    else:
        config = hf.DiffusionGemmaConfig.from_dict(raw)
        with torch.device(device):  # built in dtype: an fp32 copy of 25B weights would not fit beside it
            model = hf.DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    model.eval()
    times, g = {}, cfg.gemma
    size, vocab = g.canvas_length, cfg.vocab_size
    canvas = torch.randint(0, vocab, (batch, size), device=device)
    logits = torch.randn(batch, size, vocab, device=device, dtype=dtype)
    for context in contexts:
        cache = DynamicCache(config=model.config)
        for layer in range(cfg.num_layers):  # a sliding layer holds its last window - 1 tokens
            dim, heads = attention_shape(cfg, layer)
            held = min(context, g.sliding_window - 1) if g.is_sliding(layer) else context
            cache.update(*(torch.randn(batch, heads, held, dim, device=device, dtype=dtype) for _ in range(2)), layer)
        positions = torch.arange(context, context + size, device=device)[None].expand(batch, -1)
        with torch.no_grad():
            step = lambda: model(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=logits,
                                 decoder_position_ids=positions)
            times[context] = wall_us(step, device, tries=3) / 1e3
        del cache
    return times


def diffusiongemma(setup):
    quick, device, dtype = setup.quick, setup.device, setup.dtype
    raw = _PRESETS[PRESET]
    contexts, batches = ([64, 128], [1, 2]) if quick else ([8192, 32768, 131072], [1, 4])
    model = load_reference(FIXTURE, device=device, dtype=dtype) if quick else \
        build_random(ModelConfig.from_dict(raw, source=f"preset {PRESET}"), device=device, dtype=dtype)
    bandwidth, matmul_rate = setup.ceilings
    cfg, rows = model.cfg, []
    size, vocab = cfg.gemma.canvas_length, cfg.vocab_size
    setup.meta.update(preset=PRESET, contexts=contexts, batches=batches)
    passes = prompt_passes(model, contexts, device)
    for batch in batches:
        canvas = torch.randint(0, vocab, (batch, size), device=device)
        logits = torch.randn(batch, size, vocab, device=device, dtype=dtype)  # z, as the loop passes it
        for context in contexts:
            cache = filled_cache(model, batch, context)
            with torch.no_grad():
                eager = wall_us(lambda: model.denoise(canvas, cache, logits), device, tries=3) / 1e3
                exact = exact_step_ms(model, canvas, logits, cache) if device.type == "cuda" else eager
                sparse = wall_us(mage_step(model, canvas, cache, logits, k=64 if quick else 1024), device,
                                 warmups=2) / 1e3
                parts = step_parts(model, batch, context, touched_experts(model, canvas, cache, logits))
                floor, roofline = floors_ms(parts, bandwidth, matmul_rate)
                growing = filled_cache(model, batch, context, room=4)  # a commit per call: 1 + 3 timed
                commit = wall_us(lambda: model.encode(canvas, growing), device) / 1e3
                flash, wide = full_attention_ms(model, cache, batch) if model.full_on_kernels() else ("-", "-")
            del cache, growing
            setup.free()
            try:
                with torch.no_grad():
                    canvas_ms = loop_canvas_ms(model, batch, context)
            except torch.OutOfMemoryError as error:
                setup.report.failure(f"the loop's canvas at {kilo(context)}, batch {batch}", error)
                canvas_ms = "-"
            setup.free()
            rows.append({"context": kilo(context), "batch": batch, "exact step ms": exact, "floor ms": floor,
                         "exact / floor": exact / floor, "roofline ms": roofline, "exact / roofline": exact / roofline,
                         "eager step ms": eager, "MAGE step ms": sparse,
                         "commit ms": commit, f"loop canvas ms ({STEPS_PER_CANVAS} steps)": canvas_ms,
                         "full layers' attention: flash ms": flash, "wide ms": wide})
    del model
    setup.free()
    try:
        for batch in batches:
            for context, ms in hf_step(raw, cfg, batch, contexts, device, dtype, quick).items():
                row = next(r for r in rows if r["context"] == kilo(context) and r["batch"] == batch)
                row.update({"transformers step ms": ms, "transformers / exact": ms / row["exact step ms"]})
            setup.free()
    except (ImportError, torch.OutOfMemoryError) as error:
        setup.report.failure("transformers' step", error)
    for row in rows:  # what transformers did not run
        row.setdefault("transformers step ms", "-")
        row.setdefault("transformers / exact", "-")
    setup.report.table(f"One denoising step, {PRESET}", rows,
                       f"random weights, {dtype}; floor: bytes read / {bandwidth:.0f} GB/s (copy); roofline: per part "
                       f"(experts, dense weights, embedding, attention) the slower of bytes / that and FLOPs / "
                       f"{matmul_rate:.0f} TFLOP/s (matmul)")
    setup.report.table("The prompt's encoder pass, batch 1", passes,
                       "seconds, host included; MOMO at its defaults (gamma 16, chi 128, beta 64, k 128) on the full "
                       "layers, the sliding layers exact")
    return "bench_diffusiongemma"
