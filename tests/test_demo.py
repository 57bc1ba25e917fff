"""train_free_demo.py end to end on the small fixture checkpoints, and its error paths."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nanodllm.config import ModelConfig
from nanodllm.demo import demo_budget, kv_summary
from nanodllm.loader import build_empty, random_weights

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
    whole_blocks = " or more (whole blocks)" if name == "sdar_tiny" else ""  # the block engine fills whole blocks
    assert f"decoding: 8 tokens{whole_blocks}, blocks of 4" in done.stdout and " gave " not in done.stdout


def test_demo_on_diffusion_gemma_reports_its_sampler_and_what_mage_read():
    """A DiffusionGemma checkpoint directory: its chat template (16 tokens: the specials recognised), whole
    canvases, each run's denoising steps per canvas and tokens per step, and MAGE reading part of the full
    layers' cache where dense reads all of it."""
    done = demo("--model", str(FIXTURES / "diffusion_gemma_tiny"), "--method", "mage", "--knobs", "k=8", "--prompt",
                "what is the capital of france ?", "--gen-length", "16", "--steps", "6")
    assert done.returncode == 0, done.stderr
    assert "(diffusion_gemma, gemma engine), prompt 16 tokens" in done.stdout
    assert "decoding: 16 tokens or more (whole canvases of 8), at most 6 denoising steps per canvas" in done.stdout
    kept = {}
    for name in ("dense", "mage"):
        report = done.stdout.split(f"[{name}] ")[1].splitlines()[0]
        found = re.search(r"^(\d+) tokens .* KV kept (\d+)%.*sampler: (\d+) denoising steps over (\d+) canvas(?:es)? "
                          r"\(([\d, ]+)\), ([\d.]+) tokens per step$", report)
        assert found, report
        tokens, kept[name], steps, canvases = map(int, found.groups()[:4])
        per_canvas = [int(n) for n in found[5].split(", ")]
        assert sum(per_canvas) == steps and len(per_canvas) == canvases <= 2 and max(per_canvas) <= 6
        assert float(found[6]) == pytest.approx(tokens / steps, abs=0.005)
    assert kept["dense"] == 100 and kept["mage"] < 100


def test_demo_refuses_a_diffusion_gemma_context_past_its_positions_before_loading():
    """Its RoPE is not stretched: a default passkey prompt longer than the fixture's 512 positions is one
    error, with no note promising a stretch and nothing loaded (no vision-tensor notice)."""
    done = demo("--model", str(FIXTURES / "diffusion_gemma_tiny"), "--method", "dense")
    assert done.returncode != 0 and "note:" not in done.stdout + done.stderr and "vision" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: diffusion_gemma: 1098 tokens exceed max_position_embeddings 512, and its RoPE is not stretched: use "
        "a shorter prompt (--length, --context)"]


def test_demo_defaults_to_the_tiny_model_and_a_passkey_prompt():
    done = demo("--method", "dense", "--length", "512")
    assert done.returncode == 0, done.stderr
    assert "tiny-llada (llada, masked engine)" in done.stdout
    answer = done.stdout.split("the answer is ")[1].split()[0]
    assert done.stdout.split("[dense]")[1].splitlines()[1].strip() == answer


def test_demo_unknown_method_lists_valid_ones():
    done = demo("--method", "nope")
    assert done.returncode != 0
    assert "unknown method 'nope'" in done.stderr and "dense" in done.stderr


def test_demo_knobs_reach_the_method():
    done = demo("--method", "maskkv", "--knobs", "budget=48", "--length", "512", "--gen-length", "8", "--steps", "4")
    assert done.returncode == 0, done.stderr
    assert "maskkv knobs: budget=48, alpha=0.1" in done.stdout
    average, _ = kept_per_head(done.stdout, "maskkv")
    assert 44 <= average <= 48  # the budget, less what the layer and head shares floor away


def kept_per_head(stdout: str, method: str) -> tuple[float, float]:
    """From '[method] ... KV kept 12% (255 of 527 prompt tokens per head on average)'."""
    found = re.search(r"\(([\d.]+) of ([\d.]+) prompt tokens per head", stdout.split(f"[{method}]")[1])
    return float(found[1]), float(found[2])


@pytest.mark.parametrize("knobs,message", [
    ("size=3", "method 'mage' has no knob 'size'; its knobs (defaults): k=1024, exact_layers=2"),
    ("k=0", "k must be an integer >= 1, got 0"),
    ("k", "knobs are name=value pairs"),
])
def test_demo_bad_knobs_are_named_before_loading(knobs, message, tmp_path):
    done = demo("--method", "mage", "--knobs", knobs, "--model", str(tmp_path / "not-read"))
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr


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
    assert "maskkv gave " in done.stdout


