"""Benchmarks, written to docs/results/ as JSON + Markdown. Run on the GPU from the repo root:

    python scripts/bench.py kernels [--quick] [--out docs/results]
    python scripts/bench.py mage [--quick] [--out docs/results]
    python scripts/bench.py maskkv [--quick] [--out docs/results]
    python scripts/bench.py sparse_dllm [--quick] [--out docs/results]
    python scripts/bench.py dyllm [--quick] [--fractions F ...] [--out docs/results]
    python scripts/bench.py momo [--quick] [--lengths N ...] [--out docs/results]
    python scripts/bench.py routing [--quick] [--out docs/results]
    python scripts/bench.py moe [--quick] [--generate llada2-mini | sdar-30b-a3b] [--out docs/results]
    python scripts/bench.py e2e [--quick] [--settings paper | warm_start] [--out docs/results]

mage: time per output block of the block engine on the sdar-8b preset, exact vs MAGE, Quest and
SparseD (scripts/bench_mage.py has the details).
maskkv: tokens/s and peak memory of the masked engine on the llada-8b preset with 8K-32K prompts,
vanilla vs dllm_cache vs MaskKV (scripts/bench_maskkv.py has the details).
sparse_dllm: tokens/s and peak memory at 1K-32K on the llada-8b preset, vanilla vs Fast-dLLM's prefix
and dual caches vs Sparse-dLLM (scripts/bench_sparse_dllm.py).
dyllm: DyLLM's sparse steps at fixed salient fractions, 512 + 256 tokens, batch 1 and 16, vs vanilla
and the dual cache (scripts/bench_dyllm.py).
momo: MOMO's prefill attention at 32K-128K, causal and block-causal, each top-k variant, vs SDPA and
our dense kernel, with the FLOP floors and latency vs k (scripts/bench_momo.py).
moe: one layer's MoE MLP on the llada2-mini and sdar-30b-a3b presets, grouped vs the per-expert loop vs
the floor; with --generate, block.generate on that preset at 32K-128K, batch 1 and 4: exact (ours and
on torch SDPA), MAGE, Quest and SparseD, each next to its floor (scripts/bench_moe.py).
e2e: real generate() calls in new processes, every method at its paper's setting beside the dense
engine and transformers' reference loop, or (--settings warm_start) what a later process pays over a
warm one (scripts/bench_e2e.py).
routing: the timings behind nanodllm/attention.py's choice between flash_attention, the split-KV
decode kernel and SDPA (scripts/bench_routing.py).

kernels: the attention kernels next to their floors and to what a user has (torch SDPA), in one run:
  1. ceilings: copy bandwidth (1 GiB device-to-device, bytes read + written, best of several) and
     the bf16 matmul rate (8192^3);
  2. block decode (L = 32 queries vs P cached keys + the block): decode_attention vs SDPA on the
     cache view vs the floor (K + V bytes / copy bandwidth), plus a small tile / split sweep;
  3. sparse block decode (k selected tokens per KV head, as tokens and as 64-token key blocks) vs
     torch gather + SDPA vs the floor (selected K + V bytes / copy bandwidth);
  4. key scores over the prefix (with and without dots) as a ratio to one decode pass, floor = K bytes;
  5. dense prefill through kernels/flash_attention.py vs SDPA (TFLOP/s).
Shapes are SDAR-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16), batch 1 and 4.
GPU times come from CUDA-graph replays with L2 evicted before every call (Timer); the decode table
also gives the eager per-call time, host launch overhead included.
--quick runs tiny shapes end to end (on a CPU through TRITON_INTERPRET=1, in float32): a smoke test,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import triton  # noqa: E402
import triton.testing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels.decode_attention import DENSE_STAGES, INTERPRETER_SMS, decode_attention, default_tiles, sm_count  # noqa: E402
from kernels.key_scores import key_scores  # noqa: E402
from kernels.sparse_decode_attention import sparse_decode_attention  # noqa: E402
from nanodllm.cli import output_folder, positive_int, run_main, unit_fraction, write_whole  # noqa: E402

GB = 1e9


@dataclass
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    block: int  # L, the active block's queries
    batches: tuple
    prefixes: tuple  # cached keys P
    sparse_prefix: int
    sparse_ks: tuple  # selected tokens per KV head
    key_block: int  # tokens per key block in the blocked sparse rows
    prefill_lengths: tuple
    prefill_block_size: int  # block-causal B of the prefill rows (SDAR-8B's config default)
    copy_bytes: int
    matmul_n: int


FULL = Shapes(heads=32, kv_heads=8, head_dim=128, block=32, batches=(1, 4), prefixes=(8192, 32768, 131072),
              sparse_prefix=131072, sparse_ks=(1024, 8192), key_block=64, prefill_lengths=(8192, 32768),
              prefill_block_size=4, copy_bytes=1 << 30, matmul_n=8192)
QUICK = Shapes(heads=4, kv_heads=2, head_dim=64, block=8, batches=(1, 2), prefixes=(96, 200), sparse_prefix=200,
               sparse_ks=(32,), key_block=16, prefill_lengths=(64,), prefill_block_size=4, copy_bytes=1 << 22,
               matmul_n=128)


class Timer:
    """Microseconds of one call of fn(), as the GPU sees it.

    GPU: fn is captured `repeats` times into a CUDA graph, each call preceded by a read of a
    256 MiB buffer that evicts L2; the graph of the reads alone is timed too, and the difference
    divided by `repeats` is fn's time, median of several replays. The flush reads (a max over the
    buffer) rather than writes: a write would leave the L2 full of dirty lines, which the timed
    call would then pay to write back (the "L2 flush" table times both), while a real step finds
    the L2 holding clean weights and cache lines; flush="write" is kept for that table. A graph
    replays kernels back to back, so the host's launch overhead (Python, argument packing) is not
    in the number;
    `eager(fn)` gives the other view, do_bench's wall-clock per call, host overhead included.
    CPU (--quick): a plain wall-clock median; the numbers mean nothing there."""

    FLUSH_BYTES = 256 << 20

    def __init__(self, device, quick, flush="read"):
        if flush not in ("read", "write"):
            raise ValueError(f"flush must be 'read' or 'write', got {flush!r}")
        self.device, self.quick, self.flush_mode = device, quick, flush
        self.repeats = 5 if quick else 20
        if device.type == "cuda":
            self.flush = torch.ones(self.FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.flush_max = torch.empty((), dtype=torch.uint8, device=device)
            self.flush_graph = self.capture(lambda: None)
            self.flush_us = self.replay(self.flush_graph)

    def capture(self, fn):
        fn()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.repeats):
                if self.flush_mode == "read":
                    torch.amax(self.flush, dim=0, out=self.flush_max)
                else:
                    self.flush.fill_(1)
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
        if self.device.type == "cuda":
            graph = self.capture(fn)
            us = self.replay(graph) - self.flush_us
            del graph
            return us
        return self.eager(fn)

    def eager(self, fn, return_mode="median") -> float:
        if self.device.type == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=100 if not self.quick else 10,
                                           return_mode=return_mode) * 1e3
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6


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
            columns = list(rows[0])
            self.say("| " + " | ".join(columns) + " |")
            self.say("|" + "---|" * len(columns))
            for row in rows:
                self.say("| " + " | ".join(fmt(row[c]) for c in columns) + " |")
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


def kilo(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def measure_ceilings(timer, shapes, device, dtype):
    """Copy bandwidth (bytes read + written) and matmul rate, each the best of several runs."""
    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer.eager(lambda: dst.copy_(src), return_mode="min")
    n = shapes.matmul_n
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_us = timer.eager(lambda: a @ b, return_mode="min")
    return 2 * shapes.copy_bytes / copy_us / 1e3, 2 * n**3 / matmul_us / 1e6  # GB/s, TFLOP/s


def make_cache(batch, capacity, shapes, device, dtype):
    shape = (batch, capacity, shapes.kv_heads, shapes.head_dim)
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


def sdpa_on_cache(q, k_cache, v_cache, n_keys):
    """What a user has: SDPA with GQA on the [batch, kv_heads, n_keys, D] view of the cache."""
    keys, values = k_cache[:, :n_keys].transpose(1, 2), v_cache[:, :n_keys].transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def bench_flush_check(report, timer, shapes, device, dtype, bandwidth, caches):
    """The same calls timed after the read flush (Timer's method) and after a write flush."""
    write_timer = Timer(device, shapes is QUICK, flush="write")
    batch, hidden = shapes.batches[0], shapes.heads * shapes.head_dim
    k_cache, v_cache = caches[batch]
    q = torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype)
    cases = []
    for prefix in shapes.prefixes:
        n_keys = prefix + shapes.block
        lengths = torch.full((batch,), n_keys, device=device, dtype=torch.int32)
        cases.append((f"block decode, batch {batch}, P = {kilo(prefix)}", 2 * batch * k_cache[0, :n_keys].nbytes,
                      lambda lengths=lengths, n_keys=n_keys: decode_attention(q, k_cache, v_cache, lengths,
                                                                              max_length=n_keys)))
    x = torch.randn(shapes.block, hidden, device=device, dtype=dtype)
    weight = torch.randn(hidden, hidden, device=device, dtype=dtype)
    cases.append((f"torch matmul [{shapes.block}, {hidden}] x [{hidden}, {hidden}]", weight.nbytes,
                  lambda: F.linear(x, weight)))
    rows = []
    for name, nbytes, call in cases:
        read_us, write_us = timer(call), write_timer(call)
        rows.append({"call": name, "bytes floor us": nbytes / bandwidth / 1e3, "after a read flush us": read_us,
                     "after a write flush us": write_us, "difference us": write_us - read_us})
    del write_timer
    report.table("L2 flush: read (used here) vs write", rows,
                 "Every time in this file follows a read of a 256 MiB buffer, which leaves the L2 clean. A write "
                 "flush leaves up to the L2's size in dirty lines that the timed call pays to write back: the "
                 "difference column is that cost, one capture each (repeated captures of one call differ a little).")


