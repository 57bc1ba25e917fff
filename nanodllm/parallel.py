"""Tensor and expert parallelism over torch.distributed: each rank holds a share of every layer.

With N ranks (torchrun: one process per GPU on NCCL, or CPU processes on gloo), rank r holds
    attention   query heads [r H/N, (r+1) H/N) and KV heads [r K/N, (r+1) K/N): whole GQA groups, and
                its own KV cache; q/k/v are its rows (column-parallel: plain nn.Linear), o_proj its
                columns, so out = sum over ranks of o_r W_o[:, r]                     one all-reduce
    dense MLP   gate/up rows, down_proj columns: down(silu(gate x) * up x) summed        one all-reduce
    MoE         the whole router, experts [r E/N, (r+1) E/N) for the tokens routed to them, the shared
                expert split as a dense MLP; routed and shared parts summed together     one all-reduce
    embedding   vocabulary rows [r V/N, (r+1) V/N); other ids give 0; summed             one all-reduce
    LM head     the same rows' logits; greedy picks from each rank's best and log-sum-exp      one all-gather
    DiffusionGemma: its experts, and its heads where the KV heads of both kinds of layer divide; the rest whole
Norms and the router are replicated. Every rank holds the same hidden states and decisions, so all decode the
same tokens (sampling at T > 0 gathers whole logit rows; one seed on every rank). The loader builds a rank's
modules (local_config), swaps in the ones below (shard) and reads each tensor's part (nanodllm/shards.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .gemma import GemmaExperts
from .mlp import MLP, MoE, Router


@dataclass(frozen=True)
class Group:
    """This process's place in the split: rank of world, over a torch.distributed group (None: the default)."""

    rank: int = 0
    world: int = 1
    process_group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (one rank: x as it is)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x of n along dim on each rank -> world * n along dim, the ranks' parts in rank order (one rank: x)."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)

    def share(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's part of x (whole and the same on every rank) along dim: all_gather undone, no collective."""
        return x if self.world == 1 else x.chunk(self.world, dim=dim)[self.rank]


SINGLE = Group()


def from_torchrun(backend: str | None = None) -> Group:
    """This process's Group, the default process group set up from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): by default NCCL on GPU LOCAL_RANK where there is one, else gloo."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start one process per rank with torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        importlib.import_module("torch._dynamo")  # before the group: see close
        dist.init_process_group(backend, rank=rank, world_size=world)
        atexit.register(close)
    return Group(rank, world)


def close():
    """End the default process group and its worker threads (at exit). torch modules imported after
    init_process_group take the group as a default argument and keep it alive past destroy_process_group
    (torch._dynamo imports them on first use, e.g. nn.init on the meta device); a gloo thread still
    releasing a tensor as Python shuts down then aborts the process. So from_torchrun imports them first."""
    if dist.is_initialized():
        dist.destroy_process_group()


def split_numbers(cfg: ModelConfig) -> dict[str, int]:
    """What a split divides among the ranks, by name: heads, KV heads, vocabulary, the dense MLPs'
    width (where a layer has one), experts and the shared expert's width; of DiffusionGemma, its experts (its
    heads split where they can: splits_gemma_heads)."""
    if cfg.gemma is not None:
        return {"moe.num_experts": cfg.moe.num_experts}
    numbers = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size}
    if cfg.moe is None or cfg.moe.dense_layers:
        numbers["intermediate_size"] = cfg.intermediate_size
    if cfg.moe is not None:
        numbers["moe.num_experts"] = cfg.moe.num_experts
        if cfg.moe.shared_size:
            numbers["moe.shared_size"] = cfg.moe.shared_size
    return numbers


def check_split(cfg: ModelConfig, world: int):
    """A one-line ValueError where `world` ranks cannot split cfg's model."""
    if world > 1 and cfg.qk_norm == "projection":
        raise ValueError("this model's q/k norm spans the whole projection (OLMo's attention_layer_norm), "
                         "across heads; tensor parallelism splits heads and does not split it")
    for name, number in split_numbers(cfg).items():
        if number % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs {name} divisible by {world}; "
                             f"this model has {name}={number}")


