"""`python scripts/bench.py e2e`: what a user sees, real generate() calls in new processes.

Each configuration (an engine, a preset of random bf16 weights, a method, a batch of random prompts
one token off a multiple of the block, a generation length and step count) runs in two new processes,
one after the other:
1. the first generates once: what a new process pays where nothing of this configuration ran before
   (Triton compiles; launch settings missing from kernels/tuned.json are measured and cached). Other
   configurations may have compiled shared kernels already, so this is not quite a new machine;
2. the second generates three times: its first generation is what every later process pays (the bar
   of the warm start: at most 1 s over a warm one), the faster of the other two is the warm time.
Timing is wall clock around generate() with torch.cuda.synchronize(); the model is built before.
Tokens/s counts the generated tokens of the batch over the warm time.

--settings warm_start (the default for now) runs every method once at short settings: LLaDA-8B's
masked engine with a 4K prompt, 64 tokens in 64 steps, and SDAR-8B's block engine with an 8K prompt
and two blocks of 32 tokens, 32 steps each. --quick runs tiny models on the CPU: a smoke test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanodllm import block, masked  # noqa: E402
from nanodllm.config import GenerationConfig, ModelConfig, preset  # noqa: E402
from nanodllm.fused import build_random  # noqa: E402
from nanodllm.methods import get_method  # noqa: E402


@dataclass
class Run:
    engine: str  # "masked" or "block"
    model: str  # a preset, or "quick" (QUICK_MODEL)
    method: str
    prompt: int
    gen: int
    steps: int
    block: int = 32
    batch: int = 1
    knobs: dict = field(default_factory=dict)


MASKED = ("dense", "fast_dllm", "dllm_cache", "maskkv", "snapkv", "sparse_dllm", "dyllm")
BLOCK = ("dense", "mage", "quest", "sparsed", "momo")
SETTINGS = {
    "warm_start": [Run("masked", "llada-8b", m, 4095, 64, 64) for m in MASKED]
                  + [Run("block", "sdar-8b", m, 8191, 64, 32) for m in BLOCK],
    "quick": [Run("masked", "quick", m, 47, 16, 8, block=8) for m in MASKED]
             + [Run("block", "quick", m, 47, 16, 4, block=8) for m in BLOCK],
}
QUICK_MODELS = {  # a tiny LLaDA (OLMo fields) and a tiny SDAR (Qwen3 fields)
    "masked": dict(model_type="llada", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128,
                   vocab_size=256, mask_token_id=255, eos_token_id=254, max_sequence_length=1024),
    "block": dict(model_type="sdar", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=256, mask_token_id=255, block_size=8,
                  max_position_embeddings=1024),
}


def build(run: Run, device):
    if run.model == "quick":
        cfg = ModelConfig.from_dict(QUICK_MODELS[run.engine], source="e2e --quick")
    else:
        cfg = preset(run.model, context=run.prompt + run.gen + run.block, block_size=run.block)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return build_random(cfg, device=device, dtype=dtype)


def one_process(run: Run, generations: int) -> dict:
    """In this process: build the model, then time `generations` generate() calls."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(run, device)
    cfg = model.cfg
    prompts = [torch.randint(0, cfg.mask_token_id, (run.prompt,), generator=torch.Generator().manual_seed(row)).tolist()
               for row in range(run.batch)]
    gen = GenerationConfig(gen_length=run.gen, block_length=run.block, steps=run.steps)
    engine = masked if run.engine == "masked" else block
    extra = {"stop_ids": ()} if run.engine == "block" else {}
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    seconds = []
    for _ in range(generations):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        engine.generate(model, prompts, gen, method=get_method(run.method, **run.knobs), **extra)
        sync()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"seconds": seconds, "peak GiB": peak}


def in_new_process(run: Run, generations: int) -> dict:
    command = [sys.executable, __file__, "--one", json.dumps(asdict(run)), "--generations", str(generations)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{run.method} on {run.model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_e2e(args, report, meta):
    runs = SETTINGS["quick" if args.quick else args.settings]
    meta.update(settings="quick" if args.quick else args.settings)
    rows = []
    for run in runs:
        first = in_new_process(run, 1)
        later = in_new_process(run, 3)
        new_process, warm = later["seconds"][0], min(later["seconds"][1:])
        rows.append({"engine": run.engine, "model": run.model, "method": run.method, "batch": run.batch,
                     "prompt": run.prompt, "tokens / steps": f"{run.gen} / {run.steps}",
                     "first process s": first["seconds"][0], "later process s": new_process, "warm s": warm,
                     "later - warm s": new_process - warm, "tokens/s": run.batch * run.gen / warm,
                     "peak GiB": later["peak GiB"]})
        print(rows[-1], flush=True)
    for row in rows:
        dense = next(r for r in rows if r["engine"] == row["engine"] and r["method"] == "dense")
        row["vs dense"] = dense["warm s"] / row["warm s"]
    report.table("Generations in new processes", rows,
                 "First process: its one generation. Later process: its first generation, after the first process "
                 "ran. Warm: the faster of that process's next two. Every method at its defaults.")


def main():
    parser = argparse.ArgumentParser(description="one configuration of bench.py e2e, in this process")
    parser.add_argument("--one", required=True, help="a Run as JSON")
    parser.add_argument("--generations", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(one_process(Run(**json.loads(args.one)), args.generations)))


if __name__ == "__main__":
    main()
