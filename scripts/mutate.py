"""Mutation check: plant small bugs one at a time and see whether the tests catch each.

    python scripts/mutate.py                  every mutation, one pytest run each
    python scripts/mutate.py --only quest     the mutations whose name contains "quest"
    python scripts/mutate.py --jobs 2         two at a time, each worker in a copy of its own

A mutation is a plausible bug (an off-by-one, another layer's state, a flipped comparison, a missing
mask or scale, state not reset) as an exact snippet of a file, its replacement and the tests that
should notice. Each worker tests in its own copy of the repository (no .git, venv or caches): pytest
exit 1 is caught, 0 survived (add a test that fails on it), anything else an error. Every snippet
must occur exactly once and every named test exist, so the list fails loudly when the code moves;
the first mutation, always run, breaks the package's import to prove the tests read the copy.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanodllm.cli import help_text, positive_int, run_main  # noqa: E402

NOT_COPIED = (".git", ".venv", "venv", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", "build", "runs",
              ".whl", "*.whl", "_orig", "_golden")
PLUGIN = "mutate_no_shrink"  # written into each scratch copy, loaded with -p
PYTEST = ("-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN)
# The hypothesis profile the conftest loaded, derandomized (the same examples every run, so a result
# repeats) and without shrinking (a failing property test would spend minutes looking for a minimal
# example, which a caught mutation does not need) or an example database.
PLUGIN_SOURCE = '''from hypothesis import Phase, settings


def pytest_configure(config):
    settings.register_profile("mutate", settings(), phases=(Phase.explicit, Phase.generate), database=None,
                              derandomize=True)
    settings.load_profile("mutate")
'''


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest ids relative to tests/: "file.py" or "file.py::test"


def mutation(name, path, old, new, *tests) -> Mutation:
    return Mutation(name, path, old, new, tests)


SANITY = mutation("sanity-package-import-fails", "nanodllm/__init__.py",
                  "from .config import GenerationConfig, ModelConfig, preset",
                  "raise ImportError('mutate.py: the scratch copy is what the tests import')",
                  "test_top_k.py::test_bad_inputs_are_named")

ENGINES = [
    mutation("moe-sigmoid-router-logits-in-bf16", "nanodllm/mlp.py",
             "scores = F.linear(fp32_or_wider(x), fp32_or_wider(self.weight)).sigmoid()",
             "scores = fp32_or_wider(F.linear(x, self.weight)).sigmoid()",
             "test_moe.py::test_a_bfloat16_moe_routes_and_sums_as_its_float64_reference"),
    mutation("moe-experts-summed-in-bf16", "nanodllm/mlp.py",
             "return (outputs.to(weights.dtype) * weights[..., None]).sum(dim=1).to(dtype)",
             "return (outputs * weights[..., None].to(dtype)).sum(dim=1)",
             "test_moe.py::test_a_bfloat16_moe_routes_and_sums_as_its_float64_reference"),
    mutation("moe-softmax-router-in-bf16", "nanodllm/mlp.py",
             "scores = fp32_or_wider(F.linear(x, self.weight)).softmax(dim=-1)",
             "scores = F.linear(x, self.weight).softmax(dim=-1).to(torch.float32)",
             "test_moe.py::test_a_bfloat16_moe_routes_and_sums_as_its_float64_reference"),
    mutation("fused-moe-drops-the-shared-expert", "nanodllm/fused.py",
             "return y if self.shared_expert is None else y + self.shared_expert(flat)", "return y",
             "test_moe.py::test_the_fused_moe_model_gives_the_reference_logits_across_shapes"),
    mutation("router-float32-scores-rounded", "nanodllm/mlp.py",
             "        weights = scores.gather(-1, chosen)\n", "        weights = scores.gather(-1, chosen).half().float()\n",
             "test_moe.py::test_the_router_in_float32_chooses_as_in_float64_across_shapes"),
    mutation("fused-partial-rotary-on-the-whole-head-kernel", "nanodllm/fused.py",
             'if cfg.qk_norm != "projection" and projected.dim() == 3 and cfg.rotary_dim == cfg.head_dim:',
             'if cfg.qk_norm != "projection" and projected.dim() == 3:',
             "test_fused.py::test_engines_decode_the_same_tokens_on_the_fused_kernels"),
    mutation("fused-few-row-step-takes-experts", "nanodllm/fused.py",
             "if not few or not isinstance(self.mlp, FusedMLP):", "if not few:",
             "test_fused.py::test_engines_decode_the_same_tokens_on_the_fused_kernels"),
    mutation("block-threshold-only-for-dynamic", "nanodllm/block.py",
             'if threshold is not None and remasking != "low_confidence_static":',
             'if threshold is not None and remasking == "low_confidence_dynamic":',
             "test_block_engine.py::test_the_threshold_rule_unmasks_several_tokens_a_step_as_the_reference"),
    mutation("block-threshold-takes-too-few", "nanodllm/block.py",
             "transfer = torch.where(enough[:, None], confident, transfer)",
             "transfer = torch.where(confident.any(dim=-1, keepdim=True), confident, transfer)",
             "test_block_engine.py::test_the_threshold_rule_unmasks_several_tokens_a_step_as_the_reference"),
    mutation("block-masks-found-by-the-mask-id", "nanodllm/block.py",
             "            masked &= ~transfer", "            masked = current == mask_id",
             "test_block_engine.py::test_the_threshold_rule_unmasks_several_tokens_a_step_as_the_reference"),
    mutation("block-stop-scan-from-block-start", "nanodllm/block.py",
             "generated = x[row, int(lengths[row]) : int(starts[row]) + size]",
             "generated = x[row, int(starts[row]) : int(starts[row]) + size]",
             "test_block_engine.py::test_a_stop_token_in_the_prompts_last_block_is_not_a_stop"),
    mutation("block-decodes-prompt-tokens-equal-to-mask", "nanodllm/block.py",
             "masked = (columns >= lengths[:, None]) & active[:, None]",
             "masked = (current == mask_id) & active[:, None]",
             "test_moe.py::test_a_prompt_token_equal_to_the_mask_id_is_never_decoded"),
    mutation("block-sequential-takes-one-too-few", "nanodllm/block.py",
             "return masked & (order <= count[:, None])",
             "return masked & (order < count[:, None])",
             "test_block_engine.py::test_tokens_equal_cache_free_recompute"),
    mutation("masked-confidence-of-decoded-positions", "nanodllm/masked.py",
             'confidence = torch.where(block_masked, x0_conf, float("-inf"))',
             "confidence = x0_conf",
             "test_masked_engine.py::test_matches_reference_loop"),
    mutation("masked-cfg-scale-off-by-one", "nanodllm/masked.py",
             "return uncond + (cfg_scale + 1) * (cond - uncond)",
             "return uncond + cfg_scale * (cond - uncond)",
             "test_masked_engine.py::test_matches_reference_with_cfg"),
    mutation("masked-gumbel-noise-ignores-temperature", "nanodllm/masked.py",
             "return logits.exp() / (-torch.log(noise)) ** temperature",
             "return logits.exp() / (-torch.log(noise))",
             "test_masked_engine.py::test_gumbel_noise_samples_the_softmax_at_the_temperature"),
    mutation("masked-left-padded-positions-not-shifted", "nanodllm/decoding.py",
             "(columns - pads).clamp(min=0), lengths, prompt_width,",
             "columns.expand(len(prompts), -1), lengths, prompt_width,",
             "test_masked_engine.py::test_a_block_causal_ragged_batch_equals_its_rows_alone"),
    mutation("decoding-schedule-remainder-off-by-one", "nanodllm/decoding.py",
             "return base + (torch.arange(steps, device=total.device)[None, :] < remainder).long()",
             "return base + (torch.arange(steps, device=total.device)[None, :] <= remainder).long()",
             "test_masked_engine.py::test_transfer_schedule_is_split_evenly"),
    mutation("cache-values-written-from-keys", "nanodllm/cache.py",
             "self.values[layer][rows, slots] = v.transpose(1, 2)[keep]",
             "self.values[layer][rows, slots] = k.transpose(1, 2)[keep]",
             "test_cache_and_hooks.py::test_ragged_write_view_and_attend_equal_per_row_attention"),
    mutation("cache-host-lengths-stale-after-advance", "nanodllm/cache.py",
             "        self.lengths += counts\n        self.host_lengths = self.lengths.tolist()",
             "        self.lengths += counts",
             "test_cache_and_hooks.py::test_advance_makes_the_written_block_part_of_the_cache"),
    mutation("attention-block-causal-hides-own-block", "nanodllm/attention.py",
             "return (k_pos[:, None, None, :] // block_size) <= (q_pos[:, None, :, None] // block_size)",
             "return (k_pos[:, None, None, :] // block_size) < (q_pos[:, None, :, None] // block_size)",
             "test_block_engine.py::test_mask_first_token_of_block_sees_its_last_and_nothing_later"),
    mutation("attention-reference-forgets-scale", "nanodllm/attention.py",
             "scores = (qg @ k.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)  # [b, kv, group*q_len, k_len]",
             "scores = qg @ k.transpose(-1, -2)  # [b, kv, group*q_len, k_len]",
             "test_kernel_wiring.py::test_attention_routes_and_equals_reference"),
    mutation("attention-cache-padding-off-by-one", "nanodllm/attention.py",
             "mask = key_padding_mask(slots[None, :] < lengths[:, None])",
             "mask = key_padding_mask(slots[None, :] <= lengths[:, None])",
             "test_cache_and_hooks.py::test_ragged_write_view_and_attend_equal_per_row_attention"),
    mutation("model-rope-rotates-the-wrong-way", "nanodllm/model.py",
             "rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)",
             "rotated = torch.cat([x32[..., half:], -x32[..., :half]], dim=-1)",
             "test_parity.py::test_logits_match_transformers"),
    mutation("model-mlp-norm-reads-the-layer-input", "nanodllm/model.py",
             "return h + self.mlp(self.mlp_norm(h))",
             "return h + self.mlp(self.mlp_norm(x))",
             "test_parity.py::test_logits_match_transformers"),
    mutation("model-logit-shift-unshifted", "nanodllm/model.py",
             "source = (torch.arange(start, stop, device=hidden.device) - 1).clamp(min=0)",
             "source = torch.arange(start, stop, device=hidden.device)",
             "test_config.py::test_logit_shift_moves_logits_one_position_right"),
    mutation("gemma-temperature-one-step-late", "nanodllm/gemma_loop.py",
             "(torch.tensor(left, dtype=torch.int32) / steps)", "(torch.tensor(left - 1, dtype=torch.int32) / steps)",
             "test_gemma_loop.py::test_each_step_of_the_sampler_matches_transformers"),
    mutation("gemma-renoise-drawn-before-the-sample", "nanodllm/gemma_loop.py",
             "                drawn = torch.multinomial(",
             "                early_noise = noise()\n                drawn = torch.multinomial(",
             "test_gemma_loop.py::test_generation_matches_transformers_token_for_token"),
    mutation("gemma-stop-history-keeps-the-oldest", "nanodllm/gemma_loop.py",
             "torch.cat([history, argmax[None]])[1:]", "torch.cat([history, argmax[None]])[:-1]",
             "test_gemma_loop.py::test_the_stop_rule_matches_transformers"),
    mutation("gemma-ring-keeps-a-whole-window", "nanodllm/gemma.py",
             "self.ring, self.length = g.sliding_window - 1, 0", "self.ring, self.length = g.sliding_window, 0",
             "test_gemma_loop.py::test_generation_matches_transformers_token_for_token"),
    mutation("gemma-grouped-experts-exact-gelu", "nanodllm/gemma.py",
             "y = GROUPED_MM(F.gelu(gate, approximate=\"tanh\") * up, self.down_proj.mT, offs=ends)",
             "y = GROUPED_MM(F.gelu(gate) * up, self.down_proj.mT, offs=ends)",
             "test_diffusion_gemma.py::test_the_grouped_experts_equal_the_per_expert_loop"),
    mutation("gemma-full-layers-keep-the-pads", "nanodllm/gemma.py",
             "self.full.write(layer, k.gather(2, order), v.gather(2, order), valid.sum(dim=1))",
             "self.full.write(layer, k, v, valid.sum(dim=1))",
             "test_gemma_loop.py::test_generation_matches_transformers_token_for_token"),
    mutation("gemma-methods-read-the-default-scale", "nanodllm/gemma.py",
             "held=full_layers, scale=1.0)", "held=full_layers)",
             "test_contract.py::test_full_budget_equals_dense"),
    mutation("gemma-flash-reads-the-default-scale", "nanodllm/gemma.py",
             "flash_attention(q, k, v, k_valid=key_valid, scale=1.0)", "flash_attention(q, k, v, k_valid=key_valid)",
             "test_diffusion_gemma.py::test_the_denoisers_attention_on_the_kernel_equals_attend"),
    mutation("gemma-self-conditioning-dropped", "nanodllm/gemma_loop.py",
             "self_conditioning = z.to(model.embed_tokens.weight.dtype)", "self_conditioning = None",
             "test_gemma_loop.py::test_the_deterministic_mode_equals_a_plain_argmax_loop"),
    mutation("gemma-finished-rows-encode-their-tokens", "nanodllm/gemma_loop.py",
             "padded = canvas.masked_fill(after_stop | finished[:, None], pad_id)",
             "padded = canvas.masked_fill(finished[:, None], pad_id)",
             "test_gemma_loop.py::test_generation_matches_transformers_token_for_token"),
]

METHODS = [
    mutation("cache-ragged-read-as-uniform", "nanodllm/cache.py",
             "ragged=not self.uniform,", "ragged=False,",
             "test_cache_and_hooks.py::test_ragged_write_view_and_attend_equal_per_row_attention"),
    mutation("common-flat-rows-batch-offset", "nanodllm/methods/common.py",
             "rows + torch.arange(0, batch * t, t, device=rows.device)[:, None]",
             "rows + torch.arange(batch, device=rows.device)[:, None]",
             "test_dllm_cache.py::test_row_takes_equal_the_gather"),
    mutation("common-attention-mass-sums-the-group", "nanodllm/methods/common.py",
             "mass[:, h] = (probs * weight).sum(dim=2).mean(dim=1)",
             "mass[:, h] = (probs * weight).sum(dim=2).sum(dim=1)",
             "test_maskkv.py::test_attention_mass_is_the_summed_softmax"),
    mutation("mage-sparse-steps-read-another-layers-selection", "nanodllm/methods/mage.py",
             "indices, counts = self.chosen[layer]",
             "indices, counts = self.chosen[self.exact_layers]",
             "test_mage.py::test_each_layer_selects_its_own_top_k_and_attends_to_it"),
    mutation("mage-exact-layers-off-by-one", "nanodllm/methods/mage.py",
             'stage = self.stage(ctx) if layer >= self.exact_layers else "exact"',
             'stage = self.stage(ctx) if layer > self.exact_layers else "exact"',
             "test_mage.py::test_exact_layers_stay_exact"),
    mutation("mage-captures-at-the-second-step", "nanodllm/methods/mage.py",
             "        return 0", "        return 1",
             "test_mage.py::test_tiny_budget_differs"),
    mutation("sparsed-capture-step-off-by-one", "nanodllm/methods/sparsed.py",
             "return max(1, round(self.exact_fraction * ctx.steps_per_block)) - 1",
             "return max(1, round(self.exact_fraction * ctx.steps_per_block))",
             "test_sparsed.py::test_sparsed_captures_after_a_fifth_of_the_steps"),
    mutation("quest-reads-another-layers-page-bounds", "nanodllm/methods/quest.py",
             "bounds = self.bounds[layer]\n", "bounds = self.bounds[min(self.bounds)]\n",
             "test_quest.py::test_quest_pages_each_layer_from_its_own_bounds_and_attends_to_them"),
    mutation("quest-page-bound-swaps-min-and-max", "nanodllm/methods/quest.py",
             "return (high @ positive[..., None] + low @ negative[..., None]).squeeze(-1).float()",
             "return (low @ positive[..., None] + high @ negative[..., None]).squeeze(-1).float()",
             "test_quest.py::test_page_score_is_quests_bound_on_the_block_mean_of_each_query_best_key"),
    mutation("quest-bounds-kept-across-generations", "nanodllm/methods/quest.py",
             "        if ctx.block == 0:  # a new generation: a new cache, no pages chosen yet\n"
             "            self.bounds, self.pages = {}, {}\n", "",
             "test_quest.py::test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does"),
    mutation("fast-dllm-dual-cache-kept-from-the-previous-block", "nanodllm/methods/fast_dllm.py",
             "    def begin_block(self, ctx: StepContext):\n        self.kept = []",
             "    def begin_block(self, ctx: StepContext):\n        pass",
             "test_fast_dllm.py::test_a_new_block_drops_the_last_blocks_cache"),
    mutation("fast-dllm-fed-values-not-written", "nanodllm/methods/fast_dllm.py",
             "        kept.values[:, :, -kept.room :].copy_(v)\n", "",
             "test_fast_dllm.py::test_a_cached_step_on_an_unchanged_canvas_equals_the_full_forward"),
    mutation("fast-dllm-refresh-ignored", "nanodllm/methods/fast_dllm.py",
             "return since > 0 and not (self.refresh and since % self.refresh == 0)",
             "return since > 0",
             "test_fast_dllm.py::test_a_full_forward_every_step_equals_dense"),
    mutation("fast-dllm-refresh-out-of-phase", "nanodllm/methods/fast_dllm.py",
             "not (self.refresh and since % self.refresh == 0)",
             "not (self.refresh and (since + 1) % self.refresh == 0)",
             "test_fast_dllm.py::test_fast_dllm_matches_its_reference"),
    mutation("fast-dllm-built-a-step-late", "nanodllm/methods/fast_dllm.py",
             "return ctx.step >= self.delay and not self.cached(ctx)",
             "return ctx.step > self.delay and not self.cached(ctx)",
             "test_fast_dllm.py::test_fast_dllm_matches_its_reference"),
    mutation("fast-dllm-kept-padding-visible", "nanodllm/methods/fast_dllm.py",
             "mask = None if all_valid else valid[:, None, None, :]", "mask = None",
             "test_fast_dllm.py::test_the_dual_cache_equals_its_plain_reference_in_every_block"),
    mutation("sparse-dllm-padding-inherits-pooled-scores", "nanodllm/methods/sparse_dllm.py",
             'return pooled.view(batch, heads, n).masked_fill(padding, float("-inf"))',
             "return pooled.view(batch, heads, n)",
             "test_sparse_dllm.py::test_pivotal_tokens_pool_neighbours_and_skip_padding"),
    mutation("sparse-dllm-mean-query-of-the-whole-canvas", "nanodllm/methods/sparse_dllm.py",
             "q_mean = q[:, :, ctx.logits_start : ctx.logits_stop].mean(dim=2)", "q_mean = q.mean(dim=2)",
             "test_sparse_dllm.py::test_each_layer_keeps_the_keys_the_blocks_mean_query_scores_highest"),
    mutation("dllm-cache-response-refresh-out-of-phase", "nanodllm/methods/dllm_cache.py",
             "if ctx.t % self.response_interval == 0:",
             "if (ctx.t + 1) % self.response_interval == 0:",
             "test_dllm_cache.py::test_dllm_cache_refreshes_on_its_schedule_and_a_full_refresh_is_exact"),
    mutation("dllm-cache-eviction-kept-across-generations", "nanodllm/methods/dllm_cache.py",
             "            self.kept = []\n", "            pass\n",
             "test_maskkv.py::test_a_method_reused_for_other_prompts_decodes_what_a_fresh_one_does"),
    mutation("dllm-cache-drifted-keys-not-refreshed", "nanodllm/methods/dllm_cache.py",
             "        put_heads(k_cached, rows[:, None], k_rows)\n", "",
             "test_dllm_cache.py::test_all_rows_drifting_equals_a_response_refresh"),
    mutation("dllm-cache-default-intervals-swapped", "nanodllm/methods/dllm_cache.py",
             "prompt_interval: int = 50, response_interval: int = 5,",
             "prompt_interval: int = 5, response_interval: int = 50,",
             "test_maskkv.py::test_a_row_whose_prompt_fits_the_budget_equals_dllm_cache_in_any_batch"),
    mutation("eviction-keep-top-counts-a-pad-column", "nanodllm/methods/common.py",
             "real = columns[None, :] >= (width - prompt_lengths)[:, None]",
             "real = columns[None, :] > (width - prompt_lengths)[:, None]",
             "test_maskkv.py::test_keep_top_respects_counts_padding_and_order"),
    mutation("maskkv-evicts-a-prompt-exactly-its-budget", "nanodllm/methods/maskkv.py",
             "ctx.prompt_lengths[:, None] <= self.budget", "ctx.prompt_lengths[:, None] < self.budget",
             "test_maskkv.py::test_a_row_whose_prompt_fits_the_budget_equals_dllm_cache_in_any_batch"),
    mutation("maskkv-boundary-layers-off-by-one", "nanodllm/methods/maskkv.py",
             "set(range(num_layers - boundary_layers, num_layers))",
             "set(range(num_layers - boundary_layers - 1, num_layers))",
             "test_maskkv.py::test_layer_budgets_follow_algorithm_2"),
    mutation("maskkv-votes-attend-to-padding", "nanodllm/methods/maskkv.py",
             "votes = attention_mass(q_r, cache.keys, cache.key_mask, is_mask, cache.prompt_slots)",
             "votes = attention_mass(q_r, cache.keys, None, is_mask, cache.prompt_slots)",
             "test_maskkv.py::test_a_row_decodes_the_same_alone_and_next_to_another_prompt"),
    mutation("snapkv-window-not-forced-into-the-kept-set", "nanodllm/methods/snapkv.py",
             "return torch.where(rank[:, None, :] >= 0, window_scores[:, None, :], scores)", "return scores",
             "test_snapkv.py::test_snapkv_always_keeps_its_observation_window"),
    mutation("snapkv-pools-over-padding", "nanodllm/methods/snapkv.py",
             "scores = pool_real(scores, real[:, None, :], self.pool)",
             "scores = pool_real(scores, torch.ones_like(real)[:, None, :], self.pool)",
             "test_snapkv.py::test_snapkv_votes_for_a_padded_row_as_for_the_row_alone"),
    mutation("momo-padded-sampled-rows-vote", "nanodllm/methods/momo.py",
             "scores = scores.masked_fill(~real[:, None, sampled, None], float(\"-inf\"))", "scores = scores",
             "test_momo_reference.py::test_attention_matches_the_reference_row_by_row"),
    mutation("momo-grid-from-the-padded-canvas-column-0", "nanodllm/methods/momo.py",
             "    if not bool(shift.any()):", "    if True:",
             "test_momo_reference.py::test_attention_matches_the_reference_row_by_row",
             "test_contract.py::test_a_ragged_batch_equals_its_rows_run_alone"),
    mutation("qsa-padded-rows-choose-blocks", "kernels/qsa_attention.py",
             "    return (out, lse, *unchosen_padding(top_index, top_score, q_valid, gamma))",
             "    return out, lse, top_index, top_score",
             "test_momo_reference.py::test_the_kernel_path_matches_the_reference_row_by_row"),
    mutation("momo-delta-correction-sign", "nanodllm/methods/momo.py",
             "return o_sparse + delta[:, :, torch.arange(n, device=o_sparse.device) // gamma]",
             "return o_sparse - delta[:, :, torch.arange(n, device=o_sparse.device) // gamma]",
             "test_momo.py::test_delta_correction_gives_the_sampled_rows_their_exact_output_and_shifts_their_window"),
    mutation("momo-diagonal-range-off-by-one", "nanodllm/methods/momo.py",
             "return starts // beta, (torch.clamp(starts + chi, max=n) - 1) // beta",
             "return starts // beta, torch.clamp(starts + chi, max=n) // beta",
             "test_momo.py::test_diagonal_blocks_are_the_key_blocks_under_each_query_blocks_rows"),
    mutation("momo-trim-ranks-by-sum-not-mean", "nanodllm/methods/momo.py",
             "total if summed else total / times.clamp(min=1)", "total",
             "test_momo.py::test_union_and_trim_ranks_by_mean_score"),
    mutation("dyllm-salient-cosine-comparison-flipped", "nanodllm/methods/dyllm.py",
             "return list_rows((cos < self.threshold) & fed.valid)",
             "return list_rows((cos > self.threshold) & fed.valid)",
             "test_dyllm.py::test_every_row_salient_equals_dense"),
    mutation("dyllm-response-only-columns-not-offset", "nanodllm/methods/dyllm.py",
             "columns = selected.rows + fed.offset if fed.offset else selected.rows", "columns = selected.rows",
             "test_dyllm.py::test_sparse_steps_match_the_plain_torch_reference"),
    mutation("dyllm-small-steps-listed-at-half", "nanodllm/methods/dyllm.py",
             "return 1.0 if ctx.tokens.shape[0]", "return 0.5 if ctx.tokens.shape[0]",
             "test_dyllm.py::test_small_steps_list_every_row_and_decode_what_eager_steps_decode"),
    mutation("dyllm-one-full-step-too-many", "nanodllm/methods/dyllm.py",
             "return ctx.t < self.full_steps", "return ctx.t <= self.full_steps",
             "test_dyllm.py::test_sparse_steps_match_the_plain_torch_reference"),
]

KERNELS = [
    mutation("top-k-negative-scores-misordered", "kernels/top_k.py",
             "ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)", "ordered = bits",
             "test_top_k.py::test_the_k_best_of_negative_scores_are_those_nearest_zero",
             "test_top_k.py::test_top_k_positions_match_a_stable_sort"),
    mutation("top-k-whole-row-takes-one-tie-too-few", "kernels/top_k.py",
             "(equal & (tl.cumsum(equal.to(tl.int32), 0) <= still))",
             "(equal & (tl.cumsum(equal.to(tl.int32), 0) < still))",
             "test_top_k.py::test_top_k_positions_match_a_stable_sort"),
    mutation("flash-attention-forgets-the-rescale", "kernels/flash_attention.py",
             "acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])", "acc = tl.dot(p.to(v.dtype), v, acc)",
             "test_flash_attention.py::test_matches_reference"),
    mutation("flash-attention-queries-not-at-the-end", "kernels/flash_attention.py",
             "position_shift = n_k - n_q", "position_shift = 0",
             "test_flash_attention.py::test_matches_reference"),
    mutation("decode-attention-drops-a-rows-last-key", "kernels/decode_attention.py",
             "end = tl.minimum(start + keys_per_split, length)", "end = tl.minimum(start + keys_per_split, length - 1)",
             "test_decode_kernels.py::test_decode_attention_matches_reference"),
    mutation("decode-attention-merge-in-natural-base", "kernels/decode_attention.py",
             "weight = tl.exp2(lse - m[:, None])", "weight = tl.exp(lse - m[:, None])",
             "test_decode_kernels.py::test_decode_attention_matches_reference"),
    mutation("sparse-decode-page-tokens-all-the-first", "kernels/sparse_decode_attention.py",
             "entries.to(tl.int64) * INDEX_BLOCK + column % INDEX_BLOCK,",
             "entries.to(tl.int64) * INDEX_BLOCK,",
             "test_decode_kernels.py::test_sparse_decode_attention_matches_reference"),
    mutation("key-scores-garbage-past-the-prefix", "kernels/key_scores.py",
             "tl.where(key_valid, prob_sum * score_weight, 0.0)", "prob_sum * score_weight",
             "test_decode_kernels.py::test_key_scores_match_reference"),
    mutation("key-scores-prefix-lse-merges-the-block-slice", "kernels/key_scores.py",
             "mask=row_valid[:, None] & (slices < prefix_slices)[None, :],",
             "mask=row_valid[:, None] & (slices <= prefix_slices)[None, :],",
             "test_decode_kernels.py::test_block_apart_keeps_the_attention_and_gives_the_prefix_lse"),
    mutation("approx-attention-weight-not-clamped", "kernels/approx_attention.py",
             "p = tl.exp2(tl.minimum(scores - lse2[:, None], 0.0))", "p = tl.exp2(scores - lse2[:, None])",
             "test_dyllm.py::test_kernel_matches_reference"),
    mutation("rope-second-half-sign", "kernels/rope.py",
             "tl.store(out1_ptrs + half, (x2 * cos2 + x1 * sin2).to(out_dtype), mask=mask)",
             "tl.store(out1_ptrs + half, (x2 * cos2 - x1 * sin2).to(out_dtype), mask=mask)",
             "test_norm_rope_kernels.py::test_rope_matches_reference"),
    mutation("rope-qk-norm-mean-over-half-the-head", "kernels/rope.py",
             "/ (2 * half) + eps)", "/ half + eps)",
             "test_norm_rope_kernels.py::test_rope_qk_matches_norm_then_rope"),
    mutation("rmsnorm-sum-not-written-back", "kernels/rmsnorm.py",
             "        tl.store(x_ptr + x_rows[:, None] + cols[None, :], summed, mask=mask)\n", "",
             "test_norm_rope_kernels.py::test_rms_norm_with_add_writes_the_sum_and_normalises_it"),
    mutation("norm-linear-up-half-not-normalised", "kernels/norm_linear.py",
             "    up_acc = up_acc * rstd[None, :]\n", "",
             "test_norm_linear.py::test_norm_linear_comes_as_close_as_the_unfused_path"),
    mutation("keep-top-ties-follow-the-largest-count", "nanodllm/methods/common.py",
             "top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :kmax]",
             "top = scores.topk(kmax, dim=-1).indices",
             "test_maskkv.py::test_keep_top_breaks_ties_to_the_lower_position_whatever_the_other_heads_keep"),
    mutation("expert-linear-one-tile-per-expert", "kernels/expert_linear.py",
             "for start in range(first, last, BLOCK_M):", "for start in range(first, first + 1, BLOCK_M):",
             "test_expert_linear.py::test_expert_linear_comes_as_close_as_one_linear_per_expert"),
    mutation("expert-linear-second-expert-from-row-0", "kernels/expert_linear.py",
             "mask=expert > 0, other=0)", "mask=expert > 1, other=0)",
             "test_expert_linear.py::test_expert_linear_comes_as_close_as_one_linear_per_expert"),
    mutation("fused-moe-group-ends-one-expert-early", "nanodllm/fused.py",
             "torch.arange(1, len(held) + 1, device=flat.device)", "torch.arange(len(held), device=flat.device)",
             "test_moe.py::test_grouped_experts_equal_the_per_expert_loop"),
    mutation("silu-mul-ignores-the-row-stride", "kernels/silu_mul.py",
             "gate_ptrs = gate_up_ptr + row * stride_row + col", "gate_ptrs = gate_up_ptr + row * width + col",
             "test_norm_rope_kernels.py::test_silu_mul_matches_reference"),
    mutation("cache-write-every-row-at-row-0s-length", "kernels/cache_write.py",
             "slots = tl.load(lengths_ptr + batch).to(tl.int64) + tokens",
             "slots = tl.load(lengths_ptr).to(tl.int64) + tokens",
             "test_cache_and_hooks.py::test_cache_write_kernel_writes_exactly_the_block_slots"),
    mutation("row-scatter-delta-on-rows-not-written", "kernels/row_scatter.py",
             "delta = tl.where(write, src.to(tl.float32) - old.to(tl.float32), 0.0)",
             "delta = tl.where(inside, src.to(tl.float32) - old.to(tl.float32), 0.0)",
             "test_dyllm.py::test_row_scatter_matches_reference"),
    mutation("salient-rows-own-count-rounded-down", "kernels/salient_rows.py",
             "own = tl.ceil(", "own = tl.floor(",
             "test_salient_rows.py::test_salient_rows_match_the_reference"),
    mutation("value-drift-ties-to-the-higher-row", "kernels/value_drift.py",
             "(others[None, :] < rows[:, None])", "(others[None, :] > rows[:, None])",
             "test_value_drift.py::test_most_drifted_matches_stable_sort"),
    mutation("decode-inputs-cache-head-dim-unchecked", "kernels/decode_inputs.py",
             "if cache_batch != batch or cache_dim != head_dim:", "if cache_batch != batch:",
             "test_decode_kernels.py::test_a_cache_of_another_head_dim_is_refused"),
    mutation("block-sparse-query-block-of-the-tile-index", "kernels/block_sparse_attention.py",
             "query_block = (m_tile * BLOCK_M) // chi", "query_block = m_tile // chi",
             "test_momo_kernels.py::test_block_sparse_matches_the_reference"),
    mutation("qsa-sampled-rows-not-strided", "kernels/qsa_attention.py",
             "positions = rows * gamma", "positions = rows",
             "test_momo_kernels.py::test_qsa_matches_the_reference"),
    mutation("qsa-estimate-blocks-left-off-by-one", "kernels/qsa_estimate.py",
             "p = 1 - free.double() / (last - count + visible.double()).clamp(min=1)",
             "p = 1 - free.double() / (last - count).clamp(min=1)",
             "test_momo.py::test_estimated_top_k_visits_each_row_in_golden_strides"),
]

PARALLEL = [
    mutation("parallel-row-linear-without-all-reduce", "nanodllm/parallel.py",
             "return self.group.all_reduce(F.linear(x, self.weight))", "return F.linear(x, self.weight)",
             "test_parallel.py::test_logits_equal_one_process"),
    mutation("parallel-rank-reads-the-next-ranks-part", "nanodllm/parallel.py",
             "return Part(name, dim, group.rank * length, length)",
             "return Part(name, dim, (group.rank + 1) % group.world * length, length)",
             "test_parallel.py::test_the_ranks_shares_of_a_checkpoint_make_the_whole_and_are_all_they_read"),
    mutation("parallel-fused-qkv-offsets-in-the-ranks-rows", "nanodllm/loader.py",
             "stored, firsts = handle.get_slice(source), itertools.accumulate([0, *rows])",
             "stored, firsts = handle.get_slice(source), itertools.accumulate([0, *(n // group.world for n in rows)])",
             "test_parallel.py::test_the_ranks_shares_of_a_checkpoint_make_the_whole_and_are_all_they_read"),
    mutation("parallel-expert-offset-off-by-one", "nanodllm/parallel.py",
             "return range(group.rank * count, (group.rank + 1) * count)",
             "return range(group.rank * (count - 1), group.rank * (count - 1) + count)",
             "test_parallel.py::test_each_ranks_share_of_random_weights_is_the_one_process_draw_sliced",
             "test_parallel.py::test_logits_equal_one_process"),
    mutation("parallel-embedding-keeps-ids-outside-its-rows", "nanodllm/parallel.py",
             "return self.group.all_reduce(rows.masked_fill_(~inside[..., None], 0.0))",
             "return self.group.all_reduce(rows)",
             "test_parallel.py::test_logits_equal_one_process"),
    mutation("parallel-head-gathers-ranks-in-reverse", "nanodllm/parallel.py",
             "return torch.cat(parts, dim=dim)", "return torch.cat(parts[::-1], dim=dim)",
             "test_parallel.py::test_logits_equal_one_process"),
    mutation("parallel-fuse-drops-the-row-parallel-o-proj", "nanodllm/fused.py",
             "fused_layer.self_attn.o_proj = layer.self_attn.o_proj", "pass",
             "test_parallel.py::test_logits_equal_one_process"),
    mutation("parallel-block-cache-of-every-kv-head", "nanodllm/block.py",
             "layer_cfg = model.layers[0].cfg", "layer_cfg = model.cfg",
             "test_parallel.py::test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads"),
    mutation("parallel-grouped-experts-of-another-rank-kept", "nanodllm/fused.py",
             "        if len(held) < count:  # rows past the last group",
             "        if False:  # rows past the last group",
             "test_parallel.py::test_the_ranks_grouped_experts_sum_to_the_whole_layer"),
    mutation("parallel-grouped-experts-numbered-from-zero", "nanodllm/fused.py",
             "experts = (chosen.flatten() - held.start) % count", "experts = chosen.flatten() % count",
             "test_parallel.py::test_the_ranks_grouped_experts_sum_to_the_whole_layer"),
    mutation("parallel-drift-of-this-ranks-heads-only", "nanodllm/methods/dllm_cache.py",
             "group.all_gather(values, dim=1), group.all_gather(cached_values, dim=1)", "values, cached_values.clone()",
             "test_parallel.py::test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads"),
    mutation("parallel-greedy-may-pick-the-mask", "nanodllm/decoding.py",
             "    if first <= mask_id < first + logits.shape[-1]:", "    if False:",
             "test_parallel.py::test_greedy_decisions_from_the_ranks_columns_are_the_whole_rows"),
    mutation("parallel-greedy-probability-of-this-ranks-columns", "nanodllm/decoding.py",
             "(best - ranks[:, 2].logsumexp(dim=0)).exp()", "(best - local[2]).exp()",
             "test_parallel.py::test_greedy_decisions_from_the_ranks_columns_are_the_whole_rows"),
    mutation("parallel-greedy-last-rank-wins-a-tie", "nanodllm/decoding.py",
             "winner = ranks[:, 0].argmax(dim=0, keepdim=True)",
             "winner = len(ranks) - 1 - ranks[:, 0].flip(0).argmax(dim=0, keepdim=True)",
             "test_parallel.py::test_greedy_decisions_from_the_ranks_columns_are_the_whole_rows"),
    mutation("parallel-maskkv-budgets-from-this-ranks-heads-only", "nanodllm/methods/maskkv.py",
             "head_budgets(votes, self.budgets[i], self.alpha, self.group)",
             "head_budgets(votes, self.budgets[i], self.alpha)",
             "test_parallel.py::test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads"),
    mutation("parallel-dyllm-salient-from-this-ranks-heads-only", "nanodllm/methods/dyllm.py",
             "dots = self.group.all_gather(dots, dim=1).sum(dim=1)", "dots = dots.sum(dim=1)",
             "test_parallel.py::test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads"),
    mutation("parallel-sparse-dllm-scores-of-this-ranks-heads-only", "nanodllm/methods/sparse_dllm.py",
             "group.all_gather(scores, dim=1).mean(dim=1, keepdim=True)", "scores.mean(dim=1, keepdim=True)",
             "test_parallel.py::test_each_loop_decodes_one_process_tokens_with_this_ranks_kv_heads"),
]

CONFIGS = [
    mutation("config-dense-layers-off-by-one", "nanodllm/config.py",
             "i in only_mlp or (i + 1) % step", "i in only_mlp or i % step",
             "test_config.py::test_qwen3_moe_layers_are_dense_by_decoder_sparse_step_and_mlp_only_layers"),
    mutation("config-norm-topk-prob-always-on", "nanodllm/config.py",
             'normalize=bool(raw.get("norm_topk_prob", False)),', "normalize=True,",
             "test_config.py::test_norm_topk_prob_decides_whether_the_chosen_weights_sum_to_one"),
    mutation("config-ntk-base-over-the-whole-head", "nanodllm/config.py",
             "        d = self.rotary_dim\n", "        d = self.head_dim\n",
             "test_config.py::test_the_ntk_stretched_base_follows_the_rotated_width"),
    mutation("config-one-expert-groups-accepted", "nanodllm/config.py",
             "if self.groups > 1 and per_group < 2:", "if self.groups > 1 and per_group < 1:",
             "test_config.py::test_llada2_routing_fields_are_refused_exactly_past_their_bounds"),
    mutation("loader-mask-id-equal-to-the-vocabulary", "nanodllm/loader.py",
             "not 0 <= cfg.mask_token_id < cfg.vocab_size:", "not 0 <= cfg.mask_token_id <= cfg.vocab_size:",
             "test_loader.py::test_the_mask_id_is_refused_exactly_outside_the_vocabulary"),
    mutation("eval-agreement-over-the-shorter-run", "nanodllm/eval.py",
             "total += max(len(x), len(y))", "total += min(len(x), len(y))",
             "test_eval.py::test_agreement_counts_every_position_either_run_generated"),
    mutation("journal-resume-drops-finished-runs", "nanodllm/eval.py",
             'kept = [json.dumps({"settings": settings})] + [json.dumps(record) for record in self.done.values()]',
             'kept = [json.dumps({"settings": settings})]',
             "test_cli.py::test_an_interrupted_eval_resumes_from_its_journal"),
    mutation("memory-estimate-forgets-the-cache-copy", "nanodllm/cli.py",
             "kv = 2 * 2 * cfg.num_layers", "kv = 2 * cfg.num_layers",
             "test_cli.py::test_the_memory_estimate_is_its_parts_counted_by_hand"),
    mutation("memory-estimate-scores-not-split", "nanodllm/cli.py",
             "tokens * tokens * 4 // world", "tokens * tokens * 4",
             "test_cli.py::test_the_memory_estimate_is_its_parts_counted_by_hand"),
    mutation("loader-duplicates-overwrite", "nanodllm/loader.py",
             "                duplicated.append(", "                (lambda *_: None)(",
             "test_loader.py::test_a_parameter_two_checkpoint_tensors_would_load_is_refused_naming_both"),
]

MUTATIONS = [SANITY, *ENGINES, *METHODS, *KERNELS, *PARALLEL, *CONFIGS]


def problems(mutations: list[Mutation], root: Path) -> list[str]:
    """What is wrong with the list against the files under root: snippets that do not occur exactly
    once, replacements that change nothing, tests that do not exist."""
    found = []
    names = [m.name for m in mutations]
    found += [f"{name}: the name is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for m in mutations:
        path = root / m.path
        count = path.read_text().count(m.old) if path.is_file() else -1
        if count != 1:
            found.append(f"{m.name}: the snippet occurs {count} times in {m.path}, not once"
                         if count >= 0 else f"{m.name}: no file {m.path}")
        if m.old == m.new:
            found.append(f"{m.name}: the replacement is the snippet itself")
        for test in m.tests:
            file, _, function = test.partition("::")
            test_path = root / "tests" / file
            if not test_path.is_file():
                found.append(f"{m.name}: no test file tests/{file}")
            elif function and not re.search(rf"^def {re.escape(function)}\(", test_path.read_text(), re.MULTILINE):
                found.append(f"{m.name}: no test {function} in tests/{file}")
    return found


def scratch_copy(into: Path) -> Path:
    """A copy of the repository without what the tests do not read, and the pytest plugin."""
    copy = into / ROOT.name
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    (copy / "nanodllm" / "kernels").symlink_to("../kernels")  # nanodllm.kernels: the copy's, not the installed one
    (copy / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    return copy


def environment(copy: Path) -> dict:
    """The copy first on the import path (the repository is installed editable into the venv), and no
    bytecode written, so a file put back within the same second is never read from a stale cache."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def imported_from(copy: Path) -> list[str]:
    """The packages a test process would import from outside the copy (none, or the results lie)."""
    probe = "import nanodllm.kernels; print(nanodllm.__file__); print(nanodllm.kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True,
                         text=True, check=True).stdout.split()
    return [path for path in out if not Path(path).resolve().is_relative_to(copy.resolve())]


