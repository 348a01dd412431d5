"""Offline conversion of a checkpoint's routed experts to a kernel format.

``convert_checkpoint`` writes a checkpoint whose routed experts are stored in the target
format, requantized by ``quant.requantize`` — the function the online load path uses — so
loading the converted checkpoint gives kernel weights byte-identical to loading the original
with online requantization. Every other tensor is copied byte for byte; tensor names and
the assignment of tensors to shard files stay the same (fused BF16 experts become
per-expert tensors in the same shard). Work streams one projection at a time with plain
reads and positioned writes, so memory stays near one projection whatever the checkpoint
size. The source is validated as every command validates it (``open_checkpoint``) before
anything is written, and tensors are copied from its validated headers. Output goes to
``OUT.partial-<pid>`` and is renamed to ``OUT`` only once complete; how that directory is
written, and which other files are copied, is ``megamoe.core.checkpoint.convert_output``.
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

import torch
from tqdm import tqdm

from megamoe.core.adapters import ModelAdapter, open_checkpoint
from megamoe.core.checkpoint import nvfp4
from megamoe.core.checkpoint.convert_output import (
    ACTIVE_PARTIALS,
    copy_other_files,
    partial_path,
    plain_name,
    remove_stale_partials,
    write_new,
)
from megamoe.core.checkpoint.expert_names import (
    CT_GLOBAL_SCALE,
    EXPERT_PROJS,
    FUSED_DOWN,
    FUSED_GATE_UP,
    GLOBAL_SCALE,
    INPUT_SCALES,
    WEIGHT,
    TensorSpec,
    parse_expert_name,
    parse_single_name,
    projection_shape,
    projection_specs,
    weight_kinds,
)
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.checkpoint.quant_config import unmark_converted
from megamoe.core.checkpoint.reader import CONFIG_FILE, INDEX_FILE, CheckpointReader
from megamoe.core.checkpoint.shardfile import (
    ShardWriter,
    TensorEntry,
    read_tensor,
)
from megamoe.core.errors import CheckpointError, NonFiniteError, UsageError, note_source
from megamoe.core.loading.finiteness import check_block_scales, count_nonfinite, mx_scale_limit
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat
from megamoe.core.numerics.mx_codes import UE8M0_DTYPES, as_ue8m0_bytes


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
    """One expert projection to requantize: ``{name}.weight`` and ``{name}.<scale>``.

    NVFP4 projections also have their global scale (``global_scale``, under its checkpoint
    name); their input scales are left out of the output (the run formats have none).
    """

    name: str
    weight: _Source
    scale: _Source | None
    src: WeightFormat
    global_scale: tuple[str, _Source] | None = None


@dataclass
class _Plan:
    """Output files (name -> ordered tensors), tensors to copy, projections per layer."""

    headers: dict[str, dict[str, TensorEntry]]
    files: dict[str, dict[str, tuple[tuple[int, int], TensorSpec]]]
    copies: list[tuple[str, str]] = field(default_factory=list)
    layers: list[tuple[MoELayer, list[_Projection]]] = field(default_factory=list)
    # Expert tensors copied unchanged (routed and shared), by their stored format, checked as
    # they are copied: no NaN or infinity, no scale whose block overflows, as loading checks.
    checked_copies: dict[str, WeightFormat] = field(default_factory=dict)
    # Shared experts stored unlike the routed ones: they run apart, in their stored format,
    # online too, so they are copied as they are (offline equals online).
    stored_apart: list[str] = field(default_factory=list)


def convert_checkpoint(
    src: str | Path, out: str | Path, to: WeightFormat | str, *, progress: bool = True
) -> ConvertResult:
    """Write a copy of checkpoint ``src`` at ``out`` with its routed experts in format ``to``.

    Everything is written inside ``OUT.partial-<pid>`` (created with ``mkdir`` next to
    ``out``), each file created new with ``O_EXCL | O_NOFOLLOW`` under a single plain file
    name, and the directory is renamed to ``out`` only once complete; on any error it is
    removed. A partial directory left by a convert whose process is gone is removed first,
    with a warning naming it. Besides the converted shards, the index and ``config.json``,
    the source's other regular files are copied by content (symlinks followed within the
    checkpoint directory and its Hugging Face cache); weight files the index does not
    name, directories, FIFOs, devices and symlinks leading outside the checkpoint are left
    out with a warning naming them.

    Args:
        src: the source checkpoint directory.
        out: the directory to create; it must not exist, its parent must.
        to: MXFP8, MXFP4 or FP8_BLOCK.
        progress: show a progress bar (bytes) on stderr.

    Returns:
        Sizes and timing of the conversion.

    Raises:
        FileExistsError: ``out`` exists, or another convert (a running process) is writing
            it, or a file appeared at a name convert was about to create.
        FileNotFoundError: the parent directory of ``out`` does not exist.
        OSError: reading or writing failed (no space, permissions, ...); the message names
            the file.
        UsageError: ``out`` lies inside ``src`` (a ``ValueError``).
        ValueError: ``to`` is not a conversion target, or a shard file name is not a plain
            file name.
        CheckpointError: the source is incomplete or inconsistent (checked from the headers
            of every expert tensor before anything is written), or a router, bias or gate
            tensor of an MoE layer holds NaN or infinity.
        LookupError: no installed adapter handles the model.
        NotImplementedError: the adapter cannot convert, or a layer's quantization method
            is not supported.
    """
    dst = WeightFormat.parse(to)
    if dst not in quant.TARGET_FORMATS:
        targets = ", ".join(f.value for f in quant.TARGET_FORMATS)
        raise ValueError(f"--to {dst.value}: convert writes one of {targets}")
    out = Path(out)
    if os.path.lexists(out):
        raise FileExistsError(f"{out} already exists; remove it or choose another output path")
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"{out.parent}: the output's parent directory does not exist; create it "
            f"(mkdir -p {out.parent}) or choose another output path"
        )
    source = Path(src).resolve()
    if out.parent.resolve().is_relative_to(source):
        raise UsageError(
            f"{out}: the output lies inside the checkpoint {src}, which it would then contain; "
            "choose an output path outside it"
        )
    remove_stale_partials(out)
    start = time.perf_counter()
    reader, adapter = open_checkpoint(src)
    plan = _plan(reader, adapter, dst)
    _check_dense_finite(reader)
    config = adapter.converted_config(reader.config, dst, reader.layers)
    if plan.stored_apart:  # left as stored: not converted
        config["quantization_config"] = unmark_converted(
            config["quantization_config"], plan.stored_apart
        )
    for file in plan.files:
        plain_name(file, reader.path)
    partial = partial_path(out, os.getpid())
    try:
        partial.mkdir()
    except FileExistsError:
        raise FileExistsError(
            f"{partial} appeared after convert started (nothing was written through it); "
            "remove it and run convert again"
        ) from None
    ACTIVE_PARTIALS.add(os.path.abspath(partial))
    try:
        source_bytes, converted = _write(reader, plan, dst, partial, progress)
        written = _finish(reader, plan, config, partial)
        if os.path.lexists(out):  # rename would replace an empty directory made meanwhile
            raise FileExistsError(f"{out} appeared while converting; the result was discarded")
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        ACTIVE_PARTIALS.discard(os.path.abspath(partial))
    return ConvertResult(
        out, dst, source_bytes, written, converted, len(plan.copies), time.perf_counter() - start
    )


def _check_dense_finite(reader: CheckpointReader) -> None:
    """The MoE layers' router, bias and gate tensors, copied as they are, hold no NaN or inf.

    Loading refuses them; convert reads them (small beside the experts) so that it refuses
    the checkpoint before writing anything, as it does for expert tensors.

    Raises:
        CheckpointError: names the tensor and its file.
    """
    assert reader.adapter is not None  # open_checkpoint found it
    for layer in reader.layers:
        for name in reader.adapter.dense_tensors(reader.config, layer):
            if count_nonfinite(reader.get_tensor(name)):
                raise CheckpointError(
                    f"{reader.file_of(name)}: tensor {name!r} holds NaN or infinity; fix the "
                    "checkpoint"
                )


def _plan(reader: CheckpointReader, adapter: ModelAdapter, dst: WeightFormat) -> _Plan:
    """Lay out every output file and list the work, from headers only."""
    headers = {f: reader.files.entries(f) for f in reader.files.files}  # validated at open
    plan = _Plan(headers, files={f: {} for f in headers})
    block = BLOCK_FP8_DEFAULT  # megamoe's FP8_BLOCK: 128x128, the only block it detects
    converted: set[str] = set()

    def source(name: str, start: int = 0, shape: tuple[int, ...] | None = None) -> _Source:
        file = reader.weight_map[name]
        entry = headers[file][name]
        converted.add(name)
        return _Source(file, entry, start, entry.shape if shape is None else shape)

    for layer in reader.layers:
        projections: list[_Projection] = []
        shared = adapter.shared_expert(reader.config, layer)
        for prefix in adapter.expert_prefixes(layer):
            apart = (
                shared is not None
                and shared.prefix == prefix
                and (
                    shared.checkpoint_format is not layer.checkpoint_format
                    or dst not in adapter.fusing_run_formats
                )
            )
            if apart:
                plan.stored_apart.append(prefix)  # runs as a separate MLP: left as stored
            group = [] if apart else _group(reader, layer, prefix, dst, source)
            if not group:  # copied unchanged: still checked
                plan.checked_copies |= dict.fromkeys(
                    (f"{prefix}.{rel}" for rel in reader.names_under(prefix)),
                    layer.checkpoint_format,
                )
            projections += group
        if shared is not None and shared.prefix not in adapter.expert_prefixes(layer):
            plan.checked_copies |= dict.fromkeys(  # a shared MLP beside the experts (Qwen4Exp)
                (f"{shared.prefix}.{rel}" for rel in reader.names_under(shared.prefix)),
                shared.checkpoint_format,
            )
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
        return []  # an optional group this checkpoint lacks (the reader checked the rest)
    if reader.adapter is None:
        raise ValueError("convert needs a reader opened with an adapter")
    shared = reader.adapter.shared_expert(reader.config, layer)
    if shared is not None and shared.prefix == prefix:  # one expert without an index
        fmt = shared.checkpoint_format
        if fmt is dst:
            return []
        kinds = {kind for _, kind in filter(None, map(parse_single_name, names))}
        weight_kind = next(k for k in weight_kinds(fmt) if k in kinds)
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
            global_scale = _global(reader, name, fmt, source)
            projections.append(_Projection(name, weight, scale, fmt, global_scale))
    return projections


def _global(
    reader: CheckpointReader, name: str, fmt: WeightFormat, source: Callable[..., _Source]
) -> tuple[str, _Source] | None:
    """An NVFP4 projection's global scale (kind, source); its input scales taken out."""
    if fmt is not WeightFormat.NVFP4:
        return None
    for kind in INPUT_SCALES:  # the activations' scales: no part of the converted experts
        if f"{name}.{kind}" in reader:
            source(f"{name}.{kind}")
    kind = next(k for k in (GLOBAL_SCALE, CT_GLOBAL_SCALE) if f"{name}.{k}" in reader)
    return kind, source(f"{name}.{kind}")


