"""Synthetic long-context tasks (determinism, needle placement, lengths) and the LongBench metrics."""

import itertools
import json
import math
import random
import re
import time

import pytest
from hypothesis import given, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from nanodllm.tasks import (
    DEPTHS, FILLER_WORDS, KV_KEYS, KV_LINE, MULTIKEY_NEEDLE, NAME_ADJECTIVES, NAME_ANIMALS, SENTENCE_TEMPLATES,
    TASKS, Sample,
    classification_score, code_sim, corpus, count_score, count_words, exact_match, filler, length_tolerance,
    load_longbench, make_sample, make_samples, normalize_answer, qa_f1, retrieval_score, rouge_l, score,
)

tasks = st.sampled_from(TASKS)
seeds = st.integers(0, 2**32)
depths = st.floats(0.0, 1.0)
lengths = st.integers(64, 1024)


def count_digit_split(text):
    """A BPE-like count: digits one by one, letter runs and punctuation marks one each."""
    return len(re.findall(r"\d|[^\W\d]+|[^\w\s]", text))


def context_of(sample):
    return sample.prompt[sample.meta["context_start"]:sample.meta["context_end"]]


def longest_piece(context):
    return max(len(piece) for piece in re.split(r"(?<=\.)\s", context))


@given(task=tasks, length=lengths, depth=depths, seed=seeds)
def test_same_seed_same_sample_other_seed_differs(task, length, depth, seed):
    sample = make_sample(task, length, depth, seed)
    assert make_sample(task, length, depth, seed) == sample
    assert make_sample(task, length, depth, seed + 1).prompt != sample.prompt


@given(task=tasks, length=lengths, depth=depths, seed=seeds)
def test_needle_is_where_meta_says_at_the_asked_depth(task, length, depth, seed):
    sample = make_sample(task, length, depth, seed)
    needle, offset = sample.meta["needle"], sample.meta["needle_offset"]
    assert sample.prompt[offset:offset + len(needle)] == needle
    assert sample.answer in needle and sample.depth == depth and sample.length == length
    context = context_of(sample)
    rest = len(context) - len(needle)  # the context around the needle
    if rest:
        position = (offset - sample.meta["context_start"]) / rest
        assert position == pytest.approx(sample.meta["position"])
        assert abs(position - depth) <= (longest_piece(context) + 1) / rest


@given(task=tasks, length=lengths, depth=depths, seed=seeds)
def test_answer_appears_only_inside_its_needle(task, length, depth, seed):
    sample = make_sample(task, length, depth, seed)
    start = sample.meta["needle_offset"]
    end = start + len(sample.meta["needle"])
    hits = [m.start() for m in re.finditer(re.escape(sample.answer), sample.prompt)]
    assert hits and all(start <= hit < end for hit in hits)
    if task == "multikey":
        assert sample.prompt.count(sample.answer) == 1
        assert all(sample.prompt.count(number) == 1 for _, number in sample.meta["distractors"])
        assert sample.prompt.endswith(f" What is the pass key for the {sample.meta['key']}?")
        words = [word for name in [sample.meta["key"], *(name for name, _ in sample.meta["distractors"])]
                 for word in name.split()]
        assert len(set(words)) == len(words)  # no adjective or animal is shared: one word names a needle


def test_passkey_and_kv_prompts_have_their_frame():
    passkey = make_sample("passkey", 256, 0.5, seed=0)
    assert passkey.prompt.startswith("There is a pass key hidden in this text. Find it and remember it. ")
    assert passkey.prompt.endswith(" What is the pass key?")
    assert re.fullmatch(r"[1-9]\d{4}", passkey.answer)
    assert passkey.meta["needle"] == f"The pass key is {passkey.answer}. Remember it. {passkey.answer} is the pass key."
    kv = make_sample("kv", 256, 0.5, seed=0)
    assert kv.prompt.startswith("Here are key value pairs. Find the value of the key asked for.\n")
    assert kv.prompt.endswith(f"\nWhat is the value of {kv.meta['key']}?")
    assert kv.meta["needle"] == f"{kv.meta['key']} : {kv.answer} ."


@given(seed=seeds, length=st.integers(64, 4096))
def test_kv_keys_are_distinct_key_words_and_values_distinct_codes(seed, length):
    lines = context_of(make_sample("kv", length, 0.5, seed)).split("\n")
    keys, values = zip(*(re.fullmatch(r"([a-z]{4}) : (\d{6}) \.", line).groups() for line in lines))
    assert len(set(keys)) == len(keys) and set(keys) <= set(KV_KEYS)
    assert len(set(values)) == len(values)


