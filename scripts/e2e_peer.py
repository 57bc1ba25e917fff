"""The peer of `bench.py e2e`: what a user runs without nanodllm. The reference decoding loops (LLaDA's
generate(), SDAR's block_diffusion_generate, as their repositories' generate.py write them) on
transformers' model of the same architecture with PyTorch SDPA, holding our model's weights (shared).
LLaDA-8B is LlamaForCausalLM with every attention layer bidirectional, forwarding the whole canvas at
every step (logits kept for the generated part only). SDAR-8B is Qwen3ForCausalLM: the prompt's whole
blocks prefilled under a block-causal mask into a DynamicCache, each step forwarding the block against
the cache, then cutting the cache back; a finished block is forwarded once more to store it. Greedy,
low-confidence remasking with the references' schedules, no stop tokens. Needs transformers >= 5.
"""

from __future__ import annotations

import inspect

import torch


def missing() -> str | None:
    """Why the peer cannot run here, or None."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install 'transformers>=5'): no peer rows"
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"the peer needs transformers >= 5, found {transformers.__version__}: no peer rows"
    return None


def hf_model(model):
    """transformers' model of our model's architecture, its parameters our model's tensors: the fused
    qkv_proj's rows as q/k/v_proj, gate_up_proj's as gate/up_proj (views). Dense layers only."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = model.cfg
    if (cfg.model_type not in ("llada", "sdar") or cfg.qk_norm == "projection" or cfg.moe or cfg.qkv_bias
            or cfg.rotary_dim != cfg.head_dim):
        raise ValueError(f"the peer covers LLaDA-8B and SDAR-8B shapes, not this {cfg.model_type} model")
    shape = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                 num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                 max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                 rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_base)},  # NTK-stretched
                 attention_bias=False, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.model_type == "llada":
        config, build = LlamaConfig(mlp_bias=False, **shape), LlamaForCausalLM
    else:
        config, build = Qwen3Config(use_sliding_window=False, **shape), Qwen3ForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device("meta"):  # allocates nothing: the parameters are ours, assigned below
        peer = build(config)
    peer.model.rotary_emb = type(peer.model.rotary_emb)(config).to(model.embed_tokens.weight.device)
    state = {}
    for name, p in model.named_parameters():
        if ".qkv_proj." in name:  # weight and bias
            parts = zip((name.replace("qkv", part) for part in "qkv"), p.split(model.layers[0].self_attn.widths))
        elif name.endswith("gate_up_proj.weight"):
            parts = zip((name.replace("gate_up", part) for part in ("gate", "up")), p.chunk(2))
        else:
            parts = [(name, p)]
        state.update({part if part == "lm_head.weight" else f"model.{part}": tensor for part, tensor in parts})
    peer.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        peer.tie_weights()
    if cfg.attention == "bidirectional":
        for layer in peer.model.layers:
            layer.self_attn.is_causal = False
    return peer.eval()


def transfer_schedule(masks: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens: [b] masks in a block -> [b, steps], the first (n % steps) get +1."""
    base, extra = masks // steps, masks % steps
    counts = base[:, None].repeat(1, steps)
    counts[torch.arange(steps, device=masks.device)[None] < extra[:, None]] += 1
    return counts


def unmask_most_confident(x, x0, confidence, counts):
    """Per row, the `counts[row]` most confident positions take their predicted token (in place)."""
    for row in range(x.shape[0]):
        chosen = torch.topk(confidence[row], int(counts[row])).indices
        x[row, chosen] = x0[row, chosen]


@torch.no_grad()
def llada_generate(peer, prompts: torch.Tensor, gen_length: int, block_length: int, steps: int, mask_id: int,
                   first_block_done=lambda: None) -> torch.Tensor:
    """LLaDA's generate() at temperature 0, cfg_scale 0, low_confidence remasking."""
    batch, prompt = prompts.shape
    x = torch.full((batch, prompt + gen_length), mask_id, dtype=torch.long, device=prompts.device)
    x[:, :prompt] = prompts
    blocks = gen_length // block_length
    per_block = steps // blocks
    for b in range(blocks):
        end = (b + 1) * block_length  # within the generated part
        schedule = transfer_schedule((x[:, prompt + end - block_length:prompt + end] == mask_id).sum(1), per_block)
        for i in range(per_block):
            generated = x[:, prompt:]
            masked = generated == mask_id
            logits = peer(input_ids=x, logits_to_keep=gen_length).logits
            x0 = logits.argmax(-1)
            p = torch.softmax(logits.double(), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            p[:, end:] = float("-inf")
            confidence = torch.where(masked, p, float("-inf"))
            unmask_most_confident(generated, torch.where(masked, x0, generated), confidence, schedule[:, i])
        if b == 0:
            first_block_done()
    return x[:, prompt:]


def block_causal(length: int, block: int, device) -> torch.Tensor:
    """[1, 1, length, length] bool, True where query q may see key k: k // block <= q // block."""
    blocks = torch.arange(length, device=device) // block
    return (blocks[None, :] <= blocks[:, None])[None, None]


@torch.no_grad()
def sdar_generate(peer, prompts: torch.Tensor, gen_length: int, block: int, steps: int, mask_id: int,
                  first_block_done=lambda: None) -> torch.Tensor:
    """SDAR's block_diffusion_generate at temperature 0, low_confidence_static."""
    from transformers import DynamicCache

    (batch, prompt), device = prompts.shape, prompts.device
    total = -(-(prompt + gen_length) // block) * block
    x = torch.full((batch, total), mask_id, dtype=torch.long, device=device)
    x[:, :prompt] = prompts
    cache = DynamicCache(config=peer.config)
    # later transformers 5 releases rename forward's past_key_values to cache (the old name warns)
    with_cache = {"cache" if "cache" in inspect.signature(peer.forward).parameters else "past_key_values": cache,
                  "use_cache": True}
    prefilled = prompt // block * block
    if prefilled:
        peer(input_ids=x[:, :prefilled], attention_mask=block_causal(prefilled, block, device), **with_cache,
             logits_to_keep=1)
    schedule = transfer_schedule(torch.tensor([block], device=device), steps)[0]
    for start in range(prefilled, total, block):
        window = x[:, start:start + block]
        step_inputs = dict(attention_mask=torch.ones(1, 1, block, start + block, dtype=torch.bool, device=device),
                           position_ids=torch.arange(start, start + block, device=device)[None].expand(batch, -1))
        for step in range(steps + 1):
            masked = window == mask_id
            if not masked.any():
                peer(input_ids=window, **step_inputs, **with_cache, logits_to_keep=1)
                break
            logits = peer(input_ids=window, **step_inputs, **with_cache).logits
            cache.crop(-block)
            x0 = logits.argmax(-1)
            p = torch.softmax(logits.float(), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            confidence = torch.where(masked, p, float("-inf"))
            counts = masked.sum(1).clamp(max=int(schedule[min(step, steps - 1)]))
            unmask_most_confident(window, torch.where(masked, x0, window), confidence, counts)
        if start == prefilled:
            first_block_done()
    return x[:, prompt:prompt + gen_length]
