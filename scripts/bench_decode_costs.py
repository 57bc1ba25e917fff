"""`python scripts/bench.py decode_costs`: where the block-decode kernels' time goes when they read few bytes.

Each series times one call at a fixed launch grid over growing byte counts and fits
time = fixed + bytes / rate (least squares): `rate` is how fast the call streams once it runs,
`fixed` what it pays whatever it reads (launch, the query tile, the first tile's round trip, the
partial store, the merge). Series, batch 1, SDAR-8B attention (32 query heads, 8 KV heads, d 128):
- two streaming reads from stock libraries over the same byte counts: torch.amax over a flat buffer
  and a cuBLAS matmul of 32 rows (the weight streamed, as in a projection of the block's tokens);
- decode_attention with 16 slices per KV head: the whole call, its split pass alone
  (decode_partials) and the merge alone (on the pass's scratch);
- the split pass with only the block's keys to read and the same grid (every cost but the stream);
- sparse_decode_attention over k random sorted prefix tokens per KV head (P = 128K) with 15 slices:
  the whole call and its split pass alone, next to the dense split pass over the same number of
  contiguous keys (what gathering costs on top of streaming).
Last, what issue 4's sparse bar (k = 8192 at >= 60% of copy bandwidth) leaves for the fixed cost at
each series' rate. GPU times from Timer (CUDA graphs, L2 evicted before every call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention, decode_partials, merge_splits
from kernels.sparse_decode_attention import sparse_decode_attention, sparse_decode_partials

FULL = dict(heads=32, kv_heads=8, head_dim=128, block=32, prefixes=(2048, 4096, 8192, 16384, 32768, 65536, 131072),
            sparse_prefix=131072, sparse_ks=(1024, 2048, 4096, 8192, 16384, 32768),
            library_mib=(8, 16, 32, 64, 128, 256), dense_splits=16, sparse_splits=15, bar_k=8192, bar=0.6)
QUICK = dict(heads=4, kv_heads=2, head_dim=64, block=8, prefixes=(64, 128), sparse_prefix=256, sparse_ks=(32, 64),
             library_mib=(1, 2), dense_splits=2, sparse_splits=2, bar_k=64, bar=0.6)


def fit(points):
    """(fixed us, rate GB/s) of the least-squares line time_us = fixed + bytes / rate through (bytes, us)."""
    x = torch.tensor([float(b) for b, _ in points], dtype=torch.float64)
    y = torch.tensor([us for _, us in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], 1)
    fixed, us_per_byte = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return fixed, 1 / us_per_byte / 1e3


def best_of_two(timer, fn):
    """The lower of two Timer medians: a point that lands on a clock or memory hiccup would tilt the fit."""
    return min(timer(fn), timer(fn))


def random_selection(kv_heads, prefix, count, device):
    """k sorted duplicate-free random prefix tokens per KV head, batch 1."""
    indices = torch.rand(1, kv_heads, prefix, device=device).topk(count, dim=-1).indices.sort(dim=-1).values
    return indices.to(torch.int32), torch.full((1, kv_heads), count, device=device, dtype=torch.int32)


def library_series(shapes, timer, dtype):
    series = {"torch.amax over a flat buffer": [], "cuBLAS: [32, 4096] x W^T": []}
    for mib in shapes["library_mib"]:
        nbytes = mib << 20
        flat = torch.ones(nbytes // 2, dtype=dtype, device=timer.device)
        result = torch.empty((), dtype=dtype, device=timer.device)
        amax = lambda: torch.amax(flat, dim=0, out=result)
        series["torch.amax over a flat buffer"].append((nbytes, best_of_two(timer, amax)))
        weight = torch.randn(nbytes // (2 * 4096), 4096, dtype=dtype, device=timer.device)
        x = torch.randn(32, 4096, dtype=dtype, device=timer.device)
        series["cuBLAS: [32, 4096] x W^T"].append((nbytes, best_of_two(timer, lambda: F.linear(x, weight))))
    return series


def decode_series(shapes, timer, q, k_cache, v_cache):
    splits, block = shapes["dense_splits"], shapes["block"]
    bytes_per_key = 2 * k_cache[0, 0].nbytes
    series = {f"decode_attention, {splits} slices": [], "split pass alone (decode_partials)": [],
              "merge alone (merge_splits)": []}
    for prefix in shapes["prefixes"]:
        n_keys, nbytes = prefix + block, (prefix + block) * bytes_per_key
        series[f"decode_attention, {splits} slices"].append(
            (nbytes, best_of_two(timer, lambda: decode_attention(q, k_cache, v_cache, n_keys, num_splits=splits))))
        partials = lambda: decode_partials(q, k_cache, v_cache, n_keys, num_splits=splits)
        series["split pass alone (decode_partials)"].append((nbytes, best_of_two(timer, partials)))
        part_out, part_lse = partials()
        series["merge alone (merge_splits)"].append(
            (nbytes, best_of_two(timer, lambda: merge_splits(part_out, part_lse, q))))
    return series


def sparse_series(shapes, timer, q, k_cache, v_cache):
    splits, block, prefix = shapes["sparse_splits"], shapes["block"], shapes["sparse_prefix"]
    bytes_per_key = 2 * k_cache[0, 0].nbytes
    cache_lengths = torch.full((1,), prefix, device=q.device, dtype=torch.int32)
    series = {f"sparse_decode_attention, {splits} slices": [], "sparse split pass alone": [],
              "dense split pass over as many contiguous keys": []}
    for count in shapes["sparse_ks"]:
        indices, counts = random_selection(shapes["kv_heads"], prefix, count, q.device)
        nbytes = (count + block) * bytes_per_key
        args = (q, k_cache, v_cache, cache_lengths, indices, counts)
        series[f"sparse_decode_attention, {splits} slices"].append(
            (nbytes, best_of_two(timer, lambda: sparse_decode_attention(*args, num_splits=splits))))
        series["sparse split pass alone"].append(
            (nbytes, best_of_two(timer, lambda: sparse_decode_partials(*args, num_splits=splits))))
        contiguous = lambda: decode_partials(q, k_cache, v_cache, count + block, num_splits=splits)
        series["dense split pass over as many contiguous keys"].append((nbytes, best_of_two(timer, contiguous)))
    return series


@torch.no_grad()
def bench_decode_costs(args, timer, report, bandwidth, meta):
    shapes = QUICK if args.quick else FULL
    device = timer.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta.update(shapes=shapes, copy_GBps=bandwidth)
    heads, kv_heads, head_dim, block = shapes["heads"], shapes["kv_heads"], shapes["head_dim"], shapes["block"]
    capacity = max(max(shapes["prefixes"]), shapes["sparse_prefix"]) + block
    k_cache, v_cache = (torch.randn(1, capacity, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(1, heads, block, head_dim, device=device, dtype=dtype)

    series = library_series(shapes, timer, dtype)
    series.update(decode_series(shapes, timer, q, k_cache, v_cache))
    series.update(sparse_series(shapes, timer, q, k_cache, v_cache))
    rows, fits = [], {}
    for name, points in series.items():
        fits[name] = fit(points)
        rows.append({"series": name, "MiB: us": ", ".join(f"{b / 2**20:.3g}: {us:.1f}" for b, us in points),
                     "fixed us": fits[name][0], "rate GB/s": fits[name][1],
                     "rate % of copy": 100 * fits[name][1] / bandwidth})
    report.table("time = fixed + bytes / rate", rows,
                 f"batch 1; copy bandwidth {bandwidth:.0f} GB/s (bytes read + written). The merge's rate is "
                 "meaningless (its bytes do not grow with the keys): read its fixed cost only.")

    longest = max(shapes["prefixes"])
    nothing_to_stream = lambda: decode_partials(q, k_cache, v_cache, block, max_length=longest + block,
                                                num_splits=shapes["dense_splits"])
    prologue = best_of_two(timer, nothing_to_stream)
    report.table("The split pass with nothing to stream",
                 [{"grid": f"{shapes['dense_splits']} slices x {kv_heads} KV heads", "keys read": block,
                   "us": prologue}],
                 "The grid of the longest dense row, but only the block's keys to read (slice 0): the launch, "
                 "the query tile, one tile's round trip and every program's partial store.")

    bar_bytes = (shapes["bar_k"] + block) * 2 * k_cache[0, 0].nbytes
    bar_us = bar_bytes / (shapes["bar"] * bandwidth) / 1e3
    rows = []
    for name in (f"sparse_decode_attention, {shapes['sparse_splits']} slices", "sparse split pass alone",
                 "dense split pass over as many contiguous keys"):
        fixed, rate = fits[name]
        stream_us = bar_bytes / rate / 1e3
        rows.append({"series": name, "stream us at its rate": stream_us, "fixed us": fixed,
                     "fixed + stream us": fixed + stream_us, "bar us": bar_us,
                     "fixed the bar leaves us": bar_us - stream_us})
    report.table(f"What the sparse bar leaves (k = {shapes['bar_k']}, >= {shapes['bar']:.0%} of copy bandwidth)", rows,
                 f"{bar_bytes / 2**20:.3g} MiB of K + V to read in at most {bar_us:.1f} us.")