def test_key_words_are_not_inside_any_other_word_of_the_tasks():
    words = set(re.findall(r"[a-z]+", " ".join(make_sample(task, 1024, 0.5, 0).prompt.lower()
                                                 for task in ("passkey", "multikey"))))
    assert len(set(KV_KEYS)) == len(KV_KEYS) >= 1500
    assert not any(key in word for key in KV_KEYS for word in words)


def test_a_kv_prompt_longer_than_the_key_words_allow_is_refused():
    with pytest.raises(ValueError, match="needs 2043 distinct keys, more than the 1536 of KV_KEYS"):
        make_sample("kv", 8192, 0.5, seed=0)
    assert make_sample("kv", 8192, 0.5, seed=0, count_tokens=count_digit_split).meta["tokens"] > 8000


@given(seed=seeds)
def test_filler_has_no_digits_names_or_pass_key_words(seed):
    sentences = filler(random.Random(seed), 200)
    words = set(re.findall(r"\w+", " ".join(sentences).lower()))
    assert not any(character.isdigit() for sentence in sentences for character in sentence)
    assert not words & (set(NAME_ADJECTIVES) | set(NAME_ANIMALS) | {"pass", "key", "value", "remember"})
    assert words <= {word.lower() for group in FILLER_WORDS.values() for phrase in group for word in phrase.split()} \
        | {"the", "a", "to", "near", "in", "is", "and"}


