"""Tests for nanodllm.tokenizer on tiny byte-level BPE tokenizers built in a temp dir.

The real vocabularies cannot be downloaded, so ids are checked through token strings, and the
chat templates are checked against the published jinja templates stored in
tests/fixtures/tokenizers/chat_templates.json, rendered the way transformers renders them. The
Qwen2 vocab.json + merges.txt loader is checked against golden encodings of transformers' slow
Qwen2Tokenizer in tests/fixtures/tokenizers/qwen2_bpe/ (written by scripts/make_fixtures.py).
"""

import functools
import json
import re
import shutil
import unicodedata
from pathlib import Path

import jinja2.ext
import pytest
from hypothesis import example, given, settings, strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

from nanodllm.config import preset
from nanodllm.tokenizer import CHAT_ROLES, SPECIAL_TOKENS, STOP_TOKENS, Tokenizer

FIXTURES = Path(__file__).parent / "fixtures/tokenizers"
TEMPLATES = json.loads((FIXTURES / "chat_templates.json").read_text())
QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# the same template with Qwen2.5-*-Instruct's default system prompt
TEMPLATES["qwen2.5-you-are-qwen"] = {
    **TEMPLATES["qwen2.5"],
    "chat_template": TEMPLATES["qwen2.5"]["chat_template"].replace("You are a helpful assistant.", QWEN_SYSTEM_PROMPT),
}
TEMPLATE_OF = {"llada": "llada", "sdar": "sdar", "Dream": "qwen2.5", "Fast_dLLM_Qwen": "qwen2.5"}
QWEN2_BPE = FIXTURES / "qwen2_bpe"
GOLDEN = json.loads((QWEN2_BPE / "golden.json").read_text())
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
    "Dream": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"],
    "Fast_dLLM_Qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
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


def write_configs(directory: Path, config, generation_config) -> Path:
    """config.json and generation_config.json in directory, each when given."""
    for name, content in (("config.json", config), ("generation_config.json", generation_config)):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


def make_checkpoint(directory: Path, family: str, config=None, generation_config=None,
                    with_special_tokens=True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json(family, with_special_tokens))
    return write_configs(directory, config, generation_config)


@pytest.fixture(scope="module")
def tokenizers_by_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: Tokenizer.from_dir(make_checkpoint(root / family, family), family)
            for family in FAMILY_TOKENS}


def qwen2_bpe_checkpoint(directory: Path, tokenizer_config_changes=None, config=None,
                         generation_config=None) -> Path:
    """The vocab.json + merges.txt fixture, its tokenizer_config.json updated with the given entries."""
    shutil.copytree(QWEN2_BPE, directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_config_changes or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return write_configs(directory, config, generation_config)


@pytest.fixture(scope="module")
def qwen25_tokenizers(tmp_path_factory):
    """Dream tokenizers whose tokenizer_config.json holds each stored Qwen2.5 template, by template name."""
    root = tmp_path_factory.mktemp("qwen25")
    checkpoints = {name: qwen2_bpe_checkpoint(root / name, {"chat_template": TEMPLATES[name]["chat_template"]})
                   for name in ("qwen2.5", "qwen2.5-you-are-qwen")}
    return {name: Tokenizer.from_dir(directory, "Dream") for name, directory in checkpoints.items()}


@functools.lru_cache(maxsize=None)
def compiled_template(name: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    return env.from_string(TEMPLATES[name]["chat_template"])


def render_published_template(name, messages, add_generation_prompt):
    special_tokens = {token: TEMPLATES[name][token] for token in ("bos_token", "eos_token")
                      if TEMPLATES[name][token] is not None}
    return compiled_template(name).render(messages=messages, tools=None, documents=None,
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
EXPECTED_CHAT_TEXT["Dream"] = EXPECTED_CHAT_TEXT["Fast_dLLM_Qwen"] = EXPECTED_CHAT_TEXT["sdar"]
TURN_START_TOKEN = {"llada": "<|start_header_id|>", "sdar": "<|im_start|>", "Dream": "<|im_start|>",
                    "Fast_dLLM_Qwen": "<|im_start|>"}
MASK_TOKEN = {"llada": "<|mdm_mask|>", "sdar": "<|MASK|>", "Dream": "<|mask|>", "Fast_dLLM_Qwen": None}


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
        assert render_published_template(TEMPLATE_OF[family], CONVERSATION, add_generation_prompt=True) == expected


def test_qwen25_chat_without_system_message_gets_the_default_one(tokenizers_by_family):
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "<think>x</think>y"},
                {"role": "system", "content": "later"}]
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n hi <|im_end|>\n"
                "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n<|im_start|>system\nlater<|im_end|>\n")
    for family in ("Dream", "Fast_dLLM_Qwen"):
        tok = tokenizers_by_family[family]
        assert tok.default_system_prompt == "You are a helpful assistant."
        assert tok.chat_text(messages, add_generation_prompt=False) == expected
        assert tok.chat_text(messages) == expected + "<|im_start|>assistant\n"


