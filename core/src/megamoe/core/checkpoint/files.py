r"""The safetensors files of a checkpoint directory: names confined to it, headers validated.

A checkpoint holds ``model.safetensors``, or shards that ``model.safetensors.index.json``
names. Everything a checkpoint gives is untrusted input:

- **Names.** Each file name of the index must be a plain file name (one path component:
  no ``/`` or ``\\``, not ``.`` or ``..``, no NUL), so it names a file inside the checkpoint
  directory. That file may be a symlink (Hugging Face's cache links snapshot files to
  ``../../blobs/<hash>``), followed for reading; it must lead to a regular file. Each file
  is resolved once, and every header check and data read uses that resolved path.
- **Headers.** Every shard's header is parsed by safetensors itself (``safe_open``: header
  size, JSON, dtypes, shapes, offsets covering the data section exactly, none
  overlapping), then read again for its byte offsets (``shardfile.read_header``, bounded by
  the size safetensors accepted), which raw copies need.
- **Agreement.** Each tensor the index lists is in the file it names; each tensor of a
  shard is listed, for that shard; no tensor is listed twice or stored in two shards.
- **Size.** The index and the shards together list at most ``MAX_TENSORS`` tensors, each
  file counted (by safetensors) before its header is parsed again here; safetensors itself
  refuses a header over 100 MB, which bounds what one file costs to open.

Every check runs when ``CheckpointFiles`` is built, before any tensor data is read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open

from megamoe.core.checkpoint.expert_names import TensorSpec
from megamoe.core.checkpoint.shardfile import TensorEntry, read_header
from megamoe.core.errors import CheckpointError, format_keys

logger = logging.getLogger("megamoe")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REDOWNLOAD = "download or copy the checkpoint again"
MAX_INDEX_BYTES = 256 << 20  # a real index is a few MB (one line per tensor)
# Tensors a checkpoint may hold, counted before their headers are parsed in Python: a
# header entry kept costs about 1 KB of memory, and a hostile 89 MB header of 1.3 million
# tensors took 2 GB and 28 s to open; GLM-5.3-Flash holds about 80 thousand (by its config).
MAX_TENSORS = 2_000_000


def check_file_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name inside a directory, else raise.

    Args:
        name: a file name a checkpoint gives (an index value).
        where: what gave it, for the message (e.g. ``index.json: weight_map['x']``).

    Raises:
        CheckpointError: not a string, empty, with a directory part, ``.``/``..`` or NUL.
    """
    rule = (
        "must be the plain name of a file inside the checkpoint directory (no '/', '\\', "
        "'..' or absolute path)"
    )
    if not isinstance(name, str):
        raise CheckpointError(
            f"{where} is {type(name).__name__} {name!r}; a shard file name {rule}; the index "
            f"is damaged: {REDOWNLOAD}"
        )
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise CheckpointError(
            f"{where} = {name!r}: a shard file name {rule}; megamoe never reads or writes "
            f"outside the checkpoint: fix the index or {REDOWNLOAD}"
        )
    return name


def refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of the index and config: a key given twice is an error.

    ``json.loads`` alone would keep its last value silently.
    """
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError(
                f"key {key!r} appears twice in one JSON object, where a reader silently takes "
                "one of the two: keep the right one"
            )
        seen[key] = value
    return seen


def unreadable_json(err: RecursionError | ValueError) -> str:
    """Why a JSON file that parsed into no model's config or index was refused."""
    what = (
        "nested too deeply"
        if isinstance(err, RecursionError)
        else "holding an integer of thousands of digits"
    )
    return f"JSON {what}, which no model's config or index is"


