"""The shipped tiny models (real formats, retrieval accuracy) and the eval harness around them."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from nanodllm import eval as evaluation
from nanodllm.config import ModelConfig
from nanodllm.meter import Meter
from nanodllm.methods.base import Dense, Selection
from nanodllm.tasks import make_samples

ASSETS = Path(evaluation.__file__).resolve().parent / "assets"
FIXTURES = Path(__file__).parent / "fixtures"


def run_eval(capsys, *args):
    code = evaluation.main(["--device", "cpu", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def accuracy(out: str, method: str, length: int) -> float:
    line = next(l for l in out.splitlines() if l.startswith(f"{method}: "))
    return dict(part.split(": ") for part in line[len(method) + 2 :].split(", "))[str(length)]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-sdar", "tiny-gemma"])
def test_tiny_models_are_in_the_real_formats(name):
    directory = ASSETS / name
    raw = json.loads((directory / "config.json").read_text())
    cfg = ModelConfig.from_dir(directory)
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert (directory / "model.safetensors").stat().st_size < 10 * 2**20
    if name == "tiny-llada":
        assert {"d_model", "n_layers", "n_heads", "mlp_hidden_size", "weight_tying"} <= raw.keys()
        assert cfg.attention == "bidirectional"
        assert "model.transformer.blocks.0.ff_proj.weight" in keys and "model.transformer.ff_out.weight" in keys
    elif name == "tiny-gemma":
        assert {"canvas_length", "text_config"} <= raw.keys() and raw["text_config"]["sliding_window"] == 256
        assert cfg.gemma.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.block_size == 32
        assert cfg.gemma.global_head_dim != cfg.head_dim and cfg.gemma.global_kv_heads < cfg.num_kv_heads
        assert {"model.decoder.layers.1.experts.gate_up_proj", "model.encoder.language_model.layers.1.layer_scalar",
                "model.decoder.self_conditioning.gate_proj.weight"} <= keys
    else:
        assert {"hidden_size", "num_hidden_layers", "num_key_value_heads", "block_size"} <= raw.keys()
        assert cfg.attention == "block_causal" and cfg.block_size == 32 and cfg.qk_norm
        assert cfg.num_kv_heads < cfg.num_heads
        assert "model.layers.0.self_attn.q_norm.weight" in keys and "lm_head.weight" in keys


@pytest.mark.parametrize("name,length,extra", [("tiny-sdar", 1024, []), ("tiny-llada", 1024, ["--gen-length", "8"]),
                                               ("tiny-gemma", 512, [])])
def test_passkey_on_the_cpu(capsys, name, length, extra):
    """10 of 10 (two at each of the 5 depths) at the longest length each model was trained to answer well."""
    code, out, err = run_eval(capsys, "--model", name, "--task", "passkey", "--lengths", str(length), "--n", "10",
                              "--batch", "10", *extra)
    assert code == 0, err
    assert float(accuracy(out, "dense", length)) >= 0.95, out


def test_longbench_file_is_scored(capsys, tmp_path):
    data = tmp_path / "qa.jsonl"
    rows = [dict(input="What is the pass key?", context="The pass key is 12345. Remember it.", answers=["12345"],
                 length=10, dataset="narrativeqa", all_classes=None, _id=str(i)) for i in range(2)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, err = run_eval(capsys, "--model", "tiny-sdar", "--task", "longbench", "--data", str(data), "--n", "2")
    assert code == 0, err
    assert "| narrativeqa |" in out


@pytest.mark.parametrize("args,message", [
    (["--method", "nope"], "unknown method 'nope'; valid methods: dense"),
    (["--task", "longbench"], "--task longbench needs --data"),
    (["--task", "longbench", "--data", "/nowhere.jsonl"], "error: --data /nowhere.jsonl: no such file"),
    (["--model", "/nowhere"], "model not found: /nowhere"),
    (["--model", "tiny-llada", "--method", "mage"],
     "method 'mage' runs on the block and gemma engines; this llada model"),
    (["--method", "mage", "--knobs", "budget=64"], "method 'mage' has no knob 'budget'; its knobs (defaults): k=1024"),
])
def test_bad_arguments_are_named(capsys, args, message):
    code, _, err = run_eval(capsys, *args)
    assert code == 2 and message in err


def test_plot_writes_a_heatmap_or_says_matplotlib_is_missing(capsys, tmp_path):
    target = tmp_path / "heatmap.png"
    code, out, err = run_eval(capsys, "--model", "tiny-sdar", "--lengths", "256", "--n", "2", "--plot", str(target))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "--plot needs matplotlib" in err and not target.exists()
    else:
        assert code == 0 and target.stat().st_size > 0


@pytest.mark.parametrize("methods", [["dense"], ["dense", "other"]])
def test_table_rows_have_as_many_columns_as_the_header(methods):
    outcome = evaluation.Outcome(scores=[1.0, 0.0], tokens=[[1, 2], [3]], seconds=0.5, kv_kept=[1.0, 0.5])
    results = {m: {(1024, 0.5): outcome, (2048, 0.0): outcome} for m in methods}
    lines = evaluation.table(results, methods).splitlines()
    assert [line.count("|") for line in lines] == [lines[0].count("|")] * 4
    assert lines[0] == "| cell | depth | n | " + " | ".join(f"{m} acc" for m in methods) + (
        " | other agree | other tok/s | other KV kept" if len(methods) == 2 else "") + " | dense tok/s |"
    assert lines[2].startswith("| 1024 | 0.50 | 2 | 0.500 | ") and lines[2].endswith(" | 6.0 |")


def test_each_method_shows_its_own_accuracy_agreement_and_speed():
    dense = evaluation.Outcome(scores=[1.0, 1.0], tokens=[[1, 2], [3, 4]], seconds=1.0, kv_kept=[1.0, 1.0])
    other = evaluation.Outcome(scores=[0.0, 1.0], tokens=[[1, 5], [3, 4]], seconds=0.5, kv_kept=[0.5, 0.25])
    row = evaluation.table({"dense": {(1024, 0.5): dense}, "other": {(1024, 0.5): other}}, ["dense", "other"])
    assert row.splitlines()[2] == "| 1024 | 0.50 | 2 | 1.000 | 0.500 | 0.750 | 8.0 | 0.375 | 4.0 |"


class BatchOfThreeSeconds:
    """A Runner whose every run of a batch takes 3 s."""

    device, replicas, replica = torch.device("cpu"), 1, 0

    def generate(self, chunk, name):
        n = len(chunk)
        return evaluation.Outcome(scores=[1.0] * n, tokens=[[7, 8]] * n, seconds=3.0, kv_kept=[1.0] * n)


def test_each_cell_is_charged_its_samples_share_of_a_runs_seconds():
    """Two runs of two samples, each sample in its own cell: each cell gets half of each run's 3 s."""
    samples = make_samples("passkey", 128, 4, seed=0, depths=[0.0, 1.0])
    results = evaluation.evaluate(BatchOfThreeSeconds(), samples, ["dense"], batch=2)
    assert {cell: outcome.seconds for cell, outcome in results["dense"].items()} == {(128, 0.0): 3.0, (128, 1.0): 3.0}