@pytest.mark.parametrize("count_tokens", [None, count_digit_split, lambda text: len(text) // 4])
@pytest.mark.parametrize("length", [64, 100, 256, 1000, 4096, 8192])
@pytest.mark.parametrize("task", TASKS)
def test_prompt_length_is_within_tolerance(task, length, count_tokens):
    count = count_tokens or count_words
    if task == "multikey" and length < 100 and count_tokens is count_digit_split:
        # the frame alone (intro, 4 needles, question) is 82 digit-split tokens: nothing is added to it
        sample = make_sample(task, length, 0.5, seed=7, count_tokens=count_tokens)
        assert 82 <= count(sample.prompt) <= 100 and sample.meta["tokens"] == count(sample.prompt)
        return
    if task == "kv" and length == 8192 and count_tokens is not count_digit_split:
        with pytest.raises(ValueError, match="distinct keys"):  # 4 tokens a line: more lines than keys
            make_sample(task, length, 0.5, seed=7, count_tokens=count_tokens)
        return
    for depth in (0.0, 0.5, 1.0):
        sample = make_sample(task, length, depth, seed=7, count_tokens=count_tokens)
        assert sample.meta["tokens"] == count(sample.prompt)
        assert abs(count(sample.prompt) - length) <= max(0.03 * length, 16)


@given(tasks, st.integers(128, 1024), depths, seeds)
def test_an_additive_count_lands_within_half_a_piece_of_the_length(task, length, depth, seed):
    """count_words adds up over pieces, so the prompt stops within half of its longest possible piece of
    the asked length: a filler sentence with each slot's wordiest choice, or a kv line."""
    wordiest = {slot: max(words, key=count_words) for slot, words in FILLER_WORDS.items()}
    sentence = max(count_words(" " + template.format(**wordiest)) for template in SENTENCE_TEMPLATES)
    piece = count_words("\n" + KV_LINE.format(key=KV_KEYS[0], value="123456")) if task == "kv" else sentence
    assert abs(make_sample(task, length, depth, seed).meta["tokens"] - length) <= piece / 2

def test_lengths_hold_with_a_small_bpe_trained_on_the_corpus():
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tokenizer.train_from_iterator(corpus(60, seed=0), trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"]))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    for task in TASKS:
        for length in (128, 1000, 4096):
            sample = make_sample(task, length, 0.25, seed=2, count_tokens=count)
            assert abs(count(sample.prompt) - length) <= length_tolerance(length)


def test_an_8k_sample_is_fast():
    make_sample("kv", 8192, 0.5, seed=0, count_tokens=count_digit_split)
    start = time.perf_counter()
    for task in TASKS:
        make_sample(task, 8192, 0.5, seed=1, count_tokens=count_digit_split)
    assert time.perf_counter() - start < 1.0  # about 50 ms for all three here


@pytest.mark.parametrize("task", TASKS)
def test_lengths_of_one_seed_share_the_needle_under_a_count_that_is_not_additive(task):
    """A count that grows faster than its pieces' (words ** 1.1) makes the sample be rebuilt at a rescaled
    budget: from the same draws, so every length and depth of one seed still holds the same needle."""
    count = lambda text: int(count_words(text) ** 1.1)
    samples = [make_sample(task, length, depth, seed=7, count_tokens=count) for length in (128, 512, 2048)
               for depth in (0.0, 0.5)]
    assert len({sample.answer for sample in samples}) == 1
    assert samples[0].answer == make_sample(task, 128, 0.5, seed=7).answer


@given(seed=seeds, length=lengths)
def test_multikey_meta_pairs_each_distractor_with_the_number_its_needle_gives(seed, length):
    sample = make_sample("multikey", length, 0.5, seed)
    assert len(sample.meta["distractors"]) == 3
    for name, number in sample.meta["distractors"]:
        assert MULTIKEY_NEEDLE.format(name=name, number=number) in sample.prompt


def test_make_samples_cycles_depths_and_differs_per_sample():
    samples = make_samples("passkey", 128, 7, seed=3)
    assert [s.depth for s in samples] == [*DEPTHS, *DEPTHS[:2]]
    assert len({s.answer for s in samples}) == 7
    assert make_samples("passkey", 128, 7, seed=3) == samples
    assert [s.depth for s in make_samples("kv", 128, 3, seed=0, depths=[0.1])] == [0.1] * 3


def test_depth_none_is_drawn_from_the_seed():
    sample = make_sample("multikey", 200, None, seed=5)
    assert 0.0 <= sample.depth <= 1.0
    assert make_sample("multikey", 200, None, seed=5) == sample


def test_corpus_is_deterministic_and_covers_the_tasks():
    texts = list(corpus(9, seed=0))
    assert texts == list(corpus(9, seed=0)) and texts != list(corpus(9, seed=1))
    assert sum(t.startswith("There is a pass key") and " for the " not in t for t in texts) == 3
    assert sum("What is the pass key for the " in t for t in texts) == 3
    assert sum(t.startswith("Here are key value pairs") for t in texts) == 3
    assert all(64 - 16 <= count_words(t) <= 512 + 32 for t in texts)


@pytest.mark.parametrize("call,message", [
    (lambda: make_sample("haystack", 256, 0.5, 0), "unknown task 'haystack'; choose from passkey, multikey, kv"),
    (lambda: make_sample("kv", 63, 0.5, 0), "length must be at least 64 tokens, got 63"),
    (lambda: make_sample("kv", 256, 1.5, 0), r"depth must be in \[0, 1\], got 1.5"),
    (lambda: make_sample("kv", 256, -0.1, 0), "depth"),
    (lambda: make_samples("kv", 256, 2, 0, depths=[]), "depths must not be empty"),
])
def test_bad_requests_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_normalize_and_exact_match():
    assert normalize_answer("  The Cat, sat!  on a mat. ") == "cat sat on mat"
    assert exact_match("The pass key is 12345.", ["12345"]) == 0.0  # strict: equality only
    assert exact_match(" 12345.\n", ["12345"]) == 1.0
    assert exact_match("An Apple!", ["banana", "apple"]) == 1.0
    assert exact_match("12345", "12345") == 1.0  # a bare string is one answer


def test_qa_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]; overlap 2
    # P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert qa_f1("the cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    # best answer counts: "dog" scores 0, "cat" gives P = 1/2, R = 1 -> 2/3
    assert qa_f1("black cat", ["dog", "cat"]) == pytest.approx(2 / 3)
    # repeated tokens are matched at most as often as they occur: overlap 1 of P 1/2, R 1
    assert qa_f1("yes yes", ["yes"]) == pytest.approx(2 / 3)
    assert qa_f1("", ["cat"]) == 0.0


def test_rouge_l_by_hand():
    # pred [police, killed, the, gunman], ref [the, police, kill, the, gunman]
    # LCS = police, the, gunman = 3; P = 3/4, R = 3/5, F = 2PR/(P+R) = 0.9/1.35 = 2/3
    assert rouge_l("police killed the gunman", ["the police kill the gunman"]) == pytest.approx(2 / 3)
    assert rouge_l("The cat sat.", ["The cat sat"]) == pytest.approx(1.0)  # "." dropped
    assert rouge_l("", ["cat"]) == 0.0


def test_code_sim_by_hand():
    # comment and fence lines are skipped; "x = 1" vs "x = 2": 4 of 5 chars match each way,
    # difflib ratio = 2 * 4 / 10 = 0.8
    assert code_sim("\n# set x\n```\nx = 1\ny = 2", ["x = 2"]) == pytest.approx(0.8)
    assert code_sim("return a + b", ["return a + b", "pass"]) == 1.0
    assert code_sim("// only a comment", ["x"]) == 0.0


def test_code_sim_rounds_the_ratio_to_the_nearest_percent():
    # "ab" in "abcd": difflib ratio = 2 * 2 / 6 = 0.666..., fuzz.ratio 67
    assert code_sim("ab", ["abcd"]) == 0.67


def test_classification_retrieval_and_count_scores():
    classes = ["Location", "Description", "Entity", "Human being", "Human"]
    # "Human" is dropped as a proper part of the answer "Human being": one class left -> 1.0
    assert classification_score("Type: Human being", ["Human being"], classes) == 1.0
    # two classes named, the answer is one of them -> 1/2
    assert classification_score("Entity or Location", ["Location"], classes) == 0.5
    # numbers 3 and 12 found, one equals paragraph 12 -> 1/2
    assert retrieval_score("Paragraph 3 or 12", ["Paragraph 12"]) == 0.5
    assert count_score("There are 7 paragraphs", ["7"]) == 1.0


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


RECORD = {"input": "Who sat?", "context": "The cat sat on the mat.", "answers": ["the cat", "a cat"],
          "length": 6, "dataset": "hotpotqa", "_id": "abc", "all_classes": None}


def test_load_longbench_reads_samples_and_scores_them(tmp_path):
    path = write_jsonl(tmp_path / "lb.jsonl", [RECORD, "", {**RECORD, "dataset": "samsum", "_id": "d"}])
    first, second = load_longbench(path)
    assert first == Sample("hotpotqa", "The cat sat on the mat.\n\nWho sat?", "the cat", ("the cat", "a cat"),
                           6, first.depth, {"id": "abc", "all_classes": ()})
    assert math.isnan(first.depth)
    assert score(first, "The cat!") == 1.0
    assert score(second, "the cat\nsat on the mat") == 1.0  # samsum scores the first line only
    assert score(first, "nobody\nthe cat") == pytest.approx(2 / 3)  # hotpotqa scores every line
    assert score(make_sample("kv", 128, 0.5, 0), make_sample("kv", 128, 0.5, 0).answer) == 1.0


@pytest.mark.parametrize("line,message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    (json.dumps({**RECORD, "answers": []}), "line 2: 'answers' must be a non-empty list of strings"),
    (json.dumps({k: v for k, v in RECORD.items() if k != "context"}), "line 2: field 'context' is missing"),
    (json.dumps({**RECORD, "dataset": "dureader"}), "unknown LongBench dataset 'dureader'; supported: narrativeqa"),
])
def test_load_longbench_errors_name_the_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORD, line])
    with pytest.raises(ValueError, match=message):
        load_longbench(path)