FRAGMENTS = ["<think>", "</think>", "<tool_response>", "</tool_response>", "\n", "\n\n", " ", "\t",
             "\u00a0", "\u3000", "\r\n", "é", "中文", "🙂", "a b", "x"]
free_text = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(FRAGMENTS)), max_size=6).map("".join)
message_content = st.one_of(free_text, free_text.map(lambda text: f"<tool_response>{text}</tool_response>"))
conversations = st.lists(st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": message_content}),
                         min_size=1, max_size=5)


# LLaDA's published template ignores add_generation_prompt, so it is compared with True only.
@pytest.mark.parametrize("family, add_generation_prompt", [("llada", True), ("sdar", True), ("sdar", False),
                                                           ("Dream", True), ("Dream", False),
                                                           ("Fast_dLLM_Qwen", True), ("Fast_dLLM_Qwen", False)])
@settings(max_examples=150, deadline=None)
@given(messages=conversations)
@example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"},
                   {"role": "assistant", "content": "b"}])
@example(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "<tool_response>42</tool_response>"},
                   {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"}])
@example(messages=[{"role": "system", "content": " s "}, {"role": "user", "content": " q\n"},
                   {"role": "assistant", "content": "\n\na "}])
@example(messages=[{"role": "user", "content": "q"}, {"role": "system", "content": "s"}])
def test_chat_text_equals_published_template(tokenizers_by_family, family, add_generation_prompt, messages):
    tok = tokenizers_by_family[family]
    expected = render_published_template(TEMPLATE_OF[family], messages, add_generation_prompt)
    assert tok.chat_text(messages, add_generation_prompt) == expected


system_message = st.fixed_dictionaries({"role": st.just("system"), "content": message_content})


# The default system prompt is read from the checkpoint's template: both variants, with and without
# a leading system message.
@pytest.mark.parametrize("template", ["qwen2.5", "qwen2.5-you-are-qwen"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@settings(max_examples=100, deadline=None)
@given(messages=conversations, leading_system=st.one_of(st.none(), system_message))
def test_qwen25_chat_text_equals_the_checkpoint_template(qwen25_tokenizers, template, add_generation_prompt,
                                                         messages, leading_system):
    messages = messages if leading_system is None else [leading_system, *messages]
    expected = render_published_template(template, messages, add_generation_prompt)
    assert qwen25_tokenizers[template].chat_text(messages, add_generation_prompt) == expected


def test_default_system_prompt_is_read_from_the_template(qwen25_tokenizers):
    assert qwen25_tokenizers["qwen2.5"].default_system_prompt == "You are a helpful assistant."
    tok = qwen25_tokenizers["qwen2.5-you-are-qwen"]
    assert tok.default_system_prompt == QWEN_SYSTEM_PROMPT
    text = tok.chat_text([{"role": "user", "content": "hi"}])
    assert text.startswith(f"<|im_start|>system\n{QWEN_SYSTEM_PROMPT}<|im_end|>\n")


def test_default_system_prompt_from_chat_template_jinja(tmp_path):
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt")
    (directory / "chat_template.jinja").write_text(TEMPLATES["qwen2.5-you-are-qwen"]["chat_template"])
    assert Tokenizer.from_dir(directory, "Fast_dLLM_Qwen").default_system_prompt == QWEN_SYSTEM_PROMPT


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    """A checkpoint with both templates reads the file's, as transformers' from_pretrained does."""
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt", {"chat_template": TEMPLATES["qwen2.5"]["chat_template"]})
    (directory / "chat_template.jinja").write_text(TEMPLATES["qwen2.5-you-are-qwen"]["chat_template"])
    assert Tokenizer.from_dir(directory, "Dream").default_system_prompt == QWEN_SYSTEM_PROMPT


@pytest.mark.parametrize("template", ["llada", "sdar", "{{ messages }}"])
def test_template_that_is_not_qwen25_chatml_raises(tmp_path, template):
    chat_template = TEMPLATES[template]["chat_template"] if template in TEMPLATES else template
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt", {"chat_template": chat_template})
    with pytest.raises(ValueError, match="not a Qwen2.5 ChatML template nanodllm can port"):
        Tokenizer.from_dir(directory, "Dream")


def test_only_qwen25_families_have_a_default_system_prompt(tokenizers_by_family):
    assert tokenizers_by_family["llada"].default_system_prompt is None
    assert tokenizers_by_family["sdar"].default_system_prompt is None


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


@pytest.mark.parametrize("family, mask, eos, pad, bos, stops", [
    ("llada", "<|mdm_mask|>", "<|endoftext|>", "<|endoftext|>", "<|startoftext|>", ("<|endoftext|>", "<|eot_id|>")),
    ("sdar", "<|MASK|>", "<|im_end|>", "<|endoftext|>", None, ("<|im_end|>", "<|endoftext|>")),
    ("Dream", "<|mask|>", "<|endoftext|>", "<|endoftext|>", "<|beginoftext|>", ("<|im_end|>", "<|endoftext|>")),
    ("Fast_dLLM_Qwen", 151665, "<|im_end|>", "<|endoftext|>", None, ("<|im_end|>", "<|endoftext|>")),  # no mask string
])
def test_ids_from_vocabulary(tmp_path, family, mask, eos, pad, bos, stops):
    """Token strings are looked up in the vocabulary (ints: the documented default, None: no token)."""
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, family), family)
    as_id = lambda token: vocab_id(tok, token) if isinstance(token, str) else token
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == tuple(map(as_id, (mask, eos, pad, bos)))
    assert tok.stop_ids == tuple(map(as_id, stops))


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
    assert tok.mask_id == (vocab_id(tok, MASK_TOKEN[family]) if MASK_TOKEN[family] else 151665)  # Fast-dLLM v2
    assert tok.stop_ids[:2] == (11, 12)


@pytest.mark.parametrize("family, ids, stops", [
    ("llada", (126336, 126081, 126081, 126080), (126081, 126348)),
    ("sdar", (151669, 151645, 151643, None), (151645, 151643)),
    ("Dream", (151666, 151643, 151643, 151665), (151645, 151643)),
    ("Fast_dLLM_Qwen", (151665, 151645, 151643, None), (151645, 151643)),
])
def test_defaults_when_vocabulary_lacks_the_tokens(tmp_path, family, ids, stops):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, family, with_special_tokens=False), family)
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == ids
    assert tok.stop_ids == stops


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