def bench_decode(report, timer, shapes, device, dtype, bandwidth, caches):
    """Block decode against the whole cache; returns {(batch, P): our microseconds} for later ratios."""
    rows, ours = [], {}
    bytes_per_key = 2 * shapes.kv_heads * shapes.head_dim * caches[shapes.batches[0]][0].element_size()
    for batch in shapes.batches:
        k_cache, v_cache = caches[batch]
        q = torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype)
        for prefix in shapes.prefixes:
            n_keys = prefix + shapes.block
            lengths = torch.full((batch,), n_keys, device=device, dtype=torch.int32)
            kv_bytes = batch * n_keys * bytes_per_key
            call = lambda: decode_attention(q, k_cache, v_cache, lengths, max_length=n_keys)
            us, eager_us = timer(call), timer.eager(call)
            sdpa_us = timer(lambda: sdpa_on_cache(q, k_cache, v_cache, n_keys))
            ours[batch, prefix] = us
            rows.append({"batch": batch, "P": kilo(prefix), "ours us": us, "SDPA us": sdpa_us,
                         "floor us": kv_bytes / bandwidth / 1e3, "ours GB/s": kv_bytes / us / 1e3,
                         "% of copy BW": 100 * kv_bytes / us / 1e3 / bandwidth, "SDPA GB/s": kv_bytes / sdpa_us / 1e3,
                         "speedup vs SDPA": sdpa_us / us, "ours eager us": eager_us})
    report.table("Block decode (dense)", rows,
                 f"L = {shapes.block} queries vs P cached keys + the block's L keys; floor = K + V bytes / copy "
                 "bandwidth; SDPA(enable_gqa=True) reads the same token-major cache through a transposed view. "
                 "'eager' = one call from Python (do_bench), host launch overhead included.")
    return ours


