"""What each ``megamoe`` command does and prints, given its parsed arguments.

``megamoe.core.cli.main`` parses the arguments and calls ``run_<command>(args)``, which returns
the exit code; errors propagate to the CLI, which prints them as one line.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import torch
from tqdm import tqdm

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.cli.demo import format_table
from megamoe.core.cli.exit_codes import EXIT_FAIL, EXIT_OK
from megamoe.core.cli.inspection import human_bytes
from megamoe.core.errors import CapabilityError, UsageError
from megamoe.core.numerics.formats import WeightFormat

SAMPLE_MAX_BYTES = 4 << 30  # megamoe sample writes small checkpoints


def _out(text: str = "", stream: TextIO | None = None) -> None:
    print(text, file=stream or sys.stdout, flush=True)


def resolve_device(name: str | None) -> torch.device:
    """The device ``--device`` names (None: cuda if available), checked to exist here.

    Raises:
        UsageError: a CUDA device this machine lacks; the message says why there is none
            and names ``--device``.
    """
    from megamoe.core.cli.demo import default_device

    if name is None:
        return default_device()
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            why = (
                "this torch is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
                if count == 0
                else f"its CUDA devices are cuda:0..{count - 1}"
            )
            raise UsageError(
                f"--device {name}: this machine has {count} CUDA device(s) ({why}); use "
                "--device cpu" + (f" or cuda:0..{count - 1}" if count else "")
            )
    return device


def _progress_on(args: argparse.Namespace) -> bool:
    """A progress bar only on a terminal, unless ``--no-progress``."""
    return not args.no_progress and sys.stderr.isatty()


@contextmanager
def _bar(total: int, unit: str, on: bool) -> Iterator[tqdm]:
    # Redrawn at every stage: on a real checkpoint a stage of one layer takes seconds.
    bar = tqdm(total=total, unit=unit, disable=not on, file=sys.stderr, leave=False, mininterval=0)
    with bar:
        yield bar


def check_backend_runs(backend: str, runs: Iterable[WeightFormat], device: torch.device) -> None:
    """Refuse a ``--backend`` that cannot run one of the run formats ``runs`` on ``device``.

    Checked before anything loads, as a ``--moe-format`` the target cannot run is.

    Raises:
        UsageError: the backend's reason, and the flags to pass instead.
    """
    from megamoe.core.modules.backend_select import resolve_backend

    for run in dict.fromkeys(runs):
        try:
            resolve_backend(backend, run, device)
        except CapabilityError as exc:
            raise UsageError(str(exc)) from exc


def run_demo(args: argparse.Namespace) -> int:
    """``megamoe demo``."""
    from megamoe.core.cli.demo import demo_combinations, run_demo
    from megamoe.core.modules.block_setup import target_arch
    from megamoe.core.numerics.formats import resolve_formats

    device = resolve_device(args.device)
    combinations = demo_combinations(args.adapter, args.format)
    arch = target_arch(None, args.backend, device)
    with warnings.catch_warnings():  # each load warns of its conversion itself
        warnings.simplefilter("ignore")
        runs = [resolve_formats(fmt, None, arch)[1] for _, fmt in combinations]
    check_backend_runs(args.backend, runs, device)
    total = len(combinations)
    _out("megamoe demo: synthetic checkpoint -> load -> forward -> float64 reference")
    with _bar(total, "checkpoint", _progress_on(args)) as bar:
        rows = run_demo(
            device=device,
            backend=args.backend,
            adapters=args.adapter,
            formats=args.format,
            on_row=lambda _: bar.update(),
        )
    _out(format_table([row.cells() for row in rows]))
    for row in rows:
        if row.error is not None:
            _out(f"{row.adapter} {row.checkpoint_format.value}: {row.error}", sys.stderr)
    failed = [r for r in rows if not r.ok]
    _out(f"{len(rows) - len(failed)} of {len(rows)} combinations within tolerance")
    return EXIT_FAIL if failed else EXIT_OK


def run_sample(args: argparse.Namespace) -> int:
    """``megamoe sample``."""
    from megamoe.core.cli.sample import write_sample

    sizes = SyntheticSizes(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_experts=args.num_experts,
        shared_intermediate_size=args.intermediate_size,
    )
    if sizes.top_k > sizes.num_experts:
        raise UsageError(
            f"--num-experts {sizes.num_experts}: fewer than the {sizes.top_k} experts each "
            f"token is routed to; use --num-experts {sizes.top_k} or more"
        )
    # Expert weights in bf16 at most, one MTP layer and a shared expert included.
    estimate = (
        (sizes.num_layers + 1) * (sizes.num_experts + 1) * 3
        * sizes.hidden_size * sizes.intermediate_size * 2
    )  # fmt: skip
    if estimate > SAMPLE_MAX_BYTES:
        raise UsageError(
            f"--num-layers {sizes.num_layers} --num-experts {sizes.num_experts} --hidden-size "
            f"{sizes.hidden_size} --intermediate-size {sizes.intermediate_size}: about "
            f"{human_bytes(estimate)} of expert weights, above the {human_bytes(SAMPLE_MAX_BYTES)} "
            "a sample may take; choose smaller sizes (a sample is for trying the commands)"
        )
    sample = write_sample(args.out, args.adapter, args.format, sizes, args.seed)
    mtp = sum(layer.is_mtp for layer in sample.layers)
    _out(
        f"wrote {sample.path}: {sample.model_type} ({sample.adapter.name}), routed experts "
        f"stored as {sample.checkpoint_format.value}; {len(sample.layers) - mtp} MoE layer(s)"
        f"{f' + {mtp} MTP' if mtp else ''}, {sizes.num_experts} experts, hidden "
        f"{sizes.hidden_size}, intermediate {sizes.intermediate_size}; {sample.files} "
        f"safetensors file(s), {human_bytes(sample.tensor_bytes)}"
    )
    _out(f"next: megamoe inspect {sample.path}")
    return EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    """``megamoe inspect``."""
    from megamoe.core.cli.inspection import plan_checkpoint

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
    _out(f"path        {plan.experts_path()}")
    _out(
        "checked     names, headers, index and every expert tensor (routed, shared, MTP) vs "
        "config.json"
    )
    taken = ", ".join(f"{key}={value!r}" for key, value in plan.defaulted.items())
    _out(
        f"defaults    {taken} (absent from config.json: transformers' {plan.model_type} defaults)"
        if taken
        else "defaults    none (config.json sets every key megamoe would take a default for)"
    )
    _out()
    headers = ("layer", "prefix", "stored", "runs as", "conversion", "kernel bytes/rank")
    rows = [
        (
            _layer_cell(p.layer),
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


def run_convert(args: argparse.Namespace) -> int:
    """``megamoe convert``."""
    from megamoe.core.convert import convert_checkpoint

    result = convert_checkpoint(args.checkpoint, args.out, args.to, progress=_progress_on(args))
    _out(
        f"wrote {result.out}: {result.converted} expert projection(s) requantized to "
        f"{result.target.value}, {result.copied} tensor(s) copied unchanged; "
        f"{result.source_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
        f"({result.mb_per_s:.1f} MB/s)"
    )
    _out(f"next: megamoe verify {result.out} --against {args.checkpoint}")
    return EXIT_OK


def _layer_cell(layer: MoELayer) -> str:
    return f"{layer.index}{' (mtp)' if layer.is_mtp else ''}"


def _layer_label(layer: MoELayer) -> str:
    """How ``--layers`` names a layer: its index, or ``mtp`` for the MTP drafter's."""
    return "mtp" if layer.is_mtp else str(layer.index)


