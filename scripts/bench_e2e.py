"""`python scripts/bench.py e2e`: what a user sees, real generate() calls in new processes, each of a
configuration (engine, preset of random bf16 weights, method, batch of random prompts, generation
length and steps); wall clock around generate() with torch.cuda.synchronize(), the model built
before. Rows are journaled as they finish (runs/e2e-*.jsonl): a rerun of the command resumes.
--settings paper (docs/results/bench_e2e_paper.md): every method at its paper's setting, one process
per row timing its first generation and a warm one, beside the dense engine and transformers'
reference loop (scripts/e2e_peer.py) on the same weights; whole-canvas loops run one step per block,
their times scaled to the row's steps ("projected"). Floor: one pass over the prompt plus, per step,
the larger of one read of the weights and the step's matmuls.
--settings warm_start (docs/results/bench_e2e_warm_start.md): short settings; per configuration a
first process generating once, then --repeats later processes generating three times each: a later
process's first generation against its warm time (the faster of the other two), medians.
This file is also the worker: `python scripts/bench_e2e.py --one '<a Run as JSON>' --generations N`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass
from itertools import accumulate
from statistics import median

import torch

from harness import QUICK_LLADA, QUICK_SDAR, REPO, config_of, random_prompts
from nanodllm.attention import CanvasMask, attention
from nanodllm.config import GenerationConfig
from nanodllm.decoding import split_evenly
from nanodllm.eval import Journal, journal_path, time_left
from nanodllm.generation import generate
from nanodllm.loader import build_empty, build_random
from nanodllm.methods import get_method

PEER = "transformers"


@dataclass
class Run:
    engine: str  # "masked" or "block"
    model: str  # a preset, or "quick" (harness's tiny LLaDA or SDAR)
    method: str  # a registered method, or PEER
    prompt: int
    gen: int
    steps: int  # the masked engine: in all; the block engine: per block
    block: int = 32
    batch: int = 1
    projected: bool = False  # run one step per block, scale the times to `steps`

    @property
    def timed_steps(self) -> int:
        return self.gen // self.block if self.projected else self.steps

    @property
    def block_masks(self) -> list[int]:
        """The block engine's blocks, each as the masks it decodes: its canvas is aligned to position 0, so a
        prompt ending inside a block adds one that holds the prompt's tail and the first masks."""
        first, end = self.prompt // self.block * self.block, -(-(self.prompt + self.gen) // self.block) * self.block
        return [start + self.block - max(start, self.prompt) for start in range(first, end, self.block)]

    @property
    def blocks(self) -> int:
        """The blocks a generation decodes."""
        return self.gen // self.block if self.engine == "masked" else len(self.block_masks)

    @property
    def forwards(self) -> int:
        """The forwards a generation runs: the masked engine's steps; on the block engine, per block, the
        steps its masks take and its commit."""
        if self.engine == "masked":
            return self.steps
        decoded = list(accumulate(split_evenly(torch.tensor([self.block]), self.steps)[0].tolist()))
        return sum(bisect_left(decoded, masks) + 2 for masks in self.block_masks)  # the steps, then the commit

    @property
    def setting(self) -> tuple:
        return self.engine, self.model, self.batch, self.prompt, self.gen, self.steps

    def label(self) -> str:
        return f"{self.engine} {self.model} {self.method} b{self.batch} {self.prompt}+{self.gen}/{self.steps}"


def group(engine, model, prompt, gen, steps, methods, batch=1, block=32) -> list[Run]:
    """A setting's rows; the masked engine's whole-canvas loops (dense, the peer) projected."""
    whole_canvas = ("dense", PEER) if engine == "masked" else ()
    return [Run(engine, model, m, prompt, gen, steps, block, batch, projected=m in whole_canvas) for m in methods]