SWEEP_ROUNDS = 3


def bench_decode_sweep(report, timer, shapes, device, dtype, bandwidth, caches):
    """Tile and split variants of the decode kernel at batch 1 (what to look at if it is short of 75%)."""
    batch = shapes.batches[0]
    k_cache, v_cache = caches[batch]
    q = torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype)
    bytes_per_key = 2 * shapes.kv_heads * shapes.head_dim * k_cache.element_size()
    variants = [
        ("default", {}, None),
        ("BLOCK_N 128, 2 stages", {"BLOCK_N": 128, "num_stages": 2}, None),
        ("BLOCK_N 32, 4 stages", {"BLOCK_N": 32, "num_stages": 4}, None),
        ("3 stages", {"num_stages": 3}, None),
        ("BLOCK_M 64, 4 warps (2 query tiles)", {"BLOCK_M": 64, "num_warps": 4}, None),
        ("BLOCK_M 64, 4 warps, 2x splits", {"BLOCK_M": 64, "num_warps": 4}, 2),
        ("half the splits", {}, 0.5),
        ("2x splits", {}, 2),
        ("4x splits", {}, 4),
    ]
    sms = sm_count(device) if device.type == "cuda" else INTERPRETER_SMS
    base_splits = max(1, sms // (batch * shapes.kv_heads))  # the heuristic's count before its MIN_KEYS_PER_SPLIT cap
    rows = []
    for prefix in shapes.prefixes[-2:]:
        n_keys = prefix + shapes.block
        lengths = torch.full((batch,), n_keys, device=device, dtype=torch.int32)
        kv_bytes = batch * n_keys * bytes_per_key
        times: dict[str, list] = {name: [] for name, _, _ in variants}
        for _ in range(SWEEP_ROUNDS):  # rounds over all variants, so that drift does not favour one of them
            for name, tiles, split_factor in variants:
                splits = None if split_factor is None else max(1, int(base_splits * split_factor))
                try:  # a variant that does not compile (shared memory, registers) is reported, not fatal
                    times[name].append(timer(lambda: decode_attention(q, k_cache, v_cache, lengths, max_length=n_keys,
                                                                      num_splits=splits, tiles=tiles)))
                except Exception as error:  # noqa: BLE001
                    times[name].append(f"failed: {type(error).__name__}")
        for name, _, split_factor in variants:
            splits = None if split_factor is None else max(1, int(base_splits * split_factor))
            row = {"P": kilo(prefix), "variant": name, "num_splits": splits or "auto"}
            if isinstance(times[name][0], str):
                row.update({"us": times[name][0], "% of copy BW": ""})
            else:
                us = sorted(times[name])[len(times[name]) // 2]
                row.update({"us": us, "% of copy BW": 100 * kv_bytes / us / 1e3 / bandwidth})
            rows.append(row)
    defaults = default_tiles(shapes.heads // shapes.kv_heads * shapes.block, shapes.head_dim, q.element_size(),
                             DENSE_STAGES)
    report.table(f"Block decode sweep (batch {batch})", rows,
                 f"default = {defaults}, splits = SMs // (batch * KV heads) = {base_splits} here; a variant changes "
                 f"only what its name says; median of {SWEEP_ROUNDS} captures, taken in rounds over the variants.")


def random_index_lists(batch, shapes, prefix, count, unit, device):
    """Sorted duplicate-free random selections of count/unit units (tokens or key blocks) per (row, KV head)."""
    units, picks = prefix // unit, count // unit
    scores = torch.rand(batch, shapes.kv_heads, units, device=device)
    indices = scores.topk(picks, dim=-1).indices.sort(dim=-1).values
    counts = torch.full((batch, shapes.kv_heads), picks, device=device, dtype=torch.int32)
    return indices.to(torch.int32), counts


def gather_then_sdpa(q, k_cache, v_cache, tokens):
    """The torch baseline: gather each (row, KV head)'s tokens [batch, kv_heads, n], then SDPA."""
    batch_index = torch.arange(q.shape[0], device=q.device)[:, None, None]
    head_index = torch.arange(k_cache.shape[2], device=q.device)[None, :, None]
    keys, values = k_cache[batch_index, tokens, head_index], v_cache[batch_index, tokens, head_index]
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def bench_sparse(report, timer, shapes, device, dtype, bandwidth, caches, dense_us):
    rows = []
    prefix = shapes.sparse_prefix
    for batch in shapes.batches:
        k_cache, v_cache = caches[batch]
        q = torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype)
        cache_lengths = torch.full((batch,), prefix, device=device, dtype=torch.int32)
        block_tokens = torch.arange(prefix, prefix + shapes.block, device=device).expand(batch, shapes.kv_heads, -1)
        for count in shapes.sparse_ks:
            for unit in (1, shapes.key_block):
                indices, counts = random_index_lists(batch, shapes, prefix, count, unit, device)
                tokens = (indices[..., None].long() * unit + torch.arange(unit, device=device)).flatten(2)
                tokens = torch.cat([tokens, block_tokens], dim=-1)
                read_bytes = tokens.numel() * 2 * shapes.head_dim * k_cache.element_size()
                us = timer(lambda: sparse_decode_attention(q, k_cache, v_cache, cache_lengths, indices, counts,
                                                           index_block=unit))
                torch_us = timer(lambda: gather_then_sdpa(q, k_cache, v_cache, tokens))
                rows.append({"batch": batch, "k": count, "index_block": unit, "ours us": us,
                             "gather+SDPA us": torch_us, "floor us": read_bytes / bandwidth / 1e3,
                             "% of copy BW": 100 * read_bytes / us / 1e3 / bandwidth,
                             "speedup vs gather+SDPA": torch_us / us,
                             "speedup vs dense decode": dense_us.get((batch, prefix), float("nan")) / us})
    report.table(f"Sparse block decode (P = {kilo(prefix)})", rows,
                 f"k selected prefix tokens per KV head (sorted random; as tokens or as {shapes.key_block}-token key "
                 f"blocks) + the block's {shapes.block} keys; time per layer; floor = selected K + V bytes / copy "
                 "bandwidth; dense decode = our decode_attention over the whole prefix, same run.")


def bench_key_scores(report, timer, shapes, device, dtype, bandwidth, caches, dense_us):
    rows = []
    for batch in shapes.batches:
        k_cache, v_cache = caches[batch]
        q = torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype)
        for prefix in shapes.prefixes:
            cache_lengths = torch.full((batch,), prefix, device=device, dtype=torch.int32)
            n_keys = prefix + shapes.block
            _, lse = decode_attention(q, k_cache, v_cache, cache_lengths + shapes.block, max_length=n_keys)
            k_bytes = batch * prefix * shapes.kv_heads * shapes.head_dim * k_cache.element_size()
            for with_dots in (False, True):
                us = timer(lambda: key_scores(q, k_cache, cache_lengths, lse, with_dots=with_dots, max_length=prefix))
                rows.append({"batch": batch, "P": kilo(prefix), "dots": with_dots, "us": us,
                             "floor us (K bytes)": k_bytes / bandwidth / 1e3,
                             "% of copy BW": 100 * k_bytes / us / 1e3 / bandwidth,
                             "ratio to one decode pass": us / dense_us[batch, prefix]})
    report.table("Key scores (MAGE / MaskKV / Sparse-dLLM selection pass)", rows,
                 "Probabilities of the block's queries over every prefix key, reduced over the GQA group and the L "
                 "queries, from the decode pass's LSE; one read of K, no V. Ideal ratio to a decode pass: ~0.5.")


