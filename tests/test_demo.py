"""train_free_demo.py end to end on the small fixture checkpoints, and its error paths."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SPECIALS = ["<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|mdm_mask|>",
            "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["[UNK]", "user", "assistant", "what", "is", "the", "capital", "of", "france", "?"]


def checkpoint_with_tokenizer(name: str, directory: Path) -> Path:
    """Copy a fixture checkpoint and give it a word-level tokenizer whose ids fit its vocabulary."""
    target = directory / name
    shutil.copytree(FIXTURES / name, target)
    vocab = {word: i for i, word in enumerate(WORDS + SPECIALS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(target / "tokenizer.json"))
    return target


def demo(*args):
    return subprocess.run([sys.executable, "train_free_demo.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name,extra", [("llada_tiny", ["--steps", "8"]), ("sdar_tiny", [])])
def test_demo_runs_dense_on_a_checkpoint(tmp_path, name, extra):
    model = checkpoint_with_tokenizer(name, tmp_path)
    done = demo("--model", str(model), "--method", "dense", "--prompt", "what is the capital of france ?",
                "--gen-length", "8", "--block-length", "4", "--dtype", "float32", *extra)
    assert done.returncode == 0, done.stderr
    assert "[dense] 8 tokens" in done.stdout
    assert "token agreement dense vs dense: 8/8" in done.stdout


def test_demo_without_model_says_so():
    done = demo("--method", "dense")
    assert done.returncode != 0
    assert "no default model" in done.stderr and "--model" in done.stderr


def test_demo_unknown_method_lists_valid_ones():
    done = demo("--method", "nope")
    assert done.returncode != 0
    assert "unknown method 'nope'" in done.stderr and "dense" in done.stderr


def test_demo_bad_checkpoint_is_a_clear_error(tmp_path):
    done = demo("--model", str(tmp_path / "missing"))
    assert done.returncode != 0
    assert "checkpoint directory not found" in done.stderr
    assert "Traceback" not in done.stderr