def test_dream_generation_config_values(tmp_path):
    generation_config = {"bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643}
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "Dream", {"model_type": "Dream"}, generation_config, False),
                             "Dream")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (151666, 151643, 151643, 151643)
    assert tok.stop_ids == (151643, 151645)


# The qwen2_bpe fixture's tokenizer_config.json names Dream's tokens: mask <|mask|>, eos and pad
# <|endoftext|>, bos <|beginoftext|>; ids 400.. are <|endoftext|>, <|im_start|>, <|im_end|>,
# <tool_call>, <|beginoftext|>, <|mask|>.
def test_tokenizer_config_names_win_over_the_family_strings(tmp_path):
    tok = Tokenizer.from_dir(qwen2_bpe_checkpoint(tmp_path / "ckpt"), "Fast_dLLM_Qwen")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (405, 400, 400, 404)
    assert tok.stop_ids == (402, 400)


def test_tokenizer_config_names_as_dicts_strings_nulls_and_unknown_tokens(tmp_path):
    changes = {"mask_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
               "pad_token": "<|not_in_vocabulary|>", "bos_token": None}
    tok = Tokenizer.from_dir(qwen2_bpe_checkpoint(tmp_path / "ckpt", changes), "Dream")
    assert (tok.mask_id, tok.eos_id) == (401, 402)
    assert tok.pad_id == 400  # unknown string: the family's <|endoftext|>
    assert tok.bos_id == 404  # null: the family's <|beginoftext|>


