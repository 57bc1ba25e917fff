"""MaskKV: mask-query voting evicts the prompt's KV to per-layer, per-head budgets (masked engine, on dLLM-Cache).

Paper: "Mask Tokens as Prophet: Fine-Grained Cache Eviction for Efficient dLLM Inference",
https://arxiv.org/abs/2510.09309 (section 3.3, Algorithms 1-3; its cached steps, Algorithms 4-7, are
dLLM-Cache's: methods/dllm_cache.py, which keeps the prompt K/V that prompt_kept chooses).
Idea: in a diffusion LM the [MASK] queries do the long-range retrieval, and what they attend to at
the first step stays stable. So step 0 runs exact and, per layer, the response's [MASK] queries vote:
I[h, j] = sum over mask queries of softmax(q k^T / sqrt(d)) on prompt key j, the softmax over the
whole canvas (eq. 6-7), averaged over each KV head's query group. Budgets:
    layers (Algorithm 2): B_l = floor(beta B) + an equal share of the pool (B - floor(beta B)) L split
        between the boundary and the middle layers by their summed importance S_l = 1 - mean cos(h_in,
        h_out) (eq. 8): from a profile (`python -m nanodllm.eval --model DIR --calibrate` writes
        DIR/maskkv_profile.json), else measured per row by one dense forward of its first canvas
        (the paper's online variant, Table 12);
    heads (Algorithm 3): k_h = floor(alpha B_l) + floor((B_l - floor(alpha B_l)) H_kv P_h), P_h head
        h's share of the prompt attention mass (prompt preference).
Each head keeps its top-k_h prompt tokens; later steps attend to them plus the response.
Hooks: dLLM-Cache's; step (the layer budgets, before step 0), prompt_kept (the voting and budgets).
Equals dllm_cache (same intervals and rho) on every row whose prompt is at most the budget long.
Heads split over ranks: step 0 all-gathers each layer's vote sums per KV head; drift tests as dllm_cache's.
Knobs (paper defaults): budget = 256 KV pairs per head on average (paper sweeps 16..512), alpha =
0.1, beta = 0.4, boundary_layers = layers at each end counted as boundary (default max(1, L // 8), an
assumption: the paper does not say where the groups split), profile = None (a JSON {"layer_importance":
[...]}); prompt_interval, response_interval, rho as dllm_cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..attention import CanvasMask, attention
from ..parallel import SINGLE, Group
from .common import attention_mass, check_int, keep_top
from .dllm_cache import DllmCache

PROFILE_NAME = "maskkv_profile.json"


def layer_budgets(budget: int, importance, beta: float, boundary_layers: int) -> list[int]:
    """Algorithm 2: a base of floor(beta * budget) per layer, the rest of budget * L shared out
    between the boundary and the middle group by summed importance, equally within a group."""
    num_layers = len(importance)
    boundary = set(range(boundary_layers)) | set(range(num_layers - boundary_layers, num_layers))
    middle = [l for l in range(num_layers) if l not in boundary]
    base = int(beta * budget)
    pool = (budget - base) * num_layers
    s_boundary = sum(importance[l] for l in boundary)
    s_middle = sum(importance[l] for l in middle)
    pool_boundary = int(pool * s_boundary / (s_boundary + s_middle)) if s_boundary + s_middle > 0 else pool
    if not middle:
        pool_boundary = pool
    share = {True: pool_boundary // len(boundary), False: (pool - pool_boundary) // max(len(middle), 1)}
    return [base + share[l in boundary] for l in range(num_layers)]


def head_budgets(mass, layer_budget, alpha: float, group: Group = SINGLE):
    """Algorithm 3: [batch, kv_heads] = floor(alpha B_l) + floor(pool * prompt preference); B_l one for
    every row or [batch], each row's. Heads split over ranks: every head's mass gathered, this rank's budgets."""
    per_head = group.all_gather(mass.sum(dim=-1), dim=1)  # [batch, every KV head]
    kv_heads = per_head.shape[1]
    preference = per_head / per_head.sum(dim=1, keepdim=True).clamp(min=1e-30)
    budget = torch.as_tensor(layer_budget, device=mass.device).reshape(-1, 1)
    base = (alpha * budget.double()).floor().long()
    return group.share(base + (preference * (budget - base) * kv_heads).floor().long(), dim=1)


