"""Synthetic long-context tasks (passkey, multikey, kv) and LongBench-compatible metrics.

The tasks train and evaluate tiny diffusion LMs, so their text is simple and regular. Every sample
is one user message (an intro line, a context, a question); the reply is `sample.answer`. passkey
hides one pass key in filler sentences, multikey 4 named pass keys of which one is asked for, kv
lists "{key} : {value} ." lines and asks for one value. Only the needle holds the answer.

Length: `count_tokens(text)` (default `count_words`) measures the frame and the filler in chunks, so
the prompt lands within half a piece of `length` when the count is additive over pieces (the whole
prompt's count: meta["tokens"]). Depth: the queried needle sits at the piece boundary nearest `depth`
of the context (meta["position"]: the achieved fraction). A sample depends on (task, seed, length,
depth, count_tokens) only: with one seed, lengths and depths share the needle and the filler start.

Metrics follow LongBench's metrics.py and eval.py (max over the reference answers; the first line
of the prediction only for trec, triviaqa and samsum), with the standard library only.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher
from typing import Callable, Iterator

from .cli import read_text

TASKS = ("passkey", "multikey", "kv")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_LENGTH = 64
LENGTH_TOLERANCE = 0.03
MIN_LENGTH_TOLERANCE = 16
CORPUS_LENGTHS = (64, 512)
FILL_CHUNK = 32  # pieces counted per count_tokens call while far from the budget

PASSKEY_INTRO = "There is a pass key hidden in this text. Find it and remember it."
PASSKEY_NEEDLE = "The pass key is {number}. Remember it. {number} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
MULTIKEY_NEEDLE = "The pass key for the {name} is {number}."
MULTIKEY_QUESTION = "What is the pass key for the {name}?"
MULTIKEY_NEEDLES = 4
KV_INTRO = "Here are key value pairs. Find the value of the key asked for."
KV_LINE = "{key} : {value} ."
KV_QUESTION = "What is the value of {key}?"
KV_VALUE_LENGTH = 6
KV_KEY_COUNT = 1536
NUMBER_RANGE = range(10000, 100000)

NAME_ADJECTIVES = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "pink", "brown")
NAME_ANIMALS = ("fox", "owl", "wolf", "bear", "tiger", "horse", "rabbit", "eagle", "snake", "mouse", "lion", "whale")

FILLER_WORDS = {
    "person": ("farmer", "baker", "teacher", "doctor", "sailor", "painter", "writer", "singer", "driver",
               "hunter", "miller", "tailor", "gardener", "fisherman", "soldier", "student", "child",
               "woman", "man", "king", "queen", "boy", "girl", "traveler"),
    "quality": ("old", "young", "tall", "small", "quiet", "busy", "happy", "tired", "kind", "brave",
                "clever", "careful", "gentle", "proud", "calm", "strong", "poor", "rich", "shy", "wise"),
    "motion": ("walks", "runs", "goes", "rides", "hurries", "returns", "comes", "travels", "wanders", "climbs"),
    "action": ("carries", "finds", "holds", "opens", "cleans", "paints", "builds", "moves", "fixes", "sells",
               "buys", "brings", "watches", "reads", "takes", "keeps", "washes", "fills", "lifts", "drops"),
    "thing": ("basket", "book", "letter", "box", "chair", "table", "door", "window", "bottle", "cup", "bag",
              "lamp", "rope", "coat", "hat", "bowl", "map", "ladder", "bucket", "bench", "blanket", "wheel",
              "candle", "shoe"),
    "state": ("heavy", "empty", "clean", "broken", "new", "wooden", "large", "warm", "cold", "dusty"),
    "place": ("river", "market", "village", "garden", "forest", "station", "church", "school", "bridge",
              "harbor", "field", "mill", "road", "square", "library", "kitchen", "valley", "hill", "shop", "farm"),
    "time": ("In the morning", "In the evening", "At night", "After lunch", "Before dinner", "Every day",
             "Later", "Today", "Once again", "Soon"),
}
SENTENCE_TEMPLATES = (
    "The {quality} {person} {motion} to the {place}.",
    "The {person} {action} the {state} {thing}.",
    "The {quality} {person} {action} a {thing} near the {place}.",
    "{time}, the {person} {motion} to the {place}.",
    "The {thing} in the {place} is {state}.",
    "The {person} {action} the {thing} and {motion} to the {place}.",
)



def _key_words() -> tuple[str, ...]:
    """KV_KEY_COUNT made-up consonant-vowel words, none inside a word of the frames or the filler."""
    frames = " ".join([PASSKEY_INTRO, PASSKEY_NEEDLE, PASSKEY_QUESTION, MULTIKEY_NEEDLE, MULTIKEY_QUESTION,
                       KV_INTRO, KV_QUESTION, *SENTENCE_TEMPLATES, *NAME_ADJECTIVES, *NAME_ANIMALS,
                       *(phrase for group in FILLER_WORDS.values() for phrase in group)]).lower()
    syllables = [consonant + vowel for consonant in "bdfgklmnprstvz" for vowel in "aeiou"]
    words = sorted({first + second for first in syllables for second in syllables})
    random.Random("kv keys").shuffle(words)
    return tuple(word for word in words if word not in frames)[:KV_KEY_COUNT]


KV_KEYS = _key_words()
WORD_OR_PUNCTUATION = re.compile(r"\w+|[^\w\s]")
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = frozenset(string.punctuation)


@dataclass(frozen=True)
class Sample:
    task: str  # "passkey" | "multikey" | "kv" | a LongBench dataset name
    prompt: str  # the user message: context followed by the question
    answer: str  # reference answer (for LongBench: the first of `answers`)
    answers: tuple[str, ...]  # all accepted references
    length: int  # target prompt length in tokens (what was asked for)
    depth: float  # relative position of the queried needle in the context, 0..1 (nan if none)
    meta: dict = field(default_factory=dict)  # needle offset, position, distractors, queried key, ...


def count_words(text: str) -> int:
    """The default token count: words (runs of letters, digits, _) plus punctuation marks."""
    return len(WORD_OR_PUNCTUATION.findall(text))


def make_sample(task: str, length: int, depth: float | None, seed: int, count_tokens=None) -> Sample:
    """One sample of `task` about `length` tokens long, its needle at `depth` (None: drawn from seed).
    When the whole prompt's count is off by more than length_tolerance, the budget is rescaled and the
    sample rebuilt once. A prompt is never shorter than its frame (intro, needles, question):
    multikey's is 66 words, 82 tokens when digits are split, so multikey prompts asked for fewer than
    about 70 tokens come out longer. sample.depth and sample.length are what was asked for, so results
    group by them exactly."""
    _check_request(task, length, depth)
    rng = random.Random(f"{task}/{seed}")
    depth = rng.random() if depth is None else float(depth)
    count_tokens = count_tokens or count_words
    build = functools.partial(TASK_BUILDERS[task], length=length, depth=depth, count=count_tokens)
    start = rng.getstate()
    sample = _measured(build(rng, target=length), count_tokens)
    if abs(sample.meta["tokens"] - length) > length_tolerance(length):
        rng.setstate(start)  # the count is not additive over pieces: rescale the budget once
        retry = _measured(build(rng, target=length * length / max(sample.meta["tokens"], 1)), count_tokens)
        sample = min(sample, retry, key=lambda s: abs(s.meta["tokens"] - length))
    return sample


def length_tolerance(length: int) -> float:
    """How far count_tokens(prompt) may be from the asked length: 3%, at least 16 tokens."""
    return max(LENGTH_TOLERANCE * length, MIN_LENGTH_TOLERANCE)


def make_samples(task: str, length: int, n: int, seed: int, depths=None, count_tokens=None) -> list[Sample]:
    """n samples whose depths cycle over `depths` (default DEPTHS), each with its own derived seed."""
    depths = DEPTHS if depths is None else tuple(depths)
    if not depths:
        raise ValueError("depths must not be empty")
    return [make_sample(task, length, depths[index % len(depths)], _derived_seed(seed, index), count_tokens)
            for index in range(n)]


def corpus(n: int, seed: int) -> Iterator[str]:
    """n texts (prompt + " " + answer) cycling over TASKS at random lengths of 64..512 words."""
    rng = random.Random(f"corpus/{seed}")
    for index in range(n):
        length, depth = rng.randint(*CORPUS_LENGTHS), rng.random()
        sample = make_sample(TASKS[index % len(TASKS)], length, depth, _derived_seed(f"corpus/{seed}", index))
        yield f"{sample.prompt} {sample.answer}"


def filler(rng: random.Random, n_sentences: int) -> list[str]:
    """n_sentences filler sentences over FILLER_WORDS: no digits, no pass key or name words, nothing
    shaped like a kv code, so the answer appears only inside its needle."""
    return [_sentence(rng) for _ in range(n_sentences)]


def _measured(sample, count_tokens):
    return replace(sample, meta={**sample.meta, "tokens": count_tokens(sample.prompt)})


def _check_request(task, length, depth):
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if length < MIN_LENGTH:
        raise ValueError(f"length must be at least {MIN_LENGTH} tokens, got {length}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")


def _derived_seed(seed, index):
    return random.Random(f"{seed}/{index}").getrandbits(63)


def _sentence(rng):
    template = rng.choice(SENTENCE_TEMPLATES)
    return template.format(**{slot: rng.choice(words) for slot, words in FILLER_WORDS.items()})


def _passkey(rng, length, depth, count, target):
    number = str(rng.choice(NUMBER_RANGE))
    needle = PASSKEY_NEEDLE.format(number=number)
    budget = target - _frame_cost(count, " ", PASSKEY_INTRO, [needle], PASSKEY_QUESTION)
    pieces = _fill(rng, budget, count, " ", _sentence)
    return _assemble("passkey", length, depth, " ", PASSKEY_INTRO, pieces, needle, PASSKEY_QUESTION, number, {})


def _multikey(rng, length, depth, count, target):
    """4 needles, no two sharing an adjective or an animal, with distinct numbers; the first is asked
    for, the 3 distractors sit at random depths."""
    adjectives, animals = rng.sample(NAME_ADJECTIVES, MULTIKEY_NEEDLES), rng.sample(NAME_ANIMALS, MULTIKEY_NEEDLES)
    names = [f"{adjective} {animal}" for adjective, animal in zip(adjectives, animals)]
    numbers = [str(number) for number in rng.sample(NUMBER_RANGE, MULTIKEY_NEEDLES)]
    needles = [MULTIKEY_NEEDLE.format(name=name, number=number) for name, number in zip(names, numbers)]
    question = MULTIKEY_QUESTION.format(name=names[0])
    budget = target - _frame_cost(count, " ", PASSKEY_INTRO, needles, question)
    pieces = _fill(rng, budget, count, " ", _sentence)
    for distractor in needles[1:]:
        pieces.insert(rng.randint(0, len(pieces)), distractor)
    meta = {"key": names[0], "distractors": tuple(zip(names[1:], numbers[1:]))}
    return _assemble("multikey", length, depth, " ", PASSKEY_INTRO, pieces, needles[0], question, numbers[0], meta)


def _kv(rng, length, depth, count, target):
    """No filler: lines with distinct keys (made-up words, one token each in the tiny models' tokenizer)
    and distinct values. KV_KEYS bounds the lines (enough for 8K tokens of a BPE tokenizer); a longer
    prompt is refused with a clear error."""
    used = set()
    key, value = rng.choice(KV_KEYS), _kv_value(rng, used)
    needle = KV_LINE.format(key=key, value=value)
    question = KV_QUESTION.format(key=key)
    budget = target - _frame_cost(count, "\n", KV_INTRO, [needle], question)

    def pair(rng):  # the queried key stands in for the others while the budget is measured
        return KV_LINE.format(key=key, value=_kv_value(rng, used))
    pieces = _fill(rng, budget, count, "\n", pair)
    if len(pieces) >= len(KV_KEYS):
        raise ValueError(f"a kv prompt of {length} tokens needs {len(pieces) + 1} distinct keys, more than the "
                         f"{len(KV_KEYS)} of KV_KEYS; ask for a shorter prompt")
    others = rng.sample([other for other in KV_KEYS if other != key], len(pieces))
    pieces = [other + piece[len(key):] for other, piece in zip(others, pieces)]
    return _assemble("kv", length, depth, "\n", KV_INTRO, pieces, needle, question, value, {"key": key})


def _kv_value(rng, used):
    """A fresh 6-digit value (digits tokenize one by one: a value reads the same wherever it appears)."""
    while True:
        value = "".join(rng.choices(string.digits, k=KV_VALUE_LENGTH))
        if value not in used:
            used.add(value)
            return value


def _frame_cost(count, separator, intro, needles, question):
    return count(intro) + sum(count(separator + piece) for piece in [*needles, question])


def _fill(rng, budget, count, separator, make_piece):
    """Chunks of pieces while they fit the budget, halving the chunk when one does not; a single
    piece is kept when it brings the total closer to the budget (so it stops within half a piece).
    A chunk (pieces with their leading separators) is one count call; the count is additive over
    pieces for BPE with whitespace pre-tokenization."""
    pieces, used, size = [], 0, FILL_CHUNK
    while size:
        chunk = [make_piece(rng) for _ in range(size)]
        cost = count("".join(separator + piece for piece in chunk))
        if used + cost <= budget + (cost / 2 if size == 1 else 0):
            pieces += chunk
            used += cost
        else:
            size //= 2
    return pieces


def _assemble(task, length, depth, separator, intro, pieces, needle, question, answer, meta):
    """Insert the needle at the boundary nearest `depth` and join intro, context and question.
    Nearest by character offset within the rest of the context; meta["position"] is the achieved
    fraction, meta["needle_offset"] the needle's character offset in the prompt."""
    starts = list(itertools.accumulate((len(piece) + len(separator) for piece in pieces), initial=0))
    index = min(range(len(starts)), key=lambda i: abs(starts[i] - depth * starts[-1]))
    context = separator.join([*pieces[:index], needle, *pieces[index:]])
    context_start = len(intro) + len(separator)
    meta = {
        **meta,
        "needle": needle,
        "needle_offset": context_start + starts[index],
        "position": starts[index] / starts[-1] if pieces else depth,
        "context_start": context_start,
        "context_end": context_start + len(context),
    }
    prompt = separator.join([intro, context, question])
    return Sample(task, prompt, answer, (answer,), length, depth, meta)


TASK_BUILDERS = {"passkey": _passkey, "multikey": _multikey, "kv": _kv}


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD/LongBench)."""
    text = "".join(character for character in text.lower() if character not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers) -> float:
    """1.0 when the normalized prediction equals a normalized answer, else 0.0."""
    def one(prediction, answer):
        return float(normalize_answer(prediction) == normalize_answer(answer))
    return _best(one, prediction, answers)


def qa_f1(prediction: str, answers) -> float:
    """Token F1 between normalized prediction and answer (LongBench qa_f1_score), best answer."""
    def one(prediction, answer):
        predicted, reference = normalize_answer(prediction).split(), normalize_answer(answer).split()
        return _f_measure(sum((Counter(predicted) & Counter(reference)).values()), len(predicted), len(reference))
    return _best(one, prediction, answers)


def rouge_l(prediction: str, answers) -> float:
    """LCS F-measure on whitespace tokens, "." dropped (LongBench rouge_score's rouge-l f), best answer.
    The `rouge` package that LongBench calls scores summary-level LCS over sentences and counts unique
    words, so scores on long texts with repeated words differ slightly."""
    def one(prediction, answer):
        predicted, reference = prediction.replace(".", " ").split(), answer.replace(".", " ").split()
        return _f_measure(_lcs_length(predicted, reference), len(predicted), len(reference))
    return _best(one, prediction, answers)


def code_sim(prediction: str, answers) -> float:
    """fuzz.ratio / 100 of the first code line of the prediction and the answer (LongBench code_sim_score).
    fuzz.ratio is fuzzywuzzy's pure-Python one (difflib ratio rounded to a percent); the first code line
    is the first that contains no '`', '#' or '//'."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if not any(mark in line for mark in ("`", "#", "//"))), "")
    return _best(_fuzz_ratio, line, answers)


def classification_score(prediction: str, answers, all_classes) -> float:
    """1/k when the answer is among the k classes named in the prediction (LongBench classification_score).
    Every matched class that is a proper substring of the answer is dropped (LongBench's loop removes
    while iterating and can skip one)."""
    def one(prediction, answer):
        named = [name for name in all_classes if name in prediction and not (name in answer and name != answer)]
        return 1.0 / len(named) if answer in named else 0.0
    return _best(one, prediction, answers)


def retrieval_score(prediction: str, answers) -> float:
    """Share of the numbers in the prediction that equal the answer's "Paragraph N" (LongBench)."""
    def one(prediction, answer):
        paragraph = re.findall(r"Paragraph (\d+)", answer)
        return _share_equal(re.findall(r"\d+", prediction), paragraph[0]) if paragraph else 0.0
    return _best(one, prediction, answers)


def count_score(prediction: str, answers) -> float:
    """Share of the numbers in the prediction that equal the answer (LongBench count_score)."""
    def one(prediction, answer):
        return _share_equal(re.findall(r"\d+", prediction), answer)
    return _best(one, prediction, answers)


def _best(metric, prediction, answers):
    answers = (answers,) if isinstance(answers, str) else answers
    return max((float(metric(prediction, answer)) for answer in answers), default=0.0)


def _f_measure(overlap, predicted, reference):
    if overlap == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _lcs_length(first, second):
    previous = [0] * (len(second) + 1)
    for item in first:
        current = [0]
        for j, other in enumerate(second):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _fuzz_ratio(first, second):
    if not first or not second:
        return 0.0
    return round(100 * SequenceMatcher(None, first, second).ratio()) / 100


def _share_equal(numbers, target):
    return numbers.count(str(target)) / len(numbers) if numbers else 0.0


LONGBENCH_METRICS: dict[str, Callable] = {
    "narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "hotpotqa": qa_f1,
    "2wikimqa": qa_f1, "musique": qa_f1, "triviaqa": qa_f1,
    "gov_report": rouge_l, "qmsum": rouge_l, "multi_news": rouge_l, "samsum": rouge_l,
    "lcc": code_sim, "repobench-p": code_sim,
    "trec": classification_score, "passage_retrieval_en": retrieval_score, "passage_count": count_score,
}
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum")
LONGBENCH_FIELDS = {"input": str, "context": str, "answers": list, "length": int, "dataset": str, "_id": str}


def load_longbench(path) -> list[Sample]:
    """Samples from a LongBench JSONL file; prompt = context + "\\n\\n" + input. Blank lines are skipped."""
    lines = read_text(path).split("\n")  # not splitlines: a JSON string may hold a raw U+2028
    return [_longbench_sample(line, f"{path} line {number}") for number, line in enumerate(lines, 1) if line.strip()]


def _longbench_sample(line, where):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for name, kind in LONGBENCH_FIELDS.items():
        if not isinstance(record.get(name), kind):
            raise ValueError(f"{where}: field {name!r} is missing or not a {kind.__name__}")
    answers = record["answers"]
    if not answers or not all(isinstance(answer, str) for answer in answers):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
    if record["dataset"] not in LONGBENCH_METRICS:
        raise ValueError(f"{where}: unknown LongBench dataset {record['dataset']!r}; "
                         f"supported: {', '.join(LONGBENCH_METRICS)}")
    meta = {"id": record["_id"], "all_classes": tuple(record.get("all_classes") or ())}
    prompt = f"{record['context']}\n\n{record['input']}"
    return Sample(record["dataset"], prompt, answers[0], tuple(answers), record["length"], math.nan, meta)


def score(sample: Sample, prediction: str) -> float:
    """exact_match for the synthetic tasks, the dataset's LongBench metric otherwise, in 0..1."""
    if sample.task in TASKS:
        return exact_match(prediction, sample.answers)
    if sample.task not in LONGBENCH_METRICS:
        raise ValueError(f"no metric for task {sample.task!r}; supported: "
                         f"{', '.join(TASKS + tuple(LONGBENCH_METRICS))}")
    if sample.task in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[sample.task]
    if metric is classification_score:
        return classification_score(prediction, sample.answers, sample.meta.get("all_classes", ()))
    return metric(prediction, sample.answers)