@pytest.mark.parametrize("name", ["tiny-llada", "tiny-sdar", "tiny-gemma"])
def test_kv_key_words_are_one_token_each_in_the_tiny_tokenizers(name):
    from tokenizers import Tokenizer as HFTokenizer

    from nanodllm.tasks import KV_KEYS

    tokenizer = HFTokenizer.from_file(str(ASSETS / name / "tokenizer.json"))
    for key in KV_KEYS:
        assert tokenizer.encode(f"\n{key} :").tokens == ["Ċ", key, "Ġ:"]
        assert tokenizer.encode(f"of {key}?").tokens == ["of", "Ġ", key, "?"]


def test_method_all_runs_the_methods_of_the_models_engine(capsys):
    code, out, err = run_eval(capsys, "--model", "tiny-sdar", "--method", "all", "--lengths", "256", "--n", "1",
                              "--gen-length", "32")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("| cell"))
    assert "mage acc" in header and "quest acc" in header and "maskkv" not in header and "dyllm" not in header


def test_sweep_depth_grids_read_back():
    """scripts/sweep.py's depth grids, as its --out file lays them out under '## Task' headings (next
    to the per-length table, whose rows must not be read as a grid), come back cell for cell."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "sweep.py"
    spec = importlib.util.spec_from_file_location("sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    lengths = [2048, 4096]
    outcomes = {"dense": [1, 1, 0, 1], "mage k=64": [0, 1, 1, 1]}  # per (length, depth) cell: one record
    cells = {name: {(length, depth): [(hits[i * 2 + j],)] for i, length in enumerate(lengths)
                    for j, depth in enumerate((0.0, 0.5))} for name, hits in outcomes.items()}
    sections = []
    for task in ("kv", "passkey"):
        sections += [f"## Task {task}\n", "| variant | 2048 acc | 4096 acc |", "|---|---|---|",
                     "| dense | 1.000 | 0.500 |", "", "Accuracy by needle depth x context length:\n"]
        sections += [sweep.depth_grid(name, grid, lengths) + "\n" for name, grid in cells.items()]
    sections += ["## Something else\n", "other:\n", "| depth | 2048 |", "|---|---|", "| 0.00 | 0.25 |"]
    grids = sweep.read_depth_grids("\n".join(sections))
    expected = {name: {cell: float(records[0][0]) for cell, records in grid.items()} for name, grid in cells.items()}
    assert grids == {"kv": expected, "passkey": expected}


def test_on_a_gpu_eval_warms_each_method_up_before_timing(capsys):
    """The first batch runs once per method untimed (the kernels load or compile then), said apart."""
    import torch

    from nanodllm import tasks

    class Runner:
        device = torch.device("cuda")
        replica, replicas = 0, 1
        calls = []

        def generate(self, chunk, name):
            self.calls.append((len(chunk), name))
            return evaluation.Outcome(seconds=1.0, scores=[1.0] * len(chunk), tokens=[[1]] * len(chunk),
                                      kv_kept=[1.0] * len(chunk))

    samples = tasks.make_samples("passkey", 64, 3, 0, count_tokens=len)
    evaluation.evaluate(Runner(), samples, ["dense", "mage"], batch=2)
    assert Runner.calls == [(2, "dense"), (2, "mage"), (2, "dense"), (2, "mage"), (1, "dense"), (1, "mage")]
    assert "warm-up, not timed" in capsys.readouterr().err


@pytest.mark.parametrize("a, b, expected", [
    ([[1, 2, 3, 4]], [[1, 2, 3, 4]], 1.0),
    ([[1, 2, 3, 4] * 10], [[1, 2, 3, 4] * 2], 0.2),  # a row that stopped after 8 of 40 tokens
    ([[1, 2], [3]], [[1, 9], [3, 4, 5]], 2 / 5),  # positions counted over the longer of each pair
    ([[5, 6, 7]], [[6, 7, 8]], 0.0),
])
def test_agreement_counts_every_position_either_run_generated(a, b, expected):
    assert evaluation.agreement(a, b) == pytest.approx(expected) == pytest.approx(evaluation.agreement(b, a))


def test_diffusion_gemma_is_evaluated_with_its_sampler_and_recall(capsys):
    """eval on a DiffusionGemma checkpoint: the table adds each method's tokens per denoising step; --recall
    records its full layers only (layer 3 of the fixture: layer 1, the other full one, is exact)."""
    flags = ["--model", str(FIXTURES / "diffusion_gemma_tiny"), "--task", "passkey", "--lengths", "128", "--n", "2",
             "--batch", "2", "--method", "mage", "--knobs", "k=16", "--gen-length", "16", "--steps", "6"]
    code, out, err = run_eval(capsys, *flags)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("| cell"))
    assert header.endswith("| dense tok/s | dense tok/step | mage tok/step |"), header
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 128 ")]
    assert len(rows) == 2 and all(0 < float(row[-1].strip(" |")) <= 8 for row in rows)  # a canvas of 8 at most a step
    code, out, err = run_eval(capsys, *flags, "--recall")
    assert code == 0, err
    assert "| steps | layer 3 |" in out and "layer 1" not in out and "| 3 | " in out


class Stated(Dense):
    """A method that states each step's (K/V kept, of how many) from a list, or selects `most` keys at layer 2."""

    def __init__(self, kept=(), most=None):
        self.kept, self.most = list(kept), most

    def kv_kept(self, ctx):
        return self.kept.pop(0) if self.kept else None

    def selection(self, layer, ctx):
        if layer != 2 or self.most is None:
            return None
        return Selection(torch.zeros(2, 1, 1), torch.ones(2, 1), 1, self.most)