@torch.no_grad()
def layer_importance(model, tokens, positions, valid, attn_mask=None) -> list[list[float]]:
    """Eq. 8 on one canvas, per row: for each layer, 1 - mean over the row's real tokens of cos(layer
    input, layer output). [rows][layers]."""
    x, rope = model.embed(tokens), model.rope(positions)
    importance = []  # per layer, [rows] on the device: one host sync at the end, not one per layer
    for layer in model.layers:
        out = layer(x, rope, lambda q, k, v: attention(q, k, v, attn_mask))
        cos = torch.nn.functional.cosine_similarity(x.float(), out.float(), dim=-1)
        importance.append(1 - (cos * valid).sum(dim=-1) / valid.sum(dim=-1))
        x = out
    return torch.stack(importance, dim=1).tolist()


class MaskKV(DllmCache):
    """Builds on dLLM-Cache: its cached steps, over the prompt K/V that mask voting keeps."""

    name = "maskkv"

    def __init__(self, budget: int = 256, alpha: float = 0.1, beta: float = 0.4, boundary_layers: int | None = None,
                 profile: str | None = None, prompt_interval: int = 50, response_interval: int = 5, rho: float = 0.25):
        super().__init__(prompt_interval, response_interval, rho)
        check_int(1, budget=budget)
        for knob, value in (("alpha", alpha), ("beta", beta)):
            if not 0 <= value <= 1:
                raise ValueError(f"{knob} must be in [0, 1], got {value!r}")
        check_int(1, **({} if boundary_layers is None else {"boundary_layers": boundary_layers}))
        self.budget, self.alpha, self.beta = budget, alpha, beta
        self.boundary_layers, self.profile = boundary_layers, profile
        self.importance: list[list[float]] | None = None  # [rows][layers], this generation's (eq. 8)
        self.budgets: torch.Tensor | None = None  # [layers, rows]: Algorithm 2 on each row's importance

    def step(self, model, ctx):
        if ctx.t == 0 and self.budget < ctx.prompt_width:  # else every row keeps its whole prompt
            self.importance = self.load_importance(model, ctx)
            num_layers = len(self.importance[0])
            boundary = min(self.boundary_layers or max(1, num_layers // 8), num_layers)
            per_row = [layer_budgets(self.budget, row, self.beta, boundary) for row in self.importance]
            self.budgets = torch.tensor(per_row, device=ctx.tokens.device).T
        return super().step(model, ctx)

    def load_importance(self, model, ctx) -> list[list[float]]:
        """Each row's layer importance: the profile's, or (no profile) measured on the row's tokens."""
        if not self.profile:
            mask = ctx.attn_mask if isinstance(ctx.attn_mask, CanvasMask) else None
            return layer_importance(model, ctx.tokens, ctx.positions, ctx.valid, mask)
        path = Path(self.profile)
        if not path.is_file():
            raise FileNotFoundError(f"MaskKV profile not found: {self.profile}")
        importance = json.loads(path.read_text())["layer_importance"]
        if len(importance) != model.cfg.num_layers:
            raise ValueError(f"{path}: {len(importance)} layer importances for a {model.cfg.num_layers}-layer model")
        return [importance] * ctx.tokens.shape[0]

    def prompt_kept(self, i, q_p, q_r, cache, ctx):
        """Mask voting (eq. 6-7), then each head's budget (Algorithms 2-3) and its best prompt tokens;
        a row whose prompt fits the budget keeps all of it."""
        if self.budget >= ctx.prompt_width:
            return None
        is_mask = ctx.tokens[:, cache.prompt_slots:] == ctx.mask_id
        votes = attention_mass(q_r, cache.keys, cache.key_mask, is_mask, cache.prompt_slots)
        budgets = head_budgets(votes, self.budgets[i], self.alpha, self.group)
        counts = torch.where(ctx.prompt_lengths[:, None] <= self.budget, ctx.prompt_lengths[:, None], budgets)
        return keep_top(votes, counts, ctx.prompt_lengths)