def run_tests(copy: Path, m: Mutation, timeout: float) -> tuple[str, float]:
    """(result, seconds) of m's tests in the copy with m applied; the file is put back. A result is what
    pytest's exit status says of the mutation: caught, survived, error or timeout."""
    path = copy / m.path
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new, 1))
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", *PYTEST, *(f"tests/{test}" for test in m.tests)]
    try:
        done = subprocess.run(command, cwd=copy, env=environment(copy), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout)
        result = {0: "survived", 1: "caught"}.get(done.returncode, f"error ({done.returncode})")
    except subprocess.TimeoutExpired:
        result = "timeout"
    finally:
        path.write_text(original)
    return result, time.monotonic() - start


def run_all(mutations: list[Mutation], jobs: int, timeout: float) -> list[tuple[Mutation, str, float]]:
    """Every mutation's result, jobs at a time, each worker in a scratch copy of its own. The sanity
    mutation runs first, alone: if it survives nothing else is worth running (it is not among the results)."""
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        copies = [scratch_copy(Path(scratch) / str(worker)) for worker in range(max(1, min(jobs, len(mutations))))]
        if wrong := problems([SANITY, *mutations], copies[0]):
            sys.exit("the mutation list no longer fits the code:\n  " + "\n  ".join(wrong))
        if outside := imported_from(copies[0]):
            sys.exit(f"the tests would import {', '.join(outside)}, not the scratch copy")
        result, _ = run_tests(copies[0], SANITY, timeout)
        if result == "survived":
            sys.exit("the sanity mutation survived: the tests do not read the scratch copy")
        print(f"sanity: a package that cannot be imported fails the tests ({result}): they read the copy")
        free = list(copies)

        def one(m: Mutation):
            copy = free.pop()
            try:
                result, seconds = run_tests(copy, m, timeout)
            finally:
                free.append(copy)
            print(f"{result:<12} {seconds:6.1f}s  {m.name}", flush=True)
            return m, result, seconds

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            return list(pool.map(one, mutations))


def seconds(text: str) -> float:
    """argparse type: a time limit of at least a second (less times out before pytest has started)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (seconds), got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run the mutations whose name contains NAME (repeatable; the sanity check always runs)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="mutations tested at once (default 1)")
    parser.add_argument("--timeout", type=seconds, default=600, help="seconds a mutation's tests may take (default 600)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS[1:] if not args.only or any(part in m.name for part in args.only)]
    if not chosen:
        sys.exit(f"no mutation name contains {' or '.join(args.only)}")
    start = time.monotonic()
    results = run_all(chosen, args.jobs, args.timeout)
    kinds = ("caught", "survived", "error", "timeout")
    counts = {kind: sum(result.startswith(kind) for _, result, _ in results) for kind in kinds}
    print(f"\n{'result':<12} {'time':>7}  {'mutation':<52} file")
    print("\n".join(f"{result:<12} {secs:6.1f}s  {m.name:<52} {m.path}" for m, result, secs in results))
    print("\n" + ", ".join(f"{counts[kind]} {kind}" for kind in kinds)
          + f" of {len(results)} in {time.monotonic() - start:.0f}s")
    return int(any(result != "caught" for _, result, _ in results))


if __name__ == "__main__":
    sys.exit(run_main(main))