def test_score_rejects_unknown_tasks():
    sample = Sample("dureader", "p", "a", ("a",), 1, math.nan, {})
    with pytest.raises(ValueError, match="no metric for task 'dureader'"):
        score(sample, "a")


def test_a_first_line_dataset_scores_the_first_line_after_leading_newlines(tmp_path):
    """LongBench strips the reply's leading newlines before taking trec's, triviaqa's and samsum's first line."""
    (sample,) = load_longbench(write_jsonl(tmp_path / "lb.jsonl", [{**RECORD, "dataset": "samsum"}]))
    assert score(sample, "\n\nthe cat\nsat on the mat") == 1.0


def test_qa_f1_matches_a_repeated_word_as_often_as_both_hold_it():
    """The overlap is the multiset intersection (LongBench's Counter &): "yes yes no" against "yes yes"
    shares 2 words, P = 2/3, R = 1, F1 = 0.8."""
    assert qa_f1("yes yes no", ["yes yes"]) == pytest.approx(0.8)


def _longest_common_subsequence(first, second):
    """By enumeration: the longest subsequence of `first` that is also a subsequence of `second`."""
    def within(part, whole):
        rest = iter(whole)
        return all(item in rest for item in part)
    for size in range(len(first), 0, -1):
        if any(within(part, second) for part in itertools.combinations(first, size)):
            return size
    return 0


word_lists = st.lists(st.sampled_from("abc"), min_size=1, max_size=6)


@given(word_lists, word_lists)
def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence(predicted, reference):
    """rouge_l's F = 2 LCS / (|prediction| + |reference|), the LCS found here by enumeration."""
    lcs = _longest_common_subsequence(predicted, reference)
    expected = 2 * lcs / (len(predicted) + len(reference))
    assert rouge_l(" ".join(predicted), [" ".join(reference)]) == pytest.approx(expected)


def test_rouge_l_drops_the_periods_of_the_answer_too():
    """"." is dropped from the reference as from the prediction: "The cat sat" equals "The cat sat."."""
    assert rouge_l("The cat sat", ["The cat sat."]) == pytest.approx(1.0)


def test_load_longbench_skips_a_line_of_only_whitespace(tmp_path):
    """A blank line, spaces or tabs only, is no record (the docstring: blank lines are skipped)."""
    path = write_jsonl(tmp_path / "lb.jsonl", [RECORD, "  \t ", {**RECORD, "_id": "d"}])
    assert [sample.meta["id"] for sample in load_longbench(path)] == ["abc", "d"]