def test_generation_config_wins_over_tokenizer_config(tmp_path):
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt", config={"model_type": "Dream", "mask_token_id": 7},
                                     generation_config={"eos_token_id": [8, 9], "bos_token_id": 10})
    tok = Tokenizer.from_dir(directory, "Dream")
    assert (tok.mask_id, tok.eos_id, tok.pad_id, tok.bos_id) == (7, 8, 400, 10)
    assert tok.stop_ids == (8, 9, 402, 400)


def test_bad_tokenizer_config_token_entry(tmp_path):
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt", {"eos_token": ["<|im_end|>"]})
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(directory, "Dream")


@pytest.mark.parametrize("name, family", [("llada-8b", "llada"), ("sdar-8b", "sdar"), ("dream-7b", "Dream"),
                                          ("fast-dllm-v2-7b", "Fast_dLLM_Qwen"), ("llada2-mini", "llada2_moe")])
def test_defaults_agree_with_model_config(name, family):
    config = preset(name)
    assert config.mask_token_id == SPECIAL_TOKENS[family]["mask_token_id"][1]
    assert config.eos_token_ids == tuple(default for _, default in STOP_TOKENS[family])


# ---- Qwen2 vocab.json + merges.txt vs transformers' slow Qwen2Tokenizer ------------------------

@pytest.fixture(scope="module", params=["sdar", "Dream", "Fast_dLLM_Qwen"])
def qwen2_bpe_tokenizer(request):
    return Tokenizer.from_dir(QWEN2_BPE, request.param)


@pytest.mark.parametrize("case", GOLDEN["encode"], ids=range(len(GOLDEN["encode"])))
def test_qwen2_bpe_matches_slow_transformers_tokenizer(qwen2_bpe_tokenizer, case):
    tok = qwen2_bpe_tokenizer
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
    assert tok.decode(case["ids"]) == case["decoded_skip_special"]


@pytest.mark.parametrize("case", GOLDEN["decode"], ids=range(len(GOLDEN["decode"])))
def test_qwen2_bpe_decodes_partial_characters_like_slow_transformers_tokenizer(qwen2_bpe_tokenizer, case):
    assert qwen2_bpe_tokenizer.decode(case["ids"], skip_special_tokens=False) == case["decoded"]


def test_qwen2_bpe_added_tokens_at_their_ids(qwen2_bpe_tokenizer):
    tok = qwen2_bpe_tokenizer
    added = json.loads((QWEN2_BPE / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert tok.vocab_size == 400 + len(added)
    for token_id, entry in added.items():
        assert tok.encode(f"x{entry['content']}y")[1:-1] == [int(token_id)]
        assert tok.decode([int(token_id)]) == ("" if entry["special"] else entry["content"])


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_qwen2_bpe_decode_inverts_encode_up_to_nfc(qwen2_bpe_tokenizer, text):
    tok = qwen2_bpe_tokenizer
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_tokenizer_json_wins_over_vocab_and_merges(tmp_path):
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt")
    (directory / "tokenizer.json").write_text(tokenizer_json("Dream", True))
    tok = Tokenizer.from_dir(directory, "Dream")
    assert tok.vocab_size == HFTokenizer.from_str(tokenizer_json("Dream", True)).get_vocab_size()


@pytest.mark.parametrize("content, token_id", [("<|endoftext|>", "401"), ("a", "400")])
def test_added_token_at_another_id_raises(tmp_path, content, token_id):
    added = {token_id: {"content": content, "special": True}}
    directory = qwen2_bpe_checkpoint(tmp_path / "ckpt", {"added_tokens_decoder": added})
    with pytest.raises(ValueError, match=re.escape(f"{content!r} id {token_id}")):
        Tokenizer.from_dir(directory, "Dream")


# ---- errors ---------------------------------------------------------------------------------

def test_unknown_family_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="llada.*sdar.*Dream.*Fast_dLLM_Qwen"):
        Tokenizer.from_dir(make_checkpoint(tmp_path, "llada"), "dream")


def test_missing_directory(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        Tokenizer.from_dir(missing, "llada")


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path, "sdar")


@pytest.mark.parametrize("present", [(), ("vocab.json",), ("merges.txt",)])
@pytest.mark.parametrize("family", ["sdar", "Dream", "Fast_dLLM_Qwen"])
def test_missing_tokenizer_files_name_what_was_looked_for(tmp_path, family, present):
    for name in present:
        shutil.copy(QWEN2_BPE / name, tmp_path / name)
    with pytest.raises(FileNotFoundError) as error:
        Tokenizer.from_dir(tmp_path, family)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        assert str(tmp_path / name) in str(error.value)


def test_llada_needs_tokenizer_json(tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(QWEN2_BPE / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path, "llada")


@pytest.mark.parametrize("name, family", [("tiny-llada", "llada"), ("tiny-sdar", "sdar")])
def test_a_shipped_models_config_stops_where_its_tokenizer_does(name, family):
    """generate() called without stop_ids stops on the config's ids: for the tiny models they are the
    tokenizer's (its end of turn and end of text), not the 8B vocabulary's ids beyond the tiny one."""
    from nanodllm.config import ModelConfig

    folder = Path(__file__).resolve().parents[1] / "nanodllm" / "assets" / name
    cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()), source=name)
    assert cfg.eos_token_ids == Tokenizer.from_dir(folder, family).stop_ids
    assert all(i < cfg.vocab_size for i in cfg.eos_token_ids)


