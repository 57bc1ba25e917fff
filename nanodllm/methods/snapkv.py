"""SnapKV-style baseline for MaskKV: the last prompt tokens vote, every head keeps the same budget.

Paper: Li et al. 2024, "SnapKV: LLM knows what you are looking for before generation", as MaskKV
(../shared/papers/001_11756cf7236fadd5.txt, Tables 2 and 13) runs it on diffusion LMs: inside the same
dLLM-Cache framework, only the token scores and the budgets differ. Here for what mask voting adds.

Idea. At step 0 (exact), per layer, the `window` last prompt tokens (the observation window) vote:
score[h, j] = sum over window queries of their softmax probability on prompt key j (softmax over the
whole canvas, as the step attends), averaged over each KV head's query group, then smoothed by an
average pool of width `pool` so neighbours of a hit are kept too. The window itself always stays
(its tokens rank first, the latest first). Every layer and head keeps `budget` prompt tokens; later
steps attend to them plus the response, as in maskkv.py.

Hooks: MaskKV's; token_scores and head_counts overridden.
Equals dllm_cache when the budget is at least the longest prompt.
Knobs (SnapKV defaults): budget = 256, window = 32, pool = 5 (1 = no pooling); prompt_interval,
response_interval, rho as dllm_cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import check_int
from .maskkv import MaskKV, attention_mass


class SnapKV(MaskKV):
    name = "snapkv"

    def __init__(self, budget: int = 256, window: int = 32, pool: int = 5, prompt_interval: int = 50,
                 response_interval: int = 5, rho: float = 0.25):
        super().__init__(budget=budget, prompt_interval=prompt_interval, response_interval=response_interval, rho=rho)
        check_int(1, window=window)
        check_int(1, odd=True, pool=pool)
        self.window, self.pool = window, pool

    def step(self, model, ctx):
        self.importance = [1.0] * model.cfg.num_layers  # uniform budgets: no profile needed
        return super().step(model, ctx)

    def token_scores(self, i, q_p, q_r, cache, ctx):
        prompt_width = cache.prompt_slots
        window = min(self.window, int(ctx.prompt_lengths.min()))
        voters = q_p[:, :, prompt_width - window :]
        every_voter = torch.ones(voters.shape[0], window, device=voters.device)
        scores = attention_mass(voters, cache.keys, cache.key_mask, every_voter, prompt_width)
        if self.pool > 1:
            batch, kv_heads, _ = scores.shape
            flat = scores.view(batch * kv_heads, 1, prompt_width)
            scores = F.avg_pool1d(flat, self.pool, stride=1, padding=self.pool // 2,
                                  count_include_pad=False).view(batch, kv_heads, -1)
        ranks = torch.arange(window, device=scores.device, dtype=scores.dtype)
        scores[:, :, prompt_width - window :] = window + 1.0 + ranks  # a vote total is at most `window`
        return scores

    def head_counts(self, i, scores, ctx):
        return torch.full(scores.shape[:2], self.budget, dtype=torch.long, device=scores.device)
