"""Train the tiny diffusion LMs shipped in nanodllm/assets/, with nanodllm's own model code (how they
were made, and why: docs/results/tiny_models.md; each one's commands: its train_log.json).

    python scripts/train_tiny.py tokenizer            # BPE tokenizer on the task corpus (CPU, seconds)
    python scripts/train_tiny.py llada --minutes 4    # tiny-llada: masked diffusion, bidirectional
    python scripts/train_tiny.py sdar --minutes 4     # tiny-sdar: block diffusion, block-causal B=32
    python scripts/train_tiny.py diffusion_gemma      # tiny-gemma: uniform-state block diffusion, canvas 32

Data: nanodllm.tasks' passkey, multikey and kv samples in the family's chat template, the response
padded as SFT data is. llada: response tokens masked with probability t ~ U(0.05, 1), cross-entropy
on them weighted by 1/t (LLaDA's SFT loss). sdar: a clean and a noisy copy of the response blocks,
each noisy block seeing the clean blocks before it and itself, as the block engine shows it.
diffusion_gemma: the encoder pass over the clean rows, the denoiser over the response's canvases with
tokens replaced by random ones instead of masks, half the time self-conditioned, as its loop shows it.
Options: recall drills (--drill) and fully masked (or noised) samples (--full-mask); a length
curriculum per task, 128 to 4096 tokens, doubling when its held-out one-step accuracy reaches
ADVANCE_AT; --init continues a checkpoint (for llada also an sdar one, converted: llada_from_sdar).
AdamW, warmup and cosine decay; the checkpoint furthest along is saved in bf16 in the family's on-disk
format. Reproducible from --seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanodllm.cli import help_text, run_main, unit_fraction  # noqa: E402
from nanodllm import tasks  # noqa: E402
from nanodllm.attention import attention, block_causal_mask, key_padding_mask  # noqa: E402
from nanodllm.config import ModelConfig  # noqa: E402
from nanodllm import gemma as gemma_module  # noqa: E402
from nanodllm.gemma import DiffusionGemma, attend as gemma_attend  # noqa: E402
from nanodllm.loader import checkpoint_name, load_reference  # noqa: E402
from nanodllm.model import Model  # noqa: E402
from nanodllm.tokenizer import Tokenizer  # noqa: E402

ASSETS = ROOT / "nanodllm" / "assets"
SPECIAL_TOKENS = ["<|endoftext|>", "<|mdm_mask|>", "<|MASK|>", "<|startoftext|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB_SIZE = 1024  # merges and special tokens; the kv key words come on top
RESPONSE_LENGTH = 32
RESPONSE_LENGTHS = {"llada": (16, 32), "sdar": (32,), "diffusion_gemma": (32,)}  # llada also learns shorter canvases
GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"]  # Gemma 4's, added
BLOCK = 32
MAX_LENGTH = 4096
STAGES = [128, 256, 512, 1024, 2048, 4096]
ADVANCE_AT = 0.8  # one-step accuracy (all answer tokens at once) that moves the curriculum on
MAX_BATCH = 128
DRILL_RESPONSE_LENGTH = 64  # a drill restates up to this many tokens of needles or kv lines
DRILL_KV_LINES = 5
KV_LINE = re.compile(r"^(\S+) : (\d+) \.$", re.M)
TOKENS_PER_BATCH = 65536
EVAL_EVERY = 100


# tokenizer and configs

def train_tokenizer(seed: int) -> Path:
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(tasks.corpus(4000, seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(word, single_word=True) for word in tasks.KV_KEYS])
    path = ASSETS / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def family_tokenizer(family: str):
    """The tiny BPE tokenizer (nanodllm/assets/tokenizer.json); for diffusion_gemma with Gemma 4's special
    tokens added after its entries (the ids differ from Gemma's: the tokenizer names them)."""
    from tokenizers import Tokenizer as HFTokenizer

    bpe = HFTokenizer.from_file(str(ASSETS / "tokenizer.json"))
    if family == "diffusion_gemma":
        bpe.add_special_tokens(GEMMA_TOKENS)
    return bpe


def family_config(family: str, vocab: dict, vocab_size: int) -> dict:
    """config.json in the family's real field names (llada without q/k norm, sdar with its per-head one,
    diffusion_gemma's text fields under text_config)."""
    if family == "llada":
        return dict(model_type="llada", architectures=["LLaDAModelLM"], d_model=256, n_layers=4, n_heads=4,
                    n_kv_heads=4, mlp_hidden_size=704, mlp_ratio=4, vocab_size=vocab_size,
                    embedding_size=vocab_size, rope_theta=500000.0, rms_norm_eps=1e-5, include_bias=False,
                    attention_layer_norm=False, attention_layer_norm_with_affine=True, layer_norm_type="rms",
                    weight_tying=False, block_type="llama", rope=True,
                    rope_full_precision=True, max_sequence_length=2 * MAX_LENGTH,
                    mask_token_id=vocab["<|mdm_mask|>"],
                    eos_token_id=[vocab["<|endoftext|>"], vocab["<|eot_id|>"]],
                    pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|startoftext|>"])
    if family == "diffusion_gemma":  # 2 sliding layers (window 256) and 2 full ones, 8 experts of 64
        rope = {"full_attention": dict(partial_rotary_factor=0.25, rope_theta=1000000.0, rope_type="proportional"),
                "sliding_attention": dict(rope_theta=10000.0, rope_type="default")}
        text = dict(model_type="diffusion_gemma_text", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
                    intermediate_size=512, moe_intermediate_size=64, num_experts=8, top_k_experts=2,
                    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=256,
                    rope_parameters=rope, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                    rms_norm_eps=1e-6, max_position_embeddings=2 * MAX_LENGTH, vocab_size=vocab_size,
                    tie_word_embeddings=True, attention_bias=False, pad_token_id=vocab["<pad>"],
                    bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"])
        return dict(model_type="diffusion_gemma", architectures=["DiffusionGemmaForBlockDiffusion"],
                    canvas_length=BLOCK, eos_token_id=[vocab["<eos>"], vocab["<turn|>"]], tie_word_embeddings=True,
                    text_config=text)
    return dict(model_type="sdar", architectures=["SDARForCausalLM"], hidden_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=704,
                vocab_size=vocab_size, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, hidden_act="silu", max_position_embeddings=2 * MAX_LENGTH,
                block_size=BLOCK, mask_token_id=vocab["<|MASK|>"],
                eos_token_id=[vocab["<|im_end|>"], vocab["<|endoftext|>"]],
                pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|endoftext|>"])


# data

class PieceCache:
    """The tokenizer's ids for task text, cached per whitespace-led piece: each piece is looked up with
    its digits read as 0 (the tokenizer splits digits one by one, so the ids do not depend on which
    digits they are) and the digits are put back. Equal to encoding the whole text when the tokenizer's
    pre-tokenization splits at whitespace, as the tiny models' does (a test checks it on task samples)."""

    PIECE = re.compile(r"\s*\S+|\s+$")
    AS_ZERO = str.maketrans("0123456789", "0000000000")

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.cache, self.lengths = {}, {}  # piece -> ids, piece -> number of ids
        self.zero = hf_tokenizer.token_to_id("0")
        self.digit_ids = {digit: hf_tokenizer.token_to_id(digit) for digit in "0123456789"}

    def encode(self, text: str) -> list[int]:
        digits = iter([self.digit_ids[c] for c in text if c in self.digit_ids])
        return [next(digits) if i == self.zero else i for piece in self._pieces(text) for i in self.cache[piece]]

    def count(self, text: str) -> int:
        return sum(map(self.lengths.__getitem__, self._pieces(text)))

    def _pieces(self, text: str) -> list[str]:
        """The text's pieces with digits read as 0, each encoded once."""
        pieces = self.PIECE.findall(text.translate(self.AS_ZERO))
        for piece in set(pieces) - self.cache.keys():
            self.cache[piece] = self.hf.encode(piece, add_special_tokens=False).ids
            self.lengths[piece] = len(self.cache[piece])
        return pieces


class Encoder:
    """Chat-formatted prompt ids, the padded response, and which response tokens the objective may
    mask (all of them, except in a drill: its digits only)."""

    def __init__(self, directory: Path, family: str):
        self.tokenizer, self.family = Tokenizer.from_dir(directory, family), family
        self.pieces, self.mask_id = PieceCache(self.tokenizer.hf), self.tokenizer.mask_id
        vocab = self.tokenizer.hf.get_vocab()
        self.end_of_turn = vocab[{"llada": "<|eot_id|>", "diffusion_gemma": "<turn|>"}.get(family, "<|im_end|>")]
        self.pad = vocab["<pad>" if family == "diffusion_gemma" else "<|endoftext|>"]

    def count_tokens(self, text: str) -> int:
        return self.pieces.count(text)

    def encode(self, sample: tasks.Sample, response_length: int = RESPONSE_LENGTH):
        return self._pair(sample.prompt, sample.answer, response_length, digits_only=False)

    def drill(self, sample: tasks.Sample, rng: random.Random):
        """A multikey or kv sample turned into a recall drill: the question becomes a request to recite,
        and the response restates every multikey needle (or DRILL_KV_LINES kv lines) in a random order,
        only their numbers maskable, each number as a whole (a number partly shown could be found by its
        shown digits instead of its key). One sample then asks for several keys instead of one, so the
        retrieval by key gets several times the supervision of the one-question format."""
        if sample.task == "multikey":
            question = tasks.MULTIKEY_QUESTION.format(name=sample.meta["key"])
            needles = [(sample.meta["key"], sample.answer), *sample.meta["distractors"]]
            rng.shuffle(needles)
            text = " ".join(tasks.MULTIKEY_NEEDLE.format(name=name, number=number) for name, number in needles)
            request = "Recite the pass keys."
        elif sample.task == "kv":
            question = tasks.KV_QUESTION.format(key=sample.meta["key"])
            lines = KV_LINE.findall(sample.prompt)
            chosen = rng.sample(lines, min(DRILL_KV_LINES, len(lines)))
            text = "\n".join(tasks.KV_LINE.format(key=key, value=value) for key, value in chosen)
            request = "Recite the values of some keys."
        else:
            raise ValueError(f"no drill for task {sample.task!r}")
        if not sample.prompt.endswith(question):
            raise ValueError(f"a {sample.task} prompt does not end with its question {question!r}")
        return self._pair(sample.prompt[: -len(question)] + request, text, DRILL_RESPONSE_LENGTH, digits_only=True)

    def _pair(self, message: str, answer: str, response_length: int, digits_only: bool):
        """(prompt, response, mask groups): tokens of one positive group are masked together, 0 never.
        Block diffusion (sdar) pads the response to the end of the block holding its last token, the
        canvas the block engine decodes for gen_length = response_length."""
        prompt = self.pieces.encode(self.tokenizer.chat_text([{"role": "user", "content": message}]))
        if self.family == "sdar":
            response_length = -(-(len(prompt) + response_length) // BLOCK) * BLOCK - len(prompt)
        answer_ids = self.pieces.encode(answer)
        if len(answer_ids) + 1 > response_length:
            raise ValueError(f"an answer of {len(answer_ids)} tokens does not fit a response of {response_length}")
        response = (answer_ids + [self.end_of_turn] + [self.pad] * response_length)[:response_length]
        if not digits_only:
            return prompt, response, list(range(1, len(response) + 1))
        digits, groups, number = set(self.pieces.digit_ids.values()), [], 0
        for index, token in enumerate(response):
            if token in digits and (index == 0 or response[index - 1] not in digits):
                number += 1  # a number starts: its digits form one group
            groups.append(number if token in digits else 0)
        return prompt, response, groups


class Stages:
    """Each task's curriculum stage: the training loop moves them on, the data workers read them."""

    def __init__(self, n_tasks: int, across_processes: bool, ladder: list[int]):
        self.cells = torch.multiprocessing.Array("i", n_tasks) if across_processes else [0] * n_tasks
        self.ladder = ladder  # the lengths, shortest first

    def __getitem__(self, task_index: int) -> int:
        return self.cells[task_index]

    def advance(self, task_index: int):
        self.cells[task_index] += 1

    def lengths(self) -> list[int]:
        return [self.ladder[stage] for stage in self.cells]


class TaskStream(torch.utils.data.IterableDataset):
    """Endless micro-batches of (prompt, response, mask groups), each of one task (cycling over the tasks)
    at that task's curriculum length or a shorter one, sized by its length (TOKENS_PER_BATCH tokens, 8 to
    MAX_BATCH samples): a task still at 128 tokens keeps its batch when another has reached 4096. With
    probability `drill` a multikey or kv sample is a recall drill (Encoder.drill). Each worker has its own seed."""

    def __init__(self, directory: Path, family: str, seed: int, stages: Stages, task_names: tuple[str, ...],
                 drill: float):
        self.directory, self.family, self.seed = directory, family, seed
        self.stages, self.task_names, self.drill = stages, task_names, drill

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        rng = random.Random(self.seed * 1000 + worker)
        encoder = Encoder(self.directory, self.family)
        for turn in itertools.count(worker):
            task_index = turn % len(self.task_names)
            ladder = self.stages.ladder
            length = ladder[self.stages[task_index]]
            triples = []
            for _ in range(min(MAX_BATCH, max(8, TOKENS_PER_BATCH // (length + 64)))):
                target = rng.choice([length] * len(ladder) + [s for s in ladder if s < length])
                target = max(tasks.MIN_LENGTH, int(target * rng.uniform(0.75, 1.0)))
                task = self.task_names[task_index]
                sample = tasks.make_sample(task, target, rng.random(), rng.randrange(2**31), encoder.count_tokens)
                if task != "passkey" and rng.random() < self.drill:
                    triples.append(encoder.drill(sample, rng))
                else:
                    triples.append(encoder.encode(sample, rng.choice(RESPONSE_LENGTHS[self.family])))
            yield task_index, triples


def collate(triples, pad_id):
    """Right-pad prompt ++ response; returns ids [b, t], prompt lengths [b], valid [b, t] and the mask
    groups [b, t] (0: never masked, so the whole prompt and the padding)."""
    width = max(len(p) + len(r) for p, r, _ in triples)
    ids = torch.full((len(triples), width), pad_id, dtype=torch.long)
    groups = torch.zeros((len(triples), width), dtype=torch.long)
    for row, (prompt, response, response_groups) in enumerate(triples):
        ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        groups[row, len(prompt) : len(prompt) + len(response)] = torch.tensor(response_groups)
    lengths = torch.tensor([len(p) for p, _, _ in triples])
    totals = torch.tensor([len(p) + len(r) for p, r, _ in triples])
    valid = torch.arange(width)[None, :] < totals[:, None]
    return ids, lengths, valid, groups


# objectives

def draw_masked(groups, t):
    """Which tokens to mask: each group (positive id) of row b with probability t[b], all its tokens."""
    draws = torch.rand(groups.shape[0], int(groups.max()) + 1, device=groups.device)
    return (groups > 0) & (draws.gather(1, groups) < t[:, None])


def llada_batch(ids, lengths, valid, groups, mask_id, t):
    """Noisy canvas, positions, attention mask and the loss targets for masked diffusion."""
    masked = draw_masked(groups, t)
    positions = torch.arange(ids.shape[1], device=ids.device)[None, :].expand(ids.shape[0], -1)
    return torch.where(masked, mask_id, ids), positions, key_padding_mask(valid, valid), masked, ids


def sdar_batch(ids, lengths, valid, groups, mask_id, t):
    """Clean sequence ++ noisy copy of the blocks holding the response (block diffusion)."""
    (batch, width), device = ids.shape, ids.device
    starts, ends = lengths // BLOCK * BLOCK, valid.sum(1)  # responses are padded to a block boundary
    noisy_width = int((ends - starts).max())
    noisy_columns = starts[:, None] + torch.arange(noisy_width, device=device)[None, :]  # the column each copies
    noisy_valid = noisy_columns < ends[:, None]
    copied = ids.gather(1, noisy_columns.clamp(max=width - 1))
    masked = draw_masked(groups.gather(1, noisy_columns.clamp(max=width - 1)) * noisy_valid, t)
    noisy = torch.where(masked, mask_id, copied)

    columns = torch.arange(width, device=device)[None, :].expand(batch, -1)
    clean_mask = block_causal_mask(columns, columns, BLOCK)  # [b, 1, w, w]
    noisy_block, clean_block = noisy_columns // BLOCK, columns // BLOCK
    noisy_sees_clean = clean_block[:, None, None, :] < noisy_block[:, None, :, None]
    noisy_sees_noisy = noisy_block[:, None, None, :] == noisy_block[:, None, :, None]
    top = torch.cat([clean_mask, torch.zeros(batch, 1, width, noisy_width, dtype=torch.bool, device=device)], -1)
    bottom = torch.cat([noisy_sees_clean, noisy_sees_noisy], -1)
    all_valid = torch.cat([valid, noisy_valid], 1)
    mask = torch.cat([top, bottom], 2) & key_padding_mask(all_valid, all_valid)
    return (torch.cat([ids, noisy], 1), torch.cat([columns, noisy_columns], 1), mask,
            torch.cat([torch.zeros_like(valid), masked], 1), torch.cat([ids, copied], 1))


def gemma_batch(ids, lengths, valid, groups, vocab_size, t):
    """The responses as DiffusionGemma's canvases (each row's starts where its prompt ends), in uniform-state
    noise: each group's tokens replaced by random tokens with probability t[b]. Returns the noisy canvases
    [b, r], which of their tokens are real (not right padding) and the clean ones."""
    width, device = ids.shape[1], ids.device
    ends = valid.sum(1)
    columns = lengths[:, None] + torch.arange(int((ends - lengths).max()), device=device)[None, :]
    canvas_valid = columns < ends[:, None]
    clean = ids.gather(1, columns.clamp(max=width - 1))
    noised = draw_masked(groups.gather(1, columns.clamp(max=width - 1)) * canvas_valid, t)
    return torch.where(noised, torch.randint(0, vocab_size, clean.shape, device=device), clean), canvas_valid, clean


def row_ropes(model, positions, dtype):
    """model.ropes at positions [b, t] that differ by row: cos and sin [b, 1, t, head_dim]."""
    ropes = model.ropes(positions.flatten(), dtype)
    for rope in ropes.values():
        rope.cos, rope.sin = (x.view(*positions.shape, -1)[:, None] for x in (rope.cos, rope.sin))
    return ropes


def gemma_logits(model, ids, lengths, valid, canvas, canvas_valid, last_logits=None):
    """DiffusionGemma's denoiser logits [b, r, vocab] for canvas [b, r], each row's after its prompt (lengths),
    as generate() computes them: the encoder pass over the clean rows ids [b, w] (causal, a sliding layer's
    query within its window; valid hides the right padding), then the denoiser over each canvas (canvas_length
    tokens) against the encoder's K/V before it (a sliding layer's last window - 1) and itself, bidirectionally,
    self-conditioned on last_logits (None: zeros, a canvas' first step)."""
    window, canvas_length, device = model.cfg.gemma.sliding_window, model.cfg.gemma.canvas_length, ids.device
    columns = torch.arange(ids.shape[1], device=device)
    causal = columns[None, :] <= columns[:, None]
    in_window = columns[None, :] > columns[:, None] - window
    encoder_sees = {False: causal[None] & valid[:, None, :], True: (causal & in_window)[None] & valid[:, None, :]}
    x, cached = model.embed(ids), []
    ropes = model.ropes(columns, x.dtype)
    for layer in model.layers:
        def attend(q, k, v, sees=encoder_sees[layer.sliding]):
            cached.append((k, v))
            return gemma_attend(q, k, v, sees)
        x = layer(x, ropes[layer.sliding], attend, layer.encoder_scalar)
    offsets = torch.arange(canvas.shape[1], device=device)
    starts = lengths[:, None] + offsets // canvas_length * canvas_length  # [b, r]: where each token's canvas starts
    before = columns[None, None, :] < starts[:, :, None]
    recent = columns[None, None, :] >= starts[:, :, None] - (window - 1)
    own = (offsets[:, None] // canvas_length == offsets[None, :] // canvas_length)[None] & canvas_valid[:, None, :]
    denoiser_sees = {False: torch.cat([before, own], 2), True: torch.cat([before & recent, own], 2)}
    embedded = model.embed(canvas)
    soft = torch.zeros_like(embedded) if last_logits is None else model.soft_embedding(last_logits)
    y = model.self_conditioning(embedded, soft)
    ropes = row_ropes(model, lengths[:, None] + offsets, y.dtype)
    for layer, (cached_k, cached_v) in zip(model.layers, cached):
        def attend(q, k, v, sees=denoiser_sees[layer.sliding], cached_k=cached_k, cached_v=cached_v):
            return gemma_attend(q, torch.cat([cached_k, k], 2), torch.cat([cached_v, v], 2), sees)
        y = layer(y, ropes[layer.sliding], attend, layer.denoiser_scalar)
    return model.head(y)


def gemma_loss_and_accuracy(model, ids, lengths, valid, groups, t, self_condition):
    """The mean cross-entropy of the clean canvas at every real canvas position (the noised and the kept: the
    model cannot tell them apart); with self_condition, the logits of a first pass (no gradient) fed back."""
    canvas, canvas_valid, clean = gemma_batch(ids, lengths, valid, groups, model.cfg.vocab_size, t)
    last = None
    if self_condition:
        with torch.no_grad():
            last = gemma_logits(model, ids, lengths, valid, canvas, canvas_valid)
    logits = gemma_logits(model, ids, lengths, valid, canvas, canvas_valid, last).float()
    per_token = F.cross_entropy(logits.transpose(1, 2), clean, reduction="none")
    return (per_token * canvas_valid).sum() / canvas_valid.sum(), logits.argmax(-1), clean, canvas_valid


def loss_and_accuracy(model, family, ids, lengths, valid, groups, mask_id, t, self_condition=False):
    """The 1/t-weighted loss over the masked tokens, per maskable token of each sample (DiffusionGemma:
    gemma_loss_and_accuracy)."""
    if family == "diffusion_gemma":
        return gemma_loss_and_accuracy(model, ids, lengths, valid, groups, t, self_condition)
    make = llada_batch if family == "llada" else sdar_batch
    tokens, positions, mask, loss_at, targets = make(ids, lengths, valid, groups, mask_id, t)
    logits = model(tokens, positions, lambda layer, q, k, v: attention(q, k, v, mask)).float()
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_sample = (per_token * loss_at).sum(1) / (t * (groups > 0).sum(1))
    return per_sample.mean(), logits.argmax(-1), targets, loss_at


# training

def held_out(encoder, task, length, n, seed):
    """n (prompt, response, mask groups) triples of the task: the fixed set a stage is judged on."""
    rng = random.Random(seed)
    return [encoder.encode(tasks.make_sample(task, length, rng.random(), rng.randrange(2**31), encoder.count_tokens))
            for _ in range(n)]


@torch.no_grad()
def one_step_accuracy(model, family, triples, encoder, device):
    """Fraction of samples whose answer (through the end-of-turn token) is predicted exactly from a
    fully masked response in one forward."""
    correct = 0
    for chunk in range(0, len(triples), 16):
        ids, lengths, valid, groups = (x.to(device) for x in collate(triples[chunk : chunk + 16], encoder.pad))
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast(device, family)):
            _, predicted, targets, loss_at = loss_and_accuracy(model, family, ids, lengths, valid, groups,
                                                               encoder.mask_id, torch.ones(ids.shape[0], device=device))
        for row in range(ids.shape[0]):
            answer_length = triples[chunk + row][1].index(encoder.end_of_turn) + 1
            where = loss_at[row].nonzero().flatten()[:answer_length]
            correct += bool((predicted[row, where] == targets[row, where]).all())
    return correct / len(triples)


def autocast(device, family) -> bool:
    """bf16 autocast on a GPU; DiffusionGemma trains in fp32 (TF32 matmuls), its reference path as it is."""
    return device.type == "cuda" and family != "diffusion_gemma"


def save_checkpoint(model, family, directory: Path, config: dict, tokenizer: Path):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {checkpoint_name(family, name): p.detach().to("cpu", torch.bfloat16, copy=True)
               for name, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "tokenizer.json").write_bytes(tokenizer.read_bytes())


def llada_config_from_sdar(llada: dict, sdar: dict) -> dict:
    """The LLaDA config of a model converted from an SDAR checkpoint of the same shape: its KV heads, RoPE
    base and norm eps, and q/k norm (attention_layer_norm)."""
    if sdar.get("model_type") != "sdar" or llada.get("model_type") != "llada":
        raise SystemExit(f"--init: only an sdar checkpoint converts (to llada); got {sdar.get('model_type')!r} "
                         f"for {llada.get('model_type')!r}")
    shape = dict(d_model="hidden_size", n_layers="num_hidden_layers", n_heads="num_attention_heads",
                 mlp_hidden_size="intermediate_size", vocab_size="vocab_size")
    differ = [f"{ours}={llada[ours]} vs {theirs}={sdar[theirs]}" for ours, theirs in shape.items()
              if llada[ours] != sdar[theirs]]
    if differ:
        raise SystemExit("--init: the sdar checkpoint's shape differs from tiny-llada's: " + ", ".join(differ))
    return dict(llada, n_kv_heads=sdar["num_key_value_heads"], rope_theta=sdar["rope_theta"],
                rms_norm_eps=sdar["rms_norm_eps"], attention_layer_norm=True)


def llada_from_sdar(sdar: Model, llada_config: dict) -> Model:
    """An SDAR model's weights in a LLaDA model. SDAR's q/k norm is per head, LLaDA's over the whole
    projection: the per-head weights are tiled over the heads, so only the normaliser changes (one RMS over
    all heads instead of one per head). The attention becomes bidirectional. The fine-tuning that follows
    adapts the model to both."""
    model = Model(ModelConfig.from_dict(llada_config)).to(sdar.lm_head.weight.device)
    weights = sdar.state_dict()
    for name, target in model.state_dict().items():
        weight = weights[name]
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weight = weight.repeat(target.numel() // weight.numel())
        target.copy_(weight)
    with torch.no_grad():  # LLaDA's mask token starts where SDAR's is
        model.embed_tokens.weight[model.cfg.mask_token_id] = sdar.embed_tokens.weight[sdar.cfg.mask_token_id]
    return model


def train(args, ladder: tuple[int, ...]):
    """main's flags; ladder: the curriculum's lengths, shortest first."""
    family, init, device, out, task_names = args.what, args.init, torch.device(args.device), Path(args.out), tasks.TASKS
    torch.manual_seed(args.seed)
    if family == "diffusion_gemma":  # fp32 on the reference path, TF32 matmuls
        torch.set_float32_matmul_precision("high")
        gemma_module.GROUPED_MM = None  # the experts one by one: the grouped matmul serves bf16 inference
    work = out / f"tiny-{family}"
    bpe = family_tokenizer(family)
    vocab = {token: bpe.token_to_id(token) for token in SPECIAL_TOKENS + GEMMA_TOKENS}
    config = family_config(family, vocab, -(-bpe.get_vocab_size() // 128) * 128)
    source = json.loads((Path(init) / "config.json").read_text()) if init else None
    converting = source is not None and source.get("model_type") != config["model_type"]
    if converting:
        config = llada_config_from_sdar(config, source)
    elif init:
        config = source  # the architecture continues as it was
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(config))
    bpe.save(str(work / "tokenizer.json"))
    encoder = Encoder(work, family)
    if converting:
        model = llada_from_sdar(load_reference(init, device, torch.float32), config)
    elif init:
        model = load_reference(init, device, torch.float32)
    else:
        model = (DiffusionGemma if family == "diffusion_gemma" else Model)(ModelConfig.from_dict(config)).to(device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith(("norm.weight", "scale", "scalar")):
                    p.normal_(0.0, 0.02)
    print(f"tiny-{family}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)

    stages = Stages(len(task_names), args.workers > 0, list(ladder))
    stream = TaskStream(work, family, args.seed, stages, task_names, args.drill)
    loader = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup, checks = 200, {}  # checks: (task, stage) -> held-out triples
    best, start, step, log = -1.0, time.perf_counter(), 0, []
    while step < args.max_steps and time.perf_counter() - start < args.minutes * 60:
        progress = max(step / args.max_steps, (time.perf_counter() - start) / (args.minutes * 60))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        losses = {}
        for _ in task_names:  # one micro-batch per task on average: the gradient is their mean
            task_index, triples = next(loader)
            ids, lengths, valid, groups = (x.to(device) for x in collate(triples, encoder.pad))
            t = torch.rand(ids.shape[0], device=device).clamp(min=0.05)
            t = torch.where(torch.rand(ids.shape[0], device=device) < args.full_mask, 1.0, t)
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast(device, family)):
                loss, *_ = loss_and_accuracy(model, family, ids, lengths, valid, groups, encoder.mask_id, t,
                                             self_condition=bool(torch.rand(()) < 0.5))
            (loss / len(task_names)).backward()
            losses[task_names[task_index]] = round(loss.item(), 4)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % EVAL_EVERY == 0:
            accuracy = {}
            for index, task in enumerate(task_names):
                key = (task, stages[index])
                if key not in checks:
                    checks[key] = held_out(encoder, task, stages.ladder[key[1]], 48, args.seed + 7919 * index + key[1])
                accuracy[task] = one_step_accuracy(model, family, checks[key], encoder, device)
            entry = dict(step=step, seconds=round(time.perf_counter() - start, 1), loss=losses, lr=lr,
                         length=dict(zip(task_names, stages.lengths())), accuracy=accuracy)
            log.append(entry)
            print(json.dumps(entry), flush=True)
            furthest = sum(stages[index] + accuracy[task] for index, task in enumerate(task_names))
            if furthest > best:
                best, best_entry = furthest, entry
                save_checkpoint(model, family, out / f"best-{family}", config, work / "tokenizer.json")
            for index, task in enumerate(task_names):
                if accuracy[task] >= ADVANCE_AT and stages[index] + 1 < len(stages.ladder):
                    stages.advance(index)
    if not log:
        raise SystemExit(f"tiny-{family}: stopped after {step} steps, before the first check (every {EVAL_EVERY}); "
                         "nothing saved")
    (out / f"best-{family}" / "train_log.json").write_text(json.dumps(log))
    print(f"tiny-{family}: best checkpoint at step {best_entry['step']}: lengths {best_entry['length']}, "
          f"held-out one-step accuracy {best_entry['accuracy']}; {step} steps in "
          f"{time.perf_counter() - start:.0f}s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["tokenizer", "llada", "sdar", "diffusion_gemma"])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(ROOT / "runs"))
    parser.add_argument("--init", help="continue from this checkpoint directory (for llada also an sdar one, "
                        "converted: llada_from_sdar)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warmup 200 steps, cosine to 0.1x)")
    parser.add_argument("--first-length", type=int, default=STAGES[0],
                        help=f"the curriculum's first length (default {STAGES[0]}; then the doublings above it)")
    parser.add_argument("--last-length", type=int, default=MAX_LENGTH,
                        help=f"the curriculum's last length (default {MAX_LENGTH})")
    parser.add_argument("--drill", type=unit_fraction, default=0.0,
                        help="fraction of multikey and kv samples that are recall drills (several keys each)")
    parser.add_argument("--full-mask", type=unit_fraction, default=0.0,
                        help="fraction of samples trained fully masked (t = 1, the canvas decoding starts from)")
    args = parser.parse_args()
    if not tasks.MIN_LENGTH <= args.first_length <= args.last_length <= MAX_LENGTH:
        parser.error(f"--first-length and --last-length must satisfy {tasks.MIN_LENGTH} <= first <= last <= "
                     f"{MAX_LENGTH}, got {args.first_length} and {args.last_length}")
    if args.what == "tokenizer":
        print(f"wrote {train_tokenizer(args.seed)}")
        return
    train(args, (args.first_length, *(n for n in STAGES if args.first_length < n <= args.last_length)))


if __name__ == "__main__":
    sys.exit(run_main(main))