MASKED = ("dense", "fast_dllm", "dllm_cache", "maskkv", "snapkv", "sparse_dllm", "dyllm")
BLOCK = ("dense", "mage", "quest", "sparsed", "momo")
PAPER_MASKED = ("dense", PEER, "fast_dllm", "dllm_cache", "maskkv", "snapkv")
PAPER_BLOCK = ("dense", PEER, "mage", "quest", "sparsed", "momo")
SETTINGS = {
    "warm_start": [Run("masked", "llada-8b", m, 4095, 64, 64) for m in MASKED]
                  + [Run("block", "sdar-8b", m, 8191, 64, 32) for m in BLOCK],
    "paper": group("masked", "llada-8b", 8191, 256, 256, PAPER_MASKED)
             + group("masked", "llada-8b", 32767, 256, 256, PAPER_MASKED)
             + group("masked", "llada-8b", 4095, 256, 256, ("dense", PEER, "fast_dllm", "sparse_dllm"))
             + group("masked", "llada-8b", 511, 256, 256, ("dense", PEER, "fast_dllm", "dllm_cache", "dyllm"), batch=16)
             + group("masked", "llada-8b", 511, 256, 128, ("dense", "fast_dllm", "dllm_cache", "dyllm"), batch=16)
             + group("masked", "llada-8b", 511, 256, 64, ("dense", "fast_dllm", "dllm_cache", "dyllm"), batch=16)
             + group("block", "sdar-8b", 32767, 128, 32, PAPER_BLOCK)
             + group("block", "sdar-8b", 32767, 128, 32, PAPER_BLOCK[:-1], batch=4)
             + group("block", "sdar-8b", 131071, 128, 32, ("dense", PEER, "mage", "sparsed", "momo"))
             + group("block", "llada2-mini", 32767, 128, 32, ("dense", "mage", "quest", "sparsed"))
             + group("block", "sdar-30b-a3b", 32767, 128, 32, ("dense", "mage", "quest", "sparsed")),
    "quick": [Run("masked", "quick", m, 47, 16, 8, block=8) for m in MASKED]
             + [Run("block", "quick", m, 47, 16, 4, block=8) for m in BLOCK],
    "paper_quick": group("masked", "quick", 47, 16, 8, ("dense", PEER, "fast_dllm", "maskkv"), block=8)
                   + group("masked", "quick", 23, 16, 8, ("dense", PEER, "dyllm"), batch=4, block=8)
                   + group("block", "quick", 47, 16, 4, ("dense", PEER, "mage", "momo"), block=8),
}


def build(run: Run, device):
    """The run's model with random weights; on the meta device, its shapes only."""
    cfg = config_of(run.model, QUICK_LLADA if run.engine == "masked" else QUICK_SDAR,
                    context=run.prompt + run.gen + run.block, block_size=run.block)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return build_empty(cfg, device, dtype) if device.type == "meta" else build_random(cfg, device=device, dtype=dtype)


@torch.no_grad()
def peer_logits_error(model, peer, e2e_peer, length: int = 256) -> float:
    """Refuse to time a peer whose logits over a random canvas differ from our model's: the same weights
    under the same mask (bidirectional, or block-causal) give the same logits up to rounding."""
    cfg, device = model.cfg, model.embed_tokens.weight.device
    ids = torch.tensor(random_prompts(cfg, length), device=device)
    causal = cfg.attention == "block_causal"
    mask = CanvasMask(block_size=cfg.block_size) if causal else CanvasMask()
    theirs = peer(input_ids=ids, **({"attention_mask": e2e_peer.block_causal(length, cfg.block_size, device)}
                                    if causal else {})).logits
    ours = model(ids, torch.arange(length, device=device)[None], lambda layer, q, k, v: attention(q, k, v, mask))
    error = ((ours.float() - theirs.float()).norm() / ours.float().norm()).item()
    tolerance = 1e-3 if model.embed_tokens.weight.dtype == torch.float32 else 0.15  # bf16: rounding in every layer
    if not error < tolerance:
        raise RuntimeError(f"transformers' logits differ from ours by {error:.3f} (relative): not the same model")
    return error