def visible_fraction(n, block_size):
    """Fraction of the n x n score matrix a block-causal(B) mask keeps (B = 1: causal)."""
    blocks = -(-n // block_size)
    seen = sum(min((i + 1) * block_size, n) * min(block_size, n - i * block_size) for i in range(blocks))
    return seen / n**2


def bench_prefill(report, timer, shapes, device, dtype, matmul_rate):
    from kernels.flash_attention import flash_attention

    rows = []
    b = shapes.prefill_block_size
    for n in shapes.prefill_lengths:
        q = torch.randn(1, shapes.heads, n, shapes.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, shapes.kv_heads, n, shapes.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        full_flops = 4 * n * n * shapes.heads * shapes.head_dim
        cases = [
            ("bidirectional", lambda: flash_attention(q, k, v), 1.0,
             lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 1.0),
            (f"block-causal B={b} (SDPA: causal)", lambda: flash_attention(q, k, v, block_size=b),
             visible_fraction(n, b), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             visible_fraction(n, 1)),
        ]
        for name, ours, fraction, sdpa, sdpa_fraction in cases:
            us, sdpa_us = timer(ours), timer(sdpa)
            rate, sdpa_rate = full_flops * fraction / us / 1e6, full_flops * sdpa_fraction / sdpa_us / 1e6
            rows.append({"N": kilo(n), "mask": name, "ours ms": us / 1e3, "SDPA ms": sdpa_us / 1e3,
                         "ours TFLOP/s": rate, "SDPA TFLOP/s": sdpa_rate, "% of SDPA": 100 * rate / sdpa_rate,
                         "% of matmul": 100 * rate / matmul_rate})
    report.table("Dense prefill (flash_attention)", rows,
                 f"batch 1; FLOPs = 4 N^2 heads d times the visible fraction of the mask; block-causal uses B = {b} "
                 "(SDAR-8B's config default), compared with SDPA's causal mask (its FLOPs counted for causal).")


def bench_kernels(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    timer, report = Timer(device, args.quick), Report()
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()}), "
                  "TRITON_INTERPRET=1",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."), "quick": args.quick, "shapes": asdict(shapes),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    report.say(f"# Kernel benchmarks: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
               f"{meta['dtype']}\n")
    report.say(f"Attention shapes: {shapes.heads} query heads, {shapes.kv_heads} KV heads, head_dim {shapes.head_dim}; "
               "GPU times from CUDA-graph replays with L2 flushed before each call (see Timer), "
               "so host launch overhead is excluded except in the 'eager' column.\n")

    bandwidth, matmul_rate = measure_ceilings(timer, shapes, device, dtype)
    meta.update(copy_GBps=bandwidth, matmul_TFLOPs=matmul_rate)
    report.table("Ceilings", [{"copy bandwidth GB/s": bandwidth, "matmul TFLOP/s": matmul_rate}],
                 f"copy: {shapes.copy_bytes / 2**30:.3g} GiB device-to-device, read + written bytes, best of several; "
                 f"matmul: {shapes.matmul_n}^3 {meta['dtype']}, best of several.")

    capacity = max(max(shapes.prefixes), shapes.sparse_prefix) + shapes.block
    caches = {batch: make_cache(batch, capacity, shapes, device, dtype) for batch in shapes.batches}
    bench_flush_check(report, timer, shapes, device, dtype, bandwidth, caches)
    dense_us = bench_decode(report, timer, shapes, device, dtype, bandwidth, caches)
    bench_decode_sweep(report, timer, shapes, device, dtype, bandwidth, caches)
    bench_sparse(report, timer, shapes, device, dtype, bandwidth, caches, dense_us)
    bench_key_scores(report, timer, shapes, device, dtype, bandwidth, caches, dense_us)
    del caches
    try:  # another file's kernel: a failure there must not lose the tables above
        bench_prefill(report, timer, shapes, device, dtype, matmul_rate)
    except Exception as error:  # noqa: BLE001
        report.failure("Dense prefill (flash_attention)", error)
    report.write(args.out, "bench_kernels_quick" if args.quick else "bench_kernels", meta)
    return report


