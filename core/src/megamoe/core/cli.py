"""The ``megamoe`` command: demo, inspect, convert, verify, bench (SPEC §3.7).

Errors print as one line, ``megamoe <command>: error: <message>``, with exit code 1 (2 for
bad usage: an option's value the command cannot use; 130 when interrupted); ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from megamoe.core.adapters import MoELayer
from megamoe.core.errors import UsageError
from megamoe.core.formats import ARCHES, WeightFormat

if TYPE_CHECKING:
    import torch

EXIT_OK = 0
EXIT_FAIL = 1  # an error, or a forward beyond tolerance
EXIT_USAGE = 2  # an option the command cannot use (argparse's code too)
EXIT_INTERRUPTED = 130
TARGETS = ("mxfp8", "mxfp4", "fp8_block")
FORMATS = tuple(f.value for f in WeightFormat)
BENCH_SCRIPTS = ("bench_requant.py", "bench_forward.py", "bench_load.py")
BENCH_PARTS = ("requant", "forward", "convert")
# This file in a source checkout: <root>/core/src/megamoe/core/cli.py.
SOURCE_ROOT = Path(__file__).resolve().parents[4]
DEVICE_HELP = "cpu or cuda[:N] (default: cuda if available)"


def _positive_int(text: str) -> int:
    """Argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
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


def _device_name(text: str) -> str:
    """Argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    kind, _, index = text.partition(":")
    if (kind == "cpu" and not index) or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not one of cpu, cuda, cuda:N")


def _device(name: str | None) -> torch.device:
    """The device ``--device`` names (None: cuda if available), checked to exist here."""
    import torch

    from megamoe.core.demo import default_device

    if name is None:
        return default_device()
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UsageError(
                f"--device {name}: this machine has {count} CUDA device(s); use --device cpu"
                + (f" or cuda:0..{count - 1}" if count else "")
            )
    return device


def _out(text: str = "", stream: TextIO | None = None) -> None:
    print(text, file=stream or sys.stdout, flush=True)


def _cmd_demo(args: argparse.Namespace) -> int:
    from megamoe.core.demo import format_table, run_demo

    _out("megamoe demo: synthetic checkpoint -> load -> forward -> float64 reference")
    rows = run_demo(
        device=_device(args.device),
        backend=args.backend,
        adapters=args.adapter,
        formats=args.format,
    )
    _out(format_table([row.cells() for row in rows]))
    for row in rows:
        if row.error is not None:
            _out(f"{row.adapter} {row.checkpoint_format.value}: {row.error}", sys.stderr)
    failed = [r for r in rows if not r.ok]
    _out(f"{len(rows) - len(failed)} of {len(rows)} combinations within tolerance")
    return EXIT_FAIL if failed else EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from megamoe.core.demo import format_table
    from megamoe.core.inspection import human_bytes, plan_checkpoint

    plan = plan_checkpoint(
        args.checkpoint, ep_size=args.ep_size, arch=args.arch, moe_format=args.moe_format
    )
    experts, hidden, inter = plan.dims
    where = "this machine" if args.arch is None else "--arch"
    _out(
        f"checkpoint  {plan.path} ({plan.num_files} safetensors file(s), "
        f"{human_bytes(plan.tensor_bytes)} of tensors)"
    )
    _out(
        f"model       {plan.model_type} -> adapter {plan.adapter.name} "
        f"({plan.adapter.distribution})"
    )
    limit = plan.swiglu_limit
    clamp = "" if limit is None else f", SwiGLU clamp {limit:g} (swiglu_limit)"
    _out(f"experts     {experts} routed per layer, hidden {hidden}, intermediate {inter}{clamp}")
    _out(
        f"target      {plan.arch} ({where}); expert parallel {plan.ep_size} -> "
        f"{experts // plan.ep_size} experts per rank"
    )
    _out(
        "checked     names, headers, index and every expert tensor (routed, shared, MTP) vs "
        "config.json"
    )
    _out()
    headers = ("layer", "prefix", "stored", "runs as", "conversion", "kernel bytes/rank")
    rows = [
        (
            f"{p.layer.index}{' (mtp)' if p.layer.is_mtp else ''}",
            p.layer.prefix,
            p.layer.checkpoint_format.value,
            p.run_format.value,
            p.conversion,
            human_bytes(p.kernel_bytes_per_rank),
        )
        for p in plan.layers
    ]
    _out(format_table(rows, headers))
    _out(f"total routed-expert kernel weights per rank: {human_bytes(plan.kernel_bytes_per_rank)}")
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from megamoe.core.convert import convert_checkpoint

    result = convert_checkpoint(args.checkpoint, args.out, args.to, progress=not args.no_progress)
    _out(
        f"wrote {result.out}: {result.converted} expert projection(s) requantized to "
        f"{result.target.value}, {result.copied} tensor(s) copied unchanged; "
        f"{result.source_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
        f"({result.mb_per_s:.1f} MB/s)"
    )
    return EXIT_OK


def _layer_label(layer: MoELayer) -> str:
    """How ``--layers`` names a layer: its index, or ``mtp`` for the MTP drafter's."""
    return "mtp" if layer.is_mtp else str(layer.index)


