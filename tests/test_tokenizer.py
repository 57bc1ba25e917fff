"""Tests for nanodllm.tokenizer on tiny byte-level BPE tokenizers built in a temp dir.

The real vocabularies cannot be downloaded, so ids are checked through token strings, and the
chat templates are checked against the published jinja templates stored in
tests/fixtures/tokenizers/chat_templates.json, rendered the way transformers renders them.
"""

import functools
import json
import re
from pathlib import Path

import jinja2.ext
import pytest
from hypothesis import example, given, settings, strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from nanodllm.tokenizer import CHAT_ROLES, Tokenizer

TEMPLATES = json.loads((Path(__file__).parent / "fixtures/tokenizers/chat_templates.json").read_text())
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2+2? The answer is 4.",
    "You are a helpful assistant. Please reason step by step.",
    "Diffusion language models unmask tokens in parallel.",
]
FAMILY_TOKENS = {
    "llada": ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>",
              "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "sdar": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"],
}


@functools.lru_cache(maxsize=None)
def tokenizer_json(family: str, with_special_tokens: bool) -> str:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(CORPUS, trainer)
    if with_special_tokens:
        hf.add_special_tokens(FAMILY_TOKENS[family])
    return hf.to_str()


def make_checkpoint(directory: Path, family: str, config=None, generation_config=None,
                    with_special_tokens=True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json(family, with_special_tokens))
    for name, content in (("config.json", config), ("generation_config.json", generation_config)):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


@pytest.fixture(scope="module")
def tokenizers_by_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: Tokenizer.from_dir(make_checkpoint(root / family, family), family)
            for family in FAMILY_TOKENS}


@functools.lru_cache(maxsize=None)
def compiled_template(family: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    return env.from_string(TEMPLATES[family]["chat_template"])


def render_published_template(family, messages, add_generation_prompt):
    special_tokens = {name: TEMPLATES[family][name] for name in ("bos_token", "eos_token")
                      if TEMPLATES[family][name] is not None}
    return compiled_template(family).render(messages=messages, tools=None, documents=None,
                                            add_generation_prompt=add_generation_prompt, **special_tokens)


# ---- chat templates -------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
EXPECTED_CHAT_TEXT = {
    "llada": (
        "<|startoftext|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "sdar": (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\n  What is 2+2?\n<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
}
TURN_START_TOKEN = {"llada": "<|start_header_id|>", "sdar": "<|im_start|>"}
MASK_TOKEN = {"llada": "<|mdm_mask|>", "sdar": "<|MASK|>"}


@pytest.mark.parametrize("family", FAMILY_TOKENS)
def test_chat_matches_literal_template(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    expected = EXPECTED_CHAT_TEXT[family]
    assert tok.chat_text(CONVERSATION) == expected
    ids = tok.chat(CONVERSATION)
    assert ids == tok.encode(expected)
    assert ids.count(tok.hf.token_to_id(TURN_START_TOKEN[family])) == 5
    assert tok.decode(ids, skip_special_tokens=False) == expected


def test_llada_chat_without_generation_prompt(tokenizers_by_family):
    text = tokenizers_by_family["llada"].chat_text([{"role": "user", "content": "hi "}], add_generation_prompt=False)
    assert text == "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"


def test_qwen3_final_assistant_message_gets_think_block(tokenizers_by_family):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"}]
    text = tokenizers_by_family["sdar"].chat_text(messages, add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello<|im_end|>\n"
    earlier = messages + [{"role": "user", "content": "and?"}]
    text = tokenizers_by_family["sdar"].chat_text(earlier)
    assert "<|im_start|>assistant\nhello<|im_end|>\n" in text


def test_published_templates_render_the_literal_examples():
    for family, expected in EXPECTED_CHAT_TEXT.items():
        assert render_published_template(family, CONVERSATION, add_generation_prompt=True) == expected


FRAGMENTS = ["<think>", "</think>", "<tool_response>", "</tool_response>", "\n", "\n\n", " ", "\t",
             "\u00a0", "\u3000", "\r\n", "é", "中文", "🙂", "a b", "x"]
free_text = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(FRAGMENTS)), max_size=6).map("".join)
message_content = st.one_of(free_text, free_text.map(lambda text: f"<tool_response>{text}</tool_response>"))
conversations = st.lists(st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": message_content}),
                         min_size=1, max_size=5)


# LLaDA's published template ignores add_generation_prompt, so it is compared with True only.
@pytest.mark.parametrize("family, add_generation_prompt", [("llada", True), ("sdar", True), ("sdar", False)])
@settings(max_examples=150, deadline=None)
@given(messages=conversations)
@example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"},
                   {"role": "assistant", "content": "b"}])