def run_metadata(dtype, quick: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(dtype).removeprefix("torch."), "quick": quick, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def bench_generations(args):
    """`e2e`: one new process per configuration and pass (scripts/bench_e2e.py)."""
    from bench_e2e import bench_e2e

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta, report = run_metadata(dtype, args.quick), Report()
    shapes = QUICK if args.quick else FULL
    failed = bench_e2e(args, report, meta, lambda: measure_ceilings(Timer(device, args.quick), shapes, device, dtype))
    methods = getattr(args, "methods", None)
    stem = f"bench_e2e_{args.settings}" + ("_" + "_".join(methods) if methods else "") + ("_quick" if args.quick else "")
    report.write(args.out, stem, meta)
    if failed:
        sys.exit(f"bench.py e2e: {len(failed)} row(s) failed, their errors above: {'; '.join(failed)}. The same "
                 "command runs them again and keeps the rows that finished.")
    return report


def bench_methods(args):
    """`mage`, `maskkv`, `sparse_dllm`, `dyllm`, `momo`, `routing`: timings on 8B shapes."""
    from bench_mage import bench_mage  # scripts/ is on sys.path when this file runs
    from bench_maskkv import bench_maskkv
    from bench_momo import bench_momo
    from bench_dyllm import bench_dyllm
    from bench_sparse_dllm import bench_sparse_dllm
    from bench_routing import bench_routing
    from bench_moe import bench_moe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer, report = Timer(device, args.quick), Report()
    meta = run_metadata(dtype, args.quick)
    rates = lambda: measure_ceilings(timer, shapes, device, dtype)
    if args.command == "mage":
        report.say(f"# MAGE and its baselines on the block engine: {meta['device']}, torch {meta['torch']}, "
                   f"triton {meta['triton']}, {meta['dtype']}\n")
        bench_mage(args, timer, report, lambda: rates()[0], meta)
    elif args.command == "maskkv":
        report.say(f"# MaskKV, dLLM-Cache and vanilla on the masked engine: {meta['device']}, torch {meta['torch']}, "
                   f"triton {meta['triton']}, {meta['dtype']}\n")
        bench_maskkv(args, timer, report, rates, meta)
    elif args.command == "sparse_dllm":
        report.say(f"# Sparse-dLLM, Fast-dLLM's caches and vanilla on the masked engine: {meta['device']}, "
                   f"torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}\n")
        bench_sparse_dllm(args, timer, report, rates, meta)
    elif args.command == "routing":
        report.say(f"# Which attention kernel nanodllm/attention.py picks: {meta['device']}, torch {meta['torch']}, "
                   f"triton {meta['triton']}, {meta['dtype']}\n")
        bench_routing(args, timer, report, meta)
    elif args.command == "moe":
        what = f"Real generations on {args.generate}" if args.generate else "The mixture-of-experts MLP"
        report.say(f"# {what}: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}\n")
        bench_moe(args, timer, report, rates, meta)
    elif args.command == "momo":
        report.say(f"# MOMO's prefill attention vs SDPA and our dense kernel: {meta['device']}, torch {meta['torch']}, "
                   f"triton {meta['triton']}, {meta['dtype']}\n")
        bench_momo(args, timer, report, rates, meta)
    else:
        report.say(f"# DyLLM's sparse steps vs vanilla and Fast-dLLM's dual cache: {meta['device']}, "
                   f"torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}\n")
        bench_dyllm(args, timer, report, rates, meta)
    stem = f"bench_{args.command}" + (f"_{args.generate}" if getattr(args, "generate", None) else "")
    report.write(args.out, f"{stem}_quick" if args.quick else stem, meta)
    return report


SHAPES_SMOKE = "tiny shapes: a smoke test (CPU: TRITON_INTERPRET=1)"
MODEL_SMOKE = "a tiny model: a smoke test (CPU: eager timing)"


def add_command(commands, name: str, help: str, smoke: str):
    """A subcommand with --quick (`smoke` says what it runs instead) and --out."""
    command = commands.add_parser(name, help=help)
    command.add_argument("--quick", action="store_true", help=smoke)
    command.add_argument("--out", type=output_folder, help="directory for the JSON + Markdown (default: docs/results, "
                         "or a new temporary directory with --quick)")
    return command


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_command(commands, "kernels", "attention kernels vs SDPA and their floors", SHAPES_SMOKE)
    add_command(commands, "mage", "time per output block: exact, MAGE, Quest, SparseD (sdar-8b preset)", MODEL_SMOKE)
    add_command(commands, "maskkv", "tokens/s and peak memory: vanilla, dllm_cache, MaskKV (llada-8b preset)",
                MODEL_SMOKE)
    add_command(commands, "sparse_dllm", "tokens/s and peak memory at 1K-32K: vanilla, fast_dllm prefix / dual, "
                "sparse_dllm (llada-8b preset)", MODEL_SMOKE)
    dyllm = add_command(commands, "dyllm", "DyLLM sparse steps at fixed salient fractions vs vanilla and fast_dllm "
                        "dual (llada-8b preset, 512 + 256 tokens, batch 1 and 16)", MODEL_SMOKE)
    dyllm.add_argument("--fractions", type=unit_fraction, nargs="+", help="salient fractions (default 0.1 0.25 0.5)")
    momo = add_command(commands, "momo", "MOMO prefill attention vs SDPA and the dense kernel at 32K-128K",
                       SHAPES_SMOKE)
    momo.add_argument("--lengths", type=positive_int, nargs="+", help="sequence lengths (default 32768 65536 131072)")
    momo.add_argument("--tune", action="store_true", help="also sweep the kernels' launch settings (GPU)")
    moe = add_command(commands, "moe", "MoE MLP grouped vs per-expert loop vs floor", MODEL_SMOKE)
    moe.add_argument("--generate", choices=("llada2-mini", "sdar-30b-a3b"),
                     help="time real generations on this preset instead (GPU), written to bench_moe_MODEL")
    add_command(commands, "routing", "flash vs split-KV decode vs SDPA on the shapes attention() routes", SHAPES_SMOKE)
    e2e = add_command(commands, "e2e", "generate() in new processes, every method, beside dense and transformers; "
                      "method", MODEL_SMOKE)
    e2e.add_argument("--settings", choices=("paper", "warm_start"), default="paper",
                     help="paper: every method at its paper's setting, beside transformers (default); warm_start: "
                     "short settings, a first and a later process each")
    e2e.add_argument("--repeats", type=positive_int, default=3, help="warm_start: later processes per configuration "
                     "(default 3)")
    e2e.add_argument("--methods", nargs="+", help="warm_start: only these methods' rows, written to "
                     "bench_e2e_warm_start_METHODS")
    e2e.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration's process may take "
                     "before its row is given up (default 900)")
    e2e.add_argument("--journal", type=Path, help="the journal of finished rows (default: runs/e2e-<hash>.jsonl)")
    e2e.add_argument("--report-only", action="store_true", help="write the tables from the journal of an earlier "
                     "--settings paper run (rows it lacks are listed as not run); runs nothing, needs no GPU")
    args = parser.parse_args()
    if args.out is None:  # a smoke test never overwrites the committed results
        args.out = Path(tempfile.mkdtemp(prefix="nanodllm-bench-")) if args.quick else REPO / "docs" / "results"
    if getattr(args, "methods", None) and args.settings != "warm_start":
        parser.error("e2e --methods picks rows of --settings warm_start only")
    gpu_only = {"--generate": getattr(args, "generate", None), "--tune": getattr(args, "tune", False)}
    for flag in (flag for flag, given in gpu_only.items() if given and not torch.cuda.is_available()):
        parser.error(f"{args.command} {flag} runs on a GPU only (CUDA events and graphs), and torch sees none here")
    if not (args.quick or torch.cuda.is_available() or getattr(args, "report_only", False)):
        sys.exit(f"bench.py {args.command}: the full run times 8B shapes on a GPU; on a CPU run it with --quick")
    if args.command == "kernels":
        report = bench_kernels(args)
    elif args.command == "e2e":
        report = bench_generations(args)
    else:
        report = bench_methods(args)
    if report.failed:
        sys.exit(f"bench.py {args.command}: {len(report.failed)} part(s) failed: {'; '.join(report.failed)}. The "
                 f"tables that finished are written to {args.out}.")


if __name__ == "__main__":
    sys.exit(run_main(main))
