"""`python scripts/bench.py momo`: MOMO's prefill attention against SDPA and our dense kernel
(docs/results/bench_momo.md). Batch 1, SDAR-8B's attention (32 query heads, 8 KV heads, head_dim 128,
bf16), N = 32K-128K (--lengths), random q / k / v, causal and block-causal (B = 4; SDPA has no
block-causal mask, so its causal time is the comparison there). SDPA gets K / V expanded to 32 heads
(what a user writes); ours is kernels/flash_attention.py; MOMO is methods/momo.py momo_attention at
the paper's defaults, once per top-k variant, plus its three stages timed apart, then its latency
vs k at 64K causal (the paper's Fig. 4). Times are eager (CUDA events, median of 3 after a warm-up):
MOMO's middle stage is torch ops and a host sync. Floors = FLOPs / the measured matmul rate, FLOPs
= 4 d heads x the (query, key) pairs computed. Random q / k make every block about as good as
another: the speed, not the mask, is measured here (scripts/momo_mass.py measures the masks).

`python scripts/bench.py momo_gemma`: the same on a full layer of DiffusionGemma's prompt pass (16
query heads, 2 KV heads, head_dim 512, scale 1, causal; docs/results/bench_momo_gemma.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness import kilo, visible_pairs, wall_us
from nanodllm.attention import CanvasMask
from nanodllm.kernels.block_sparse_attention import block_sparse_attention
from nanodllm.kernels.flash_attention import flash_attention
from nanodllm.kernels.qsa_attention import qsa_attention
from nanodllm.methods.momo import kept_lists, momo_attention

FULL = dict(lengths=(32768, 65536, 131072), heads=32, kv_heads=8, head_dim=128, block_size=4, k_length=65536,
            ks=(32, 64, 128, 256))
QUICK = dict(lengths=(512,), heads=4, kv_heads=2, head_dim=64, block_size=4, k_length=512, ks=(2, 4))
KNOBS = dict(gamma=16, chi=128, beta=64, k_blocks=128, k_exact=8)
QUICK_KNOBS = dict(gamma=16, chi=64, beta=16, k_blocks=4, k_exact=2)
VARIANTS = ("exact", "tree", "estimated")


def momo_stages(q, k, v, block_size, knobs):
    """MOMO's kernel pipeline (exact top-k) as three callables sharing state (QSA, union and trim,
    block-sparse), and the (query block, key block) pairs kept."""
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


def prepared(setup, quick: dict, full: dict, scale=None):
    """What a section starts from: its shapes, MOMO's knobs, the matmul rate, a timer (ms), MOMO's call
    (q, k, v, mask, k blocks, top-k variant) at `scale` and random q / k / v of n tokens."""
    device, dtype, shapes = setup.device, setup.dtype, setup.shapes(quick, full, knobs=KNOBS)
    knobs = QUICK_KNOBS if setup.quick else KNOBS
    momo_call = lambda q, k, v, mask, k_blocks, variant: momo_attention(
        q, k, v, mask, knobs["gamma"], knobs["chi"], knobs["beta"], k_blocks, min(knobs["k_exact"], k_blocks), None,
        variant, scale=scale)
    generator = torch.Generator(device=device).manual_seed(0)
    random_qkv = lambda n: tuple(torch.randn(1, shapes[heads], n, shapes["head_dim"], device=device, dtype=dtype,
                                             generator=generator) for heads in ("heads", "kv_heads", "kv_heads"))
    return shapes, knobs, setup.ceilings[1], lambda fn: wall_us(fn, device) / 1e3, momo_call, random_qkv


@torch.no_grad()
def momo(setup):
    shapes, knobs, matmul_rate, ms, momo_call, random_qkv = prepared(setup, QUICK, FULL)
    heads, kv_heads, d, gamma = shapes["heads"], shapes["kv_heads"], shapes["head_dim"], knobs["gamma"]
    floor_ms = lambda flops: flops / matmul_rate / 1e9
    rows, stage_rows = [], []
    for n in setup.args.lengths or shapes["lengths"]:
        q, k, v = random_qkv(n)
        wide_k, wide_v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))  # SDPA as a user calls it
        sdpa_ms = ms(lambda: F.scaled_dot_product_attention(q, wide_k, wide_v, is_causal=True))
        for mask_name, block_size in (("causal", 1), (f"block-causal B={shapes['block_size']}", shapes["block_size"])):
            canvas, dense_flops = CanvasMask(block_size=block_size), 4 * d * heads * visible_pairs(n, block_size)
            row = {"N": kilo(n), "mask": mask_name, "SDPA causal ms": sdpa_ms,
                   "ours dense ms": ms(lambda: flash_attention(q, k, v, block_size=block_size)),
                   "dense floor ms": floor_ms(dense_flops)}
            for variant in VARIANTS:
                row[f"MOMO {variant} ms"] = ms(lambda: momo_call(q, k, v, canvas, knobs["k_blocks"], variant))
                if variant != "exact":
                    continue
                (measure, trim, attend), kept_pairs = momo_stages(q, k, v, block_size, knobs)
                kept_keys = kept_pairs * knobs["chi"] * knobs["beta"]
                momo_flops = 4 * d * (heads * visible_pairs(n, block_size) / gamma + kept_keys)
                row["MOMO floor ms"] = floor_ms(momo_flops)
                stage_rows.append({"N": kilo(n), "mask": mask_name, "QSA + top-k ms": ms(measure),
                                   "union + trim ms": ms(trim), "block-sparse ms": ms(attend),
                                   "total ms": row["MOMO exact ms"], "kept keys / row": kept_keys / (heads * n),
                                   "FLOPs vs dense": momo_flops / dense_flops})
            row["SDPA / MOMO exact"] = sdpa_ms / row["MOMO exact ms"]
            rows.append(row)
        del q, k, v, wide_k, wide_v
    setup.report.table("Prefill attention: MOMO vs SDPA and our dense kernel", rows,
                       f"batch 1, {heads} heads ({kv_heads} KV), d {d}, {setup.meta['dtype']}; MOMO gamma "
                       f"{gamma}, chi {knobs['chi']}, beta {knobs['beta']}, k = k_trim = {knobs['k_blocks']} "
                       f"blocks, k_exact {knobs['k_exact']} (estimated only); matmul rate {matmul_rate:.0f} TFLOP/s. "
                       "SDPA runs causal for both masks.")
    setup.report.table("MOMO's stages (exact top-k)", stage_rows,
                       "Each stage timed alone on the same inputs; 'kept keys / row' = chi x beta x kept block pairs "
                       "per query row and head (the block-sparse stage's work).")
    n = shapes["k_length"]
    (q, k, v), causal = random_qkv(n), CanvasMask(block_size=1)
    k_rows = [{"k blocks": k_blocks, "keys per sampled row": k_blocks * knobs["beta"],
               **{f"{variant} ms": ms(lambda: momo_call(q, k, v, causal, k_blocks, variant))
                  for variant in VARIANTS}} for k_blocks in shapes["ks"]]
    setup.report.table(f"MOMO latency vs k at {kilo(n)} causal (Fig. 4 analogue)", k_rows,
                       "k = k_trim; the estimated variant keeps k_exact exact slots, the rest by threshold.")
    return "bench_momo"


GEMMA = dict(lengths=(8192, 32768, 131072), heads=16, kv_heads=2, head_dim=512)
QUICK_GEMMA = dict(lengths=(256,), heads=4, kv_heads=1, head_dim=512)


@torch.no_grad()
def momo_gemma(setup):
    shapes, knobs, matmul_rate, ms, momo_call, random_qkv = prepared(setup, QUICK_GEMMA, GEMMA, scale=1.0)
    heads, kv_heads, d, gamma = shapes["heads"], shapes["kv_heads"], shapes["head_dim"], knobs["gamma"]
    causal, rows = CanvasMask(block_size=1), []
    for n in shapes["lengths"]:
        q, k, v = random_qkv(n)
        dense_flops = 4 * d * heads * visible_pairs(n, 1)
        row = {"N": kilo(n), "ours dense ms": ms(lambda: flash_attention(q, k, v, causal=True, scale=1.0)),
               "dense floor ms": dense_flops / matmul_rate / 1e9}
        for variant in ("exact", "estimated"):
            row[f"MOMO {variant} ms"] = ms(lambda: momo_call(q, k, v, causal, knobs["k_blocks"], variant))
        row["dense / MOMO exact"] = row["ours dense ms"] / row["MOMO exact ms"]
        rows.append(row)
        del q, k, v
    setup.report.table("A full layer's prompt attention: MOMO vs our dense kernel", rows,
                       f"batch 1, {heads} heads ({kv_heads} KV), d {d}, scale 1, causal, {setup.meta['dtype']}; MOMO "
                       f"gamma {gamma}, chi {knobs['chi']}, beta {knobs['beta']}, k = k_trim = {knobs['k_blocks']} "
                       f"blocks, k_exact {knobs['k_exact']} (estimated only); matmul rate {matmul_rate:.0f} TFLOP/s.")
    return "bench_momo_gemma"