def test_demo_maskkv_on_the_default_model():
    done = demo("--method", "maskkv", "--length", "512")
    assert done.returncode == 0, done.stderr
    assert "[maskkv] 32 tokens" in done.stdout and "is the demo's" not in done.stdout  # 256 of 527: its own budget
    average, prompt = kept_per_head(done.stdout, "maskkv")
    assert 252 <= average <= 256 < prompt  # the budget of 256, less what the layer and head shares floor away
    computed = int(re.search(r"rows computed (\d+)%", done.stdout.split("[maskkv]")[1])[1])
    assert 0 < computed < 100  # dLLM-Cache's steps between refreshes compute a few rows
    answers = {name: done.stdout.split(f"[{name}]")[1].splitlines()[1] for name in ("dense", "maskkv")}
    verdict = ("the same answer as dense" if answers["dense"] == answers["maskkv"]
               else "an answer that differs from dense")
    assert f"maskkv gave {verdict}: " in done.stdout


def test_demo_counts_the_tokens_that_agree_and_the_speed_ratio():
    """The verdict line: how many of the 32 tokens agree (fewer than all where the answers differ, as
    8 keys of 527 make them on a CPU) and dense's seconds over the method's, as the runs print them
    (rounded to 0.01 s; the ratio to 0.1)."""
    done = demo("--method", "maskkv", "--length", "512", "--knobs", "budget=8")
    assert done.returncode == 0, done.stderr
    dense, method = (float(re.search(rf"\[{name}\] \d+ tokens in ([\d.]+)s", done.stdout)[1])
                     for name in ("dense", "maskkv"))
    verdict = re.search(r"maskkv gave (the same answer as|an answer that differs from) dense: (\d+) of (\d+) "
                        r"tokens agree, ([\d.]+)x", done.stdout)
    agree, total, ratio = int(verdict[2]), int(verdict[3]), float(verdict[4])
    assert total == 32 and agree <= total and (agree < total or verdict[1] == "the same answer as"), done.stdout
    assert (dense - 0.005) / (method + 0.005) - 0.05 <= ratio <= (dense + 0.005) / max(method - 0.005, 1e-9) + 0.05
    if not torch.cuda.is_available():  # in float32 on a CPU the 8 keys change the answer
        assert verdict[1] == "an answer that differs from" and agree < total


@pytest.mark.parametrize("method, knobs", [("mage", []), ("quest", []), ("sparsed", []),
                                           ("mage", ["--knobs", "k=1024"])])
def test_demo_shows_a_selecting_method_leave_keys_out(method, knobs):
    """The paper's k = 1024 would keep all of a 527-token prompt: unless --knobs sets k, the demo picks
    a quarter of the prompt and says so, and the method reads less than all of it (more than half: the
    first 2 of the tiny model's 4 layers read every key, and SparseD every key for a block's first fifth)."""
    done = demo("--method", method, "--length", "512", *knobs)
    assert done.returncode == 0, done.stderr
    prompt = int(re.search(r"prompt (\d+) tokens", done.stdout)[1])
    kept = int(re.search(r"KV kept (\d+)%", done.stdout.split(f"[{method}]")[1])[1])
    if knobs:
        assert "is the demo's" not in done.stdout and f"{method} knobs: k=1024," in done.stdout and kept == 100
        return
    budget = prompt // 4 // 16 * 16
    assert f"{method} knobs: k={budget}," in done.stdout and f"  k={budget} is the demo's" in done.stdout
    assert 50 <= kept < 100


def test_demo_says_why_momo_shows_no_keys_left_out():
    done = demo("--method", "momo", "--length", "512", "--gen-length", "8")
    assert done.returncode == 0, done.stderr
    assert "  momo sparsifies the prefill's attention, which 'KV kept'" in done.stdout


