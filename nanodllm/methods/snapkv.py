"""SnapKV-style baseline for MaskKV: the last prompt tokens vote, every head keeps the same budget.

Paper: Li et al. 2024, "SnapKV: LLM knows what you are looking for before generation",
https://arxiv.org/abs/2404.14469, as MaskKV (https://arxiv.org/abs/2510.09309, Tables 2 and 13) runs
it on diffusion LMs: inside dLLM-Cache (methods/dllm_cache.py keeps the prompt K/V that prompt_kept
chooses), as MaskKV runs; only the token scores and the budgets differ. Here for what mask voting adds.

Idea. At step 0 (exact), per layer, each row's last min(window, its prompt length) prompt tokens (the
observation window) vote: score[h, j] = sum over window queries of their softmax probability on
prompt key j (softmax over the whole canvas, as the step attends), averaged over each KV head's
query group, then smoothed by an average pool of width `pool` (over the row's own prompt tokens, never
its left padding) so neighbours of a hit are kept too. The window itself always stays (its tokens
rank first, the latest first). Every layer and head keeps `budget` prompt tokens; later steps attend
to them plus the response, as MaskKV's do.

Hooks: dLLM-Cache's; prompt_kept (the window's votes, one budget for every head).
Equals dllm_cache on every row whose prompt is at most the budget long. Heads split over ranks: each
head chooses alone; only dLLM-Cache's drift test communicates.
Knobs (SnapKV defaults): budget = 256, window = 32, pool = 5 (1 = no pooling); prompt_interval,
response_interval, rho as dllm_cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import attention_mass, check_int, keep_top
from .dllm_cache import DllmCache


class SnapKV(DllmCache):
    """Builds on dLLM-Cache, as MaskKV's paper runs it: its cached steps, over what SnapKV keeps."""

    name = "snapkv"

    def __init__(self, budget: int = 256, window: int = 32, pool: int = 5, prompt_interval: int = 50,
                 response_interval: int = 5, rho: float = 0.25):
        super().__init__(prompt_interval, response_interval, rho)
        check_int(1, budget=budget, window=window)
        check_int(1, odd=True, pool=pool)
        self.budget, self.window, self.pool = budget, window, pool

    def prompt_kept(self, i, q_p, q_r, cache, ctx):
        """Every head keeps the `budget` best prompt tokens by token_scores."""
        if self.budget >= ctx.prompt_width:
            return None
        scores = self.token_scores(q_p, cache, ctx)
        return keep_top(scores, torch.full(scores.shape[:2], self.budget, device=scores.device), ctx.prompt_lengths)

    def token_scores(self, q_p, cache, ctx):
        """[batch, kv_heads, P]: the votes of each row's own window, pooled over its real prompt
        columns; the window's tokens rank above every vote, the latest first."""
        prompt_width = cache.prompt_slots
        columns = torch.arange(prompt_width, device=q_p.device)
        window_starts = prompt_width - ctx.prompt_lengths.clamp(max=self.window)
        rank = columns - window_starts[:, None]  # [batch, P]: place in the row's window, < 0 before it
        widest = min(self.window, prompt_width)
        voters = q_p[:, :, prompt_width - widest :]
        scores = attention_mass(voters, cache.keys, cache.key_mask, rank[:, -widest:] >= 0, prompt_width)
        if self.pool > 1:
            real = columns >= (prompt_width - ctx.prompt_lengths)[:, None]
            scores = pool_real(scores, real[:, None, :], self.pool)
        window_scores = self.window + 1.0 + rank.to(scores.dtype)  # a vote total is at most the window
        return torch.where(rank[:, None, :] >= 0, window_scores[:, None, :], scores)


def pool_real(scores, real, pool: int):
    """Average pool of width `pool` (stride 1, centred) over the last dim of scores [batch, heads, P],
    each average taken over the real columns in reach only (real [batch, 1, P]: False at left padding),
    so a row's pooled scores are those it would get alone."""
    half = pool // 2
    reach_sum = lambda x: F.pad(x, (half, half)).unfold(-1, pool, 1).sum(dim=-1)
    sums = reach_sum(scores.masked_fill(~real, 0.0))
    counts = reach_sum(real.to(scores.dtype))
    return sums / counts.clamp(min=1)
