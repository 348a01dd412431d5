r"""The safetensors files of a checkpoint directory: names confined to it, headers validated.

A checkpoint holds ``model.safetensors``, or shards that ``model.safetensors.index.json``
names. Everything a checkpoint gives is untrusted input:

- **Names.** Each file name of the index must be a plain file name (one path component:
  no ``/`` or ``\\``, not ``.`` or ``..``, no NUL, at most ``MAX_NAME_BYTES`` bytes), so it
  names a file inside the checkpoint directory. A layer or expert index in a tensor name
  has at most ``MAX_INDEX_DIGITS`` digits.
- **Confined.** ``config.json``, the index and every shard may be symlinks (Hugging Face's
  cache links snapshot files to ``../../blobs/<hash>``), followed for reading; each must
  lead to a regular file inside the checkpoint directory or, for a Hugging Face cache
  snapshot (``<repo>/snapshots/<revision>``), the repository's ``blobs/``
  (``checkpoint_roots``; ``confined``). Each file is resolved once, and every header check
  and data read uses that resolved path.
- **Headers.** Every shard's header is parsed by safetensors itself (``safe_open``: header
  size, JSON, dtypes, shapes, offsets covering the data section exactly, none
  overlapping), then read again for its byte offsets (``shardfile.read_header``, bounded by
  the size safetensors accepted), which raw copies need; it also refuses shapes torch
  cannot hold (an empty tensor may declare any dimension below 2**64 to safetensors).
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
import os
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from megamoe.core.checkpoint.expert_names import MAX_INDEX_DIGITS, TensorSpec
from megamoe.core.checkpoint.shardfile import TensorEntry, read_header
from megamoe.core.errors import CheckpointError, UnsupportedCheckpointError, format_keys

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
MAX_NAME_BYTES = 255  # NAME_MAX: the longest file name Linux and macOS file systems hold
MAX_SHOWN_CHARS = 160  # of a name in a message; a longer one is shown cut in the middle
# A dot-separated part of a tensor name of all digits, longer than an index may be.
_LONG_INDEX = re.compile(rf"(?:^|\.)(\d{{{MAX_INDEX_DIGITS + 1},}})(?=\.|$)")
CONFINED = (
    "a file a checkpoint names must lie inside its directory (or, for a Hugging Face cache "
    "snapshot, in its repository's blobs/), so that reading it never leaves the checkpoint"
)


def clipped(text: str) -> str:
    """``text`` for a message: cut in the middle when longer than ``MAX_SHOWN_CHARS``."""
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    half = MAX_SHOWN_CHARS // 2
    return f"{text[:half]}...({len(text)} characters)...{text[-half // 2 :]}"


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
            f"{where} = {clipped(name)!r}: a shard file name {rule}; megamoe never reads or "
            f"writes outside the checkpoint: fix the index or {REDOWNLOAD}"
        )
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800", which JSON allows
        raise CheckpointError(
            f"{where} = {clipped(name)!r}: a shard file name must be text a file name can "
            f"hold, and this one holds a lone UTF-16 surrogate; the index is damaged: fix it "
            f"or {REDOWNLOAD}"
        ) from None
    if size > MAX_NAME_BYTES:
        raise CheckpointError(
            f"{where} = {clipped(name)!r} ({size} bytes): a shard file name has at most "
            f"{MAX_NAME_BYTES} bytes (UTF-8), the longest file name a file system holds, so "
            f"no file has this one; the index is damaged: fix it or {REDOWNLOAD}"
        )
    return name


def check_tensor_name(name: str, where: object) -> None:
    """Refuse a tensor name with an index longer than ``MAX_INDEX_DIGITS`` digits.

    Names are parsed for their layer and expert indices (``layers.3.``, ``experts.5.``);
    ``int()`` raises on thousands of digits, and no model has a billion layers or experts.

    Args:
        name: a tensor name a checkpoint gives.
        where: the file that gives it, for the message.

    Raises:
        CheckpointError: names the tensor (cut short), the index's length and the rule.
    """
    match = _LONG_INDEX.search(name)
    if match is not None:
        raise CheckpointError(
            f"{where}: tensor {clipped(name)!r} has an index of {len(match[1])} digits; a "
            f"layer or expert index in a tensor name has at most {MAX_INDEX_DIGITS} digits "
            f"(no model has a billion layers or experts): the name is damaged; {REDOWNLOAD}"
        )


def checkpoint_roots(directory: Path) -> list[Path]:
    """Where the files of checkpoint ``directory`` may lie once symlinks are followed.

    The directory itself, and for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<revision>``, whose files link to ``../../blobs/<hash>``)
    or a folder inside one (a repository that keeps its weights in a subfolder) the
    repository's ``blobs/``.
    """
    root = directory.resolve()
    for folder in (root, *root.parents):
        if folder.parent.name == "snapshots":
            return [root, folder.parent.parent / "blobs"]
    return [root]


def confined(path: Path, what: str, fix: str) -> Path:
    """The regular file that ``path``, an entry of a checkpoint directory, leads to.

    Symlinks are followed; where they lead must lie in ``checkpoint_roots`` of the
    directory. Read the returned path, not ``path``: the name could be relinked later.

    Args:
        path: the entry (it exists, or is a symlink).
        what: what it is, for messages (``shard file``, ``config.json``).
        fix: what to do when it is a broken symlink or no regular file.

    Returns:
        The resolved path.

    Raises:
        CheckpointError: a broken symlink, not a regular file, or a file outside the
            checkpoint; names the entry, where it leads, the rule and the fix.
    """
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop (Python 3.11)
        reason = getattr(err, "strerror", None) or str(err)
        kind = f"a broken symlink to {_link_text(path)}" if path.is_symlink() else "unreadable"
        raise CheckpointError(f"{path}: {what} is {kind} ({reason}); {fix}") from None
    if not target.is_file():
        kind = "a directory" if target.is_dir() else "a device, FIFO or socket"
        via = f", through a symlink to {target}" if path.is_symlink() else ""
        raise CheckpointError(f"{path}: {what} is not a regular file ({kind}{via}); {fix}")
    roots = checkpoint_roots(path.parent)
    if not any(target.is_relative_to(root) for root in roots):
        raise CheckpointError(
            f"{path}: {what} is a symlink to {target}, outside the checkpoint directory "
            f"{roots[0]}; {CONFINED}: copy the file into {path.parent} in place of the link"
        )
    return target


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


def _link_text(path: Path) -> str:
    """Where symlink ``path`` points, as it is written, for a message."""
    try:
        return repr(clipped(os.readlink(path)))
    except OSError:
        return "an unreadable target"


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
        self.index: Path | None = index if os.path.lexists(index) else None
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
        elif os.path.lexists(path / SINGLE_FILE):  # a broken link is named by entries()
            self.weight_map = dict.fromkeys(self.entries(SINGLE_FILE), SINGLE_FILE)
        else:
            raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        self._check_agreement()

    @property
    def files(self) -> list[str]:
        """The shard file names, sorted."""
        return sorted(set(self.weight_map.values()))

    def _read_index(self, index: Path) -> dict[str, str]:
        source = confined(index, "the index", f"remove it, or {REDOWNLOAD}")
        try:
            size = source.stat().st_size
        except OSError as err:
            raise CheckpointError(f"{index}: cannot be read ({err.strerror})") from None
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(
                f"{index}: {size} bytes, more than the {MAX_INDEX_BYTES} an index may have; "
                f"{REDOWNLOAD}"
            )
        try:
            data = json.loads(source.read_bytes(), object_pairs_hook=refuse_duplicate_keys)
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
            check_tensor_name(name, index)
            check_file_name(file, f"{index}: weight_map[{name!r}]")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            if not os.path.lexists(self.path / file):  # a broken link is named by resolved()
                raise CheckpointError(
                    f"{self.path / file}: shard file is missing; {INDEX_FILE} names it for "
                    f"{len(names)} tensor(s), e.g. {format_keys(names[:3])}; {REDOWNLOAD}"
                )
        return dict(weight_map)

    def resolved(self, file: str) -> Path:
        """The file ``file`` names inside the directory, symlinks followed (cached).

        Raises:
            CheckpointError: an unsafe name, or it does not lead to a regular file inside
                the checkpoint (``confined``).
        """
        if file not in self._resolved:
            check_file_name(file, f"{self.path}: shard file")
            path = self.path / file
            if not os.path.lexists(path):
                raise CheckpointError(f"{path}: shard file is missing; {REDOWNLOAD}")
            self._resolved[file] = confined(path, "shard file", REDOWNLOAD)
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
            for name in names:
                check_tensor_name(name, shown)
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
            except NotImplementedError as err:  # a dtype megamoe does not read
                raise UnsupportedCheckpointError(f"{shown}: {err}") from None
            except ValueError as err:
                raise CheckpointError(f"{shown}: {err}; {REDOWNLOAD}") from None
            except OSError as err:
                raise CheckpointError(f"{shown}: cannot be read ({err.strerror or err})") from None
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
