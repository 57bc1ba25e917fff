"""Tokenizer: a checkpoint's tokenizer files, its special ids, and its chat template.

`Tokenizer.from_dir(path, family)` builds a `tokenizers` tokenizer (no transformers needed) from
`<path>/tokenizer.json`, else, for the Qwen2-vocabulary families, `vocab.json` + `merges.txt` built as
transformers' Qwen2 tokenizer does. `family` is the config's model_type: "llada", "sdar", "Dream",
"Fast_dLLM_Qwen", "llada2_moe", "sdar_moe" (SDAR's vocabulary and template), "diffusion_gemma" (no mask).

Special ids (mask_id, eos_id, pad_id, bos_id) are resolved field by field, first hit wins: config.json,
generation_config.json, tokenizer_config.json's token strings, the family's token strings in the
vocabulary, then its default ids (SPECIAL_TOKENS). stop_ids: the configs' eos_token_id entries, then
the family's STOP_TOKENS, in order and without repeats.

Chat templates are Python ports of the published jinja templates, checked against them in
tests/test_tokenizer.py. Only plain {"role", "content"} messages with roles system/user/assistant
are supported; anything else is a ValueError.
"""

import json
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

SUPPORTED_FAMILIES = ("llada", "sdar", "Dream", "Fast_dLLM_Qwen", "llada2_moe", "sdar_moe", "diffusion_gemma")
QWEN2_VOCAB_FAMILIES = ("sdar", "Dream", "Fast_dLLM_Qwen", "sdar_moe")
QWEN25_CHAT_FAMILIES = ("Dream", "Fast_dLLM_Qwen")
CHAT_ROLES = ("system", "user", "assistant")

# transformers' models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX (the same in its Qwen2Converter)
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# the no-tools default system turn of a Qwen2.5 template: '<|im_start|>system\n{default}<|im_end|>\n'
QWEN25_DEFAULT_SYSTEM_TURN = re.compile(r"'<\|im_start\|>system\\n([^'\\]*)<\|im_end\|>\\n'")
ASSUMED_QWEN25_SYSTEM_PROMPT = "You are a helpful assistant."

# field -> (token string or None, default id or None), per family
SPECIAL_TOKENS = {
    "llada": {
        "mask_token_id": ("<|mdm_mask|>", 126336),
        "eos_token_id": ("<|endoftext|>", 126081),
        "pad_token_id": ("<|endoftext|>", 126081),
        "bos_token_id": ("<|startoftext|>", 126080),
    },
    "sdar": {
        "mask_token_id": ("<|MASK|>", 151669),
        "eos_token_id": ("<|im_end|>", 151645),
        "pad_token_id": ("<|endoftext|>", 151643),
        "bos_token_id": (None, None),
    },
    "Dream": {
        "mask_token_id": ("<|mask|>", 151666),
        "eos_token_id": ("<|endoftext|>", 151643),
        "pad_token_id": ("<|endoftext|>", 151643),
        "bos_token_id": ("<|beginoftext|>", 151665),
    },
    "Fast_dLLM_Qwen": {
        "mask_token_id": (None, 151665),
        "eos_token_id": ("<|im_end|>", 151645),
        "pad_token_id": ("<|endoftext|>", 151643),
        "bos_token_id": (None, None),
    },
    "llada2_moe": {
        "mask_token_id": (None, 156895),
        "eos_token_id": ("<|endoftext|>", 156892),
        "pad_token_id": ("<|endoftext|>", 156892),
        "bos_token_id": ("<|startoftext|>", 156891),
    },
    "diffusion_gemma": {
        "mask_token_id": (None, None),  # uniform-state diffusion: none
        "eos_token_id": ("<eos>", 1),
        "pad_token_id": ("<pad>", 0),
        "bos_token_id": ("<bos>", 2),
    },
}
SPECIAL_TOKENS["sdar_moe"] = SPECIAL_TOKENS["sdar"]
QWEN_STOP_TOKENS = (("<|im_end|>", 151645), ("<|endoftext|>", 151643))
STOP_TOKENS = {
    "llada": (("<|endoftext|>", 126081), ("<|eot_id|>", 126348)),
    "sdar": QWEN_STOP_TOKENS,
    "Dream": QWEN_STOP_TOKENS,
    "Fast_dLLM_Qwen": QWEN_STOP_TOKENS,
    "sdar_moe": QWEN_STOP_TOKENS,
    "llada2_moe": (("<|endoftext|>", 156892),),
    "diffusion_gemma": (("<eos>", 1), ("<turn|>", 106)),
}
# special-id field -> the tokenizer_config.json entry naming its token
TOKENIZER_CONFIG_NAMES = {
    "mask_token_id": "mask_token",
    "eos_token_id": "eos_token",
    "pad_token_id": "pad_token",
    "bos_token_id": "bos_token",
}


