"""Mixture-of-experts models: LLaDA2 (llada2_moe) and SDAR-MoE (sdar_moe).

- parity: tests/fixtures/llada2_tiny (sharded, LLaDA2's tensor names, against a float32 transcription
  of its forward whose MoE layers are transformers' DeepseekV3MoE) and sdar_moe_tiny (Qwen3-MoE names,
  against transformers' Qwen3MoeForCausalLM), both block-causal with blocks of 4, written by
  `python scripts/make_fixtures.py moe`;
- the router: the group limit and the expert bias each change the logits; its choice obeys both;
- the grouped fast path equals the per-expert reference;
- the block engine: LLaDA2's threshold loop, recomputing the prefix every step, equals the cached
  engine; a prompt token equal to the mask id is never decoded; the block methods keep their
  contract (tests/test_contract.py) on an MoE model;
- bad checkpoints and configs are named.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

import nanodllm.experts as experts_module
from nanodllm import block, fused_mlp
from nanodllm.config import GenerationConfig, ModelConfig
from nanodllm.fused import fuse
from nanodllm.generation import generate
from nanodllm.kernels.expert_linear import expert_linear
from nanodllm.attention import attention
from nanodllm.loader import CheckpointError, build_empty, build_random, load_model, random_weights
from nanodllm.mlp import MoE, Router, within_best_groups
from tests.test_block_engine import cache_free_generate
from tests.test_contract import CONTRACT, GENS, PROMPTS, decode, differing
from tests.device import DEVICE
from tests.test_parity import golden, mask_for, run
from tests.tiny_models import MASK_ID, random_prompt, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
LLADA2 = FIXTURES / "llada2_tiny"
SDAR_MOE = FIXTURES / "sdar_moe_tiny"
TOLERANCE = 1e-4
torch_grouped_mm = fused_mlp.GROUPED_MM


@pytest.mark.parametrize("path, family", [(LLADA2, "llada2_moe"), (SDAR_MOE, "sdar_moe")], ids=["llada2", "sdar_moe"])
def test_logits_match_the_references(path, family):
    model = load_model(path, dtype=torch.float32)
    cfg = model.cfg
    assert (cfg.model_type, cfg.attention, cfg.block_size) == (family, "block_causal", 4)
    ids, positions, expected = golden(path)
    logits = run(model, ids, positions, mask_for(model, positions))
    diff = (logits - expected).abs().max().item()
    print(f"\n{family}: max |logits - reference| = {diff:.3e} (logit scale {expected.abs().max():.2f})")
    assert diff < TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_fixtures_hold_the_released_layouts():
    llada2 = load_model(LLADA2, dtype=torch.float32)
    assert llada2.cfg.rotary_dim == llada2.cfg.head_dim // 2 and llada2.cfg.qk_norm == "head"
    assert llada2.cfg.moe.dense_layers == (0,) and llada2.cfg.moe.shared_size > 0
    sdar = load_model(SDAR_MOE, dtype=torch.float32)
    assert sdar.cfg.moe.dense_layers == (1,) and sdar.cfg.moe.score == "softmax"
    assert [type(layer.mlp).__name__ for layer in sdar.layers] == ["FusedMoE", "FusedMLP", "FusedMoE"]


@pytest.mark.parametrize("ablation", ["group_limit", "expert_bias", "rotary_width"])
def test_each_part_of_llada2_matters(ablation):
    """Without the group limit, the expert bias or the partial rotary width the golden logits are missed."""
    model = load_model(LLADA2, dtype=torch.float32)
    ids, positions, expected = golden(LLADA2)
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer.mlp, MoE) and ablation == "group_limit":
                layer.mlp.gate.moe = dataclasses.replace(layer.mlp.gate.moe, groups=1, groups_kept=1)
            elif isinstance(layer.mlp, MoE) and ablation == "expert_bias":
                layer.mlp.gate.expert_bias.zero_()
    if ablation == "rotary_width":
        model.cfg = dataclasses.replace(model.cfg, partial_rotary_factor=1.0)
    assert (run(model, ids, positions, mask_for(model, positions)) - expected).abs().max() > 1e-2


def test_the_router_chooses_within_the_best_groups_and_weighs_by_unbiased_scores():
    cfg = tiny_config("llada2_moe")
    router = Router(cfg.hidden_size, cfg.moe).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator, dtype=torch.float64))
        router.expert_bias.copy_(torch.randn(8, generator=generator, dtype=torch.float64))
    x = torch.randn(50, cfg.hidden_size, generator=generator, dtype=torch.float64)
    chosen, weights = router(x)
    scores = (x @ router.weight.T).sigmoid()
    biased = (scores + router.expert_bias).view(50, 4, 2)
    best_groups = biased.sum(-1).topk(2, dim=-1).indices  # two experts per group: the top-2 sum is the sum
    assert all(set((chosen[n] // 2).tolist()) <= set(best_groups[n].tolist()) for n in range(50))
    picked = scores.gather(1, chosen)
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True) * 2.5)
    allowed = within_best_groups(scores + router.expert_bias, 4, 2)
    assert torch.equal(chosen, allowed.topk(2, dim=-1).indices)


def routed_in_float64(gate: Router, x: torch.Tensor):
    """(chosen experts [n, k] sorted, their weights, the margin between the k-th and next preference) of
    bfloat16 inputs x, in float64 with the one rounding the references make: Qwen3-MoE's router logits
    in the model's dtype (LLaDA2's are float32)."""
    moe = gate.moe
    logits = x.double() @ gate.weight.double().T
    scores = logits.to(x.dtype).double().softmax(dim=-1) if moe.score == "softmax" else logits.sigmoid()
    preference = scores if gate.expert_bias is None else scores + gate.expert_bias.double()
    if moe.groups > 1:
        preference = within_best_groups(preference, moe.groups, moe.groups_kept)
    top = preference.topk(moe.experts_per_token + 1, dim=-1)
    chosen = top.indices[:, :-1]
    weights = scores.gather(-1, chosen)
    if moe.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    order = chosen.argsort(dim=-1)
    return chosen.gather(-1, order), (weights * moe.scale).gather(-1, order), top.values[:, -2] - top.values[:, -1]


@pytest.mark.parametrize("family", ["llada2_moe", "sdar_moe"])
def test_a_bfloat16_moe_routes_and_sums_as_its_float64_reference(family):
    """In bfloat16 the router's choice equals the float64 one's wherever the k-th and next preferences are
    1e-5 apart, and the layer's output is the float64 sum of the weighted bf16 expert outputs rounded to
    bf16 once (then the shared expert added), to within 1% of entries one bf16 step off: float32 routing
    and a float32 sum meet it, a bf16 router or bf16 accumulation does not."""
    moe = tiny_model(family, dtype=torch.bfloat16).layers[1].mlp
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        chosen, weights = moe.gate(x)
        y = moe(x)
        expected, expected_weights, margin = routed_in_float64(moe.gate, x)
        outputs = torch.zeros(*chosen.shape, 32, dtype=x.dtype)  # each expert over its rows, as the layer runs it
        for expert in range(moe.gate.moe.num_experts):
            rows, slots = (chosen == expert).nonzero(as_tuple=True)
            outputs[rows, slots] = moe.experts[expert](x[rows])
        order = chosen.argsort(dim=-1)
        outputs = outputs.gather(1, order[..., None].expand_as(outputs))
        routed = (outputs.double() * expected_weights[..., None]).sum(dim=1).to(torch.bfloat16)
        reference = routed + moe.shared_expert(x) if moe.shared_expert is not None else routed
    clear = margin > 1e-5
    assert clear.float().mean() > 0.95
    assert torch.equal(chosen.gather(-1, order)[clear], expected[clear])
    torch.testing.assert_close(weights.gather(-1, order)[clear].double(), expected_weights[clear], rtol=1e-6, atol=0)
    differ = y[clear] != reference[clear]
    assert differ.float().mean() < 0.01, f"{differ.float().mean():.3f} of the entries differ"
    step = (routed[clear].float().abs() + reference[clear].float().abs()) * 2 ** -7  # one bf16 step of either sum
    assert ((y[clear].float() - reference[clear].float()).abs() <= step).all()


@st.composite
def moe_configs(draw) -> ModelConfig:
    """A tiny MoE config over the fields' ranges: experts, top-k, LLaDA2's groups, shared expert, dense
    first layer and scaling, Qwen3-MoE's sparse step, dense layers and normalisation, RoPE's width."""
    family = draw(st.sampled_from(["llada2_moe", "sdar_moe"]))
    experts = draw(st.sampled_from([4, 8, 16]))
    fields = dict(num_experts=experts, partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 1.0])))
    if family == "llada2_moe":
        groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts // g >= 2]))
        kept = draw(st.integers(1, groups))
        fields.update(n_group=groups, topk_group=kept, num_shared_experts=draw(st.sampled_from([0, 1])),
                      first_k_dense_replace=draw(st.sampled_from([0, 1])),
                      routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
        most = kept * experts // groups
    else:
        fields.update(decoder_sparse_step=draw(st.sampled_from([1, 2])),
                      mlp_only_layers=draw(st.sampled_from([[], [0]])),
                      norm_topk_prob=draw(st.booleans()))
        most = experts
    fields["num_experts_per_tok"] = draw(st.integers(1, min(4, most)))
    return tiny_config(family, **fields)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=moe_configs(), seed=st.integers(0, 2**16))
def test_the_fused_moe_model_gives_the_reference_logits_across_shapes(kernels_on, cfg, seed):
    """float32 on the kernels (compiled on a GPU, else Triton's interpreter) and torch's grouped_mm: the
    fused model (stacked experts in grouped matmuls, fused norms and RoPE) against its reference model."""
    reference = random_weights(build_empty(cfg, dtype=torch.float32), seed)
    model = fuse(copy.deepcopy(reference)).to(DEVICE)
    reference = reference.to(DEVICE)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=generator).to(DEVICE)
    positions = torch.arange(11, device=DEVICE).expand(2, 11)
    with torch.no_grad():
        fast = model(ids, positions, lambda layer, q, k, v: attention(q, k, v))
        slow = reference(ids, positions, lambda layer, q, k, v: attention(q, k, v))
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(cfg=moe_configs(), seed=st.integers(0, 2**16))
def test_the_router_in_float32_chooses_as_in_float64_across_shapes(cfg, seed):
    """Wherever the k-th and next preferences are 1e-5 apart, the same experts and weights to 1e-5."""
    generator = torch.Generator().manual_seed(seed)
    router = Router(cfg.hidden_size, cfg.moe)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=generator))
        if router.expert_bias is not None:
            router.expert_bias.copy_(0.1 * torch.randn(cfg.moe.num_experts, generator=generator))
    exact = copy.deepcopy(router).double()
    x = torch.randn(64, cfg.hidden_size, generator=generator)
    chosen, weights = router(x)
    expected, expected_weights = exact(x.double())
    preference = (x.double() @ exact.weight.T)
    preference = preference.sigmoid() if cfg.moe.score == "sigmoid" else preference.softmax(dim=-1)
    if exact.expert_bias is not None:
        preference = preference + exact.expert_bias
    if cfg.moe.groups > 1:
        preference = within_best_groups(preference, cfg.moe.groups, cfg.moe.groups_kept)
    unchosen = torch.full((64, 1), float("-inf"), dtype=torch.float64)  # a k + 1-th where k is every expert
    top = torch.cat([preference, unchosen], dim=-1).topk(cfg.moe.experts_per_token + 1, dim=-1).values
    clear = top[:, -2] - top[:, -1] > 1e-5
    assert torch.equal(chosen[clear], expected[clear])
    torch.testing.assert_close(weights[clear].double(), expected_weights[clear], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["expert_linear", "grouped_mm"])
@pytest.mark.parametrize("family", ["llada2_moe", "sdar_moe"])
def test_grouped_experts_equal_the_per_expert_loop(family, path, kernels_on, monkeypatch):
    """A step's few tokens on kernels/expert_linear.py, more on torch's grouped_mm: on the CPU in float32
    (Triton's interpreter), on a GPU in bfloat16 (its grouped GEMM takes nothing else), to the dtype's
    rounding; a prefill's tokens in chunks."""
    calls = []
    monkeypatch.setattr(experts_module, "GROUPED_MM",
                        lambda *args, **kwargs: calls.append(kwargs["offs"].dtype) or torch_grouped_mm(*args, **kwargs))
    monkeypatch.setattr(experts_module, "expert_linear",
                        lambda *args, **kwargs: calls.append(path) or expert_linear(*args, **kwargs))
    monkeypatch.setattr(experts_module, "beats_grouped_mm", lambda *sizes: path == "expert_linear")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model = build_random(tiny_config(family), device=DEVICE, dtype=dtype, seed=3)
    moe = model.layers[1].mlp
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    with torch.no_grad():
        grouped = moe(x)
        reference = MoE.forward(moe, x)
        monkeypatch.setattr(fused_mlp, "CHUNK_TOKENS", 5)  # a prefill's tokens go through in chunks
        chunked = moe(x)
    kind = path if path == "expert_linear" else torch.int32  # CUDA's grouped GEMM takes int32 offsets only
    assert calls == [kind] * 2 * (1 + 5), "one call for gate/up, one for down, per chunk"
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for fast in (grouped, chunked):  # a matmul's blocking may follow its rows: equal to rounding
        assert (fast.float() - reference.float()).abs().max() <= tolerance * reference.float().abs().max()


@pytest.mark.parametrize("threshold", [None, 0.5, 0.95])
@pytest.mark.parametrize("prompt_length", [3, 9])
def test_llada2_threshold_loop_equals_the_cached_engine(threshold, prompt_length):
    """LLaDA2's generate(): every masked position above the threshold if at least the scheduled count
    clear it, else the top scheduled count; its loop re-forwards the prefix at every step."""
    model = tiny_model("llada2_moe")
    remasking = "low_confidence_dynamic" if threshold else "low_confidence"
    gen = GenerationConfig(gen_length=12, block_length=4, steps=4, threshold=threshold, remasking=remasking)
    prompt = random_prompt(prompt_length, seed=prompt_length)
    assert block.generate(model, [prompt], gen, stop_ids=()).tokens[0] == cache_free_generate(model, prompt, gen)


def test_a_prompt_token_equal_to_the_mask_id_is_never_decoded():
    model = tiny_model("llada2_moe")
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4)
    prompt = random_prompt(5, seed=4)[:-1] + [MASK_ID]  # its tail (columns 4..) shares the first block
    result = block.generate(model, [prompt], gen, stop_ids=())
    assert result.tokens[0] == cache_free_generate(model, prompt, gen)
    assert result.forwards == 3 + 1 + 2 * (4 + 1), "3 steps for the 3 masks of block 1, then 2 full blocks"


def test_generate_decodes_an_moe_model_on_the_block_engine():
    """nanodllm.generate routes LLaDA2 (and SDAR-MoE), block-causal, to the block engine's loop."""
    model = tiny_model("llada2_moe")
    gen = GenerationConfig(gen_length=8, block_length=4, steps=4)
    prompts = [random_prompt(5, seed=4), random_prompt(9, seed=5)]
    result, expected = generate(model, prompts, gen, stop_ids=()), block.generate(model, prompts, gen, stop_ids=())
    assert (result.tokens, result.forwards) == (expected.tokens, expected.forwards)


BLOCK_METHODS = sorted(name for name, engine in CONTRACT if engine == "block" and name != "dense")
MOE_MODEL = tiny_model("llada2_moe")


@pytest.mark.parametrize("name", BLOCK_METHODS)
def test_block_methods_keep_their_contract_on_an_moe_model(name):
    entry = CONTRACT[name, "block"]
    dense = decode("block", *entry.reference, model=MOE_MODEL)
    assert differing(decode("block", name, entry.full, model=MOE_MODEL), dense) == 0
    assert differing(decode("block", name, entry.tiny, model=MOE_MODEL), dense) > 0


@pytest.mark.parametrize("name", ["dense", "mage", "quest", "sparsed"])
def test_a_ragged_moe_batch_equals_its_rows_alone(name):
    knobs = CONTRACT[name, "block"].tiny
    batched = decode("block", name, knobs, model=MOE_MODEL)
    assert batched == [decode("block", name, knobs, [prompt], model=MOE_MODEL)[0] for prompt in PROMPTS]
    assert GENS["block"].block_length == 4


def copy_fixture(tmp_path: Path, edit) -> Path:
    """sdar_moe_tiny with its tensors passed through edit(dict)."""
    out = tmp_path / "model"
    shutil.copytree(SDAR_MOE, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_fused_experts_are_refused_by_name(tmp_path):
    def fuse(tensors):
        prefix = "model.layers.0.mlp.experts."
        gate_up = [torch.cat([tensors.pop(f"{prefix}{e}.gate_proj.weight"), tensors.pop(f"{prefix}{e}.up_proj.weight")])
                   for e in range(16)]
        tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj holds every expert"):
        load_model(copy_fixture(tmp_path, fuse))


def test_a_missing_or_misshapen_expert_is_named(tmp_path):
    def break_experts(tensors):
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
        tensors["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(32, 8, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError) as error:
        load_model(copy_fixture(tmp_path, break_experts))
    assert "missing (1 tensor): model.layers.2.mlp.experts.5.up_proj.weight" in str(error.value)
    assert "model.layers.0.mlp.experts.3.down_proj.weight has shape [32, 8], expected [32, 16]" in str(error.value)


@pytest.mark.parametrize("edit, message", [
    (dict(score_function="softmax"), "score_function 'softmax' is not implemented"),
    (dict(n_group=None), "required field 'n_group' is missing"),
    (dict(topk_group=None), "required field 'topk_group' is missing"),
    (dict(n_group=3), "n_group=3 must divide num_experts=16"),
    (dict(num_experts_per_tok=12), "12 experts per token do not fit in topk_group=2 groups of 4"),
    (dict(use_qkv_bias=True), "use_qkv_bias=true is not supported"),
])
def test_a_router_config_we_do_not_implement_is_named(edit, message):
    raw = json.loads((LLADA2 / "config.json").read_text())
    raw.update(edit)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_the_stacked_experts_hold_each_experts_rows_and_cast_as_one(kernels_on, monkeypatch):
    """experts.gate_up_proj [experts, 2 * size, hidden] holds each expert's gate and up rows, experts.down_proj
    [experts, hidden, size] its down, the shared expert's gate_up_proj its gate's and up's: Parameters of
    their own storage, which .to() keeps so (float64: the per-expert loop, bit for bit; cast to a kernel
    dtype: the grouped path)."""
    reference = random_weights(build_empty(tiny_config("llada2_moe"), dtype=torch.float64), seed=3)
    model = fuse(copy.deepcopy(reference)).to(DEVICE)
    moe, moe_ref = model.layers[1].mlp, reference.to(DEVICE).layers[1].mlp
    assert moe.experts.gate_up_proj.shape == (8, 2 * 16, 32) and moe.experts.down_proj.shape == (8, 32, 16)
    for e, expert in enumerate(moe_ref.experts):
        assert torch.equal(moe.experts.gate_up_proj[e], torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
        assert torch.equal(moe.experts.down_proj[e], expert.down_proj.weight)
    shared = moe_ref.shared_expert
    assert torch.equal(moe.shared_expert.gate_up_proj.weight,
                       torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    calls = []
    monkeypatch.setattr(experts_module, "GROUPED_MM",
                        lambda *args, **kwargs: calls.append(1) or torch_grouped_mm(*args, **kwargs))
    monkeypatch.setattr(experts_module, "beats_grouped_mm", lambda *sizes: False)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # what the grouped GEMM takes there
    with torch.no_grad():
        assert torch.equal(moe(x), moe_ref(x)) and not calls
        model.to(dtype)
        stacked = (moe.experts.gate_up_proj, moe.experts.down_proj, moe.shared_expert.gate_up_proj.weight)
        assert all(p.dtype == dtype and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in stacked)
        grouped, expected = moe(x.to(dtype)).float(), moe_ref.to(dtype)(x.to(dtype)).float()
    assert len(calls) == 2
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (grouped - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped fast path runs on CUDA")
def test_grouped_experts_on_the_gpu_match_the_loop_and_replay_in_a_graph():
    model = build_random(tiny_config("llada2_moe"), device="cuda", dtype=torch.bfloat16, seed=3)
    moe = model.layers[1].mlp
    x = torch.randn(2, 40, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        grouped, reference = moe(x), MoE.forward(moe, x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # no host sync inside: it records
            replayed = moe(x)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, grouped)
    assert (grouped.float() - reference.float()).abs().max() <= 1e-2 * reference.float().abs().max()


def test_llada2_chat_template_and_stop_ids():
    from nanodllm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(LLADA2, "llada2_moe")
    text = tokenizer.chat_text([{"role": "user", "content": "hello"}])
    assert text == ("<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>hello<|role_end|>"
                    "<role>ASSISTANT</role>")
    assert (tokenizer.mask_id, tokenizer.eos_id, tokenizer.stop_ids) == (250, 251, (251,))
