"""nanodllm/parallel.py: a model split over ranks computes what one process computes.

In this process (loading needs no collective): a split that does not divide the heads, the experts,
the widths or the vocabulary is refused in one line naming both numbers; every rank's share of each
real-format fixture and of a random model, put back together, is the whole model, with each expert
on exactly one rank, and each rank reads from the checkpoint no more than what it keeps.
Across CPU processes on gloo (spawned here once per size, 2 and 4 ranks, every rank running every
case): the logits of a ragged batch equal one process's (float64 within 1e-10, float32 within its
noise) on every fixture and on random models, dense and mixture of experts; each family's loop decodes
one process's tokens on every rank, dense and with every method at its defaults and at a tiny budget
(block engine: MAGE, Quest, SparseD, MOMO; masked engine: Fast-dLLM, dLLM-Cache, SnapKV, and those that
choose across heads from what they gather: MaskKV, DyLLM, Sparse-dLLM), with each rank's KV cache
holding its share of the KV heads. Where 4 ranks do not divide a fixture's KV heads its cases check
the refusal. DiffusionGemma, split by its experts alone: its steps' logits and its loop's tokens and steps,
dense and with the methods that apply to it.
Under torchrun (2 CPU processes): the demo split over both reports one process's answers once, and
eval writes one process's table whether the ranks hold two replicas or one split model.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import nanodllm.loader as loader
from nanodllm import GenerationConfig, generate
from nanodllm.attention import CanvasMask, attention
from nanodllm.config import ModelConfig
from nanodllm.block import sample
from nanodllm.decoding import left_padded_canvas, most_likely
from nanodllm.loader import build_empty, build_random, load_model, load_reference, random_weights
from nanodllm.methods import get_method
from nanodllm.parallel import SINGLE, Group, check_split, from_torchrun
from nanodllm.shards import local_part
from tests.device import DEVICE
from tests.test_contract import MOMO_GRID
from tests.tiny_models import tiny_config

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ["llada_tiny", "dream_tiny", "sdar_tiny", "fast_dllm_v2_tiny", "llada2_tiny", "sdar_moe_tiny"]
GEMMA = "diffusion_gemma_tiny"  # its 8 experts split over 2 and 4 ranks; its one full-layer KV head keeps heads whole
GEMMA_HEADS = "diffusion_gemma_heads"  # the fixture's shape, random, 2 full-layer KV heads: heads split over 2 ranks
RANDOM = ["sdar", "sdar_tied", "dream", "llada2_moe", "sdar_moe"]  # 4 KV heads and 8 experts: 4 ranks divide them
WORLDS = (2, 4)
SPAWN_TIMEOUT = 300  # seconds for one spawned group to run every case
# tiny budgets on every layer, as tests/test_contract.py's ("name-variant": method `name` with those knobs);
# MaskKV's 4, not 2: there a rank budgeting its own heads alone decodes other tokens on 2 ranks too
BLOCK_METHODS = {"mage": dict(k=1, exact_layers=0), "quest": dict(k=2, page_size=2, exact_layers=0),
                 "sparsed": dict(k=1, exact_layers=0, exact_fraction=0.5), "momo": dict(MOMO_GRID, k=1)}
GEMMA_METHODS = {"dense": {}, "mage": {}, "mage-tiny": dict(k=2, exact_layers=0), "quest-tiny": dict(k=2, page_size=2),
                 "sparsed-tiny": dict(k=2, exact_layers=0, exact_fraction=0.5), "momo": {}}
MASKED_METHODS = {"fast_dllm": {}, "dllm_cache": {}, "dllm_cache-tiny": dict(rho=0.5, response_interval=8),
                  "snapkv": {}, "snapkv-tiny": dict(budget=2), "maskkv": {}, "maskkv-tiny": dict(budget=4),
                  "dyllm": {}, "dyllm-tiny": dict(tau=0.5, full_steps=1, list_all_rows=0),
                  "sparse_dllm": {}, "sparse_dllm-tiny": dict(ratio=0.1, delay=1),
                  "sparse_dllm-per_head": dict(per_head=True, ratio=0.1, delay=1)}


def random_config(name: str) -> ModelConfig:
    if name == "dream":
        return ModelConfig.from_dict(dict(model_type="Dream", hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                                          vocab_size=64, mask_token_id=63, eos_token_id=62,
                                          max_position_embeddings=256))
    if name == "sdar_tied":
        return tiny_config("sdar", num_key_value_heads=4, tie_word_embeddings=True)
    return tiny_config(name, num_key_value_heads=4)


def config_of(model: str) -> ModelConfig:
    return ModelConfig.from_dir(FIXTURES / model) if model in FAMILIES + [GEMMA] else random_config(model)


def divides(model: str, world: int) -> bool:
    try:
        check_split(config_of(model), world)
    except ValueError:
        return False
    return True


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    """Token ids below the fixtures' mask (250) and stop (251) ids, and below a random model's."""
    return torch.randint(0, min(vocab - 3, 240), (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------------
# the cases every rank runs, and one process too


def built(model: str, dtype: torch.dtype, group: Group):
    """A fixture loaded, or a random model built, as this rank's share."""
    if model in FAMILIES:
        return load_model(FIXTURES / model, dtype=dtype, group=group)
    return build_random(random_config(model), dtype=dtype, seed=3, group=group)


