"""DiffusionGemma (google/diffusiongemma-26B-A4B-it) as its math: one set of layers run in two passes.

    cache = model.empty_cache(batch)
    model.encode(prompt, cache)                    # causal; appends every layer's K/V (encoder scalars)
    logits = model.denoise(canvas, cache)          # bidirectional over [cache; canvas], reads the cache
    logits = model.denoise(canvas, cache, logits)  # self-conditioned on the last step's logits
    model.encode(committed, cache)                 # the chosen canvas joins the cache where it stood
A layer: sandwich norms around attention, then a dense GELU MLP beside a mixture of experts routed on
the raw residual, each post-normed, summed, normed and added; the stream times the pass's layer scalar.
Sliding layers see the last sliding_window positions when encoding, the last sliding_window - 1 cached
ones when denoising; full layers see everything, have global_head_dim and global_kv_heads, values that
are their raw keys (K = V) and proportional RoPE. Attention scale 1 (q_norm and k_norm carry it);
RMSNorm is x * w in fp32; logits are softcapped in fp32. Plain torch (the experts in grouped matmuls on
CUDA) and, in 16 bits on a GPU, kernels/rmsnorm.py, rope.py, flash_attention and wide_attention (the
full layers' cached keys) for the full layers and the denoiser (SDPA for the encoder's windows).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanodllm.kernels.flash_attention import flash_attention
from nanodllm.kernels.moe_route import moe_route
from nanodllm.kernels.rmsnorm import rms_norm
from nanodllm.kernels.rope import apply_rope
from nanodllm.kernels.vocab_rows import soft_probs, softcap
from nanodllm.kernels.wide_attention import wide_attention

from .attention import FLASH_HEAD_DIMS, flash_on_kernels, use_kernels
from .config import ModelConfig
from .experts import GROUPED_MM, grouped_experts
from .gemma_cache import GemmaCache
from .mlp import MLP, choose_experts, fp32_or_wider

ENCODE_CHUNK = 4096  # query rows an encoder pass attends at once off the kernels: masks grow with it, not the prompt
WIDE_FROM = 512  # the head_dim from which the full layers' cached keys go to wide_attention (the tests move it)
PROMPT_CHUNK = 1024  # a wide prompt's queries per wide_attention: 4 GiB of probabilities a row against 128K keys
GROUPED_TOKENS = 65536  # tokens the experts take at once: a long prompt's pass gathers k rows a token, in pieces


def attend_first_keys(q, keys, values, key_counts, return_lse: bool = False):
    """Each batch row's queries against its first key_counts[b] keys, at scale 1, on the kernels: where
    flash_attention would compute q . k once per half of a head's output columns (head_dim WIDE_FROM and
    up), kernels/wide_attention.py's two matmuls; else flash_attention, the other keys masked."""
    if q.shape[-1] >= WIDE_FROM:
        return wide_attention(q, keys, values, key_counts, scale=1.0, return_lse=return_lse)
    valid = torch.arange(keys.shape[2], device=keys.device)[None, :] < key_counts[:, None]
    return flash_attention(q, keys, values, k_valid=valid, scale=1.0, return_lse=return_lse)


def merged(parts, dtype: torch.dtype) -> torch.Tensor:
    """Two attentions [(out, lse)] of the same queries over disjoint keys as one over both: each weighted by
    exp(its lse - their log-sum-exp), in fp32."""
    lse = torch.logaddexp(parts[0][1], parts[1][1])[..., None]  # [b, heads, t, 1]
    return sum(out.float() * (part_lse[..., None] - lse).exp() for out, part_lse in parts).to(dtype)


