"""`python scripts/bench.py kernels`: the attention, norm and RoPE kernels next to their floors and to
torch (docs/results/bench_kernels.md), on SDAR-8B's attention shapes (32 query heads, 8 KV heads,
head_dim 128, bf16), batch 1 and 4: the copy and matmul ceilings; block decode (L = 32 queries vs P
cached keys) against SDPA and K + V bytes; sparse block decode against gather + SDPA and the selected
bytes; the key-score pass; dense prefill against SDPA; the few-row norm_linear against rms_norm +
cuBLAS; the fused RMSNorm and RoPE against the model's torch form at llada-8b's rows (batch 16 x
768). GPU times from the Timer (CUDA graphs, L2 evicted).

`python scripts/bench.py tune`: every key of flash_attention's tuner measured on this GPU (bf16, an
8B model's heads at the top of each key's bucket), merged into kernels/tuned.json; prints how often
each candidate won (one that never wins on the file's GPUs can leave the tuning space).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from harness import kilo, visible_pairs, wall_us
from nanodllm.kernels.decode_attention import decode_attention
from nanodllm.kernels.key_scores import key_scores
from nanodllm.kernels.norm_linear import norm_linear
from nanodllm.kernels.rmsnorm import rms_norm, rms_norm_reference
from nanodllm.kernels.rope import apply_rope, apply_rope_reference
from nanodllm.kernels.silu_mul import silu_mul
from nanodllm.kernels.sparse_decode_attention import sparse_decode_attention
from nanodllm.model import Rope

# block: L, the active block's queries; prefixes: P cached keys; sparse_ks: selected tokens per KV head; key_block:
# tokens per key block of the blocked sparse rows; prefill_block_size: block-causal B of the prefill rows (SDAR-8B's
# default); norm_rows: (batch, rows) of the norm and RoPE rows; mlp_width: the norm_linear rows' gate (and up) width
FULL = SimpleNamespace(heads=32, kv_heads=8, head_dim=128, block=32, batches=(1, 4), prefixes=(8192, 32768, 131072),
                       sparse_prefix=131072, sparse_ks=(1024, 8192), key_block=64, prefill_lengths=(8192, 32768),
                       prefill_block_size=4, norm_rows=(16, 768), norm_hidden=4096, mlp_width=12288)
QUICK = SimpleNamespace(heads=4, kv_heads=2, head_dim=64, block=8, batches=(1, 2), prefixes=(96, 200),
                        sparse_prefix=200, sparse_ks=(32,), key_block=16, prefill_lengths=(64,), prefill_block_size=4,
                        norm_rows=(2, 32), norm_hidden=256, mlp_width=512)


def bench_decode(setup, shapes, inputs, bandwidth):
    """Block decode against the whole cache; returns {(batch, P): our microseconds} for later ratios."""
    timer, rows, ours = setup.timer, [], {}
    for (batch, (q, k_cache, v_cache)), prefix in itertools.product(inputs.items(), shapes.prefixes):
        n_keys = prefix + shapes.block
        lengths = torch.full((batch,), n_keys, device=setup.device, dtype=torch.int32)
        kv_bytes = batch * n_keys * 2 * shapes.kv_heads * shapes.head_dim * k_cache.element_size()
        call = lambda: decode_attention(q, k_cache, v_cache, lengths, max_length=n_keys)
        keys, values = k_cache[:, :n_keys].transpose(1, 2), v_cache[:, :n_keys].transpose(1, 2)  # a user's view
        us, eager_us = timer(call), timer.eager(call)
        sdpa_us = timer(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True))
        ours[batch, prefix] = us
        rows.append({"batch": batch, "P": kilo(prefix), "ours us": us, "SDPA us": sdpa_us,
                     "floor us": kv_bytes / bandwidth / 1e3, "ours GB/s": kv_bytes / us / 1e3,
                     "% of copy BW": 100 * kv_bytes / us / 1e3 / bandwidth, "SDPA GB/s": kv_bytes / sdpa_us / 1e3,
                     "speedup vs SDPA": sdpa_us / us, "ours eager us": eager_us})
    setup.report.table("Block decode (dense)", rows,
                       f"L = {shapes.block} queries vs P cached keys + the block's L keys; floor = K + V bytes / "
                       "copy bandwidth; SDPA(enable_gqa=True) reads the cache through a transposed view. 'eager' = "
                       "one call from Python (do_bench), host launch overhead included.")
    return ours


def gather_then_sdpa(q, k_cache, v_cache, tokens):
    """The torch baseline: gather each (row, KV head)'s tokens [batch, kv_heads, n], then SDPA."""
    batch_index = torch.arange(q.shape[0], device=q.device)[:, None, None]
    head_index = torch.arange(k_cache.shape[2], device=q.device)[None, :, None]
    keys, values = k_cache[batch_index, tokens, head_index], v_cache[batch_index, tokens, head_index]
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def bench_sparse(setup, shapes, inputs, bandwidth, dense_us):
    rows, prefix, device = [], shapes.sparse_prefix, setup.device
    for (batch, (q, k_cache, v_cache)), count, unit in itertools.product(inputs.items(), shapes.sparse_ks,
                                                                         (1, shapes.key_block)):
        cache_lengths = torch.full((batch,), prefix, device=device, dtype=torch.int32)
        # sorted duplicate-free random selections of count / unit units (tokens or key blocks) per (row, KV head)
        scores = torch.rand(batch, shapes.kv_heads, prefix // unit, device=device)
        indices = scores.topk(count // unit, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
        counts = torch.full((batch, shapes.kv_heads), count // unit, device=device, dtype=torch.int32)
        tokens = (indices[..., None].long() * unit + torch.arange(unit, device=device)).flatten(2)
        block_tokens = torch.arange(prefix, prefix + shapes.block, device=device).expand(batch, shapes.kv_heads, -1)
        tokens = torch.cat([tokens, block_tokens], dim=-1)
        read_bytes = tokens.numel() * 2 * shapes.head_dim * k_cache.element_size()
        us = setup.timer(lambda: sparse_decode_attention(q, k_cache, v_cache, cache_lengths, indices, counts,
                                                         index_block=unit))
        torch_us = setup.timer(lambda: gather_then_sdpa(q, k_cache, v_cache, tokens))
        rows.append({"batch": batch, "k": count, "index_block": unit, "ours us": us, "gather+SDPA us": torch_us,
                     "floor us": read_bytes / bandwidth / 1e3, "% of copy BW": 100 * read_bytes / us / 1e3 / bandwidth,
                     "speedup vs gather+SDPA": torch_us / us,
                     "speedup vs dense decode": dense_us.get((batch, prefix), float("nan")) / us})
    setup.report.table(f"Sparse block decode (P = {kilo(prefix)})", rows,
                       f"k selected prefix tokens per KV head (sorted random; as tokens or as {shapes.key_block}-token "
                       f"key blocks) + the block's {shapes.block} keys; floor = selected K + V bytes / copy bandwidth; "
                       "dense decode = our decode_attention over the whole prefix, same run.")


def bench_key_scores(setup, shapes, inputs, bandwidth, dense_us):
    rows = []
    for (batch, (q, k_cache, v_cache)), prefix in itertools.product(inputs.items(), shapes.prefixes):
        cache_lengths = torch.full((batch,), prefix, device=setup.device, dtype=torch.int32)
        _, lse = decode_attention(q, k_cache, v_cache, cache_lengths + shapes.block, max_length=prefix + shapes.block)
        k_bytes = batch * prefix * shapes.kv_heads * shapes.head_dim * k_cache.element_size()
        for with_dots in (False, True):
            us = setup.timer(lambda: key_scores(q, k_cache, cache_lengths, lse, with_dots=with_dots, max_length=prefix))
            rows.append({"batch": batch, "P": kilo(prefix), "dots": with_dots, "us": us,
                         "floor us (K bytes)": k_bytes / bandwidth / 1e3,
                         "% of copy BW": 100 * k_bytes / us / 1e3 / bandwidth,
                         "ratio to one decode pass": us / dense_us[batch, prefix]})
    setup.report.table("Key scores (MAGE / MaskKV / Sparse-dLLM selection pass)", rows,
                       "Probabilities of the block's queries over every prefix key, reduced over the GQA group and "
                       "the L queries, from the decode pass's LSE; one read of K, no V. Ideal ratio to a decode "
                       "pass: ~0.5.")


def bench_prefill(setup, shapes, matmul_rate):
    from nanodllm.kernels.flash_attention import flash_attention  # late: a test replaces it

    rows, b, device = [], shapes.prefill_block_size, setup.device
    for n in shapes.prefill_lengths:
        q = torch.randn(1, shapes.heads, n, shapes.head_dim, device=device, dtype=setup.dtype)
        k = torch.randn(1, shapes.kv_heads, n, shapes.head_dim, device=device, dtype=setup.dtype)
        v = torch.randn_like(k)
        full_flops = 4 * n * n * shapes.heads * shapes.head_dim
        sdpa = lambda causal: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        cases = [("bidirectional", lambda: flash_attention(q, k, v), 1.0, sdpa(False), 1.0),
                 (f"block-causal B={b} (SDPA: causal)", lambda: flash_attention(q, k, v, block_size=b),
                  visible_pairs(n, b) / n**2, sdpa(True), visible_pairs(n, 1) / n**2)]
        for name, ours, fraction, torch_form, sdpa_fraction in cases:
            us, sdpa_us = setup.timer(ours), setup.timer(torch_form)
            rate, sdpa_rate = full_flops * fraction / us / 1e6, full_flops * sdpa_fraction / sdpa_us / 1e6
            rows.append({"N": kilo(n), "mask": name, "ours ms": us / 1e3, "SDPA ms": sdpa_us / 1e3,
                         "ours TFLOP/s": rate, "SDPA TFLOP/s": sdpa_rate, "% of SDPA": 100 * rate / sdpa_rate,
                         "% of matmul": 100 * rate / matmul_rate})
    setup.report.table("Dense prefill (flash_attention)", rows,
                       f"batch 1; FLOPs = 4 N^2 heads d times the visible fraction of the mask; block-causal uses "
                       f"B = {b}, compared with SDPA's causal mask (its FLOPs counted for causal).")


def bench_norm_rope(setup, shapes):
    """The fused RMSNorm and RoPE kernels against the model's torch form; GB/s of the bytes that must move
    (input, output, the weight or tables once)."""
    device, dtype, (batch, length), hidden = setup.device, setup.dtype, shapes.norm_rows, shapes.norm_hidden
    heads, head_dim, calls = hidden // shapes.head_dim, shapes.head_dim, 5 if setup.quick else 50
    x = torch.randn(batch * length, hidden, device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    q = torch.randn(batch, length, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)  # a projection's view
    head_weight = (1 + 0.1 * torch.randn(head_dim, device=device)).to(dtype)
    rope = Rope(torch.arange(length, device=device)[None].expand(batch, -1), head_dim, 1e6)
    size = lambda *tensors: sum(t.numel() * t.element_size() for t in tensors)
    cases = [(f"rms_norm {list(x.shape)}", 2 * size(x) + size(weight), rms_norm, rms_norm_reference, (x, weight, 1e-6)),
             (f"rms_norm q/k {list(q.shape)} transposed view", 2 * size(q) + size(head_weight), rms_norm,
              rms_norm_reference, (q, head_weight, 1e-6)),
             (f"apply_rope {list(q.shape)} transposed view", 2 * size(q) + 2 * size(rope.cos), apply_rope,
              apply_rope_reference, (q, rope.cos, rope.sin))]
    rows = []
    for name, nbytes, fused, reference, args in cases:
        out, expected = fused(*args), reference(*args)
        fused_us, torch_us = (wall_us(lambda: fn(*args), device, tries=1, calls=calls, warmups=5)
                              for fn in (fused, reference))
        rows.append({"op": name, "fused us": fused_us, "fused GB/s": nbytes / fused_us / 1e3, "torch us": torch_us,
                     "torch GB/s": nbytes / torch_us / 1e3,
                     "max abs diff": (out.float() - expected.float()).abs().max().item(),
                     "bit-equal": f"{(out == expected).float().mean().item():.4%}"})
    setup.report.table("Fused RMSNorm and RoPE (kernels/rmsnorm.py, kernels/rope.py)", rows,
                       f"batch {batch} x {length} rows, mean of {calls} calls in a row after 5 warm-ups (CUDA "
                       "events); 'torch' is the model's torch form (fp32 upcast, rotate-half by cat and neg).")


def bench_norm_linear(setup, shapes, bandwidth):
    """kernels/norm_linear.py at a block step's rows of one sequence (its MAX_ROWS) on sdar-8b's q/k/v
    and gate/up weights, against the path it replaces (rms_norm, cuBLAS, silu_mul) and cuBLAS alone."""
    device, dtype, rows, hidden = setup.device, setup.dtype, shapes.block, shapes.norm_hidden
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    norm = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    table = []
    for name, width, swiglu in (("q/k/v", (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim, False),
                                ("gate/up + SwiGLU", 2 * shapes.mlp_width, True)):
        weight = torch.randn(width, hidden, device=device, dtype=dtype) / hidden**0.5
        finish = silu_mul if swiglu else (lambda out: out)
        fused_us = setup.timer(lambda: norm_linear(x, norm, 1e-6, weight, swiglu=swiglu))
        unfused_us = setup.timer(lambda: finish(F.linear(rms_norm(x, norm, 1e-6), weight)))
        cublas_us = setup.timer(lambda: F.linear(x, weight))
        floor_us = weight.numel() * weight.element_size() / bandwidth / 1e3
        table.append({"rows": rows, "projection": name, "floor us": floor_us, "rms_norm + cuBLAS (+ silu_mul) us":
                      unfused_us, "cuBLAS alone us": cublas_us, "norm_linear us": fused_us,
                      "norm_linear / floor": fused_us / floor_us})
    setup.report.table("Few-row norm_linear (kernels/norm_linear.py)", table,
                       "RMSNorm, the projection and SwiGLU in one launch (the model's path at batch 1) against the "
                       "launches it replaces; floor: the weight's bytes / copy bandwidth.")


def kernels(setup):
    shapes = QUICK if setup.quick else FULL
    setup.meta.update(shapes=vars(shapes))
    (bandwidth, matmul_rate), device, dtype = setup.ceilings, setup.device, setup.dtype
    setup.report.table("Ceilings", [{"copy bandwidth GB/s": bandwidth, "matmul TFLOP/s": matmul_rate}],
                       f"copy: device-to-device, read + written bytes; matmul: {setup.meta['dtype']}; best of several.")
    cache_shape = (max(*shapes.prefixes, shapes.sparse_prefix) + shapes.block, shapes.kv_heads, shapes.head_dim)
    inputs = {batch: (torch.randn(batch, shapes.heads, shapes.block, shapes.head_dim, device=device, dtype=dtype),
                      *(torch.randn(batch, *cache_shape, device=device, dtype=dtype) for _ in "kv"))
              for batch in shapes.batches}  # the block's queries, the K and V caches
    dense_us = bench_decode(setup, shapes, inputs, bandwidth)
    bench_sparse(setup, shapes, inputs, bandwidth, dense_us)
    bench_key_scores(setup, shapes, inputs, bandwidth, dense_us)
    del inputs
    for name, part in (("Dense prefill (flash_attention)", lambda: bench_prefill(setup, shapes, matmul_rate)),
                       ("Few-row norm_linear", lambda: bench_norm_linear(setup, shapes, bandwidth)),
                       ("Fused RMSNorm and RoPE", lambda: bench_norm_rope(setup, shapes))):
        try:  # other files' kernels: a failure there must not lose the tables above
            part()
        except Exception as error:  # noqa: BLE001
            setup.report.failure(name, error)
    return "bench_kernels"


HEAD_DIMS, LENGTHS = (64, 128), (1024, 2048, 4096, 8192, 16384, 32768)


def tune(out):
    """Measure every flash_attention tuner key on this GPU and merge the choices into `out`."""
    os.environ["NANODLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanodllm-tune-")  # measure afresh, cache nothing
    import nanodllm.kernels.flash_attention as fa
    from nanodllm.kernels.tuning import key_name, read_settings, write_settings

    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    fa.TUNER.known = {}  # ignore the shipped table: measure every key
    generator = torch.Generator(device=device).manual_seed(0)
    for head_dim, causal, padded, n_k, rows in itertools.product(HEAD_DIMS, (False, True), (False, True), LENGTHS,
                                                                  (64, fa.FEW_ROWS, 1024)):
        n_q = n_k if rows == 1024 else rows
        q = torch.randn(1, 32, n_q, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
        k, v = (torch.randn(1, 8, n_k, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
                for _ in range(2))
        k_valid = torch.arange(n_k, device=device)[None] >= n_k // 16 if padded else None  # left padding
        fa.flash_attention(q, k, v, causal=causal, k_valid=k_valid)  # the tuner measures the key's candidates
        print(f"flash_attention d={head_dim} causal={causal} padded={padded} N_k={n_k} rows<={rows}", flush=True)
    settings = read_settings(out)
    chosen = {key_name(key): setting for key, setting in fa.TUNER.chosen.items()}
    settings.setdefault(gpu, {})["flash_attention"] = dict(sorted(chosen.items()))
    write_settings(out, settings)
    wins = Counter((str(key[0]), json.dumps(setting, sort_keys=True)) for key, setting in fa.TUNER.chosen.items())
    print(f"\n{len(fa.TUNER.chosen)} keys measured on the {gpu}, written to {out}. Wins per candidate:")
    for head_dim in HEAD_DIMS:
        for setting in fa._TUNING_SPACE[head_dim] + fa._FEW_ROW_TILES[head_dim]:
            print(f"  d={head_dim} {wins[str(head_dim), json.dumps(setting, sort_keys=True)]:4d}  {setting}")
