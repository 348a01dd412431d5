"""One MoE layer's load from a safetensors checkpoint on disk to ready kernel weights.

Writes a one-layer checkpoint per checkpoint format (per-expert ``{e}.{gate,up,down}_proj``
tensors in Hugging Face naming, several shard files), then times, per (checkpoint format
-> run format):

- ``plain read``: every tensor of the layer read with ``safe_open(...).get_tensor`` and
  copied to the GPU: the least any loader must do with those bytes;
- ``megamoe``: ``MegaMoEExperts(...).load_weights(stream)`` + ``finalize()`` on
  ``--backend`` (``auto``: DeepGEMM where it runs the run format, else the reference): the
  product's load path (requantizing each projection as its weight and scale pair up,
  through ``quant.requantize``, i.e. the Triton kernels on CUDA);
- ``streamed``: the same tensors staged on the GPU ``--chunk`` experts at a time and
  requantized by one Triton launch per projection group, written straight into the final
  kernel tensors (``requantize_triton_async(..., out=...)``, one flag check per layer).

Throughput is checkpoint bytes over time; "ratio" is a load path's time over the plain
read's. Memory of the ``megamoe`` path: "resident" is what the loaded layer keeps (distinct
storages of the experts and their backend, ``testing/memory.py``) over one copy of the
run-format weights and scales; "peak" the allocator's peak during the first load, and
"reload peak" during a full reload of new weights, over the final resident bytes (the
DeepGEMM symmetric buffer, activation memory, is allocated before measuring).
Reads hit the page cache (the file was just written and read once
to warm): the GPU work is not hidden behind a slow disk.

The DeepGEMM layout transform (gate/up rows interleaved in groups of 8, as
``transform_weights_for_mega_moe_sm90`` does; block scales unchanged) is timed on its own
over the loaded layer: a torch permutation copy, and DeepGEMM's own function when
``deep_gemm`` imports.

With ``--device cpu`` every path runs on the CPU (no GPU needed): the plain read copies
each tensor once in memory, the streamed path converts with the torch requantization, and
peak memory is not measured.

Usage::

    python benchmarks/bench_load.py --experts 32 --hidden 4096 --intermediate 1536 --json load.json
    python benchmarks/bench_load.py --device cpu --hidden 2048 --intermediate 768
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from memory import canonical_bytes, resident_bytes
from safetensors import safe_open
from safetensors.torch import save_file

from harness import (
    add_shape_args,
    cuda_median_ms,
    format_table,
    model_like_bf16,
    one_rank_experts,
    parse_format_pairs,
    write_json,
)
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

W = WeightFormat
DEFAULT_PAIRS = "fp8_block:mxfp8,fp8_block:fp8_block,bf16:fp8_block,mxfp4:fp8_block,bf16:mxfp8"
PROJS = ("gate_proj", "up_proj", "down_proj")
INTERLEAVE_ROWS = 8  # DeepGEMM's gate/up interleave granularity


@dataclass
class LoadRow:
    """One (checkpoint format -> run format) load."""

    conversion: str
    disk_bytes: int
    final_bytes: int
    plain_s: float
    megamoe_s: float | None
    megamoe_peak_ratio: float | None
    resident_ratio: float | None
    reload_peak_ratio: float | None
    backend: str | None
    megamoe_error: str | None
    streamed_s: float
    streamed_peak_ratio: float | None
    transform_ms: float
    transform_deep_gemm_ms: float | None
    interleave_equals_deep_gemm: bool | None

    @property
    def plain_gbs(self) -> float:
        return self.disk_bytes / self.plain_s / 1e9


def write_checkpoint(
    root: Path, fmt: WeightFormat, shape: tuple[int, int, int], per_file: int, device: str
) -> list[Path]:
    """One layer's experts in ``fmt``, ``per_file`` experts per safetensors file."""
    experts, hidden, inter = shape
    gate_up = model_like_bf16((experts, 2 * inter, hidden), seed=1, device=device)
    down = model_like_bf16((experts, hidden, inter), seed=2, device=device)
    files = []
    for first in range(0, experts, per_file):
        tensors: dict[str, torch.Tensor] = {}
        for e in range(first, min(experts, first + per_file)):
            dense = {
                "gate_proj": gate_up[e, :inter],
                "up_proj": gate_up[e, inter:] * 1.7,
                "down_proj": down[e] * 0.6,
            }
            for proj, x in dense.items():
                if fmt is W.BF16:
                    tensors[f"{e}.{proj}.weight"] = x.contiguous().cpu()
                    continue
                weight, scale = quant.requantize(x.contiguous(), None, W.BF16, fmt)
                tensors[f"{e}.{proj}.weight"] = weight.cpu()
                tensors[f"{e}.{proj}.{fmt.scale_name}"] = scale.cpu()
        path = root / f"{fmt.value}-{first:05d}.safetensors"
        save_file(tensors, str(path))
        files.append(path)
    return files