def test_the_meter_sums_each_count_over_the_steps_before_dividing():
    """kv_kept over steps of 3 of 4 and 1 of 4 entries is 4 of 8; per layer, each layer's sums divided."""
    meter, method = Meter(), Stated([(3, 4), (1, 4)])
    for _ in range(2):
        meter.count(method, SimpleNamespace(cache=None))
    assert meter.stats() == {"kv_kept": 0.5}
    meter, method = Meter(), Stated([(torch.tensor([3.0, 4.0]), 4), (torch.tensor([1.0, 0.0]), 4)])
    for _ in range(2):
        meter.count(method, SimpleNamespace(cache=None))
    assert meter.stats() == {"kv_kept_per_layer": [0.5, 0.5], "kv_kept": 0.5}


def test_a_selecting_layer_reads_at_most_its_keys_of_each_cached_row():
    """Where a method states nothing, the block engine's cached keys read: every key of layer 0, at layer 2
    at most `most` = 4 of a row's (10 of 10 + 3 of 3, then 4 of 10 + 3 of 3); layer 1 holds no cache."""
    cache = SimpleNamespace(host_lengths=[10, 3], keys=[torch.zeros(1), None, torch.zeros(1)])
    meter = Meter()
    meter.count(Stated(most=4), SimpleNamespace(cache=cache))
    assert meter.stats() == {"kv_kept": 20 / 26}


