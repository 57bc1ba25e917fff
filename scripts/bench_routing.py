"""`python scripts/bench.py routing`: the measurements behind nanodllm/attention.py's choice of kernel.

1. A few queries against many unmasked keys: flash_attention (one program per query tile and head)
   vs decode_attention (the keys split over the SMs, partial results merged), for 8 to 256 queries,
   with and without GQA. attention() sends at most SPLIT_MAX_QUERIES queries against SPLIT_MIN_KEYS
   or more keys to the split kernel; the table's last column says which one it picks.
2. Many queries against a few hundred keys hidden per KV head (MaskKV's full refresh: the canvas's
   queries against the kept prompt keys and the response): flash_attention with k_valid
   [batch, kv_heads, keys] vs torch SDPA with the same mask as a bool [batch, heads, 1, keys], and
   both without a mask. attention() uses flash_attention for such masks.
Batch 1, 32 query heads, head_dim 128, bf16; GPU times from Timer (CUDA graphs, L2 evicted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention
from kernels.flash_attention import flash_attention
from nanodllm.attention import SPLIT_MAX_QUERIES, SPLIT_MIN_KEYS

FULL = dict(heads=((32, 32), (32, 8)), queries=(8, 32, 64, 128, 256), keys=(256, 512, 1024, 2048, 4096, 8192, 32768),
            masked=((8192, 768), (32768, 768), (256, 768), (8192, 8448)), head_dim=128, kept=0.8)
QUICK = dict(heads=((4, 4), (4, 2)), queries=(4,), keys=(32, 64), masked=((64, 48),), head_dim=64, kept=0.8)


def random_qkv(heads, kv_heads, n_q, n_k, head_dim, device, dtype):
    q = torch.randn(1, heads, n_q, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, n_k, head_dim, device=device, dtype=dtype) for _ in range(2))
    return q, k, v


@torch.no_grad()
def bench_routing(args, timer, report, meta):
    shapes = QUICK if args.quick else FULL
    device = timer.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta.update(shapes=shapes)
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