def generation(run: Run, model, sync, logits_error: list):
    """A function that runs one generation and returns when its first block was final (perf_counter)."""
    prompts, first_block = torch.tensor(random_prompts(model.cfg, run.prompt, run.batch)), []

    def first_block_done():
        sync()
        first_block.append(time.perf_counter())

    if run.method == PEER:
        import e2e_peer

        peer, ids = e2e_peer.hf_model(model), prompts.to(model.embed_tokens.weight.device)
        logits_error.append(peer_logits_error(model, peer, e2e_peer))
        reference = e2e_peer.llada_generate if run.engine == "masked" else e2e_peer.sdar_generate
        loop = lambda: reference(peer, ids, run.gen, run.block, run.timed_steps, model.cfg.mask_token_id,
                                 first_block_done=first_block_done)
    else:
        def loop():
            method = get_method(run.method)
            begin_block, blocks_begun = method.begin_block, []

            def noted(ctx):  # the second block begins: the first one's tokens are final
                blocks_begun.append(1)
                if len(blocks_begun) == 2:
                    first_block_done()
                return begin_block(ctx)

            method.begin_block = noted
            try:
                generate(model, prompts.tolist(), GenerationConfig(run.gen, run.block, run.timed_steps), method,
                         stop_ids=())
            finally:
                del method.begin_block  # no cycle through noted: the method's tensors go with the generation

    def once():
        first_block.clear()
        loop()
        sync()
        return first_block[0] if first_block else time.perf_counter()  # one block: final at the end

    return once


def one_process(run: Run, generations: int) -> dict:
    """In this process: build the model, then time `generations` generate() calls."""
    if run.method == PEER:
        import e2e_peer

        if why := e2e_peer.missing():
            return {"skipped": why}
    cuda = torch.cuda.is_available()
    model = build(run, torch.device("cuda" if cuda else "cpu"))
    sync = torch.cuda.synchronize if cuda else lambda: None
    logits_error, seconds, first_block = [], [], []
    once = generation(run, model, sync, logits_error)
    try:
        for _ in range(generations):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            first_done = once()
            seconds.append(time.perf_counter() - start)
            first_block.append(first_done - start)
    except torch.OutOfMemoryError as error:
        return {"skipped": f"out of memory ({str(error).splitlines()[0][:120]})"}
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"seconds": seconds, "first block": first_block, "peak GiB": peak, "logits error": logits_error}


