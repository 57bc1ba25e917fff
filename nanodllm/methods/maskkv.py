"""MaskKV: mask-query voting evicts the prompt's KV down to a per-layer, per-head budget, on top of
dLLM-Cache (masked engine).

Paper: "MaskKV", ../shared/papers/001_11756cf7236fadd5.txt (section 3.3, Algorithms 1-3; the cached
steps, Algorithms 4-7, are dllm_cache.py).

Idea. In a diffusion LM the [MASK] queries do the long-range retrieval, and what they attend to at the
first step stays stable over the generation. So step 0 runs exact and, per layer, the response's
[MASK] queries vote: I[h, j] = sum over mask queries of softmax(q k^T / sqrt(d)) on prompt key j,
the softmax taken over the whole canvas (eq. 6-7), averaged over each KV head's query group. Budgets
are hierarchical:
    layers (Algorithm 2): B_l = floor(beta B) + an equal share of the remaining pool (B - floor(beta B)) L
        split between the boundary and the middle layers in proportion to their summed importance
        S_l = 1 - mean cos(h_in, h_out) (eq. 8), taken from an offline profile;
    heads (Algorithm 3): k_h = floor(alpha B_l) + floor((B_l - floor(alpha B_l)) H_kv P_h), with P_h
        head h's share of the prompt attention mass (prompt preference).
Each head keeps its top-k_h prompt tokens (in prompt order); a row whose whole prompt fits the
budget (prompt length <= B) keeps all of it in every head, so it decodes as under dllm_cache whatever
else is in the batch. Every later step, prompt refreshes included, attends to the kept prompt K/V
plus the response's. The full prompt KV is never stored past step 0 (each layer is evicted as soon
as it has voted); layer l's buffers hold, per head, as many prompt slots as its largest head keeps
(over rows and KV heads; Algorithm 3 can give one head up to about B_l H_kv), the slots a smaller
head does not use hidden, plus the R response keys.

Profile: `maskkv_profile.json` next to the checkpoint ({"layer_importance": [...]}), written by
    python -m nanodllm.eval --model MODEL_DIR --calibrate
Without one (or the `profile` knob naming a file), the importance is measured by one dense forward
of the first canvas decoded and kept for later generations (the paper's online variant, Table 12).

On a GPU the vote is two kernel passes (attention_mass_kernels: flash_attention's log-sum-exp, then
kernels/key_scores.py), not fp32 score matrices.

Hooks: dllm_cache's, plus keep_prompt (gather the kept K/V at each prompt refresh) and
first_step_attention (vote, allocate, evict).
Equals dllm_cache (same intervals and rho) on every row whose prompt is at most the budget long.
Knobs (paper defaults): budget = 256 KV pairs per head on average (paper sweeps 16..512), alpha = 0.1,
beta = 0.4, boundary_layers = layers at each end counted as boundary (default max(1, L // 8), an
assumption: the paper does not say where the groups split), profile = path to a profile JSON;
prompt_interval, response_interval, rho as dllm_cache.
stats: kv_kept = kept / prompt KV entries (layers, heads, rows averaged); kv_per_head = (kept, prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..attention import CanvasMask, as_kernel_mask, use_kernels
from .base import check_int
from .dllm_cache import DllmCache, take_heads

PROFILE_NAME = "maskkv_profile.json"
MASK_VOTE_QUERIES = 64  # queries per key_scores launch (kernels/decode_inputs.py MAX_QUERIES)


def attention_mass(q, keys, key_mask, query_weight, prompt_width):
    """[batch, kv_heads, prompt_width]: sum over queries (weighted by query_weight [batch, q_len], 0 or
    1) of their softmax probability on each prompt key, the softmax over all `keys` (hidden where the
    bool key_mask [batch, 1 or kv_heads, 1, keys] is False), averaged over each KV head's query group.
    On a GPU (float16 / bfloat16): attention_mass_kernels."""
    kernel_mask = as_kernel_mask(key_mask, q, keys) if use_kernels(q) else None
    if kernel_mask is not None:
        return attention_mass_kernels(q, keys, kernel_mask[1], query_weight, prompt_width)
    return attention_mass_reference(q, keys, key_mask, query_weight, prompt_width)


def attention_mass_kernels(q, keys, k_valid, query_weight, prompt_width):
    """attention_mass in two kernel passes, k_valid [batch, keys] or [batch, kv_heads, keys] (or None)
    as flash_attention takes it: flash_attention gives each query's log-sum-exp over all keys (its
    output is dropped), then key_scores sums exp(score - lse) over the queries for each prompt key,
    MASK_VOTE_QUERIES queries per launch (its limit); a query of weight 0 gets lse = +inf, so it
    adds exactly 0, and a hidden prompt key gets 0, as the softmax gives it. The torch version
    materialises fp32 scores [group, q_len, keys] per KV head, several passes over them; these read
    K twice and V once."""
    from kernels.flash_attention import flash_attention
    from kernels.key_scores import key_scores

    batch, num_heads, q_len, _ = q.shape
    group = num_heads // keys.shape[1]
    _, lse = flash_attention(q, keys, keys, k_valid=k_valid, return_lse=True)
    lse = lse.masked_fill(~query_weight.bool()[:, None, :], float("inf"))
    cache = keys.transpose(1, 2)  # [batch, keys, kv_heads, head_dim], as key_scores reads a cache
    lengths = torch.full((batch,), prompt_width, dtype=torch.int32, device=q.device)
    mass = sum(key_scores(q[:, :, start:start + MASK_VOTE_QUERIES], cache, lengths,
                          lse[:, :, start:start + MASK_VOTE_QUERIES], reduce="sum", max_length=prompt_width)
               for start in range(0, q_len, MASK_VOTE_QUERIES)) / group
    if k_valid is not None:
        prompt_valid = k_valid[..., :prompt_width]
        mass = mass.masked_fill(~(prompt_valid[:, None] if prompt_valid.dim() == 2 else prompt_valid), 0.0)
    return mass


def attention_mass_reference(q, keys, key_mask, query_weight, prompt_width):
    """attention_mass in torch, one KV head at a time to bound the fp32 scores."""
    batch, num_heads, q_len, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = num_heads // kv_heads
    weight = query_weight.float()[:, None, :, None]
    mass = q.new_zeros(batch, kv_heads, prompt_width, dtype=torch.float32)
    for h in range(kv_heads):
        scores = q[:, h * group : (h + 1) * group].float() @ keys[:, h : h + 1].float().transpose(-1, -2)
        scores = scores * head_dim**-0.5
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, h if key_mask.shape[1] > 1 else 0][:, None], float("-inf"))
        probs = scores.softmax(dim=-1)[..., :prompt_width]
        mass[:, h] = (probs * weight).sum(dim=2).mean(dim=1)
    return mass


def keep_top(scores, counts, prompt_lengths):
    """Per (row, KV head) the counts[b, h] best prompt positions, in prompt order, padded.

    scores [batch, kv_heads, P] (left-padded prompts: row b's tokens are its last prompt_lengths[b]
    columns), counts [batch, kv_heads]. Returns (indices [batch, kv_heads, kmax], keep [batch,
    kv_heads, 1, kmax]: False at padding slots)."""
    width = scores.shape[2]
    columns = torch.arange(width, device=scores.device)
    real = columns[None, :] >= (width - prompt_lengths)[:, None]
    scores = scores.masked_fill(~real[:, None, :], float("-inf"))
    counts = torch.minimum(counts, prompt_lengths[:, None])
    kmax = max(int(counts.max()), 1)
    top = scores.topk(kmax, dim=-1).indices
    slots = torch.arange(kmax, device=scores.device)
    indices = torch.where(slots < counts[..., None], top, width).sort(dim=-1).values
    keep = indices < width
    return indices.clamp(max=width - 1), keep[:, :, None, :]


def layer_budgets(budget: int, importance, beta: float, boundary_layers: int) -> list[int]:
    """Algorithm 2: a base of floor(beta * budget) per layer, the rest of budget * L shared out
    between the boundary and the middle group by summed importance, equally within a group."""
    num_layers = len(importance)
    boundary = set(range(boundary_layers)) | set(range(num_layers - boundary_layers, num_layers))
    middle = [l for l in range(num_layers) if l not in boundary]
    base = int(beta * budget)
    pool = (budget - base) * num_layers
    s_boundary = sum(importance[l] for l in boundary)
    s_middle = sum(importance[l] for l in middle)
    pool_boundary = int(pool * s_boundary / (s_boundary + s_middle)) if s_boundary + s_middle > 0 else pool
    if not middle:
        pool_boundary = pool
    share = {True: pool_boundary // len(boundary), False: (pool - pool_boundary) // max(len(middle), 1)}
    return [base + share[l in boundary] for l in range(num_layers)]


def head_budgets(mass, layer_budget: int, alpha: float):
    """Algorithm 3: [batch, kv_heads] = floor(alpha B_l) + floor(pool * prompt preference)."""
    kv_heads = mass.shape[1]
    per_head = mass.sum(dim=-1)
    preference = per_head / per_head.sum(dim=1, keepdim=True).clamp(min=1e-30)
    base = int(alpha * layer_budget)
    return base + (preference * (layer_budget - base) * kv_heads).floor().long()


@torch.no_grad()
def layer_importance(model, tokens, positions, valid, attn_mask=None) -> list[float]:
    """Eq. 8 on one canvas: per layer, 1 - mean over real tokens of cos(layer input, layer output)."""
    from ..attention import attention

    x, rope = model.embed(tokens), model.rope(positions)
    importance = []
    for layer in model.layers:
        out = layer(x, rope, lambda q, k, v: attention(q, k, v, attn_mask))
        cos = torch.nn.functional.cosine_similarity(x.float(), out.float(), dim=-1)
        importance.append(float(1 - cos[valid].mean()))
        x = out
    return importance


class MaskKV(DllmCache):
    name = "maskkv"

    def __init__(self, budget: int = 256, alpha: float = 0.1, beta: float = 0.4, boundary_layers: int | None = None,
                 profile: str | None = None, prompt_interval: int = 50, response_interval: int = 5, rho: float = 0.25):
        super().__init__(prompt_interval, response_interval, rho)
        check_int(1, budget=budget)
        for knob, value in (("alpha", alpha), ("beta", beta)):
            if not 0 <= value <= 1:
                raise ValueError(f"{knob} must be in [0, 1], got {value!r}")
        if boundary_layers is not None:
            check_int(1, boundary_layers=boundary_layers)
        self.budget, self.alpha, self.beta = budget, alpha, beta
        self.boundary_layers, self.profile = boundary_layers, profile
        self.importance: list[float] | None = None
        self.indices: list = []  # per layer: (indices, keep) of the kept prompt tokens
        self.prompt_masks: list = []  # per layer: keep as a key mask, None where every slot is kept
        self.evicting = False  # this generation's budget is below its longest prompt: some row evicts
        self.kept_sum = self.prompt_sum = self.head_rows = 0

    def step(self, model, ctx):
        first = self.t == 0
        if first:
            self.indices, self.prompt_masks = [], []  # step 0 is exact and votes again
            self.evicting = self.budget < int(ctx.prompt_lengths.max())  # else nothing to evict
        if first and self.importance is None and self.evicting:
            self.importance = self.load_importance(model, ctx)
        logits = super().step(model, ctx)
        if first and self.evicting:
            self.count_kept(ctx.prompt_lengths)
        return logits

    def load_importance(self, model, ctx) -> list[float]:
        """The profile's layer importance, or (no profile) one measured on this canvas."""
        path = Path(self.profile) if self.profile else None
        if path is None and getattr(model, "checkpoint_dir", None) is not None:
            path = Path(model.checkpoint_dir) / PROFILE_NAME
        if path is not None and path.is_file():
            importance = json.loads(path.read_text())["layer_importance"]
            if len(importance) != model.cfg.num_layers:
                raise ValueError(f"{path}: {len(importance)} layer importances for a {model.cfg.num_layers}-layer model")
            self.stats["profile"] = str(path)
            return importance
        if self.profile:
            raise FileNotFoundError(f"MaskKV profile not found: {self.profile}")
        self.stats["profile"] = "online (measured on the first canvas)"
        mask = ctx.attn_mask if isinstance(ctx.attn_mask, CanvasMask) else None
        return layer_importance(model, ctx.tokens, ctx.positions, ctx.valid, mask)

    def keep_prompt(self, i, k_p, v_p, ctx):
        if i >= len(self.indices):  # step 0: exact
            return super().keep_prompt(i, k_p, v_p, ctx)
        indices, _ = self.indices[i]
        return take_heads(k_p, indices), take_heads(v_p, indices), self.prompt_masks[i]

    def first_step_attention(self, i, q_p, q_r, ctx):
        """Vote with the exact step-0 attention, allocate the budgets, evict layer i's prompt KV."""
        if not self.evicting:
            return
        cache = self.layers[i]
        prompt_width = cache.prompt_slots
        scores = self.token_scores(i, q_p, q_r, cache, ctx)
        fits = ctx.prompt_lengths <= self.budget  # such a row has nothing to evict: it keeps its whole prompt
        counts = torch.where(fits[:, None], ctx.prompt_lengths[:, None], self.head_counts(i, scores, ctx))
        indices, keep = keep_top(scores, counts, ctx.prompt_lengths)
        self.indices.append((indices, keep))
        self.prompt_masks.append(None if bool(keep.all()) else keep)  # decided once: no sync at refreshes
        k_r, v_r = self.response_kv(cache)
        k_p, v_p = cache.keys[:, :, :prompt_width], cache.values[:, :, :prompt_width]
        self.store_prompt(i, k_p, v_p, k_r, v_r, ctx, k_r.shape[2])

    def token_scores(self, i, q_p, q_r, cache, ctx):
        """Mask voting (eq. 6-7): [batch, kv_heads, P]."""
        is_mask = ctx.tokens[:, cache.prompt_slots:] == ctx.mask_id
        return attention_mass(q_r, cache.keys, cache.key_mask, is_mask, cache.prompt_slots)

    def head_counts(self, i, scores, ctx):
        """Algorithms 2-3: [batch, kv_heads] prompt tokens each head keeps in layer i."""
        num_layers = len(self.importance)
        boundary = self.boundary_layers or max(1, num_layers // 8)
        budget = layer_budgets(self.budget, self.importance, self.beta, min(boundary, num_layers))[i]
        return head_budgets(scores, budget, self.alpha)

    def count_kept(self, prompt_lengths):
        """stats over the generations so far, after step 0 evicted every layer (each layer, row and
        KV head one entry); one sync."""
        layers, (batch, kv_heads) = len(self.indices), self.indices[0][0].shape[:2]
        self.kept_sum += int(sum(keep.sum() for _, keep in self.indices))
        self.prompt_sum += int(prompt_lengths.sum()) * kv_heads * layers
        self.head_rows += batch * kv_heads * layers
        self.stats["kv_kept"] = self.kept_sum / self.prompt_sum
        self.stats["kv_per_head"] = (self.kept_sum / self.head_rows, self.prompt_sum / self.head_rows)


def calibrate(model_dir, lengths=(1024, 2048), n: int = 4, gen_length: int = 32, seed: int = 99,
              device="cpu", dtype=torch.float32) -> Path:
    """Write MODEL_DIR/maskkv_profile.json: eq. 8 averaged over n canvases (prompt + gen_length
    masks) per task and length, drawn from nanodllm.tasks with a seed the evaluation does not use."""
    from .. import tasks
    from ..loader import load_model
    from ..tokenizer import Tokenizer

    model_dir = Path(model_dir)
    model = load_model(model_dir, device, dtype, context=max(lengths) + 2 * gen_length)
    cfg = model.cfg
    tokenizer = Tokenizer.from_dir(model_dir, cfg.model_type)
    count = lambda text: len(tokenizer.encode(text))
    profiles = []
    for task in ("passkey", "multikey", "kv"):
        for length in lengths:
            for sample in tasks.make_samples(task, length, n, seed, count_tokens=count):
                ids = tokenizer.chat([{"role": "user", "content": sample.prompt}]) + [cfg.mask_token_id] * gen_length
                tokens = torch.tensor([ids], device=device)
                positions = torch.arange(len(ids), device=device)[None]
                valid = torch.ones_like(tokens, dtype=torch.bool)
                mask = CanvasMask(block_size=cfg.block_size) if cfg.attention == "block_causal" else None
                profiles.append(layer_importance(model, tokens, positions, valid, mask))
    importance = torch.tensor(profiles).mean(dim=0).tolist()
    record = {"layer_importance": importance, "calibration": {
        "tasks": ["passkey", "multikey", "kv"], "lengths": list(lengths), "samples_per_cell": n,
        "gen_length": gen_length, "seed": seed, "canvases": len(profiles)}}
    path = model_dir / PROFILE_NAME
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)  # never a half-written profile
    return path