def _select_layers(layers: Sequence[MoELayer], spec: str | None) -> list[MoELayer]:
    """The layers ``--layers`` selects (all for None or ``all``)."""
    if spec is None or spec == "all":
        return list(layers)
    wanted = {part.strip() for part in spec.split(",") if part.strip()}
    unknown = wanted - {_layer_label(layer) for layer in layers}
    if unknown:
        known = dict.fromkeys(_layer_label(layer) for layer in layers)
        raise UsageError(
            f"--layers {spec}: no MoE layer {', '.join(sorted(unknown))}; the checkpoint's "
            f"MoE layers are {', '.join(known)}"
        )
    return [layer for layer in layers if _layer_label(layer) in wanted]


def _cmd_verify(args: argparse.Namespace) -> int:
    from megamoe.core.checkpoint import open_checkpoint
    from megamoe.core.demo import format_table
    from megamoe.core.parallel import ParallelSettings, single_rank_group
    from megamoe.core.verify import verify_layer

    reader, adapter = open_checkpoint(args.checkpoint)
    layers = _select_layers(reader.layers, args.layers)
    device = _device(args.device)
    parallel = ParallelSettings(ep_group=single_rank_group(device))
    rows, failed = [], 0
    for layer in layers:
        check = verify_layer(
            reader,
            adapter,
            layer,
            parallel=parallel,
            moe_format=args.moe_format,
            backend=args.backend,
            device=device,
            num_tokens=args.tokens,
            seed=args.seed,
            tolerance=args.tolerance,
        )
        failed += not check.ok
        rows.append(
            (
                f"{layer.index}{' (mtp)' if layer.is_mtp else ''}",
                layer.prefix,
                layer.checkpoint_format.value,
                check.run_format.value,
                check.backend,
                f"{check.max_rel_error:.2e}",
                f"{check.tolerance:.0e}",
                f"{check.load_seconds:.2f}",
                "ok" if check.ok else "FAIL",
            )
        )
    headers = (
        "layer",
        "prefix",
        "stored",
        "run",
        "backend",
        "max rel. error",
        "tol.",
        "load s",
        "result",
    )
    _out(format_table(rows, headers))
    _out(
        f"{len(rows) - failed} of {len(rows)} layer(s) within tolerance "
        "(max |out - ref| / max |ref| vs the float64 reference)"
    )
    return EXIT_FAIL if failed else EXIT_OK


def shipped_bench_scripts() -> list[Path]:
    """The ``benchmarks/bench_*.py`` scripts of the source checkout megamoe runs from.

    Only megamoe's own: found beside this package's sources (``SOURCE_ROOT``), never in
    the current directory; none for an installed wheel (the built-in benchmarks run then).
    """
    if not (SOURCE_ROOT / "core" / "pyproject.toml").is_file():
        return []
    directory = SOURCE_ROOT / "benchmarks"
    return [directory / name for name in BENCH_SCRIPTS if (directory / name).is_file()]


