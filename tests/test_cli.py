"""The scripts' command lines as a user meets them: run in a subprocess, exit code and message checked."""

import ast
import contextlib
import dataclasses
import functools
import io
import json
import re
import shutil
import signal
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


def bench_sections() -> list[str]:
    """The sections scripts/bench.py offers (its SECTIONS, read without importing the harness)."""
    tree = ast.parse((REPO / "scripts" / "bench.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "SECTIONS")
    return list(ast.literal_eval(table))


@pytest.mark.parametrize("section", bench_sections())
def test_every_benchmark_section_runs_quick(section, tmp_path):
    """Each section's --quick smoke run finishes and writes its tables: a section that no longer matches
    the code it measures fails here, not when someone reruns it on a GPU. DiffusionGemma's section names
    its one missing part where transformers 5.24 is not installed; parallel runs under torchrun, 2 ranks."""
    if section == "parallel":
        done = script("-m", "torch.distributed.run", "--nproc-per-node", "2", "scripts/bench.py", section, "--quick",
                      "--out", str(tmp_path))
    else:
        done = script("scripts/bench.py", section, "--quick", "--out", str(tmp_path))
    if done.returncode and section == "diffusiongemma":  # no transformers with DiffusionGemma (5.24) here
        failed = done.stderr.splitlines()[-1]
        assert done.returncode == 1, done.stderr[-3000:]
        assert re.search(r"1 part\(s\) failed: transformers' step: (ModuleNotFound|Import)Error", failed), failed
    else:
        assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    written = [p.name for p in tmp_path.iterdir()]
    assert written and all(name.endswith(("_quick.json", "_quick.md")) for name in written), written


def quoted_bench_commands() -> list[tuple[str, list[str]]]:
    """(results file, arguments) of every `scripts/bench.py` command a docs/results file quotes as its own."""
    commands = []
    for path in sorted((REPO / "docs" / "results").glob("*.md")):
        for line in path.read_text().splitlines():
            for command in line.split("#")[0].split("&&"):
                words = command.split()
                if line.startswith("    ") and "scripts/bench.py" in words:
                    commands.append((path.name, words[words.index("scripts/bench.py") + 1:]))
    return commands


def test_the_commands_the_results_quote_are_ones_bench_py_takes(monkeypatch):
    """A results file names the command that measures it: each such command still parses (its section and
    flags exist), so a renamed flag or section cannot leave a file that no command reproduces."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench

    commands = quoted_bench_commands()
    assert len({name for name, _ in commands}) >= 10, commands
    parser = bench.parser_of_sections()
    for name, args in commands:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            try:
                parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{name} quotes `bench.py {' '.join(args)}`: {said.getvalue().strip().splitlines()[-1]}")


def entry(command: str, *args):
    return script("-m", "nanodllm", command, *args, timeout=120)


HELP_PROBE = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, "scripts")  # as `python scripts/X.py` would have it
shown = {}
for entry in sys.argv[1:]:
    sys.argv = [entry, "--help"] if entry.endswith(".py") else ["nanodllm", entry, "--help"]
    out, code = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            if entry.endswith(".py"):
                runpy.run_path(entry, run_name="__main__")
            else:
                runpy.run_module("nanodllm", run_name="__main__")
        except SystemExit as stop:
            code = stop.code
    shown[entry] = [code, out.getvalue()]
print(json.dumps(shown))
"""
INTERNAL = {"scripts/bench_e2e.py"}  # bench.py e2e's worker process, not run by hand

BATCH_PROBE = """
import contextlib, io, json, runpy, sys, traceback
sys.path.insert(0, "scripts")  # as `python scripts/X.py` would have it
done = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:  # as the interpreter exits: None is 0, a number itself, else printed and 1
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()  # what the interpreter prints of an uncaught exception
            code = 1
    done.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(done))
"""


@functools.cache
def batched(commands: tuple) -> list[subprocess.CompletedProcess]:
    """What `script(*command)` returns for each command line, run one after another in one Python
    process (BATCH_PROBE): for flags refused as they are read, where a process each spends nearly all
    its time importing torch. Exit code, stdout and stderr as a process of its own would give them."""
    done = script("-c", BATCH_PROBE, json.dumps(commands))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(list(argv), *result) for argv, result in zip(commands, results)]


def run_together(commands: list, command: list) -> subprocess.CompletedProcess:
    """command's outcome, run in one process with the other commands (lists of arguments) of its test."""
    commands = tuple(tuple(c) for c in commands)
    return batched(commands)[commands.index(tuple(command))]


def test_every_entry_point_shows_an_example_in_its_help():
    """--help of every script and `python -m nanodllm` command exits 0 and shows a command line to copy."""
    scripts = sorted(f"scripts/{p.name}" for p in (REPO / "scripts").glob("*.py") if "__main__" in p.read_text())
    entries = [s for s in scripts if s not in INTERNAL] + ["demo", "eval"]
    done = script("-c", HELP_PROBE, *entries)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert {entry: code for entry, (code, _) in shown.items()} == {entry: 0 for entry in entries}
    without = [entry for entry, (_, text) in shown.items() if not re.search(r"^\s+(python|nanodllm) ", text, re.M)]
    assert without == []


BAD_FLAGS = [
    ("eval", ["--n", "0"], "argument --n: must be a positive integer, got '0'"),
    ("eval", ["--batch", "0"], "argument --batch: must be a positive integer, got '0'"),
    ("eval", ["--lengths", "abc"],
     "argument --lengths: must be comma-separated positive integers, e.g. 1024,2048; got 'abc'"),
    ("eval", ["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
    ("demo", ["--block-length", "0"], "argument --block-length: must be a positive integer, got '0'"),
    ("demo", ["--steps", "-3"], "argument --steps: must be a positive integer, got '-3'"),
    ("demo", ["--device", "tpu9"], "argument --device: 'tpu9' is not a device"),
]


@pytest.mark.parametrize("command, args, first_line", BAD_FLAGS)
def test_a_bad_flag_is_named_before_anything_loads(command, args, first_line):
    entries = [["-m", "nanodllm", c, *a] for c, a, _ in BAD_FLAGS]
    done = run_together(entries, ["-m", "nanodllm", command, *args])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert first_line in done.stderr.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_cuda_without_a_gpu_is_refused():
    done = entry("demo", "--device", "cuda")
    assert done.returncode == 2 and "torch sees no CUDA GPU here" in done.stderr.splitlines()[-1]


HARMFUL_SETTINGS = [
    ("demo", ["--steps", "100"], "error: --steps 100 exceeds --gen-length 32: at most 32 steps unmask anything"),
    ("demo", ["--method", "mage", "--steps", "9", "--block-length", "8"],
     "error: --steps 9 exceeds --block-length 8 (steps are per block): at most 8 steps unmask anything"),
    ("eval", ["--model", "tiny-sdar", "--calibrate"],
     "error: --calibrate writes MaskKV's profile, and MaskKV runs on the masked engine;"),
]


@pytest.mark.parametrize("command, args, message", HARMFUL_SETTINGS)
def test_settings_that_would_do_nothing_or_harm_are_refused(command, args, message):
    entries = [["-m", "nanodllm", c, *a] for c, a, _ in HARMFUL_SETTINGS]
    done = run_together(entries, ["-m", "nanodllm", command, *args])
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


SWEEP_FLAGS = [
    (["--knob", "kk=16,64"], "error: --knob kk: no method in --methods takes it (maskkv: budget, alpha,"),
    (["--knob", "k"], "error: --knob must be name=v1,v2,... (e.g. budget=16,64), got 'k'"),
    (["--knob", "budget=16,-1"],
     "error: --knob / --knobs give maskkv budget=-1: budget must be an integer >= 1, got -1"),
    (["--knob", "budget=16", "--lengths", "10000000", "--model", "tiny-llada"],
     "error: 10000256 tokens x batch 8 need about"),
]


@pytest.mark.parametrize("args, message", SWEEP_FLAGS)
def test_sweep_checks_its_flags_before_loading_a_model(args, message):
    sweep = ["scripts/sweep.py", "--methods", "maskkv", "--model", "/no/model/here"]
    done = run_together([sweep + a for a, _ in SWEEP_FLAGS], sweep + args)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


def test_an_interrupted_sweep_resumes_from_its_journal(tmp_path, monkeypatch, capsys):
    """Interrupted after 4 of its 6 (variant, batch) runs, the same sweep runs only the other 2 and prints
    what an uninterrupted one prints; a completed sweep leaves no journal behind."""
    sys.path.insert(0, str(REPO / "scripts"))
    import sweep
    from nanodllm.eval import Runner

    journal = tmp_path / "sweep.jsonl"
    flags = ["--methods", "snapkv", "--knob", "budget=16,64", "--lengths", "256", "--n", "2", "--batch", "1",
             "--journal", str(journal)]
    assert sweep.main(flags) == 0
    whole = capsys.readouterr()
    assert "2/2 samples, accuracy so far: dense " in whole.err and not journal.exists()
    generate, calls = Runner.generate, []

    def interrupted_after_four(self, *args, **kwargs):
        calls.append(args)
        if len(calls) > 4:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "generate", interrupted_after_four)
    with pytest.raises(KeyboardInterrupt):
        sweep.main(flags)
    assert len(journal.read_text().splitlines()) == 1 + 4  # the settings, then each finished run
    with journal.open("a") as file:
        file.write('{"key": "snapkv bud')  # a line cut short
    capsys.readouterr()
    calls.clear()
    monkeypatch.setattr(Runner, "generate", generate)
    assert sweep.main(flags) == 0
    resumed = capsys.readouterr()
    assert "resuming from" in resumed.err and ": 4 of 6 runs done" in resumed.err
    assert resumed.out == whole.out and not journal.exists()
    with journal.open("w") as file:
        file.write(json.dumps({"settings": {"other": "flags"}}) + "\n")
    assert sweep.main(flags) == 2 and "holds a run with other settings (" in capsys.readouterr().err


def test_an_interrupted_eval_resumes_from_its_journal(tmp_path, monkeypatch, capsys):
    from nanodllm import eval as evaluation

    journal = tmp_path / "eval.jsonl"
    flags = ["--method", "snapkv", "--lengths", "256", "--n", "4", "--batch", "2", "--gen-length", "8", "--journal",
             str(journal)]  # 8 tokens: snapkv scores 0 on one depth, 1 on the others, dense 1 on all
    assert evaluation.main(flags) == 0
    whole = capsys.readouterr()
    assert "eval: 4/4 samples, accuracy so far: dense " in whole.err and not journal.exists()
    generate = evaluation.Runner.generate
    warm_up = 2 if torch.cuda.is_available() else 0  # on a GPU each method first runs once untimed

    def interrupted_after(runs: int):
        calls = []

        def interrupted(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > warm_up + runs:
                raise KeyboardInterrupt
            return generate(self, *args, **kwargs)
        return interrupted

    for runs, done in ((2, 0), (1, 2)):  # interrupted, then interrupted again while resuming
        monkeypatch.setattr(evaluation.Runner, "generate", interrupted_after(runs))
        with pytest.raises(KeyboardInterrupt):
            evaluation.main(flags)
        assert (f": {done} of 4 runs done" in capsys.readouterr().err) == bool(done)
    monkeypatch.setattr(evaluation.Runner, "generate", generate)
    assert evaluation.main(flags) == 0
    resumed = capsys.readouterr()
    assert ": 3 of 4 runs done" in resumed.err and not journal.exists()
    scores = lambda out: [line.split("|")[4:6] for line in out.splitlines() if line.startswith("| 256")]
    assert scores(resumed.out) == scores(whole.out)  # accuracies (tokens/s are timings, read back or not)


def test_an_output_is_written_whole_or_not_at_all(tmp_path):
    """A writer that fails halfway leaves the earlier file as it was and no partial file beside it; one
    that finishes replaces it."""
    from nanodllm.cli import write_whole

    out = tmp_path / "table.md"
    out.write_text("earlier\n")

    def fails_halfway(partial):
        partial.write_text("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(out, fails_halfway)
    assert out.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.md"]
    write_whole(out, lambda partial: partial.write_text("new\n"))
    assert out.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.md"]


def test_a_failed_benchmark_row_is_named_and_retried_by_a_rerun(tmp_path, monkeypatch):
    """bench.py e2e --settings paper: a row whose process fails is reported (bench.py then exits
    non-zero) and left out of the journal, which keeps the rows that finished for the rerun."""
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_e2e
    import harness

    good = bench_e2e.Run("masked", "quick", "dense", 23, 8, 4, block=4)
    bad = dataclasses.replace(good, method="no_such_method")
    monkeypatch.setitem(bench_e2e.SETTINGS, "paper_quick", [good, bad])
    journal = tmp_path / "e2e.jsonl"
    args = argparse.Namespace(quick=True, journal=journal, timeout=300.0, settings="paper")
    assert bench_e2e.paper(harness.Setup(args)) == [bad.label()]
    kept = [json.loads(line).get("key") for line in journal.read_text().splitlines()[1:]]
    assert kept == ["machine", good.label()]


@pytest.mark.parametrize("engine, prompt", [("block", 23), ("block", 24), ("masked", 23)])
def test_a_benchmark_row_counts_the_blocks_and_forwards_its_generation_runs(monkeypatch, engine, prompt):
    """bench.py e2e's ms per later block divides by the blocks the engine begins after the first: the block
    engine's canvas is aligned to position 0, so a prompt ending inside a block decodes one more, in as
    few steps as its masks need. Its floor counts the forwards (steps, and the block engine's commits)."""
    from nanodllm.config import GenerationConfig
    from nanodllm.generation import generate
    from nanodllm.methods import get_method

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_e2e

    run = bench_e2e.Run(engine, "quick", "dense", prompt, 16, 4, block=8)
    model = bench_e2e.build(run, torch.device("cpu"))
    method, begun = get_method("dense"), []
    begin = method.begin_block
    method.begin_block = lambda ctx: (begun.append(ctx), begin(ctx))
    result = generate(model, [[1] * prompt], GenerationConfig(run.gen, run.block, run.timed_steps), method,
                      stop_ids=())
    assert len(begun) == run.blocks == (3 if (engine, prompt) == ("block", 23) else 2)
    assert result.forwards == run.forwards


def test_warm_start_resumes_its_journal_and_takes_medians(tmp_path, monkeypatch):
    """bench.py e2e --settings warm_start: configurations already journaled are not run again, and a row
    holds the medians over its later processes of the first generation, the warm one (the faster of the
    other two) and their difference, with the difference's range. A journal of another GPU is refused."""
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_e2e
    import harness

    done, todo = (bench_e2e.Run("masked", "quick", m, 23, 8, 4, block=4) for m in ("dense", "fast_dllm"))
    monkeypatch.setitem(bench_e2e.SETTINGS, "quick", [done, todo])
    later = [[5.0, 2.0, 3.0], [9.0, 4.0, 4.5], [4.0, 3.5, 1.0]]  # differences 3, 5, 3; warm 2, 4, 1
    journal = tmp_path / "warm.jsonl"
    args = argparse.Namespace(quick=True, journal=journal, repeats=3, methods=None)
    settings = {"settings": "quick", "repeats": 3, "methods": None, "device": "another GPU"}
    row = json.dumps({"key": done.label(), "result": {"first": 7.0, "later": later, "peak GiB": 1.0}})
    journal.write_text(json.dumps({"settings": settings}) + "\n" + row + "\n")
    with pytest.raises(SystemExit, match=r"other settings \(device\)"):  # never mixed with another GPU's rows
        bench_e2e.warm_start(harness.Setup(args))
    setup = harness.Setup(args)
    journal.write_text(json.dumps({"settings": {**settings, "device": setup.meta["device"]}}) + "\n" + row + "\n")
    ran = []

    def fake_process(run, generations, timeout=None):
        ran.append((run.method, generations))
        return {"seconds": [1.5, 1.0, 1.25][:generations], "peak GiB": 2.0}

    monkeypatch.setattr(bench_e2e, "in_new_process", fake_process)
    bench_e2e.warm_start(setup)
    assert ran == [("fast_dllm", 1)] + [("fast_dllm", 3)] * 3
    dense, fast = setup.report.sections[0]["rows"]
    assert (dense["first process s"], dense["later process s"], dense["warm s"]) == (7.0, 5.0, 2.0)
    assert (dense["later - warm s"], dense["range s"]) == (3.0, "3.00 - 5.00")
    assert (fast["later - warm s"], fast["vs dense"]) == (0.5, 2.0)
    assert not journal.exists()  # the run completed: a rerun starts afresh


def test_the_e2e_worker_times_one_configuration_in_its_process():
    run = {"engine": "masked", "model": "quick", "method": "maskkv", "prompt": 23, "gen": 8, "steps": 4, "block": 4}
    done = script("scripts/bench_e2e.py", "--one", json.dumps(run), "--generations", "2", timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert len(result["seconds"]) == len(result["first block"]) == 2
    assert all(0 < first <= whole for first, whole in zip(result["first block"], result["seconds"]))


def test_a_warm_start_subset_without_dense_has_no_ratio_to_it(tmp_path, monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_e2e
    import harness

    runs = [bench_e2e.Run("masked", "quick", m, 23, 8, 4, block=4) for m in ("dense", "fast_dllm")]
    monkeypatch.setitem(bench_e2e.SETTINGS, "quick", runs)
    monkeypatch.setattr(bench_e2e, "in_new_process", lambda run, generations, timeout=None:
                        {"seconds": [1.5, 1.0, 1.25][:generations], "peak GiB": 2.0})
    setup = harness.Setup(argparse.Namespace(quick=True, journal=tmp_path / "warm.jsonl", repeats=1,
                                             methods=["fast_dllm"]))
    bench_e2e.warm_start(setup)
    (row,) = setup.report.sections[0]["rows"]
    assert row["method"] == "fast_dllm" and "vs dense" not in row


def test_a_failed_warm_start_row_is_named_and_its_journal_kept(tmp_path, monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_e2e
    import harness

    good, bad = (bench_e2e.Run("masked", "quick", m, 23, 8, 4, block=4) for m in ("dense", "fast_dllm"))
    monkeypatch.setitem(bench_e2e.SETTINGS, "quick", [good, bad])

    def fake_process(run, generations, timeout=None):
        if run is bad:
            raise RuntimeError("the worker died")
        return {"seconds": [1.5, 1.0, 1.25][:generations], "peak GiB": 2.0}

    monkeypatch.setattr(bench_e2e, "in_new_process", fake_process)
    journal = tmp_path / "warm.jsonl"
    setup = harness.Setup(argparse.Namespace(quick=True, journal=journal, repeats=2, methods=None))
    assert bench_e2e.warm_start(setup) == [bad.label()]
    assert [row["method"] for row in setup.report.sections[0]["rows"]] == ["dense"]
    assert "vs dense" in setup.report.sections[0]["rows"][0]
    kept = [json.loads(line).get("key") for line in journal.read_text().splitlines()[1:]]
    assert kept == [good.label()]


def test_no_command_is_named_on_stderr():
    done = script("-m", "nanodllm", timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: no command given; choose from demo, eval "
                                  "(python -m nanodllm --help lists them)")


FAILING_LATE = [
    (["scripts/sweep.py", "--methods", "maskkv", "--knob", "budget=16", "--out", "no-such-folder/sweep.md"],
     "argument --out: the folder no-such-folder of no-such-folder/sweep.md does not exist"),
    (["scripts/sweep.py", "--methods", "maskkv", "--knob", "budget=16", "--plot", "docs"],
     "argument --plot: docs is a folder; give a file name"),
    (["-m", "nanodllm", "eval", "--plot", "no-such-folder/heatmap.png"],
     "argument --plot: the folder no-such-folder of no-such-folder/heatmap.png does not exist"),
    (["scripts/bench.py", "tune", "--out", "docs"], "argument --out: docs is a folder; give a file name"),
    (["scripts/bench.py", "routing", "--quick", "--out", "README.md"],
     "argument --out: README.md is a file, not a folder"),
    (["scripts/bench.py", "momo", "--quick", "--lengths", "0"],
     "argument --lengths: must be a positive integer, got '0'"),
    (["scripts/bench.py", "dyllm", "--quick", "--fractions", "2"],
     "argument --fractions: must be a number from 0 to 1, got '2'"),
    (["scripts/momo_mass.py", "--chi", "0"], "argument --chi: must be a positive integer, got '0'"),
    (["scripts/momo_mass.py", "--synthetic", "--mask", "causal,diag"],
     "argument --mask: diag is not a mask; choose from causal, block, none"),
    (["scripts/bench.py", "dyllm_salient", "--n", "0"], "argument --n: must be a positive integer, got '0'"),
    (["tests/mutate.py", "--timeout", "0.001"], "argument --timeout: must be at least 1 (seconds), got '0.001'"),
    (["tests/mutate.py", "--timeout", "-5"], "argument --timeout: must be at least 1 (seconds), got '-5'"),
    (["scripts/bench.py", "dyllm_salient", "--out", "README.md"], "argument --out: README.md is a file, not a folder"),
]


@pytest.mark.parametrize("args, last_line", FAILING_LATE)
def test_an_output_path_or_value_that_would_fail_late_is_refused_first(args, last_line):
    """Checked as the flags are read, not when the run ends and writes (or a benchmark reaches the value)."""
    done = run_together([a for a, _ in FAILING_LATE], args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith(last_line), done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_gpu_only_benchmark_flag_is_refused_on_a_cpu(tmp_path):
    """Before, the run went on without the part the flag asks for, wrote its files and exited 0."""
    done = script("scripts/bench.py", "moe", "--quick", "--generate", "llada2-mini", "--out", str(tmp_path),
                  timeout=120)
    assert done.returncode == 2 and "bench.py: error: moe --generate runs on a GPU only" in done.stderr.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_tuning_without_a_gpu_is_refused_and_writes_nothing(tmp_path):
    done = script("scripts/bench.py", "tune", "--out", str(tmp_path / "tuned.json"), timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("bench.py tune measures launch settings on a GPU") and list(tmp_path.iterdir()) == []


def test_an_eval_of_a_file_without_samples_is_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    done = entry("eval", "--task", "longbench", "--data", str(data), "--journal", str(tmp_path / "eval.jsonl"))
    assert done.returncode == 2 and done.stderr.startswith(f"error: --data {data}: the file holds no samples")


def test_plot_results_names_the_tables_it_lacks_before_drawing(tmp_path):
    (tmp_path / "bench_momo.json").write_text("{}")
    done = script("scripts/plot_results.py", "--results", str(tmp_path), timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"plot_results.py: {tmp_path} lacks bench_sparse_dllm.json, dyllm_salient.json, "
                                  "tiny_models.json, mage_accuracy.md")
    assert [p.name for p in tmp_path.iterdir()] == ["bench_momo.json"]


@pytest.mark.parametrize("command", [
    ["-m", "nanodllm", "eval", "--method", "snapkv", "--lengths", "256"],
    ["scripts/sweep.py", "--methods", "snapkv", "--knob", "budget=16", "--lengths", "256"],
])
def test_ctrl_c_exits_130_with_a_line_and_keeps_the_journal(command, tmp_path):
    """SIGINT mid-run, as Ctrl-C sends it: exit status 130 and one line instead of a traceback; the journal of
    finished runs stays for the rerun."""
    journal = tmp_path / "runs.jsonl"
    running = subprocess.Popen([sys.executable, *command, "--n", "40", "--batch", "1", "--journal", str(journal)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        said = []
        while not any(line.startswith("finished runs are kept in") for line in said):
            said.append(running.stderr.readline())
            assert said[-1], "".join(said)
        running.send_signal(signal.SIGINT)
        said.append(running.communicate(timeout=60)[1])
    finally:
        running.kill()
    assert running.returncode == 130 and "Traceback" not in "".join(said)
    assert "".join(said).rstrip().endswith("interrupted (Ctrl-C): nothing more was run or written")
    assert journal.exists()


RUN_MAIN = """
import sys, torch
from nanodllm.cli import run_main
def main():
    if sys.argv[1] == "cpu":
        torch.empty(1 << 50, dtype=torch.uint8)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\\nmore detail")
sys.exit(run_main(main))
"""


@pytest.mark.parametrize("where, allocation", [("cpu", "DefaultCPUAllocator: can't allocate memory"),
                                               ("gpu", "CUDA out of memory. Tried to allocate 20.00 GiB.)")])
def test_running_out_of_memory_is_one_line_and_exit_1(where, allocation):
    """What every entry point's run_main does when an allocation fails mid-run: a real one on the CPU, and
    the error torch raises for a GPU's."""
    done = script("-c", RUN_MAIN, where, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: out of memory (") and allocation in first
    assert first.endswith("a shorter context or a smaller batch needs less")


FAILING_PREFILL = """
import runpy, sys
bench = runpy.run_path("scripts/bench.py")
import nanodllm.kernels.flash_attention
def fails(*args, **kwargs):
    raise RuntimeError("no kernel for this GPU")
nanodllm.kernels.flash_attention.flash_attention = fails
sys.argv = ["scripts/bench.py", "kernels", "--quick", "--out", sys.argv[1]]
sys.exit(bench["run_main"](bench["main"]))
"""


def test_a_benchmark_part_that_fails_is_written_as_failed_and_exits_1(tmp_path):
    """bench.py kernels keeps the tables before a failing section (another file's kernel), and says so."""
    done = script("-c", FAILING_PREFILL, str(tmp_path), timeout=300)
    assert done.returncode == 1 and done.stderr.splitlines()[0] == (
        "bench.py kernels: 1 part(s) failed: Dense prefill (flash_attention): RuntimeError: no kernel for this GPU. "
        f"The tables that finished are written to {tmp_path}.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_kernels_quick.json", "bench_kernels_quick.md"]
    assert "- failed: Dense prefill (flash_attention)" in (tmp_path / "bench_kernels_quick.md").read_text()


@pytest.mark.parametrize("world", [1, 2])
def test_the_memory_estimate_is_its_parts_counted_by_hand(monkeypatch, world):
    """tiny sdar (hidden 32, 2 layers, 4 heads and 2 KV heads of 8, MLP 64, vocabulary 64, untied head),
    100 tokens x batch 3 in float32 on the CPU: the weights, K and V kept twice, and three fp32 score
    tensors of one layer, each split over `world` ranks. It fits in exactly that many bytes, not one less."""
    from nanodllm import cli
    from tests.tiny_models import tiny_config

    layer = 32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 2 * 8 + 2 * 32 + 3 * 32 * 64  # q, k v, o, q/k norms, norms, MLP
    weights = (2 * 64 * 32 + 2 * layer + 32) * 4 // world  # embedding, head, layers, final norm
    kv = 2 * 2 * 2 * 2 * 8 * 100 * 3 * 4 // world  # K and V, twice, layers, KV heads, dims, tokens, rows
    scores = 3 * 3 * 4 * 100 * 100 * 4 // world  # three tensors, rows, heads, tokens x tokens
    for free, fits in ((weights + kv + scores, True), (weights + kv + scores - 1, False)):
        monkeypatch.setattr(cli, "available_ram", lambda: free)
        if fits:
            assert cli.check_fits(tiny_config("sdar"), 100, 3, torch.device("cpu"), torch.float32, world) is None
            continue
        with pytest.raises(ValueError, match="100 tokens x batch 3 need about"):
            cli.check_fits(tiny_config("sdar"), 100, 3, torch.device("cpu"), torch.float32, world)


def broken_checkpoint(tmp_path: Path, edit: str) -> Path:
    """tiny-sdar copied, with one thing broken (`edit`)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / edit
    shutil.copytree(REPO / "nanodllm" / "assets" / "tiny-sdar", path)
    config = json.loads((path / "config.json").read_text())
    if edit in ("list", "null"):
        (path / "config.json").write_text("[]" if edit == "list" else "null")
    elif edit in ("num_key_value_heads", "eos_token_id"):
        config[edit] = 0 if edit == "num_key_value_heads" else "eos"
        (path / "config.json").write_text(json.dumps(config))
    elif edit == "tokenizer":
        (path / "tokenizer.json").write_text('{"hello": 1}')
    else:
        weights = load_file(str(path / "model.safetensors"))
        save_file({name: tensor.to(torch.int32) for name, tensor in weights.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("edit, last_line", [
    ("list", "config.json holds a list, not a JSON object of fields"),
    ("null", "config.json holds null, not a JSON object of fields"),
    ("num_key_value_heads", "config.json: num_kv_heads must be >= 1, got 0"),
    ("eos_token_id", "config.json: eos_token_id must be a token id or a list of them, got 'eos'"),
    ("tokenizer", "tokenizer.json is not a tokenizer the tokenizers library reads: "),
    ("int32", "model.safetensors: lm_head.weight holds I32 numbers; nanodllm loads floating-point weights"),
])
def test_a_broken_checkpoint_is_one_line_naming_its_file(tmp_path, capsys, edit, last_line):
    from nanodllm.__main__ import main

    path = broken_checkpoint(tmp_path, edit)
    assert main(["demo", "--model", str(path), "--gen-length", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {path}") and last_line in err[-1], err


@pytest.mark.parametrize("args, last_line", [
    (["demo", "--prompt", "hi", "--context", "4096"],
     "--length sets the built-in prompt's length; with --prompt or --prompt-file it does nothing"),
    (["eval", "--method", "all", "--knobs", "k=8"], "error: method 'dllm_cache' has no knob 'k'"),
])
def test_a_flag_that_would_be_ignored_or_fail_late_is_refused_at_once(capsys, args, last_line):
    from nanodllm.__main__ import main

    with pytest.raises(SystemExit) if args[0] == "demo" else contextlib.nullcontext():
        assert main(args) == 2
    assert last_line in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path, capsys):
    from nanodllm.__main__ import main

    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"the pass key is \xff\xfe")
    assert main(["demo", "--prompt-file", str(prompt)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"--prompt-file {prompt}: not UTF-8 text (invalid start byte at byte 16)")


def test_the_version_and_the_defaults_are_in_the_help(capsys):
    from nanodllm import __version__
    from nanodllm.__main__ import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"nanodllm {__version__}"
    for command, shown in (("eval", ["(default: 50)", "(default: 1024)"]), ("demo", ["(default: 32)"])):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # as wrapped to any terminal's width
        assert all(part in text for part in shown), text


@pytest.mark.parametrize("doc", ["nanodllm.__main__", "nanodllm.eval"])
def test_the_eval_example_in_the_help_runs_as_written(doc, tmp_path, monkeypatch, capsys):
    """With one short sample instead of the example's many (the last --n and --lengths win)."""
    import importlib

    from nanodllm.__main__ import main

    line = next(line for line in importlib.import_module(doc).__doc__.splitlines() if "nanodllm eval" in line)
    example = line.split("python -m nanodllm ")[1].split("  ")[0].split()
    monkeypatch.chdir(tmp_path)
    assert main([*example, "--n", "1", "--lengths", "256", "--gen-length", "8"]) == 0, capsys.readouterr().err


def test_a_run_refused_midway_leaves_no_empty_journal(tmp_path, monkeypatch, capsys):
    from nanodllm import eval as evaluation

    def refused(self, *args, **kwargs):
        raise ValueError("refused by the method")

    monkeypatch.setattr(evaluation.Runner, "generate", refused)
    journal = tmp_path / "eval.jsonl"
    assert evaluation.main(["--lengths", "256", "--n", "1", "--journal", str(journal)]) == 2
    assert capsys.readouterr().err.strip().endswith("error: refused by the method") and not journal.exists()


def test_a_refused_sweep_leaves_nothing_behind(tmp_path):
    """Refused after its journal was opened (a method of the other engine), in a folder of its own."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), "--model", "tiny-sdar", "--methods",
                           "maskkv", "--knob", "budget=16", "--lengths", "256", "--n", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        "error: method 'maskkv' runs on the masked engine; this sdar model"), done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, held, message", [
    ("--data", b'{"settings": "caf\xe9"}\n', ": not UTF-8 text (invalid continuation byte at byte 17)"),
    ("--journal", b'{"settings": "caf\xe9"}\n', ": not UTF-8 text (invalid continuation byte at byte 17)"),
    ("--journal", b'["a list"]\n', " is not a journal (its first line holds no settings); remove it or pass another "
                                   "--journal"),
])
def test_a_data_file_or_journal_that_cannot_be_read_is_named_and_kept(tmp_path, flag, held, message):
    path = tmp_path / "file.jsonl"
    path.write_bytes(held)
    task = ["--task", "longbench"] if flag == "--data" else []
    done = entry("eval", *task, flag, str(path), "--lengths", "256", "--n", "1", "--gen-length", "8")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: {path}{message}"
    assert path.read_bytes() == held and list(tmp_path.iterdir()) == [path]


def test_a_mutation_check_that_times_out_is_not_a_pass():
    """A plant whose tests run out of time was not shown caught: the check exits 1."""
    done = script("tests/mutate.py", "--only", "config-norm-topk-prob-always-on", "--timeout", "1", timeout=300)
    assert done.returncode == 1 and "timeout" in done.stdout, done.stdout + done.stderr


def test_a_unit_fraction_takes_both_ends_and_nothing_past_them():
    import argparse

    from nanodllm.cli import unit_fraction

    assert (unit_fraction("0"), unit_fraction("0.5"), unit_fraction("1")) == (0.0, 0.5, 1.0)
    for text in ("1.0001", "-0.01", "nan", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be a number from 0 to 1, got '{text}'"):
            unit_fraction(text)


def test_as_many_steps_as_tokens_per_block_or_generation_are_allowed():
    """One token a step is the most steps can do: that many are allowed, one more is refused."""
    from nanodllm.cli import check_steps
    from nanodllm.config import GenerationConfig

    check_steps(GenerationConfig(gen_length=32, block_length=8, steps=32), is_block=False)
    check_steps(GenerationConfig(gen_length=32, block_length=8, steps=8), is_block=True)
    with pytest.raises(ValueError, match="--steps 33 exceeds --gen-length 32"):
        check_steps(GenerationConfig(gen_length=32, block_length=8, steps=33), is_block=False)
    with pytest.raises(ValueError, match=r"--steps 9 exceeds --block-length 8 \(steps are per block\)"):
        check_steps(GenerationConfig(gen_length=32, block_length=8, steps=9), is_block=True)


def test_run_main_turns_ctrl_c_and_os_errors_into_exit_codes_and_lets_other_errors_through(capsys):
    """Ctrl-C exits 130 and an OS error 1, each one line on stderr; any other error (a bug, a RuntimeError
    that is not out of memory) is raised as it is, not told as something else."""
    from nanodllm.cli import run_main

    def raises(error):
        def main():
            raise error
        return main

    assert run_main(lambda flags: len(flags), [1, 2]) == 2
    assert run_main(raises(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): nothing more was run or written\n"
    assert run_main(raises(PermissionError("cannot write out.md"))) == 1
    assert capsys.readouterr().err == "error: cannot write out.md\n"
    with pytest.raises(RuntimeError, match="no kernel for this GPU"):
        run_main(raises(RuntimeError("no kernel for this GPU")))
    assert capsys.readouterr().err == ""


def test_help_of_the_package_lists_its_commands(capsys):
    """-h is --help: the package's usage, its commands and exit 0 (not an unknown command)."""
    from nanodllm.__main__ import main

    for flag in ("-h", "--help"):
        assert main([flag]) == 0
        said = capsys.readouterr()
        assert said.err == "" and said.out.startswith("The package's command line: `python -m nanodllm COMMAND")
        assert "python -m nanodllm demo" in said.out and "python -m nanodllm eval" in said.out


def test_the_partial_file_keeps_the_outputs_suffix(tmp_path):
    """Writers that pick a format by the name (matplotlib's savefig) see the output's suffix on the file they write."""
    from nanodllm.cli import write_whole

    written = []
    write_whole(tmp_path / "heatmap.png", lambda partial: (written.append(partial), partial.write_bytes(b"png")))
    assert written[0].suffix == ".png" and written[0].parent == tmp_path and written[0].name != "heatmap.png"
    assert [p.name for p in tmp_path.iterdir()] == ["heatmap.png"] and (tmp_path / "heatmap.png").read_bytes() == b"png"


def test_pythons_own_memory_error_is_out_of_memory_too(capsys):
    """A MemoryError (Python's allocator failing) exits 1 with the out-of-memory line, named by its type."""
    from nanodllm.cli import run_main

    def main():
        raise MemoryError()

    assert run_main(main) == 1
    assert capsys.readouterr().err == ("error: out of memory (MemoryError); a shorter context or a smaller batch "
                                       "needs less\n")


def test_a_context_of_exactly_the_trained_positions_is_not_stretched(monkeypatch):
    """check_fits: max_position_embeddings tokens fit the trained positions (no note, and DiffusionGemma's
    unstretched RoPE takes them); one token more gets the stretch note, or DiffusionGemma's refusal."""
    from nanodllm import cli
    from nanodllm.config import ModelConfig
    from tests.tiny_models import tiny_config

    monkeypatch.setattr(cli, "available_ram", lambda: 2**40)
    cpu = torch.device("cpu")
    sdar, gemma = tiny_config("sdar"), ModelConfig.from_dir(REPO / "tests" / "fixtures" / "diffusion_gemma_tiny")
    assert cli.check_fits(sdar, sdar.max_position_embeddings, 1, cpu, torch.float32) is None
    assert cli.check_fits(sdar, sdar.max_position_embeddings + 1, 1, cpu, torch.float32).startswith(
        f"note: {sdar.max_position_embeddings + 1} tokens are past the model's trained")
    assert cli.check_fits(gemma, gemma.max_position_embeddings, 1, cpu, torch.float32) is None
    with pytest.raises(ValueError, match=f"{gemma.max_position_embeddings + 1} tokens exceed max_position_embeddings"):
        cli.check_fits(gemma, gemma.max_position_embeddings + 1, 1, cpu, torch.float32)


def test_available_ram_reads_memavailable_in_bytes(monkeypatch):
    """/proc/meminfo counts in kB (KiB): MemAvailable 2048 kB is 2 MiB."""
    import io

    from nanodllm import cli

    meminfo = "MemTotal:        8192 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n"
    monkeypatch.setattr(cli, "open", lambda *args, **kwargs: io.StringIO(meminfo), raising=False)
    assert cli.available_ram() == 2048 * 1024


def test_a_data_parallel_world_that_is_no_multiple_of_tp_is_refused(monkeypatch):
    """--tp 4 over 2 processes, or --tp 2 over 3, makes no whole replicas: refused naming both numbers, before
    any process group starts."""
    from nanodllm import cli

    monkeypatch.setattr(cli, "from_torchrun", lambda *args: pytest.fail("a process group was started"))
    for world, tp in ((2, 4), (3, 2)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        refused = rf"--tp {tp} needs a multiple of {tp} processes \(.*\); this run has {world}"
        with pytest.raises(ValueError, match=refused):
            cli.tensor_parallel(tp, data_parallel=True)
    with pytest.raises(ValueError, match="--tp 0 needs"):  # refused, not divided by
        cli.tensor_parallel(0, data_parallel=True)


def test_an_output_file_under_a_file_is_refused_at_once(tmp_path):
    """Its folder is a file, so no folder to write into: refused as the flag is read."""
    import argparse

    from nanodllm.cli import output_file

    (tmp_path / "notes.txt").write_text("notes")
    with pytest.raises(argparse.ArgumentTypeError, match="the folder .*notes.txt of .* is a file"):
        output_file(str(tmp_path / "notes.txt" / "heatmap.png"))
    assert output_file(str(tmp_path / "heatmap.png")) == tmp_path / "heatmap.png"


def test_the_help_adds_a_default_only_where_the_help_names_none():
    """HelpFormatter: '(default: X)' after a flag's help (a list's items joined by commas), but not where the
    help already says what its default is."""
    import argparse

    from nanodllm.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--block", type=int, default=32, help="default: the config's block size")
    parser.add_argument("--lengths", default=[1024, 2048], help="context lengths")
    text = " ".join(parser.format_help().split())
    assert "steps per block (default: 8)" in text and "context lengths (default: 1024,2048)" in text
    assert "default: the config's block size" in text and "(default: 32)" not in text