def logits_of_a_ragged_batch(model: str, dtype: torch.dtype, group: Group) -> torch.Tensor:
    """Logits [2, 13, vocab] of two left-padded prompts (9 and 5 tokens) and 4 masks, padding hidden (the
    ranks' vocabulary columns gathered)."""
    net = built(model, dtype, group)
    cfg = net.cfg
    canvas = left_padded_canvas([prompt(9, 1, cfg.vocab_size), prompt(5, 2, cfg.vocab_size)], 4,
                                cfg.mask_token_id, 0, "cpu")
    block = cfg.block_size if cfg.attention == "block_causal" else None
    mask = CanvasMask(canvas.valid, block, canvas.positions if block else None)
    with torch.no_grad():
        return group.all_gather(net(canvas.tokens, canvas.positions, lambda layer, q, k, v: attention(q, k, v, mask)))


def logits_on_the_kernels(model: str, group: Group) -> torch.Tensor:
    """logits_of_a_ragged_batch in float32 through the fused model's kernels (Triton's interpreter here):
    the stacked projections, the row-parallel adds and the grouped experts of this rank."""
    import nanodllm.attention as attention_module

    switch = {"KERNEL_DEVICES": ("cuda", "cpu"), "KERNEL_DTYPES": (torch.float16, torch.bfloat16, torch.float32)}
    saved = {name: getattr(attention_module, name) for name in switch}
    try:
        vars(attention_module).update(switch)
        return logits_of_a_ragged_batch(model, torch.float32, group)
    finally:
        vars(attention_module).update(saved)


def decoded(model: str, method: str, knobs: dict, group: Group):
    """(tokens, KV heads in the block loops' cache or None) of a ragged batch decoded by the family's loop."""
    net = built(model, torch.float64, group)
    cfg, size = net.cfg, net.cfg.block_size or 4
    long = method != "dense"  # a prefix the tiny budgets cut
    lengths = (30, 21) if long else (7, 3)
    prompts = [prompt(n, seed, cfg.vocab_size) for seed, n in enumerate(lengths)]
    if cfg.model_type == "Dream":
        gen = GenerationConfig(gen_length=8, block_length=8, steps=8)
    elif cfg.attention == "bidirectional":
        gen = GenerationConfig(gen_length=16 if long else 8, block_length=4, steps=16 if long else 8)
    else:
        gen = GenerationConfig(gen_length=12 if long else 8, block_length=size, steps=size)
    result = generate(net, prompts, gen, get_method(method, **knobs))
    return result.tokens, None if result.cache is None else result.cache.keys[0].shape[2]