def test_a_methods_own_statement_is_counted_over_the_cache_it_reads():
    """Where a method states its K/V kept (1 of 4), that is the count, even on an engine with a cache whose keys
    the meter would otherwise count (13 of 26 here)."""
    cache = SimpleNamespace(host_lengths=[10, 3], keys=[torch.zeros(1), None, torch.zeros(1)])
    meter = Meter()
    meter.count(Stated([(1, 4)], most=4), SimpleNamespace(cache=cache))
    assert meter.stats() == {"kv_kept": 0.25}


def test_the_summary_averages_each_length_over_its_samples():
    """A length's accuracy is over all its samples, not a mean of its cells' (3 of 4 and 0 of 1 make 3/5)."""
    results = {"dense": {(1024, 0.0): evaluation.Outcome(scores=[1.0, 1.0, 1.0, 0.0]),
                         (1024, 1.0): evaluation.Outcome(scores=[0.0]),
                         (2048, 0.0): evaluation.Outcome(scores=[1.0])}}
    assert evaluation.summary(results, ["dense"]) == {"dense": {1024: pytest.approx(3 / 5), 2048: 1.0}}


def test_a_journal_resumed_twice_keeps_every_finished_run_once(tmp_path):
    """A last line cut short by an interruption is dropped on resume, so runs added after it survive the next."""
    path, settings = tmp_path / "eval.jsonl", {"n": "4"}
    first = evaluation.Journal(path, settings)
    first.add({"key": "dense @ 0", "scores": [1.0]})
    with path.open("a") as file:
        file.write('{"key": "dense @ 2", "sco')
    second = evaluation.Journal(path, settings)
    assert list(second.done) == ["dense @ 0"]
    second.add({"key": "dense @ 2", "scores": [0.0]})
    third = evaluation.Journal(path, settings)
    assert third.done == {"dense @ 0": {"key": "dense @ 0", "scores": [1.0]},
                          "dense @ 2": {"key": "dense @ 2", "scores": [0.0]}}
    assert len(path.read_text().splitlines()) == 3


def test_a_refused_run_leaves_a_journal_only_when_it_holds_finished_runs(tmp_path):
    path, settings = tmp_path / "eval.jsonl", {"n": "4"}
    evaluation.Journal(path, settings).forget_unless_resumable()
    assert not path.exists()
    journal = evaluation.Journal(path, settings)
    journal.add({"key": "dense @ 0", "scores": [1.0]})
    journal.forget_unless_resumable()
    assert list(evaluation.Journal(path, settings).done) == ["dense @ 0"]


class SteppingRunner(BatchOfThreeSeconds):
    """A Runner whose sample i of every batch decodes 1 + i tokens per denoising step (DiffusionGemma's sampler)."""

    def generate(self, chunk, name):
        outcome = super().generate(chunk, name)
        outcome.tokens_per_step = [1.0 + i for i in range(len(chunk))]
        return outcome


def test_each_cell_gets_its_own_samples_tokens_per_step():
    samples = make_samples("passkey", 128, 4, seed=0, depths=[0.0, 1.0])
    results = evaluation.evaluate(SteppingRunner(), samples, ["dense"], batch=2)
    assert {cell: o.tokens_per_step for cell, o in results["dense"].items()} == {(128, 0.0): [1.0, 1.0],
                                                                                  (128, 1.0): [2.0, 2.0]}
    assert evaluation.table(results, ["dense"]).splitlines()[2].endswith(" | 1.00 |")


def test_a_profile_named_in_the_knobs_wins_over_the_checkpoints(tmp_path):
    """with_profile adds the checkpoint's MaskKV profile only where the knobs name none: a user's is kept."""
    (tmp_path / evaluation.PROFILE_NAME).write_text("{}")
    assert evaluation.with_profile("maskkv", {"profile": "mine.json"}, tmp_path) == {"profile": "mine.json"}
    assert evaluation.with_profile("maskkv", {}, tmp_path) == {"profile": str(tmp_path / evaluation.PROFILE_NAME)}


