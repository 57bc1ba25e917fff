"""`python scripts/bench.py routing`: the timings behind nanodllm/attention.py's choice of kernel
(docs/results/bench_routing.md). A few queries against many unmasked keys: flash_attention vs the
split-KV decode_attention, 8 to 256 queries, with and without GQA (the last column: which one
attention() picks). Many queries against a few hundred keys hidden per KV head (MaskKV's full
refresh): flash_attention with k_valid vs SDPA with the same bool mask, and both unmasked.
Batch 1, 32 query heads, head_dim 128, bf16; GPU times from the Timer (CUDA graphs, L2 evicted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanodllm.kernels.decode_attention import decode_attention
from nanodllm.kernels.flash_attention import flash_attention
from nanodllm.attention import SPLIT_MAX_QUERIES, SPLIT_MIN_KEYS

FULL = dict(heads=((32, 32), (32, 8)), queries=(8, 32, 64, 128, 256), keys=(256, 512, 1024, 2048, 4096, 8192, 32768),
            masked=((8192, 768), (32768, 768), (256, 768), (8192, 8448)), head_dim=128, kept=0.8)
QUICK = dict(heads=((4, 4), (4, 2)), queries=(4,), keys=(32, 64), masked=((64, 48),), head_dim=64, kept=0.8)


def random_qkv(heads, kv_heads, n_q, n_k, head_dim, device, dtype):
    q = torch.randn(1, heads, n_q, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, n_k, head_dim, device=device, dtype=dtype) for _ in range(2))
    return q, k, v


@torch.no_grad()
def routing(setup):
    shapes, timer, report = setup.shapes(QUICK, FULL), setup.timer, setup.report
    device, dtype = setup.device, setup.dtype
    rows = []
    for heads, kv_heads in shapes["heads"]:
        for n_q in shapes["queries"]:
            for n_k in shapes["keys"]:
                q, k, v = random_qkv(heads, kv_heads, n_q, n_k, shapes["head_dim"], device, dtype)
                flash = timer(lambda: flash_attention(q, k, v))
                split = timer(lambda: decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), n_k, return_lse=False))
                picks = "split" if n_q <= SPLIT_MAX_QUERIES and n_k >= SPLIT_MIN_KEYS else "flash"
                rows.append({"heads / kv heads": f"{heads}/{kv_heads}", "queries": n_q, "keys": n_k,
                             "flash us": flash, "split us": split, "flash / split": flash / split,
                             "attention() picks": picks})
    report.table("Few queries, no mask: flash_attention vs the split-KV decode kernel", rows,
                 f"attention() picks the split kernel for <= {SPLIT_MAX_QUERIES} queries against >= "
                 f"{SPLIT_MIN_KEYS} keys.")
    rows = []
    heads = shapes["heads"][0][0]
    for n_q, n_k in shapes["masked"]:
        q, k, v = random_qkv(heads, heads, n_q, n_k, shapes["head_dim"], device, dtype)
        kept = torch.rand(1, heads, n_k, device=device) < shapes["kept"]
        rows.append({"queries": n_q, "keys": n_k,
                     "masked flash us": timer(lambda: flash_attention(q, k, v, k_valid=kept)),
                     "masked SDPA us": timer(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                                  attn_mask=kept[:, :, None, :])),
                     "flash us": timer(lambda: flash_attention(q, k, v)),
                     "SDPA us": timer(lambda: F.scaled_dot_product_attention(q, k, v))})
    report.table("Many queries, keys hidden per KV head: flash_attention vs SDPA", rows,
                 f"{heads} heads and KV heads; each key kept with probability {shapes['kept']} per KV head.")
    return "bench_routing"