def _write(
    reader: CheckpointReader, plan: _Plan, dst: WeightFormat, partial: Path, progress: bool
) -> tuple[int, int]:
    """Write every output file; returns (source bytes read, projections converted)."""
    block = BLOCK_FP8_DEFAULT  # megamoe's FP8_BLOCK: 128x128, the only block it detects
    headers = plan.headers
    total = sum(e.end - e.begin for entries in headers.values() for e in entries.values())
    with contextlib.ExitStack() as stack:
        fds = {}
        for file in plan.files:
            fds[file] = os.open(reader.files.resolved(file), os.O_RDONLY)
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
            if name in plan.checked_copies:
                what = f"{reader.path / file}: {name}"
                _check_copied(read_tensor(fds[file], entry), what, plan.checked_copies[name])
            writers[file].copy(name, fds[file], entry)
            bar.update(entry.end - entry.begin)
        converted = 0
        for layer, projections in plan.layers:
            bar.set_description(layer.prefix)
            for proj in projections:
                converted += 1
                bar.update(_convert_one(layer, proj, fds, writers, dst, block, reader.path))
        for writer in writers.values():
            writer.close()
    return total, converted


def _check_copied(tensor: torch.Tensor, what: str, fmt: WeightFormat) -> None:
    """Refuse an expert tensor copied unchanged that loading would refuse.

    Args:
        tensor: the stored tensor.
        what: its file and name, for the message.
        fmt: the stored format of the experts (or shared MLP) it belongs to.

    Raises:
        NonFiniteError: NaN or infinity, or an MX scale whose block decodes to them.
        InvalidScaleError: a block-FP8 scale that is not > 0.
    """
    block_scale = what.endswith(f".{WeightFormat.FP8_BLOCK.scale_name}")
    limit = mx_scale_limit(fmt) if what.endswith(f".{fmt.scale_name}") else None
    if limit is not None and tensor.dtype in UE8M0_DTYPES:
        tensor = as_ue8m0_bytes(tensor, what)
    else:
        limit = None
    bad = count_nonfinite(tensor, ue8m0_from=limit)
    if bad:
        raise NonFiniteError(
            f"{what} holds {bad} non-finite value(s) (NaN/inf, or a scale whose block "
            "overflows float32); megamoe refuses to load it, so convert does not copy it: fix "
            "the checkpoint"
        )
    if block_scale and tensor.is_floating_point():
        check_block_scales(tensor, what)


