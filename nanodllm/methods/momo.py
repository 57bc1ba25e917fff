"""MOMO (Measure Once, Mask Once): delta-corrected block-sparse attention for long prefills.

Paper: "Measure Once, Mask Once: Delta Refined Block Sparse Attention" (anonymous submission;
Algorithms 1-2, eq. 2-7, appendix A).
Idea: every gamma-th query attends densely (query-sparse attention, QSA); while it scans the keys it
also scores every key block j of beta keys, S(j) = logsumexp of its scaled scores over the block (eq.
4), and keeps the top-k blocks. Per query block of chi rows the chi / gamma sampled rows' blocks are
united and trimmed to the k_trim blocks of highest mean score (Algorithm 2), the diagonal blocks
always added. Every query then attends to its query block's kept key blocks (block-sparse attention,
O_*), and the sparsity's error is corrected with the sampled rows' exact outputs:
O_i = O_*[i] + O_gamma[i // gamma] - O_*[(i // gamma) * gamma] (eq. 2-3).
Trim "mass" (not in the paper) ranks the union by each block's share of the choosing rows' attention,
exp(S(j) - the row's logsumexp), summed (Algorithm 2's mean of raw scores lets a row with larger
logits outvote the others: docs/results/momo_mass.md). Top-k "exact" (an online k-slot buffer) and
"tree" (a tournament tree) are exact (ties to the lower block); "estimated" takes the k_exact best
exactly, the rest by a Gaussian threshold from Welford statistics (eq. 6-7, kernels/qsa_estimate.py).
On the kernels qsa_attention (step 1, top-k fused) and block_sparse_attention (step 3) run, union and
trim in torch; elsewhere all in torch, densely. Ragged rows: each row's grid starts at its first real
token (row_alignment) and padded rows choose no blocks, so a row's result does not depend on its batch.
Hooks: attend (the block engine's prefill; DiffusionGemma's prompt pass on its full layers, scale 1;
canvas=True: every masked-engine step), step_kind.
Equals dense: k covering every key block (delta = 0 then; tested for each top-k variant and trim).
Heads split over ranks: each head chooses its own key blocks; nothing is communicated.
Knobs (paper defaults): gamma = 16, chi = 128, beta = 64, k = 128, k_exact = min(8, k), k_trim = k,
top_k = "exact" | "tree" | "estimated", trim = "mean" (Algorithm 2) | "mass", canvas = False.
"""

from __future__ import annotations

import math

import torch

from nanodllm.kernels.block_sparse_attention import block_sparse_attention, launch_tiles, takes
from nanodllm.kernels.qsa_attention import qsa_attention
from nanodllm.kernels.qsa_estimate import estimated_top_k

from ..attention import CanvasMask, attention_on_kernels, use_kernels
from .base import Method
from .common import check_int


def dense_mask(mask, n, device):
    """The [batch, 1, n, n] bool mask (or None) of a CanvasMask, a bool tensor or None. Padded keys
    are hidden from every query, padded ones included (as the kernels do)."""
    if not isinstance(mask, CanvasMask):
        return mask
    dense = mask.dense(n, n, device)
    if mask.valid is not None:
        dense = dense & mask.valid[:, None, None, -n:]
    return dense


def scaled_scores(q, k, mask, scale=None):
    """[batch, heads, q_len, n] scores in fp32 or wider (GQA), times scale (None: head_dim^-1/2), -inf
    where mask [batch, 1 or heads, q_len, n] is False."""
    group = q.shape[1] // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    keys = k.to(compute).repeat_interleave(group, dim=1)
    scores = q.to(compute) @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
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


def lower_first(scores, blocks):
    """scores (float64) nudged so that of two equal scores the one of the lower block ranks higher;
    -inf stays -inf (a bare nudge would make 0 * inf = NaN at block 0, which topk ranks first)."""
    scores = scores.double()
    return torch.where(scores > float("-inf"), scores - blocks * 1e-12 * (scores.abs() + 1), scores)


def exact_top_k(scores, k):
    """The k best blocks per row (ties to the lower index), -1 where a row has fewer visible blocks."""
    k = min(k, scores.shape[-1])
    columns = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.float64)
    values, indices = lower_first(scores, columns).topk(k, dim=-1)
    return torch.where(values > float("-inf"), indices, -1)


