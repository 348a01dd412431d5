"""Test, lint and type-check sessions for the megamoe monorepo.

CPU sessions install packages into fresh virtualenvs with torch pinned by
``constraints.txt`` (the CPU wheel); ``gpu_tests`` runs in the machine's own environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PACKAGES = {"core": "core", "qwen4exp": "qwen4exp", "glm5next": "glm5next"}
# Installed with each package: what it depends on inside the monorepo.
DEPENDS = {"core": (), "qwen4exp": ("core",), "glm5next": ("core",)}
FORMATS = ("bf16", "fp8_block", "mxfp8", "mxfp4")
TEST_DEPS = ("pytest>=8", "hypothesis>=6")
# The external oracle of the adapter and cross-package tests (testing/transformers_oracle.py):
# the release that ships qwen4_exp and glm5_next. A test dependency only.
ORACLE_DEPS = ("transformers==5.24.0",)
SOURCE_PATHS = ("core/src", "qwen4exp/src", "glm5next/src")

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, *packages: str) -> None:
    """Install monorepo packages (non-editable: tests see what users get) and test deps."""
    session.install(*CONSTRAINTS, *TEST_DEPS, *(f"./{PACKAGES[p]}" for p in packages))


def _run_tests(session: nox.Session, paths: list[str], *extra: str) -> None:
    # One intra-op thread: the test tensors are small, and torch's spinning worker threads
    # only contend with each other on CI's two cores.
    session.run("pytest", *paths, *extra, *session.posargs, env={"OMP_NUM_THREADS": "1"})


# Each distribution alone with only its own dependencies, then cross-package end-to-end
# tests over everything, once per weight format.
TEST_MATRIX = [nox.param(p, "", id=p) for p in PACKAGES] + [
    nox.param("all", f, id=f"all-{f}") for f in FORMATS
]


@nox.session
@nox.parametrize("target,weight_format", TEST_MATRIX)
def tests(session: nox.Session, target: str, weight_format: str) -> None:
    """CPU tests: one package alone, or everything for one weight format."""
    if target == "all":
        _install(session, "core", "qwen4exp", "glm5next")
        session.install(*CONSTRAINTS, *ORACLE_DEPS)
        _run_tests(session, ["tests"], f"--weight-format={weight_format}")
        return
    _install(session, *DEPENDS[target], target)
    if target != "core":
        session.install(*CONSTRAINTS, *ORACLE_DEPS)
    _run_tests(session, [f"{PACKAGES[target]}/tests"])


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy over every package."""
    session.install(*CONSTRAINTS, "mypy>=1.10", "torch", "safetensors", "tqdm", "pytest")
    session.run("mypy")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the mkdocs site (guides + API reference from docstrings) into site/."""
    _install(session, "core", "qwen4exp", "glm5next")
    session.install("mkdocs>=1.6", "mkdocstrings[python]>=0.26")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Run ``megamoe demo`` from a fresh install of every package."""
    _install(session, "core", "qwen4exp", "glm5next")
    session.run("megamoe", "demo", *session.posargs)


@nox.session(venv_backend="none", default=False)
def gpu_tests(session: nox.Session) -> None:
    """GPU tests (``-m gpu``) in this machine's own environment (its curated torch/CUDA)."""
    path = os.pathsep.join(
        [*(str(ROOT / p) for p in SOURCE_PATHS), os.environ.get("PYTHONPATH", "")]
    )
    session.env["PYTHONPATH"] = path
    session.run(
        "python3",
        "-m",
        "pytest",
        "-m",
        "gpu",
        "core/tests",
        "qwen4exp/tests",
        "glm5next/tests",
        "tests",
        *session.posargs,
    )