def in_new_process(run: Run, generations: int, timeout: float | None = None) -> dict:
    command = [sys.executable, __file__, "--one", json.dumps(asdict(run)), "--generations", str(generations)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"took over {timeout:.0f} s"}
    if done.returncode != 0:
        raise RuntimeError(f"{run.label()} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def floor_seconds(run: Run, bandwidth: float, matmul_rate: float) -> float:
    """One pass over the prompt plus, at every forward (Run.forwards), the larger of one read of the weights
    and the forward's matmuls over its block of tokens (GB/s, TFLOP/s). The embedding table is looked up,
    not read; of a mixture of experts, a forward reads at least the experts one token is routed to."""
    shapes = build(run, torch.device("meta"))
    cfg = shapes.cfg
    params = sum(p.numel() for name, p in shapes.named_parameters() if not name.startswith("embed_tokens"))
    if cfg.moe:
        unread = (cfg.num_layers - len(cfg.moe.dense_layers)) * (cfg.moe.num_experts - cfg.moe.experts_per_token)
        params -= unread * 3 * cfg.hidden_size * cfg.moe.expert_size
    attention = 4 * run.prompt**2 * cfg.num_heads * cfg.head_dim * cfg.num_layers / (2 if run.engine == "block" else 1)
    prefill = run.batch * (2 * params * run.prompt + attention) / (matmul_rate * 1e12)
    step = max(2 * params / (bandwidth * 1e9), 2 * params * run.batch * run.block / (matmul_rate * 1e12))
    return prefill + run.forwards * step


def paper_row(run: Run, result: dict, bandwidth: float, matmul_rate: float) -> dict:
    scale, blocks = run.steps / run.timed_steps, run.blocks
    warm = result["seconds"][-1] * scale
    first = warm + result["seconds"][0] - result["seconds"][-1]  # what the first pays over a warm one, once
    first_block = result["first block"][-1] * scale
    return {"engine": run.engine, "model": run.model, "batch": run.batch, "prompt": run.prompt,
            "tokens / steps": f"{run.gen} / {run.steps}" + (" per block" if run.engine == "block" else ""),
            "method": run.method + (" (projected)" if run.projected else ""),
            "first generation s": first, "warm s": warm, "first block s": first_block,
            "ms per later block": (warm - first_block) / (blocks - 1) * 1e3 if blocks > 1 else float("nan"),
            "tokens/s": run.batch * run.gen / warm, "peak GiB": result["peak GiB"],
            "x floor": warm / floor_seconds(run, bandwidth, matmul_rate)}


def add_ratios(rows: list[dict], runs: list[Run], against=(("vs dense", "dense"), ("vs transformers", PEER))):
    """Each row's speed-up over the dense engine and over transformers (or the (column, method) pairs
    `against`) at its setting, from the rows' warm times."""
    warm = {(run.setting, run.method): row["warm s"] for run, row in zip(runs, rows)}
    for run, row in zip(runs, rows):
        for name, method in against:
            other = warm.get((run.setting, method))
            row[name] = other / row["warm s"] if other else float("nan")


def journaled(setup, key: dict, runs: list[Run], measure) -> tuple[list[tuple[Run, dict]], list[str], Journal]:
    """Every run with its result, from the journal (--journal, or runs/e2e-<hash of key>.jsonl) or
    measure(run); the labels of the runs that failed (not journaled: a rerun tries them again); the
    journal. A journal of other settings (another GPU's included) ends the run with a line naming them.
    The paper settings' journal keeps the machine, versions and rates its first call measured: rows
    resumed in a later call (or a report rebuilt from the journal) stay with the first numbers."""
    try:
        journal = Journal(setup.args.journal or journal_path("e2e", key), key)
    except ValueError as error:
        sys.exit(f"bench.py e2e: {error}")
    if key["settings"].startswith("paper"):
        if "machine" not in journal.done:
            try:
                from transformers import __version__ as peer_version
            except ImportError:
                peer_version = None
            bandwidth, matmul_rate = setup.ceilings
            journal.done["machine"] = {"key": "machine", **setup.meta, "transformers": peer_version,
                                       "copy_GBps": bandwidth, "matmul_TFLOPs": matmul_rate}
            journal.add(journal.done["machine"])
        setup.meta.update({k: v for k, v in journal.done["machine"].items() if k not in ("key", "date")})
    setup.meta["settings"] = key["settings"]
    started, computed, failed = time.perf_counter(), 0, []
    for i, run in enumerate(runs):
        if run.label() in journal.done:
            continue
        try:
            result = measure(run)
        except RuntimeError as error:
            result = {"skipped": f"failed: {str(error).strip().splitlines()[-1][:200]}"}
            failed.append(run.label())
            print(error, file=sys.stderr, flush=True)
        else:
            journal.add({"key": run.label(), "result": result})
        journal.done[run.label()] = {"result": result}
        computed += 1
        print(f"[{i + 1}/{len(runs)}] {run.label()}: {result}{time_left(started, computed, len(runs) - i - 1)}",
              flush=True)
    return [(run, journal.done[run.label()]["result"]) for run in runs], failed, journal


def close(report, done, failed: list[str], journal: Journal) -> list[str]:
    """Names the rows not run; deletes the journal once every row ran. Returns the failed rows."""
    if skipped := [f"{run.label()}: {result['skipped']}" for run, result in done if "skipped" in result]:
        report.say("Not run: " + "; ".join(skipped) + "\n")
    if not failed:
        journal.finish()
    return failed


def paper(setup) -> list[str]:
    """The paper settings' table; returns the rows that failed (they are retried by a rerun)."""
    args, meta, report = setup.args, setup.meta, setup.report
    settings = "paper_quick" if args.quick else "paper"
    key = {"settings": settings, "device": meta["device"]}  # rows of another GPU are never mixed in
    done, failed, journal = journaled(setup, key, SETTINGS[settings], lambda run: in_new_process(run, 2, args.timeout))
    bandwidth, matmul_rate = meta["copy_GBps"], meta["matmul_TFLOPs"]
    ran = [(run, paper_row(run, result, bandwidth, matmul_rate)) for run, result in done if "skipped" not in result]
    add_ratios([row for _, row in ran], [run for run, _ in ran])
    setup.header("e2e --settings paper" + (" --quick" if args.quick else ""))
    report.say(f"transformers {meta['transformers']}. Copy bandwidth {bandwidth:.0f} GB/s, matmul {matmul_rate:.0f} "
               "TFLOP/s, measured by the run.\n")
    report.table("Generations at the papers' settings", [row for _, row in ran],
                 "One new process per row: its first generation, then a warm one. First block: the time until "
                 "the first block's tokens are final (the prefill included). Random bf16 weights, every method "
                 "at its defaults.")
    if errors := [f"{run.label()}: {max(result['logits error']):.3f}" for run, result in done
                  if result.get("logits error")]:
        report.say("The peer's logits against ours over a 256-token canvas (relative error): " + "; ".join(errors)
                   + "\n")
    return close(report, done, failed, journal)


def warm_start_processes(run: Run, repeats: int) -> dict:
    """One configuration's first process (one generation) and `repeats` later ones (three each)."""
    first, later = in_new_process(run, 1), [in_new_process(run, 3) for _ in range(repeats)]
    return {"first": first["seconds"][0], "later": [p["seconds"] for p in later],
            "peak GiB": max(p["peak GiB"] for p in later)}


def warm_start_row(run: Run, result: dict) -> dict:
    """Per later process: its first generation, its warm time (the faster of its next two) and the
    difference; the row gives their medians over the processes, and the range of the difference."""
    warm = [min(seconds[1:]) for seconds in result["later"]]
    extra = [seconds[0] - w for seconds, w in zip(result["later"], warm)]
    return {"engine": run.engine, "model": run.model, "method": run.method, "batch": run.batch,
            "prompt": run.prompt, "tokens / steps": f"{run.gen} / {run.steps}",
            "first process s": result["first"], "later process s": median([s[0] for s in result["later"]]),
            "warm s": median(warm), "later - warm s": median(extra), "range s": f"{min(extra):.2f} - {max(extra):.2f}",
            "tokens/s": run.batch * run.gen / median(warm), "peak GiB": result["peak GiB"]}


def warm_start(setup) -> list[str]:
    """The warm-start table; returns the rows that failed (they are retried by a rerun)."""
    args, meta = setup.args, setup.meta
    settings = "quick" if args.quick else "warm_start"
    if unknown := sorted(set(args.methods or ()) - {run.method for run in SETTINGS[settings]}):
        sys.exit(f"bench.py e2e --methods: {', '.join(unknown)} not among the warm_start rows' methods "
                 f"({', '.join(dict.fromkeys(run.method for run in SETTINGS[settings]))})")
    runs = [run for run in SETTINGS[settings] if not args.methods or run.method in args.methods]
    key = {"settings": settings, "repeats": args.repeats, "methods": args.methods, "device": meta["device"]}
    done, failed, journal = journaled(setup, key, runs, lambda run: warm_start_processes(run, args.repeats))
    ran = [(run, warm_start_row(run, result)) for run, result in done if "skipped" not in result]
    add_ratios([row for _, row in ran], [run for run, _ in ran],
               (("vs dense", "dense"),) if any(run.method == "dense" for run, _ in ran) else ())
    setup.header("e2e --settings warm_start" + (" --quick" if args.quick else "")
                 + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
                 + (f" --methods {' '.join(args.methods)}" if args.methods else ""))
    setup.report.table("Generations in new processes", [row for _, row in ran],
                       f"First process: its one generation. Then {args.repeats} later processes, one after another, "
                       "each generating three times: its first generation (what every later process pays; the bar: at "
                       "most 1 s over a warm one) and its warm time (the faster of the other two). The row gives "
                       "medians over the later processes, and the range of their first-minus-warm differences. Every "
                       "method at its defaults.")
    return close(setup.report, done, failed, journal)


def e2e(setup) -> str:
    """The tables of --settings; the rows that failed are the report's failures (a rerun runs them again)."""
    args = setup.args
    setup.report.failed += paper(setup) if args.settings == "paper" else warm_start(setup)
    return f"bench_e2e_{args.settings}" + ("_" + "_".join(args.methods) if args.methods else "")


def main():
    parser = argparse.ArgumentParser(description="one configuration of bench.py e2e, in this process")
    parser.add_argument("--one", required=True, help="a Run as JSON")
    parser.add_argument("--generations", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(one_process(Run(**json.loads(args.one)), args.generations)))


if __name__ == "__main__":
    main()
