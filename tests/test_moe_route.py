"""kernels/moe_route.py (a token's experts and their weights from its router logits) against the torch
form, nanodllm/mlp.py choose_experts, off a GPU in Triton's interpreter; and the routers that call it
(the fused model's for LLaDA2 and Qwen3-MoE, DiffusionGemma's) choosing on it as in torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanodllm.fused_mlp as fused_mlp_module
import nanodllm.gemma as gemma_module
from nanodllm.config import ModelConfig
from nanodllm.fused_mlp import FusedRouter
from nanodllm.gemma import GemmaRouter
from nanodllm.kernels.moe_route import moe_route
from nanodllm.mlp import choose_experts, within_best_groups
from tests.device import DEVICE
from tests.tiny_models import tiny_config

GEMMA = ModelConfig.from_dir("tests/fixtures/diffusion_gemma_tiny")
MARGIN = 1e-5  # preferences closer than this may be ordered either way by float32 rounding


@st.composite
def rules(draw) -> tuple[int, int, dict]:
    """(experts, k, the rule's keywords) over LLaDA2's, Qwen3-MoE's and DiffusionGemma's ranges."""
    experts = draw(st.sampled_from([8, 16, 60, 128, 256]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if experts % g == 0 and experts // g >= 2]))
    kept = draw(st.integers(1, groups))
    k = draw(st.integers(1, min(8, kept * experts // groups)))
    rule = dict(sigmoid=draw(st.booleans()), groups=groups, kept=kept, normalize=draw(st.booleans()),
                eps=draw(st.sampled_from([0.0, 1e-20])), scale=draw(st.sampled_from([1.0, 2.5])))
    return experts, k, rule


def clear_rows(logits: torch.Tensor, k: int, bias, rule: dict) -> torch.Tensor:
    """Rows whose kept groups and k-th choice are each MARGIN ahead of the next, in float64."""
    logits = logits.double()
    scores = logits.sigmoid() if rule["sigmoid"] else logits.softmax(dim=-1)
    preference = scores if bias is None else scores + bias.double()
    clear = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
    if rule["groups"] > 1:
        group_scores = preference.view(len(logits), rule["groups"], -1).topk(2, dim=-1).values.sum(-1)
        ranked = torch.cat([group_scores, torch.full_like(group_scores[:, :1], float("-inf"))], dim=-1)
        top = ranked.topk(rule["kept"] + 1, dim=-1).values
        clear &= top[:, -2] - top[:, -1] > MARGIN
        preference = within_best_groups(preference, rule["groups"], rule["kept"])
    ranked = torch.cat([preference, torch.full_like(preference[:, :1], float("-inf"))], dim=-1)
    top = ranked.topk(k + 1, dim=-1).values
    return clear & (top[:, -2] - top[:, -1] > MARGIN)


@settings(max_examples=40, deadline=None)
@given(case=rules(), rows=st.integers(1, 6), biased=st.booleans(), scaled=st.booleans(), seed=st.integers(0, 999))
def test_the_kernel_chooses_and_weighs_as_the_torch_form(case, rows, biased, scaled, seed):
    experts, k, rule = case
    generator = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, experts, generator=generator)).to(DEVICE)
    bias = (0.2 * torch.randn(experts, generator=generator)).to(DEVICE) if biased else None
    expert_scale = (0.5 + torch.rand(experts, generator=generator)).to(DEVICE) if scaled else None
    chosen, weights = moe_route(logits, k, bias=bias, expert_scale=expert_scale, **rule)
    expected, expected_weights = choose_experts(logits, k, bias=bias, expert_scale=expert_scale, **rule)
    assert chosen.shape == weights.shape == (rows, k) and chosen.dtype == torch.int64
    clear = clear_rows(logits, k, bias, rule)
    assert torch.equal(chosen[clear], expected[clear])
    torch.testing.assert_close(weights[clear], expected_weights[clear], rtol=2e-6, atol=1e-7)


def test_a_tie_goes_to_the_lowest_expert_and_group():
    logits = torch.zeros(2, 16, device=DEVICE)
    chosen, weights = moe_route(logits, 4, sigmoid=False)
    assert chosen.tolist() == [[0, 1, 2, 3]] * 2 and torch.equal(weights, torch.full_like(weights, 0.25))
    chosen, _ = moe_route(logits, 3, sigmoid=True, groups=4, kept=2)  # groups of 4: 0-3 and 4-7 kept
    assert chosen.tolist() == [[0, 1, 2]] * 2
    logits[:, 12:] = 1.0  # the last group now ranks first
    chosen, _ = moe_route(logits, 6, sigmoid=True, groups=4, kept=2)
    assert chosen.tolist() == [[12, 13, 14, 15, 0, 1]] * 2


@pytest.mark.parametrize("call, message", [
    (lambda x: moe_route(x.double(), 2, sigmoid=True), "float32"),
    (lambda x: moe_route(x.t(), 2, sigmoid=True), "float32, rows contiguous"),
    (lambda x: moe_route(x, 2, sigmoid=True, bias=torch.zeros(7, device=DEVICE)), "bias must be"),
    (lambda x: moe_route(x, 2, sigmoid=True, groups=3), "do not split into 3 groups"),
    (lambda x: moe_route(x, 2, sigmoid=True, groups=16), "groups of two or more"),
    (lambda x: moe_route(x, 5, sigmoid=True, groups=4, kept=1), "k = 5 experts cannot be chosen"),
])
def test_bad_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(3, 16, device=DEVICE))


def llada2_router() -> FusedRouter:
    cfg = tiny_config("llada2_moe", num_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    return FusedRouter(cfg.hidden_size, cfg.moe)


def sdar_moe_router() -> FusedRouter:
    cfg = tiny_config("sdar_moe", num_experts=16, norm_topk_prob=True)
    return FusedRouter(cfg.hidden_size, cfg.moe)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 999))
@pytest.mark.parametrize("build", [llada2_router, sdar_moe_router, lambda: GemmaRouter(GEMMA)],
                         ids=["llada2", "sdar_moe", "diffusion_gemma"])
def test_the_routers_choose_on_the_kernel_as_in_torch(build, seed, kernels_on, monkeypatch):
    """float32 on the kernel (Triton's interpreter on a CPU) against the torch form (autograd on)."""
    generator = torch.Generator().manual_seed(seed)
    router = build().to(DEVICE)
    with torch.no_grad():
        for parameter in router.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 + (parameter.dim() == 1))
    x = torch.randn(24, router.weight.shape[1] if hasattr(router, "weight") else GEMMA.hidden_size,
                    generator=generator).to(DEVICE)
    calls = []
    for module in (fused_mlp_module, gemma_module):
        monkeypatch.setattr(module, "moe_route", lambda *a, **kw: calls.append(1) or moe_route(*a, **kw))
    with torch.no_grad():
        chosen, weights = router(x)
    expected, expected_weights = (t.detach() for t in router(x))  # autograd on: the torch form
    assert calls == [1]
    agree = (chosen == expected).all(dim=-1)
    assert agree.float().mean() >= 0.9  # the rest: float32 near-ties (the kernel test bounds them)
    torch.testing.assert_close(weights[agree], expected_weights[agree], rtol=2e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 16-bit matmul with float32 sums runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llada2s_logits_on_a_gpu_are_the_float32_matmul(dtype):
    """The fused router's one matmul of 16-bit x and weight into float32 against the reference's casts
    and float32 matmul: float32 rounding apart, nowhere near a 16-bit rounding."""
    router = llada2_router().to("cuda", dtype)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=torch.Generator("cuda").manual_seed(0))
        x = torch.randn(37, router.weight.shape[1], device="cuda").to(dtype)
        fused = router.logits(x.view(37, 1, -1))
    expected = x.float() @ router.weight.float().t()
    assert fused.dtype == torch.float32 and fused.shape == (37, 1, 16)
    torch.testing.assert_close(fused.view(37, 16), expected, rtol=1e-6, atol=1e-5)


def test_the_torch_form_is_the_routers_rule():
    """With DiffusionGemma's keywords, its router's rule bit for bit: softmax, top-k, renormalised, per-expert scale."""
    generator = torch.Generator().manual_seed(0)
    logits, scale = torch.randn(5, 32, generator=generator), torch.rand(32, generator=generator)
    chosen, weights = choose_experts(logits, 4, sigmoid=False, expert_scale=scale)
    top, expected = logits.softmax(dim=-1).topk(4, dim=-1)
    assert torch.equal(chosen, expected)
    assert torch.equal(weights, top / top.sum(dim=-1, keepdim=True) * scale[expected])
