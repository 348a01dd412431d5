"""Built-in benchmarks for ``megamoe bench``, each beside its memory-bandwidth ceiling.

In megamoe's source checkout on a CUDA device, ``megamoe bench`` runs the checkout's own
``benchmarks/`` scripts instead (``shipped_bench_scripts``); they need CUDA.

Requantization and a layer's forward are memory-bound at best: the fastest they could run
is the time to move their bytes at the bandwidth of a plain copy (of a buffer larger than
the caches) on the same device, measured in the same run. ``megamoe convert`` is measured
against a plain safetensors copy (load_file + save_file) of the same checkpoint. Each result
is reported as the ceiling's time over the measured time (1.0 = at the ceiling).
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megamoe.core import adapters as adapter_registry
from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.expert_names import projection_specs
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.convert import convert_checkpoint
from megamoe.core.modules.backend_select import backend_class
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat, detect_arch, resolve_formats
from megamoe.core.testing import synthetic_expert_tensors, write_synthetic_checkpoint

REQUANT_PAIRS = (
    (WeightFormat.BF16, WeightFormat.MXFP8),
    (WeightFormat.BF16, WeightFormat.MXFP4),
    (WeightFormat.FP8_BLOCK, WeightFormat.MXFP8),
    (WeightFormat.BF16, WeightFormat.FP8_BLOCK),
    (WeightFormat.MXFP4, WeightFormat.MXFP8),
)
BACKENDS = ("reference", "deepgemm")
BANDWIDTH_PROBE_BYTES = 512 << 20  # 256 MiB read + 256 MiB written
BENCH_SCRIPTS = ("bench_requant.py", "bench_forward.py", "bench_load.py")
# This file's place in a source checkout (<root>/core/src/...); a wheel puts it elsewhere.
CHECKOUT_PATH = Path("core", "src", "megamoe", "core", "cli", "bench.py")
SOURCE_ROOT = Path(__file__).resolve().parents[len(CHECKOUT_PATH.parts) - 1]


def shipped_bench_scripts() -> list[Path]:
    """The ``benchmarks/bench_*.py`` scripts of the source checkout megamoe runs from.

    Only megamoe's own: found beside this package's sources (``SOURCE_ROOT``), never in
    the current directory; none for an installed wheel (the built-in benchmarks run then).
    """
    if not (SOURCE_ROOT / "core" / "pyproject.toml").is_file():
        return []
    directory = SOURCE_ROOT / "benchmarks"
    return [directory / name for name in BENCH_SCRIPTS if (directory / name).is_file()]


@dataclass(frozen=True)
class BenchResult:
    """One timed operation and its ceiling.

    Attributes:
        name: what ran.
        seconds: median time of one run.
        bytes_moved: bytes it must read and write at least.
        ceiling_seconds: the time to move ``bytes_moved`` at the plain-copy bandwidth.
    """

    name: str
    seconds: float
    bytes_moved: int
    ceiling_seconds: float

    @property
    def gb_per_s(self) -> float:
        """Effective bandwidth, 10^9 bytes per second."""
        return self.bytes_moved / self.seconds / 1e9

    @property
    def ratio(self) -> float:
        """Ceiling time over measured time (1.0 = at the copy bandwidth)."""
        return self.ceiling_seconds / self.seconds


def time_median(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(
    device: torch.device, repeats: int, nbytes: int = BANDWIDTH_PROBE_BYTES
) -> float:
    """Bytes per second (read plus write) of a plain copy of ``nbytes`` bytes on ``device``.

    The buffer is larger than CPU caches, so this is the memory-bandwidth ceiling.
    """
    src = torch.ones(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / time_median(lambda: dst.copy_(src), device, repeats)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bench_requantize(
    *,
    device: torch.device | str = "cpu",
    num_experts: int = 4,
    rows: int = 1024,
    cols: int = 1024,
    repeats: int = 5,
    bandwidth: float | None = None,
) -> list[BenchResult]:
    """Time ``quant.requantize`` of (experts, rows, cols) weights for each of ``REQUANT_PAIRS``.

    Args:
        device: where the tensors live.
        num_experts: leading (batch) dimension.
        rows: weight rows N (a multiple of 128).
        cols: weight columns K (a multiple of 128).
        repeats: timed runs per measurement (the median is kept).
        bandwidth: the copy bandwidth in bytes/s; None measures ``copy_bandwidth``.

    Returns:
        One result per (source, target) pair.
    """
    device = torch.device(device)
    bandwidth = bandwidth or copy_bandwidth(device, repeats)
    results = []
    for src, dst in REQUANT_PAIRS:
        parts: dict[str, list[torch.Tensor]] = {}
        for name, tensor in synthetic_expert_tensors(src, num_experts, cols, rows, seed=0):
            if ".gate_proj." in name:  # gate is (I, H) = (rows, cols)
                parts.setdefault(name.rsplit(".", 1)[1], []).append(tensor)
        weight = torch.stack(parts["weight"]).to(device)
        scale = torch.stack(parts[src.scale_name]).to(device) if src.scale_name else None
        out = projection_specs(dst, rows, cols)
        moved = _nbytes(weight, scale) + num_experts * sum(s.nbytes for s in out if s)
        with warnings.catch_warnings():  # non-power-of-two block scales warn elsewhere
            warnings.simplefilter("ignore")
            seconds = time_median(
                functools.partial(quant.requantize, weight, scale, src, dst), device, repeats
            )
        results.append(
            BenchResult(
                f"requantize {src.value} -> {dst.value} ({num_experts}x{rows}x{cols})",
                seconds,
                moved,
                moved / bandwidth,
            )
        )
    return results


def bench_forward(
    *,
    device: torch.device | str = "cpu",
    num_tokens: int = 64,
    repeats: int = 3,
    bandwidth: float | None = None,
) -> list[BenchResult]:
    """Time one MoE layer's forward per installed adapter and per backend that runs here.

    The floor is reading every kernel weight once: a copy of the kernel-weight bytes.

    Args:
        device: where the block runs.
        num_tokens: tokens per forward.
        repeats: timed runs per measurement.
        bandwidth: the copy bandwidth in bytes/s; None measures ``copy_bandwidth``.

    Returns:
        One result per (adapter, backend).
    """
    device = torch.device(device)
    bandwidth = bandwidth or copy_bandwidth(device, repeats)
    arch = detect_arch(device)
    parallel = ParallelSettings(ep_group=single_rank_group(device))
    results = []
    with tempfile.TemporaryDirectory(prefix="megamoe-bench-") as tmp:
        for name, adapter in adapter_registry.installed_adapters().items():
            fmt = adapter.checkpoint_formats[0]
            path = write_synthetic_checkpoint(Path(tmp) / name, adapter, fmt)
            reader = CheckpointReader(path, adapter)
            layer = reader.layers[0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, run = resolve_formats(fmt, None, arch)
            hidden = torch.randn(num_tokens, adapter.expert_dims(reader.config)[1])
            hidden = hidden.to(device=device, dtype=torch.bfloat16)
            for backend in BACKENDS:
                try:
                    cls = backend_class(backend)
                except ImportError:
                    continue
                if cls.unsupported_reason(run, device) is not None:
                    continue
                block = adapter.build_block(
                    reader.config,
                    layer,
                    parallel=parallel,
                    backend=backend,
                    device=device,
                    max_num_tokens=num_tokens,
                )
                block.load_from_checkpoint(reader)
                moved = _nbytes(*block.experts.kernel_params.values())
                with torch.no_grad():
                    seconds = time_median(functools.partial(block, hidden), device, repeats)
                results.append(
                    BenchResult(
                        f"forward {name} {layer.prefix} {run.value} {backend} ({num_tokens} tok)",
                        seconds,
                        moved,
                        moved / bandwidth,
                    )
                )
    return results


def safetensors_copy_seconds(src: Path, dst: Path) -> float:
    """Seconds to copy every safetensors file of ``src`` with safetensors' own load and save."""
    dst.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for shard in sorted(src.glob("*.safetensors")):
        save_file(load_file(shard), dst / shard.name, metadata={"format": "pt"})
    return time.perf_counter() - start


