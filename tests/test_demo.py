"""train_free_demo.py end to end on the small fixture checkpoints, and its error paths."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def demo(*args):
    return subprocess.run([sys.executable, "train_free_demo.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name,extra", [("llada_tiny", ["--steps", "8"]), ("sdar_tiny", [])])
def test_demo_runs_dense_on_a_checkpoint(name, extra):
    done = demo("--model", str(FIXTURES / name), "--method", "dense", "--prompt", "what is the capital of france ?",
                "--gen-length", "8", "--block-length", "4", "--dtype", "float32", *extra)
    assert done.returncode == 0, done.stderr
    assert "[dense] 8 tokens" in done.stdout
    assert "token agreement dense vs dense: 8/8" in done.stdout


def test_demo_defaults_to_the_tiny_model_and_a_passkey_prompt():
    done = demo("--method", "dense", "--context", "512")
    assert done.returncode == 0, done.stderr
    assert "tiny-llada (llada, masked engine)" in done.stdout
    answer = done.stdout.split("the answer is ")[1].split()[0]
    assert done.stdout.split("[dense]")[1].splitlines()[1].strip() == answer


def test_demo_unknown_method_lists_valid_ones():
    done = demo("--method", "nope")
    assert done.returncode != 0
    assert "unknown method 'nope'" in done.stderr and "dense" in done.stderr


def test_demo_bad_checkpoint_is_a_clear_error(tmp_path):
    done = demo("--model", str(tmp_path / "missing"))
    assert done.returncode != 0
    assert "checkpoint directory not found" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_readme_demo_command_runs():
    import shlex

    readme = (REPO / "README.md").read_text().splitlines()
    command = next(line.strip() for line in readme if line.strip().startswith("python train_free_demo.py"))
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "token agreement" in done.stdout


def test_demo_maskkv_on_the_default_model():
    done = demo("--method", "maskkv", "--context", "512")
    assert done.returncode == 0, done.stderr
    assert "[maskkv] 32 tokens" in done.stdout
    kept = done.stdout.split("[maskkv]")[1].split("(")[2]  # "256 of 528 prompt tokens per head on average)"
    assert kept.startswith("256 of ") and "prompt tokens per head" in kept
    assert "token agreement maskkv vs dense: " in done.stdout
