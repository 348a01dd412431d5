"""megamoe-core installs and imports alone, as a namespace portion."""

from __future__ import annotations

import importlib
import importlib.metadata as md
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_namespace_has_no_init() -> None:
    assert not (SRC / "megamoe" / "__init__.py").exists()


def test_core_imports_and_exports() -> None:
    core = importlib.import_module("megamoe.core")
    for name in core.__all__:
        assert hasattr(core, name), name


def test_console_script_declared() -> None:
    scripts = {ep.name: ep.value for ep in md.entry_points(group="console_scripts")}
    assert scripts.get("megamoe") == "megamoe.core.cli.main:main"
