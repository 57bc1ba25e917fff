"""MOMO (Measure Once, Mask Once): delta-corrected block-sparse attention for long prefills.

Paper: ../shared/papers/002_325610b97a7d67f4.txt (Algorithms 1-2, eq. 2-7, appendix A).

Idea. Every gamma-th query attends densely (query-sparse attention, QSA); while it scans the keys
it also scores every key block j of beta keys, S(j) = logsumexp of its scaled scores over the block
(eq. 4), and keeps the top-k blocks. Per query block of chi rows the chi / gamma sampled rows' blocks
are united and trimmed to the k_trim blocks of highest mean score (Algorithm 2), the diagonal blocks
always added. Every query then attends to its query block's kept key blocks (block-sparse attention,
O_*), and the error that sparsity makes is corrected with the sampled rows' exact outputs:
O_i = O_*[i] + O_gamma[i // gamma] - O_*[(i // gamma) * gamma] (eq. 2-3).

Top-k variants (`top_k`): "exact" (the online k-slot buffer and the tournament tree both return the
exact top-k, ties to the lower block index), "estimated" (the k_exact best exactly, the other
k - k_exact slots filled greedily by blocks whose score beats a Gaussian threshold from Welford
running statistics: eq. 6-7). This file is the torch reference of the whole pipeline (it forms the
score matrix of the sampled rows and the sparse mask densely); the Triton kernels that never form
them are the next slice of the issue.

Hooks: prefill (block engine: the prompt's attention), step (masked engine, canvas=True: every full
canvas step).
Equals dense: k covering every key block (delta = 0 then; test for both top-k variants).
Knobs (paper defaults): gamma = 16, chi = 128, beta = 64, k = 128, k_exact = 8, k_trim = k,
top_k = "exact" | "estimated", canvas = False.
"""

from __future__ import annotations

import math

import torch

from ..attention import CanvasMask
from .base import Method


def dense_mask(mask, n, device):
    """The [batch, 1, n, n] bool mask (or None) of a CanvasMask, a bool tensor or None."""
    return mask.dense(n, n, device) if isinstance(mask, CanvasMask) else mask


def scaled_scores(q, k, mask):
    """[batch, heads, q_len, n] scores in fp32 or wider (GQA), -inf where mask [batch, 1 or heads,
    q_len, n] is False."""
    group = q.shape[1] // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    keys = k.to(compute).repeat_interleave(group, dim=1)
    scores = q.to(compute) @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def softmax_out(scores, v):
    """softmax(scores) v with GQA; rows that see nothing give 0."""
    group = scores.shape[1] // v.shape[1]
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    return probs @ v.to(probs.dtype).repeat_interleave(group, dim=1)


def block_scores(scores, beta):
    """eq. 4: [batch, heads, rows, ceil(n / beta)] logsumexp of each key block's scores (-inf: none visible)."""
    n = scores.shape[-1]
    blocks = math.ceil(n / beta)
    padded = torch.nn.functional.pad(scores, (0, blocks * beta - n), value=float("-inf"))
    return padded.view(*scores.shape[:-1], blocks, beta).logsumexp(dim=-1)


def exact_top_k(scores, k):
    """The k best blocks per row (ties to the lower index), -1 where a row has fewer visible blocks."""
    k = min(k, scores.shape[-1])
    columns = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.float64)
    ranked = scores.double() - columns * 1e-12 * (scores.double().abs() + 1)  # lower index wins a tie
    values, indices = ranked.topk(k, dim=-1)
    return torch.where(values > float("-inf"), indices, -1)


