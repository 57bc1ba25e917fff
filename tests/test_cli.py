"""The scripts' command lines as a user meets them: run in a subprocess, exit code and message checked."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def script(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_a_quick_benchmark_writes_to_a_temporary_folder_unless_told():
    before = sorted((REPO / "docs" / "results").iterdir())
    done = script("scripts/bench.py", "routing", "--quick")
    assert done.returncode == 0, done.stderr
    written = Path(done.stdout.strip().splitlines()[-1].removeprefix("wrote ").removesuffix(".json and .md"))
    assert written.with_suffix(".md").is_file() and REPO not in written.parents
    assert sorted((REPO / "docs" / "results").iterdir()) == before


def entry(command: str, *args):
    return script("-m", "nanodllm", command, *args, timeout=120)


@pytest.mark.parametrize("command, args, first_line", [
    ("eval", ["--n", "0"], "argument --n: must be a positive integer, got '0'"),
    ("eval", ["--batch", "0"], "argument --batch: must be a positive integer, got '0'"),
    ("eval", ["--lengths", "abc"], "argument --lengths: must be comma-separated positive integers, e.g. 1024,2048; got 'abc'"),
    ("eval", ["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
    ("demo", ["--block-length", "0"], "argument --block-length: must be a positive integer, got '0'"),
    ("demo", ["--steps", "-3"], "argument --steps: must be a positive integer, got '-3'"),
    ("demo", ["--device", "tpu9"], "argument --device: 'tpu9' is not a device"),
])
def test_a_bad_flag_is_named_before_anything_loads(command, args, first_line):
    done = entry(command, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert first_line in done.stderr.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_cuda_without_a_gpu_is_refused():
    done = entry("demo", "--device", "cuda")
    assert done.returncode == 2 and "torch sees no CUDA GPU here" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("command, args, message", [
    ("demo", ["--steps", "100"], "error: --steps 100 exceeds --gen-length 32: at most 32 steps unmask anything"),
    ("demo", ["--method", "mage", "--steps", "9", "--block-length", "8"],
     "error: --steps 9 exceeds --block-length 8 (steps are per block): at most 8 steps unmask anything"),
    ("eval", ["--model", "tiny-sdar", "--calibrate"], "error: --calibrate writes MaskKV's profile, and MaskKV runs on the "
     "masked engine;"),
])
def test_settings_that_would_do_nothing_or_harm_are_refused(command, args, message):
    done = entry(command, *args)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


@pytest.mark.parametrize("args, message", [
    (["--knob", "kk=16,64"], "error: --knob kk: no method in --methods takes it (maskkv: budget, alpha,"),
    (["--knob", "k"], "error: --knob must be name=v1,v2,... (e.g. budget=16,64), got 'k'"),
    (["--knob", "budget=16,-1"], "error: --knob / --knobs give maskkv budget=-1: budget must be an integer >= 1, got -1"),
    (["--knob", "budget=16", "--out", "no-such-folder/sweep.md"], "error: --out no-such-folder/sweep.md: the folder "
     "no-such-folder does not exist"),
])
def test_sweep_checks_its_flags_before_loading_a_model(args, message):
    done = script("scripts/sweep.py", "--methods", "maskkv", "--model", "/no/model/here", *args)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


def test_an_interrupted_sweep_resumes_from_its_journal(tmp_path):
    journal = tmp_path / "sweep.jsonl"
    flags = ["scripts/sweep.py", "--methods", "snapkv", "--knob", "budget=16,64", "--lengths", "256", "--n", "4",
             "--batch", "2", "--journal", str(journal)]
    first = script(*flags)
    assert first.returncode == 0, first.stderr
    assert "4/4 samples, accuracy so far: dense " in first.stderr and "min left" in first.stderr
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 2 * 3  # the settings, then 2 batches x (dense + 2 budgets)
    journal.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:20] + "\n")  # the last run lost, one cut short
    again = script(*flags)
    assert again.returncode == 0, again.stderr
    assert "resuming from" in again.stderr and ": 4 of 6 runs done" in again.stderr
    assert again.stdout == first.stdout and len(journal.read_text().splitlines()) == 7
    other = script(*[flag if flag != "256" else "512" for flag in flags])
    assert other.returncode == 2 and "holds a sweep with other flags" in other.stderr


def test_a_prompt_too_long_for_the_memory_is_refused_before_loading():
    done = entry("demo", "--length", "60000", "--device", "cpu")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert re.search(r"^error: \d+ tokens x batch 1 need about [\d.]+ GiB \(weights [\d.]+, K/V [\d.]+, attention scores "
                     r"[\d.]+ \(plain torch on this device\)\); cpu has [\d.]+ GiB free", done.stderr.splitlines()[-1])


def test_a_prompt_past_the_trained_context_is_said_to_stretch_rope():
    from nanodllm.cli import check_fits
    from nanodllm.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.from_dir(REPO / "nanodllm" / "assets" / "tiny-sdar"), max_position_embeddings=512)
    assert check_fits(cfg, cfg.max_position_embeddings, 1, torch.device("cpu"), torch.float32) is None
    note = check_fits(cfg, 2 * cfg.max_position_embeddings, 1, torch.device("cpu"), torch.float32)
    assert note.startswith(f"note: {2 * cfg.max_position_embeddings} tokens are past the model's trained "
                           f"{cfg.max_position_embeddings}: RoPE is stretched (NTK) 2.0x")
