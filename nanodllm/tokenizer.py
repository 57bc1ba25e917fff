"""Tokenizer: a checkpoint's tokenizer.json, its special ids, and its chat template.

`Tokenizer.from_dir(path, family)` loads `<path>/tokenizer.json` with the `tokenizers` library
(no transformers needed). `family` is the config's model_type: "llada" or "sdar".

Special ids (mask_id, eos_id, pad_id, bos_id) are resolved field by field, first hit wins:
  1. config.json             mask_token_id / eos_token_id / pad_token_id / bos_token_id
  2. generation_config.json  the same fields
  3. the vocabulary, by token string (LLaDA: <|mdm_mask|>, <|endoftext|>, <|startoftext|>;
     SDAR: <|MASK|>, <|im_end|>, <|endoftext|>, no BOS string)
  4. documented defaults     LLaDA mask 126336, eos/pad 126081, bos 126080;
                             SDAR mask 151669, eos 151645, pad 151643, bos None
eos_token_id may be a list; eos_id is its first entry. stop_ids gathers, in order and without
repeats: the eos_token_id entries of config.json and generation_config.json, then the family's
stop tokens, each looked up in the vocabulary, else its default (LLaDA <|endoftext|> 126081 and
<|eot_id|> 126348; SDAR <|im_end|> 151645 and <|endoftext|> 151643).

Chat templates are Python ports of the published jinja templates, checked against them in
tests/test_tokenizer.py. Only plain {"role", "content"} messages with roles system/user/assistant
are supported; anything else is a ValueError.
  - LLaDA-8B-Instruct (Llama-3 style): <|startoftext|> once, then per message
    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>, then the header
    <|start_header_id|>assistant<|end_header_id|>\\n\\n. The published template appends that header
    even when add_generation_prompt is False; here the flag is honoured.
  - SDAR-Chat (Qwen3): <|im_start|>{role}\\n{content}<|im_end|>\\n per message (content not
    stripped), generation prompt <|im_start|>assistant\\n. As in Qwen3's template, an assistant
    message's "<think>...</think>" part is dropped unless the message comes after the last user
    query, and the final such message always gets a (possibly empty) <think> block. Qwen3's
    enable_thinking switch is not offered: the default (thinking enabled) adds nothing.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

SUPPORTED_FAMILIES = ("llada", "sdar")
CHAT_ROLES = ("system", "user", "assistant")

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
}
STOP_TOKENS = {
    "llada": (("<|endoftext|>", 126081), ("<|eot_id|>", 126348)),
    "sdar": (("<|im_end|>", 151645), ("<|endoftext|>", 151643)),
}


class Tokenizer:
    def __init__(self, hf_tokenizer: HFTokenizer, family: str, configs: list[dict]):
        self.hf = hf_tokenizer
        self.family = family
        self.mask_id = self._resolve("mask_token_id", configs)
        self.eos_id = self._resolve("eos_token_id", configs)
        self.pad_id = self._resolve("pad_token_id", configs)
        self.bos_id = self._resolve("bos_token_id", configs)
        stop = [i for config in configs for i in _as_id_list(config.get("eos_token_id"))]
        stop += [self._vocab_id(token, default) for token, default in STOP_TOKENS[family]]
        self.stop_ids = tuple(dict.fromkeys(stop))

    @classmethod
    def from_dir(cls, path, family: str) -> "Tokenizer":
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unknown model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {directory}")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
        configs = [_read_json(directory / name) for name in ("config.json", "generation_config.json")]
        return cls(HFTokenizer.from_file(str(tokenizer_file)), family, configs)

    def _vocab_id(self, token, default):
        token_id = self.hf.token_to_id(token) if token is not None else None
        return default if token_id is None else token_id

    def _resolve(self, field, configs):
        for config in configs:
            ids = _as_id_list(config.get(field))
            if ids:
                return ids[0]
        return self._vocab_id(*SPECIAL_TOKENS[self.family][field])

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        _check_messages(messages)
        render = _llada_chat_text if self.family == "llada" else _qwen3_chat_text
        return render(messages, add_generation_prompt)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt))

    def encode_prompt(self, prompt, chat: bool = True) -> list[int]:
        """A string or a message list -> ids; a string becomes one user message when chat is True."""
        if isinstance(prompt, str):
            return self.chat([{"role": "user", "content": prompt}]) if chat else self.encode(prompt)
        return self.chat(prompt)


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
    turns = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages]
    prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else ""
    return "<|startoftext|>" + "".join(turns) + prompt


def _is_user_query(message):
    content = message["content"]
    is_tool_response = content.startswith("<tool_response>") and content.endswith("</tool_response>")
    return message["role"] == "user" and not is_tool_response


def _qwen3_chat_text(messages, add_generation_prompt):
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
