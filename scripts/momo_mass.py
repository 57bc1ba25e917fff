"""Captured attention mass of MOMO's block mask against the oracle block mask and mean pooling, on a
tiny model's real queries and keys (the paper's Fig. 2e / the issue's accuracy bar).

    python scripts/momo_mass.py --model tiny-sdar --lengths 2048,4096 --n 4 --k 4

For every layer and head of a prefill over passkey prompts: P = the dense attention probabilities.
A block mask (per query block of chi rows, a set of key blocks of beta keys) captures
    mass = mean over rows of the sum of P over the keys the row's query block keeps (and the mask allows).
MOMO's mask is steps 1-2 of methods/momo.py (trimmed union of the sampled rows' top-k plus the
diagonal blocks). The oracle keeps, per query block, as many key blocks as MOMO kept there, chosen by
their true mass over the block's rows; mean pooling (the paper's baseline) ranks key blocks by the dot
product of the query block's mean query with the key block's mean key (scaled, masked), same count.
Prints mass / oracle mass for MOMO and mean pooling per length (averaged over layers, heads, prompts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanodllm import tasks  # noqa: E402
from nanodllm.attention import CanvasMask  # noqa: E402
from nanodllm.eval import resolve_model  # noqa: E402
from nanodllm.loader import load_model  # noqa: E402
from nanodllm.methods.momo import (dense_mask, diagonal_blocks, expand_blocks, measure_and_mask,  # noqa: E402
                                   scaled_scores)
from nanodllm.tokenizer import Tokenizer  # noqa: E402


def captured(probs, keep, n, chi, beta, full):
    """Mean over rows (and heads) of the probability mass inside the kept blocks."""
    return float((probs * expand_blocks(keep, n, chi, beta, full)).sum(-1).mean())


def block_mass(probs, n, chi, beta):
    """[batch, heads, query blocks, key blocks]: the true mass each key block gets from each query block."""
    query_blocks, key_blocks = -(-n // chi), -(-n // beta)
    padded = torch.nn.functional.pad(probs, (0, key_blocks * beta - n, 0, query_blocks * chi - n))
    return padded.view(*probs.shape[:2], query_blocks, chi, key_blocks, beta).sum(dim=(3, 5))


def best_per_query_block(scores, counts):
    """keep [.., query blocks, key blocks] with counts[..., qb] best key blocks per query block."""
    order = scores.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order))
    return (ranks < counts[..., None]) & (scores > float("-inf"))


def mean_pooling_scores(q, k, n, chi, beta, full):
    """The baseline's block scores: mean query of each query block . mean key of each key block."""
    group = q.shape[1] // k.shape[1]
    query_blocks, key_blocks = -(-n // chi), -(-n // beta)
    pooled_q = torch.nn.functional.pad(q.float(), (0, 0, 0, query_blocks * chi - n)).view(
        *q.shape[:2], query_blocks, chi, -1).sum(3) / chi
    keys = k.float().repeat_interleave(group, dim=1)
    pooled_k = torch.nn.functional.pad(keys, (0, 0, 0, key_blocks * beta - n)).view(
        *keys.shape[:2], key_blocks, beta, -1).sum(3) / beta
    scores = pooled_q @ pooled_k.transpose(-1, -2)
    if full is not None:  # a key block no row of the query block may see is never chosen
        visible = block_mass(full.float().expand(-1, q.shape[1], -1, -1), n, chi, beta) > 0
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def layer_queries_and_keys(model, ids, positions, mask):
    captured_qk = []

    def attend(layer, q, k, v):
        captured_qk.append((q, k))
        from nanodllm.attention import attention

        return attention(q, k, v, mask)

    model.hidden(ids, positions, attend)
    return captured_qk


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sdar")
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--n", type=int, default=4, help="prompts per length")
    parser.add_argument("--gamma", type=int, default=16)
    parser.add_argument("--chi", type=int, default=128)
    parser.add_argument("--beta", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="top-k key blocks per sampled query (and k_trim)")
    parser.add_argument("--seed", type=int, default=4321)
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = load_model(model_dir, "cpu", torch.float32, context=max(lengths) + 64)
    cfg = model.cfg
    tokenizer = Tokenizer.from_dir(model_dir, cfg.model_type)
    block_size = cfg.block_size if cfg.attention == "block_causal" else None
    print(f"{args.model}: gamma {args.gamma}, chi {args.chi}, beta {args.beta}, k = k_trim = {args.k} key blocks\n")
    print("| length | prompts | MOMO / oracle | mean pooling / oracle | oracle mass | blocks kept per query block |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        ratios = {"momo": [], "pool": []}
        oracle_mass, kept = [], []
        samples = tasks.make_samples("passkey", length, args.n, args.seed + length,
                                     count_tokens=lambda text: len(tokenizer.encode(text)))
        for sample in samples:
            ids = torch.tensor([tokenizer.chat([{"role": "user", "content": sample.prompt}])])
            n = ids.shape[1]
            mask = CanvasMask(block_size=block_size) if block_size else None
            full = dense_mask(mask, n, ids.device)
            for q, k in layer_queries_and_keys(model, ids, torch.arange(n)[None], mask):
                probs = torch.nan_to_num(scaled_scores(q, k, full).softmax(-1), nan=0.0)
                _, keep = measure_and_mask(q, k, k, full, args.gamma, args.chi, args.beta, args.k, args.k, args.k, "exact")
                counts = keep.sum(-1)
                oracle = best_per_query_block(block_mass(probs, n, args.chi, args.beta), counts)
                pool_scores = mean_pooling_scores(q, k, n, args.chi, args.beta, full)
                diagonal = diagonal_blocks(n, args.chi, args.beta, q.device)
                pool = best_per_query_block(pool_scores.masked_fill(diagonal, float("inf")), counts)
                best = captured(probs, oracle, n, args.chi, args.beta, full)
                ratios["momo"].append(captured(probs, keep, n, args.chi, args.beta, full) / best)
                ratios["pool"].append(captured(probs, pool, n, args.chi, args.beta, full) / best)
                oracle_mass.append(best)
                kept.append(float(counts.float().mean()))
        mean = lambda xs: sum(xs) / len(xs)
        print(f"| {length} | {len(samples)} | {mean(ratios['momo']):.4f} | {mean(ratios['pool']):.4f} | "
              f"{mean(oracle_mass):.4f} | {mean(kept):.1f} of {-(-n // args.beta)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
