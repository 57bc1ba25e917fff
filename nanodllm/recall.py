"""Recall diagnostics of per-block key selection (the MAGE paper's eq. 1, Fig. 1a and Fig. 3).

At every denoising step and layer where a selecting method (mage, quest, sparsed) read or chose a key
set (Method.selection), compare it with the ORACLE per-block top-k of the same step: the k prefix keys
of highest probability averaged over the block's queries and the group's heads, from this step's
exact scores (eq. 2, normalised as methods/mage.py says). Estimation accuracy (eq. 1) = |selected and
oracle| / |oracle| per row and KV head, kept per KV head (mean over rows) and overall; layers and
steps that attend exactly are not recorded. At each block's first step also record the union of the
per-query top-k sets over the block's queries and the group's heads, relative to k (Fig. 1a: how far
one shared set is from every query's own choice).

    records = attach(method)   # before generation; one Record per (block, step, layer)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import use_kernels
from .methods.mage import block_probabilities, block_scores
from .methods.common import listed_tokens, select_top_k


@dataclass
class Record:
    block: int
    step: int
    layer: int
    accuracy: float  # mean over rows and KV heads with a non-empty prefix
    head_accuracy: tuple  # per KV head, mean over rows with a non-empty prefix (nan: none)
    union_ratio: float | None  # |union of per-query top-k| / k, at a block's first step only


def token_mask(indices, counts, prefix_lengths, prefix: int, index_block: int) -> torch.Tensor:
    """[batch, kv_heads, prefix] bool: the tokens an index list selects (key blocks expanded, clipped)."""
    tokens, selected = listed_tokens(indices, counts, prefix_lengths, index_block)
    batch, num_kv_heads, _ = tokens.shape
    mask = torch.zeros(batch, num_kv_heads, prefix + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(2, torch.where(selected, tokens, prefix), True)  # unselected entries land in the spare column
    return mask[..., :prefix]


def union_ratio(q, k_cache, prefix_lengths, k: int) -> float:
    """Mean over rows and KV heads of |union over the group's query rows of each row's top-k| / k."""
    prefix = int(prefix_lengths.max())
    # softmax is monotone: the top-k of scores is the top-k of probabilities
    scores = block_scores(q, k_cache, prefix_lengths)[..., :prefix]
    in_prefix = torch.arange(prefix, device=q.device)[None, :] < prefix_lengths[:, None]
    scores = scores.masked_fill(~in_prefix[:, None, None], float("-inf"))  # the block's keys of shorter rows
    width = min(k, prefix)
    top = scores.topk(width, dim=-1).indices  # [batch, kv_heads, rows, width]
    valid = torch.arange(width, device=q.device) < prefix_lengths.clamp(max=k)[:, None, None, None]
    batch, num_kv_heads = scores.shape[:2]
    union = torch.zeros(batch, num_kv_heads, prefix + 1, dtype=torch.bool, device=q.device)
    union.scatter_(2, torch.where(valid, top, prefix).flatten(2), True)
    sizes = union[..., :prefix].sum(-1).float() / k  # [batch, kv_heads]
    return float(sizes[prefix_lengths > 0].mean())


def attach(method) -> list[Record]:
    """Wrap method.attend so that every selecting attention call is compared with the oracle."""
    records: list[Record] = []
    original = method.attend

    def attend(layer, q, k, v, ctx):
        out = original(layer, q, k, v, ctx)
        cache = ctx.cache
        chosen = None if cache is None or ctx.phase != "step" else method.selection(layer, ctx)
        if chosen is None or cache.max_length == 0:
            return out  # an exact call (an exact layer, SparseD's steps before its capture step)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)  # a side-stream selection is complete
        prefix = cache.max_length
        probabilities = block_probabilities(q, cache.keys[layer], cache.lengths, cache.scale)
        oracle = select_top_k(probabilities, cache.lengths, method.k, on_kernels=use_kernels(q))
        oracle_mask = token_mask(*oracle, cache.lengths, prefix, 1)
        chosen_mask = token_mask(chosen.indices, chosen.counts, cache.lengths, prefix, chosen.index_block)
        hits = (oracle_mask & chosen_mask).sum(-1).float()  # [batch, kv_heads]
        sizes = oracle_mask.sum(-1).float()
        has_prefix = sizes > 0
        ratios = torch.where(has_prefix, hits / sizes.clamp(min=1), float("nan"))
        accuracy = float(ratios[has_prefix].mean())
        head_accuracy = tuple(ratios.nanmean(0).tolist())
        first = ctx.step == 0
        union = union_ratio(q, cache.keys[layer], cache.lengths, method.k) if first else None
        records.append(Record(ctx.block, ctx.step, layer, accuracy, head_accuracy, union))
        return out

    method.attend = attend
    return records


def summarise(records: list[Record], steps_per_bucket: int = 4) -> str:
    """Markdown: mean estimation accuracy per step bucket (rows) and layer (columns), the same per
    layer and KV head over every recorded step, and the mean union ratio at the first step."""
    layers = sorted({r.layer for r in records})
    buckets = sorted({r.step // steps_per_bucket for r in records})
    lines = ["| steps | " + " | ".join(f"layer {l}" for l in layers) + " |", "|" + "---|" * (len(layers) + 1)]
    for bucket in buckets:
        cells = []
        for layer in layers:
            values = [r.accuracy for r in records if r.layer == layer and r.step // steps_per_bucket == bucket]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
        first, last = bucket * steps_per_bucket + 1, (bucket + 1) * steps_per_bucket
        lines.append(f"| {first}-{last} | " + " | ".join(cells) + " |")
    heads = max((len(r.head_accuracy) for r in records), default=0)
    lines += ["\nper KV head, over every recorded step:\n", "| layer | " + " | ".join(f"head {h}" for h in range(heads))
              + " |", "|" + "---|" * (heads + 1)]
    for layer in layers:
        per_head = torch.tensor([r.head_accuracy for r in records if r.layer == layer]).nanmean(0)
        lines.append(f"| {layer} | " + " | ".join(f"{value:.3f}" for value in per_head.tolist()) + " |")
    unions = [r.union_ratio for r in records if r.union_ratio is not None]
    if unions:
        lines.append(f"\nunion of per-query top-k over the block at step 1, relative to k: "
                     f"{sum(unions) / len(unions):.2f} (mean over blocks, layers, rows, KV heads)")
    return "\n".join(lines)