def _convert_one(
    layer: MoELayer,
    proj: _Projection,
    fds: Mapping[str, int],
    writers: Mapping[str, ShardWriter],
    dst: WeightFormat,
    block: tuple[int, int],
    source_dir: Path,
) -> int:
    """Requantize one projection into its output files; returns the source bytes read.

    Raises:
        NonFiniteError / InvalidScaleError: a bad weight or scale; a non-finite value found
            while requantizing carries a note naming the files under ``source_dir`` that
            the weight (and its scale) were read from.
    """
    src = proj.src
    weight = read_tensor(
        fds[proj.weight.file], proj.weight.entry, proj.weight.start, proj.weight.shape
    )
    scale = None
    if proj.scale is not None:
        scale = read_tensor(fds[proj.scale.file], proj.scale.entry)
        if src is WeightFormat.FP8_BLOCK:
            check_block_scales(scale, f"{proj.scale.file}: {proj.name}.{src.scale_name}")
        if src is WeightFormat.FP8_BLOCK and dst.is_mx and not quant.is_power_of_two(scale):
            quant.warn_not_power_of_two(layer.prefix, option_hint="--to fp8_block", target=dst)
    read = 0 if scale is None else scale.numel() * scale.element_size()
    if proj.global_scale is not None and scale is not None:  # NVFP4: apply the global scale
        kind, where = proj.global_scale
        value = read_tensor(fds[where.file], where.entry)
        multiplier = nvfp4.global_multiplier(kind, value, f"{where.file}: {proj.name}.{kind}")
        scale = nvfp4.nvfp4_block_scale(scale, multiplier, proj.name)
        nvfp4.warn_requantized(layer.prefix, src, dst, option="--to")
        read += value.numel() * value.element_size()
    scale_file = proj.scale.file if proj.scale is not None else proj.weight.file
    try:
        new_weight, new_scale = quant.requantize(weight, scale, src, dst, block, name=proj.name)
    except NonFiniteError as err:
        apart = scale_file != proj.weight.file
        also = f", its {src.scale_name} from {source_dir / scale_file}" if apart else ""
        note_source(err, f"{proj.name}.{WEIGHT}", source_dir / proj.weight.file, also)
        raise
    writers[proj.weight.file].write(f"{proj.name}.{WEIGHT}", new_weight)
    writers[scale_file].write(f"{proj.name}.{dst.scale_name}", new_scale)
    return read + weight.numel() * weight.element_size()


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
        write_new(partial / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    write_new(partial / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    copy_other_files(reader.path, partial, skip={CONFIG_FILE, INDEX_FILE, *plan.files})
    return sum(sizes.values())
