"""Guards shared by the convert and hostile-checkpoint tests.

Nothing outside a convert's OUT may change, and a hang must fail instead of stalling.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

from megamoe.core.checkpoint.convert_output import PARTIAL_MARK


def _is_out(name: str, out: Path) -> bool:
    return name == out.name or name.startswith(out.name + PARTIAL_MARK)


def tree_state(root: Path, out: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` but ``out`` and its partials: kind, mode, content hash."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if not _is_out(d, out)]
            filenames = [f for f in filenames if not _is_out(f, out)]
        for name in dirnames + filenames:
            path = here / name
            st = os.lstat(path)
            key = str(path.relative_to(root))
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[key] = ("file", st.st_mode, st.st_mtime_ns, digest)
            elif stat.S_ISLNK(st.st_mode):
                found[key] = ("link", os.readlink(path))
            else:
                found[key] = ("other", st.st_mode)
    return found


@contextlib.contextmanager
def nothing_changes_outside(root: Path, out: Path) -> Iterator[None]:
    """Fail if anything under ``root`` other than ``out`` (and its partials) changes."""
    before = tree_state(root, out)
    yield
    after = tree_state(root, out)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"files outside {out} changed: {changed}"


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Turn a hang (a loop over a huge config size, opening a FIFO) into a failure."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
