"""The feed-forward half of a layer: a SwiGLU MLP, or a mixture of experts.

A mixture of experts (LLaDA2, SDAR-MoE) sends each token through a few of many small SwiGLU MLPs:

    scores = softmax(x W_r^T) or sigmoid(x W_r^T)         per expert, in float32
    chosen = top-k of (scores + expert_bias), within the topk_group best of n_group groups
    w      = scores[chosen], / their sum if normalised, * routed_scaling_factor
    y      = sum_j w_j expert_{chosen_j}(x)  (+ shared_expert(x))

The bias and the group limit only choose; the weights are the unbiased scores. This is the reference:
one expert at a time, plain torch. nanodllm/fused_mlp.py runs the same sum as grouped matmuls.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig, MoEConfig


def fp32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is (tests run whole models in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Which experts each token goes to, and with what weight. (Named `gate` in the model, as in the
    checkpoints.)"""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if moe.expert_bias else None

    def forward(self, x: torch.Tensor):
        """x [n, hidden] -> (chosen experts [n, k] long, their weights [n, k] in float32 or wider)."""
        return choose_experts(self.logits(x), self.moe.experts_per_token, **self.rule())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe.score == "sigmoid":  # LLaDA2 computes the logits in float32
            return F.linear(fp32_or_wider(x), fp32_or_wider(self.weight))
        return fp32_or_wider(F.linear(x, self.weight))  # Qwen3-MoE: in the model's dtype, softmax in float32

    def rule(self) -> dict:
        """How choose_experts chooses for this model, as keywords."""
        moe = self.moe
        return dict(sigmoid=moe.score == "sigmoid", bias=self.expert_bias, groups=moe.groups, kept=moe.groups_kept,
                    normalize=moe.normalize, eps=1e-20, scale=moe.scale)


def choose_experts(logits: torch.Tensor, k: int, *, sigmoid: bool, bias: torch.Tensor | None = None, groups: int = 1,
                   kept: int = 1, normalize: bool = True, eps: float = 0.0, scale: float = 1.0,
                   expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, experts] -> (the k experts of best preference, best first; their weights): the scores
    (sigmoid or softmax), the preference (scores + bias, within the `kept` best of `groups` groups), the
    weights (the chosen scores, / (their sum + eps) if normalised, * scale, * expert_scale[chosen])."""
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    preference = scores if bias is None else scores + bias
    if groups > 1:
        preference = within_best_groups(preference, groups, kept)
    chosen = preference.topk(k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    weights = weights * scale
    return chosen, weights if expert_scale is None else weights * expert_scale[chosen]


def within_best_groups(preference: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """preference [n, experts] with every expert outside each row's `kept` best groups at -inf; a
    group's rank is the sum of its two best preferences."""
    n = preference.shape[0]
    by_group = preference.view(n, groups, -1)
    group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(kept, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return by_group.masked_fill(~allowed[..., None], float("-inf")).view(n, -1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, moe.expert_size) for _ in range(moe.num_experts))
        self.shared_expert = MLP(cfg.hidden_size, moe.shared_size) if moe.shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden]: each token's chosen experts' outputs, weighted and summed in float32 (in the
        order the router chose them, as LLaDA2 sums), cast back, plus the shared expert's."""
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.gate(flat)
        outputs = flat.new_zeros(*chosen.shape, flat.shape[-1])  # [n, k, hidden]
        for expert in chosen.unique().tolist():
            rows, slots = (chosen == expert).nonzero(as_tuple=True)
            outputs[rows, slots] = self.experts[expert](flat[rows])
        y = self.combine(outputs, weights, x.dtype)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.view_as(x)

    @staticmethod
    def combine(outputs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sum_j weights[:, j] outputs[:, j] in the weights' precision, cast to dtype."""
        return (outputs.to(weights.dtype) * weights[..., None]).sum(dim=1).to(dtype)
