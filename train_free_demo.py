"""Dense decoding and one training-free method side by side: `python train_free_demo.py --method maskkv`.

The demo itself is nanodllm/demo.py (also `python -m nanodllm demo`); --help lists its flags.
"""

import sys

from nanodllm.cli import run_main
from nanodllm.demo import main

if __name__ == "__main__":
    sys.exit(run_main(main))