@example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "<tool_response>42</tool_response>"},
                   {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"}])
@example(messages=[{"role": "system", "content": " s "}, {"role": "user", "content": " q\n"},
                   {"role": "assistant", "content": "\n\na "}])
def test_chat_text_equals_published_template(tokenizers_by_family, family, add_generation_prompt, messages):
    tok = tokenizers_by_family[family]
    expected = render_published_template(family, messages, add_generation_prompt)
    assert tok.chat_text(messages, add_generation_prompt) == expected


BAD_MESSAGES = [
    [],
    "hello",
    [{"role": "tool", "content": "42"}],
    [{"role": "ipython", "content": "42"}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
    [{"role": "assistant", "content": "hi", "reasoning_content": "hmm"}],
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    ["hi"],
]


@pytest.mark.parametrize("family", FAMILY_TOKENS)
@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_unsupported_messages_raise(tokenizers_by_family, family, messages):
    with pytest.raises(ValueError):
        tokenizers_by_family[family].chat(messages)


# ---- encode / decode ------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_TOKENS)
def test_special_token_strings_encode_to_single_ids(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    for token in FAMILY_TOKENS[family]:
        token_id = tok.hf.token_to_id(token)
        assert tok.encode(token) == [token_id]
        assert tok.encode(f"a{token}b").count(token_id) == 1


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_decode_inverts_encode(tokenizers_by_family, text):
    tok = tokenizers_by_family["sdar"]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizers_by_family):
    tok = tokenizers_by_family["sdar"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_encode_adds_no_special_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "llada"), "llada")
    bos = tok.hf.token_to_id("<|startoftext|>")
    tok.hf.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A",
                                                          special_tokens=[("<|startoftext|>", bos)])
    assert tok.hf.encode("hello").ids[0] == bos
    assert bos not in tok.encode("hello")


def test_encode_prompt(tokenizers_by_family):
    tok = tokenizers_by_family["llada"]
    assert tok.encode_prompt("hi") == tok.chat([{"role": "user", "content": "hi"}])
    assert tok.encode_prompt("hi", chat=False) == tok.encode("hi")
    assert tok.encode_prompt(CONVERSATION) == tok.chat(CONVERSATION)


# ---- special ids ----------------------------------------------------------------------------

def vocab_id(tok, token):
    return tok.hf.token_to_id(token)


def test_llada_ids_from_vocabulary(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "llada"), "llada")
    assert tok.mask_id == vocab_id(tok, "<|mdm_mask|>")
    assert tok.eos_id == tok.pad_id == vocab_id(tok, "<|endoftext|>")
    assert tok.bos_id == vocab_id(tok, "<|startoftext|>")
    assert tok.stop_ids == (vocab_id(tok, "<|endoftext|>"), vocab_id(tok, "<|eot_id|>"))


def test_sdar_ids_from_vocabulary(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "sdar"), "sdar")
    assert tok.mask_id == vocab_id(tok, "<|MASK|>")
    assert tok.eos_id == vocab_id(tok, "<|im_end|>")
    assert tok.pad_id == vocab_id(tok, "<|endoftext|>")
    assert tok.bos_id is None
    assert tok.stop_ids == (vocab_id(tok, "<|im_end|>"), vocab_id(tok, "<|endoftext|>"))


@pytest.mark.parametrize("family", FAMILY_TOKENS)
def test_config_json_wins_over_generation_config_and_vocabulary(tmp_path, family):
    config = {"model_type": family, "mask_token_id": 3, "eos_token_id": [5, 6], "pad_token_id": 7, "bos_token_id": 8}
    generation_config = {"mask_token_id": 9, "eos_token_id": 10, "pad_token_id": 11, "bos_token_id": 12}
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, family, config, generation_config), family)
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (3, 5, 7, 8)
    assert tok.stop_ids[:3] == (5, 6, 10)


@pytest.mark.parametrize("family", FAMILY_TOKENS)
def test_generation_config_fills_fields_config_lacks(tmp_path, family):
    config = {"model_type": family, "eos_token_id": None}
    generation_config = {"eos_token_id": [11, 12], "pad_token_id": 13}
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, family, config, generation_config), family)
    assert (tok.eos_id, tok.pad_id) == (11, 13)
    assert tok.mask_id == vocab_id(tok, MASK_TOKEN[family])
    assert tok.stop_ids[:2] == (11, 12)


def test_llada_defaults_when_vocabulary_lacks_the_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "llada", with_special_tokens=False), "llada")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (126336, 126081, 126081, 126080)
    assert tok.stop_ids == (126081, 126348)


def test_sdar_defaults_when_vocabulary_lacks_the_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "sdar", with_special_tokens=False), "sdar")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (151669, 151645, 151643, None)
    assert tok.stop_ids == (151645, 151643)


def test_released_llada_config_values(tmp_path):
    config = {"model_type": "llada", "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "llada", config, with_special_tokens=False), "llada")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (126336, 126081, 126081, 126080)
    assert tok.stop_ids == (126081, 126348)


def test_qwen3_style_sdar_config_values(tmp_path):
    config = {"model_type": "sdar", "bos_token_id": 151643, "eos_token_id": 151645}
    generation_config = {"eos_token_id": [151645, 151643], "pad_token_id": 151643}
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "sdar", config, generation_config, False), "sdar")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (151669, 151645, 151643, 151643)
    assert tok.stop_ids == (151645, 151643)


# ---- errors ---------------------------------------------------------------------------------

def test_unknown_family_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="llada.*sdar"):
        Tokenizer.from_dir(make_checkpoint(tmp_path, "llada"), "dream")


def test_missing_directory(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        Tokenizer.from_dir(missing, "llada")


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path, "sdar")
