"""The estimated online top-k of kernels/qsa_attention.py (MOMO eq. 6-7): its scan order and its torch form.

The estimate's choice depends on the order a row's key blocks arrive in, which the paper leaves open.
Eq. 6 reads the running mean and variance as those of the whole row, which holds only when the blocks
arrive in no particular order, so a row's T blocks are visited in golden-ratio strides: block (i g) mod
T at step i, g the first integer from round(T / 1.618) up that is prime to T. Every stretch of the
scan then spreads over the whole row; scanning in order, a causal row's heavy local blocks would come
all first (backwards) or all last (forwards) and skew the statistics. T is the number of blocks the
last of a group of ORDER_ROWS sampled rows sees (one kernel program's rows scan together, and
ORDER_ROWS is a multiple of every program's row count), so a row's order does not depend on the
launch; each row counts the blocks it has left as its last_blocks less the visible blocks it has seen
(a hidden block, all padding, counts as left until the scan ends).
"""

from __future__ import annotations

import functools
import math

import torch

GOLDEN = (1 + math.sqrt(5)) / 2
ORDER_ROWS = 64  # sampled rows that scan in one order: a multiple of the QSA kernel's BLOCK_M (16 or 64)


@functools.lru_cache(maxsize=16)
def golden_strides(blocks, device):
    """[blocks + 1] int32: for a scan of T key blocks, the stride g: the first integer from
    round(T / golden ratio) up that is prime to T, so (i g) mod T visits every block once (index 0:
    1, an empty scan)."""
    strides = [1]
    for total in range(1, blocks + 1):
        stride = max(1, round(total / GOLDEN))
        while math.gcd(stride, total) != 1:
            stride += 1
        strides.append(stride)
    return torch.tensor(strides, dtype=torch.int32, device=device)


def last_blocks(n, gamma, beta, causal=False, block_size=None, k_valid=None, batch=1, device="cpu", q_valid=None):
    """[batch, sampled rows] int32: 1 + the last key block each sampled row sees a key of (0: none,
    and for a row at a padded column, q_valid False). The estimate counts a row's blocks left to scan
    against it; each group of ORDER_ROWS rows scans up to its largest (group_maxima), so that a row's
    order does not depend on how many rows a program holds, nor on padded rows."""
    positions = torch.arange(0, n, gamma, device=device)
    limit = torch.full_like(positions, n - 1)
    if causal or block_size is not None:
        size = 1 if causal else block_size
        limit = torch.clamp((positions // size + 1) * size, max=n) - 1
    last = limit[None].expand(batch, -1)
    if k_valid is not None:
        upto = torch.where(k_valid, torch.arange(n, device=device), -1).cummax(dim=1).values  # last valid key <= i
        last = upto.gather(1, last)
    if q_valid is not None:
        last = torch.where(q_valid[:, ::gamma], last, -1)
    return torch.where(last >= 0, last // beta + 1, 0).to(torch.int32)


def group_maxima(per_row):
    """[..., rows] -> [..., ceil(rows / ORDER_ROWS)]: the maximum over each group of ORDER_ROWS rows."""
    pad = -per_row.shape[-1] % ORDER_ROWS
    padded = torch.nn.functional.pad(per_row, (0, pad))
    return padded.view(*per_row.shape[:-1], -1, ORDER_ROWS).amax(dim=-1)


def estimated_top_k(scores, k, k_exact):
    """The estimated online top-k (MOMO eq. 6-7 with an exact part), in torch, visiting each row's
    blocks in the kernel's order: scores [..., sampled rows, blocks] (-inf = not visible); a row's scan
    covers T blocks (its group's last_blocks), block (i g) mod T at step i (g = golden_strides[T]). Each
    visible block first updates Welford's running mean m and sample variance sigma^2 (M2 / (count - 1),
    0 after one block), then is offered to a k_exact-slot exact buffer (it replaces the buffer's lowest
    slot, the first of equals, when strictly higher); what the buffer rejects or displaces (an empty
    slot: nothing) takes one of the k - k_exact other slots when it beats the threshold:
    erf((s - m) / (sigma sqrt 2)) > 2p - 1 (s > m while sigma = 0), p = 1 - free slots / the row's
    blocks left (its last_blocks less the visible blocks seen before), taken outright when p <= 0.
    Returns [..., k] block indices (-1 = empty): the exact part, then the others in the order they
    were taken."""
    rows_shape, blocks = scores.shape[:-1], scores.shape[-1]
    device = scores.device
    flat = scores.reshape(-1, blocks).double()
    visible_any = scores > float("-inf")
    last = torch.where(visible_any.any(-1), blocks - visible_any.flip(-1).int().argmax(-1), 0)
    scan = group_maxima(last).repeat_interleave(ORDER_ROWS, dim=-1)[..., : last.shape[-1]].reshape(-1)
    stride = golden_strides(blocks, device).long()[scan]
    last = last.reshape(-1)
    rows = flat.shape[0]
    exact_scores = flat.new_full((rows, k_exact), float("-inf"))
    exact_index = torch.full((rows, k_exact), -1, dtype=torch.long, device=device)
    greedy = torch.full((rows, k - k_exact), -1, dtype=torch.long, device=device)
    filled = torch.zeros(rows, dtype=torch.long, device=device)
    count, mean, m2 = (torch.zeros(rows, dtype=torch.float64, device=device) for _ in range(3))
    all_rows = torch.arange(rows, device=device)
    for step in range(int(scan.max()) if rows else 0):
        scanning = step < scan
        block = torch.where(scanning, step * stride % scan.clamp(min=1), 0)
        score = torch.where(scanning, flat[all_rows, block], float("-inf"))
        visible = score > float("-inf")
        count += visible.double()
        delta = torch.where(visible, score - mean, 0.0)
        mean += torch.where(visible, delta / count.clamp(min=1), 0.0)
        m2 += torch.where(visible, delta * (score - mean), 0.0)
        out_score, out_index = torch.where(visible, score, float("-inf")), torch.where(visible, block, -1)
        if k_exact:
            slot = exact_scores.argmin(dim=1)
            lowest, lowest_index = exact_scores[all_rows, slot], exact_index[all_rows, slot]
            takes = visible & (score > lowest)
            out_score, out_index = torch.where(takes, lowest, out_score), torch.where(takes, lowest_index, out_index)
            exact_scores[all_rows, slot] = torch.where(takes, score, lowest)
            exact_index[all_rows, slot] = torch.where(takes, block, lowest_index)
        free = greedy.shape[1] - filled
        p = 1 - free.double() / (last - count + visible.double()).clamp(min=1)
        sigma = (m2 / (count - 1).clamp(min=1)).sqrt()
        z = (out_score - mean) / (sigma * math.sqrt(2)).clamp(min=1e-300)
        beats = torch.where(sigma > 0, torch.erf(z) > 2 * p - 1, out_score > mean)
        accept = (out_index >= 0) & (free > 0) & ((p <= 0) | beats)
        if greedy.shape[1]:
            target = filled.clamp(max=greedy.shape[1] - 1)
            greedy[all_rows, target] = torch.where(accept, out_index, greedy[all_rows, target])
        filled += accept.long()
    return torch.cat([exact_index, greedy], dim=1).view(*rows_shape, k)

