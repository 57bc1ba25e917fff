"""kernels/first_use.py: a GPU model's loading starts, on a side thread, what the first kernels would pay."""

import threading
import time

import pytest
import torch
import triton

import nanodllm.kernels.first_use as first_use


@pytest.fixture
def calls(monkeypatch):
    """What prepare's parts were asked to do, in order: "hash", each import's name, "matmul"."""
    done, ones = [], torch.ones
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: done.append("hash"), raising=False)
    monkeypatch.setattr(first_use.importlib, "import_module", done.append)
    monkeypatch.setattr(first_use.torch, "ones", lambda *shape, **kwargs: done.append("matmul") or ones(*shape))
    return done


def test_prepare_hashes_triton_imports_its_launchers_modules_and_runs_a_matmul(calls, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    first_use.prepare(torch.device("cpu"), torch.float32)
    assert calls == ["hash", *first_use.LAUNCHER_IMPORTS, "matmul"]


def test_the_interpreter_compiles_nothing_so_nothing_is_hashed(calls, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    first_use.prepare(torch.device("cpu"), torch.float32)
    assert calls == [*first_use.LAUNCHER_IMPORTS, "matmul"]


def test_a_launcher_module_this_triton_lacks_is_skipped(monkeypatch):
    monkeypatch.setattr(first_use, "LAUNCHER_IMPORTS", ("triton.no_such_module",))
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: None, raising=False)
    first_use.prepare(torch.device("cpu"), torch.float32)  # no ImportError


def test_only_a_gpu_starts_the_thread_on_the_callers_current_gpu(monkeypatch):
    started = []
    monkeypatch.setattr(first_use, "prepare",
                        lambda device, dtype: started.append((threading.current_thread().name, device, dtype)))
    monkeypatch.setattr(first_use.torch.cuda, "current_device", lambda: 1)
    first_use.start("cpu", torch.bfloat16)
    first_use.start("cuda", torch.bfloat16)
    first_use.start("cuda:0", torch.float16)
    first_use.wait()
    assert not first_use.STARTED
    assert sorted(started, key=str) == sorted([("first-use", torch.device("cuda", 1), torch.bfloat16),
                                               ("first-use", torch.device("cuda", 0), torch.float16)], key=str)


def test_loading_a_model_returns_once_the_side_thread_has_finished(monkeypatch):
    """Its CUDA work must not run into a generation's graph capture: load_model and build_random wait,
    also when the loading fails."""
    from nanodllm.eval import resolve_model
    from nanodllm.loader import build_random, load_model
    from tests.tiny_models import tiny_config

    finished = []

    def slow_start(device, dtype):
        thread = threading.Thread(target=lambda: (time.sleep(0.05), finished.append(str(device))))
        thread.start()
        first_use.STARTED.append(thread)

    monkeypatch.setattr(first_use, "start", slow_start)
    build_random(tiny_config("llada"), "cpu", torch.float32)
    assert finished == ["cpu"] and not first_use.STARTED
    load_model(resolve_model("tiny-llada"), "cpu", torch.float32)
    assert finished == ["cpu", "cpu"] and not first_use.STARTED
    with pytest.raises(FileNotFoundError):  # a loading that fails waits too
        load_model(resolve_model("tiny-llada") / "nowhere", "cpu", torch.float32)
    assert finished == ["cpu", "cpu", "cpu"] and not first_use.STARTED


def test_the_side_thread_is_a_daemon(monkeypatch):
    """A daemon thread: a process that ends (a loading that fails, a CLI error) never waits for it."""
    daemons = []
    monkeypatch.setattr(first_use, "prepare", lambda device, dtype: daemons.append(threading.current_thread().daemon))
    first_use.start("cuda:0", torch.float16)
    first_use.wait()
    assert daemons == [True]
