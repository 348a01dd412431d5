"""Read Hugging Face checkpoint directories tensor by tensor, validated before any data is read.

A checkpoint is ``config.json`` plus ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Routed experts stored fused (``experts.gate_up_proj``
(E, 2I, H), gate rows first, and ``experts.down_proj`` (E, H, I), as transformers'
``save_pretrained(save_original_format=False)`` writes them) read as their per-expert
projections ``experts.{e}.{gate,up,down}_proj.weight``: slices of the fused tensors, so
a rank reads only its own experts.

Opening a checkpoint with its adapter (``open_checkpoint``; every command and the loading
API do) validates it once, the same way for every caller, before any tensor data is read:

1. ``config.json``: a JSON object the adapter parses, every size within the bounds of
   ``megamoe.core.checkpoint.hf_config.SIZE_BOUNDS`` and valid for the kernel (hidden and
   intermediate sizes multiples of 128);
2. the files (``megamoe.core.checkpoint.files``): names confined to the directory, every
   header parsed by safetensors, the index and the shards in agreement;
3. every expert tensor of every MoE layer (routed, shared, MTP): a name the layer's format
   has, an expert index below the config's expert count, the dtype and shape the config
   implies, and every expert complete.

Data checks (NaN/inf, block-FP8 scales that are zero or negative) happen where data is
read: while loading and converting.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from megamoe.core.checkpoint import nvfp4
from megamoe.core.checkpoint.expert_names import (
    EXPERT_PROJS,
    FUSED_DOWN,
    FUSED_GATE_UP,
    MAX_INDEX_DIGITS,
    WEIGHT,
    TensorSpec,
    checkpoint_kinds,
    parse_expert_name,
    parse_single_name,
    projection_shape,
    projection_specs,
    required_kinds,
    weight_kinds,
)
from megamoe.core.checkpoint.files import (
    CONFIG_FILE,
    INDEX_FILE,
    REDOWNLOAD,
    SINGLE_FILE,
    CheckpointFiles,
    confined,
    refuse_duplicate_keys,
    unreadable_json,
)
from megamoe.core.checkpoint.hf_config import (
    MoEConfig,
    defaulted_keys,
    defaults_note,
    dense_cause,
    key_text,
    mtp_count_key,
    mtp_count_text,
)
from megamoe.core.checkpoint.layers import (
    MLP,
    ModelRules,
    MoELayer,
    SharedExpert,
    decoder_prefix,
)
from megamoe.core.errors import (
    CheckpointError,
    NoMoELayerError,
    UnsupportedCheckpointError,
    format_keys,
)
from megamoe.core.numerics.formats import (
    BLOCK_FP8_DEFAULT,
    UNQUANTIZED_DTYPES,
    WeightFormat,
    check_kernel_dims,
    loads_unquantized,
)

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointReader",
    "FusedPiece",
    "read_config",
]
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KB
# Unquantized float dtypes other than BF16 that a checkpoint may store (training output).
OTHER_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})
_T = TypeVar("_T")
# Modules of an MoE block (routed experts, router, shared expert and its gate); a dense
# MLP has gate_proj, up_proj and down_proj only.
MOE_MODULES = frozenset(
    {"experts", "gate", "shared_expert", "shared_experts", "shared_expert_gate"}
)
# The index is bounded for int() (CheckpointFiles refuses longer ones before this runs).
_MLP_MODULE = re.compile(
    rf"^(?P<stack>.+?)\.(?P<index>\d{{1,{MAX_INDEX_DIGITS}}})\.mlp\.(?P<module>[^.]+)\."
)


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory.

    ``config.json`` may be a symlink leading inside the checkpoint (or, for a Hugging Face
    cache snapshot, its repository's ``blobs/``), as its shards may (``files.confined``).

    Raises:
        CheckpointError: the directory or its config is missing, leads outside the
            checkpoint, or is not a JSON object.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a Hugging Face checkpoint dir")
    config_path = path / CONFIG_FILE
    if not os.path.lexists(config_path):
        raise CheckpointError(f"{path}: no {CONFIG_FILE}; expected a Hugging Face checkpoint dir")
    source = confined(config_path, CONFIG_FILE, f"put the model's {CONFIG_FILE} there")
    try:
        size = source.stat().st_size
    except OSError as err:
        raise CheckpointError(f"{config_path}: cannot be read ({err.strerror})") from None
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(
            f"{config_path}: larger than {MAX_CONFIG_BYTES} bytes; not a model config"
        )
    try:
        config = json.loads(source.read_bytes(), object_pairs_hook=refuse_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, CheckpointError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    except (RecursionError, ValueError) as err:
        raise CheckpointError(f"{config_path}: {unreadable_json(err)}") from None
    except OSError as err:
        raise CheckpointError(f"{config_path}: cannot be read ({err.strerror})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


class CheckpointReader:
    """A checkpoint directory: ``config.json`` plus one or more safetensors files.

    Tensors are read one at a time through ``safe_open``; no file is read whole. Opened
    with an adapter, the whole checkpoint is validated first (see the module docstring).

    Args:
        path: the checkpoint directory.
        adapter: the model's adapter; given, the reader knows the MoE layers and checks
            every expert tensor's name, dtype and shape against the config.

    Attributes:
        config: the parsed ``config.json``.
        files: the validated safetensors files.
        weight_map: tensor name -> file name.
        adapter: the adapter given, or None.
        layers: the adapter's MoE layers (empty without an adapter).

    Raises:
        CheckpointError: a missing, unsafe or unreadable config, index or shard file, an
            invalid or out-of-bounds config key, files that disagree, or expert tensors
            that do not match the config.
        UnsupportedCheckpointError: a setting megamoe cannot run, e.g. a layer's
            quantization method (a ``CheckpointError`` and a ``NotImplementedError``).
    """

    def __init__(self, path: str | Path, adapter: ModelRules | None = None) -> None:
        self.path = Path(path)
        self.config = read_config(self.path)
        self.adapter = adapter
        cfg = None if adapter is None else self._config_checked(adapter.parse_config)
        if adapter is not None:  # bounded sizes before any loop they drive
            _, hidden, inter = self._config_checked(adapter.expert_dims)
            with self._defaults_named(cfg):
                try:
                    check_kernel_dims(hidden, inter)
                except ValueError as err:
                    raise CheckpointError(
                        f"{self.path / CONFIG_FILE}: {err}; this model cannot run on MegaMoE"
                    ) from None
        self.files = CheckpointFiles(self.path)
        self.weight_map = self.files.weight_map
        self.layers: list[MoELayer] = []
        nothing: NoMoELayerError | None = None
        if adapter is not None:
            try:
                self.layers = self._config_checked(adapter.moe_layers, self.weight_map.keys())
            except NoMoELayerError as err:
                nothing = err  # after the check that names experts under a dense layer
        self._expert_layers = {
            prefix: layer
            for layer in self.layers
            for prefix in (adapter.expert_prefixes(layer) if adapter else ())
        }
        self._groups = self._group_names()
        with self._defaults_named(cfg):
            if adapter is not None and cfg is not None:
                self._check_undeclared(adapter, cfg)
            if nothing is not None:
                raise nothing
            for layer in self.layers:
                self.check_layer(layer)

    @contextmanager
    def _defaults_named(self, cfg: MoEConfig | None) -> Iterator[None]:
        """A ``CheckpointError`` raised inside names the size keys taken as defaults."""
        try:
            yield
        except CheckpointError as err:
            defaulted = defaulted_keys(cfg) if cfg is not None else {}
            if not defaulted or isinstance(err, UnsupportedCheckpointError):
                raise
            model = getattr(cfg, "model_type", None) or "model"
            unnamed = {k: v for k, v in defaulted.items() if k not in str(err)}
            note = defaults_note(unnamed, model)
            if not note:
                raise
            raise type(err)(f"{err}; {note}") from None

    def _check_undeclared(self, adapter: ModelRules, cfg: MoEConfig) -> None:
        """Refuse MoE tensors under a layer the config's own rule makes dense or leaves out.

        Routed experts, a router or a shared expert (``MOE_MODULES``) under a decoder layer's
        or MTP layer's MLP that is not one of the config's MoE layers would be passed over:
        the model would run without them.
        """
        decoder = decoder_prefix(self.config, self.weight_map.keys())
        declared = {layer.prefix for layer in self.layers} | {
            adapter.mtp_block_prefix(cfg, decoder, j) for j in range(cfg.num_nextn_predict_layers)
        }
        stacks = {decoder, adapter.mtp_block_prefix(cfg, decoder, 0).rsplit(".", 2)[0]}
        undeclared: dict[str, tuple[str, int]] = {}  # name -> its block and layer index
        for name in self.weight_map:  # one pass, no sort of every name: the first offender
            match = _MLP_MODULE.match(name)
            if match is None or match["stack"] not in stacks or match["module"] not in MOE_MODULES:
                continue
            block = f"{match['stack']}.{match['index']}.{MLP}"
            if block not in declared:
                undeclared[name] = (block, int(match["index"]))
        if undeclared:
            name = min(undeclared)
            block, index = undeclared[name]
            raise CheckpointError(
                f"{self.path / CONFIG_FILE}: {block} holds MoE tensors (e.g. {name!r}), "
                + _undeclared_why(adapter, cfg, decoder, block, index)
            )

    def _config_checked(self, read: Callable[..., _T], *args: Any) -> _T:
        """``read(config, *args)``, its config errors as ``CheckpointError`` naming the file.

        An invalid key (``ValueError``) becomes a ``CheckpointError``, a setting megamoe
        cannot run (``NotImplementedError``) an ``UnsupportedCheckpointError`` (both).
        """
        try:
            return read(self.config, *args)
        except CheckpointError as err:
            message = str(err)
            if message.startswith(f"{CONFIG_FILE}: "):  # e.g. NoMoELayerError: name the file
                where = f"{self.path / CONFIG_FILE}: "
                raise type(err)(where + message.removeprefix(f"{CONFIG_FILE}: ")) from None
            raise
        except (ValueError, NotImplementedError) as err:
            kind = CheckpointError if isinstance(err, ValueError) else UnsupportedCheckpointError
            message = str(err).removeprefix(f"{CONFIG_FILE}: ")
            raise kind(f"{self.path / CONFIG_FILE}: {message}") from None
        except (TypeError, AttributeError, KeyError, re.error) as err:  # a value of a wrong type
            raise CheckpointError(
                f"{self.path / CONFIG_FILE}: a value of the wrong type or form "
                f"({type(err).__name__}: {err}); check the keys against the model's config"
            ) from None

    def _group_names(self) -> dict[str, list[str]]:
        """Names under each expert prefix (routed and shared), relative to it, in one pass."""
        prefixes = set(self._expert_layers)
        if self.adapter is not None:
            for layer in self.layers:
                shared = self.adapter.shared_expert(self.config, layer)
                if shared is not None:
                    prefixes.add(shared.prefix)
        groups: dict[str, list[str]] = {p: [] for p in prefixes}
        for name in self.weight_map:
            parts = name.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                group = groups.get(".".join(parts[:cut]))
                if group is not None:
                    group.append(".".join(parts[cut:]))
                    break
        return {p: sorted(names) for p, names in groups.items()}

    def tensor_names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``, as it lies in the checkpoint directory.

        Raises:
            CheckpointError: no such tensor in the checkpoint.
        """
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        return self.path / file

    def source_of(self, name: str) -> Path:
        """The file ``iter_tensors`` reads tensor ``name`` from (a fused tensor's, for a piece).

        Raises:
            CheckpointError: no such tensor in the checkpoint.
        """
        piece = self.fused_piece(name)
        return self.file_of(name if piece is None else piece.stored)

    def tensor_spec(self, name: str) -> TensorSpec:
        """Dtype and shape of tensor ``name`` as its file's header gives them.

        Raises:
            CheckpointError: the tensor is unknown.
        """
        return self.files.spec(name)

    def expert_layer(self, name: str) -> tuple[MoELayer, str] | None:
        """The MoE layer whose routed experts include ``name``, and the name relative to them."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            layer = self._expert_layers.get(".".join(parts[:cut]))
            if layer is not None:
                return layer, ".".join(parts[cut:])
        return None

    def _mismatch(self, name: str, got: TensorSpec, want: TensorSpec, what: str) -> None:
        """Raise naming the file and tensor when ``got`` differs from ``want``."""
        if want.dtype == torch.bfloat16 and got.dtype in OTHER_FLOATS:
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has dtype {got.dtype}; megamoe reads "
                "unquantized expert weights in bfloat16 only (MegaMoE runs BF16 or quantized "
                "experts): save the checkpoint in bfloat16 first (transformers: "
                "from_pretrained(..., dtype=torch.bfloat16), then save_pretrained)"
            )
        if got.dtype != want.dtype:
            found = f"has dtype {got.dtype}, expected {want.dtype}"
        elif not want.accepts(got):
            found = f"has shape {got.shape}, expected {want.shape}"
        else:
            return
        raise CheckpointError(
            f"{self.file_of(name)}: tensor {name!r} {found} for {what} per {CONFIG_FILE}; the "
            "weights do not match the config: fix config.json or use the checkpoint it "
            "belongs to"
        )

    def check_layer(self, layer: MoELayer) -> None:
        """Check every expert tensor of ``layer`` from the headers (the reader does at open).

        Routed experts (the first of ``expert_prefixes(layer)``): every name under the
        prefix is an expert tensor of the layer's format (``{e}.{proj}.{kind}``, or fused
        BF16) with ``e`` below the config's expert count and the dtype and shape the config
        implies, and every expert has every projection. The shared expert
        (``adapter.shared_expert``), when the model has one, likewise; and the router's
        tensors (``adapter.dense_tensors``) are there with their shapes.

        Raises:
            CheckpointError: an unknown or mismatching tensor, or missing ones; the message
                names the file, the tensor and the rule.
            ValueError: the reader has no adapter.
        """
        adapter = self.adapter
        if adapter is None:
            raise ValueError("check_layer needs a reader opened with an adapter")
        num_experts, hidden, inter = adapter.expert_dims(self.config)
        fmt = layer.checkpoint_format
        prefix = adapter.expert_prefixes(layer)[0]
        what = (
            f"{fmt.value} experts with (experts, hidden, intermediate) = "
            f"({num_experts}, {hidden}, {inter})"
        )
        present: dict[tuple[int | None, str], set[str]] = {}
        for rel in self.names_under(prefix):
            full = f"{prefix}.{rel}"
            parsed = parse_expert_name(rel)
            if parsed is not None and parsed.expert is not None and parsed.expert >= num_experts:
                raise CheckpointError(
                    f"{self.file_of(full)}: tensor {full!r} is of expert {parsed.expert}, but "
                    f"{CONFIG_FILE} gives {num_experts} routed experts (ids 0..{num_experts - 1})"
                    "; the checkpoint and its config disagree: fix config.json or use the "
                    "checkpoint it belongs to"
                )
            want = adapter.expected_expert_tensor(self.config, layer, rel)
            if parsed is None or want is None:
                raise CheckpointError(
                    f"{self.file_of(full)}: tensor {full!r} is not a tensor of {fmt.value} "
                    f"routed experts (expected {_routed_pattern(fmt)}); the checkpoint does "
                    f"not match the quantization_config of {CONFIG_FILE}"
                )
            self._mismatch(full, self.tensor_spec(full), want, what)
            present.setdefault((parsed.expert, parsed.proj), set()).add(parsed.kind)
        _check_complete(prefix, fmt, present, range(num_experts), self.files.index or self.path)
        shared = adapter.shared_expert(self.config, layer)
        if shared is not None:
            self._check_shared(shared, hidden)
        dense = adapter.dense_tensors(self.config, layer)
        for name, shape in dense.items():
            self._check_dense(layer, name, shape)
        self._check_no_others(layer, [prefix] + ([] if shared is None else [shared.prefix]), dense)

    def _check_no_others(
        self, layer: MoELayer, prefixes: Sequence[str], dense: Mapping[str, object]
    ) -> None:
        """Refuse a tensor under the MoE block that its block would not load.

        Empty tensors are let through: transformers saves a zero-width shared MLP for a
        model without shared experts, and a block accepts those as nothing to load.
        """
        heads = tuple(f"{p}." for p in prefixes)
        for rel in self.names_under(layer.prefix):
            full = f"{layer.prefix}.{rel}"
            empty = not math.prod(self.tensor_spec(full).shape)
            if full in dense or full.startswith(heads) or empty:
                continue
            known = ", ".join([*(f"{p}.*" for p in prefixes), *dense])
            raise CheckpointError(
                f"{self.file_of(full)}: tensor {full!r} is under the MoE block {layer.prefix} "
                f"but is none of the tensors its block loads ({known}); the checkpoint does "
                f"not match {CONFIG_FILE}: fix the config (e.g. its shared-expert count) or "
                "remove the tensor"
            )

    def _check_dense(self, layer: MoELayer, name: str, shape: tuple[int, ...]) -> None:
        """A router, bias or gate tensor: present, unquantized floats, of ``shape``."""
        if name not in self.weight_map:
            raise CheckpointError(
                f"{self.files.index or self.path}: tensor {name!r} is missing; the MoE layer "
                f"{layer.prefix} that {CONFIG_FILE} declares loads it (shape {shape}): the "
                "checkpoint is incomplete or not this model's"
            )
        got = self.tensor_spec(name)
        if not loads_unquantized(got.dtype):
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has dtype {got.dtype}; megamoe loads it "
                f"unquantized ({UNQUANTIZED_DTYPES}): store it so"
            )
        if got.shape != shape:
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has shape {got.shape}, expected "
                f"{shape} per {CONFIG_FILE}; the weights do not match the config: fix "
                "config.json or use the checkpoint it belongs to"
            )

    def _check_shared(self, shared: SharedExpert, hidden: int) -> None:
        """The shared expert's tensors: names, dtypes, shapes, and all of them present."""
        fmt, inter = shared.checkpoint_format, shared.intermediate_size
        if fmt is WeightFormat.NVFP4:
            raise UnsupportedCheckpointError(
                f"{self.path / CONFIG_FILE}: the shared expert {shared.prefix} is stored as "
                "NVFP4, which megamoe loads for routed experts only; list it in the "
                "quantization_config's ignore list with BF16 weights, or use a checkpoint "
                "whose shared expert is BF16, block-FP8 or MX"
            )
        block = BLOCK_FP8_DEFAULT  # FP8_BLOCK is 128x128 (quant_config detects no other)
        kinds = {*weight_kinds(fmt), *((fmt.scale_name,) if fmt.scale_name else ())}
        pattern = "{gate,up,down}_proj.{" + ",".join(sorted(kinds)) + "}"
        what = f"a {fmt.value} shared expert with (hidden, intermediate) = ({hidden}, {inter})"
        present: dict[str, set[str]] = {}
        for rel in self.names_under(shared.prefix):
            full = f"{shared.prefix}.{rel}"
            single = parse_single_name(rel)
            if single is None or single[1] not in kinds:
                raise CheckpointError(
                    f"{self.file_of(full)}: tensor {full!r} is not a tensor of {what} "
                    f"(expected {pattern}); the checkpoint does not match the "
                    f"quantization_config of {CONFIG_FILE}"
                )
            proj, kind = single
            weight, scale = projection_specs(
                fmt, *projection_shape(proj, hidden, inter), (block[0], block[-1])
            )
            want = weight if kind in weight_kinds(fmt) else scale
            assert want is not None  # kinds holds a scale name only for formats with scales
            self._mismatch(full, self.tensor_spec(full), want, what)
            present.setdefault(proj, set()).add(kind)
        missing = [
            f"{proj}.{kind}"
            for proj in EXPERT_PROJS
            for kind, needed in (
                (WEIGHT, not present.get(proj, set()) & set(weight_kinds(fmt))),
                (fmt.scale_name, fmt.scale_name not in present.get(proj, set())),
            )
            if kind is not None and needed
        ]
        if missing:
            raise CheckpointError(
                f"{self.path}: {len(missing)} tensor(s) of the shared expert {shared.prefix} "
                f"are missing, e.g. {format_keys(missing)}; {CONFIG_FILE} declares {what}, "
                f"stored as {pattern}; {REDOWNLOAD}"
            )

    def names_under(self, prefix: str) -> list[str]:
        """Names of the tensors under ``prefix + "."``, relative to it, sorted."""
        if prefix in self._groups:
            return list(self._groups[prefix])
        head = prefix + "."
        return sorted(n[len(head) :] for n in self.weight_map if n.startswith(head))

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a per-expert projection of a fused checkpoint: its slice).

        Raises:
            CheckpointError: no such tensor, or the file fails to read.
        """
        piece = self.fused_piece(name)
        stored = name if piece is None else piece.stored
        file = self.file_of(stored).name
        empty = self._empty(name, piece)
        if empty is not None:
            return empty
        try:
            with safe_open(self.files.resolved(file), framework="pt") as f:
                return _read(f, name, piece)
        except Exception as err:
            raise CheckpointError(
                f"{self.path / file}: reading tensor {name!r} failed ({err})"
            ) from None

    def _empty(self, name: str, piece: FusedPiece | None) -> torch.Tensor | None:
        """Tensor ``name`` built from its header when it holds no element, else None.

        An empty tensor has nothing to read, and safetensors' reader is not trusted with
        the huge dimensions an empty tensor may declare (the header check bounds them).
        """
        if piece is not None:
            return None
        spec = self.files.spec(name)
        return None if math.prod(spec.shape) else torch.empty(spec.shape, dtype=spec.dtype)

    def read_projection(
        self, stem: str, fmt: WeightFormat
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One projection's weight and the ``scale`` that ``quant.dequantize`` takes for it.

        Args:
            stem: the projection, e.g. ``model.layers.3.mlp.experts.5.up_proj``.
            fmt: how the checkpoint stores it.

        Returns:
            The weight under whichever name ``fmt`` allows (``weight_packed`` too; the slice
            of a fused tensor) and its scale: None for BF16, the scale tensor, or for NVFP4
            the float32 block scales with the global scale applied (ModelOpt
            ``weight_scale_2`` or compressed-tensors ``weight_global_scale``).

        Raises:
            CheckpointError: a tensor is missing or fails to read.
        """
        parts: dict[str, torch.Tensor] = {}
        for names in required_kinds(fmt):
            kind = next((k for k in names if f"{stem}.{k}" in self), names[0])
            half = nvfp4.loaded_half(kind, self.get_tensor(f"{stem}.{kind}"), f"{stem}.{kind}")
            if half is not None:
                parts[WEIGHT if kind in weight_kinds(fmt) else half[0]] = half[1]
        return parts[WEIGHT], nvfp4.shard_scale(fmt, parts, stem)

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

        The reader validated every header when it was opened.

        Args:
            prefix: e.g. ``model.layers.3.mlp.experts``.
            keep: called with the name relative to the prefix; tensors it rejects are
                never read.

        Yields:
            ``(name relative to prefix, tensor)``.

        Raises:
            CheckpointError: a file fails to read.
        """
        head = prefix + "."
        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            if not name.startswith(head):
                continue
            pieces = self._expand_fused(name) or [name]
            kept = [p for p in pieces if keep is None or keep(p[len(head) :])]
            if kept:
                by_file.setdefault(file, []).extend(kept)
        for file, names in sorted(by_file.items()):
            path = self.path / file
            try:
                with safe_open(self.files.resolved(file), framework="pt") as f:
                    for name in sorted(names):
                        piece = self.fused_piece(name)
                        empty = self._empty(name, piece)
                        yield name[len(head) :], _read(f, name, piece) if empty is None else empty
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


def _routed_pattern(fmt: WeightFormat) -> str:
    """The routed-expert tensor names of ``fmt``, for messages."""
    kinds = set(checkpoint_kinds(fmt))
    pattern = "{e}.{gate,up,down}_proj.{" + ",".join(sorted(kinds)) + "}"
    if fmt is WeightFormat.BF16:
        pattern += f" or fused {FUSED_GATE_UP} / {FUSED_DOWN}"
    return pattern


def _check_complete(
    prefix: str,
    fmt: WeightFormat,
    present: dict[tuple[int | None, str], set[str]],
    experts: Iterable[int],
    index: Path,
) -> None:
    """Raise unless every expert has its weight (and scale) for every projection."""
    fused = [p for p in (FUSED_GATE_UP, FUSED_DOWN) if (None, p) in present]
    if fused and len(fused) < len(present):
        per_expert = sorted(f"{e}.{proj}" for e, proj in present if e is not None)
        raise CheckpointError(
            f"{index}: {prefix} holds fused {format_keys(fused)} and per-expert tensors "
            f"(e.g. {format_keys(per_expert[:3])}); store the experts one way: fused or per "
            "expert"
        )
    if fused:
        missing = [p for p in (FUSED_GATE_UP, FUSED_DOWN) if (None, p) not in present]
    else:
        required = required_kinds(fmt)
        for (e, proj), kinds in sorted(present.items(), key=lambda kv: str(kv[0])):
            for names in required:
                both = sorted(kinds & set(names))
                if len(both) > 1:
                    raise CheckpointError(
                        f"{index}: {prefix}.{e}.{proj} has both {format_keys(both)}, two names "
                        "for one tensor that loading and the reference could each read "
                        "differently: keep one of them"
                    )
        missing = [
            f"{e}.{proj}.{names[0]}"
            for e in experts
            for proj in EXPERT_PROJS
            for names in required
            if not present.get((e, proj), set()) & set(names)
        ]
    if missing:
        where = f"{index.parent} ({index.name})" if index.is_file() else f"{index} ({SINGLE_FILE})"
        needs = " and ".join(" or ".join(names) for names in required_kinds(fmt))
        raise CheckpointError(
            f"{where}: {len(missing)} routed-expert tensor(s) of {prefix} are missing "
            f"from the checkpoint, e.g. "
            f"{format_keys(missing)}; a {fmt.value} expert needs {needs} for gate, up and down"
        )


def _undeclared_why(
    adapter: ModelRules, cfg: MoEConfig, decoder: str, block: str, index: int
) -> str:
    """Why MoE block ``block`` is no MoE layer of ``cfg``, and the fix (message tail)."""
    passed = "megamoe would pass over them and an engine would serve the model without them"
    layers = cfg.num_hidden_layers
    if block == f"{decoder}.{index}.{MLP}" and index < layers and not cfg.is_moe_layer(index):
        cause, fix = dense_cause(cfg, index)
        return (
            f"but decoder layer {index} is dense by {cause}, so {passed}; {fix}, or use the "
            "config this checkpoint belongs to (a dense layer holds no experts, router or "
            "shared expert)"
        )
    count = cfg.num_nextn_predict_layers
    key = mtp_count_key(cfg)
    for j in (index, index - layers):
        if j >= count and adapter.mtp_block_prefix(cfg, decoder, j) == block:
            return (
                f"of MTP layer {j}, but {mtp_count_text(cfg)} counts {count} MTP layer(s), so "
                f"{passed}; set {key} to {j + 1} in config.json, or remove the tensors"
            )
    counted = key_text("num_hidden_layers", layers, defaulted_keys(cfg))
    return (
        f"but it is no layer config.json declares ({counted}, "
        f"{mtp_count_text(cfg)}), so {passed}; fix the layer counts in config.json, or use "
        "the config this checkpoint belongs to"
    )
