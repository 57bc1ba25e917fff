"""What bench.py's sections share: the Timer and Clock, the Report of tables they write, the Setup each
one is given (flags, device, dtype, metadata, measured ceilings), the tiny models of --quick and the
measurements and floors several of them make."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from functools import cached_property
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import triton  # noqa: E402
import triton.testing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import nanodllm.graphs as graphs_module  # noqa: E402
from nanodllm.cli import write_whole  # noqa: E402
from nanodllm.config import GenerationConfig, ModelConfig, preset  # noqa: E402
from nanodllm.generation import generate  # noqa: E402
from nanodllm.loader import build_random  # noqa: E402
from nanodllm.methods.base import Dense, StepContext  # noqa: E402
from nanodllm.mlp import MoE  # noqa: E402

QUICK_LLADA = dict(model_type="llada", d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, mlp_hidden_size=256,
                   vocab_size=256, mask_token_id=255, eos_token_id=254, max_sequence_length=1024)
QUICK_SDAR = dict(model_type="sdar", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, intermediate_size=256, vocab_size=256, mask_token_id=255,
                  block_size=8, max_position_embeddings=1024)
QUICK_MOE = dict(model_type="llada2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                 num_experts=16, num_experts_per_tok=4, num_shared_experts=1, n_group=4, topk_group=2,
                 routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5,
                 vocab_size=256, mask_token_id=255, block_size=8, max_position_embeddings=1024)


class Timer:
    """Microseconds of one call of fn() as the GPU sees it: fn captured `repeats` times into a CUDA graph,
    each call after a read of 256 MiB that evicts the L2 (a read leaves it clean, as a real step finds it);
    the graph of the reads alone is subtracted; the median of several replays. Host launch overhead is left
    out; `eager(fn)` is do_bench's wall clock per call, overhead included. On a CPU (--quick) both are a
    wall-clock median whose numbers mean nothing."""

    def __init__(self, device, quick):
        self.device, self.quick, self.repeats = device, quick, 5 if quick else 20
        if device.type == "cuda":
            self.flush = torch.ones(256 << 20, dtype=torch.uint8, device=device)
            self.flush_max = torch.empty((), dtype=torch.uint8, device=device)
            self.flush_us = self.replay(self.capture(lambda: None))

    def capture(self, fn):
        fn()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.repeats):
                torch.amax(self.flush, dim=0, out=self.flush_max)
                fn()
        return graph

    def replay(self, graph, tries=7) -> float:
        times = []
        for _ in range(tries):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.repeats)
        return sorted(times)[len(times) // 2]

    def __call__(self, fn) -> float:
        if self.device.type != "cuda":
            return self.eager(fn)
        graph = self.capture(fn)
        return self.replay(graph) - self.flush_us

    def eager(self, fn, return_mode="median") -> float:
        if self.device.type != "cuda":
            return wall_us(fn, self.device, tries=2)
        return triton.testing.do_bench(fn, warmup=25, rep=10 if self.quick else 100, return_mode=return_mode) * 1e3


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
        return [a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def wall_us(fn, device, tries=3, calls=1, warmups=1) -> float:
    """After `warmups` calls, the median over `tries` of the microseconds per call of `calls` calls in a
    row (CUDA events on a GPU), host overhead included."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(tries):
        clock = Clock(device.type == "cuda")
        clock.mark()
        for _ in range(calls):
            fn()
        clock.mark()
        times.append(clock.between()[0] * 1e3 / calls)
    return sorted(times)[len(times) // 2]


class Report:
    """Markdown tables printed as they complete and kept for the JSON / Markdown files, and the parts
    that failed (bench.py writes the rest, then exits non-zero naming them)."""

    def __init__(self):
        self.sections, self.lines, self.failed = [], [], []

    def failure(self, what: str, error: BaseException):
        """A part that did not run: noted in the tables and kept for the exit message."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self.failed.append(f"{what}: {type(error).__name__}{': ' + first if first else ''}")
        self.say(f"- failed: {self.failed[-1]}\n")

    def say(self, text=""):
        print(text, flush=True)
        self.lines.append(text)

    def table(self, title, rows, note=""):
        self.say(f"## {title}\n")
        if note:
            self.say(note + "\n")
        if rows:
            self.say("| " + " | ".join(rows[0]) + " |")
            self.say("|" + "---|" * len(rows[0]))
            for row in rows:
                self.say("| " + " | ".join(fmt(row[c]) for c in rows[0]) + " |")
        self.say()
        self.sections.append({"title": title, "note": note, "rows": rows})

    def write(self, out_dir: Path, stem: str, meta: dict):
        out_dir.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"meta": meta, "sections": self.sections}, indent=2)
        write_whole(out_dir / f"{stem}.json", lambda partial: partial.write_text(record))
        write_whole(out_dir / f"{stem}.md", lambda partial: partial.write_text("\n".join(self.lines) + "\n"))
        print(f"wrote {out_dir / stem}.json and .md")


def fmt(value):
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def visible_pairs(n: int, block_size: int) -> int:
    """(query, key) pairs a block-causal(B) mask shows over n tokens (B = 1: causal)."""
    full_blocks, rest = divmod(n, block_size)
    return block_size * block_size * full_blocks * (full_blocks + 1) // 2 + rest * n


def kilo(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


class Setup:
    """What a section is given: its flags, the device and dtype (float32 on a CPU: the interpreter's
    bf16 dot is wrong), the run's metadata, the Timer, the Report and the measured ceilings."""

    def __init__(self, args, title: str = ""):
        self.args, self.quick, self.title = args, args.quick, title
        cuda = torch.cuda.is_available()
        self.device, self.dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
        interpreted = ", TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""
        machine = torch.cuda.get_device_name(self.device) if cuda else f"CPU ({platform.machine()}){interpreted}"
        self.meta = {"device": machine, "torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda, "dtype": str(self.dtype).removeprefix("torch."), "quick": args.quick,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.report = Report()

    @cached_property
    def timer(self) -> Timer:
        return Timer(self.device, self.quick)

    def header(self, command: str):
        """The Markdown file's title (with the machine) and the command that measures it."""
        meta = self.meta
        self.report.say(f"# {self.title}: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
                        f"{meta['dtype']}\n")
        self.report.say(f"    python scripts/bench.py {command}\n")

    @cached_property
    def ceilings(self) -> tuple[float, float]:
        """Copy bandwidth (GB/s, bytes read + written, 1 GiB device-to-device) and matmul rate (TFLOP/s,
        8192^3), each the best of several runs; recorded in the metadata."""
        copy_bytes, n = (1 << 22, 128) if self.quick else (1 << 30, 8192)
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        copy_us = self.timer.eager(lambda: dst.copy_(src), return_mode="min")
        a, b = (torch.randn(n, n, device=self.device, dtype=self.dtype) for _ in range(2))
        matmul_us = self.timer.eager(lambda: a @ b, return_mode="min")
        self.meta.update(copy_GBps=2 * copy_bytes / copy_us / 1e3, matmul_TFLOPs=2 * n**3 / matmul_us / 1e6)
        return self.meta["copy_GBps"], self.meta["matmul_TFLOPs"]

    def say_ceilings(self, then: str = ""):
        """The measured ceilings as the line opening a section's report, then more of it."""
        self.report.say(f"Copy {self.ceilings[0]:.0f} GB/s, matmul {self.ceilings[1]:.0f} TFLOP/s. {then}\n")

    def shapes(self, quick: dict, full: dict, **recorded) -> dict:
        """The section's shapes (--quick: the tiny ones), recorded in the metadata with `recorded`."""
        self.meta.update(shapes=quick if self.quick else full, **recorded)
        return self.meta["shapes"]

    def random_model(self, quick_fields: dict, name: str, **preset_knobs):
        """Random weights of a tiny model with --quick, else of the named preset's shape."""
        cfg = config_of("quick" if self.quick else name, quick_fields, **preset_knobs)
        return build_random(cfg, device=self.device, dtype=self.dtype)

    def free(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def config_of(name: str, quick_fields: dict, **preset_knobs) -> ModelConfig:
    """The tiny model of --quick (quick_fields) for the name "quick", else the named preset."""
    if name == "quick":
        return ModelConfig.from_dict(quick_fields, source="bench --quick")
    return preset(name, **preset_knobs)


def read_bytes(model) -> int:
    """The bytes of weights a forward reads: all but the embedding table, which is looked up."""
    embed = model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()


def logits(steps, model, ctx):
    """A denoising step as the loops run it (steps: a nanodllm/graphs.py Replayed): the step, its logits."""
    return steps.logits(model, steps.step(model, ctx), ctx)


def random_prompts(cfg, length: int, batch: int = 1, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random tokens (below the mask id), row r drawn from seed + r."""
    return [torch.randint(0, cfg.mask_token_id, (length,), generator=torch.Generator().manual_seed(seed + row)).tolist()
            for row in range(batch)]


def canvas_context(cfg, prompt, gen_length, block_length, device, batch=1, block=0) -> StepContext:
    """The masked engine's step context for `block` of a canvas of random prompt tokens + masks."""
    width, start = prompt + gen_length, prompt + block * block_length
    tokens = torch.randint(0, cfg.mask_token_id, (batch, width), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    tokens[:, prompt:] = cfg.mask_token_id
    return StepContext(tokens, torch.arange(width, device=device)[None].expand(batch, -1),
                       torch.ones_like(tokens, dtype=torch.bool), torch.full((batch,), prompt, device=device),
                       prompt_width=prompt, block=block, steps_per_block=block_length, mask_id=cfg.mask_token_id,
                       logits_start=start, logits_stop=start + block_length, block_length=block_length)


def peak_gib(fn, device) -> float:
    """Max GiB allocated while fn runs (NaN on a CPU)."""
    if device.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 2**30


def step_floor(cfg, model, ceilings, logit_rows: int):
    """floor_us(rows, keys attended): max(weight bytes / copy bandwidth, FLOPs / matmul rate), FLOPs = 2 x
    non-embedding parameters but the LM head x rows forwarded + 2 x the head's x logit_rows (the rows whose
    logits a step reads) + 4 x layers x hidden x (query rows x keys attended)."""
    weights, (bandwidth, matmul_rate) = read_bytes(model), ceilings
    head = model.lm_head.weight.numel()
    params = weights // model.embed_tokens.weight.element_size() - head
    flops = lambda rows, keys: 2 * (params * rows + head * logit_rows) + 4 * cfg.num_layers * cfg.hidden_size * keys
    return lambda rows, keys: max(weights / bandwidth / 1e3, flops(rows, keys) / matmul_rate / 1e6)


def generation_seconds(model, prompt: int, gen: int, block: int, method, device) -> float:
    """Seconds of one masked.generate of a random prompt (seed 1), host overhead included: the second of two
    generations with one method object (the first compiles and autotunes; each records its own graphs)."""
    prompts, config = random_prompts(model.cfg, prompt, seed=1), GenerationConfig(gen, block, steps=gen)
    return wall_us(lambda: generate(model, prompts, config, method), device, tries=1) / 1e6


def kv_bytes(cfg, tokens: int, element: int) -> int:
    """Bytes of the keys and values of `tokens` tokens in every layer."""
    return tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element


def too_big(device, weight_bytes: int, kv_bytes: int) -> str | None:
    """Why the weights, a KV cache and headroom for activations, graph pools and the allocator's slack do
    not fit the GPU; None if they do (or on a CPU)."""
    total, headroom = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0, 6 << 30
    if total and weight_bytes + kv_bytes + headroom > total:
        return (f"weights {weight_bytes / 2**30:.1f} GiB + KV cache {kv_bytes / 2**30:.1f} GiB + {headroom >> 30} GiB "
                f"headroom exceed the device's {total / 2**30:.1f} GiB")
    return None


def touched_experts_per_forward(model, prompts, block: int, steps: int) -> list[int]:
    """How many of this rank's experts each MoE layer's tokens chose, in every step and commit (forwards over
    the block's rows, not the prefill) of an exact generation of two blocks, run eagerly: a step replayed
    from a CUDA graph runs no Python, so no hook would see it."""
    counts, rows = [], len(prompts) * block

    def recorder(held: range):
        def record(router, inputs, output):
            if inputs[0].shape[0] == rows:
                counts.append(sum(int(e) in held for e in output[0].unique()))
        return record

    hooks = [layer.mlp.gate.register_forward_hook(recorder(layer.mlp.experts.held))
             for layer in model.layers if isinstance(layer.mlp, MoE)]
    graphs_module.GRAPHS_ENABLED = False
    try:
        timed_generation(model, prompts, Dense(), block, steps, blocks=2)
    finally:
        graphs_module.GRAPHS_ENABLED = True
        for hook in hooks:
            hook.remove()
    return counts


def block_floor_ms(model, context: int, batch: int, steps: int, touched: float, kv_fraction: float,
                   bandwidth: float) -> float:
    """Milliseconds a block of the block engine cannot beat on this rank: its steps and commit each read
    the weights but the embedding, the LM head and the routed experts, `touched` experts per MoE layer
    and the rank's KV heads' cache (kv_fraction of it at a step, all of it at the commit); the steps
    also read the LM head. Over copy bandwidth (GB/s)."""
    cfg, element = model.layers[0].cfg, model.embed_tokens.weight.element_size()
    fixed = sum(p.numel() for name, p in model.named_parameters()
                if ".experts." not in name and not name.startswith(("embed_tokens.", "lm_head.")))
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    expert = moe_layers[0].experts.gate_up_proj[0].numel() * 3 // 2 if moe_layers else 0
    weights = (fixed + len(moe_layers) * touched * expert) * element
    kv = kv_bytes(cfg, batch * context, element)
    head = model.lm_head.weight.numel() * element
    return ((steps + 1) * weights + steps * head + (steps * kv_fraction + 1) * kv) / bandwidth / 1e6


GENERATION_BLOCKS = 7  # a timed generation: the first block (where the engine records its graphs), six timed


def timed_generation(model, prompts, method, block: int, steps: int, blocks: int = GENERATION_BLOCKS):
    """generate() of `blocks` blocks (temperature 0, no stop token) with a mark before the call, as each
    block (a DiffusionGemma canvas) begins and after it: the milliseconds of each block after the first
    (where the engine records its graphs), in order, each up to the next block's start (a canvas with its
    commit); the seconds before the first block (the prefill); the GenerationResult."""
    clock, begin = Clock(model.embed_tokens.weight.is_cuda), method.begin_block

    def begin_timed(ctx):
        clock.mark()
        begin(ctx)

    method.begin_block = begin_timed
    clock.mark()
    result = generate(model, prompts, GenerationConfig(blocks * block, block, steps=steps), method, stop_ids=())
    clock.mark()
    spans = clock.between()
    return spans[2:], spans[0] / 1e3, result
