"""Mutation check: plant small bugs one at a time and see whether the tests catch each.

    python tests/mutate.py                  every mutation, one pytest run each
    python tests/mutate.py --only quest     the mutations whose name contains "quest"
    python tests/mutate.py --jobs 2         two at a time, each worker in a copy of its own

The mutations (a snippet of a file, its replacement, the tests that should notice) are listed in
tests/plants.py. Each worker tests in its own copy of the repository (no .git, venv or caches): pytest
exit 1 is caught, 0 survived (add a test that fails on it), anything else an error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nanodllm.cli import help_text, positive_int, run_main  # noqa: E402
from plants import MUTATIONS, SANITY, Mutation  # noqa: E402

NOT_COPIED = (".git", ".venv", "venv", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", "build", "runs",
              ".whl", "*.whl", "_orig", "_golden")
PLUGIN = "mutate_no_shrink"  # written into each scratch copy, loaded with -p
PYTEST = ("-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN)
# The hypothesis profile the conftest loaded, derandomized (the same examples every run, so a result
# repeats) and without shrinking (a failing property test would spend minutes looking for a minimal
# example, which a caught mutation does not need) or an example database.
PLUGIN_SOURCE = '''from hypothesis import Phase, settings


def pytest_configure(config):
    settings.register_profile("mutate", settings(), phases=(Phase.explicit, Phase.generate), database=None,
                              derandomize=True)
    settings.load_profile("mutate")
'''


def problems(mutations: list[Mutation], root: Path) -> list[str]:
    """What is wrong with the list against the files under root: snippets that do not occur exactly
    once, replacements that change nothing, tests that do not exist."""
    found = []
    names = [m.name for m in mutations]
    found += [f"{name}: the name is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for m in mutations:
        path = root / m.path
        count = path.read_text().count(m.old) if path.is_file() else -1
        if count != 1:
            found.append(f"{m.name}: the snippet occurs {count} times in {m.path}, not once"
                         if count >= 0 else f"{m.name}: no file {m.path}")
        if m.old == m.new:
            found.append(f"{m.name}: the replacement is the snippet itself")
        for test in m.tests:
            file, _, function = test.partition("::")
            test_path = root / "tests" / file
            if not test_path.is_file():
                found.append(f"{m.name}: no test file tests/{file}")
            elif function and not re.search(rf"^def {re.escape(function)}\(", test_path.read_text(), re.MULTILINE):
                found.append(f"{m.name}: no test {function} in tests/{file}")
    return found


def scratch_copy(into: Path) -> Path:
    """A copy of the repository without what the tests do not read, and the pytest plugin."""
    copy = into / ROOT.name
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    link = copy / "nanodllm" / "kernels"  # nanodllm.kernels: the copy's, not the installed one
    if not link.is_symlink():  # a copy of a scratch copy (tests/test_cli.py runs this file) has it
        link.symlink_to("../kernels")
    (copy / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    return copy


def environment(copy: Path) -> dict:
    """The copy first on the import path (the repository is installed editable into the venv), and no
    bytecode written, so a file put back within the same second is never read from a stale cache."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def imported_from(copy: Path) -> list[str]:
    """The packages a test process would import from outside the copy (none, or the results lie)."""
    probe = "import nanodllm.kernels; print(nanodllm.__file__); print(nanodllm.kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True,
                         text=True, check=True).stdout.split()
    return [path for path in out if not Path(path).resolve().is_relative_to(copy.resolve())]


def run_tests(copy: Path, m: Mutation, timeout: float) -> tuple[str, float]:
    """(result, seconds) of m's tests in the copy with m applied; the file is put back. A result is what
    pytest's exit status says of the mutation: caught, survived, error or timeout."""
    path = copy / m.path
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new, 1))
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", *PYTEST, *(f"tests/{test}" for test in m.tests)]
    try:
        done = subprocess.run(command, cwd=copy, env=environment(copy), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout)
        result = {0: "survived", 1: "caught"}.get(done.returncode, f"error ({done.returncode})")
    except subprocess.TimeoutExpired:
        result = "timeout"
    finally:
        path.write_text(original)
    return result, time.monotonic() - start


def run_all(mutations: list[Mutation], jobs: int, timeout: float) -> list[tuple[Mutation, str, float]]:
    """Every mutation's result, jobs at a time, each worker in a scratch copy of its own. The sanity
    mutation runs first, alone: if it survives nothing else is worth running (it is not among the results)."""
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        copies = [scratch_copy(Path(scratch) / str(worker)) for worker in range(max(1, min(jobs, len(mutations))))]
        if wrong := problems([SANITY, *mutations], copies[0]):
            sys.exit("the mutation list no longer fits the code:\n  " + "\n  ".join(wrong))
        if outside := imported_from(copies[0]):
            sys.exit(f"the tests would import {', '.join(outside)}, not the scratch copy")
        result, _ = run_tests(copies[0], SANITY, timeout)
        if result == "survived":
            sys.exit("the sanity mutation survived: the tests do not read the scratch copy")
        print(f"sanity: a package that cannot be imported fails the tests ({result}): they read the copy")
        free = list(copies)

        def one(m: Mutation):
            copy = free.pop()
            try:
                result, seconds = run_tests(copy, m, timeout)
            finally:
                free.append(copy)
            print(f"{result:<12} {seconds:6.1f}s  {m.name}", flush=True)
            return m, result, seconds

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            return list(pool.map(one, mutations))


def seconds(text: str) -> float:
    """argparse type: a time limit of at least a second (less times out before pytest has started)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (seconds), got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run the mutations whose name contains NAME (repeatable; the sanity check always runs)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="mutations tested at once (default 1)")
    parser.add_argument("--timeout", type=seconds, default=600,
                        help="seconds a mutation's tests may take (default 600)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS[1:] if not args.only or any(part in m.name for part in args.only)]
    if not chosen:
        sys.exit(f"no mutation name contains {' or '.join(args.only)}")
    start = time.monotonic()
    results = run_all(chosen, args.jobs, args.timeout)
    kinds = ("caught", "survived", "error", "timeout")
    counts = {kind: sum(result.startswith(kind) for _, result, _ in results) for kind in kinds}
    print(f"\n{'result':<12} {'time':>7}  {'mutation':<52} file")
    print("\n".join(f"{result:<12} {secs:6.1f}s  {m.name:<52} {m.path}" for m, result, secs in results))
    print("\n" + ", ".join(f"{counts[kind]} {kind}" for kind in kinds)
          + f" of {len(results)} in {time.monotonic() - start:.0f}s")
    return int(any(result != "caught" for _, result, _ in results))


if __name__ == "__main__":
    sys.exit(run_main(main))
