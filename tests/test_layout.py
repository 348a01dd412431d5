"""The monorepo stays a PEP 420 namespace with one distribution per folder."""

from __future__ import annotations

import importlib
import importlib.metadata as md
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "qwen4exp", "glm5next")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_namespace_init(package: str) -> None:
    assert not (ROOT / package / "src" / "megamoe" / "__init__.py").exists(), (
        f"{package}/src/megamoe/__init__.py would turn the megamoe namespace into a regular "
        "package and hide the other distributions"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_py_typed(package: str) -> None:
    assert (ROOT / package / "src" / "megamoe" / package / "py.typed").is_file()


def test_namespace_spans_installed_distributions() -> None:
    megamoe = importlib.import_module("megamoe")
    assert getattr(megamoe, "__file__", None) is None, "megamoe must be a namespace package"
    for package in PACKAGES:
        module = importlib.import_module(f"megamoe.{package}")
        assert module.__all__, f"megamoe.{package} exports nothing"


def test_adapters_registered_through_entry_points() -> None:
    names = {ep.name for ep in md.entry_points(group="megamoe.adapters")}
    assert {"qwen4exp", "glm5next"} <= names


def test_core_never_imports_an_adapter() -> None:
    core_src = ROOT / "core" / "src" / "megamoe" / "core"
    for path in core_src.rglob("*.py"):
        text = path.read_text()
        for adapter in ("qwen4exp", "glm5next"):
            assert f"megamoe.{adapter}" not in text, f"{path} imports megamoe.{adapter}"