def test_a_finished_journal_removes_only_a_folder_it_made(tmp_path):
    """finish() deletes the journal, and its folder only where the journal made it: a user's folder stays."""
    evaluation.Journal(tmp_path / "made" / "eval.jsonl", {"n": "4"}).finish()
    assert not (tmp_path / "made").exists()
    (tmp_path / "mine").mkdir()
    evaluation.Journal(tmp_path / "mine" / "eval.jsonl", {"n": "4"}).finish()
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_only_the_writing_rank_adds_to_the_journal(tmp_path):
    """Every other rank reads the first rank's journal (writes=False) and adds nothing: no run is held twice."""
    path, settings, record = tmp_path / "eval.jsonl", {"n": "4"}, {"key": "dense @ 0", "scores": [1.0]}
    first, other = evaluation.Journal(path, settings), evaluation.Journal(path, settings, writes=False)
    first.add(record)
    other.add(record)
    assert path.read_text().splitlines() == [json.dumps({"settings": settings}), json.dumps(record)]


def test_the_time_left_is_the_mean_runs_time_for_each_run_left(monkeypatch):
    """2 runs in 120 s: 3 more take about 3 min; nothing is said before the first run or after the last."""
    monkeypatch.setattr(evaluation, "time", SimpleNamespace(perf_counter=lambda: 1120.0))
    assert evaluation.time_left(1000.0, 2, 3) == ", about 3.0 min left"
    assert evaluation.time_left(1000.0, 0, 3) == evaluation.time_left(1000.0, 2, 0) == ""


def test_the_progress_counts_the_samples_done_and_no_time_after_the_last(capsys):
    """3 samples in batches of 2: 2 of 3 done with a time left, then 3 of 3 (not 4) with none."""
    samples = make_samples("passkey", 128, 3, seed=0, depths=[0.0, 1.0])
    evaluation.evaluate(BatchOfThreeSeconds(), samples, ["dense"], batch=2)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval: ")]
    assert [line.split(",")[0] for line in progress] == ["eval: 2/3 samples", "eval: 3/3 samples"]
    assert "min left" in progress[0] and "min left" not in progress[1]


def test_dense_alone_is_one_column_and_one_summary_line(capsys, tmp_path):
    """--method dense compares dense with nothing else: its accuracy once, over each sample once."""
    code, out, err = run_eval(capsys, "--model", "tiny-llada", "--lengths", "256", "--n", "1", "--gen-length", "8",
                              "--journal", str(tmp_path / "eval.jsonl"))
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("| cell"))
    assert header == "| cell | depth | n | dense acc | dense tok/s |"
    assert [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| 256 ")] == ["1"]
    assert len([line for line in out.splitlines() if line.startswith("dense: ")]) == 1


def test_the_memory_check_is_for_the_longest_length(capsys, monkeypatch, tmp_path):
    """--lengths 256,100000 with 1 GiB free: refused for the longest context before the model loads (the
    shortest's would fit)."""
    from nanodllm import cli

    def loads(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(cli, "available_ram", lambda: 2**30)
    monkeypatch.setattr(evaluation, "Runner", loads)
    code, _, err = run_eval(capsys, "--lengths", "256,100000", "--n", "1", "--journal", str(tmp_path / "eval.jsonl"))
    assert code == 2 and "error: 100256 tokens x batch 8 need about" in err


def test_a_run_whose_method_states_no_kv_share_kept_all_of_it():
    """Dense on the masked engine states no KV share: each sample's is 1.0, all of the KV."""
    from nanodllm.config import GenerationConfig

    gen = GenerationConfig(gen_length=8, block_length=8, steps=4)
    runner = evaluation.Runner(evaluation.resolve_model("tiny-llada"), "cpu", torch.float32, gen, context=512)
    samples = make_samples("passkey", 128, 2, seed=0, count_tokens=runner.count_tokens)
    outcome = runner.generate(samples, "dense")
    assert "kv_kept" not in outcome.stats and outcome.kv_kept == [1.0, 1.0]


def test_the_table_lists_lengths_in_numeric_order_and_named_cells_after():
    """Cells of 256, 1024 and 4096 tokens come out in that order (not as text: 1024, 256, 4096), then
    LongBench's named datasets by name."""
    cells = [(4096, 0.5), ("qasper", 0.0), (256, 0.5), (1024, 0.0), (1024, 0.5), ("hotpotqa", 0.0)]
    results = {"dense": {cell: evaluation.Outcome([1.0], [[1]], 1.0, [1.0]) for cell in cells}}
    rows = evaluation.table(results, ["dense"]).splitlines()[2:]
    assert [row.split(" | ")[0:2] for row in rows] == [["| 256", "0.50"], ["| 1024", "0.00"], ["| 1024", "0.50"],
                                                        ["| 4096", "0.50"], ["| hotpotqa", "0.00"],
                                                        ["| qasper", "0.00"]]
