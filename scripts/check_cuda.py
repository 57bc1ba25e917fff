"""CUDA check of the foundation, with its first measurements. Run on a GPU machine:

    python scripts/check_cuda.py [--sections parity,engines,presets,streaming,kernels,methods] --out FILE.md

1. parity: the tests/fixtures checkpoints (LLaDA, SDAR, Dream, Fast-dLLM v2) on CUDA (SDPA path,
   float32) against transformers' logits;
2. engines: the tiny random test models and the Dream / Fast-dLLM v2 fixtures decode the same tokens
   on CUDA as on CPU (ragged batches);
3. presets: llada-8b / sdar-8b built with random bf16 weights directly on the GPU; one dense step
   of each engine timed next to its floor (bytes / measured copy bandwidth, FLOPs / measured matmul
   rate), with stock torch SDPA attention and with the Triton kernels (nanodllm.attention);
4. streamed loading: a random sdar-1.7b written as a sharded checkpoint, loaded in a child process
   whose peak host RSS is reported next to the largest tensor;
5. kernels: the shipped tiny models decode passkey prompts in bf16 on the Triton kernels and on
   torch SDPA: accuracy of each and how many tokens agree;
6. methods: the methods' own kernels (MOMO's QSA and block-sparse, DyLLM's approximate attention
   and row scatter) against their torch references at 8B head shapes in bf16 and fp16, and the tiny
   models decoding with MOMO and DyLLM on those kernels vs the methods' torch paths; the cached-step
   methods with their steps replayed from CUDA graphs vs eager.
--sections picks some of them (default: all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nanodllm.attention as attention_module  # noqa: E402
from nanodllm import block, masked, tasks  # noqa: E402
from nanodllm.attention import attention, block_causal_mask  # noqa: E402
from nanodllm.cache import KVCache  # noqa: E402
from nanodllm.config import GenerationConfig, preset  # noqa: E402
from nanodllm.loader import checkpoint_name, load_model  # noqa: E402
from nanodllm.methods.base import Dense, StepContext  # noqa: E402
from nanodllm.model import build_random  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
lines: list[str] = []


def report(text: str = ""):
    print(text, flush=True)
    lines.append(text)


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of fn() after one warm-up, CUDA-synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_parity():
    from safetensors.torch import load_file

    report("## 1. Parity on CUDA (float32, SDPA) against transformers' golden logits\n")
    report("| checkpoint | max abs logit diff | argmax equal |")
    report("|---|---|---|")
    for name in ("llada_tiny", "sdar_tiny", "dream_tiny", "fast_dllm_v2_tiny"):
        golden = load_file(str(FIXTURES / name / "golden.safetensors"), device="cuda")
        model = load_model(FIXTURES / name, device="cuda", dtype=torch.float32)
        ids, positions = golden["input_ids"], golden["positions"]
        block_size = model.cfg.block_size
        mask = None if model.cfg.attention == "bidirectional" else block_causal_mask(positions, positions, block_size)
        with torch.no_grad():
            logits = model(ids, positions, lambda layer, q, k, v: attention(q, k, v, mask))
        diff = (logits - golden["logits"]).abs().max().item()
        same = torch.equal(logits.argmax(-1), golden["logits"].argmax(-1))
        report(f"| {name} | {diff:.2e} | {same} |")


def check_engines():
    from tiny_models import random_prompt, tiny_model

    report("\n## 2. Engines: CUDA tokens equal CPU tokens (tiny random models, float32)\n")
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 6)]
    for family, engine, gen in (
        ("llada", masked, GenerationConfig(gen_length=16, block_length=8, steps=8)),
        ("llada", masked, GenerationConfig(gen_length=16, block_length=8, steps=16, threshold=0.5)),
        ("sdar", block, GenerationConfig(gen_length=16, block_length=4, steps=4)),
        ("sdar", block, GenerationConfig(gen_length=16, block_length=4, steps=4, threshold=0.4)),
    ):
        cpu_model = tiny_model(family, dtype=torch.float32)
        gpu_model = tiny_model(family, dtype=torch.float32).cuda()
        cpu = engine.generate(cpu_model, prompts, gen).tokens
        gpu = engine.generate(gpu_model, prompts, gen).tokens
        alone = [engine.generate(gpu_model, [p], gen).tokens[0] for p in prompts]
        report(f"- {family} {engine.__name__.split('.')[-1]} threshold={gen.threshold}: "
               f"cuda == cpu: {gpu == cpu}; batch == batch-of-one on cuda: {gpu == alone}")
    for name, engine, gen in (
        ("dream_tiny", masked, GenerationConfig(gen_length=16, block_length=16, steps=16)),
        ("fast_dllm_v2_tiny", block, GenerationConfig(gen_length=16, block_length=4, steps=4, threshold=0.9)),
    ):
        cpu_model = load_model(FIXTURES / name, dtype=torch.float32)
        gpu_model = load_model(FIXTURES / name, device="cuda", dtype=torch.float32)
        cpu = engine.generate(cpu_model, prompts, gen).tokens
        gpu = engine.generate(gpu_model, prompts, gen).tokens
        alone = [engine.generate(gpu_model, [p], gen).tokens[0] for p in prompts]
        report(f"- {name} ({cpu_model.cfg.model_type}, {engine.__name__.split('.')[-1]} engine): "
               f"cuda == cpu: {gpu == cpu}; batch == batch-of-one on cuda: {gpu == alone}")


def machine_rates():
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul FLOP rate."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x), 10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ a, 10)
    del x, y, a
    return 2 * 2**30 / copy_s, 2 * 8192**3 / matmul_s


def both_paths(fn, repeats: int = 5):
    """(seconds with torch SDPA, seconds with the kernels) of fn(), each timed()."""
    result = []
    for enabled in (False, True):
        attention_module.KERNELS_ENABLED = enabled
        with torch.no_grad():
            result.append(timed(fn, repeats))
    return tuple(result)


def check_presets(profile: bool):
    bandwidth, flops = machine_rates()
    report(f"\n## 3. 8B shapes, random bf16 weights built on the GPU; one dense step, torch SDPA vs our kernels\n")
    report(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s\n")
    report("| preset | engine step | context | batch | ms SDPA | ms kernels | floor ms | floor kind | "
           "floor / ms kernels |")
    report("|---|---|---|---|---|---|---|---|---|")
    dense = Dense()

    start = time.perf_counter()
    model = build_random(preset("sdar-8b", context=131072, block_size=32), device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    cfg = model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = weight_bytes - model.embed_tokens.weight.numel() * 2  # embedding rows: only 32 are read
    report_build = f"sdar-8b: {weight_bytes / 1e9:.2f} GB of weights built in {build_s:.1f}s"
    for context in (4096, 32768, 131072):
        for batch in (1, 4):
            if context * batch > 131072 * 2:
                continue
            cache = KVCache.for_model(cfg, batch, context + 32, "cuda", torch.bfloat16)
            for layer in range(cfg.num_layers):
                cache.keys[layer][:, :context].normal_()
                cache.values[layer][:, :context].normal_()
            cache.advance(torch.full((batch,), context, device="cuda"))
            columns = context + torch.arange(32, device="cuda")[None].expand(batch, -1)
            tokens = torch.full_like(columns, cfg.mask_token_id)
            ctx = StepContext(tokens, columns, torch.ones_like(columns, dtype=torch.bool),
                              torch.full((batch,), context, device="cuda"), cache=cache, block_length=32)
            sdpa_s, seconds = both_paths(lambda: dense.step(model, ctx))
            kv_bytes = 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * 2
            floor = (read_bytes + kv_bytes) / bandwidth
            report(f"| sdar-8b | block decode, 32 queries | {context} | {batch} | {sdpa_s * 1e3:.1f} | "
                   f"{seconds * 1e3:.1f} | {floor * 1e3:.1f} | weights + KV bytes | {floor / seconds:.2f} |")
            if profile and context == 4096 and batch == 1:
                with torch.no_grad(), torch.profiler.profile() as prof:
                    dense.step(model, ctx)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
            del cache, ctx
    del model
    torch.cuda.empty_cache()

    model = build_random(preset("llada-8b", context=32768), device="cuda")
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    for length in (1024, 4096, 16384):
        ids = torch.full((1, length), cfg.mask_token_id, device="cuda")
        positions = torch.arange(length, device="cuda")[None]
        ctx = StepContext(ids, positions, torch.ones_like(ids, dtype=torch.bool), torch.tensor([length // 2]),
                          logits_start=length - 32, logits_stop=length)
        sdpa_s, seconds = both_paths(lambda: dense.step(model, ctx), 3)
        attn_flops = 4 * cfg.num_layers * length * length * cfg.num_heads * cfg.head_dim
        floor = (2 * params * length + attn_flops) / flops
        report(f"| llada-8b | full canvas | {length} | 1 | {sdpa_s * 1e3:.1f} | {seconds * 1e3:.1f} | "
               f"{floor * 1e3:.1f} | FLOPs | {floor / seconds:.2f} |")
    del model
    torch.cuda.empty_cache()
    report(f"\n{report_build}; peak GPU memory so far {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def write_checkpoint(directory: Path):
    """A random sdar-1.7b in SDAR's on-disk format, sharded about 1 GB per file."""
    from safetensors.torch import save_file

    model = build_random(preset("sdar-1.7b"), device="cuda")
    shards, current, size = [], {}, 0
    for name, param in model.named_parameters():
        current[checkpoint_name("sdar", name)] = param.detach().cpu()
        size += param.numel() * 2
        if size > 1e9:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = dict(model_type="sdar", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936)
    (directory / "config.json").write_text(json.dumps(config))
    largest = max(p.numel() * 2 for p in model.parameters())
    total = sum(p.numel() * 2 for p in model.parameters())
    return largest, total, len(shards)