def select_layers(layers: Sequence[MoELayer], spec: str | None) -> list[MoELayer]:
    """The layers ``--layers`` selects (all for None or ``all``).

    Raises:
        UsageError: a label that names no MoE layer, or none at all; the message lists the
            layers.
    """
    if spec is None or spec == "all":
        return list(layers)
    wanted = {part.strip() for part in spec.split(",") if part.strip()}
    known = dict.fromkeys(_layer_label(layer) for layer in layers)
    if not wanted:
        raise UsageError(
            f"--layers {spec!r} selects no layer; name some of {', '.join(known)}, or 'all'"
        )
    unknown = wanted - known.keys()
    if unknown:
        raise UsageError(
            f"--layers {spec}: no MoE layer {', '.join(sorted(unknown))}; the checkpoint's "
            f"MoE layers are {', '.join(known)}"
        )
    return [layer for layer in layers if _layer_label(layer) in wanted]


def run_verify(args: argparse.Namespace) -> int:
    """``megamoe verify``."""
    from megamoe.core.adapters import open_checkpoint
    from megamoe.core.cli.inspection import run_formats
    from megamoe.core.cli.verify import source_layers, verify_layer
    from megamoe.core.modules.block_setup import target_arch
    from megamoe.core.modules.parallel import ParallelSettings, single_rank_group

    reader, adapter = open_checkpoint(args.checkpoint)
    sources = None
    if args.against is not None:
        source, source_adapter = open_checkpoint(args.against)
        sources = source_layers(reader, adapter, source, source_adapter)
    layers = select_layers(reader.layers, args.layers)
    device = resolve_device(args.device)
    with warnings.catch_warnings():  # each layer's load warns of its conversion itself
        warnings.simplefilter("ignore")
        runs = run_formats(layers, args.moe_format, target_arch(None, args.backend, device))
    check_backend_runs(args.backend, runs, device)
    parallel = ParallelSettings(ep_group=single_rank_group(device))
    rows, failed = [], 0
    with _bar(len(layers), "layer", _progress_on(args)) as bar:
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
                against=None if sources is None else (source, sources[layer.prefix]),
                on_stage=functools.partial(_describe, bar, layer.prefix),
            )
            bar.update()
            failed += not check.ok
            loss = () if check.conversion_error is None else (f"{check.conversion_error:.2e}",)
            rows.append(
                (
                    _layer_cell(layer),
                    layer.prefix,
                    layer.checkpoint_format.value,
                    check.run_format.value,
                    check.backend,
                    *loss,
                    f"{check.max_rel_error:.2e}",
                    repr(check.tolerance),
                    f"{check.load_seconds:.2f}",
                    "ok" if check.ok else "FAIL",
                )
            )
    vs = "the float64 reference" if sources is None else f"the float64 reference of {args.against}"
    headers = (
        "layer",
        "prefix",
        "stored",
        "run",
        "backend",
        *(() if sources is None else ("conversion loss",)),
        "max rel. error",
        "tol.",
        "load s",
        "result",
    )
    _out(format_table(rows, headers))
    _out(
        f"{len(rows) - failed} of {len(rows)} layer(s) within tolerance "
        f"(max |out - ref| / max |ref| vs {vs})"
    )
    if sources is not None:
        _out(
            "conversion loss: max |ref - ref_source| / max |ref_source| of the two float64 "
            "references, before any kernel rounding"
        )
    return EXIT_FAIL if failed else EXIT_OK