def trim_values(chosen, chosen_scores, lse, trim):
    """(what the trim ranks each chosen block by, whether it sums them over the choosing rows): "mean"
    (Algorithm 2) the eq. 4 scores, averaged; "mass" the block's share of its row's attention,
    exp(S(j) - lse) with lse [batch, heads, rows] the sampled rows' logsumexp, summed."""
    if trim == "mean":
        return chosen_scores, False
    share = (chosen_scores.double() - lse.double()[..., None]).exp()
    return torch.where(chosen >= 0, share, 0.0), True


def union_and_trim(chosen, chosen_scores, blocks, rows_per_block, k_trim, summed=False):
    """Algorithm 2: per query block, the union of its sampled rows' chosen key blocks, ranked by
    their mean score over the rows that chose them (with summed, by the sum); the k_trim best. chosen
    [batch, heads, rows, k] (-1 = none) with their scores; returns keep [batch, heads, query blocks,
    blocks] bool."""
    entries, values = per_query_block(chosen, chosen_scores, rows_per_block)
    slots = torch.where(entries >= 0, entries, blocks)  # a sentinel column for the empty slots
    total = values.new_zeros(*entries.shape[:3], blocks + 1)
    total.scatter_add_(3, slots, torch.where(entries >= 0, values, 0.0))
    times = total.new_zeros(total.shape).scatter_add_(3, slots, (entries >= 0).double())
    best = exact_top_k(union_rank(total, times, summed)[..., :blocks], k_trim)
    keep = torch.zeros_like(times, dtype=torch.bool)  # the sentinel column takes the empty picks
    return keep.scatter_(-1, torch.where(best >= 0, best, blocks), True)[..., :blocks]


def per_query_block(chosen, chosen_scores, rows_per_block):
    """(entries, values) [batch, heads, query blocks, rows_per_block x k]: each query block's sampled
    rows' chosen blocks (int64, -1 = none, also for the rows past the last) and their values (float64)."""
    batch, heads, rows, k = chosen.shape
    pad = -rows % rows_per_block
    entries = torch.nn.functional.pad(chosen, (0, 0, 0, pad), value=-1).view(batch, heads, -1, rows_per_block * k)
    return entries.long(), torch.nn.functional.pad(chosen_scores.double(), (0, 0, 0, pad)).view(entries.shape)


def union_rank(total, times, summed):
    """The trim's ranking of a union's blocks from their summed values and how many rows chose each:
    the sum (summed) or the mean over those rows; -inf for a block no row chose."""
    return torch.where(times > 0, total if summed else total / times.clamp(min=1), float("-inf"))


