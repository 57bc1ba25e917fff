"""What the command lines (demo, eval, the scripts) share: flag types that refuse a bad value with
the flag's name before anything loads, the checks of a device, a step count and whether a run fits
the device's memory, reading a text file (one that is not UTF-8 named), writing an output file whole
or not at all, and run_main, which turns what a user can meet mid-run (Ctrl-C, out of memory, a file
that cannot be written) into an exit status and one line on stderr."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .attention import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from .config import GenerationConfig, ModelConfig
from .model import Model
from .parallel import SINGLE, Group, from_torchrun


def write_whole(path, write) -> None:
    """Call write(temporary path) beside `path`, then rename the result over it: an interrupted or failed
    write leaves the earlier file (or none), never half of one. The temporary name keeps the suffix, so
    writers that pick a format by it (matplotlib's savefig) still do."""
    path = Path(path)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        write(partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read_text(path, flag: str = "") -> str:
    """A text file's contents; one that is not UTF-8 is a ValueError naming it (after `flag`, e.g.
    --prompt-file, when a flag gave it) and where its first undecodable byte is."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        named = f"{flag} {path}" if flag else path
        raise ValueError(f"{named}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def run_main(main, *args, **kwargs) -> int:
    """main(*args, **kwargs)'s exit status, for `sys.exit(run_main(main))`: Ctrl-C exits 130 (what a
    shell reports for SIGINT) and running out of memory or an operating-system error (a file that
    cannot be read or written, a full disk) exit 1, each said in one line on stderr instead of a
    traceback. Outputs are written with write_whole, so none of these leaves half a file."""
    try:
        return main(*args, **kwargs)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): nothing more was run or written", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as error:
        if not out_of_memory(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"error: out of memory ({first}); a shorter context or a smaller batch needs less", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def out_of_memory(error: BaseException) -> bool:
    """An allocation failed: a GPU's (torch.OutOfMemoryError), Python's, or torch's CPU allocator's."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


def help_text(doc: str) -> str:
    """What `--help` shows of a script's docstring: its first paragraph and its first block of example
    commands (argparse.RawDescriptionHelpFormatter keeps the layout)."""
    paragraphs = doc.strip("\n").split("\n\n")
    examples = next((p for p in paragraphs[1:] if p.lstrip(" ").startswith("python")), None)
    return paragraphs[0] + (f"\n\n{examples}" if examples else "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each flag's default after its help unless the help names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        default = ",".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        return f"{text} (default: {default})".lstrip()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, e.g. 1024,2048."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, e.g. 1024,2048; got {text!r}")


def unit_fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}")
    return value


def output_file(text: str) -> Path:
    """argparse type: a file to write at the end of a run, refused before any work when its folder is
    missing or the path is a folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    if not path.parent.is_dir():
        missing = "is a file" if path.parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"the folder {path.parent} of {text} {missing}")
    return path


def output_folder(text: str) -> Path:
    """argparse type: a folder to write into (made if missing), refused when the path is a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def available_device(name: str) -> torch.device:
    """argparse type: a torch device this machine has."""
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a device (cpu, cuda, cuda:1, ...)")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: torch sees no CUDA GPU here (its CPU build, or no driver); "
                                         "use cpu")
    return chosen


def check_steps(gen: GenerationConfig, is_block: bool):
    """Each step unmasks at least one token: more steps than the tokens they decode (per block on the
    block engine) would run forwards that change nothing, so they are refused."""
    most = gen.block_length if is_block else gen.gen_length
    if gen.steps > most:
        what = (f"--block-length {gen.block_length} (steps are per block)" if is_block
                else f"--gen-length {gen.gen_length}")
        raise ValueError(f"--steps {gen.steps} exceeds {what}: at most {most} steps unmask anything")


def check_fits(cfg: ModelConfig, tokens: int, batch: int, device: torch.device, dtype: torch.dtype,
               world: int = 1) -> str | None:
    """Before a model loads: refuse a run whose memory estimate exceeds what `device` has free (an
    error naming both), and return a note when `tokens` stretches RoPE past the trained context
    (None otherwise). The estimate: the weights, K and V of every layer for every token (twice: the
    caching methods keep a copy), and where attention runs in plain torch (a CPU, float32) three
    fp32 score tensors of one layer, batch x heads x tokens x tokens, which the GPU kernels never
    make; split over `world` ranks, one rank's share of each."""
    with torch.device("meta"):
        weights = sum(p.numel() for p in Model(cfg).parameters()) * dtype.itemsize // world
    kv = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * batch * dtype.itemsize // world
    on_kernels = device.type == "cuda" and dtype in KERNEL_DTYPES and cfg.head_dim in KERNEL_HEAD_DIMS
    scores = 0 if on_kernels else 3 * batch * cfg.num_heads * tokens * tokens * 4 // world
    need = weights + kv + scores
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_ram()
    if need > free:
        parts = f"weights {weights / 2**30:.1f}, K/V {kv / 2**30:.1f}"
        if scores:
            parts += f", attention scores {scores / 2**30:.1f} (plain torch on this device)"
        raise ValueError(f"{tokens} tokens x batch {batch} need about {need / 2**30:.1f} GiB ({parts}); {device} has "
                         f"{free / 2**30:.1f} GiB free. Use a shorter prompt{' or a GPU' if scores else ''}.")
    if tokens > cfg.max_position_embeddings and cfg.gemma is not None:
        raise ValueError(f"{cfg.model_type}: {tokens} tokens exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings}, and its RoPE is not stretched: use a shorter prompt "
                         "(--length, --context)")
    if tokens > cfg.max_position_embeddings:
        return (f"note: {tokens} tokens are past the model's trained {cfg.max_position_embeddings}: RoPE is "
                f"stretched (NTK) {tokens / cfg.max_position_embeddings:.1f}x, and quality past the trained length "
                "is not assured")
    return None


def tensor_parallel(tp: int, data_parallel: bool = False) -> tuple[Group, int, int]:
    """(this process's Group, its replica, how many replicas) for `--tp tp` under torchrun (one GPU each on
    NCCL, CPU processes on gloo): ranks [r tp, (r + 1) tp) hold replica r, each a model split over tp ranks.
    Without torchrun (SINGLE, 0, 1). A world other than tp (data_parallel: other than a multiple of tp),
    or more processes than GPUs, is refused naming both numbers."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or (world % tp if data_parallel else world != tp):
        launch = f"torchrun --nproc-per-node {tp} ..." if tp > 1 else "python, or torchrun with --tp"
        raise ValueError(f"--tp {tp} needs {'a multiple of ' if data_parallel else ''}{tp} processes ({launch}); "
                         f"this run has {world}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world > 1 and torch.cuda.is_available() and torch.cuda.device_count() < local:
        raise ValueError(f"{local} processes on this machine need a GPU each; it has {torch.cuda.device_count()}")
    if world == 1:
        return SINGLE, 0, 1
    rank = from_torchrun().rank
    if tp == world:
        return Group(rank, world), 0, 1
    groups = [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(world // tp)]  # every rank makes all
    return Group(rank % tp, tp, groups[rank // tp]), rank // tp, world // tp


def available_ram() -> int:
    """Bytes of memory the OS can give this process now (Linux: MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
