"""Offline conversion of a checkpoint's routed experts to a kernel format (SPEC §3.7, §5).

``convert_checkpoint`` writes a checkpoint whose routed experts are stored in the target
format, requantized by ``quant.requantize`` — the function the online load path uses — so
loading the converted checkpoint gives kernel weights byte-identical to loading the original
with online requantization. Every other tensor is copied byte for byte; tensor names and
the assignment of tensors to shard files stay the same (fused BF16 experts become
per-expert tensors in the same shard). Work streams one projection at a time with plain
reads and positioned writes, so memory stays near one projection whatever the checkpoint
size. Output goes to ``OUT.partial-<pid>`` and is renamed to ``OUT`` only once complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megamoe.core import quant
from megamoe.core.adapters import MoELayer
from megamoe.core.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointReader,
    open_checkpoint,
)
from megamoe.core.errors import CheckpointError
from megamoe.core.expert_names import (
    EXPERT_PROJS,
    FUSED_DOWN,
    FUSED_GATE_UP,
    WEIGHT,
    WEIGHT_PACKED,
    TensorSpec,
    parse_expert_name,
    parse_single_name,
    projection_shape,
    projection_specs,
    stored_format,
    weight_kinds,
)
from megamoe.core.formats import BLOCK_FP8_DEFAULT, WeightFormat
from megamoe.core.hf_config import quantization_config
from megamoe.core.shardfile import ShardWriter, TensorEntry, read_header, read_tensor

PARTIAL_MARK = ".partial-"  # OUT.partial-<pid> while a conversion is in progress


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote.

    Attributes:
        out: the converted checkpoint directory.
        target: the experts' new format.
        source_bytes: tensor bytes read from the source checkpoint.
        written_bytes: bytes of the safetensors files written.
        converted: projections requantized.
        copied: tensors copied unchanged.
        seconds: wall time.
    """

    out: Path
    target: WeightFormat
    source_bytes: int
    written_bytes: int
    converted: int
    copied: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        """Source megabytes (10^6 bytes) converted per second."""
        return self.source_bytes / 1e6 / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class _Source:
    """A contiguous run of elements of a source tensor: a projection's weight or scale."""

    file: str
    entry: TensorEntry
    start: int
    shape: tuple[int, ...]

    @property
    def offset(self) -> int:
        return self.entry.begin + self.start * self.entry.dtype.itemsize


@dataclass(frozen=True)
class _Projection:
    """One expert projection to requantize: ``{name}.weight`` and ``{name}.<scale>``."""

    name: str
    weight: _Source
    scale: _Source | None
    src: WeightFormat


@dataclass
class _Plan:
    """Output files (name -> ordered tensors), tensors to copy, projections per layer."""

    headers: dict[str, dict[str, TensorEntry]]
    files: dict[str, dict[str, tuple[tuple[int, int], TensorSpec]]]
    copies: list[tuple[str, str]] = field(default_factory=list)
    layers: list[tuple[MoELayer, list[_Projection]]] = field(default_factory=list)


