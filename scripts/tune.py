"""Measure every tuned kernel's launch settings on this GPU and ship them in kernels/tuned.json.

    python scripts/tune.py [--out kernels/tuned.json]

A process that meets a key missing from kernels/tuned.json and from the user's cache measures it
itself, once per machine (kernels/tuning.py). This script measures them all ahead, for bfloat16,
on shapes of an 8B model (32 query and 8 KV heads, batch 1) at the top of each key's buckets, and
merges the choices for this GPU into --out. It prints how often each candidate won: a candidate
that never wins on the GPUs in the file can leave the tuning space.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["NANODLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanodllm-tune-")  # measure afresh, cache nothing

import kernels.flash_attention as fa  # noqa: E402
from kernels.tuning import key_name, read_settings, write_settings  # noqa: E402
from nanodllm.cli import output_file, run_main  # noqa: E402

HEAD_DIMS, LENGTHS, ROW_BUCKETS = (64, 128), (1024, 2048, 4096, 8192, 16384, 32768), (64, fa.FEW_ROWS, 1024)


def flash_attention_keys(device):
    """Run flash_attention once per key of its tuner: the tuner measures each (none is known here)."""
    generator = torch.Generator(device=device).manual_seed(0)
    for head_dim, causal, padded, n_k, rows in itertools.product(HEAD_DIMS, (False, True), (False, True),
                                                                  LENGTHS, ROW_BUCKETS):
        n_q = n_k if rows == 1024 else rows
        q = torch.randn(1, 32, n_q, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
        k, v = (torch.randn(1, 8, n_k, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
                for _ in range(2))
        k_valid = torch.arange(n_k, device=device)[None] >= n_k // 16 if padded else None  # left padding
        fa.flash_attention(q, k, v, causal=causal, k_valid=k_valid)
        print(f"flash_attention d={head_dim} causal={causal} padded={padded} N_k={n_k} rows<={rows}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_file, default=REPO / "kernels" / "tuned.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune.py measures launch settings on a GPU; there is none here")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    fa.TUNER.known = {}  # ignore the shipped table: measure every key
    flash_attention_keys(device)
    settings = read_settings(args.out)
    chosen = {key_name(key): setting for key, setting in fa.TUNER.chosen.items()}
    settings.setdefault(gpu, {})["flash_attention"] = dict(sorted(chosen.items()))
    write_settings(args.out, settings)
    wins = Counter((str(key[0]), json.dumps(setting, sort_keys=True)) for key, setting in fa.TUNER.chosen.items())
    print(f"\n{len(fa.TUNER.chosen)} keys measured on the {gpu}, written to {args.out}. Wins per candidate:")
    for head_dim in HEAD_DIMS:
        for setting in fa._TUNING_SPACE[head_dim] + fa._FEW_ROW_TILES[head_dim]:
            print(f"  d={head_dim} {wins[str(head_dim), json.dumps(setting, sort_keys=True)]:4d}  {setting}")


if __name__ == "__main__":
    sys.exit(run_main(main))