def _cmd_bench(args: argparse.Namespace) -> int:
    scripts = [] if args.builtin else shipped_bench_scripts()
    if scripts:
        code = EXIT_OK
        for script in scripts:
            _out(f"== {script}")
            done = subprocess.run([sys.executable, str(script), *args.script_args], check=False)
            code = code or (EXIT_FAIL if done.returncode else EXIT_OK)
        return code
    from megamoe.core import bench
    from megamoe.core.demo import format_table

    device = _device(args.device)
    parts = set(args.only.split(",")) if args.only else set(BENCH_PARTS)
    results = []
    bandwidth = bench.copy_bandwidth(device, args.repeats)
    if "requant" in parts:
        results += bench.bench_requantize(device=device, repeats=args.repeats, bandwidth=bandwidth)
    if "forward" in parts:
        results += bench.bench_forward(device=device, repeats=args.repeats, bandwidth=bandwidth)
    if "convert" in parts:
        results += bench.bench_convert()
    headers = ("benchmark", "time", "GB/s", "ceiling GB/s", "ratio to ceiling")
    rows = [
        (
            r.name,
            f"{r.seconds * 1e3:.2f} ms",
            f"{r.gb_per_s:.2f}",
            f"{r.bytes_moved / r.ceiling_seconds / 1e9:.2f}",
            f"{r.ratio:.2f}",
        )
        for r in results
    ]
    _out(
        f"megamoe bench on {device}; ceiling: the bytes moved at the plain-copy bandwidth "
        f"measured now ({bandwidth / 1e9:.1f} GB/s), for convert a safetensors load_file + "
        "save_file copy of the same checkpoint"
    )
    _out(format_table(rows, headers))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The ``megamoe`` argument parser with its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    parser = argparse.ArgumentParser(
        prog="megamoe",
        parents=[common],
        description="Checkpoint experts to DeepGEMM MegaMoE kernel weights.",
        epilog="Run 'megamoe <command> --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="synthetic checkpoints end to end",
        description="For every installed adapter and format: write a synthetic checkpoint, "
        "load it, run a forward on the best backend and compare with the float64 reference. "
        "Exits 1 on any mismatch.",
    )
    demo.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    demo.add_argument("--backend", default="auto", choices=("auto", "reference", "deepgemm"))
    demo.add_argument("--adapter", action="append", help="only this adapter (repeatable)")
    demo.add_argument(
        "--format",
        action="append",
        choices=FORMATS,
        help="only this checkpoint format (repeatable)",
    )
    demo.set_defaults(func=_cmd_demo)

    inspect = sub.add_parser(
        "inspect",
        parents=[common],
        help="describe a checkpoint",
        description="Model, MoE layers, expert format per layer, what would be requantized "
        "to what on the target, and kernel-weight bytes per rank. Reads headers only.",
    )
    inspect.add_argument("checkpoint", help="Hugging Face checkpoint directory")
    inspect.add_argument(
        "--ep-size", type=_positive_int, default=1, help="expert-parallel ranks (default 1)"
    )
    inspect.add_argument("--arch", choices=ARCHES, help="target (default: this machine)")
    inspect.add_argument("--moe-format", choices=FORMATS, help="force a run format")
    inspect.set_defaults(func=_cmd_inspect)

    convert = sub.add_parser(
        "convert",
        parents=[common],
        help="write a kernel-ready checkpoint",
        description="Requantize the routed experts to a kernel format offline (byte-identical "
        "to online requantization); other tensors are copied unchanged, quantization_config "
        "is updated. Writes OUT.partial-<pid> and renames it to OUT when complete.",
    )
    convert.add_argument("checkpoint", help="source checkpoint directory")
    convert.add_argument("out", help="output directory (must not exist)")
    convert.add_argument("--to", required=True, choices=TARGETS, help="target expert format")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert.set_defaults(func=_cmd_convert)

    verify = sub.add_parser(
        "verify",
        parents=[common],
        help="check forwards vs the reference",
        description="Load MoE layers, run a forward on random tokens, compare with the "
        "float64 reference; exits 1 if any layer is beyond tolerance.",
    )
    verify.add_argument("checkpoint", help="checkpoint directory")
    verify.add_argument("--layers", help="comma-separated layer indices and/or 'mtp' (default all)")
    verify.add_argument("--moe-format", choices=FORMATS, help="force a run format")
    verify.add_argument("--backend", default="auto", choices=("auto", "reference", "deepgemm"))
    verify.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    verify.add_argument(
        "--tokens", type=_positive_int, default=32, help="tokens per forward (default 32)"
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    verify.add_argument(
        "--tolerance", type=_positive_float, help="accepted max rel. error (default per format)"
    )
    verify.set_defaults(func=_cmd_verify)

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="throughput beside its ceiling",
        description="Runs megamoe's own benchmarks/bench_{requant,forward,load}.py when "
        "megamoe runs from its source checkout (never scripts of the current directory), "
        "else the built-in benchmarks: requantization, one layer's forward per backend and "
        "convert, each beside the memory-bandwidth ceiling measured in the same run.",
    )
    bench.add_argument("--builtin", action="store_true", help="built-in benchmarks only")
    bench.add_argument("--only", help=f"built-in parts, comma-separated: {','.join(BENCH_PARTS)}")
    bench.add_argument("--device", type=_device_name, help=DEVICE_HELP)
    bench.add_argument(
        "--repeats", type=_positive_int, default=5, help="timed runs per measurement"
    )
    bench.add_argument("script_args", nargs="*", help="arguments for the scripts (after --)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    _out(f"megamoe: warning: {message}", sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``megamoe`` command.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="megamoe: %(message)s"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # shown once per place, never turned into errors
        warnings.showwarning = _one_line_warning
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        if args.debug:
            raise
        _out(f"megamoe {args.command}: interrupted", sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if args.debug:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        _out(f"megamoe {args.command}: error: {message}", sys.stderr)
        return EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
