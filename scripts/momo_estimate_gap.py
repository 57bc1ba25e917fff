"""Which key blocks MOMO's estimated top-k misses against the exact top-k, on the structured synthetic
inputs of scripts/momo_mass.py (sink + slash + noise), for every sampled query row of a causal prefill:

    python scripts/momo_estimate_gap.py [--n 16384] [--k 32] [--k-exact 8]

Prints each set's share of the row's attention mass (over key blocks, before MOMO's union and trim),
and where in the row the blocks that only one of the two sets holds sit: their distance in blocks from
the row's last visible block (the diagonal). CPU, float64, torch references of both top-k variants.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels.qsa_estimate import estimated_top_k  # noqa: E402
from momo_mass import structured_qk  # noqa: E402
from nanodllm.methods.momo import block_scores, exact_top_k, mark  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--k-exact", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=16)
    parser.add_argument("--beta", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    q, k = structured_qk(args.n, 4, 4, 128, seed=args.seed)[:2]
    rows = torch.arange(0, args.n, args.gamma)
    scores = (q[:, :, rows].double() @ k.double().transpose(-1, -2)) * 128**-0.5
    scores = scores.masked_fill(torch.arange(args.n)[None, :] > rows[:, None], float("-inf"))
    per_block = block_scores(scores, args.beta)  # [1, heads, sampled rows, blocks]
    blocks = per_block.shape[-1]
    mass = per_block.softmax(dim=-1)
    exact = mark(exact_top_k(per_block, args.k), blocks)
    estimated = mark(estimated_top_k(per_block, args.k, args.k_exact), blocks)
    distance = ((rows // args.beta)[:, None] - torch.arange(blocks)[None, :]).expand_as(exact)
    quarters = torch.tensor([0.25, 0.5, 0.75])
    quartiles = lambda where: [round(x) for x in distance[where].float().quantile(quarters).tolist()]
    print(f"n {args.n}, k {args.k} (k_exact {args.k_exact}), gamma {args.gamma}, beta {args.beta}: "
          f"{rows.numel()} sampled rows x 4 heads")
    print(f"mass of the row's blocks captured: exact top-k {(mass * exact).sum(-1).mean():.4f}, "
          f"estimated {(mass * estimated).sum(-1).mean():.4f}")
    only_exact, only_estimated = exact & ~estimated, estimated & ~exact
    print(f"blocks only the exact set holds: {only_exact.sum(-1).float().mean():.1f} per row, mass "
          f"{(mass * only_exact).sum(-1).mean():.4f}, distance to the diagonal (quartiles) {quartiles(only_exact)}")
    print(f"blocks only the estimate holds: {only_estimated.sum(-1).float().mean():.1f} per row, mass "
          f"{(mass * only_estimated).sum(-1).mean():.4f}, distance to the diagonal (quartiles) "
          f"{quartiles(only_estimated)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