def _describe(bar: tqdm, prefix: str, stage: str) -> None:
    bar.set_description(f"{prefix}: {stage}")


def run_bench(args: argparse.Namespace) -> int:
    """``megamoe bench``."""
    from megamoe.core.cli import bench

    device = resolve_device(args.device)
    scripts = [] if args.builtin else bench.shipped_bench_scripts()
    if scripts and device.type == "cuda":
        return _run_scripts(scripts, args.script_args, device)
    if scripts:
        _out(
            f"megamoe bench: benchmarks/ scripts need a CUDA device (--device {device}); "
            f"running the built-in benchmarks on {device}"
        )
    if args.script_args:
        raise UsageError(
            f"arguments after -- ({' '.join(args.script_args)}) are for the benchmarks/ "
            "scripts, which run on a CUDA device of a source checkout; drop them here"
        )
    results = []
    bandwidth = bench.copy_bandwidth(device, args.repeats)
    if "requant" in args.only:
        results += bench.bench_requantize(device=device, repeats=args.repeats, bandwidth=bandwidth)
    if "forward" in args.only:
        results += bench.bench_forward(device=device, repeats=args.repeats, bandwidth=bandwidth)
    if "convert" in args.only:
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


def _run_scripts(
    scripts: Sequence[os.PathLike[str]], extra: Sequence[str], device: torch.device
) -> int:
    """Each benchmark script on ``device`` (``CUDA_VISIBLE_DEVICES`` picks ``cuda:N``).

    The checkout's ``testing/`` helpers (which some scripts import) go on ``PYTHONPATH``.
    """
    env = dict(os.environ)
    helpers = {os.fspath(Path(script).parent.parent / "testing") for script in scripts}
    env["PYTHONPATH"] = os.pathsep.join([*sorted(helpers), *filter(None, [env.get("PYTHONPATH")])])
    if device.index is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ids[device.index]
    code = EXIT_OK
    for script in scripts:
        _out(f"== {script}")
        done = subprocess.run([sys.executable, os.fspath(script), *extra], check=False, env=env)
        code = code or (EXIT_FAIL if done.returncode else EXIT_OK)
    return code
