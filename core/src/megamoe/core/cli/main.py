"""The ``megamoe`` command: its argument parser, exit codes and error lines.

Errors print as one line, ``megamoe <command>: error: <message>``, with exit code 1 (2 for
bad usage: an option's value the command cannot use; 130 when interrupted); ``--debug``
shows the traceback instead. What each command does is in ``megamoe.core.cli.commands``,
imported only once the arguments are parsed: this module imports neither torch nor an
adapter, so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import TextIO

from megamoe.core.cli.exit_codes import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_TERMINATED,
    EXIT_USAGE,
)
from megamoe.core.errors import UsageError

# The values of megamoe.core.numerics.formats' WeightFormat and ARCHES, spelled out so that parsing
# needs no torch (core/tests/cli/test_cli.py checks that each exists there). FORMATS are the run
# formats; CHECKPOINT_FORMATS add NVFP4, which checkpoints store and nothing runs as.
FORMATS = ("bf16", "fp8_block", "mxfp8", "mxfp4")
CHECKPOINT_FORMATS = (*FORMATS, "nvfp4")
ARCHES = ("sm90", "sm100", "reference")
TARGETS = ("mxfp8", "mxfp4", "fp8_block")
BACKENDS = ("auto", "reference", "deepgemm")
BENCH_PARTS = ("requant", "forward", "convert")
DEVICE_HELP = "cpu or cuda[:N] (default: cuda if available)"
ADAPTER_GROUP = "megamoe.adapters"
# Python API parameter names in library messages -> the flag each command takes for them.
PARAMETER_FLAGS = {
    "inspect": {"moe_format": "--moe-format"},
    "verify": {"moe_format": "--moe-format", "max_num_tokens": "--tokens", "backend": "--backend"},
    "demo": {"backend": "--backend"},
}


def _positive_int(text: str) -> int:
    """Argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


SAMPLE_MAX_LAYERS = 64


def _sample_layers(text: str) -> int:
    """Argparse type: a sample's MoE layer count, 1 to ``SAMPLE_MAX_LAYERS``."""
    value = _positive_int(text)
    if value > SAMPLE_MAX_LAYERS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer from 1 to {SAMPLE_MAX_LAYERS} (a sample is small)"
        )
    return value


def _multiple_of_128(text: str) -> int:
    """Argparse type: a positive multiple of 128 (the kernel's block)."""
    value = _positive_int(text)
    if value % 128:
        raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of 128 (the kernel's block)")
    return value


def _positive_float(text: str) -> float:
    """Argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def _bench_parts(text: str) -> tuple[str, ...]:
    """Argparse type: comma-separated names of built-in benchmarks."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(parts) - set(BENCH_PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no part {', '.join(unknown)}; the parts are {', '.join(BENCH_PARTS)}"
        )
    return parts


