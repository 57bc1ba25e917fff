"""The scripts' command lines as a user meets them: run in a subprocess, exit code and message checked."""

import subprocess
import sys
from pathlib import Path

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