def test_diffusion_gemma_chat_spells_transformers_ids():
    """transformers' test of DiffusionGemma's template: one user message -> ids 2, 105, user, \\n, ..., 106, \\n,
    105, model, \\n, 100, thought, \\n, 101 (<bos><|turn>user\\n...<turn|>\\n<|turn>model\\n<|channel>thought\\n
    <channel|>); the fixture's word-level tokenizer holds Gemma 4's special tokens at those ids."""
    tok = Tokenizer.from_dir(Path(__file__).parent / "fixtures" / "diffusion_gemma_tiny", "diffusion_gemma")
    message = [{"role": "user", "content": " Write a long essay about Portugal. "}]
    assert tok.chat_text(message) == ("<bos><|turn>user\nWrite a long essay about Portugal.<turn|>\n<|turn>model\n"
                                      "<|channel>thought\n<channel|>")
    word = tok.hf.token_to_id
    ids = tok.chat([{"role": "user", "content": "hello"}])
    assert ids == [2, 105, word("user"), word("hello"), 106, 105, word("model"), 100, word("thought"), 101]
    assert tok.stop_ids == (1, 106) and tok.mask_id is None and (tok.bos_id, tok.pad_id, tok.eos_id) == (2, 0, 1)
    answered = tok.chat_text([*message, {"role": "assistant", "content": "Portugal is"}], add_generation_prompt=False)
    assert answered.endswith("<turn|>\n<|turn>model\nPortugal is<turn|>\n")


def test_llada2_chat_matches_literal_template():
    """The Ling-2.0 port: a leading system message fills the SYSTEM turn (once), the user is HUMAN, and
    every conversation starts with the SYSTEM turn, empty when no system message is given."""
    tok = Tokenizer.from_dir(Path(__file__).parent / "fixtures" / "llada2_tiny", "llada2_moe")
    assert tok.chat_text(CONVERSATION) == (
        "<role>SYSTEM</role>You are helpful.detailed thinking off<|role_end|>"
        "<role>HUMAN</role>  What is 2+2?\n<|role_end|><role>ASSISTANT</role>4<|role_end|>"
        "<role>HUMAN</role>And 3+3?<|role_end|><role>ASSISTANT</role>")
    assert tok.chat_text([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>hi<|role_end|>")


def test_added_tokens_land_at_their_ids_across_a_digit_boundary(tmp_path):
    """added_tokens_decoder's keys are strings: the tokens are registered in their ids' numeric order (the
    strings' order would put "1000" before "400"), so ids 400..1001 each land where the config says."""
    added = json.loads((QWEN2_BPE / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    added.update({str(i): {"content": f"<|extra_{i}|>", "special": i % 2 == 0} for i in range(406, 1002)})
    tok = Tokenizer.from_dir(qwen2_bpe_checkpoint(tmp_path / "ckpt", {"added_tokens_decoder": added}), "Dream")
    assert tok.vocab_size == 1002
    assert all(tok.hf.token_to_id(entry["content"]) == int(token_id) for token_id, entry in added.items())