class CheckpointFiles:
    """The validated safetensors files of one checkpoint directory.

    Args:
        path: the checkpoint directory.

    Attributes:
        path: the directory.
        index: the index file, None for a single-file checkpoint.
        weight_map: tensor name -> file name (as the index gives it; validated).

    Raises:
        CheckpointError: an unsafe or missing file name, an unreadable or damaged file or
            index, or an index that disagrees with the shards (each named, with its file).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / INDEX_FILE
        self.index: Path | None = index if index.is_file() else None
        self._resolved: dict[str, Path] = {}
        self._entries: dict[str, dict[str, TensorEntry]] = {}
        if self.index is not None:
            self.weight_map = self._read_index(self.index)
            if (path / SINGLE_FILE).is_file() and SINGLE_FILE not in self.weight_map.values():
                logger.warning(
                    "%s: both %s and %s are present; megamoe reads the shards the index names "
                    "(transformers reads %s): remove the stale one",
                    path, INDEX_FILE, SINGLE_FILE, SINGLE_FILE,
                )  # fmt: skip
        elif (path / SINGLE_FILE).is_file():
            self.weight_map = dict.fromkeys(self.entries(SINGLE_FILE), SINGLE_FILE)
        else:
            raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        self._check_agreement()

    @property
    def files(self) -> list[str]:
        """The shard file names, sorted."""
        return sorted(set(self.weight_map.values()))

    def _read_index(self, index: Path) -> dict[str, str]:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(
                f"{index}: {index.stat().st_size} bytes, more than the {MAX_INDEX_BYTES} an "
                f"index may have; {REDOWNLOAD}"
            )
        try:
            data = json.loads(index.read_bytes(), object_pairs_hook=refuse_duplicate_keys)
        except (json.JSONDecodeError, UnicodeDecodeError, CheckpointError) as err:
            raise CheckpointError(f"{index}: not a valid index ({err}); {REDOWNLOAD}") from None
        except (RecursionError, ValueError) as err:
            raise CheckpointError(f"{index}: {unreadable_json(err)}; {REDOWNLOAD}") from None
        except OSError as err:
            raise CheckpointError(f"{index}: cannot be read ({err.strerror})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index}: not a valid index (needs a JSON object with a 'weight_map' object "
                f"mapping tensor names to shard files); {REDOWNLOAD}"
            )
        metadata = data.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise CheckpointError(
                f"{index}: not a valid index ('metadata' is a {type(metadata).__name__}, "
                f'where an index has an object such as {{"total_size": ...}}); {REDOWNLOAD}'
            )
        if len(weight_map) > MAX_TENSORS:
            raise CheckpointError(
                f"{index}: lists {len(weight_map)} tensors, more than the {MAX_TENSORS} a "
                f"checkpoint may hold (real ones hold at most a few hundred thousand); "
                f"{REDOWNLOAD}"
            )
        for name, file in weight_map.items():
            check_file_name(file, f"{index}: weight_map[{name!r}]")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            if not (self.path / file).exists():
                raise CheckpointError(
                    f"{self.path / file}: shard file is missing; {INDEX_FILE} names it for "
                    f"{len(names)} tensor(s), e.g. {format_keys(names[:3])}; {REDOWNLOAD}"
                )
        return dict(weight_map)

    def resolved(self, file: str) -> Path:
        """The file ``file`` names inside the directory, symlinks followed (cached).

        Raises:
            CheckpointError: an unsafe name, or it does not lead to a regular file.
        """
        if file not in self._resolved:
            check_file_name(file, f"{self.path}: shard file")
            path = self.path / file
            if not path.is_file():
                what = "missing" if not path.exists() else "not a regular file"
                raise CheckpointError(f"{path}: shard file is {what}; {REDOWNLOAD}")
            self._resolved[file] = path.resolve()
        return self._resolved[file]

    def entries(self, file: str) -> dict[str, TensorEntry]:
        """Every tensor of ``file`` with its dtype, shape and byte range (validated, cached).

        Raises:
            CheckpointError: the file is unsafe, missing, or not a valid safetensors file.
        """
        if file not in self._entries:
            path = self.resolved(file)
            shown = self.path / file
            try:
                with safe_open(path, framework="pt") as f:
                    names = set(f.keys())
            except Exception as err:  # safetensors raises its own (Rust) error type
                raise CheckpointError(
                    f"{shown}: not a readable safetensors file ({err}); the file is truncated "
                    f"or corrupt: {REDOWNLOAD}"
                ) from None
            counted = len(names) + sum(map(len, self._entries.values()))
            if counted > MAX_TENSORS:
                raise CheckpointError(
                    f"{shown}: {len(names)} tensors, which brings the checkpoint's files to "
                    f"{counted}, more than the {MAX_TENSORS} a checkpoint may hold (real "
                    f"ones hold at most a few hundred thousand); the file is damaged or not "
                    f"a model checkpoint: {REDOWNLOAD}"
                )
            try:
                entries = read_header(path)
            except (ValueError, OSError) as err:
                raise CheckpointError(f"{shown}: {err}; {REDOWNLOAD}") from None
            if set(entries) != names:
                raise CheckpointError(f"{shown}: the file changed while it was read; retry")
            self._entries[file] = entries
        return self._entries[file]

    def spec(self, name: str) -> TensorSpec:
        """Dtype and shape of tensor ``name``.

        Raises:
            CheckpointError: no such tensor.
        """
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        return self.entries(file)[name].spec

    def _check_agreement(self) -> None:
        """Every listed tensor in its file, every stored tensor listed there, none twice."""
        stored_in: dict[str, str] = {}
        for file in self.files:
            for name in self.entries(file):
                if name in stored_in:
                    raise CheckpointError(
                        f"{self.path}: tensor {name!r} is stored in two shards, "
                        f"{stored_in[name]} and {file}; the checkpoint is damaged: {REDOWNLOAD}"
                    )
                stored_in[name] = file
        index = self.index.name if self.index is not None else SINGLE_FILE
        for name, file in sorted(self.weight_map.items()):
            found = stored_in.get(name)
            if found is None:
                raise CheckpointError(
                    f"{self.path / file}: tensor {name!r} is named in {index} but absent from "
                    f"this file; {REDOWNLOAD}"
                )
            if found != file:
                raise CheckpointError(
                    f"{self.path}: {index} places tensor {name!r} in {file}, but it is in "
                    f"{found}; {REDOWNLOAD}"
                )
        unlisted = sorted(set(stored_in) - set(self.weight_map))
        if unlisted:
            raise CheckpointError(
                f"{self.path / stored_in[unlisted[0]]}: {len(unlisted)} tensor(s) of the shards "
                f"are not listed in {index}, e.g. {format_keys(unlisted)}; the index and the "
                f"shards disagree: {REDOWNLOAD}"
            )