class Tokenizer:
    def __init__(self, hf_tokenizer: HFTokenizer, family: str, configs: list[dict],
                 tokenizer_config: dict | None = None, chat_template: str | None = None):
        """configs: config.json then generation_config.json ({} when absent). chat_template: the
        checkpoint's jinja template, read only for the Qwen2.5 families' default system prompt."""
        self.hf = hf_tokenizer
        self.family = family
        tokenizer_config = tokenizer_config or {}
        self._named = {field: _token_content(tokenizer_config, name) for field, name in TOKENIZER_CONFIG_NAMES.items()}
        self.mask_id = self._resolve("mask_token_id", configs)
        self.eos_id = self._resolve("eos_token_id", configs)
        self.pad_id = self._resolve("pad_token_id", configs)
        self.bos_id = self._resolve("bos_token_id", configs)
        stop = [i for config in configs for i in _as_id_list(config.get("eos_token_id"))]
        stop += [self._vocab_id(token, default) for token, default in STOP_TOKENS[family]]
        self.stop_ids = tuple(dict.fromkeys(stop))
        qwen25 = family in QWEN25_CHAT_FAMILIES
        self.default_system_prompt = _qwen25_system_prompt(chat_template) if qwen25 else None

    @classmethod
    def from_dir(cls, path, family: str) -> "Tokenizer":
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unknown model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {directory}")
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        hf_tokenizer = _load_hf_tokenizer(directory, family, tokenizer_config)
        configs = [_read_json(directory / name) for name in ("config.json", "generation_config.json")]
        return cls(hf_tokenizer, family, configs, tokenizer_config, _chat_template(directory, tokenizer_config))

    def _vocab_id(self, token, default):
        token_id = self.hf.token_to_id(token) if token is not None else None
        return default if token_id is None else token_id

    def _resolve(self, field, configs):
        """First hit wins: config.json, generation_config.json (a list eos_token_id gives its first entry),
        tokenizer_config.json's token (a string or a {"content": ...} dict), the family's token string,
        its default id. LLaDA2's mask id is never looked up by name: which token holds it is not settled."""
        for config in configs:
            ids = _as_id_list(config.get(field))
            if ids:
                return ids[0]
        named_id = self._vocab_id(self._named[field], None)
        return named_id if named_id is not None else self._vocab_id(*SPECIAL_TOKENS[self.family][field])

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """As the `tokenizers` library decodes: skip_special_tokens drops every added token flagged special."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        _check_messages(messages)
        if self.family == "llada":
            return _llada_chat_text(messages, add_generation_prompt)
        if self.family in ("sdar", "sdar_moe"):
            return _qwen3_chat_text(messages, add_generation_prompt)
        if self.family == "llada2_moe":
            return _llada2_chat_text(messages, add_generation_prompt)
        if self.family == "diffusion_gemma":
            return _gemma_chat_text(messages, add_generation_prompt)
        return _qwen25_chat_text(messages, add_generation_prompt, self.default_system_prompt)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt))

    def encode_prompt(self, prompt, chat: bool = True) -> list[int]:
        """A string or a message list -> ids; a string becomes one user message when chat is True."""
        if isinstance(prompt, str):
            return self.chat([{"role": "user", "content": prompt}]) if chat else self.encode(prompt)
        return self.chat(prompt)


def _load_hf_tokenizer(directory: Path, family: str, tokenizer_config: dict) -> HFTokenizer:
    """tokenizer.json, else vocab.json + merges.txt (Dream ships only those files) plus the added tokens
    of tokenizer_config.json's added_tokens_decoder at their ids."""
    tokenizer_file = directory / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            return HFTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the library raises a bare Exception naming no file
            raise ValueError(f"{tokenizer_file} is not a tokenizer the tokenizers library reads: {err}") from None
    if family not in QWEN2_VOCAB_FAMILIES:
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    if not (vocab_file.is_file() and merges_file.is_file()):
        raise FileNotFoundError(f"no tokenizer found: looked for {tokenizer_file}, "
                                f"else {vocab_file} and {merges_file}")
    hf_tokenizer = _qwen2_tokenizer(vocab_file, merges_file)
    _add_tokens(hf_tokenizer, tokenizer_config.get("added_tokens_decoder") or {})
    return hf_tokenizer


def _qwen2_tokenizer(vocab_file: Path, merges_file: Path) -> HFTokenizer:
    """transformers' Qwen2 tokenizer (its Qwen2Converter) without the added tokens; the converter's
    ByteLevel post-processor only moves offsets, which nanodllm never reads, and is left out."""
    bpe = models.BPE.from_file(str(vocab_file), str(merges_file), dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False)
    hf_tokenizer = HFTokenizer(bpe)
    hf_tokenizer.normalizer = normalizers.NFC()
    hf_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf_tokenizer.decoder = decoders.ByteLevel()
    return hf_tokenizer