def estimated_top_k(scores, k, k_exact):
    """eq. 6-7 with a k_exact exact part, scanning the blocks in order as the kernel does: each
    block is offered to the exact buffer; what it displaces (or the block itself) is accepted into
    one of the k - k_exact other slots when its score beats m + sqrt(2) sigma erfinv(2p - 1),
    p = 1 - free slots / blocks left, m and sigma running over the visible blocks seen so far."""
    rows_shape, blocks = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(-1, blocks).double()
    rows = flat.shape[0]
    exact_scores = flat.new_full((rows, k_exact), float("-inf"))
    exact_index = torch.full((rows, k_exact), -1, dtype=torch.long, device=scores.device)
    greedy = torch.full((rows, max(k - k_exact, 0)), -1, dtype=torch.long, device=scores.device)
    filled = torch.zeros(rows, dtype=torch.long, device=scores.device)
    count = torch.zeros(rows, dtype=torch.float64, device=scores.device)
    mean = torch.zeros(rows, dtype=torch.float64, device=scores.device)
    m2 = torch.zeros(rows, dtype=torch.float64, device=scores.device)
    visible_total = (flat > float("-inf")).sum(dim=1)
    seen = torch.zeros(rows, dtype=torch.long, device=scores.device)
    all_rows = torch.arange(rows, device=scores.device)
    for j in range(blocks):
        score = flat[:, j]
        visible = score > float("-inf")
        seen += visible.long()
        count += visible.double()  # Welford over the visible blocks
        delta = torch.where(visible, score - mean, 0.0)
        mean += torch.where(visible, delta / count.clamp(min=1), 0.0)
        m2 += torch.where(visible, delta * (score - mean), 0.0)
        out_score, out_index = torch.where(visible, score, float("-inf")), torch.where(visible, j, -1)
        if k_exact:
            slot = exact_scores.argmin(dim=1)
            lowest, lowest_index = exact_scores[all_rows, slot], exact_index[all_rows, slot]
            takes = visible & (score > lowest)
            out_score, out_index = torch.where(takes, lowest, out_score), torch.where(takes, lowest_index, out_index)
            exact_scores[all_rows, slot] = torch.where(takes, score, lowest)
            exact_index[all_rows, slot] = torch.where(takes, j, lowest_index)
        free = greedy.shape[1] - filled
        left = (visible_total - seen + 1).double()  # blocks left to scan, this one included
        p = 1 - free.double() / left.clamp(min=1)
        sigma = (m2 / (count - 1).clamp(min=1)).sqrt()
        threshold = mean + math.sqrt(2) * sigma * torch.special.erfinv((2 * p - 1).clamp(-1 + 1e-12, 1 - 1e-12))
        accept = (out_index >= 0) & (free > 0) & ((p <= 0) | (out_score > threshold))
        target = filled.clamp(max=max(greedy.shape[1] - 1, 0))
        if greedy.shape[1]:
            greedy[all_rows, target] = torch.where(accept, out_index, greedy[all_rows, target])
        filled += accept.long()
    chosen = torch.cat([exact_index, greedy], dim=1)
    return chosen.view(*rows_shape, -1)


def mark(indices, size):
    """[..., k] indices (-1 = none) -> [..., size] bool, True at the listed ones."""
    out = torch.zeros(*indices.shape[:-1], size + 1, dtype=torch.bool, device=indices.device)
    return out.scatter_(-1, torch.where(indices >= 0, indices, size), True)[..., :size]


def union_and_trim(scores, chosen, rows_per_block, k_trim):
    """Algorithm 2: per query block, the union of its sampled rows' chosen blocks, ranked by their
    mean score over the rows that chose them; the k_trim best. scores [batch, heads, rows, blocks],
    chosen [batch, heads, rows, k] (-1 = none). Returns keep [batch, heads, query blocks, blocks] bool."""
    batch, heads, rows, blocks = scores.shape
    query_blocks = math.ceil(rows / rows_per_block)
    picked = mark(chosen, blocks)
    pad = query_blocks * rows_per_block - rows
    picked = torch.nn.functional.pad(picked, (0, 0, 0, pad)).view(batch, heads, query_blocks, rows_per_block, blocks)
    values = torch.nn.functional.pad(scores, (0, 0, 0, pad)).view(picked.shape)
    total = torch.where(picked, values, 0.0).sum(dim=3)
    times = picked.sum(dim=3)
    mean = torch.where(times > 0, total / times.clamp(min=1), float("-inf"))
    return mark(exact_top_k(mean, k_trim), blocks)


