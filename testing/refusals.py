"""One refusal checked on every path a user takes (tests only, issue 38).

The Python API (``open_checkpoint``: what loading, ``inspect``, ``verify`` and ``convert``
share), then the three commands: each exits 1 with one error line matching the message,
and ``convert`` leaves no OUT (and nothing else changes beside it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from untouched import nothing_changes_outside

from megamoe.core.adapters import open_checkpoint
from megamoe.core.checkpoint.files import SINGLE_FILE
from megamoe.core.cli import main as cli
from megamoe.core.errors import CheckpointError


def edit_config(
    ckpt: Path, change: Callable[[dict[str, Any]], object], *, flat: bool = False
) -> None:
    """Apply ``change`` to the text model's keys of ``config.json`` (``flat``: flatten first)."""
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    if flat and "text_config" in config:
        config = {**config["text_config"]}
    change(config.get("text_config", config))
    path.write_text(json.dumps(config))


def edit_tensors(ckpt: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Apply ``change`` to the tensors of a single-file checkpoint (by name, in place)."""
    tensors = load_file(ckpt / SINGLE_FILE)
    change(tensors)
    save_file(tensors, ckpt / SINGLE_FILE)


def drop_tensors(ckpt: Path, parts: tuple[str, ...]) -> None:
    """Delete every tensor whose name holds one of ``parts`` (e.g. a model's MoE modules)."""

    def change(tensors: dict[str, Any]) -> None:
        for name in [n for n in tensors if any(part in n for part in parts)]:
            del tensors[name]

    edit_tensors(ckpt, change)


def error_line(text: str) -> str:
    """The one ``megamoe <command>: error:`` line of ``text`` (asserted to be one)."""
    lines = [line for line in text.splitlines() if ": error: " in line]
    assert len(lines) == 1, text
    return lines[0]


def assert_refused_everywhere(
    ckpt: Path,
    pattern: str,
    capsys: pytest.CaptureFixture[str],
    error: type[Exception] = CheckpointError,
) -> str:
    """The API and ``inspect``, ``verify``, ``convert`` refuse ``ckpt`` matching ``pattern``.

    Returns:
        The API's message (for the closing note of an issue, printed by ``-s``).
    """
    with pytest.raises(error) as raised:
        open_checkpoint(ckpt)
    message = str(raised.value)
    assert re.search(pattern, message), message
    capsys.readouterr()
    for command in ("inspect", "verify"):
        assert cli.main([command, str(ckpt)]) == 1
        line = error_line(capsys.readouterr().err)
        assert line.startswith(f"megamoe {command}: error: ") and re.search(pattern, line), line
    root, out = ckpt.parent, ckpt.parent / "out"
    with nothing_changes_outside(root, out):
        assert cli.main(["convert", str(ckpt), str(out), "--to", "mxfp8", "--no-progress"]) == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith("megamoe convert: error: ") and re.search(pattern, line), line
    assert not out.exists() and not list(root.glob("out.partial-*"))
    print(f"\n[refused] {message}")
    return message