def splits_gemma_heads(cfg: ModelConfig, world: int) -> bool:
    """Whether DiffusionGemma's heads split over `world` ranks: its query heads and the KV heads of both its
    sliding and its full layers divide among them, so that each rank holds whole GQA groups (MAGE, Quest and
    SparseD choose a full layer's keys per KV head from all of its group's queries)."""
    return all(number % world == 0 for number in (cfg.num_heads, cfg.num_kv_heads, cfg.gemma.global_kv_heads))


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's share: its heads, KV heads, dense MLP width and vocabulary (cfg.moe as
    it is: the router stays whole; ExpertParallelMoE takes the rank's experts)."""
    if world == 1:
        return cfg
    check_split(cfg, world)
    shares = {name: number // world for name, number in split_numbers(cfg).items() if "." not in name}
    if cfg.gemma is not None and splits_gemma_heads(cfg, world):
        shares.update(num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                      gemma=dataclasses.replace(cfg.gemma, global_kv_heads=cfg.gemma.global_kv_heads // world))
    return dataclasses.replace(cfg, **shares)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows of the embedding; an id outside them gives zeros; summed over the ranks."""

    def __init__(self, vocab_size: int, hidden: int, group: Group):
        super().__init__(vocab_size // group.world, hidden)
        self.group, self.first = group, group.rank * (vocab_size // group.world)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = super().forward(torch.where(inside, local, 0))
        return self.group.all_reduce(rows.masked_fill_(~inside[..., None], 0.0))


class RowParallelLinear(nn.Linear):
    """x W^T over this rank's input columns of W (its heads, its MLP width), summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, group: Group):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def expert_range(num_experts: int, group: Group) -> range:
    """The experts this rank holds, by their number in the whole model."""
    count = num_experts // group.world
    return range(group.rank * count, (group.rank + 1) * count)


class ExpertShare(nn.ModuleList):
    """This rank's experts, indexed as MoE.forward indexes them, by their number in the whole model:
    experts[e] is expert e's MLP where this rank holds it, else a function giving zeros."""

    def __init__(self, experts, held: range):
        super().__init__(experts)
        self.held = held

    def __getitem__(self, expert: int):
        return super().__getitem__(expert - self.held.start) if expert in self.held else torch.zeros_like


class ExpertParallelMoE(MoE):
    """MoE.forward over this rank's experts (another rank's add 0 to their slots) and its part of the
    shared expert (split as a dense MLP, not summed on its own): both summed over the ranks at once."""

    def __init__(self, cfg: ModelConfig, group: Group):
        nn.Module.__init__(self)  # its share of the experts, not MoE's
        moe, self.group = cfg.moe, group
        held = expert_range(moe.num_experts, group)
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = ExpertShare((MLP(cfg.hidden_size, moe.expert_size) for _ in held), held)
        self.shared_expert = MLP(cfg.hidden_size, moe.shared_size // group.world) if moe.shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class ExpertParallelGemmaExperts(GemmaExperts):
    """DiffusionGemma's experts [r E/N, (r+1) E/N) on rank r, their outputs summed over the ranks."""

    def __init__(self, cfg: ModelConfig, group: Group):
        super().__init__(cfg, expert_range(cfg.moe.num_experts, group))
        self.group = group

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x, chosen, weights))


class VocabParallelHead(nn.Linear):
    """The LM head's rows of this rank's vocabulary: the logits of its vocabulary columns. Decoding at
    T = 0 reduces over the ranks' columns (decoding.most_likely); whole rows are gathered where a caller
    asks for them (Group.all_gather)."""

    def __init__(self, hidden: int, vocab_size: int, group: Group):
        super().__init__(hidden, vocab_size // group.world, bias=False)
        self.group = group


def shard(model, cfg: ModelConfig, group: Group):
    """model, built from local_config(cfg, group.world) on the meta device, with the modules that need the
    other ranks replaced by those above: o_proj, dense down_proj, each MoE, the embedding and the head (a tied
    head shares the embedding's rows); model.cfg the whole config, each layer's cfg its share; of DiffusionGemma,
    each layer's experts and, where its heads split, o_proj. World 1: as is."""
    if group.world == 1:
        return model
    if cfg.gemma is not None:
        heads_split = splits_gemma_heads(cfg, group.world)
        for layer in model.layers:
            if heads_split:
                attention = layer.self_attn
                attention.o_proj = RowParallelLinear(attention.o_proj.in_features, cfg.hidden_size, group)
            layer.experts = ExpertParallelGemmaExperts(cfg, group)
        model.cfg = cfg
        return model
    local = model.cfg
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(local.num_heads * local.head_dim, cfg.hidden_size, group)
        if isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(local, group)
        else:
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, group)
    model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
    model.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, group)
    model.cfg = cfg
    model.tie_weights()
    return model


def group_of(model) -> Group:
    """The group a model is split over (its embedding's, DiffusionGemma's experts'), SINGLE for a whole model."""
    split = model.embed_tokens if model.cfg.gemma is None else model.layers[0].experts
    return split.group if isinstance(split, (VocabParallelEmbedding, ExpertParallelGemmaExperts)) else SINGLE