def test_demo_reads_a_prompt_file_and_names_a_missing_one(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("what is the capital of france ?\n" * 20)
    done = demo("--model", str(FIXTURES / "sdar_tiny"), "--prompt-file", str(prompt), "--gen-length", "8",
                "--block-length", "4")
    assert done.returncode == 0, done.stderr
    assert "built-in prompt" not in done.stdout and int(re.search(r"prompt (\d+) tokens", done.stdout)[1]) >= 100
    missing = demo("--prompt-file", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and missing.stderr.startswith(
        f"error: --prompt-file {tmp_path / 'nope.txt'}: no such file")
    both = demo("--prompt", "hi", "--prompt-file", str(prompt))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def qwen25_checkpoint(directory: Path, model_type: str, **fields) -> Path:
    """A random tiny checkpoint of a Qwen2.5-vocabulary family in its on-disk format (Qwen2 names under
    'model.'), with the vocab.json + merges.txt tokenizer fixture (400 tokens + 6 added, <|mask|> = 405)."""
    shutil.copytree(FIXTURES / "tokenizers" / "qwen2_bpe", directory, ignore=shutil.ignore_patterns("golden.json"))
    raw = dict(model_type=model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, vocab_size=406, max_position_embeddings=4096,
               tie_word_embeddings=False, mask_token_id=405, **fields)
    (directory / "config.json").write_text(json.dumps(raw))
    model = random_weights(build_empty(ModelConfig.from_dict(raw), dtype=torch.float32))  # the checkpoint's layout
    tensors = {name if name == "lm_head.weight" else f"model.{name}": tensor.clone()
               for name, tensor in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("model_type, fields, engine", [
    ("Dream", {"eos_token_id": 400}, "masked"),
    ("Fast_dLLM_Qwen", {"eos_token_id": 402, "bd_size": 4}, "block"),
])
def test_demo_runs_on_dream_and_fast_dllm_v2_checkpoints(tmp_path, model_type, fields, engine):
    """Their tokenizer from vocab.json + merges.txt, the Qwen2.5 chat template, and the default block
    length (Dream: the whole response; Fast-dLLM v2: bd_size), end to end."""
    checkpoint = qwen25_checkpoint(tmp_path / model_type, model_type, **fields)
    done = demo("--model", str(checkpoint), "--method", "dense", "--prompt", "what is the capital of france ?",
                "--gen-length", "40", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert f"({model_type}, {engine} engine)" in done.stdout
    assert "[dense] " in done.stdout


def cli(*args):
    return subprocess.run([sys.executable, "-m", "nanodllm", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_the_package_command_line_lists_its_commands_and_refuses_others():
    listed = cli("--help")
    assert listed.returncode == 0 and "python -m nanodllm demo --method maskkv" in listed.stdout
    assert cli().returncode == 2
    unknown = cli("bench")
    assert unknown.returncode == 2 and unknown.stderr.startswith(
        "error: unknown command 'bench'; choose from demo, eval")


@pytest.mark.parametrize("command, example", [("demo", "--method maskkv"), ("eval", "--task passkey")])
def test_each_command_has_help_with_an_example(command, example):
    done = cli(command, "--help")
    assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m nanodllm {command}")
    assert example in done.stdout


def test_the_demo_runs_through_the_package_command_line():
    done = cli("demo", "--model", str(FIXTURES / "sdar_tiny"), "--method", "mage", "--prompt", "hello",
               "--gen-length", "8", "--block-length", "4", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "\n[mage] " in done.stdout and "mage gave " in done.stdout


def test_a_short_prompt_gets_the_smallest_budget_of_one_page():
    """A quarter of a 40-token prompt is less than a page of 16 keys: the budget is one page, never zero."""
    knobs, note = demo_budget("mage", {"exact_layers": 1}, 40)
    assert knobs == {"exact_layers": 1, "k": 16} and note.startswith("k=16 is the demo's")


def test_the_kv_summary_of_a_method_that_counts_nothing_is_all_of_the_kv():
    """A run whose steps state nothing (dense on the masked engine) kept all of the KV; a counted one its share."""
    assert kv_summary({}, 527) == "KV kept 100%"
    assert kv_summary({"kv_kept": 0.25, "rows_computed": 0.09}, 1040) == (
        "KV kept 25% (260 of 1040 prompt tokens per head on average), rows computed 9%")


def test_the_builtin_prompts_length_is_refused_with_a_prompt_of_the_users(tmp_path, capsys):
    """--length sets the built-in prompt's length: with --prompt or --prompt-file it would do nothing."""
    from nanodllm.demo import parse_args

    for prompt in (["--prompt", "hi"], ["--prompt-file", str(tmp_path / "prompt.txt")]):
        with pytest.raises(SystemExit):
            parse_args([*prompt, "--length", "4096"])
        assert "--length sets the built-in prompt's length" in capsys.readouterr().err
    assert parse_args([]).length == 1024 and parse_args(["--length", "512"]).length == 512


def test_a_prompt_file_of_only_whitespace_is_empty(tmp_path):
    from nanodllm.demo import read_prompt

    path = tmp_path / "prompt.txt"
    path.write_text(" \n\t\n")
    with pytest.raises(ValueError, match=f"--prompt-file {path}: the file is empty"):
        read_prompt(path)
    path.write_text(" hi \n")
    assert read_prompt(path) == " hi \n"


def test_the_budget_note_says_the_default_keeps_at_most_the_prompt():
    """k=1024 of a 527-token prompt keeps all 527 of its tokens, not 1024 of them."""
    knobs, note = demo_budget("mage", {}, 527)
    assert knobs == {"k": 128} and "the default k=1024 keeps 527 of its 527 tokens" in note


def test_without_a_model_the_demo_reads_the_tiny_model_of_the_methods_first_engine(monkeypatch, capsys):
    """tiny-sdar for MAGE and MOMO (shown on the block engine's prefill), tiny-llada for MaskKV and dense."""
    from nanodllm import demo as demo_module

    def read(model_dir):
        raise FileNotFoundError(f"read {Path(model_dir).name}")

    monkeypatch.setattr(demo_module.ModelConfig, "from_dir", read)
    defaults = {"mage": "tiny-sdar", "momo": "tiny-sdar", "maskkv": "tiny-llada", "dense": "tiny-llada"}
    for method, model in defaults.items():
        assert demo_module.main(["--method", method]) == 2
        assert capsys.readouterr().err == f"error: read {model}\n"