def attend_prompt(q, k, v) -> torch.Tensor:
    """Causal attention among a prompt's tokens (no pads, head_dim WIDE_FROM and up) in chunks of PROMPT_CHUNK
    queries: each against the keys before it on wide_attention and among itself on flash_attention, merged."""
    batch, heads, t, head_dim = q.shape
    out = torch.empty(batch, t, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    for start in range(0, t, PROMPT_CHUNK):
        chunk = slice(start, start + PROMPT_CHUNK)
        own = flash_attention(q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], causal=True, scale=1.0,
                              return_lse=start > 0)
        if start:  # the keys before the chunk, every one visible
            before = torch.full((batch,), start, device=q.device)
            earlier = wide_attention(q[:, :, chunk], k[:, :, :start], v[:, :, :start], before, scale=1.0,
                                     return_lse=True)
            own = merged((earlier, own), q.dtype)
        out[:, :, chunk] = own
    return out


class GemmaRMSNorm(nn.Module):
    """x (mean(x^2) + eps)^-1/2 w, in fp32 then cast; weight=False: without w."""

    def __init__(self, dim: int, eps: float, weight: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and x.stride(-1) == 1:  # one pass (kernels/rmsnorm.py), rounded once as here
            return rms_norm(x, self.weight, self.eps, round_normed=False)
        x32 = fp32_or_wider(x)
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (normed if self.weight is None else normed * fp32_or_wider(self.weight)).to(x.dtype)


class GemmaRope:
    """Rotate-half RoPE at positions [t] of a head_dim-wide head with base theta, of which only the first
    `pairs` frequency pairs turn (proportional RoPE: the rest stay still); cos and sin [t, head_dim] in
    the activations' dtype, as transformers applies them."""

    def __init__(self, positions: torch.Tensor, head_dim: int, theta: float, pairs: int, dtype: torch.dtype):
        exponent = torch.arange(0, 2 * pairs, 2, device=positions.device, dtype=torch.float32) / head_dim
        inv_freq = F.pad(1.0 / theta**exponent, (0, head_dim // 2 - pairs))
        freqs = positions.float()[:, None] * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, heads, t, head_dim] rotated (on the kernels: kernels/rope.py, rounded as here)."""
        if use_kernels(x) and x.stride(-1) == 1 and self.cos.dtype == x.dtype:
            return apply_rope(x, self.cos[None, None], self.sin[None, None], round_products=True)
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * self.sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T + bias) v, unscaled, the bias the dtype's lowest number where not visible ([b, q_len,
    k_len] bool; None: everywhere), so a query seeing nothing (a pad's) reads every key alike, as transformers'
    eager attention. q [b, heads, t, d], k and v [b, kv_heads, n, d]: query head h reads KV head
    h // (heads / kv_heads). Scores in fp32 or wider."""
    b, heads, t, d = q.shape
    kv_heads, compute = k.shape[1], torch.promote_types(q.dtype, torch.float32)
    bias_dtype = q.dtype if q.is_cuda else compute
    bias = None if visible is None else torch.zeros(visible.shape, dtype=bias_dtype, device=q.device).masked_fill(
        ~visible, torch.finfo(bias_dtype).min)[:, None]  # [b, 1, t, n]: every head
    if q.is_cuda:  # a KV head's group as one head of group * t queries: SDPA's fused kernels take no GQA at D 512
        group = heads // kv_heads
        if bias is not None:
            bias = bias[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, 1, group * t, -1)
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, group * t, d), k, v, attn_mask=bias, scale=1.0)
        return out.reshape(b, heads, t, d)
    grouped = q.to(compute).view(b, kv_heads, heads // kv_heads, t, d)
    scores = grouped @ k.to(compute)[:, :, None].transpose(-1, -2)  # [b, kv_heads, group, t, n]
    if bias is not None:
        scores = scores + bias[:, None]
    return (scores.softmax(dim=-1) @ v.to(compute)[:, :, None]).view(b, heads, t, d).to(q.dtype)


def attend_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
    """attend with only keys hidden: key_valid [b, n] (None: all seen). Where the kernels run (16-bit on a
    GPU, at a head_dim it takes) the flash kernel (kernels/flash_attention.py: GQA in place, scale 1)."""
    if flash_on_kernels(q):
        return flash_attention(q, k, v, k_valid=key_valid, scale=1.0)
    return attend(q, k, v, None if key_valid is None else key_valid[:, None, :].expand(-1, q.shape[2], -1))


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, head_dim: int, kv_heads: int, values: bool):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False) if values else None  # None: K = V
        self.o_proj = nn.Linear(cfg.num_heads * head_dim, d, bias=False)
        self.q_norm, self.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)
        self.v_norm = GemmaRMSNorm(head_dim, eps, weight=False)

    def qkv(self, x: torch.Tensor, rope: GemmaRope):
        """[b, t, hidden] -> q [b, heads, t, d], k and v [b, kv_heads, t, d]; without v_proj, v is k
        before its norm and RoPE."""
        raw_k = self.heads(self.k_proj(x))
        v = raw_k if self.v_proj is None else self.heads(self.v_proj(x))
        return rope.apply(self.q_norm(self.heads(self.q_proj(x)))), rope.apply(self.k_norm(raw_k)), self.v_norm(v)

    def heads(self, projected: torch.Tensor) -> torch.Tensor:
        b, t = projected.shape[:2]
        return projected.view(b, t, -1, self.head_dim).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaRouter(nn.Module):
    """Each token's experts, chosen on its raw residual x [n, hidden]: softmax (fp32) of
    proj(norm(x) * scale / sqrt(hidden)), the top k renormalised to sum 1, each times its per_expert_scale."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, self.k = cfg.moe.num_experts, cfg.moe.experts_per_token
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight=False)
        self.proj = nn.Linear(cfg.hidden_size, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x: torch.Tensor):
        """(chosen experts [n, k], their weights [n, k] in fp32 or wider)."""
        logits = fp32_or_wider(self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5))
        choose = moe_route if use_kernels(x) else choose_experts
        return choose(logits, self.k, sigmoid=False, expert_scale=self.per_expert_scale)


class GemmaExperts(nn.Module):
    """The held experts' GELU MLPs (all of them in one process; a range of them on each rank of a split model,
    nanodllm/parallel.py), stacked as stored: gate_up_proj [held, 2 * size, hidden] (gate's rows, then up's),
    down_proj [held, hidden, size]. Tokens routed to experts held elsewhere get nothing from here."""

    def __init__(self, cfg: ModelConfig, held: range | None = None):
        super().__init__()
        moe, hidden = cfg.moe, cfg.hidden_size
        self.num_experts, self.held = moe.num_experts, range(moe.num_experts) if held is None else held
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.held), 2 * moe.expert_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(len(self.held), hidden, moe.expert_size))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]: each token's chosen experts' outputs times their weights, added expert by expert
        in x's dtype (transformers' eager order; on a GPU, `grouped`)."""
        if x.is_cuda and GROUPED_MM is not None:
            return self.grouped(x, chosen, weights)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            if expert not in self.held:
                continue
            slots, rows = (chosen == expert).T.nonzero(as_tuple=True)
            e = expert - self.held.start
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(x.dtype))
        return out

    def grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward with no loop (experts.py grouped_experts), GROUPED_TOKENS tokens at a time."""
        if len(x) > GROUPED_TOKENS:
            pieces = zip(*(t.split(GROUPED_TOKENS) for t in (x, chosen, weights)))
            return torch.cat([self.grouped(*piece) for piece in pieces])
        return grouped_experts(x, chosen, weights, self, self.num_experts, "gelu_tanh")


def attention_shape(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(head_dim, KV heads) of a layer: a sliding layer's, else a full layer's (global_*)."""
    g = cfg.gemma
    return (cfg.head_dim, cfg.num_kv_heads) if g.is_sliding(layer) else (g.global_head_dim, g.global_kv_heads)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        g, d = cfg.gemma, cfg.hidden_size
        self.cfg = cfg  # under a split (parallel.py) this rank's share of the heads
        self.sliding = g.is_sliding(index)
        shape = attention_shape(cfg, index)
        norm = partial(GemmaRMSNorm, d, cfg.rms_norm_eps)
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg, *shape, values=self.sliding)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm, self.mlp, self.post_feedforward_layernorm_1 = (
            norm(), GeluMLP(d, cfg.intermediate_size), norm())
        self.router = GemmaRouter(cfg)
        self.pre_feedforward_layernorm_2, self.experts, self.post_feedforward_layernorm_2 = (
            norm(), GemmaExperts(cfg), norm())
        self.post_feedforward_layernorm = norm()
        self.encoder_scalar = nn.Parameter(torch.ones(1), requires_grad=False)  # the stream's scale per pass
        self.denoiser_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor, rope: GemmaRope, attend, scalar: torch.Tensor) -> torch.Tensor:
        o = attend(*self.self_attn.qkv(self.input_layernorm(x), rope))
        h = x + self.post_attention_layernorm(self.self_attn.out(o))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        routed = self.post_feedforward_layernorm_2(self.moe(h))
        return (h + self.post_feedforward_layernorm(dense + routed)) * scalar

    def moe(self, h: torch.Tensor) -> torch.Tensor:
        """The experts of h [b, t, hidden]: routed on h itself, fed its pre_feedforward_layernorm_2."""
        flat = h.reshape(-1, h.shape[-1])
        chosen, weights = self.router(flat)
        return self.experts(self.pre_feedforward_layernorm_2(flat), chosen, weights).view_as(h)