def bench_convert(*, sizes: SyntheticSizes | None = None) -> list[BenchResult]:
    """Time ``convert_checkpoint`` per installed adapter and checkpoint format.

    The ceiling is a plain safetensors copy (load_file + save_file per shard) of the same
    checkpoint, measured right after each conversion. Each format converts to MXFP8
    (MXFP8 checkpoints to MXFP4).

    Args:
        sizes: synthetic checkpoint sizes (default: 2 layers of 16 experts, H=1024, I=512).

    Returns:
        One result per (adapter, format); ``bytes_moved`` is the source tensor bytes.
    """
    sizes = sizes or SyntheticSizes(
        num_layers=2,
        hidden_size=1024,
        intermediate_size=512,
        num_experts=16,
        shared_intermediate_size=512,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="megamoe-bench-") as tmp:
        for name, adapter in adapter_registry.installed_adapters().items():
            for fmt in adapter.checkpoint_formats:
                dst = WeightFormat.MXFP4 if fmt is WeightFormat.MXFP8 else WeightFormat.MXFP8
                src = write_synthetic_checkpoint(
                    Path(tmp) / f"{name}-{fmt.value}", adapter, fmt, sizes
                )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    done = convert_checkpoint(src, Path(tmp) / "out", dst, progress=False)
                copy = safetensors_copy_seconds(src, Path(tmp) / "copy")
                results.append(
                    BenchResult(
                        f"convert {name} {fmt.value} -> {dst.value}",
                        done.seconds,
                        done.source_bytes,
                        copy,
                    )
                )
                for used in ("out", "copy"):
                    shutil.rmtree(Path(tmp) / used)
                shutil.rmtree(src)
    return results
