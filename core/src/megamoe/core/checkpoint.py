"""Read Hugging Face checkpoint directories tensor by tensor, checking before reading (SPEC §3.6).

A checkpoint is ``config.json`` plus ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Routed experts stored fused (``experts.gate_up_proj``
(E, 2I, H), gate rows first, and ``experts.down_proj`` (E, H, I), as transformers'
``save_pretrained(save_original_format=False)`` writes them) read as their per-expert
projections ``experts.{e}.{gate,up,down}_proj.weight``: slices of the fused tensors, so
a rank reads only its own experts. Every read first checks the safetensors headers of the
tensors involved (file present and parseable, tensor present, dtype and shape as the
adapter expects from ``config.json``), so a bad checkpoint fails with an error naming the
file and tensor before any of its data is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megamoe.core.adapters import ModelAdapter, MoELayer, adapter_for
from megamoe.core.errors import CheckpointError, format_keys
from megamoe.core.expert_names import (
    EXPERT_PROJS,
    FUSED_DOWN,
    FUSED_GATE_UP,
    WEIGHT,
    TensorSpec,
    parse_expert_name,
    parse_single_name,
    weight_kinds,
)
from megamoe.core.formats import WeightFormat
from megamoe.core.shardfile import dtype_from_safetensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_REDOWNLOAD = "download or copy the checkpoint again"


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory.

    Raises:
        CheckpointError: the directory or its config is missing or not a JSON object.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a Hugging Face checkpoint dir")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}; expected a Hugging Face checkpoint dir")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


class CheckpointReader:
    """A checkpoint directory: ``config.json`` plus one or more safetensors files.

    Tensors are read one at a time through ``safe_open``; no file is read whole.

    Args:
        path: the checkpoint directory.
        adapter: the model's adapter; given, the reader knows the MoE layers and checks
            every routed-expert tensor's dtype and shape against the config before reading.

    Attributes:
        config: the parsed ``config.json``.
        weight_map: tensor name -> file name.
        adapter: the adapter given, or None.
        layers: the adapter's MoE layers (empty without an adapter).

    Raises:
        CheckpointError: a missing or unreadable config, index or shard file.
        NotImplementedError: the adapter refuses the quantization method of a layer.
    """

    def __init__(self, path: str | Path, adapter: ModelAdapter | None = None) -> None:
        self.path = Path(path)
        self.config = read_config(self.path)
        self._headers: dict[str, dict[str, TensorSpec]] = {}
        self.weight_map = self._read_weight_map()
        self.adapter = adapter
        self.layers: list[MoELayer] = (
            [] if adapter is None else adapter.moe_layers(self.config, self.weight_map.keys())
        )
        self._expert_layers = {
            prefix: layer
            for layer in self.layers
            for prefix in (adapter.expert_prefixes(layer) if adapter else ())
        }

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(
                    f"{index}: not a valid index (needs a JSON object with a 'weight_map' "
                    f"object; {type(err).__name__}: {err}); {_REDOWNLOAD}"
                ) from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: 'weight_map' must map tensor names to files")
        elif (self.path / SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(self._header(SINGLE_FILE), SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            if not (self.path / file).is_file():
                raise CheckpointError(
                    f"{self.path / file}: shard file is missing; {INDEX_FILE} names it for "
                    f"{len(names)} tensor(s), e.g. {format_keys(names[:3])}; {_REDOWNLOAD}"
                )
        return weight_map

    def _header(self, file: str) -> dict[str, TensorSpec]:
        """Dtype and shape of every tensor in ``file``, from its header (cached)."""
        if file not in self._headers:
            path = self.path / file
            try:
                with safe_open(path, framework="pt") as f:
                    header = {}
                    for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        piece = f.get_slice(name)
                        header[name] = TensorSpec(
                            dtype_from_safetensors(piece.get_dtype()), tuple(piece.get_shape())
                        )
            except Exception as err:  # safetensors raises its own (Rust) error type
                raise CheckpointError(
                    f"{path}: not a readable safetensors file ({err}); the file is truncated "
                    f"or corrupt: {_REDOWNLOAD}"
                ) from None
            self._headers[file] = header
        return self._headers[file]

    def tensor_names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``.

        Raises:
            CheckpointError: no such tensor in the checkpoint.
        """
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        return self.path / file

    def tensor_spec(self, name: str) -> TensorSpec:
        """Dtype and shape of tensor ``name`` as its file's header gives them.

        Raises:
            CheckpointError: the tensor is unknown, its file unreadable, or the file lacks it.
        """
        file = self.file_of(name).name
        header = self._header(file)
        if name not in header:
            raise CheckpointError(
                f"{self.path / file}: tensor {name!r} is named in {INDEX_FILE} but absent "
                f"from this file; {_REDOWNLOAD}"
            )
        return header[name]

    def expert_layer(self, name: str) -> tuple[MoELayer, str] | None:
        """The MoE layer whose routed experts include ``name``, and the name relative to them."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            layer = self._expert_layers.get(".".join(parts[:cut]))
            if layer is not None:
                return layer, ".".join(parts[cut:])
        return None

    def check_tensors(self, names: Iterable[str]) -> None:
        """Check tensors from their headers alone: present, and as the adapter expects.

        Raises:
            CheckpointError: a tensor is missing from the index or its file, its file is
                unreadable, or a routed-expert tensor's dtype or shape disagrees with the
                config; the message names the file and the tensor.
        """
        for name in names:
            got = self.tensor_spec(name)
            found = self.expert_layer(name)
            if found is None or self.adapter is None:
                continue
            layer, rel = found
            want = self.adapter.expected_expert_tensor(self.config, layer, rel)
            if want is None:
                continue
            what = None
            if got.dtype != want.dtype:
                what = f"has dtype {got.dtype}, expected {want.dtype}"
            elif got.shape != want.shape:
                what = f"has shape {got.shape}, expected {want.shape}"
            if what is not None:
                dims = self.adapter.expert_dims(self.config)
                raise CheckpointError(
                    f"{self.file_of(name)}: tensor {name!r} {what} for "
                    f"{layer.checkpoint_format.value} experts with (experts, hidden, "
                    f"intermediate) = {dims} per {CONFIG_FILE}; the weights do not match the "
                    "config: fix config.json or use the checkpoint it belongs to"
                )

    def check_layer(self, layer: MoELayer, experts: Iterable[int] | None = None) -> None:
        """Check every routed-expert tensor of ``layer`` from headers, before loading it.

        Args:
            layer: one of ``self.layers``.
            experts: only these expert indices (this rank's); None checks all.

        The first of ``expert_prefixes(layer)`` holds the routed experts; further prefixes
        may be absent. A prefix holding one unindexed expert (``{gate,up,down}_proj.*``,
        e.g. a shared expert the kernel runs as an extra expert) is checked for presence.

        Raises:
            CheckpointError: a missing, unreadable or mismatching tensor (see
                ``check_tensors``), a tensor that is no expert tensor of the layer's
                format, or experts whose tensors the index lacks.
            ValueError: the reader has no adapter.
        """
        if self.adapter is None:
            raise ValueError("check_layer needs a reader opened with an adapter")
        num_experts = self.adapter.expert_dims(self.config)[0]
        wanted = set(range(num_experts) if experts is None else experts)
        fmt = layer.checkpoint_format
        for position, prefix in enumerate(self.adapter.expert_prefixes(layer)):
            present: dict[tuple[int | None, str], set[str]] = {}
            names = []
            rels = self.names_under(prefix)
            if position and not rels:
                continue  # an optional extra group (e.g. no shared expert in this model)
            if rels and all(parse_single_name(rel) for rel in rels):
                # One expert without an index (a shared expert): its loader checks it.
                self.check_tensors(f"{prefix}.{rel}" for rel in rels)
                continue
            for rel in rels:
                parsed = parse_expert_name(rel)
                full = f"{prefix}.{rel}"
                if parsed is not None and (parsed.expert is None or parsed.expert in wanted):
                    if self.adapter.expected_expert_tensor(self.config, layer, rel) is None:
                        raise CheckpointError(
                            f"{self.file_of(full)}: tensor {full!r} is not a tensor of "
                            f"{fmt.value} experts ({num_experts} experts); the checkpoint "
                            f"does not match the quantization_config of {CONFIG_FILE}"
                        )
                    present.setdefault((parsed.expert, parsed.proj), set()).add(parsed.kind)
                    names.append(full)
            self.check_tensors(names)
            _check_complete(prefix, fmt, present, sorted(wanted), self.path / INDEX_FILE)

    def names_under(self, prefix: str) -> list[str]:
        """Names of the tensors under ``prefix + "."``, relative to it, sorted."""
        head = prefix + "."
        return sorted(n[len(head) :] for n in self.weight_map if n.startswith(head))

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor after checking its header.

        Raises:
            CheckpointError: see ``check_tensors``, or the file fails to read.
        """
        piece = self.fused_piece(name)
        stored = name if piece is None else piece.stored
        self.check_tensors([stored])
        path = self.file_of(stored)
        try:
            with safe_open(path, framework="pt") as f:
                return _read(f, name, piece)
        except Exception as err:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed ({err})") from None

    def fused_piece(self, name: str) -> FusedPiece | None:
        """Where per-expert projection ``name`` lies when the checkpoint stores it fused.

        Returns:
            The fused tensor and the slice of it, or None when ``name`` is stored as it is
            (or is no routed-expert weight of a fused checkpoint).
        """
        if name in self.weight_map:
            return None
        found = self.expert_layer(name)
        parsed = None if found is None else parse_expert_name(found[1])
        if found is None or parsed is None or parsed.expert is None or parsed.kind != WEIGHT:
            return None
        experts_prefix = name[: -len(found[1]) - 1]
        is_down = parsed.proj == FUSED_DOWN
        stored = f"{experts_prefix}.{FUSED_DOWN if is_down else FUSED_GATE_UP}"
        if stored not in self.weight_map:
            return None
        shape = self.tensor_spec(stored).shape
        if len(shape) != 3 or parsed.expert >= shape[0]:
            return None
        half = shape[1] // 2
        rows = (
            (0, shape[1])
            if is_down
            else (0, half)
            if parsed.proj == "gate_proj"
            else (half, 2 * half)
        )
        return FusedPiece(stored, parsed.expert, rows)

    def _expand_fused(self, name: str) -> list[str]:
        """The per-expert projection names fused tensor ``name`` holds (empty if not fused)."""
        found = self.expert_layer(name)
        parsed = None if found is None else parse_expert_name(found[1])
        if found is None or parsed is None or not parsed.is_fused:
            return []
        experts_prefix = name[: -len(found[1]) - 1]
        shape = self.tensor_spec(name).shape
        projs = ("down_proj",) if parsed.proj == FUSED_DOWN else ("gate_proj", "up_proj")
        return [f"{experts_prefix}.{e}.{proj}.{WEIGHT}" for e in range(shape[0]) for proj in projs]

    def iter_tensors(
        self, prefix: str, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the tensors under ``prefix + "."``, one at a time, file by file.

        The headers of every selected tensor are checked before the first is read.

        Args:
            prefix: e.g. ``model.layers.3.mlp.experts``.
            keep: called with the name relative to the prefix; tensors it rejects are
                never read.

        Yields:
            ``(name relative to prefix, tensor)``.

        Raises:
            CheckpointError: see ``check_tensors``, or a file fails to read.
        """
        head = prefix + "."
        by_file: dict[str, list[str]] = {}
        stored: list[str] = []
        for name, file in self.weight_map.items():
            if not name.startswith(head):
                continue
            pieces = self._expand_fused(name) or [name]
            kept = [p for p in pieces if keep is None or keep(p[len(head) :])]
            if kept:
                stored.append(name)
                by_file.setdefault(file, []).extend(kept)
        self.check_tensors(stored)
        for file, names in sorted(by_file.items()):
            path = self.path / file
            try:
                with safe_open(path, framework="pt") as f:
                    for name in sorted(names):
                        yield name[len(head) :], _read(f, name, self.fused_piece(name))
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{path}: reading tensors failed ({err})") from None


@dataclass(frozen=True)
class FusedPiece:
    """One expert's projection inside a fused expert tensor.

    Attributes:
        stored: the fused tensor's name (``...experts.gate_up_proj`` or ``.down_proj``).
        expert: the expert index (first dimension).
        rows: ``(start, stop)`` rows of that expert's matrix: gate ``[0, I)``, up
            ``[I, 2I)``, down all of its ``H`` rows.
    """

    stored: str
    expert: int
    rows: tuple[int, int]


def _read(f: Any, name: str, piece: FusedPiece | None) -> torch.Tensor:
    """Tensor ``name`` from open file ``f``: whole, or the slice ``piece`` of a fused one."""
    if piece is None:
        return f.get_tensor(name)
    start, stop = piece.rows
    return f.get_slice(piece.stored)[piece.expert : piece.expert + 1, start:stop][0].contiguous()


def _check_complete(
    prefix: str,
    fmt: WeightFormat,
    present: dict[tuple[int | None, str], set[str]],
    experts: list[int],
    index: Path,
) -> None:
    """Raise unless every wanted expert has its weight (and scale) for every projection."""
    if (None, FUSED_GATE_UP) in present or (None, FUSED_DOWN) in present:
        missing = [p for p in (FUSED_GATE_UP, FUSED_DOWN) if (None, p) not in present]
    else:
        kinds = weight_kinds(fmt)
        missing = []
        for e in experts:
            for proj in EXPERT_PROJS:
                got = present.get((e, proj), set())
                if not got & set(kinds):
                    missing.append(f"{e}.{proj}.weight")
                if fmt.scale_name is not None and fmt.scale_name not in got:
                    missing.append(f"{e}.{proj}.{fmt.scale_name}")
    if missing:
        raise CheckpointError(
            f"{index.parent}: {len(missing)} routed-expert tensor(s) of {prefix} are missing "
            f"from the checkpoint ({index.name if index.is_file() else SINGLE_FILE}), e.g. "
            f"{format_keys(missing)}; a {fmt.value} expert needs weight"
            f"{' and ' + fmt.scale_name if fmt.scale_name else ''} for gate, up and down"
        )


def open_checkpoint(path: str | Path) -> tuple[CheckpointReader, ModelAdapter]:
    """Open a checkpoint with the installed adapter that claims its ``config.json``.

    Args:
        path: the checkpoint directory.

    Returns:
        ``(reader, adapter)``; the reader checks expert tensors against the config.

    Raises:
        CheckpointError: a missing or unreadable config, index or shard file.
        LookupError: no installed adapter claims the model; the message lists the
            installed adapters and the pip command for the others.
        NotImplementedError: a layer's quantization method megamoe cannot load.
    """
    adapter = adapter_for(read_config(path))
    return CheckpointReader(path, adapter), adapter