class SelfConditioning(GeluMLP):
    """The denoiser's input: post_norm(embedding + mlp(pre_norm(soft))), soft the embedding of the last
    step's token distribution (zeros at a canvas' first step)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight=False)

    def forward(self, embedded: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        return self.post_norm(embedded + super().forward(self.pre_norm(soft)))


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # also the (tied) LM head
        self.self_conditioning = SelfConditioning(cfg)
        self.layers = nn.ModuleList(GemmaLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_cache(self, batch: int, capacity: int | None = None) -> GemmaCache:
        """A cache for `capacity` tokens per row (default: the model's context) of this rank's KV heads."""
        weight = self.embed_tokens.weight
        share = self.layers[0].cfg
        return GemmaCache(share, batch, capacity or self.cfg.context_length, weight.device, weight.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """E[ids] * sqrt(hidden), the factor rounded to the weights' dtype."""
        weight = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.cfg.hidden_size**0.5).to(weight.dtype)

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits) E * sqrt(hidden): the embedding of a token distribution [b, t, vocab]."""
        weight = self.embed_tokens.weight
        if use_kernels(weight):  # one kernel (kernels/vocab_rows.py) for torch's cast, softmax and cast back
            probs = soft_probs(logits, weight.dtype)
        else:
            probs = fp32_or_wider(logits).softmax(dim=-1).to(weight.dtype)
        return probs @ weight * torch.tensor(self.cfg.hidden_size**0.5).to(weight.dtype)

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, GemmaRope]:
        """RoPE of sliding (True) and full (False) layers at positions [t]."""
        cfg, g = self.cfg, self.cfg.gemma
        return {True: GemmaRope(positions, cfg.head_dim, cfg.rope_theta, cfg.head_dim // 2, dtype),
                False: GemmaRope(positions, g.global_head_dim, g.global_rope_theta, g.global_rotated_pairs, dtype)}

    @property
    def replayable(self) -> bool:
        """A denoising step asks the host nothing, so a CUDA graph can record it: on a GPU in bfloat16 (in
        other dtypes torch's grouped matmul reads its offsets on the host)."""
        weight = self.embed_tokens.weight
        return weight.is_cuda and weight.dtype == torch.bfloat16 and GROUPED_MM is not None

    def positions(self, cache: GemmaCache, t: int) -> torch.Tensor:
        """[t] positions after the cache's (read from the device: a step's graph holds no length)."""
        return cache.start + torch.arange(t, device=self.embed_tokens.weight.device)

    def full_on_kernels(self) -> bool:
        """Whether the full layers' attention runs on flash_attention (the weights' dtype and device)."""
        return use_kernels(self.embed_tokens.weight) and self.cfg.gemma.global_head_dim in FLASH_HEAD_DIMS

    def launch_key(self, cache: GemmaCache, t: int) -> tuple:
        """The host numbers a denoising step of t tokens is launched with, which a CUDA graph of it keeps: the
        full layers' key count (on the kernels the cache's capacity, GemmaCache.full_launch; else its length),
        the windows' width and whether pads are hidden."""
        keys = cache.full.capacity if self.full_on_kernels() else cache.length
        return keys, cache.window_width, cache.has_pads

    def encode(self, ids: torch.Tensor, cache: GemmaCache, valid: torch.Tensor | None = None,
               attend_full=None) -> torch.Tensor:
        """ids [b, t] at the positions after the cache's: every layer's K/V appended. valid [b, t]: False
        at left pads, which no other token sees (None: no pads). attend_full(layer, q, k, v): the full
        layers' causal attention among the ids, where the cache is empty (a method's prefill; default:
        exact). Returns the last hidden state (no use in decoding)."""
        x = self.encoded(ids, cache, valid, attend_full)
        cache.advance(torch.ones_like(ids, dtype=torch.bool) if valid is None else valid)
        return x

    def encoded(self, ids: torch.Tensor, cache: GemmaCache, valid: torch.Tensor | None = None,
                attend_full=None) -> torch.Tensor:
        """encode's layers, each writing its K/V into the cache; the cache's length is not moved (cache.advance
        does that). Without pads and on the kernels a commit asks the host nothing, so a graph of it replays."""
        if attend_full is not None and cache.length:
            raise ValueError("a method's prefill attention runs on the first encoder pass only (the cache is empty)")
        if valid is not None and not cache.length and bool(valid.all()):  # a prompt without pads is one (a sync)
            valid = None
        x = self.embed(ids)
        ropes = self.ropes(self.positions(cache, ids.shape[1]), x.dtype)
        for i, layer in enumerate(self.layers):
            attend_here = partial(self.attend_encoding, cache, i, valid)
            if attend_full is not None and not layer.sliding:
                attend_here = partial(self.attend_prefill, cache, i, valid, attend_full)
            x = layer(x, ropes[layer.sliding], attend_here, layer.encoder_scalar)
        return x

    def attend_encoding(self, cache: GemmaCache, layer: int, valid, q, k, v) -> torch.Tensor:
        """The new tokens against the cached ones and themselves, causally (a sliding layer: within the
        window), pads seen by none; then their K/V join the cache. A full layer on the kernels runs
        flash_attention (a prompt without pads at head_dim WIDE_FROM and up: attend_prompt; after a cache with no
        new pads: attend_after_cache); otherwise ENCODE_CHUNK queries at a time attend to the keys they may see."""
        t = q.shape[2]
        if cache.sliding[layer]:  # the window in position order, then the new tokens
            (keys, values), cached_valid = cache.window(layer, k, v), cache.window_valid
            window = self.cfg.gemma.sliding_window
        elif flash_on_kernels(q) and valid is None and (cache.length or q.shape[-1] >= WIDE_FROM):
            out = self.attend_after_cache(cache, layer, q, k, v) if cache.length else attend_prompt(q, k, v)
            cache.append(layer, k, v, valid)
            return out
        else:
            (cached_k, cached_v), cached_valid, window = cache.full_in_place(layer), cache.valid, None
            keys, values = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
        key_valid = F.pad(cached_valid, (0, t), value=True) if valid is None else torch.cat([cached_valid, valid], 1)
        if window is None and flash_on_kernels(q):  # the new tokens are the last keys
            out = flash_attention(q, keys, values, causal=True, k_valid=key_valid, scale=1.0)
        else:
            # the cached keys hold the positions just before the new ones: key j sits `offsets[j]` after the first
            cached = keys.shape[2] - t
            offsets = torch.arange(keys.shape[2], device=q.device) - cached
            chunks = []
            for start in range(0, t, ENCODE_CHUNK):
                rows = torch.arange(start, min(start + ENCODE_CHUNK, t), device=q.device)  # the same, of queries
                lo = 0 if window is None else max(0, cached + start - window + 1)  # keys before are out of reach
                hi = cached + start + len(rows)
                seen = offsets[None, lo:hi] <= rows[:, None]
                if window is not None:
                    seen &= offsets[None, lo:hi] > rows[:, None] - window
                chunks.append(attend(q[:, :, start : start + len(rows)], keys[:, :, lo:hi], values[:, :, lo:hi],
                                     seen[None] & key_valid[:, None, lo:hi]))
            out = torch.cat(chunks, dim=2)
        cache.append(layer, k, v, valid)
        return out

    @staticmethod
    def attend_after_cache(cache: GemmaCache, layer: int, q, k, v) -> torch.Tensor:
        """A full layer's new tokens (no pads) on the kernels in two parts merged by their log-sum-exps: against
        every cached key, read in place (attend_first_keys over GemmaCache.full_launch), and among themselves,
        causally (flash_attention). No host number but the cache's capacity."""
        parts = (attend_first_keys(q, *cache.full_launch(layer, q.shape[2], canvas=False), return_lse=True),
                 flash_attention(q, k, v, causal=True, scale=1.0, return_lse=True))
        return merged(parts, q.dtype)  # the causal part sees a key: a finite lse

    @staticmethod
    def attend_prefill(cache: GemmaCache, layer: int, valid, attend_full, q, k, v) -> torch.Tensor:
        """A full layer's attention at the first encoder pass by attend_full; then its K/V join the cache."""
        out = attend_full(layer, q, k, v)
        cache.append(layer, k, v, valid)
        return out

    def denoise(self, canvas: torch.Tensor, cache: GemmaCache, last_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, t, vocab] (fp32, softcapped) for canvas [b, t] at the positions after the cache's,
        self-conditioned on the last step's logits (None at a canvas' first step). The cache is only read."""
        return self.head(self.denoised(canvas, cache, last_logits))

    def denoised(self, canvas: torch.Tensor, cache: GemmaCache, last_logits: torch.Tensor | None = None,
                 attend_full=None) -> torch.Tensor:
        """denoise's hidden states, before the head. attend_full(layer, q, k, v): the full layers' attention
        over cache.full and the canvas (a method's; default: exact, as attend_denoising)."""
        positions = self.positions(cache, canvas.shape[1])
        embedded = self.embed(canvas)
        soft = torch.zeros_like(embedded) if last_logits is None else self.soft_embedding(last_logits)
        x = self.self_conditioning(embedded, soft)
        ropes = self.ropes(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            exact = layer.sliding or attend_full is None
            attend_here = partial(self.attend_denoising, cache, i) if exact else partial(attend_full, i)
            x = layer(x, ropes[layer.sliding], attend_here, layer.denoiser_scalar)
        return x

    @staticmethod
    def attend_denoising(cache: GemmaCache, layer: int, q, k, v) -> torch.Tensor:
        """The canvas against everything the cache holds for the layer but pads, and itself. The canvas K/V go
        to scratch slots (a full layer's after each row's tokens, a sliding layer's after its window in
        order), so the keys are read in place: a full layer's on the kernels as the cache holds them, every slot
        (GemmaCache.full_launch), else by position, in transformers' order."""
        t = q.shape[2]
        if cache.sliding[layer]:
            keys, values = cache.window(layer, k, v)
            cached_valid = cache.window_valid
        else:
            cache.full.write(layer, k, v)
            if flash_on_kernels(q):
                return attend_first_keys(q, *cache.full_launch(layer, t))
            keys, values = cache.full_in_place(layer, t)
            cached_valid = cache.valid
        key_valid = None
        if cache.has_pads:  # no device sync (where a window holds no pad, its mask adds zeros: the same sums)
            key_valid = F.pad(cached_valid, (0, t), value=True)  # the canvas is never padding
        return attend_keys(q, keys, values, key_valid)

    def head(self, hidden: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """cap * tanh(logits / cap), in fp32, the logits of columns start:stop from the final norm and the
        tied embedding."""
        cap = self.cfg.gemma.logit_softcap
        logits = F.linear(self.norm(hidden[:, start:stop]), self.embed_tokens.weight)
        if use_kernels(logits):  # one pass (kernels/vocab_rows.py) for torch's four
            return softcap(logits, cap)
        return torch.tanh(fp32_or_wider(logits) / cap) * cap
