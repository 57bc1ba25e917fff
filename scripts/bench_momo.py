"""`python scripts/bench.py momo`: MOMO's prefill attention against SDPA and our dense kernel.

Shapes: batch 1, 32 query heads, 8 KV heads, head_dim 128, bf16 (SDAR-8B's attention), N = 32K,
64K, 128K (--lengths), random q / k / v; masks causal and block-causal (B = 4, SDAR-8B's default;
SDPA has no block-causal mask, so its causal time is the comparison there).
- SDPA: torch's scaled_dot_product_attention with K / V expanded to 32 heads (what a user writes;
  its flash backend then runs), causal mask.
- ours: kernels/flash_attention.py, the exact dense path MOMO replaces.
- MOMO: methods/momo.py momo_attention at the paper's defaults (gamma 16, chi 128, beta 64,
  k = k_trim = 128 blocks, k_exact 8), once per top-k variant, plus its three stages timed apart
  (QSA kernel with the fused top-k; union and trim in torch; the block-sparse kernel).
Times are eager (CUDA events, median of 3 after a warm-up call): MOMO's middle stage is torch ops
and a host sync, which belong in its time.
Floors = FLOPs / the measured bf16 matmul rate, FLOPs = 4 d heads x (query, key) pairs computed:
dense: the pairs the mask shows; MOMO: the sampled rows' visible pairs plus chi x beta per kept
(query block, key block) pair (diagonal blocks counted whole).
Latency vs k (the paper's Fig. 4) at 64K causal for each top-k variant follows, then (--tune) a sweep
of the two kernels' launch settings (kernels/*.CUDA_TILES) at 64K causal.
Random q / k make every block about as good as another, so the speed, not the mask, is what is measured
here (scripts/momo_mass.py measures the masks).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from bench_maskkv import eager_us
import kernels.block_sparse_attention as block_sparse_module
import kernels.qsa_attention as qsa_module
from kernels.block_sparse_attention import block_sparse_attention
from kernels.flash_attention import flash_attention
from kernels.qsa_attention import qsa_attention
from nanodllm.attention import CanvasMask
from nanodllm.methods.momo import kept_lists, momo_attention

FULL = dict(lengths=(32768, 65536, 131072), heads=32, kv_heads=8, head_dim=128, block_size=4, k_length=65536,
            ks=(32, 64, 128, 256))
QUICK = dict(lengths=(512,), heads=4, kv_heads=2, head_dim=64, block_size=4, k_length=512, ks=(2, 4))
KNOBS = dict(gamma=16, chi=128, beta=64, k_blocks=128, k_exact=8)
QUICK_KNOBS = dict(gamma=16, chi=64, beta=16, k_blocks=4, k_exact=2)
VARIANTS = ("exact", "tree", "estimated")


def kilo(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def visible_pairs(n: int, block_size: int) -> int:
    """(query, key) pairs a block-causal(B) mask shows over n tokens (B = 1: causal)."""
    full_blocks, rest = divmod(n, block_size)
    pairs = block_size * block_size * full_blocks * (full_blocks + 1) // 2
    return pairs + rest * n


def momo_stages(q, k, v, block_size, knobs):
    """MOMO's kernel pipeline (exact top-k) as three callables (QSA, union and trim, block-sparse)
    sharing state, and the (query block, key block) pairs kept; momo_on_kernels in the same steps."""
    n, gamma, chi, beta, k_blocks = q.shape[2], knobs["gamma"], knobs["chi"], knobs["beta"], knobs["k_blocks"]
    state = {}

    def measure():
        state["qsa"] = qsa_attention(q, k, v, gamma=gamma, beta=beta, top_k=k_blocks, block_size=block_size)

    def trim():
        _, _, chosen, chosen_scores = state["qsa"]
        state["lists"] = kept_lists(chosen, chosen_scores, n, gamma, chi, beta, k_blocks)

    def attend():
        block_sparse_attention(q, k, v, state["lists"], chi=chi, beta=beta, block_size=block_size)

    measure()
    trim()
    return (measure, trim, attend), int((state["lists"] >= 0).sum())


def sdpa_causal(q, k, v):
    """SDPA as a user calls it, K / V expanded to the query heads."""
    group = q.shape[1] // k.shape[1]
    wide_k, wide_v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return lambda: F.scaled_dot_product_attention(q, wide_k, wide_v, is_causal=True)


def momo_floor_flops(n, heads, head_dim, block_size, kept_pairs, knobs):
    sampled_pairs = visible_pairs(n, block_size) / knobs["gamma"]
    return 4 * head_dim * (heads * sampled_pairs + kept_pairs * knobs["chi"] * knobs["beta"])


@torch.no_grad()
def bench_momo(args, timer, report, measure_rates, meta):
    device = timer.device
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, matmul_rate = measure_rates()
    meta.update(matmul_TFLOPs=matmul_rate, shapes=shapes, knobs=KNOBS)
    heads, kv_heads, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    knobs = QUICK_KNOBS if args.quick else KNOBS
    ms = lambda fn: eager_us(fn, device) / 1e3
    floor_ms = lambda flops: flops / matmul_rate / 1e9
    rows, stage_rows = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    for n in (args.lengths or shapes["lengths"]):
        q = torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=generator)
        k, v = (torch.randn(1, kv_heads, n, d, device=device, dtype=dtype, generator=generator) for _ in range(2))
        sdpa_ms = ms(sdpa_causal(q, k, v))
        for mask_name, block_size in (("causal", 1), (f"block-causal B={shapes['block_size']}", shapes["block_size"])):
            canvas = CanvasMask(block_size=block_size)
            dense_flops = 4 * d * heads * visible_pairs(n, block_size)
            ours_ms = ms(lambda: flash_attention(q, k, v, block_size=block_size))
            row = {"N": kilo(n), "mask": mask_name, "SDPA causal ms": sdpa_ms, "ours dense ms": ours_ms,
                   "dense floor ms": floor_ms(dense_flops)}
            for variant in VARIANTS:
                total = ms(lambda: momo_attention(q, k, v, canvas, knobs["gamma"], knobs["chi"], knobs["beta"],
                                                  knobs["k_blocks"], knobs["k_exact"], None, variant))
                row[f"MOMO {variant} ms"] = total
                if variant == "exact":
                    (measure, trim, attend), kept_pairs = momo_stages(q, k, v, block_size, knobs)
                    momo_flops = momo_floor_flops(n, heads, d, block_size, kept_pairs, knobs)
                    row["MOMO floor ms"] = floor_ms(momo_flops)
                    stage_rows.append({"N": kilo(n), "mask": mask_name, "QSA + top-k ms": ms(measure),
                                       "union + trim ms": ms(trim), "block-sparse ms": ms(attend),
                                       "total ms": total, "kept keys / row": kept_pairs * knobs["chi"] * knobs["beta"]
                                       / (heads * n), "FLOPs vs dense": momo_flops / dense_flops})
            row["SDPA / MOMO exact"] = sdpa_ms / row["MOMO exact ms"]
            rows.append(row)
        del q, k, v
    report.table("Prefill attention: MOMO vs SDPA and our dense kernel", rows,
                 f"batch 1, {heads} heads ({kv_heads} KV), d {d}, {meta['dtype']}; MOMO gamma {knobs['gamma']}, "
                 f"chi {knobs['chi']}, beta {knobs['beta']}, k = k_trim = {knobs['k_blocks']} blocks, k_exact "
                 f"{knobs['k_exact']} (estimated only); matmul rate {matmul_rate:.0f} TFLOP/s. SDPA runs causal for "
                 "both masks. Floors: FLOPs / matmul rate (module docstring).")
    report.table("MOMO's stages (exact top-k)", stage_rows,
                 "Each stage timed alone on the same inputs; 'kept keys / row' = chi x beta x kept block pairs "
                 "per query row and head (the block-sparse stage's work).")
    n = shapes["k_length"]
    q = torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=generator)
    k, v = (torch.randn(1, kv_heads, n, d, device=device, dtype=dtype, generator=generator) for _ in range(2))
    causal = CanvasMask(block_size=1)
    k_rows = []
    for k_blocks in shapes["ks"]:
        row = {"k blocks": k_blocks, "keys per sampled row": k_blocks * knobs["beta"]}
        for variant in VARIANTS:
            row[f"{variant} ms"] = ms(lambda: momo_attention(q, k, v, causal, knobs["gamma"], knobs["chi"],
                                                             knobs["beta"], k_blocks, min(knobs["k_exact"], k_blocks),
                                                             None, variant))
        k_rows.append(row)
    report.table(f"MOMO latency vs k at {kilo(n)} causal (Fig. 4 analogue)", k_rows,
                 "k = k_trim; the estimated variant keeps k_exact exact slots, the rest by threshold.")
    if getattr(args, "tune", False) and device.type == "cuda":
        sweep_tiles(report, q, k, v, knobs, ms)


def sweep_tiles(report, q, k, v, knobs, ms):
    """Each kernel's time under every launch setting of a small grid, causal (the defaults restored after)."""
    rows = []
    grids = {qsa_module: dict(BLOCK_M=(16, 32, 64), num_warps=(4, 8), num_stages=(2, 3)),
             block_sparse_module: dict(BLOCK_M=(64, 128), num_warps=(4, 8), num_stages=(2, 3))}
    (measure, trim, attend), _ = momo_stages(q, k, v, 1, knobs)
    trim()
    for module, grid in grids.items():
        default = dict(module.CUDA_TILES)
        for values in itertools.product(*grid.values()):
            module.CUDA_TILES = dict(zip(grid, values))
            if module is block_sparse_module and knobs["chi"] % module.CUDA_TILES["BLOCK_M"]:
                continue
            try:
                time_ms = ms(measure if module is qsa_module else attend)
            except Exception as error:  # noqa: BLE001 (a setting that does not compile is a result too)
                time_ms = f"failed: {type(error).__name__}"
            rows.append({"kernel": module.__name__.split(".")[-1], **module.CUDA_TILES, "ms": time_ms,
                         "default": module.CUDA_TILES == default})
        module.CUDA_TILES = default
    report.table(f"Launch settings at {kilo(q.shape[2])} causal (exact top-k, k = {knobs['k_blocks']})", rows,
                 "QSA: sampled rows per program; block-sparse: query rows per program (chi must be a multiple).")