def gemma_model(model: str, dtype: torch.dtype, group: Group):
    """The fixture loaded, or GEMMA_HEADS built, as this rank's share."""
    if model == GEMMA:
        return load_model(FIXTURES / GEMMA, dtype=dtype, group=group)
    cfg = ModelConfig.from_dir(FIXTURES / GEMMA)
    cfg = dataclasses.replace(cfg, gemma=dataclasses.replace(cfg.gemma, global_kv_heads=2))
    return build_random(cfg, dtype=dtype, seed=3, group=group)


def gemma_logits(model: str, dtype: torch.dtype, group: Group) -> torch.Tensor:
    """DiffusionGemma's logits [3, 2, canvas, vocab]: a first and a self-conditioned step after two left-padded
    prompts (12 and 7 tokens, longer than the window), and a first step after a commit."""
    net = gemma_model(model, dtype, group)
    vocab, size = net.cfg.vocab_size, net.cfg.gemma.canvas_length
    padded = left_padded_canvas([prompt(12, 1, vocab), prompt(7, 2, vocab)], 0, 0, 0, "cpu")
    canvas = torch.tensor([prompt(size, 3, vocab), prompt(size, 4, vocab)])
    cache = net.empty_cache(2, padded.tokens.shape[1] + 2 * size)
    with torch.no_grad():
        net.encode(padded.tokens, cache, padded.valid)
        first = net.denoise(canvas, cache)
        second = net.denoise(canvas, cache, first.to(dtype))
        net.encode(first.argmax(dim=-1), cache)
        return torch.stack([first, second, net.denoise(canvas, cache)])


