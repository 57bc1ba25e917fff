"""mlp.py's feed-forward halves built for the GPU kernels (fused.py builds the rest of the model).

A SwiGLU's gate and up rows are one Parameter, gate_up_proj; a mixture of experts' experts are two, stacked
[experts, ...]. Where use_kernels(x) holds, silu(gate) * up is one pass (kernels/silu_mul.py), a router's choice
one kernel (kernels/moe_route.py), and the experts' rows, grouped by expert (experts.py), run one grouped matmul per
projection (kernels/expert_linear.py up to a few dozen rows per expert, else torch's grouped_mm) before one
weighted sum (kernels/moe_combine.py). Elsewhere each runs the reference's own ops on slices of the stacked
weights. Split over ranks (parallel.py), a FusedMoE holds its rank's experts and sums over the ranks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanodllm.kernels.moe_route import moe_route
from nanodllm.kernels.silu_mul import silu_mul

from .attention import use_kernels
from .config import ModelConfig
from .experts import GROUPED_MM, grouped_experts
from .mlp import MoE, Router, choose_experts
from .parallel import SINGLE, Group, expert_range

CHUNK_TOKENS = 8192  # a long prefill's MLPs run on this many tokens at a time: their wide activations stay small


def gated(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate(x)) * up(x) over gate_up [2 * size, hidden]: gate's rows, then up's."""
    gate, up = gate_up.chunk(2)
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


class FusedMLP(nn.Module):
    """SwiGLU with gate's and up's rows back to back in gate_up_proj."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not use_kernels(x):
            return self.down_proj(gated(x, self.gate_up_proj.weight))
        return by_chunks(lambda rows: self.down_proj(silu_mul(self.gate_up_proj(rows))), x)


def by_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn, a row-wise map from [n, hidden] to [n, hidden], over x [..., hidden] CHUNK_TOKENS rows at a time."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= CHUNK_TOKENS:
        return fn(flat).view_as(x)
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[0], CHUNK_TOKENS):
        out[start : start + CHUNK_TOKENS] = fn(flat[start : start + CHUNK_TOKENS])
    return out.view_as(x)


class FusedExperts(nn.Module):
    """The held experts' SwiGLUs in two Parameters; experts[e](x): expert e alone (another rank's: zeros)."""

    def __init__(self, held: range, hidden: int, size: int):
        super().__init__()
        self.held, self.gate_up_proj = held, nn.Parameter(torch.empty(len(held), 2 * size, hidden))  # gate's, up's rows
        self.down_proj = nn.Parameter(torch.empty(len(held), hidden, size))

    def __getitem__(self, expert: int) -> Callable[[torch.Tensor], torch.Tensor]:
        e = expert - self.held.start
        run = lambda x: F.linear(gated(x, self.gate_up_proj[e]), self.down_proj[e])
        return run if expert in self.held else torch.zeros_like


class FusedRouter(Router):
    """The router, its choice in one kernel where torch runs a dozen small ones."""

    def forward(self, x: torch.Tensor):
        choose = moe_route if use_kernels(x) else choose_experts
        return choose(self.logits(x), self.moe.experts_per_token, **self.rule())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """LLaDA2's float32 logits as one matmul of the stored 16-bit weights into float32, where the
        reference casts x and the weight every step: the products of 16-bit floats are exact in float32, the
        tensor cores' sums a few float32 roundings coarser, far below a 16-bit one (tests/test_moe_route.py).
        torch's matmul takes out_dtype on CUDA only."""
        if self.moe.score != "sigmoid" or not use_kernels(x) or not x.is_cuda or x.dtype == torch.float32:
            return super().logits(x)
        return torch.mm(x.flatten(0, -2), self.weight.t(), out_dtype=torch.float32).unflatten(0, x.shape[:-1])


class FusedMoE(MoE):
    """MoE over this rank's experts and share of the shared expert (one process: all), summed over the ranks."""

    def __init__(self, cfg: ModelConfig, group: Group = SINGLE):
        nn.Module.__init__(self)  # its own experts, not MoE's
        moe, self.group = cfg.moe, group
        self.gate = FusedRouter(cfg.hidden_size, moe)
        self.experts = FusedExperts(expert_range(moe.num_experts, group), cfg.hidden_size, moe.expert_size)
        self.shared_expert = FusedMLP(cfg.hidden_size, moe.shared_size // group.world) if moe.shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = by_chunks(self.grouped, x) if use_kernels(x) and GROUPED_MM else super().forward(x)
        return self.group.all_reduce(y)

    def grouped(self, flat: torch.Tensor) -> torch.Tensor:
        """MoE.forward over tokens [n, hidden]: this rank's experts by grouped_experts, then the shared one."""
        chosen, routing = self.gate(flat)
        y = grouped_experts(flat, chosen, routing, self.experts, self.gate.moe.num_experts, "silu")
        return y if self.shared_expert is None else y + self.shared_expert(flat)
