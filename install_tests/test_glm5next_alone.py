"""megamoe-glm5next installed alone from ``dist/``, as the README's install section says.

Run by ``nox -s install`` in an environment holding only what that install brought (the
session builds ``dist/`` and removes every megamoe distribution first); never by the
``tests`` sessions, which install every package.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib.metadata import distribution, distributions
from pathlib import Path

import pytest


def _megamoe(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    script = Path(sys.executable).parent / "megamoe"
    return subprocess.run([str(script), *args], capture_output=True, text=True, check=False)


def test_the_adapter_and_core_come_from_wheels() -> None:
    """Both are installed from wheels and import from site-packages."""
    import megamoe.core
    import megamoe.glm5next

    for module in (megamoe.core, megamoe.glm5next):
        assert "site-packages" in Path(module.__file__ or "").parts, module.__file__
    for name in ("megamoe-core", "megamoe-glm5next"):
        wheel = distribution(name).read_text("WHEEL")  # installed from a wheel, not a folder
        assert wheel is not None and "Root-Is-Purelib: true" in wheel, name


def test_the_other_adapter_is_absent() -> None:
    """Nothing brought megamoe-qwen4exp along."""
    assert importlib.util.find_spec("megamoe.qwen4exp") is None
    installed = {d.metadata["Name"] for d in distributions()}
    assert "megamoe-qwen4exp" not in installed and "megamoe" not in installed
    from megamoe.core.adapters import installed_adapters

    assert list(installed_adapters()) == ["glm5next"]


def test_the_demo_runs_the_adapters_rows() -> None:
    """``megamoe demo`` runs one row per format glm5next loads, each within tolerance."""
    from megamoe.glm5next.adapter import ADAPTER

    done = _megamoe("demo", "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("glm5next ")]
    assert [row[1] for row in rows] == [f.value for f in ADAPTER.checkpoint_formats]
    assert all(row[-1] == "ok" for row in rows)
    assert f"{len(rows)} of {len(rows)} combinations within tolerance" in done.stdout


@pytest.mark.parametrize("argv", [["--version"], ["sample", "--help"]])
def test_the_console_script_answers(argv: list[str]) -> None:
    """``--version`` names this install; every command is there."""
    done = _megamoe(*argv)
    assert done.returncode == 0, done.stderr
    if argv == ["--version"]:
        core = distribution("megamoe-core").version
        glm = distribution("megamoe-glm5next").version
        assert done.stdout.strip() == f"megamoe-core {core}; adapters: megamoe-glm5next {glm}"
