"""Captured attention mass of MOMO's block mask against the oracle block mask and mean pooling, on a
tiny model's real queries and keys or on structured synthetic ones (the paper's Fig. 2e; the method
and the tables: docs/results/momo_mass.md).

    python scripts/momo_mass.py --model tiny-sdar --lengths 2048,4096 --n 4 --k 4
    python scripts/momo_mass.py --synthetic --lengths 32768,65536,131072 --mask causal,block --k 128

Model mode: every layer and head of a prefill over passkey prompts, on the CPU. Synthetic mode
(structured_qk: sink 10, slash 8, noise 1, blocks of 4 for --mask block) on --device (CUDA: bfloat16,
MOMO's mask from the Triton kernels; CPU: float32, small lengths only); its rows add the seconds taken
(the first includes Triton's compile). The dense probabilities are never formed whole: their block
masses are summed over chunks of query rows (chunked_block_mass).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanodllm.cli import (available_device, help_text, output_file, positive_int, positive_ints, run_main,  # noqa: E402
                          write_whole)
from nanodllm.attention import CanvasMask  # noqa: E402
from nanodllm.methods.momo import (dense_mask, diagonal_blocks, kept_blocks, measure_and_mask,  # noqa: E402
                                   measure_on_kernels)

ANCHORS, ANCHOR_DIMS = 32, 16
COLUMNS = ("| MOMO / oracle | mean pooling / oracle | MOMO / oracle with diagonals | mean pooling / oracle with "
           "diagonals | oracle mass | blocks kept per query block |")
MASKS = {"causal": 1, "block": 4, "none": None}  # the block size B of each --mask: key j // B <= query p // B
SEED = 4321


def rope(vector, positions, base=10000.0):
    """[len(positions), d]: vector with each coordinate pair f rotated by position * base ** (-f / pairs)."""
    pairs = vector.shape[-1] // 2
    angle = positions.double()[:, None] * base ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    x, y = vector[0::2].double(), vector[1::2].double()
    return torch.stack([x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos()], -1).flatten(-2).float()


def structured_qk(n, heads, kv_heads, head_dim, seed, sink_logit=10.0, slash_logit=8.0, noise=1.0):
    """Synthetic q [1, heads, n, d] and k [1, kv_heads, n, d] (float32, CPU): Gaussian noise of std `noise`,
    plus, per KV head (its query heads share it), vertical stripes: 32 anchor keys (positions 0-3 and
    28 drawn at random) carry a direction u in the first 16 coordinates, as does every query, so anchor
    scores q . k / sqrt(d) gain sink_logit; and slash lines: the other coordinates carry equal-energy
    pairs w, RoPE-rotated (base 10000): key j holds R(j) w, query i the sum of R(i - o) w over offsets
    o = 0 and two drawn log-uniformly in [64, n / 4], so scores gain slash_logit x the mean over the
    pairs' frequencies of cos(frequency (i - j - o)): 1 on a line, a halo near it, ripples far off."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, head_dim, generator=generator) * noise
    k = torch.randn(1, kv_heads, n, head_dim, generator=generator) * noise
    positions, group, root = torch.arange(n), heads // kv_heads, head_dim**0.25
    for kv_head in range(kv_heads):
        queries = q[0, kv_head * group : (kv_head + 1) * group]
        anchors = torch.cat([torch.arange(4), 4 + torch.randperm(n - 4, generator=generator)[: ANCHORS - 4]])
        u = torch.randn(ANCHOR_DIMS, generator=generator)
        u *= math.sqrt(sink_logit) * root / u.norm()
        k[0, kv_head, anchors, :ANCHOR_DIMS] += u
        queries[..., :ANCHOR_DIMS] += u
        phase = torch.rand((head_dim - ANCHOR_DIMS) // 2, generator=generator) * 2 * math.pi
        w = torch.stack([phase.cos(), phase.sin()], -1).flatten() * math.sqrt(slash_logit / len(phase)) * root
        far = torch.empty(2).uniform_(math.log(64), math.log(max(n / 4, 64)), generator=generator).exp()
        k[0, kv_head, :, ANCHOR_DIMS:] += rope(w, positions)
        queries[..., ANCHOR_DIMS:] += sum(rope(w, positions - offset) for offset in [0, *far.long().tolist()])
    return q, k


def momo_keep(q, k, mask_block, args):
    """MOMO's keep [batch, heads, query blocks, key blocks] as momo_attention builds it: on CUDA
    momo_on_kernels' steps 1-2 (QSA kernel, union and trim, diagonal blocks: nothing n x n), else
    measure_and_mask (forms the [n, n] mask: small n only)."""
    n = q.shape[2]
    if q.is_cuda:
        k_exact = args.k_exact if args.top_k == "estimated" else args.k
        _, chosen, values, summed = measure_on_kernels(q, k, k, args.gamma, args.beta, args.k, k_exact,
                                                       args.top_k == "tree", args.trim, block_size=mask_block)
        return kept_blocks(chosen, values, n, args.gamma, args.chi, args.beta, args.k_trim, summed)
    full = dense_mask(CanvasMask(block_size=mask_block), n, q.device)
    return measure_and_mask(q, k, k, full, args.gamma, args.chi, args.beta, args.k, args.k_exact, args.k_trim,
                            args.top_k, args.trim)[1]


def sees(query_positions, key_positions, mask_block):
    """[queries, keys] bool: query p sees key j iff j // B <= p // B (B = mask_block: 1 causal, None all)."""
    if mask_block is None:
        return torch.ones(len(query_positions), len(key_positions), dtype=torch.bool, device=query_positions.device)
    return key_positions[None, :] // mask_block <= query_positions[:, None] // mask_block


def block_mass(probs, chi, beta):
    """[..., row blocks, key blocks]: the mass of each (chi rows, beta keys) block of probs [..., rows, keys]."""
    rows, keys = probs.shape[-2:]
    row_blocks, key_blocks = -(-rows // chi), -(-keys // beta)
    padded = torch.nn.functional.pad(probs, (0, key_blocks * beta - keys, 0, row_blocks * chi - rows))
    return padded.view(*probs.shape[:-2], row_blocks, chi, key_blocks, beta).sum(dim=(-3, -1))


def chunked_block_mass(q, k, mask_block, chi, beta, budget=2**28):
    """[batch, heads, query blocks, key blocks]: block_mass of the dense attention probabilities, from
    fp32 scores of chi-aligned chunks of about budget / n query rows against the keys they may see."""
    batch, heads, n, head_dim = q.shape
    group, rows = heads // k.shape[1], max(chi, budget // n // chi * chi)
    mass = torch.zeros(batch, heads, -(-n // chi), -(-n // beta), device=q.device)
    for head in range(heads):
        keys = k[:, head // group].float()
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            seen = n if mask_block is None else min(n, ((stop - 1) // mask_block + 1) * mask_block)
            scores = q[:, head, start:stop].float() @ keys[:, :seen].transpose(-1, -2) * head_dim**-0.5
            if mask_block is not None:
                positions = torch.arange(seen, device=q.device)
                scores.masked_fill_(~sees(positions[start:stop], positions, mask_block), float("-inf"))
            query_blocks, key_blocks = slice(start // chi, -(-stop // chi)), slice(None, -(-seen // beta))
            mass[:, head, query_blocks, key_blocks] = block_mass(scores.softmax(-1), chi, beta)
    return mass


def mean_pooling_scores(q, k, chi, beta, visible):
    """The baseline's block scores: mean query of each query block . mean key of each key block;
    -inf where visible [query blocks, key blocks] is False (no row of the query block sees the key block)."""
    group, n = q.shape[1] // k.shape[1], q.shape[2]
    query_blocks, key_blocks = -(-n // chi), -(-n // beta)
    pooled_q = torch.nn.functional.pad(q.float(), (0, 0, 0, query_blocks * chi - n)).view(
        *q.shape[:2], query_blocks, chi, -1).sum(3) / chi
    keys = k.float().repeat_interleave(group, dim=1)
    pooled_k = torch.nn.functional.pad(keys, (0, 0, 0, key_blocks * beta - n)).view(
        *keys.shape[:2], key_blocks, beta, -1).sum(3) / beta
    return (pooled_q @ pooled_k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))


def best_per_query_block(scores, counts):
    """keep [.., query blocks, key blocks] with counts[..., qb] best key blocks per query block."""
    order = scores.argsort(dim=-1, descending=True)
    places = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, places)
    return (ranks < counts[..., None]) & (scores > float("-inf"))


def captured(mass, keep, n):
    """Mean over rows (and heads) of the probability mass inside the kept blocks, from the block masses."""
    return float((mass * keep).sum()) / (mass[..., 0, 0].numel() * n)


def mass_ratios(mass, keep, pool_scores, n, chi, beta):
    """From the true block masses, MOMO's keep and the pooled scores: MOMO's and mean pooling's captured
    mass over the oracle's (same count per query block) and over the oracle with diagonals', the
    oracle's mass, the mean blocks kept."""
    counts = keep.sum(-1)
    diagonal = diagonal_blocks(n, chi, beta, mass.device)
    best = captured(mass, best_per_query_block(mass, counts), n)
    best_with_diagonals = captured(mass, best_per_query_block(mass.masked_fill(diagonal, float("inf")), counts), n)
    momo = captured(mass, keep, n)
    pool = captured(mass, best_per_query_block(pool_scores.masked_fill(diagonal, float("inf")), counts), n)
    return {"momo": momo / best, "pool": pool / best, "momo diagonals": momo / best_with_diagonals,
            "pool diagonals": pool / best_with_diagonals, "oracle": best, "kept": float(counts.float().mean())}


def measure(q, k, mask_block, args):
    """mass_ratios of one forward's q [batch, heads, n, d], k [batch, kv_heads, n, d]."""
    n, chi, beta = q.shape[2], args.chi, args.beta
    keep = momo_keep(q, k, mask_block, args)
    mass = chunked_block_mass(q, k, mask_block, chi, beta)
    positions = torch.arange(n, device=q.device)
    visible = sees(torch.clamp(positions[::chi] + chi, max=n) - 1, positions[::beta], mask_block)
    return mass_ratios(mass, keep, mean_pooling_scores(q, k, chi, beta, visible), n, chi, beta)


def table_row(first_columns, results, n, beta):
    mean = lambda key: sum(result[key] for result in results) / len(results)
    return (f"| {' | '.join(map(str, first_columns))} | {mean('momo'):.4f} | {mean('pool'):.4f} | "
            f"{mean('momo diagonals'):.4f} | {mean('pool diagonals'):.4f} | {mean('oracle'):.4f} | "
            f"{mean('kept'):.1f} of {-(-n // beta)} |")


def model_table(args):
    from nanodllm import tasks
    from nanodllm.attention import attention
    from nanodllm.eval import resolve_model
    from nanodllm.loader import load_model
    from nanodllm.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    model = load_model(model_dir, "cpu", torch.float32, context=max(args.lengths) + 64)
    tokenizer = Tokenizer.from_dir(model_dir, model.cfg.model_type)
    block_size = model.cfg.block_size if model.cfg.attention == "block_causal" else None
    yield (f"{args.model}: gamma {args.gamma}, chi {args.chi}, beta {args.beta}, k = {args.k}, "
           f"k_trim = {args.k_trim} key blocks, trim {args.trim}\n")
    yield f"| length | prompts {COLUMNS}"
    yield "|---|---|---|---|---|---|---|---|"
    for length in args.lengths:
        results = []
        samples = tasks.make_samples("passkey", length, args.n, SEED + length,
                                     count_tokens=lambda text: len(tokenizer.encode(text)))
        for sample in samples:
            ids = torch.tensor([tokenizer.chat([{"role": "user", "content": sample.prompt}])])
            n, mask = ids.shape[1], CanvasMask(block_size=block_size) if block_size else None

            def attend(layer, q, k, v):  # each layer's prefill, measured
                results.append(measure(q, k, block_size, args))
                return attention(q, k, v, mask)

            model.hidden(ids, torch.arange(n)[None], attend)
        yield table_row([length, len(samples)], results, n, args.beta)


def synthetic_table(args):
    yield (f"synthetic (sink 10.0, slash 8.0, noise 1.0), {args.device} "
           f"{args.dtype}: heads {args.heads} (KV {args.heads}), d {args.head_dim}, gamma {args.gamma}, "
           f"chi {args.chi}, beta {args.beta}, k = {args.k}, k_trim = {args.k_trim} key blocks, top-k {args.top_k}, "
           f"trim {args.trim}\n")
    yield f"| length | mask {COLUMNS} seconds |"
    yield "|---|---|---|---|---|---|---|---|---|"
    for length in args.lengths:
        q, k = (x.to(args.device, getattr(torch, args.dtype))
                for x in structured_qk(length, args.heads, args.heads, args.head_dim, SEED + length))
        for mask in args.mask.split(","):
            start = time.perf_counter()
            result = measure(q, k, MASKS[mask], args)
            label = f"block-causal ({MASKS[mask]})" if mask == "block" else mask
            yield table_row([length, label], [result], length, args.beta) + f" {time.perf_counter() - start:.1f} |"


@torch.no_grad()
def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", action="store_true", help="structured synthetic q/k instead of a model's")
    parser.add_argument("--model", default="tiny-sdar")
    parser.add_argument("--lengths", type=positive_ints, default=None,
                        help="default 2048; synthetic 32768,65536,131072")
    parser.add_argument("--n", type=positive_int, default=4, help="prompts per length")
    parser.add_argument("--gamma", type=positive_int, default=16)
    parser.add_argument("--chi", type=positive_int, default=128)
    parser.add_argument("--beta", type=positive_int, default=64)
    parser.add_argument("--k", type=positive_int, default=None, help="top-k key blocks per sampled query (and k_trim "
                        "unless --k-trim); default 4 (tiny models), synthetic 128 (the paper's)")
    parser.add_argument("--k-trim", type=positive_int, default=None, help="blocks kept per query block (default --k)")
    parser.add_argument("--top-k", default="exact", choices=["exact", "tree", "estimated"])
    parser.add_argument("--trim", default="mean", choices=["mean", "mass"], help="MOMO's trim: mean = Algorithm 2")
    parser.add_argument("--k-exact", type=int, default=8, help="exact slots of the estimated top-k")
    synthetic = parser.add_argument_group("synthetic mode")
    synthetic.add_argument("--heads", type=positive_int, default=4, help="each its own KV head and pattern")
    synthetic.add_argument("--head-dim", type=positive_int, default=128)
    synthetic.add_argument("--mask", default="causal", help="comma list of causal, block (block-causal, B = 4), none")
    synthetic.add_argument("--device", type=available_device, default="cuda" if cuda else "cpu")
    synthetic.add_argument("--dtype", default="bfloat16" if cuda else "float32",
                           choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=output_file, default=None, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    if unknown := set(args.mask.split(",")) - set(MASKS):
        parser.error(f"argument --mask: {', '.join(sorted(unknown))} is not a mask; choose from {', '.join(MASKS)}")
    args.lengths = args.lengths or ([32768, 65536, 131072] if args.synthetic else [2048])
    args.k = (128 if args.synthetic else 4) if args.k is None else args.k
    args.k_trim = args.k if args.k_trim is None else args.k_trim
    lines = []
    for line in synthetic_table(args) if args.synthetic else model_table(args):
        print(line, flush=True)
        lines.append(line)
    if args.out:
        write_whole(args.out, lambda partial: partial.write_text("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