def momo_attention(q, k, v, mask=None, gamma=16, chi=128, beta=64, k_blocks=128, k_exact=8, k_trim=None,
                   top_k="exact"):
    """Algorithm 1 in torch: q [batch, heads, n, d], k/v [batch, kv_heads, n, d], mask a CanvasMask,
    a bool [batch, 1, n, n] or None (bidirectional). Returns [batch, heads, n, d] in q's dtype."""
    if chi % gamma:
        raise ValueError(f"chi ({chi}) must be a multiple of gamma ({gamma})")
    batch, heads, n, _ = q.shape
    full = dense_mask(mask, n, q.device)
    sampled = torch.arange(0, n, gamma, device=q.device)
    sampled_mask = None if full is None else full[:, :, sampled]
    sampled_scores = scaled_scores(q[:, :, sampled], k, sampled_mask)
    o_gamma = softmax_out(sampled_scores, v)
    scores = block_scores(sampled_scores, beta)
    chosen = exact_top_k(scores, k_blocks) if top_k == "exact" else estimated_top_k(scores, k_blocks, k_exact)
    keep = union_and_trim(scores, chosen, chi // gamma, k_trim or k_blocks)
    query_block = torch.arange(n, device=q.device) // chi
    key_block = torch.arange(n, device=q.device) // beta
    diagonal = (key_block[None, :] >= (query_block[:, None] * chi) // beta) & \
        (key_block[None, :] <= (torch.clamp(query_block[:, None] * chi + chi, max=n) - 1) // beta)
    sparse = keep[:, :, query_block][..., key_block] | diagonal  # [batch, heads, n, n]
    if full is not None:
        sparse = sparse & full
    o_sparse = softmax_out(scaled_scores(q, k, sparse), v)
    delta = o_gamma - o_sparse[:, :, sampled]
    window = torch.arange(n, device=q.device) // gamma
    return (o_sparse + delta[:, :, window]).to(q.dtype)


class Momo(Method):
    name = "momo"
    engines = ("block", "masked")

    def __init__(self, gamma: int = 16, chi: int = 128, beta: int = 64, k: int = 128, k_exact: int = 8,
                 k_trim: int | None = None, top_k: str = "exact", canvas: bool = False):
        super().__init__()
        for knob, value in (("gamma", gamma), ("chi", chi), ("beta", beta), ("k", k)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{knob} must be an integer >= 1, got {value!r}")
        if chi % gamma:
            raise ValueError(f"chi ({chi}) must be a multiple of gamma ({gamma})")
        if top_k not in ("exact", "estimated"):
            raise ValueError(f"top_k must be 'exact' or 'estimated', got {top_k!r}")
        if not 0 <= k_exact <= k:
            raise ValueError(f"k_exact must be in [0, k], got {k_exact!r}")
        self.knobs = dict(gamma=gamma, chi=chi, beta=beta, k_blocks=k, k_exact=k_exact, k_trim=k_trim, top_k=top_k)
        self.canvas = canvas

    def attention(self, q, k, v, mask):
        return momo_attention(q, k, v, mask, **self.knobs)

    def prefill(self, model, ctx):
        mask = CanvasMask(valid=ctx.valid, block_size=ctx.block_length)

        def attend_and_store(layer, q, k, v):
            ctx.cache.write(layer, k, v, ctx.counts)
            return self.attention(q, k, v, mask)

        model.hidden(ctx.tokens, ctx.positions, attend_and_store)
        ctx.cache.advance(ctx.counts)

    def attend(self, layer, q, k, v, ctx):
        if ctx.cache is None and self.canvas:
            return self.attention(q, k, v, ctx.attn_mask)
        return super().attend(layer, q, k, v, ctx)
