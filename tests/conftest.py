"""Shared test setup: hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci) and tiny model builders."""

import os
import sys
from pathlib import Path

import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when triton is
# first imported (torch and hypothesis do not import it), so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile("ci", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))
