"""kernels/tuning.py: a launch setting is measured once per machine and read back in later processes.

On a CPU the measurement is a stand-in (each candidate's time from a table); on a GPU a fresh process
runs flash_attention on shapes an earlier process tuned and measures nothing.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

import nanodllm.kernels.tuning as tuning
from nanodllm.kernels.tuning import Tuner, cache_path
from tests.device import DEVICE

REPO = Path(__file__).resolve().parents[1]
GPU = "Test GPU 80GB"
FAST, SLOW, TOO_BIG = {"BLOCK": 64, "num_warps": 4}, {"BLOCK": 128, "num_warps": 8}, {"BLOCK": 256, "num_warps": 8}
TIMES = {64: 1.0, 128: 2.0}


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A cache directory of its own, no shipped table, a GPU name, and launch_ms reading TIMES (a
    setting whose BLOCK is not there does not fit the GPU). Returns the launches measured."""
    monkeypatch.setenv("NANODLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "SHIPPED", tmp_path / "shipped.json")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    monkeypatch.setattr(Tuner, "announced", False)
    launched = []

    def launch_ms(fn):
        setting = fn()
        if setting["BLOCK"] not in TIMES:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        launched.append(setting)
        return TIMES[setting["BLOCK"]]

    monkeypatch.setattr(tuning, "launch_ms", launch_ms)
    return launched


def choose(tuner, key=(128, 1, 4096), candidates=(SLOW, FAST, TOO_BIG)):
    return tuner.choose(key, list(candidates), lambda setting: setting, device=None)


def test_the_fastest_fitting_setting_is_measured_once_and_kept(machine, capsys):
    tuner = Tuner("attention")
    assert choose(tuner) == FAST
    assert choose(tuner) == FAST and choose(tuner, key=(64, 0, 1024)) == FAST
    assert tuner.measured == 2 and machine == [SLOW, FAST] * 2  # the setting too big for the GPU is skipped
    said = capsys.readouterr().err
    assert said.count("measuring kernel launch settings") == 1 and str(cache_path()) in said
    assert json.loads(cache_path().read_text()) == {GPU: {"attention": {"128,1,4096": FAST, "64,0,1024": FAST}}}
    assert [path.name for path in cache_path().parent.iterdir()] == ["tuning.json"]  # no temporary left


def test_measuring_is_said_once_per_process_however_many_kernels_measure(machine, capsys):
    choose(Tuner("attention"))
    choose(Tuner("decode attention"))
    assert capsys.readouterr().err.count("measuring kernel launch settings") == 1


def test_a_later_process_reads_the_cache_and_measures_nothing(machine):
    choose(Tuner("attention"))
    later = Tuner("attention")
    assert choose(later) == FAST and later.measured == 0
    assert choose(Tuner("other kernel")) == FAST  # another kernel's key is its own


def test_the_shipped_table_serves_a_new_machine_and_the_cache_overrides_it(machine, tmp_path):
    tuning.SHIPPED.write_text(json.dumps({GPU: {"attention": {"128,1,4096": SLOW}}, "Other GPU": {}}))
    tuner = Tuner("attention")
    assert choose(tuner) == SLOW and tuner.measured == 0 and not cache_path().exists()
    cache_path().parent.mkdir()
    cache_path().write_text(json.dumps({GPU: {"attention": {"128,1,4096": FAST}}}))
    assert choose(Tuner("attention")) == FAST


def test_a_setting_no_longer_among_the_candidates_is_measured_again(machine):
    cache_path().parent.mkdir()
    cache_path().write_text(json.dumps({GPU: {"attention": {"128,1,4096": {"BLOCK": 32, "num_warps": 2}}}}))
    tuner = Tuner("attention")
    assert choose(tuner) == FAST and tuner.measured == 1


def test_an_unreadable_cache_is_replaced_and_an_unwritable_one_is_said(machine, capsys, tmp_path, monkeypatch):
    cache_path().parent.mkdir()
    cache_path().write_text("{half a fi")
    assert choose(Tuner("attention")) == FAST
    assert json.loads(cache_path().read_text())[GPU]["attention"]["128,1,4096"] == FAST
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("NANODLLM_CACHE_DIR", str(blocked))  # a file where the directory should be
    assert choose(Tuner("attention")) == FAST
    assert "the settings last this process only" in capsys.readouterr().err


def test_no_fitting_setting_names_the_kernel_and_key(machine):
    with pytest.raises(RuntimeError, match="attention: no launch setting fits this GPU for key 128,1,4096"):
        choose(Tuner("attention"), candidates=[TOO_BIG])


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("NANODLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "nanodllm" / "tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path() == Path.home() / ".cache" / "nanodllm" / "tuning.json"


FLASH_IN_A_PROCESS = """
import json
import torch
import nanodllm.kernels.flash_attention as fa
for n_q, n_k, causal in ((64, 3000, False), (2000, 2000, True)):
    q = torch.randn(1, 4, n_q, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n_k, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fa.flash_attention(q, k, v, causal=causal)
torch.cuda.synchronize()
print(fa.TUNER.measured, json.dumps(sorted(fa.TUNER.chosen.items()), sort_keys=True))  # a read-back dict is sorted
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="the tuner measures on a GPU")
def test_a_fresh_process_reuses_the_settings_an_earlier_one_measured(tmp_path):
    env = dict(os.environ, NANODLLM_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    runs = [subprocess.run([sys.executable, "-c", FLASH_IN_A_PROCESS], env=env, cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split(" ", 1) for _ in range(2)]
    (first_measured, first_chosen), (second_measured, second_chosen) = runs
    assert first_measured == "2" and second_measured == "0" and second_chosen == first_chosen  # no shipped key here


@pytest.mark.skipif(DEVICE != "cuda", reason="a launch is timed on a GPU")
def test_a_launch_is_timed_without_the_host_time_before_its_kernel():
    """The host's time between launches does not enter a setting's time: a kernel of microseconds launched
    after a millisecond of host work measures under a millisecond."""
    x = torch.zeros(1024, device="cuda")
    assert tuning.launch_ms(lambda: (time.sleep(1e-3), x.add_(1))) < 0.5


def test_a_candidate_too_big_for_the_gpu_is_skipped_and_the_rest_measured(machine):
    """A setting that does not fit (first among the candidates) is passed over, not the end of the measurement."""
    tuner = Tuner("attention")
    assert choose(tuner, candidates=(TOO_BIG, SLOW, FAST)) == FAST
    assert tuner.measured == 1 and machine == [SLOW, FAST]


@pytest.mark.skipif(DEVICE != "cuda", reason="flash_attention builds its tuner key on a GPU")
def test_flash_attention_keys_a_canvas_by_batch_and_the_shipped_table_by_what_tune_runs(monkeypatch):
    """A canvas of 256 rows at batch 1 fills few SMs and at batch 4 many: they get keys of their own. The shipped
    table's keys are those flash_attention builds for `bench.py tune`'s shapes (batch 1, 32 heads), so a change of
    the key that leaves the table behind fails here."""
    import nanodllm.kernels.flash_attention as fa

    keys = []
    monkeypatch.setattr(fa.TUNER, "choose", lambda key, candidates, launch, device: keys.append(key) or candidates[0])
    for batch in (1, 4):
        q = torch.randn(batch, 16, 256, 256, device="cuda", dtype=torch.bfloat16)
        fa.flash_attention(q, *(torch.randn(batch, 8, 1279, 256, device="cuda", dtype=torch.bfloat16) for _ in "kv"))
    assert keys[0] != keys[1] and keys[0][:5] == keys[1][:5]
    keys.clear()
    for n_q, n_k in ((64, 4096), (256, 4096), (4096, 4096)):
        q = torch.randn(1, 32, n_q, 128, device="cuda", dtype=torch.bfloat16)
        fa.flash_attention(q, *(torch.randn(1, 8, n_k, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv"))
    shipped = json.loads((REPO / "kernels" / "tuned.json").read_text())
    tables = [table["flash_attention"] for table in shipped.values()]
    assert tables and all(tuning.key_name(key) in table for key in keys for table in tables)