def _add_tokens(hf_tokenizer: HFTokenizer, added_tokens_decoder: dict) -> None:
    """Register tokenizer_config.json's added tokens in id order; each must land at its stated id."""
    for token_id, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        special = bool(entry.get("special", False))
        token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", not special), special=special)
        (hf_tokenizer.add_special_tokens if special else hf_tokenizer.add_tokens)([token])
        actual = hf_tokenizer.token_to_id(entry["content"])
        if actual != int(token_id):
            raise ValueError(f"tokenizer_config.json gives added token {entry['content']!r} id {token_id}, but it "
                             f"lands at id {actual} after a vocabulary of "
                             f"{hf_tokenizer.get_vocab_size(with_added_tokens=False)} tokens")


def _chat_template(directory: Path, tokenizer_config: dict):
    """chat_template.jinja where the checkpoint has one, else tokenizer_config.json's chat_template: the
    file wins, as in transformers' from_pretrained."""
    jinja_file = directory / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else tokenizer_config.get("chat_template")


def _qwen25_system_prompt(chat_template) -> str:
    """The literal '<|im_start|>system\\n...<|im_end|>\\n' of the no-tools branch of the checkpoint's
    chat template (chat_template.jinja, else tokenizer_config.json's chat_template); a template without
    one is a ValueError. Without a template it is ASSUMED to be "You are a helpful assistant."
    (Qwen2.5-*-Instruct's own templates say "You are Qwen, created by Alibaba Cloud. You are a helpful
    assistant.")."""
    if chat_template is None:
        return ASSUMED_QWEN25_SYSTEM_PROMPT
    match = QWEN25_DEFAULT_SYSTEM_TURN.search(chat_template) if isinstance(chat_template, str) else None
    if match is None:
        raise ValueError("the checkpoint's chat template is not a Qwen2.5 ChatML template nanodllm can port: "
                         "no default system turn '<|im_start|>system\\n...<|im_end|>\\n' found in it")
    return match.group(1)


def _token_content(tokenizer_config: dict, name: str):
    value = tokenizer_config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json {name} must be a token string or a {{'content': ...}} dict, "
                         f"got {value!r}")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _check_messages(messages):
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"message {index} must have exactly the keys 'role' and 'content' "
                             f"(tools, tool calls and reasoning fields are not supported): {message!r}")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"message {index} has role {message['role']!r}; supported: {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {index} content must be a string, got {type(message['content']).__name__}")


def _llada_chat_text(messages, add_generation_prompt):
    """LLaDA-8B-Instruct (Llama-3 style). The published template appends the assistant header even when
    add_generation_prompt is False; here the flag is honoured."""
    turns = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages]
    prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else ""
    return "<|startoftext|>" + "".join(turns) + prompt


LLADA2_ROLES = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


def _llada2_chat_text(messages, add_generation_prompt):
    """Ported from the Ling-2.0 family's template; the released tokenizer_config.json was not available
    to check against."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    text = f"<role>SYSTEM</role>{system}detailed thinking off<|role_end|>"
    text += "".join(f"<role>{LLADA2_ROLES[m['role']]}</role>{m['content']}<|role_end|>" for m in turns)
    return text + ("<role>ASSISTANT</role>" if add_generation_prompt else "")


def _is_user_query(message):
    content = message["content"]
    is_tool_response = content.startswith("<tool_response>") and content.endswith("</tool_response>")
    return message["role"] == "user" and not is_tool_response


def _qwen3_chat_text(messages, add_generation_prompt):
    """SDAR-Chat (Qwen3), content not stripped. As in Qwen3's template, an assistant message's
    "<think>...</think>" part is dropped unless the message comes after the last user query, and the
    final such message always gets a (possibly empty) <think> block. Qwen3's enable_thinking switch is
    not offered: the default (thinking enabled) adds nothing."""
    last = len(messages) - 1
    last_query = max((i for i, m in enumerate(messages) if _is_user_query(m)), default=last)
    text = ""
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role != "assistant":
            text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
            continue
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == last or reasoning):
            content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        text += f"<|im_start|>assistant\n{content}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _qwen25_chat_text(messages, add_generation_prompt, default_system_prompt):
    """Dream and Fast-dLLM v2 (Qwen2.5 ChatML): Qwen3's turns without <think> handling, and a system turn
    first: the leading system message, else the default system prompt."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system_prompt}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


GEMMA_ROLES = {"system": "system", "user": "user", "assistant": "model"}


def _gemma_chat_text(messages, add_generation_prompt):
    """DiffusionGemma (Gemma 4's turns), thinking off: '<bos>', each message as '<|turn>ROLE\n...<turn|>\n'
    (the assistant's role is "model"; content stripped, as Gemma's templates trim it), then the model's turn
    with an empty thought channel, as transformers' test of the template spells its ids. ASSUMED from
    Gemma 4's turn format, not checked against the released template: the system turn."""
    turns = "".join(f"<|turn>{GEMMA_ROLES[m['role']]}\n{m['content'].strip()}<turn|>\n" for m in messages)
    return "<bos>" + turns + ("<|turn>model\n<|channel>thought\n<channel|>" if add_generation_prompt else "")
