"""The import-linter contracts of pyproject.toml bite: a planted wrong-way import fails them.

``nox -s lint`` runs ``lint-imports`` on the tree and this file (import-linter installed
there; elsewhere it skips). Each case copies the three packages' sources and the root
``pyproject.toml`` into a temporary folder, plants one import and runs ``lint-imports`` on
the copy: the clean copy passes, every planted import fails the contract it breaks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter runs in nox -s lint")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("core/src", "qwen4exp/src", "glm5next/src")

# (file under the copy, import planted at its end, the contract it breaks)
PLANTED = [
    pytest.param(
        "core/src/megamoe/core/numerics/formats.py",
        "from megamoe.core.checkpoint import reader",
        "megamoe.core layers",
        id="numerics-imports-checkpoint",
    ),
    pytest.param(
        "core/src/megamoe/core/modules/experts.py",
        "from megamoe.core.backends import reference",
        "megamoe.core layers",
        id="modules-imports-backends",
    ),
    pytest.param(
        "core/src/megamoe/core/errors.py",
        "from megamoe.core.loading import pairing",
        "megamoe.core layers",
        id="errors-imports-loading",
    ),
    pytest.param(
        "core/src/megamoe/core/kernels/launch.py",
        "from megamoe.core.backends import symm_buffer",
        "megamoe.core layers",
        id="kernels-imports-backends",
    ),
    pytest.param(
        "core/src/megamoe/core/adapters.py",
        "import megamoe.glm5next",
        "megamoe.core never imports an adapter",
        id="core-imports-adapter",
    ),
    pytest.param(
        "glm5next/src/megamoe/glm5next/block.py",
        "from megamoe.qwen4exp import config",
        "the adapters never import each other",
        id="adapter-imports-adapter",
    ),
]


def _copy(tmp_path: Path) -> Path:
    for src in SOURCES:
        shutil.copytree(ROOT / src, tmp_path / src, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / s) for s in SOURCES)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--no-cache", "--no-logo"],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    done = _lint_imports(_copy(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(("path", "line", "contract"), PLANTED)
def test_a_planted_import_breaks_its_contract(
    tmp_path: Path, path: str, line: str, contract: str
) -> None:
    tree = _copy(tmp_path)
    with (tree / path).open("a") as f:
        f.write(f"\n{line}  # planted\n")
    done = _lint_imports(tree)
    assert done.returncode != 0, done.stdout
    # (core importing an adapter also joins the two adapters through core: that breaks
    # their independence too)
    verdicts = [
        line
        for line in done.stdout.splitlines()
        if line.startswith(contract) and line.endswith((" KEPT", " BROKEN"))
    ]
    assert len(verdicts) == 1 and verdicts[0].endswith(" BROKEN"), done.stdout
