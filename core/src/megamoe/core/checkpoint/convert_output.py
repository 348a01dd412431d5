"""The output directory of ``megamoe convert``: one partial directory, confined writes.

A conversion writes into ``OUT.partial-<pid>`` beside ``OUT`` and renames it to ``OUT``
once complete. Inside it every file is created new (``O_EXCL | O_NOFOLLOW``), under a
single plain file name, so nothing planted at a name (a file, a symlink) is written
through. A partial directory whose process is gone is stale: the next conversion to the
same ``OUT`` removes it, with a warning naming it. Besides the tensors, the index and
``config.json``, the source's other regular files are copied by content; weight files the
index does not name, entries that are not regular files and symlinks whose target lies
outside the checkpoint are left out, each named in a warning.
"""

from __future__ import annotations

import os
import shutil
import stat
import warnings
from pathlib import Path

from megamoe.core.checkpoint.files import checkpoint_roots
from megamoe.core.checkpoint.reader import INDEX_FILE
from megamoe.core.checkpoint.shardfile import COPY_CHUNK_BYTES, CREATE_NEW_FLAGS, path_error

PARTIAL_MARK = ".partial-"  # OUT.partial-<pid> while a conversion is in progress
# Weight files other than the indexed shards: never copied into the converted checkpoint.
WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".h5", ".msgpack",
    ".onnx", ".tflite", ".ot", ".npz", ".pdparams",
)  # fmt: skip
WEIGHT_INDEX_SUFFIX = ".index.json"  # e.g. pytorch_model.bin.index.json names left-out weights

ACTIVE_PARTIALS: set[str] = set()  # partial directories this process is writing now


def partial_path(out: Path, pid: int) -> Path:
    """Where the conversion of process ``pid`` to ``out`` writes: ``OUT.partial-<pid>``."""
    return out.with_name(f"{out.name}{PARTIAL_MARK}{pid}")


def plain_name(name: str, where: Path) -> str:
    """``name`` if it is one plain path component, so joining it cannot leave a directory."""
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    if name in ("", ".", "..") or "\0" in name or any(sep in name for sep in seps):
        raise ValueError(
            f"{where}: file name {name!r} is not a single plain file name (no '/', '..' or "
            "absolute path); convert only writes files directly inside its output directory"
        )
    return name


def remove_stale_partials(out: Path) -> None:
    """Remove ``OUT.partial-<pid>`` of converts whose process is gone; refuse a live one."""
    head = f"{out.name}{PARTIAL_MARK}"
    with os.scandir(out.parent) as entries:
        names = sorted(e.name for e in entries if e.name.startswith(head))
    for name in names:
        tail = name[len(head) :]
        if not (tail.isascii() and tail.isdigit() and str(int(tail)) == tail and int(tail) > 0):
            continue  # not a name convert makes: not ours to remove
        pid, path = int(tail), out.parent / name
        if _is_running(pid, path):
            raise FileExistsError(
                f"{path} exists and process {pid} is running: another convert is writing "
                f"{out}; wait for it to finish, or remove {path} if no convert is running"
            )
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)  # a link or file planted at the name: removed, never followed
        gone = "is this process, which is not writing it" if pid == os.getpid() else "is gone"
        warnings.warn(
            f"removed stale partial output {path} of a convert that did not finish "
            f"(pid {pid} {gone})",
            stacklevel=3,
        )


def _is_running(pid: int, partial: Path) -> bool:
    """Whether process ``pid`` may still be writing ``partial``."""
    if pid == os.getpid():  # this process: only while this process converts to it
        return os.path.abspath(partial) in ACTIVE_PARTIALS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def write_new(path: Path, text: str) -> None:
    """Create ``path`` (never an existing file, nor through a symlink) holding ``text``."""
    try:
        fd = os.open(path, CREATE_NEW_FLAGS, 0o644)
    except OSError as err:
        raise path_error(err, "creating", path) from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise path_error(err, "writing", path) from err


def _copy_new(src: Path, dst: Path) -> None:
    """Copy regular file ``src``'s content (symlinks followed) into a new file ``dst``."""
    try:  # O_NONBLOCK: a FIFO swapped in after the type check cannot hang the open
        src_fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise path_error(err, "opening", src) from err
    with os.fdopen(src_fd, "rb") as f_src:
        st = os.fstat(src_fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{src} stopped being a regular file while convert copied it")
        try:
            dst_fd = os.open(dst, CREATE_NEW_FLAGS, stat.S_IMODE(st.st_mode))
        except OSError as err:
            raise path_error(err, "creating", dst) from err
        try:
            with os.fdopen(dst_fd, "wb") as f_dst:
                shutil.copyfileobj(f_src, f_dst, COPY_CHUNK_BYTES)
                f_dst.flush()
                os.utime(dst_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.fsync(dst_fd)
        except OSError as err:
            raise path_error(err, f"copying {src} to", dst) from err


def copy_other_files(src_dir: Path, partial: Path, skip: set[str]) -> None:
    """Copy the source's other regular files; warn naming what is left out.

    Left out: weight files the index does not name, entries that are not regular files,
    and symlinks whose target lies outside the checkpoint directory (and its Hugging Face
    cache's ``blobs/``): a checkpoint could otherwise link ``/proc/self/environ`` or a
    secret into an output meant to be shared.
    """
    roots = checkpoint_roots(src_dir)
    weights, odd, outside = [], [], []
    with os.scandir(src_dir) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        name = plain_name(entry.name, src_dir)
        if name in skip:
            continue
        if name.lower().endswith((*WEIGHT_SUFFIXES, WEIGHT_INDEX_SUFFIX)):
            weights.append(name)
            continue
        path = src_dir / name
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            odd.append(f"{name} (a broken symlink)")
            continue
        except OSError as err:
            raise path_error(err, "reading", path) from err
        if not stat.S_ISREG(mode):
            odd.append(f"{name} ({_file_kind(mode)})")
            continue
        if entry.is_symlink():
            target = Path(os.path.realpath(path))
            if not any(target.is_relative_to(root) for root in roots):
                outside.append(f"{name} (a symlink to {target})")
                continue  # a name the checkpoint gives never leads outside it
        _copy_new(path, partial / name)
    if weights:
        warnings.warn(
            f"{src_dir}: left out weight files that {INDEX_FILE} does not name: "
            f"{', '.join(weights)}",
            stacklevel=4,
        )
    if odd:
        warnings.warn(
            f"{src_dir}: left out entries that are not regular files: {', '.join(odd)}",
            stacklevel=4,
        )
    if outside:
        warnings.warn(
            f"{src_dir}: left out files linking outside the checkpoint directory: "
            f"{'; '.join(outside)}; copy those that belong in the converted checkpoint "
            "yourself",
            stacklevel=4,
        )


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ]
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")
