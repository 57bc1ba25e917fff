"""Each token's experts and their weights from its router logits: one program a token.

    scores     = sigmoid(logits) or softmax(logits)                                  float32
    preference = scores + bias; outside the `kept` best of `groups` groups, -inf     (a group ranks by the
                                                                                      sum of its two best)
    chosen     = the k best preferences, best first
    weights    = scores[chosen], / (their sum + eps) if normalised, * scale, * expert_scale[chosen]

In torch these are a dozen small kernels a layer (three top-k's and their sorts, gathers, elementwise
ops); here a program reads its token's logits once and picks by k rounds of max, the lowest expert id
winning a tie (torch's top-k orders ties as it likes). The exponentials and sums differ from torch's in
the last bits, so a choice can differ only where two preferences lie within a few float32 ulps. The
reference is the model's own torch form, nanodllm/mlp.py choose_experts (LLaDA2's, Qwen3-MoE's and
DiffusionGemma's routers), so that the rule is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def moe_route_kernel(logits_ptr, bias_ptr, expert_scale_ptr, chosen_ptr, weights_ptr, stride_logits, eps, scale,
                     GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, KEPT: tl.constexpr, K: tl.constexpr,
                     SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                     HAS_EXPERT_SCALE: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    members = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    # [BLOCK_G, BLOCK_S] expert ids, group after group as the router numbers them
    experts = groups[:, None] * GROUP_SIZE + members[None, :]
    real = (groups[:, None] < GROUPS) & (members[None, :] < GROUP_SIZE)
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=real, other=float("-inf"))
    if SIGMOID:
        scores = tl.math.div_rn(1.0, 1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(logits - tl.max(tl.max(logits, 1), 0))
        scores = tl.math.div_rn(shifted, tl.sum(tl.sum(shifted, 1), 0))
    preference = scores
    if HAS_BIAS:
        preference += tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)
    preference = tl.where(real, preference, float("-inf"))

    if GROUPS > 1:  # keep the KEPT groups whose two best preferences sum highest
        best = tl.max(preference, 1)  # [BLOCK_G]
        first = tl.min(tl.where(preference == best[:, None], members[None, :], BLOCK_S), 1)  # [BLOCK_G]
        second = tl.max(tl.where(members[None, :] == first[:, None], float("-inf"), preference), 1)
        group_score = tl.where(groups < GROUPS, best + second, float("-inf"))  # [BLOCK_G]
        kept = groups < 0  # [BLOCK_G], none yet
        for _ in tl.static_range(KEPT):
            left = tl.where(kept, float("-inf"), group_score)
            pick = tl.min(tl.where(left == tl.max(left, 0), groups, BLOCK_G), 0)
            kept = kept | (groups == pick)
        preference = tl.where(kept[:, None], preference, float("-inf"))

    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    for slot in tl.static_range(K):
        top = tl.max(tl.max(preference, 1), 0)
        expert = tl.min(tl.min(tl.where(preference == top, experts, BLOCK_G * BLOCK_S), 1), 0)
        score = tl.sum(tl.sum(tl.where(experts == expert, scores, 0.0), 1), 0)
        ids = tl.where(slots == slot, expert, ids)
        picked = tl.where(slots == slot, score, picked)
        preference = tl.where(experts == expert, float("-inf"), preference)
    if NORMALIZE:
        picked = tl.math.div_rn(picked, tl.sum(picked, 0) + eps)
    picked = picked * scale
    in_k = slots < K
    if HAS_EXPERT_SCALE:
        picked = picked * tl.load(expert_scale_ptr + ids, mask=in_k, other=0.0).to(tl.float32)
    tl.store(chosen_ptr + token * K + slots, ids, mask=in_k)
    tl.store(weights_ptr + token * K + slots, picked, mask=in_k)


def moe_route(logits: torch.Tensor, k: int, *, sigmoid: bool, bias: torch.Tensor | None = None, groups: int = 1,
              kept: int = 1, normalize: bool = True, eps: float = 0.0, scale: float = 1.0,
              expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] float32 -> (chosen experts [n, k] int64, best first; their weights [n, k] float32).
    bias, expert_scale: [E] of any float dtype, or None; E divisible into `groups` groups of at least two."""
    n, count = logits.shape if logits.dim() == 2 else (None, None)
    if n is None or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [n, experts] float32, rows contiguous; got {tuple(logits.shape)} "
                         f"{logits.dtype} with strides {logits.stride()}")
    for name, vector in (("bias", bias), ("expert_scale", expert_scale)):
        if vector is not None and (vector.shape != (count,) or not vector.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{count}], got {tuple(vector.shape)}")
    if groups < 1 or count % groups or (groups > 1 and count // groups < 2) or not 1 <= kept <= groups:
        raise ValueError(f"{count} experts do not split into {groups} groups of two or more with {kept} kept")
    if not 1 <= k <= kept * (count // groups):
        raise ValueError(f"k = {k} experts cannot be chosen from {kept} groups of {count // groups}")
    chosen = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    if n:
        size = count // groups
        moe_route_kernel[(n,)](
            logits, logits if bias is None else bias, logits if expert_scale is None else expert_scale, chosen,
            weights, logits.stride(0), eps, scale, GROUPS=groups, GROUP_SIZE=size, KEPT=kept, K=k, SIGMOID=sigmoid,
            HAS_BIAS=bias is not None, NORMALIZE=normalize, HAS_EXPERT_SCALE=expert_scale is not None,
            BLOCK_G=triton.next_power_of_2(groups), BLOCK_S=triton.next_power_of_2(size),
            BLOCK_K=triton.next_power_of_2(k), num_warps=1 if count <= 128 else 2)
    return chosen, weights