def _device_name(text: str) -> str:
    """Argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    kind, _, index = text.partition(":")
    if (kind == "cpu" and not index) or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not one of cpu, cuda, cuda:N")


def version_text() -> str:
    """``megamoe-core X`` and each installed adapter distribution with its version."""

    def of(distribution: str) -> str:
        try:
            return version(distribution)
        except PackageNotFoundError:
            return "(not installed)"

    adapters = sorted(
        {
            f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else ep.name
            for ep in entry_points(group=ADAPTER_GROUP)
        }
    )
    return f"megamoe-core {of('megamoe-core')}; adapters: {', '.join(adapters) or 'none'}"


def _global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``--debug`` and ``-v``, accepted before and after the command name.

    A subcommand's copy has no default (SUPPRESS), so it never overwrites what was given
    before the command name.
    """
    default = False if top else argparse.SUPPRESS
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks on errors"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="log INFO messages (which backend runs, what is requantized)",
    )


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, text: str
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=summary, description=text)
    _global_flags(parser, top=False)
    parser.set_defaults(command=name)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``megamoe`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="megamoe",
        description="Checkpoint experts to DeepGEMM MegaMoE kernel weights.",
        epilog="Run 'megamoe <command> --help' for a command's options. Exit codes: 0 ok, "
        "1 error or mismatch, 2 bad usage, 130 interrupted, 141 output pipe closed, "
        "143 terminated.",
    )
    _global_flags(parser, top=True)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = _command(
        sub,
        "demo",
        "synthetic checkpoints end to end",
        "For every installed adapter and format: write a synthetic checkpoint, load it, run "
        "a forward on the best backend and compare with the float64 reference. Exits 1 on "
        "any mismatch.",
    )
    demo.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    demo.add_argument("--backend", default="auto", choices=BACKENDS)
    demo.add_argument("--adapter", action="append", help="only this adapter (repeatable)")
    demo.add_argument(
        "--format",
        action="append",
        choices=CHECKPOINT_FORMATS,
        help="only this checkpoint format (repeatable)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    sample = _command(
        sub,
        "sample",
        "write a small synthetic checkpoint",
        "Write a small synthetic checkpoint in a model's release layout (config.json, "
        "tensor names, shards, index) to try inspect, convert and verify on.",
    )
    sample.add_argument("out", help="directory to create (must not exist)")
    sample.add_argument("--adapter", help="installed adapter (default: the only one installed)")
    sample.add_argument(
        "--format",
        choices=CHECKPOINT_FORMATS,
        help="expert format (default: the adapter's first, its release's)",
    )
    sample.add_argument(
        "--num-layers",
        type=_sample_layers,
        default=2,
        help=f"MoE layers besides MTP (default 2, at most {SAMPLE_MAX_LAYERS})",
    )
    sample.add_argument(
        "--num-experts", type=_positive_int, default=8, help="routed experts (default 8)"
    )
    sample.add_argument(
        "--hidden-size", type=_multiple_of_128, default=256, help="hidden size (default 256)"
    )
    sample.add_argument(
        "--intermediate-size",
        type=_multiple_of_128,
        default=256,
        help="expert intermediate size (default 256)",
    )
    sample.add_argument("--seed", type=int, default=0, help="seed of the contents")

    inspect = _command(
        sub,
        "inspect",
        "describe a checkpoint",
        "Model, MoE layers, expert format per layer, what would be requantized to what on the "
        "target, and kernel-weight bytes per rank. Reads headers only.",
    )
    inspect.add_argument("checkpoint", help="Hugging Face checkpoint directory")
    inspect.add_argument(
        "--ep-size", type=_positive_int, default=1, help="expert-parallel ranks (default 1)"
    )
    inspect.add_argument("--arch", choices=ARCHES, help="target (default: this machine)")
    inspect.add_argument(
        "--moe-format",
        choices=FORMATS,
        help="force a run format (MTP drafter layers keep the default)",
    )

    convert = _command(
        sub,
        "convert",
        "write a kernel-ready checkpoint",
        "Requantize the routed experts to a kernel format offline (byte-identical to online "
        "requantization); other tensors are copied unchanged, quantization_config is updated. "
        "Writes OUT.partial-<pid> and renames it to OUT when complete.",
    )
    convert.add_argument("checkpoint", help="source checkpoint directory")
    convert.add_argument("out", help="output directory (must not exist)")
    convert.add_argument("--to", required=True, choices=TARGETS, help="target expert format")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")

    verify = _command(
        sub,
        "verify",
        "check forwards vs the reference",
        "Load MoE layers, run a forward on random tokens, compare with the float64 reference "
        "(of SRC with --against: what a conversion lost shows); exits 1 if any layer is "
        "beyond tolerance.",
    )
    verify.add_argument("checkpoint", help="checkpoint directory")
    verify.add_argument(
        "--against",
        metavar="SRC",
        help="the checkpoint CHECKPOINT was converted from: compare with its reference",
    )
    verify.add_argument("--layers", help="comma-separated layer indices and/or 'mtp' (default all)")
    verify.add_argument(
        "--moe-format",
        choices=FORMATS,
        help="force a run format (MTP drafter layers keep the default)",
    )
    verify.add_argument("--backend", default="auto", choices=BACKENDS)
    verify.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    verify.add_argument(
        "--tokens", type=_positive_int, default=32, help="tokens per forward (default 32)"
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    verify.add_argument(
        "--tolerance", type=_positive_float, help="accepted max rel. error (default per format)"
    )
    verify.add_argument("--no-progress", action="store_true", help="no progress bar")

    bench = _command(
        sub,
        "bench",
        "throughput beside its ceiling",
        "On a CUDA device, runs megamoe's own benchmarks/bench_{requant,forward,load}.py when "
        "megamoe runs from its source checkout (never scripts of the current directory); "
        "else, and with --builtin, the built-in benchmarks: requantization, one layer's "
        "forward per backend and convert, each beside the memory-bandwidth ceiling measured "
        "in the same run.",
    )
    bench.add_argument("--builtin", action="store_true", help="built-in benchmarks only")
    bench.add_argument(
        "--only",
        type=_bench_parts,
        default=BENCH_PARTS,
        help=f"built-in parts, comma-separated: {','.join(BENCH_PARTS)} (default all)",
    )
    bench.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    bench.add_argument(
        "--repeats", type=_positive_int, default=5, help="timed runs per measurement"
    )
    bench.add_argument("script_args", nargs="*", help="arguments for the scripts (after --)")
    return parser


def speak_in_flags(command: str, message: str) -> str:
    """``message`` with the Python parameter names it uses replaced by ``command``'s flags.

    Library messages serve the Python API (``moe_format='mxfp4'``); the command names the
    flag the user typed (``--moe-format mxfp4``). A name alone is replaced only where it
    cannot be an English word (it has an underscore): ``backend='reference'`` becomes
    ``--backend reference``, "the reference backend" stays.
    """
    for name, flag in PARAMETER_FLAGS.get(command, {}).items():
        message = re.sub(rf"\b{name}=(['\"]?)([^'\"\s;,)]+)\1", rf"{flag} \2", message)
        if "_" in name:
            message = re.sub(rf"\b{name}\b", flag, message)
    return message


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``megamoe`` command.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="megamoe: %(message)s",
        force=True,
    )

    def one_line_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = speak_in_flags(args.command, " ".join(str(message).split()))
        print(f"megamoe: warning: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # shown once per place, never turned into errors
        warnings.showwarning = one_line_warning
        return _run(args)


def _error(command: str, message: str) -> None:
    text = speak_in_flags(command, " ".join(message.split()))
    print(f"megamoe {command}: error: {text}", file=sys.stderr, flush=True)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that half-written output is removed."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _run(args: argparse.Namespace) -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        from megamoe.core.cli import commands

        return int(getattr(commands, f"run_{args.command}")(args))
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"megamoe {args.command}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except _Terminated:
        print(f"megamoe {args.command}: terminated", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # The reader of stdout went away (``| head``): say nothing more, on a closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except Exception as err:
        if args.debug:
            raise
        notes = getattr(err, "__notes__", [])  # e.g. the file a bad tensor was read from
        _error(args.command, "; ".join([str(err) or type(err).__name__, *notes]))
        return EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAIL
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
