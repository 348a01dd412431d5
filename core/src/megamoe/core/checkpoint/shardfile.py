"""Safetensors files read and written tensor by tensor, without mapping whole files.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to its dtype, shape and ``data_offsets`` (begin, end) in the data section, and
the data section. ``ShardWriter`` writes the header first from a plan, then each tensor's
bytes at its planned place, so a converted checkpoint is written one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from megamoe.core.checkpoint.expert_names import TensorSpec

HEADER_LENGTH_BYTES = 8  # u64 little-endian
HEADER_ALIGN = 8  # the header is padded with spaces to a multiple of 8 bytes
METADATA_KEY = "__metadata__"
COPY_CHUNK_BYTES = 16 * 1024 * 1024  # 16 MiB per read when copying raw bytes
INT64_MAX = 2**63 - 1  # 9223372036854775807: torch's largest size, stride or element count
MAX_SHOWN_DIMS = 8  # dimensions of a refused shape named in its message
# A new file only: never an existing file, nor through a symlink planted at its name.
CREATE_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

DTYPE_TO_SAFETENSORS = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
SAFETENSORS_TO_DTYPE = {v: k for k, v in DTYPE_TO_SAFETENSORS.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry: dtype, shape and absolute byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def spec(self) -> TensorSpec:
        """Dtype and shape."""
        return TensorSpec(self.dtype, self.shape)


def dtype_from_safetensors(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``).

    Raises:
        ValueError: a dtype name torch has no equivalent for.
    """
    if name not in SAFETENSORS_TO_DTYPE:
        raise ValueError(f"safetensors dtype {name!r} has no torch equivalent here")
    return SAFETENSORS_TO_DTYPE[name]


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header (a few reads; no tensor data is touched).

    Call this on files already checked with ``safe_open`` (``CheckpointFiles`` does),
    which validates coverage and offsets; this parser still bounds every read by the file
    size and refuses what it cannot parse, so a file changed in between cannot crash it.
    Messages name the tensor at fault but not the file: the caller names it.

    Returns:
        Every tensor's entry, with absolute file offsets.

    Raises:
        ValueError: the header cannot be parsed, or a shape no torch tensor can have
            (``check_shape``).
        NotImplementedError: a dtype megamoe does not read (``SAFETENSORS_TO_DTYPE``).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - HEADER_LENGTH_BYTES:
            raise ValueError(f"header length {length} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ValueError(f"safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    start = HEADER_LENGTH_BYTES + length
    entries = {}
    for name, info in header.items():
        if name == METADATA_KEY:
            continue
        dtype_name = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(dtype_name, str) and dtype_name not in SAFETENSORS_TO_DTYPE:
            raise NotImplementedError(
                f"tensor {name!r} has safetensors dtype {dtype_name!r}, which megamoe does not "
                f"read (it reads {', '.join(SAFETENSORS_TO_DTYPE)}): store the tensor in one "
                "of those, or remove it"
            )
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(v) for v in info["shape"])
            dtype = dtype_from_safetensors(info["dtype"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"tensor {name!r}: bad header entry ({err})") from None
        check_shape(name, shape)
        if not 0 <= begin <= end <= size - start:
            raise ValueError(f"tensor {name!r}: data_offsets lie outside the file")
        entries[name] = TensorEntry(dtype, shape, start + begin, start + end)
    return entries


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    """Refuse a shape no torch tensor can have, before torch overflows on it.

    safetensors accepts any dimension below 2**64 in an empty tensor (one of its
    dimensions 0): its byte count is 0 whatever the others. torch holds sizes and strides
    in int64, and a contiguous tensor's strides are products of its sizes (0 counted as 1).

    Raises:
        ValueError: a negative dimension, or dimensions (zeros counted as 1) whose product
            exceeds ``INT64_MAX``; names the tensor and its shape.
    """
    product = 1
    for dim in shape:  # stops at the first overflow: a long shape costs no huge product
        product *= max(dim, 1)
        if dim < 0 or product > INT64_MAX:
            shown = list(shape[:MAX_SHOWN_DIMS]) + (["..."] if len(shape) > MAX_SHOWN_DIMS else [])
            raise ValueError(
                f"tensor {name!r} has shape {shown}: its dimensions (zeros counted as 1) "
                "must be non-negative with a product of at most 2**63 - 1, the int64 sizes "
                "and strides of a torch tensor; no tensor has this shape"
            )


def read_tensor(
    fd: int, entry: TensorEntry, start: int = 0, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Read a tensor, or a contiguous run of its elements, with plain reads (no mmap).

    Args:
        fd: an open file descriptor.
        entry: the tensor's header entry.
        start: first element to read, in row-major order.
        shape: shape of the part to read (``entry.shape`` by default); its elements follow
            ``start`` contiguously, e.g. rows ``r0:r1`` of expert ``e`` of an (E, R, C)
            tensor are ``start = (e * R + r0) * C``, ``shape = (r1 - r0, C)``.

    Returns:
        A CPU tensor owning its memory.

    Raises:
        ValueError: the part lies outside the tensor.
        OSError: the file ends early.
    """
    shape = entry.shape if shape is None else tuple(shape)
    itemsize = entry.dtype.itemsize
    count = math.prod(shape)
    begin, nbytes = entry.begin + start * itemsize, count * itemsize
    if start < 0 or begin + nbytes > entry.end:
        raise ValueError(
            f"elements [{start}, {start + count}) lie outside a tensor of shape {entry.shape}"
        )
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        try:
            got = os.preadv(fd, [view[done:]], begin + done)
        except OSError as err:
            raise path_error(err, "reading", _fd_name(fd)) from err
        if got <= 0:
            where = f"at offset {begin} of {_fd_name(fd)}"
            raise OSError(f"unexpected end of file reading {nbytes} bytes {where}")
        done += got
    if not nbytes:
        return torch.empty(shape, dtype=entry.dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(entry.dtype).reshape(shape)


def path_error(err: OSError, doing: str, path: str | Path) -> OSError:
    """``err`` with the file named (``... writing PATH``); errno, hence the subclass, is kept."""
    if err.errno is None:
        return OSError(f"{err} ({doing} {path})")
    return OSError(err.errno, f"{err.strerror or err} {doing} {path}")


def _fd_name(fd: int) -> str:
    """The path an open file descriptor refers to, for error messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")  # Linux
    except OSError:
        return f"file descriptor {fd}"


class ShardWriter:
    """Writes one safetensors file from a plan: header first, then tensors in any order.

    Args:
        path: the file to create.
        plan: ``(name, spec)`` in the order the data section lays them out.
        metadata: the header's ``__metadata__`` strings.

    Raises:
        ValueError: a name planned twice, or a dtype safetensors cannot store.
    """

    def __init__(
        self,
        path: str | Path,
        plan: Sequence[tuple[str, TensorSpec]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header: dict[str, object] = {METADATA_KEY: dict(metadata or {"format": "pt"})}
        ranges: dict[str, tuple[TensorSpec, int, int]] = {}
        offset = 0
        for name, spec in plan:
            if name in header:
                raise ValueError(f"{self.path.name}: tensor {name!r} planned twice")
            if spec.dtype not in DTYPE_TO_SAFETENSORS:
                raise ValueError(f"{name}: dtype {spec.dtype} cannot be stored in safetensors")
            header[name] = {
                "dtype": DTYPE_TO_SAFETENSORS[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            ranges[name] = (spec, offset, offset + spec.nbytes)
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % HEADER_ALIGN)
        start = HEADER_LENGTH_BYTES + len(text)
        self._entries = {
            name: TensorEntry(spec.dtype, tuple(spec.shape), start + begin, start + end)
            for name, (spec, begin, end) in ranges.items()
        }
        self.nbytes = start + offset
        self._pending = set(self._entries)
        try:
            self._fd = os.open(self.path, CREATE_NEW_FLAGS, 0o644)
        except OSError as err:
            raise path_error(err, "creating", self.path) from err
        try:
            self._pwrite_all(memoryview(struct.pack("<Q", len(text)) + text), 0)
            try:
                os.ftruncate(self._fd, self.nbytes)
            except OSError as err:
                raise path_error(err, "writing", self.path) from err
        except OSError:
            os.close(self._fd)
            self._fd = -1
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write a planned tensor's bytes.

        Raises:
            ValueError: the name is not planned, was written already, or the tensor's dtype
                or shape differs from the plan.
        """
        entry = self._claim(name)
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"{self.path.name}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"planned {entry.dtype} {entry.shape}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._pwrite_all(flat.numpy().data, entry.begin)

    def copy(self, name: str, src_fd: int, src: TensorEntry) -> None:
        """Copy a planned tensor's bytes unchanged from another file, in bounded chunks.

        Raises:
            ValueError: the name is not planned, was written already, or the source entry's
                dtype or shape differs from the plan.
        """
        entry = self._claim(name)
        if src.spec != entry.spec:
            raise ValueError(f"{self.path.name}: tensor {name!r} source {src.spec} != {entry.spec}")
        done, nbytes = 0, src.end - src.begin
        while done < nbytes:
            try:
                chunk = os.pread(src_fd, min(COPY_CHUNK_BYTES, nbytes - done), src.begin + done)
            except OSError as err:
                raise path_error(err, f"reading {name!r} from", _fd_name(src_fd)) from err
            if not chunk:
                raise OSError(f"unexpected end of file copying {name!r} from {_fd_name(src_fd)}")
            self._pwrite_all(memoryview(chunk), entry.begin + done)
            done += len(chunk)

    def _claim(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise ValueError(f"{self.path.name}: tensor {name!r} is not planned for this file")
        if name not in self._pending:
            raise ValueError(f"{self.path.name}: tensor {name!r} was written already")
        self._pending.discard(name)
        return self._entries[name]

    def _pwrite_all(self, data: memoryview, offset: int) -> None:
        while len(data):
            try:
                written = os.pwrite(self._fd, data, offset)
            except OSError as err:
                raise path_error(err, "writing", self.path) from err
            data, offset = data[written:], offset + written

    def close(self) -> None:
        """Flush and close the file.

        Raises:
            ValueError: planned tensors were never written (the file would hold zeros).
        """
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            os.fsync(fd)
        except OSError as err:
            raise path_error(err, "writing", self.path) from err
        finally:
            os.close(fd)
        if self._pending:
            missing = ", ".join(sorted(self._pending)[:4])
            raise ValueError(
                f"{self.path.name}: {len(self._pending)} planned tensor(s) never written "
                f"(e.g. {missing})"
            )

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
