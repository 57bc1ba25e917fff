"""Shared test setup: hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci) and tiny model builders."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when triton is
# first imported (torch and hypothesis do not import it), so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Kernel launch settings measured by the tests stay out of the user's cache (kernels/tuning.py).
os.environ.setdefault("NANODLLM_CACHE_DIR", tempfile.mkdtemp(prefix="nanodllm-tests-"))

settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile("ci", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models (or small kernel inputs): a second thread only waits for the first
    (and, on a busy machine, for a core), which costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernels_on(monkeypatch):
    """The one switch (nanodllm.attention.use_kernels) on for float16 and float32 tensors on the CPU
    too: the Triton kernels run in Triton's interpreter (its bfloat16 dots are wrong)."""
    import nanodllm.attention as attention_module

    monkeypatch.setattr(attention_module, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(attention_module, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