def stream(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the layer, read one at a time from disk (CPU)."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def plain_read(files: Sequence[Path], device: str) -> None:
    for _, tensor in stream(files):
        tensor.to(device, copy=True)  # on the CPU too: one copy of the bytes
    sync(device)


def load_megamoe(
    files: Sequence[Path],
    ckpt: WeightFormat,
    run: WeightFormat,
    shape: Any,
    device: str,
    backend: str,
) -> MegaMoEExperts:
    """The product's path: a loaded, finalized layer."""
    module = one_rank_experts(shape, 8, run, ckpt, backend, device=device)
    module.load_weights(stream(files))
    module.finalize()
    sync(device)
    return module


def reload_peak_ratio(module: MegaMoEExperts, files: Sequence[Path], device: str) -> float | None:
    """Peak allocated bytes during a full reload over the layer's resident bytes."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    module.load_weights(stream(files))
    module.finalize()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base + resident_bytes(module)) / resident_bytes(
        module
    )


def _kernel_tensors(run: WeightFormat, shape: Any, dev: str) -> dict[str, torch.Tensor]:
    """Uninitialized canonical kernel tensors (w13 gate rows then up rows, w2) on ``dev``."""
    experts, hidden, inter = shape
    per, u8 = run.values_per_byte, torch.uint8
    tensors = {
        "w13": torch.empty(
            (experts, 2 * inter, hidden // per), dtype=run.element_dtype, device=dev
        ),
        "w2": torch.empty((experts, hidden, inter // per), dtype=run.element_dtype, device=dev),
    }
    if run is W.FP8_BLOCK:
        tensors["w13_scale"] = torch.empty((experts, 2 * inter // 128, hidden // 128), device=dev)
        tensors["w2_scale"] = torch.empty((experts, hidden // 128, inter // 128), device=dev)
    elif run.is_mx:
        tensors["w13_scale"] = torch.empty((experts, 2 * inter, hidden // 32), dtype=u8, device=dev)
        tensors["w2_scale"] = torch.empty((experts, hidden, inter // 32), dtype=u8, device=dev)
    return tensors


def load_streamed(
    files: Sequence[Path],
    ckpt: WeightFormat,
    run: WeightFormat,
    shape: Any,
    chunk: int,
    device: str,
) -> dict[str, torch.Tensor]:
    """Stage ``chunk`` experts on the GPU, requantize each group in one launch, into place."""
    experts, hidden, inter = shape
    final = _kernel_tensors(run, shape, device)
    staged = _kernel_tensors(ckpt, (chunk, hidden, inter), device)
    flags: list[torch.Tensor] = []
    with ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in files
        ]
        where = {name: f for f in handles for name in f.keys()}  # noqa: SIM118
        for first in range(0, experts, chunk):
            count = min(chunk, experts - first)
            for j in range(count):
                for proj in PROJS:
                    _stage(where, staged, ckpt, f"{first + j}.{proj}", proj, j, inter)
            _convert_chunk(staged, final, ckpt, run, first, count, flags)
    if flags and int(torch.stack(flags).sum().item()) != 0:
        raise RuntimeError("non-finite checkpoint values")
    sync(device)
    return final


def _convert_chunk(
    staged: dict[str, torch.Tensor],
    final: dict[str, torch.Tensor],
    ckpt: WeightFormat,
    run: WeightFormat,
    first: int,
    count: int,
    flags: list[torch.Tensor],
) -> None:
    """Write ``count`` staged experts into ``final`` from expert ``first`` on.

    On the GPU one Triton launch per group, straight into ``final``; on the CPU the torch
    requantization (it raises on non-finite input itself), then a copy into ``final``.
    """
    for stem in ("w13", "w2"):
        weight = staged[stem][:count]
        scale = staged.get(f"{stem}_scale")
        scale = None if scale is None else scale[:count]
        out_w = final[stem][first : first + count]
        out_s = final[f"{stem}_scale"][first : first + count]
        if ckpt is run:
            out_w.copy_(weight)
            if scale is not None:
                out_s.copy_(scale)
            continue
        if weight.is_cuda:
            from megamoe.core.kernels.requant_triton import requantize_triton_async

            flags.append(requantize_triton_async(weight, scale, ckpt, run, out=(out_w, out_s))[2])
            continue
        new_weight, new_scale = quant.requantize(weight, scale, ckpt, run)
        out_w.copy_(new_weight)
        out_s.copy_(new_scale)


def _stage(
    where: dict[str, Any],
    staging: dict[str, torch.Tensor],
    fmt: WeightFormat,
    name: str,
    proj: str,
    j: int,
    inter: int,
) -> None:
    """Copy one projection's weight (and scale) from disk into staging slot ``j``."""
    stem = "w2" if proj == "down_proj" else "w13"
    parts = [("weight", stem)]
    if fmt.scale_name is not None:
        parts.append((fmt.scale_name, f"{stem}_scale"))
    for kind, key in parts:
        tensor = where[f"{name}.{kind}"].get_tensor(f"{name}.{kind}")
        target = staging[key][j]
        if proj != "down_proj":  # gate rows first, then up rows
            rows = inter // 128 if key.endswith("scale") and fmt is W.FP8_BLOCK else inter
            target = target[:rows] if proj == "gate_proj" else target[rows:]
        target.copy_(tensor)


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[gate 0..7, up 0..7, gate 8..15, ...] rows, as DeepGEMM's SM90 transform lays them out."""
    e, n, k = w13.shape
    groups = n // 2 // INTERLEAVE_ROWS
    return w13.view(e, 2, groups, INTERLEAVE_ROWS, k).transpose(1, 2).reshape(e, n, k)


def peak_ratio(
    fn: Callable[[], Any], final_bytes: Callable[[Any], int], device: str
) -> tuple[float | None, Any]:
    """Peak allocated device bytes while ``fn`` runs over its final bytes (None on the CPU)."""
    if device != "cuda":
        return None, fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    peak = torch.cuda.max_memory_allocated() - base
    return peak / final_bytes(result), result


def median_seconds(fn: Callable[[], Any], reps: int, device: str) -> float:
    fn()  # warm: page cache, kernel compilation, allocator
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(
    pair: tuple[WeightFormat, WeightFormat],
    files: Sequence[Path],
    shape: tuple[int, int, int],
    args: argparse.Namespace,
) -> LoadRow:
    ckpt, run = pair
    dev, disk = args.device, sum(p.stat().st_size for p in files)
    plain = median_seconds(lambda: plain_read(files, dev), args.reps, dev)

    def streamed() -> dict[str, torch.Tensor]:
        return load_streamed(files, ckpt, run, shape, args.chunk, dev)

    def megamoe() -> MegaMoEExperts:
        return load_megamoe(files, ckpt, run, shape, dev, args.backend)

    streamed_s = median_seconds(streamed, args.reps, dev)
    ratio, final = peak_ratio(
        streamed, lambda t: sum(x.numel() * x.element_size() for x in t.values()), dev
    )
    final_bytes = sum(x.numel() * x.element_size() for x in final.values())
    megamoe_s = megamoe_ratio = resident = reload_ratio = backend = error = None
    try:
        megamoe_s = median_seconds(megamoe, args.reps, dev)  # its buffer is cached now
        megamoe_ratio, module = peak_ratio(megamoe, resident_bytes, dev)
        resident = resident_bytes(module) / canonical_bytes(module)
        reload_ratio = reload_peak_ratio(module, files, dev)
        backend = module.backend.name
    except Exception as exc:  # report the product path's failure beside the numbers
        error = f"{type(exc).__name__}: {exc}"[:300]
    w13 = final["w13"]
    if dev == "cuda":
        transform_ms = cuda_median_ms(lambda: interleave_gate_up(w13), 2, 10)
    else:
        transform_ms = 1e3 * median_seconds(lambda: interleave_gate_up(w13), 5, dev)
    dg_ms = same = None
    if run is W.FP8_BLOCK and dev == "cuda":
        try:
            import deep_gemm

            pieces = ((w13, final["w13_scale"]), (final["w2"], final["w2_scale"]))
            dg_ms = cuda_median_ms(
                lambda: deep_gemm.transform_weights_for_mega_moe_sm90(*pieces), 2, 10
            )
            (dg_w13, _), _ = deep_gemm.transform_weights_for_mega_moe_sm90(*pieces)
            same = torch.equal(dg_w13.view(torch.uint8), interleave_gate_up(w13).view(torch.uint8))
        except Exception:  # deep_gemm missing or unable to run here
            dg_ms = same = None
    return LoadRow(
        conversion=f"{ckpt.value}->{run.value}",
        disk_bytes=disk,
        final_bytes=final_bytes,
        plain_s=plain,
        megamoe_s=megamoe_s,
        megamoe_peak_ratio=megamoe_ratio,
        resident_ratio=resident,
        reload_peak_ratio=reload_ratio,
        backend=backend,
        megamoe_error=error,
        streamed_s=streamed_s,
        streamed_peak_ratio=ratio,
        transform_ms=transform_ms,
        transform_deep_gemm_ms=dg_ms,
        interleave_equals_deep_gemm=same,
    )


COLUMNS = (
    ("ckpt->run", "<20"),
    ("disk MB", ">8.0f"),
    ("plain s", ">8.3f"),
    ("GB/s", ">6.2f"),
    ("megamoe s", ">9.3f"),
    ("mm ratio", ">6.2f"),
    ("backend", "<9"),
    ("resident", ">8.3f"),
    ("mm peak", ">7.3f"),
    ("reload peak", ">11.3f"),
    ("streamed s", ">10.3f"),
    ("st ratio", ">6.2f"),
    ("st peak", ">5.2f"),
    ("interleave ms", ">13.3f"),
    ("% load", ">6.2f"),
    ("deep_gemm ms", ">12.3f"),
)


def table(rows: Sequence[LoadRow]) -> str:
    lines = [
        (
            r.conversion,
            r.disk_bytes / 1e6,
            r.plain_s,
            r.plain_gbs,
            r.megamoe_s,
            None if r.megamoe_s is None else r.megamoe_s / r.plain_s,
            r.backend,
            r.resident_ratio,
            r.megamoe_peak_ratio,
            r.reload_peak_ratio,
            r.streamed_s,
            r.streamed_s / r.plain_s,
            r.streamed_peak_ratio,
            r.transform_ms,
            100 * r.transform_ms / 1e3 / r.streamed_s,
            r.transform_deep_gemm_ms,
        )
        for r in rows
    ]
    errors = [
        f"  {r.conversion}: megamoe path failed: {r.megamoe_error}" for r in rows if r.megamoe_error
    ]
    return "\n".join([format_table(COLUMNS, lines), *errors])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser, experts=32, top_k=False)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="ckpt:run,... (format values)")
    parser.add_argument("--per-file", type=int, default=8, help="experts per safetensors file")
    parser.add_argument("--chunk", type=int, default=4, help="experts staged on the GPU at once")
    parser.add_argument("--reps", type=int, default=3, help="timed loads per path (median)")
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: temp)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--backend", choices=("auto", "reference", "deepgemm"), default="auto",
        help="experts backend of the megamoe path (default: auto)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_load: needs a CUDA device (or pass --device cpu)", file=sys.stderr)
        return 2
    shape = (args.experts, args.hidden, args.intermediate)
    pairs = parse_format_pairs(args.pairs)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_load_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        checkpoints: dict[WeightFormat, list[Path]] = {}
        for ckpt, run in pairs:
            if ckpt not in checkpoints:
                checkpoints[ckpt] = write_checkpoint(root, ckpt, shape, args.per_file, args.device)
            rows.append(bench((ckpt, run), checkpoints[ckpt], shape, args))
            print(table(rows[-1:]).splitlines()[2], flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"layer: {args.experts} experts, hidden {args.hidden}, intermediate {args.intermediate}")
    print(table(rows))
    if args.json:
        report = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "shape": {"experts": args.experts, "hidden": args.hidden, "inter": args.intermediate},
            "block": list(BLOCK_FP8_DEFAULT),
            "rows": [asdict(r) | {"plain_gbs": r.plain_gbs} for r in rows],
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