def gemma_decoded(model: str, method: str, knobs: dict, group: Group):
    """(tokens, steps per canvas, the experts a layer holds, the query heads a layer and the KV heads a full
    layer's cache hold) of two ragged prompts decoded by DiffusionGemma's loop, deterministic, over three
    canvases."""
    from nanodllm.gemma_loop import GemmaSampling

    net = gemma_model(model, torch.float64, group)
    prompts = [prompt(n, seed, net.cfg.vocab_size) for seed, n in enumerate((21, 12))]
    size = net.cfg.gemma.canvas_length
    result = generate(net, prompts, GenerationConfig(gen_length=3 * size, block_length=size, steps=6),
                      get_method(method, **knobs), stop_ids=(), sampling=GemmaSampling(sample=False, seed=7))
    attention, full_keys = net.layers[0].self_attn, [k for k in net.empty_cache(1, 1).full.keys if k is not None]
    return (result.tokens, result.steps_per_canvas, len(net.layers[0].experts.gate_up_proj),
            attention.q_proj.out_features // attention.head_dim, full_keys[0].shape[2])


def tied_logits() -> torch.Tensor:
    """Logits [2, 6, 64] whose largest entries tie at ids 3 and 40 (rows 0-2 of the first) and whose
    largest is [MASK] (id 17) in the second: the cases where a greedy decision over vocabulary columns
    could go wrong."""
    logits = torch.randn(2, 6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits[0, :3, 3] = logits[0, :3, 40] = 9.0
    logits[1, :, TIED_MASK] = 12.0
    return logits


TIED_MASK = 17


def greedy_over_columns(group: Group):
    """decoding.most_likely of tied_logits, each rank holding its vocabulary columns: [tokens, probabilities]."""
    tokens, probs = most_likely(tied_logits().chunk(group.world, dim=-1)[group.rank], TIED_MASK, group)
    return torch.stack([tokens.double(), probs])


CASES = {
    "greedy/sdar/ties": greedy_over_columns,
    **{f"logits/{model}/{str(dtype)[6:]}": functools.partial(logits_of_a_ragged_batch, model, dtype)
       for model in FAMILIES + RANDOM for dtype in (torch.float64, torch.float32)},
    **{f"logits/{model}/kernels": functools.partial(logits_on_the_kernels, model) for model in ("sdar", "llada2_moe")
       if not torch.cuda.is_available()},  # CPU tensors on the kernels: Triton's interpreter, set where there is no GPU
    **{f"decode/{model}/dense": functools.partial(decoded, model, "dense", {}) for model in FAMILIES + RANDOM},
    **{f"decode/sdar_tiny/{name}-{budget}": functools.partial(decoded, "sdar_tiny", name, knobs)
       for name, tiny in BLOCK_METHODS.items() for budget, knobs in (("default", {}), ("tiny", tiny))},
    **{f"decode/sdar/{name}-tiny": functools.partial(decoded, "sdar", name, tiny)
       for name, tiny in BLOCK_METHODS.items()},
    **{f"decode/llada_tiny/{name}": functools.partial(decoded, "llada_tiny", name.split("-")[0], knobs)
       for name, knobs in MASKED_METHODS.items()},
    **{f"gemma/{model}/logits/{str(dtype)[6:]}": functools.partial(gemma_logits, model, dtype)
       for model in (GEMMA, GEMMA_HEADS) for dtype in (torch.float64, torch.float32)},
    **{f"gemma/{model}/decode/{name}": functools.partial(gemma_decoded, model, name.split("-")[0], knobs)
       for model in (GEMMA, GEMMA_HEADS) for name, knobs in GEMMA_METHODS.items()},
}


def outcome(case: str, group: Group):
    """A case's result, or ("refused", the error's message)."""
    try:
        return CASES[case](group)
    except ValueError as error:
        return "refused", str(error)


@functools.cache
def one_process(case: str):
    return outcome(case, SINGLE)


def rank_main(rank: int, world: int, port: int, out: str):
    """One spawned rank: torchrun's environment, then every case's outcome, saved for the test."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = from_torchrun("gloo")
    torch.save({case: outcome(case, group) for case in CASES}, Path(out) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port no one listens on now (tests run side by side: torchrun's default port may be taken)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def launcher(ranks: int) -> list[str]:
    """The command that starts a module: torchrun with `ranks` processes on a free port, or (0) plain python."""
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
    return [sys.executable, *(torchrun if ranks else [])]


@functools.cache
def ranks(world: int) -> list[dict] | str:
    """Every rank's outcomes of every case, from `world` spawned processes; or why they did not finish
    (kept, so that a broken or hanging group fails each test at once, not after another spawn)."""
    with tempfile.TemporaryDirectory() as out:
        spawned = mp.start_processes(rank_main, args=(world, free_port(), out), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + SPAWN_TIMEOUT
        try:
            while not spawned.join(timeout=1):
                if time.monotonic() > deadline:
                    for process in spawned.processes:
                        process.kill()
                    return f"{world} ranks did not finish in {SPAWN_TIMEOUT} s"
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            return f"a rank of {world} failed: {error}"
        return [torch.load(Path(out) / f"{rank}.pt") for rank in range(world)]


def split_cases(prefix: str):
    """(world, case) for the cases of `prefix` whose model `world` ranks divide."""
    return [(world, case) for world in WORLDS for case in CASES if case.startswith(prefix)
            and divides(case.split("/")[1], world)]


# ------------------------------------------------------------------------------------------------
# refusals


NOT_DIVIDING = [  # (model, its config's changes, ranks, the number named); 4 KV heads, 64 ids, 8 experts else
    ("sdar", dict(num_attention_heads=6, num_key_value_heads=6), 4, "num_heads=6"),
    ("sdar", dict(num_key_value_heads=2), 4, "num_kv_heads=2"),
    ("sdar", dict(vocab_size=250), 4, "vocab_size=250"),
    ("sdar", dict(intermediate_size=66), 4, "intermediate_size=66"),
    ("llada2_moe", dict(num_experts=6, n_group=2, topk_group=1), 4, "moe.num_experts=6"),
    ("llada2_moe", dict(moe_intermediate_size=15), 2, "moe.shared_size=15"),
    ("llada2_moe", dict(intermediate_size=66), 4, "intermediate_size=66"),  # the width of its dense layer 0
]


@pytest.mark.parametrize("model, changes, world, named", NOT_DIVIDING, ids=[case[-1] for case in NOT_DIVIDING])
def test_a_split_that_does_not_divide_is_refused_in_one_line_naming_both_numbers(model, changes, world, named):
    cfg = tiny_config(model, **({"num_key_value_heads": 4} | changes))
    with pytest.raises(ValueError) as refused:
        build_empty(cfg, "meta", group=Group(0, world))
    message = str(refused.value)
    assert "\n" not in message and named in message and f"{world} ranks" in message, message
    build_empty(cfg, "meta")


def test_a_q_k_norm_over_the_whole_projection_is_refused_under_a_split_only():
    cfg = tiny_config("llada", attention_layer_norm=True)
    with pytest.raises(ValueError, match="attention_layer_norm") as refused:
        build_empty(cfg, "meta", group=Group(1, 2))
    assert "\n" not in str(refused.value)
    build_empty(cfg, "meta")


# ------------------------------------------------------------------------------------------------
# each rank's share, loaded or drawn in this process


def whole_from_shares(shares: list[dict], cfg: ModelConfig, whole: dict) -> dict:
    """The whole model's parameters put back together from the ranks' shares, checking that a tensor
    held whole is the same on every rank that holds it and that exactly one rank holds each expert."""
    world, assembled = len(shares), {}
    for name in whole:
        parts = [local_part(name, cfg, Group(rank, world)) for rank in range(world)]
        held = [share[part.name] for share, part in zip(shares, parts) if part is not None]
        dim = next(part for part in parts if part is not None).dim
        if ".experts." in name and dim is None:  # an expert's tensor (DiffusionGemma's stack: rows of experts)
            assert len(held) == 1, f"{name} is held by {len(held)} ranks"
        if dim is None:
            assert all(torch.equal(tensor, held[0]) for tensor in held), name
            assembled[name] = held[0]
        else:
            assembled[name] = torch.cat(held, dim=dim)
    return assembled


class Counting:
    """A safetensors handle, or one tensor's slice handle, that counts the elements it reads."""

    def __init__(self, handle, counts):
        self.handle, self.counts = handle, counts

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts["read"] += tensor.numel()
        return tensor

    def get_tensor(self, name):
        return self.read(self.handle.get_tensor(name))

    def get_slice(self, name):
        return Counting(self.handle.get_slice(name), self.counts)

    def __getitem__(self, index):
        return self.read(self.handle[index])

    def __getattr__(self, name):
        return getattr(self.handle, name)


@pytest.mark.parametrize("world, model", [(world, model) for world in WORLDS for model in FAMILIES + [GEMMA]
                                          if divides(model, world)])
def test_the_ranks_shares_of_a_checkpoint_make_the_whole_and_are_all_they_read(world, model, monkeypatch):
    assert_shares_make_the_whole(FIXTURES / model, world, monkeypatch)


def assert_shares_make_the_whole(path: Path, world: int, monkeypatch) -> list[dict]:
    """Each rank's share of the checkpoint at path: it reads exactly what it keeps, and the shares make the whole."""
    whole = dict(load_reference(path, dtype=torch.float32).named_parameters())
    real_open = loader._open
    shares = []
    for rank in range(world):
        counts = collections.Counter()
        monkeypatch.setattr(loader, "_open", lambda file: Counting(real_open(file), counts))
        share = dict(load_reference(path, dtype=torch.float32, group=Group(rank, world)).named_parameters())
        assert counts["read"] == sum(p.numel() for p in share.values()), "a rank reads exactly what it keeps"
        shares.append(share)
    assembled = whole_from_shares(shares, ModelConfig.from_dir(path), whole)
    assert all(torch.equal(assembled[name], whole[name]) for name in whole)
    return shares


def test_a_diffusion_gemma_checkpoint_whose_kv_heads_divide_splits_its_heads(tmp_path, monkeypatch):
    """GEMMA's checkpoint with 2 KV heads in its full layers (their k_proj drawn afresh), over 2 ranks: each
    reads half of every q/k/v_proj's rows and o_proj's columns besides its experts."""
    config = json.loads((FIXTURES / GEMMA / "config.json").read_text())
    config["text_config"]["num_global_key_value_heads"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors, generator = load_file(FIXTURES / GEMMA / "model.safetensors"), torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        layer = re.search(r"layers\.(\d+)\.self_attn\.k_proj", name)
        if layer and config["text_config"]["layer_types"][int(layer[1])] == "full_attention":
            tensors[name] = torch.randn(2 * tensor.shape[0], tensor.shape[1], generator=generator).to(tensor.dtype)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shares = assert_shares_make_the_whole(tmp_path, 2, monkeypatch)
    whole = dict(load_reference(tmp_path, dtype=torch.float32).named_parameters())
    halves = {f"layers.{layer}.self_attn.{projection}_proj.weight": 0 for layer, projection in ("1q", "1k", "2v")}
    for name, dim in {**halves, "layers.3.self_attn.o_proj.weight": 1}.items():
        assert all(share[name].shape[dim] * 2 == whole[name].shape[dim] for share in shares), name


@pytest.mark.parametrize("world, model", [(world, model) for world in WORLDS for model in RANDOM + [GEMMA]])
def test_each_ranks_share_of_random_weights_is_the_one_process_draw_sliced(world, model):
    cfg = config_of(model)
    whole = dict(random_weights(build_empty(cfg, dtype=torch.float32), seed=5).named_parameters())
    shares = [dict(random_weights(build_empty(cfg, dtype=torch.float32, group=Group(rank, world)), seed=5)
                   .named_parameters()) for rank in range(world)]
    assembled = whole_from_shares(shares, cfg, whole)
    assert all(torch.equal(assembled[name], whole[name]) for name in whole)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["llada2_moe", "sdar_moe"])
def test_the_ranks_grouped_experts_sum_to_the_whole_layer(model, world, kernels_on, monkeypatch):
    """FusedMoE's grouped path (torch's grouped_mm, float32 here) on each rank's share, its all-reduce left
    out: the ranks' outputs sum to one process's; each rank's rows of other ranks' experts count zero."""
    # CUDA's grouped GEMM: bf16
    cfg, dtype = random_config(model), torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(3, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    layer = lambda group: build_random(cfg, DEVICE, dtype, seed=3, group=group).layers[1].mlp
    monkeypatch.setattr(Group, "all_reduce", lambda group, y: y)
    with torch.no_grad():
        expected = layer(SINGLE)(x).float()
        shares = [layer(Group(rank, world))(x).float() for rank in range(world)]
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (sum(shares) - expected).abs().max() <= tolerance * expected.abs().max()
    assert not any(torch.allclose(share, expected, atol=1e-3) for share in shares), "each rank holds a part only"


@pytest.mark.parametrize("world", WORLDS)
def test_the_ranks_embedding_rows_sum_to_the_whole_embedding_of_every_id(world, monkeypatch):
    """Each rank's VocabParallelEmbedding, its all-reduce left out, gives its rows' embeddings and zeros
    elsewhere: summed over the ranks, every id's (the first and last of each shard too) whole row."""
    cfg = random_config("sdar")
    embedding = lambda group: build_random(cfg, dtype=torch.float32, seed=3, group=group).embed_tokens
    monkeypatch.setattr(Group, "all_reduce", lambda group, y: y)
    ids = torch.arange(cfg.vocab_size).view(2, -1)
    with torch.no_grad():
        expected = embedding(SINGLE)(ids)
        shares = [embedding(Group(rank, world))(ids) for rank in range(world)]
    assert all((share != 0).any(dim=-1).sum() == cfg.vocab_size // world for share in shares)
    assert torch.equal(sum(shares), expected)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["llada2_moe", "sdar_moe"])
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_the_ranks_moe_layers_sum_to_the_whole_layer(model, world, fused, monkeypatch):
    """MoE.forward (torch, no kernels) of the reference model's ExpertParallelMoE and of the fused model's FusedMoE
    over each rank's experts and shared-expert part, its all-reduce left out: the ranks' outputs sum to one
    process's."""
    cfg = random_config(model)
    x = torch.randn(3, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def layer(group):
        if fused:
            return build_random(cfg, dtype=torch.float64, seed=3, group=group).layers[1].mlp
        return random_weights(build_empty(cfg, dtype=torch.float64, group=group), seed=3).layers[1].mlp
    monkeypatch.setattr(Group, "all_reduce", lambda group, y: y)
    with torch.no_grad():
        expected = layer(SINGLE)(x)
        shares = [layer(Group(rank, world))(x) for rank in range(world)]
    torch.testing.assert_close(sum(shares), expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# spawned ranks against one process


def same_on_every_rank(world: int, case: str):
    """The case's outcome, after checking that every rank had the same."""
    spawned = ranks(world)
    if isinstance(spawned, str):
        pytest.fail(spawned)
    outcomes = [rank[case] for rank in spawned]
    first = outcomes[0]
    for other in outcomes[1:]:
        assert torch.equal(other, first) if isinstance(first, torch.Tensor) else other == first, case
    return first


@pytest.mark.parametrize("world", WORLDS)
def test_greedy_decisions_from_the_ranks_columns_are_the_whole_rows(world):
    """The argmax (first of a tie, never [MASK]) and its softmax probability, as the block loop's sample."""
    tokens, probs = same_on_every_rank(world, "greedy/sdar/ties")
    expected, expected_probs = sample(tied_logits(), 0.0, TIED_MASK)
    tokens = tokens.long()
    assert tokens.tolist() == expected.tolist() and (tokens[0, :3] == 3).all() and (tokens != TIED_MASK).all()
    torch.testing.assert_close(probs, expected_probs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("world, case", split_cases("logits/"))
def test_logits_equal_one_process(world, case):
    got, expected = same_on_every_rank(world, case), one_process(case)
    rtol, atol = (1e-10, 1e-10) if case.endswith("float64") else (1e-5, 5e-5)  # kernels: float32
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("world, case", split_cases("decode/"))
def test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads(world, case):
    (tokens, cache_heads), (expected, whole_heads) = same_on_every_rank(world, case), one_process(case)
    assert tokens == expected
    assert cache_heads == (None if whole_heads is None else whole_heads // world)


@pytest.mark.parametrize("world, case", [(world, case) for world in WORLDS for case in CASES
                                         if case.startswith("gemma/")])
def test_diffusion_gemma_split_computes_one_process(world, case):
    """Each rank holds 1/N of DiffusionGemma's experts and, where the KV heads of both kinds of layer divide
    among the ranks (GEMMA_HEADS over 2), 1/N of its query and KV heads (dense MLP and vocabulary whole): the
    logits of a ragged batch's steps, and the tokens and steps of every applicable method, as one process's."""
    got, expected = same_on_every_rank(world, case), one_process(case)
    if "/logits/" in case:  # float32: the experts and heads summed in another order, logits softcapped at 30
        rtol, atol = (1e-10, 1e-10) if case.endswith("float64") else (1e-5, 1e-4)
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    else:
        heads_split = GEMMA_HEADS in case and world == 2
        assert got[:2] == expected[:2] and got[2] * world == expected[2]
        assert [n * world if heads_split else n for n in got[3:]] == list(expected[3:])


@pytest.mark.parametrize("world", WORLDS)
def test_a_fixture_that_the_ranks_do_not_divide_is_refused_on_every_rank(world):
    refused = [case for case in CASES
               if case.startswith(("logits/", "decode/")) and not divides(case.split("/")[1], world)]
    assert (world == 4) == bool(refused)
    for case in refused:
        kind, message = same_on_every_rank(world, case)
        cfg = config_of(case.split("/")[1])
        assert kind == "refused" and f"num_kv_heads={cfg.num_kv_heads}" in message and f"{world} ranks" in message


# ------------------------------------------------------------------------------------------------
# the command line


def demo(*flags: str, ranks: int = 0) -> subprocess.CompletedProcess:
    """`python -m nanodllm demo FLAGS`, under torchrun with `ranks` CPU processes (0: plain python)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([*launcher(ranks), "-m", "nanodllm", "demo", *flags], capture_output=True, text=True, env=env,
                          timeout=SPAWN_TIMEOUT, cwd=FIXTURES.parents[1])


def answers(output: str) -> list[str]:
    """The demo's report lines, timings left out."""
    return [line for line in output.splitlines() if line and "tokens/s" not in line and "speed" not in line]


def test_the_demo_split_over_two_processes_reports_one_process_answers_once():
    flags = ("--method", "mage", "--gen-length", "16", "--steps", "8", "--length", "256")
    single, split = demo(*flags), demo(*flags, "--tp", "2", ranks=2)
    assert single.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    expected = answers(single.stdout)
    assert answers(split.stdout) == [expected[0] + ", split over 2 ranks", *expected[1:]]


def test_the_demo_refuses_a_split_over_fewer_processes():
    done = demo("--tp", "2")
    message = "--tp 2 needs 2 processes (torchrun --nproc-per-node 2 ...); this run has 1"
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


CLOSING = """
import os, torch
from nanodllm.loader import build_empty
from nanodllm.parallel import close, from_torchrun
from tests.tiny_models import tiny_config
threads = len(os.listdir("/proc/self/task"))
group = from_torchrun("gloo")
build_empty(tiny_config("sdar"), "meta", group=group)
group.all_reduce(torch.ones(2))
close()
# one write: ranks share stdout
os.write(1, f"threads left: {len(os.listdir('/proc/self/task')) - threads}\\n".encode())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_closing_the_group_ends_its_threads(tmp_path):
    """A group that outlives close() keeps gloo threads that can abort the process as Python exits."""
    (tmp_path / "closing.py").write_text(CLOSING)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(FIXTURES.parents[1]))
    done = subprocess.run([*launcher(2), str(tmp_path / "closing.py")], capture_output=True, text=True, env=env,
                          timeout=SPAWN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["threads left: 0"] * 2, done.stdout


EVAL_FLAGS = ("--model", "tiny-sdar", "--method", "quest", "--n", "4", "--batch", "1", "--lengths", "128",
              "--gen-length", "8", "--steps", "8")  # 8 steps for the block of 32: 4 tokens a step


def evaluated(*flags: str, ranks: int = 0, tmp: Path) -> list[str]:
    """`nanodllm eval` (under torchrun with `ranks` CPU processes; `--` keeps its --n from torchrun's
    abbreviations): the report's lines, the speed columns left out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(FIXTURES.parents[1]))
    command = [*launcher(ranks), "-m", "nanodllm", *(["--"] if ranks else []), "eval", *EVAL_FLAGS, *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=SPAWN_TIMEOUT, cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list((tmp / "runs").glob("*.jsonl")), "the journal is removed once the table is out"
    return [" | ".join(line.split(" | ")[:6]) if line.startswith("|") else line for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def one_process_table(tmp_path_factory) -> list[str]:
    """The table eval writes in one process: the same for both splits below, so run once."""
    return evaluated(tmp=tmp_path_factory.mktemp("one-process-eval"))


@pytest.mark.parametrize("tp", [1, 2], ids=["two replicas", "one model over two ranks"])
def test_eval_over_two_processes_writes_one_process_table(tp, tmp_path, one_process_table):
    assert evaluated("--tp", str(tp), ranks=2, tmp=tmp_path) == one_process_table


def test_a_world_that_tp_does_not_divide_is_refused(monkeypatch):
    from nanodllm.cli import tensor_parallel

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"--tp 2 needs a multiple of 2 processes .*; this run has 3"):
        tensor_parallel(2, data_parallel=True)
    with pytest.raises(ValueError, match=r"--tp 3 needs 3 processes"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        tensor_parallel(3)
