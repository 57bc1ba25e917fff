"""A mixture of experts' experts on the GPU kernels, for LLaDA2's and SDAR-MoE's FusedMoE (fused_mlp.py) and
DiffusionGemma's experts (gemma.py): each token's k (token, slot) pairs grouped by expert, two grouped matmuls
(gate/up with the activation, then down), and each token's k outputs weighted and summed where they lie.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanodllm.kernels.expert_linear import beats_grouped_mm, expert_linear, group_by_expert, group_by_expert_reference
from nanodllm.kernels.moe_combine import moe_combine, moe_combine_reference
from nanodllm.kernels.silu_mul import silu_mul

from .attention import use_kernels

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (tanh approximation) over [..., 2 * size]: gate's columns, then up's."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: nn.Module,
                    num_experts: int, glu: str) -> torch.Tensor:
    """Each token's chosen experts' outputs times their weights, summed: x [n, hidden], chosen and weights
    [n, k]; experts holds gate_up_proj [held, 2 * size, hidden], down_proj [held, hidden, size] and `held`,
    the range of expert numbers this rank holds. The (token, slot) pairs are grouped by expert (the held
    experts first, numbered from the first held; the pairs of experts held elsewhere after the last group,
    summed as zeros) for two grouped matmuls: a step's few dozen rows per expert on kernels/expert_linear.py,
    which reads each expert's weights once and gathers the rows as they load, more on torch's grouped_mm;
    then each token's k outputs weighted and summed in fp32 where they lie (kernels/moe_combine.py).
    glu: "silu" or "gelu_tanh", the activation of act(gate) * up."""
    kernels, held, k = use_kernels(x), experts.held, chosen.shape[1]
    order, ends, slot_of = (group_by_expert if kernels else group_by_expert_reference)(chosen, num_experts, held)
    if kernels and beats_grouped_mm(len(order), num_experts):  # a mean over every rank's experts
        y = expert_linear(expert_linear(x, experts.gate_up_proj, ends, glu, order, k), experts.down_proj, ends)
    else:
        gate_up = GROUPED_MM(x[order // k], experts.gate_up_proj.mT, offs=ends)
        y = GROUPED_MM((silu_mul if glu == "silu" else gelu_tanh_mul)(gate_up), experts.down_proj.mT, offs=ends)
    past_groups = ends[-1:] if len(held) < num_experts else None
    return (moe_combine if kernels else moe_combine_reference)(y, slot_of, weights, past_groups)