def check_streaming():
    report("\n## 4. Streamed loading (random sdar-1.7b, bf16, sharded) in a fresh process\n")
    with tempfile.TemporaryDirectory() as tmp:
        largest, total, shards = write_checkpoint(Path(tmp))
        torch.cuda.empty_cache()
        out = subprocess.run([sys.executable, "-c", LOAD_AND_WATCH_RSS, tmp], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        if out.returncode:
            report(f"load failed: {out.stderr[-2000:]}")
            return
        base, peak_anon, peak_file, seconds = out.stdout.split()
        report(f"checkpoint {total / 1e9:.2f} GB in {shards} shards, largest tensor {largest / 1e6:.0f} MB")
        report(f"host anonymous memory: {int(base) / 1024:.0f} MiB after CUDA init, peak "
               f"{int(peak_anon) / 1024:.0f} MiB while loading (+{(int(peak_anon) - int(base)) / 1024:.0f} MiB); "
               f"peak file-backed (mmap, reclaimable) RSS {int(peak_file) / 1024:.0f} MiB; load {float(seconds):.1f}s")


# Child process: load a checkpoint onto the GPU while a thread samples RssAnon / RssFile every 5 ms.
LOAD_AND_WATCH_RSS = """
import sys, threading, time, torch
sys.path.insert(0, '.')
from nanodllm.loader import load_model
def status(key):
    return int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith(key)))
torch.zeros(1, device='cuda')
base = status('RssAnon:')
peaks = {'RssAnon:': 0, 'RssFile:': 0}
done = False
def watch():
    while not done:
        for key in peaks:
            peaks[key] = max(peaks[key], status(key))
        time.sleep(0.005)
thread = threading.Thread(target=watch)
thread.start()
start = time.perf_counter()
load_model(sys.argv[1], device='cuda')
torch.cuda.synchronize()
seconds = time.perf_counter() - start
done = True
thread.join()
print(base, peaks['RssAnon:'], peaks['RssFile:'], seconds)
"""


def on_and_off(runner, method, length, n, module, flag) -> str:
    """Table cells: passkey accuracy with module.<flag> on and off, token agreement and seconds of each."""
    from nanodllm.eval import agreement

    samples = tasks.make_samples("passkey", length, n, seed=1234, count_tokens=runner.count_tokens)
    outcomes = {}
    for enabled in (True, False):
        setattr(module, flag, enabled)
        runner.generate(samples[:2], method)  # compile and autotune outside the timing
        outcomes[enabled] = runner.generate(samples, method)
    setattr(module, flag, True)
    accuracy = {key: sum(o.scores) / len(o.scores) for key, o in outcomes.items()}
    return (f"{length} | {n} | {accuracy[True]:.3f} | {accuracy[False]:.3f} | "
            f"{agreement(outcomes[True].tokens, outcomes[False].tokens):.3f} | "
            f"{outcomes[True].seconds:.2f} | {outcomes[False].seconds:.2f} |")


def check_kernels(n: int = 40):
    from nanodllm.eval import Runner, resolve_model

    report("\n## 5. The tiny models on the Triton kernels vs torch SDPA (bf16, passkey)\n")
    report("| model | length | n | accuracy kernels | accuracy SDPA | token agreement | s kernels | s SDPA |")
    report("|---|---|---|---|---|---|---|---|")
    for name in ("tiny-sdar", "tiny-llada"):
        runner = Runner(resolve_model(name), "cuda", torch.bfloat16, None)
        for length in (1024, 2048, 4096):
            report(f"| {name} | " + on_and_off(runner, "dense", length, n, attention_module, "KERNELS_ENABLED"))


def worst_error(pairs) -> float:
    """The largest |a - b| over (a, b) tensor pairs, -inf entries of both ignored."""
    worst = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        finite = torch.isfinite(a) & torch.isfinite(b)
        worst = max(worst, float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0)
    return worst


def check_method_kernels():
    from kernels.approx_attention import approximate_attention, approximate_attention_reference
    from kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_reference
    from kernels.qsa_attention import qsa_attention, qsa_attention_reference
    from kernels.row_scatter import put_rows_where, put_rows_where_reference

    report("\n## 6a. The methods' kernels against their torch references (CUDA, 32 heads, 8 KV heads, d 128)\n")
    report("Top-k columns: the fraction of sampled rows whose kernel block set has the reference's score sum "
           "(to 1e-2; near-ties may pick other blocks of the same score).\n")
    report("| kernel | dtype | N | mask | max abs err | top-k rows matching |")
    report("|---|---|---|---|---|---|")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        new = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)
        n = 2048
        q, k, v = new(1, 32, n, 128), new(1, 8, n, 128), new(1, 8, n, 128)
        for mask_name, masking in (("none", {}), ("causal", {"causal": True}), ("block 4", {"block_size": 4})):
            for variant, extra in (("exact", {}), ("tree", {"tree": True}), ("estimated", {"k_exact": 4})):
                got = qsa_attention(q, k, v, gamma=16, beta=64, top_k=16, **extra, **masking)
                reference_extra = {"k_exact": 4} if variant == "estimated" else {}
                want = qsa_attention_reference(q, k, v, gamma=16, beta=64, top_k=16, **reference_extra, **masking)
                sums = [torch.where(s > float("-inf"), s, 0).sum(-1) for s in (got[3], want[3])]
                matching = float(((sums[0] - sums[1]).abs() <= 1e-2 * sums[1].abs().clamp(min=1)).float().mean())
                report(f"| qsa {variant} | {str(dtype)[6:]} | {n} | {mask_name} | "
                       f"{worst_error([(got[0], want[0]), (got[1], want[1])]):.2e} | {matching:.3f} |")
            order = torch.rand(1, 32, n // 128, n // 64, device="cuda", generator=generator).argsort(dim=-1)
            blocks = order[..., :12].sort(dim=-1).values.int()  # 12 distinct key blocks per query block
            blocks[..., ::5] = -1  # and some empty entries
            got = block_sparse_attention(q, k, v, blocks, chi=128, beta=64, **masking)
            want = block_sparse_attention_reference(q, k, v, blocks, chi=128, beta=64, **masking)
            report(f"| block-sparse | {str(dtype)[6:]} | {n} | {mask_name} | "
                   f"{worst_error([(got[0], want[0]), (got[1], want[1])]):.2e} | |")
        rows, salient = 512, 256
        columns = torch.randperm(n, device="cuda", generator=generator)[None, :salient].int()
        context = new(1, 32, rows, 128)
        lse = (torch.rand(1, 32, rows, device="cuda", generator=generator) * 4 + 6).float()
        args = (new(1, 32, rows, 128), k, new(1, 8, salient, 128) * 0.1, columns,
                torch.tensor([salient - 17], device="cuda", dtype=torch.int32))
        exact_rows = torch.randperm(rows, device="cuda", generator=generator)[:64]
        slots = torch.full((1, rows), -1, device="cuda", dtype=torch.int32)
        slots[0, exact_rows] = torch.arange(64, device="cuda", dtype=torch.int32)
        merge = (new(1, 32, 64, 128), lse[..., :64] + 1, slots)
        results = []
        for update in (approximate_attention, approximate_attention_reference):  # in place: on copies
            updated_context, updated_lse = context.clone(), lse.clone()
            results.append((updated_context, updated_lse, update(*args, updated_lse, updated_context, merge)))
        (got, got_lse, got_stats), (want, want_lse, want_stats) = results
        report(f"| approximate attention, 64 exact rows merged | {str(dtype)[6:]} | {n} (256 salient) | none | "
               f"{worst_error([(got, want), (got_lse, want_lse)]):.2e} (stats "
               f"{worst_error([(got_stats, want_stats)]):.2e}) | |")
        ok = torch.rand(1, salient, device="cuda", generator=generator) < 0.8
        src = new(1, 8, salient, 128)
        caches = [new(1, n, 8, 128).transpose(1, 2) for _ in range(2)]
        caches[1].copy_(caches[0])
        deltas = [put_rows_where(caches[0], columns, ok, src, True),
                  put_rows_where_reference(caches[1], columns, ok, src, True)]
        report(f"| row scatter with deltas | {str(dtype)[6:]} | {n} (256 rows) | none | "
               f"{worst_error([(caches[0], caches[1]), (deltas[0], deltas[1])]):.2e} | |")


def check_methods_on_kernels(n: int = 20):
    from nanodllm.eval import Runner, resolve_model

    check_method_kernels()
    report("\n## 6b. The tiny models with the methods on their kernels vs on the methods' torch paths (bf16, passkey)\n")
    report("| model | method | knobs | length | n | accuracy kernels | accuracy torch | token agreement | s kernels | s torch |")
    report("|---|---|---|---|---|---|---|---|---|---|")
    cases = (("tiny-sdar", "momo", {"k": 8, "k_exact": 1}), ("tiny-sdar", "momo", {"k": 8, "top_k": "tree"}),
             ("tiny-llada", "momo", {"k": 8, "canvas": True}), ("tiny-llada", "dyllm", {"tau": 0.995}))
    for name, method, knobs in cases:
        runner = Runner(resolve_model(name), "cuda", torch.bfloat16, None)
        runner.knobs = knobs
        for length in (1024, 2048):
            report(f"| {name} | {method} | {knobs} | " + on_and_off(runner, method, length, n, attention_module,
                                                                  "KERNELS_ENABLED"))
    check_step_graphs(n)


def check_step_graphs(n: int):
    import nanodllm.graphs as graphs_module
    from nanodllm.eval import Runner, resolve_model

    report("\n## 6c. Cached steps replayed from CUDA graphs vs eager (tiny-llada, bf16, passkey)\n")
    report("| method | length | n | accuracy graphs | accuracy eager | token agreement | s graphs | s eager |")
    report("|---|---|---|---|---|---|---|---|")
    runner = Runner(resolve_model("tiny-llada"), "cuda", torch.bfloat16, None)
    for method, knobs in (("dllm_cache", {}), ("dllm_cache", {"prompt_interval": 8}), ("maskkv", {}),
                          ("maskkv", {"prompt_interval": 8}), ("fast_dllm", {}), ("sparse_dllm", {}),
                          ("dyllm", {"salient_fraction": 0.25}), ("dyllm", {"salient_cap": 0.5})):
        runner.knobs = knobs
        for length in (1024, 2048):
            report(f"| {method} {knobs or ''} | " + on_and_off(runner, method, length, n, graphs_module,
                                                               "GRAPHS_ENABLED"))


SECTIONS = ("parity", "engines", "presets", "streaming", "kernels", "methods")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="print a profile of one sdar-8b step at 4K")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    chosen = args.sections.split(",")
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    report(f"# CUDA checks: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"triton {__import__('triton').__version__}\n")
    run = {"parity": check_parity, "engines": check_engines, "presets": lambda: check_presets(args.profile),
           "streaming": check_streaming, "kernels": check_kernels,
           "methods": check_methods_on_kernels}
    for name in SECTIONS:
        if name in chosen:
            run[name]()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