def convert_checkpoint(
    src: str | Path, out: str | Path, to: WeightFormat | str, *, progress: bool = True
) -> ConvertResult:
    """Write a copy of checkpoint ``src`` at ``out`` with its routed experts in format ``to``.

    Args:
        src: the source checkpoint directory.
        out: the directory to create; it must not exist.
        to: MXFP8, MXFP4 or FP8_BLOCK.
        progress: show a progress bar (bytes) on stderr.

    Returns:
        Sizes and timing of the conversion.

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: ``to`` is not a conversion target.
        CheckpointError: the source is incomplete or inconsistent (checked from the headers
            of every expert tensor before anything is written).
        LookupError: no installed adapter handles the model.
        NotImplementedError: the adapter cannot convert, or a layer's quantization method
            is not supported.
    """
    dst = WeightFormat.parse(to)
    if dst not in quant.TARGET_FORMATS:
        targets = ", ".join(f.value for f in quant.TARGET_FORMATS)
        raise ValueError(f"--to {dst.value}: convert writes one of {targets}")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it or choose another output path")
    start = time.perf_counter()
    reader, adapter = open_checkpoint(src)
    config = adapter.converted_config(reader.config, dst, reader.layers)
    for layer in reader.layers:
        reader.check_layer(layer)
    plan = _plan(reader, dst)
    partial = out.with_name(f"{out.name}{PARTIAL_MARK}{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        source_bytes, converted = _write(reader, plan, dst, partial, progress)
        written = _finish(reader, plan, config, partial)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ConvertResult(
        out, dst, source_bytes, written, converted, len(plan.copies), time.perf_counter() - start
    )


def _block_size(config: Mapping[str, Any]) -> tuple[int, int]:
    quant_config = quantization_config(config)
    block = quant_config.get("weight_block_size") if quant_config else None
    return (int(block[0]), int(block[1])) if block else BLOCK_FP8_DEFAULT


def _plan(reader: CheckpointReader, dst: WeightFormat) -> _Plan:
    """Lay out every output file and list the work, from headers only."""
    adapter = reader.adapter
    if adapter is None:
        raise ValueError("convert needs a reader opened with an adapter")
    headers = {f: read_header(reader.path / f) for f in sorted(set(reader.weight_map.values()))}
    plan = _Plan(headers, files={f: {} for f in headers})
    block = _block_size(reader.config)
    converted: set[str] = set()

    def source(name: str, start: int = 0, shape: tuple[int, ...] | None = None) -> _Source:
        file = reader.weight_map[name]
        entry = headers[file][name]
        converted.add(name)
        return _Source(file, entry, start, entry.shape if shape is None else shape)

    for layer in reader.layers:
        projections: list[_Projection] = []
        for prefix in adapter.expert_prefixes(layer):
            projections += _group(reader, layer, prefix, dst, source)
        for proj in projections:
            rows, cols = proj.weight.shape[0], proj.weight.shape[1] * proj.src.values_per_byte
            spec_w, spec_s = projection_specs(dst, rows, cols, block)
            plan.files[proj.weight.file][f"{proj.name}.{WEIGHT}"] = (
                (proj.weight.offset, 0),
                spec_w,
            )
            if spec_s is not None and dst.scale_name is not None:
                scale_file, key = (
                    (proj.scale.file, (proj.scale.offset, 0))
                    if proj.scale
                    else (proj.weight.file, (proj.weight.offset, 1))
                )
                plan.files[scale_file][f"{proj.name}.{dst.scale_name}"] = (key, spec_s)
        if projections:
            plan.layers.append((layer, projections))
    for file, entries in headers.items():
        for name, entry in entries.items():
            if name not in converted:
                plan.files[file][name] = ((entry.begin, 0), entry.spec)
                plan.copies.append((name, file))
    return plan


def _group(
    reader: CheckpointReader,
    layer: MoELayer,
    prefix: str,
    dst: WeightFormat,
    source: Callable[..., _Source],
) -> list[_Projection]:
    """The projections to requantize under one expert prefix (none when already ``dst``)."""
    names = reader.names_under(prefix)
    if not names:
        return []  # an optional group this checkpoint lacks (check_layer checked the rest)
    singles = [s for s in map(parse_single_name, names) if s is not None]
    if singles:  # one expert stored without an index, e.g. a shared expert
        kinds = {kind for _, kind in singles}
        weight_kind = next((k for k in (WEIGHT, WEIGHT_PACKED) if k in kinds), WEIGHT)
        fmt = stored_format(
            reader.tensor_spec(f"{prefix}.{singles[0][0]}.{weight_kind}").dtype, kinds
        )
        if fmt is None:
            raise CheckpointError(
                f"{prefix}: cannot tell the format of tensors {sorted(names)[:6]}; expected "
                "a weight with the scale of one of bf16, fp8_block, mxfp8, mxfp4"
            )
        if fmt is dst:
            return []
        return [
            _Projection(
                f"{prefix}.{proj}",
                source(f"{prefix}.{proj}.{weight_kind}"),
                source(f"{prefix}.{proj}.{fmt.scale_name}") if fmt.scale_name else None,
                fmt,
            )
            for proj in EXPERT_PROJS
        ]
    fmt = layer.checkpoint_format
    fused = any(p is not None and p.is_fused for p in map(parse_expert_name, names))
    if fmt is dst and not fused:
        return []  # already in the target format: copied unchanged
    if reader.adapter is None:
        raise ValueError("convert needs a reader opened with an adapter")
    num_experts, hidden, inter = reader.adapter.expert_dims(reader.config)
    projections = []
    for e in range(num_experts):
        for proj in EXPERT_PROJS:
            name = f"{prefix}.{e}.{proj}"
            if fused:
                rows, cols = projection_shape(proj, hidden, inter)
                whole = f"{prefix}.{FUSED_DOWN if proj == FUSED_DOWN else FUSED_GATE_UP}"
                per_expert = reader.tensor_spec(whole).shape[1]
                first = inter if proj == "up_proj" else 0
                weight = source(whole, (e * per_expert + first) * cols, (rows, cols))
                scale = None
            else:
                kind = next(k for k in weight_kinds(fmt) if f"{name}.{k}" in reader)
                weight = source(f"{name}.{kind}")
                scale = source(f"{name}.{fmt.scale_name}") if fmt.scale_name else None
            projections.append(_Projection(name, weight, scale, fmt))
    return projections


def _write(
    reader: CheckpointReader, plan: _Plan, dst: WeightFormat, partial: Path, progress: bool
) -> tuple[int, int]:
    """Write every output file; returns (source bytes read, projections converted)."""
    block = _block_size(reader.config)
    headers = plan.headers
    total = sum(e.end - e.begin for entries in headers.values() for e in entries.values())
    with contextlib.ExitStack() as stack:
        fds = {}
        for file in plan.files:
            fds[file] = os.open(reader.path / file, os.O_RDONLY)
            stack.callback(os.close, fds[file])
        writers = {
            file: stack.enter_context(
                ShardWriter(
                    partial / file,
                    [(n, spec) for n, (_, spec) in sorted(items.items(), key=lambda kv: kv[1][0])],
                )
            )
            for file, items in plan.files.items()
        }
        bar = stack.enter_context(
            tqdm(total=total, unit="B", unit_scale=True, desc="copy", disable=not progress)
        )
        for name, file in plan.copies:
            entry = headers[file][name]
            writers[file].copy(name, fds[file], entry)
            bar.update(entry.end - entry.begin)
        converted = 0
        for layer, projections in plan.layers:
            bar.set_description(layer.prefix)
            for proj in projections:
                converted += 1
                bar.update(_convert_one(layer, proj, fds, writers, dst, block))
        for writer in writers.values():
            writer.close()
    return total, converted


def _convert_one(
    layer: MoELayer,
    proj: _Projection,
    fds: Mapping[str, int],
    writers: Mapping[str, ShardWriter],
    dst: WeightFormat,
    block: tuple[int, int],
) -> int:
    """Requantize one projection into its output files; returns the source bytes read."""
    src = proj.src
    weight = read_tensor(
        fds[proj.weight.file], proj.weight.entry, proj.weight.start, proj.weight.shape
    )
    scale = None
    if proj.scale is not None:
        scale = read_tensor(fds[proj.scale.file], proj.scale.entry)
        if src is WeightFormat.FP8_BLOCK and dst.is_mx and not quant.is_power_of_two(scale):
            quant.warn_not_power_of_two(layer.prefix, option_hint="--to fp8_block")
    new_weight, new_scale = quant.requantize(weight, scale, src, dst, block, name=proj.name)
    writers[proj.weight.file].write(f"{proj.name}.{WEIGHT}", new_weight)
    scale_file = proj.scale.file if proj.scale is not None else proj.weight.file
    writers[scale_file].write(f"{proj.name}.{dst.scale_name}", new_scale)
    read = weight.numel() * weight.element_size()
    return read + (0 if scale is None else scale.numel() * scale.element_size())


def _finish(
    reader: CheckpointReader, plan: _Plan, config: Mapping[str, object], partial: Path
) -> int:
    """Write the index, config and the source's other files; returns the tensor file bytes."""
    sizes = {f: (partial / f).stat().st_size for f in plan.files}
    index_path = reader.path / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        metadata = dict(index.get("metadata") or {})
        metadata["total_size"] = sum(
            spec.nbytes for items in plan.files.values() for _, spec in items.values()
        )
        weight_map = {n: f for f, items in plan.files.items() for n in items}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    skip = {CONFIG_FILE, INDEX_FILE, *plan.files}
    for path in sorted(reader.path.iterdir()):
        if path.is_file() and path.name not in skip:
            shutil.copy2(path, partial / path.name)
    return sum(sizes.values())