def kept_blocks(chosen, chosen_scores, n, gamma, chi, beta, k_trim, summed=False):
    """Step 2: keep [batch, heads, query blocks, key blocks] bool, the sampled rows' chosen key
    blocks united and trimmed per query block (Algorithm 2, union_and_trim) plus the diagonal blocks."""
    keep = union_and_trim(chosen, chosen_scores, math.ceil(n / beta), chi // gamma, k_trim, summed)
    return keep | diagonal_blocks(n, chi, beta, chosen.device)


def diagonal_range(n, chi, beta, device):
    """(first, last) [query blocks]: the key blocks overlapping each query block's own rows."""
    starts = torch.arange(0, n, chi, device=device)
    return starts // beta, (torch.clamp(starts + chi, max=n) - 1) // beta


def diagonal_blocks(n, chi, beta, device):
    """[query blocks, key blocks] bool: the key blocks overlapping each query block's own rows."""
    first, last = diagonal_range(n, chi, beta, device)
    key_block = torch.arange(math.ceil(n / beta), device=device)
    return (key_block[None, :] >= first[:, None]) & (key_block[None, :] <= last[:, None])


def kept_lists(chosen, chosen_scores, n, gamma, chi, beta, k_trim, summed=False):
    """block_lists(kept_blocks(...)): [batch, heads, query blocks, L] int32 (-1 padded), L = the
    longest. Where the key blocks outnumber a query block's chi / gamma x k candidates (long prompts),
    only the candidates are sorted, grouped by block (mean score per group), trimmed to the k_trim
    best (ties to the lower block, as exact_top_k) and merged with the diagonal blocks: no [.., key
    blocks] array (the faster way from about 128K keys: docs/results/bench_momo.md)."""
    blocks, rows_per_block = math.ceil(n / beta), chi // gamma
    if rows_per_block * chosen.shape[-1] >= blocks:
        return block_lists(kept_blocks(chosen, chosen_scores, n, gamma, chi, beta, k_trim, summed))
    entries, values = per_query_block(chosen, chosen_scores, rows_per_block)
    entries, order = torch.where(entries >= 0, entries, blocks).sort(dim=-1)  # empty slots (block `blocks`) last
    values = values.gather(-1, order)
    new_block = torch.ones_like(entries, dtype=torch.bool)
    new_block[..., 1:] = entries[..., 1:] != entries[..., :-1]
    group = new_block.cumsum(dim=-1) - 1  # each candidate's group: one per distinct block, in block order
    total = torch.zeros_like(values).scatter_add_(-1, group, values)
    times = torch.zeros_like(values).scatter_add_(-1, group, torch.ones_like(values))
    group_block = torch.full_like(entries, blocks).scatter_(-1, group, entries)
    rank = union_rank(total, times, summed).masked_fill(group_block >= blocks, float("-inf"))
    best, slots = lower_first(rank, group_block).topk(min(k_trim, rank.shape[-1]), dim=-1)
    trimmed = torch.where(best > float("-inf"), group_block.gather(-1, slots), blocks)
    first, last = diagonal_range(n, chi, beta, chosen.device)
    diagonal = first[:, None] + torch.arange(chi // beta + 2, device=chosen.device)  # enough for any alignment
    diagonal = torch.where(diagonal <= last[:, None], diagonal, blocks).expand(*entries.shape[:2], -1, -1)
    merged = torch.cat([trimmed, diagonal], dim=-1).sort(dim=-1).values
    merged[..., 1:] = torch.where(merged[..., 1:] == merged[..., :-1], blocks, merged[..., 1:])  # duplicates out
    merged = merged.sort(dim=-1).values
    longest = max(int((merged < blocks).sum(dim=-1).max()), 1)
    return torch.where(merged < blocks, merged, -1)[..., :longest].to(torch.int32)


def block_lists(keep):
    """[..., blocks] bool -> [..., L] int32 key-block lists (-1 padded), L = the longest."""
    blocks = keep.shape[-1]
    longest = max(int(keep.sum(dim=-1).max()), 1)
    listed = torch.where(keep, torch.arange(blocks, device=keep.device), blocks).sort(dim=-1).values[..., :longest]
    return torch.where(listed < blocks, listed, -1).to(torch.int32)


def momo_attention(q, k, v, mask=None, gamma=16, chi=128, beta=64, k_blocks=128, k_exact=8, k_trim=None,
                   top_k="exact", trim="mean", alignment=None, scale=None):
    """Algorithm 1: q [batch, heads, n, d], k/v [batch, kv_heads, n, d], mask a CanvasMask, a bool
    [batch, 1, n, n] or None (bidirectional). Returns [batch, heads, n, d] in q's dtype. On the
    Triton kernels (kernels/qsa_attention.py, block_sparse_attention.py) when use_kernels(q) and the
    mask is structured; else in torch, forming the scores densely. alignment: row_alignment(mask, n),
    where the caller computed it once for all layers; scale: the scores' (None: head_dim^-1/2)."""
    if chi % gamma:
        raise ValueError(f"chi ({chi}) must be a multiple of gamma ({gamma})")
    n, k_trim = q.shape[2], k_trim or k_blocks
    mask, index, back = alignment or row_alignment(mask, n)
    q, k, v = (rolled(x, index) for x in (q, k, v))
    structured = mask is None or (isinstance(mask, CanvasMask) and mask.positions is None)
    if structured and kernels_take(q, chi, beta):
        out = momo_on_kernels(q, k, v, mask, gamma, chi, beta, k_blocks, k_exact if top_k == "estimated" else k_blocks,
                              k_trim, top_k == "tree", trim, scale)
    else:
        full = dense_mask(mask, n, q.device)
        real = mask.valid[:, -n:] if isinstance(mask, CanvasMask) and mask.valid is not None else None
        o_gamma, keep = measure_and_mask(q, k, v, full, gamma, chi, beta, k_blocks, k_exact, k_trim, top_k, trim, real,
                                         scale)
        o_sparse = softmax_out(scaled_scores(q, k, expand_blocks(keep, n, chi, beta, full), scale), v)
        out = delta_corrected(o_sparse, o_gamma, gamma).to(q.dtype)
    return rolled(out, back)


def kernels_take(q, chi, beta) -> bool:
    """Whether MOMO's kernels run q: where the attention kernels run, at a head_dim, key block and
    query block they take (heads wider than 128, as DiffusionGemma's, included)."""
    wide = q.shape[-1] > 128 and use_kernels(q)
    return ((attention_on_kernels(q) or wide) and takes(q.shape[-1], beta)
            and chi % launch_tiles(q, beta)["BLOCK_M"] == 0)


def row_alignment(mask, n):
    """(mask, index, back): each row's n columns rolled left past its leading padding (row b's column
    c is column index[b, c]; back[b, c] undoes it), so that the grid starts at its first real token,
    as when the row runs alone, and the mask of the rolled rows (index and back None: no row is
    left-padded). A block-causal mask keeps its blocks: its positions (CanvasMask.positions, else the
    columns) roll along, dropped where they then equal the columns (a left-padded canvas's positions
    count from its first real token)."""
    if not isinstance(mask, CanvasMask) or mask.valid is None:
        return mask, None, None
    shift = mask.valid[:, -n:].int().argmax(dim=1, keepdim=True)  # the first real column (0: none)
    if not bool(shift.any()):
        return mask, None, None
    columns = torch.arange(n, device=shift.device).expand(shift.shape[0], -1)
    index = (columns + shift) % n
    valid, positions = mask.valid[:, -n:].gather(1, index), None
    if mask.block_size not in (None, 1):  # causal (blocks of 1) holds among the rolled columns as it was
        positions = (columns if mask.positions is None else mask.positions[:, -n:]).gather(1, index)
        positions = None if bool(((positions == columns) | ~valid).all()) else positions
    return CanvasMask(valid, mask.block_size, positions), index, (columns - shift) % n


def rolled(x, index):
    """x [batch, heads, n, d] with row b's column c read from column index[b, c] (None: x itself)."""
    return x if index is None else x.gather(2, index[:, None, :, None].expand(*x.shape[:2], -1, x.shape[3]))


def measure_and_mask(q, k, v, full, gamma, chi, beta, k_blocks, k_exact, k_trim, top_k, trim="mean", real=None,
                     scale=None):
    """Steps 1-2 in torch: (O_gamma [batch, heads, sampled rows, d], keep [batch, heads, query
    blocks, key blocks] bool, the trimmed union with the diagonal blocks). full: dense_mask's; real
    [batch, n] bool (or None): the padded sampled rows (False) choose no blocks."""
    n = q.shape[2]
    sampled = torch.arange(0, n, gamma, device=q.device)
    sampled_scores = scaled_scores(q[:, :, sampled], k, None if full is None else full[:, :, sampled], scale)
    o_gamma = softmax_out(sampled_scores, v)
    scores = block_scores(sampled_scores, beta)
    if real is not None:
        scores = scores.masked_fill(~real[:, None, sampled, None], float("-inf"))
    chosen = estimated_top_k(scores, k_blocks, k_exact) if top_k == "estimated" else exact_top_k(scores, k_blocks)
    chosen_scores = torch.where(chosen >= 0, scores.gather(-1, chosen.clamp(min=0)), float("-inf"))
    values, summed = trim_values(chosen, chosen_scores, sampled_scores.logsumexp(dim=-1), trim)
    return o_gamma, kept_blocks(chosen, values, n, gamma, chi, beta, k_trim, summed)


def expand_blocks(keep, n, chi, beta, full=None):
    """[batch, heads, query blocks, key blocks] -> the [batch, heads, n, n] token mask (and full's)."""
    positions = torch.arange(n, device=keep.device)
    sparse = keep[:, :, positions // chi][..., positions // beta]
    return sparse if full is None else sparse & full


def delta_corrected(o_sparse, o_gamma, gamma):
    """eq. 3: O_*[i] + O_gamma[i // gamma] - O_*[(i // gamma) gamma]."""
    n = o_sparse.shape[2]
    delta = o_gamma.to(o_sparse.dtype) - o_sparse[:, :, ::gamma]
    return o_sparse + delta[:, :, torch.arange(n, device=o_sparse.device) // gamma]


def measure_on_kernels(q, k, v, gamma, beta, k_blocks, k_exact, tree, trim, **masking):
    """Step 1 on kernels/qsa_attention.py: (O_gamma, each sampled row's chosen key blocks, what the
    trim ranks them by, whether it sums them: trim_values). masking: qsa_attention's mask arguments."""
    o_gamma, lse, chosen, chosen_scores = qsa_attention(q, k, v, gamma=gamma, beta=beta, top_k=k_blocks,
                                                        k_exact=k_exact, tree=tree, **masking)
    return (o_gamma, chosen, *trim_values(chosen, chosen_scores, lse, trim))


def momo_on_kernels(q, k, v, mask, gamma, chi, beta, k_blocks, k_exact, k_trim, tree, trim="mean", scale=None):
    """The same pipeline without an [n, n] tensor: QSA kernel -> union and trim -> block-sparse kernel."""
    masking = {"scale": scale}
    if mask is not None:
        masking.update(block_size=mask.block_size, k_valid=None if mask.valid is None else mask.valid[:, -q.shape[2]:])
    o_gamma, chosen, values, summed = measure_on_kernels(q, k, v, gamma, beta, k_blocks, k_exact, tree, trim,
                                                         q_valid=masking.get("k_valid"), **masking)
    lists = kept_lists(chosen, values, q.shape[2], gamma, chi, beta, k_trim, summed)
    o_sparse, _ = block_sparse_attention(q, k, v, lists, chi=chi, beta=beta, **masking)
    return delta_corrected(o_sparse.float(), o_gamma.float(), gamma).to(q.dtype)


class Momo(Method):
    name = "momo"
    engines = ("block", "masked", "gemma")
    sparse_prefill = True

    def __init__(self, gamma: int = 16, chi: int = 128, beta: int = 64, k: int = 128, k_exact: int | None = None,
                 k_trim: int | None = None, top_k: str = "exact", trim: str = "mean", canvas: bool = False):
        check_int(1, gamma=gamma, chi=chi, beta=beta, k=k, **({} if k_trim is None else {"k_trim": k_trim}))
        k_exact = min(8, k) if k_exact is None else k_exact
        if chi % gamma:
            raise ValueError(f"chi ({chi}) must be a multiple of gamma ({gamma})")
        if top_k not in ("exact", "tree", "estimated"):
            raise ValueError(f"top_k must be 'exact', 'tree' or 'estimated', got {top_k!r}")
        if not 0 <= k_exact <= k:
            raise ValueError(f"k_exact must be in [0, k], got {k_exact!r}")
        if trim not in ("mean", "mass"):
            raise ValueError(f"trim must be 'mean' or 'mass', got {trim!r}")
        self.knobs = dict(gamma=gamma, chi=chi, beta=beta, k_blocks=k, k_exact=k_exact, k_trim=k_trim, top_k=top_k,
                          trim=trim)
        self.canvas = canvas
        self.aligned = (None, None)  # (a mask, its row_alignment): the same for every layer of a forward

    def attend(self, layer, q, k, v, ctx):
        if ctx.phase == "prefill" or (ctx.cache is None and self.canvas):
            if self.aligned[0] is not ctx.attn_mask:
                self.aligned = (ctx.attn_mask, row_alignment(ctx.attn_mask, q.shape[2]))
            return momo_attention(q, k, v, ctx.attn_mask, alignment=self.aligned[1], **self.knobs,
                                  scale=None if ctx.cache is None else ctx.cache.scale)
        return super().attend(layer, q, k, v, ctx)

    def step_kind(self, ctx):
        """Block-engine steps are dense decode steps, each of one kind; canvas steps run eagerly."""
        return () if ctx.cache is not None else None
