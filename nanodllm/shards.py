"""Which part of each checkpoint tensor a rank of a split model (nanodllm/parallel.py) reads: the rows
of what projects into its heads, MLP width or vocabulary, the columns of what projects out of them, its
experts under their local numbers, and the rest whole. The loader reads just those parts (safetensors
get_slice), so no process ever holds a whole checkpoint it splits."""

from __future__ import annotations

import re
from typing import NamedTuple

from .config import ModelConfig
from .gemma import attention_shape
from .parallel import Group, expert_range, splits_gemma_heads


class Part(NamedTuple):
    """Where this rank keeps a whole tensor's part: in its parameter `name`; along dim `dim`, entries
    [start, start + length) of the whole (dim None: all of it)."""

    name: str
    dim: int | None = None
    start: int = 0
    length: int = 0

    def index(self, first: int, rows: int) -> tuple[slice, ...]:
        """This part of the whole tensor's rows [first, first + rows) of a tensor that stacks several
        (a fused checkpoint tensor), as a tensor or safetensors slice takes it."""
        if self.dim == 0:
            return (slice(first + self.start, first + self.start + self.length),)
        whole_rows = slice(first, first + rows)
        return (whole_rows,) if self.dim is None else (whole_rows, slice(self.start, self.start + self.length))


def split_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Internal parameter name ending -> (the dim split over the ranks, its whole length): the rows of
    what projects into heads, an MLP's width or the vocabulary, the columns of what projects out of them."""
    q, kv, width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shared = cfg.moe.shared_size if cfg.moe else 0
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "mlp.gate_proj": width, "mlp.up_proj": width,
            "shared_expert.gate_proj": shared, "shared_expert.up_proj": shared, "embed_tokens": cfg.vocab_size,
            "lm_head": cfg.vocab_size}
    columns = {"o_proj": q, "mlp.down_proj": width, "shared_expert.down_proj": shared}
    split = {f"{name}.{kind}": (0, length) for name, length in rows.items() for kind in ("weight", "bias")}
    return split | {f"{name}.weight": (1, length) for name, length in columns.items()}


GEMMA_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
GEMMA_ATTENTION = re.compile(r"layers\.(?P<layer>\d+)\.self_attn\.(?P<projection>[qkvo])_proj\.weight")
EXPERT = re.compile(r"(?P<layer>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)")


def gemma_part(name: str, cfg: ModelConfig, group: Group) -> Part:
    """local_part of DiffusionGemma: the rows of its experts stacked [experts, ...] that this rank holds; where
    its heads split, the rows of q/k/v_proj and the columns of o_proj of this rank's heads, at the layer's
    head_dim; the rest whole."""
    if name.endswith(GEMMA_EXPERTS):
        held = expert_range(cfg.moe.num_experts, group)
        return Part(name, 0, held.start, len(held))
    attention = GEMMA_ATTENTION.search(name)
    if attention is None or not splits_gemma_heads(cfg, group.world):
        return Part(name)
    projection = attention["projection"]
    head_dim, kv_heads = attention_shape(cfg, int(attention["layer"]))
    share = (cfg.num_heads if projection in "qo" else kv_heads) // group.world * head_dim
    return Part(name, 1 if projection == "o" else 0, group.rank * share, share)


def local_part(name: str, cfg: ModelConfig, group: Group) -> Part | None:
    """Which part of the whole model's parameter `name` (cfg: the whole config) this rank holds, and
    where; None for another rank's expert. Norms, the router and this rank's experts (under their
    local number) are held whole."""
    if group.world == 1:
        return Part(name)
    if cfg.gemma is not None:
        return gemma_part(name, cfg, group)
    expert = EXPERT.fullmatch(name)
    if expert:
        held = expert_range(cfg.moe.num_experts, group)
        number = int(expert["expert"])
        return Part(f"{expert['layer']}.{number - held.start}.{expert['rest']}") if number in held else None
    for ending, (dim, whole) in split_dims(cfg).items():
        if name.endswith(ending):
            length = whole // group.world
            return Part(name, dim, group.rank * length, length)
    return Part(name)
