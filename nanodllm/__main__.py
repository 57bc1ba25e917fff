"""The package's command line: `python -m nanodllm COMMAND [flags]` (or `nanodllm COMMAND` once installed).

    python -m nanodllm demo --method maskkv         dense and one method side by side (nanodllm/demo.py)
    python -m nanodllm eval --method mage --n 20    accuracy per context length and depth (nanodllm/eval.py)

`python -m nanodllm COMMAND --help` lists a command's flags, `--version` the version. Benchmarks,
sweeps and training are scripts in a checkout of the repository (scripts/bench.py, sweep.py,
train_tiny.py).
"""

from __future__ import annotations

import importlib
import sys

from . import __version__
from .cli import run_main

COMMANDS = {"demo": "nanodllm.demo", "eval": "nanodllm.eval"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv and argv[0] == "--version":
        print(f"nanodllm {__version__}")
        return 0
    if not argv:
        print(f"error: no command given; choose from {', '.join(COMMANDS)} (python -m nanodllm --help lists them)",
              file=sys.stderr)
        return 2
    command, *flags = argv
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run_main(importlib.import_module(COMMANDS[command]).main, flags, prog=f"python -m nanodllm {command}")


if __name__ == "__main__":
    sys.exit(main())
