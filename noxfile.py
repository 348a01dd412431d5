"""Test, lint and type-check sessions for the megamoe monorepo.

CPU sessions install packages into fresh virtualenvs with torch pinned by
``constraints.txt`` (the CPU wheel); ``gpu_tests`` runs in the machine's own environment.
``build`` writes the four distributions' wheels into ``dist/``; ``install`` installs one
adapter alone from there, as the README says; ``docs`` builds the site (offline-safe).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PACKAGES = {"core": "core", "qwen4exp": "qwen4exp", "glm5next": "glm5next"}
# Every distribution's folder: the three packages and the umbrella.
DISTRIBUTIONS = ("core", "qwen4exp", "glm5next", "packages/megamoe")
DIST = ROOT / "dist"
# Installed with each package: what it depends on inside the monorepo.
DEPENDS = {"core": (), "qwen4exp": ("core",), "glm5next": ("core",)}
FORMATS = ("bf16", "fp8_block", "mxfp8", "mxfp4")
TEST_DEPS = ("pytest>=8", "hypothesis>=6")
# The external oracle of the adapter and cross-package tests (testing/transformers_oracle.py):
# the release that ships qwen4_exp and glm5_next. A test dependency only.
ORACLE_DEPS = ("transformers==5.24.0",)
SOURCE_PATHS = ("core/src", "qwen4exp/src", "glm5next/src")
# The layers of megamoe.core as contracts ([tool.importlinter] in pyproject.toml).
IMPORT_LINTER = "import-linter==2.17"
# The site's generator, pinned: a build that passes --strict today passes tomorrow.
DOCS_DEPS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
)
# The Triton kernels (small-batch experts, requantization) in Triton's CPU interpreter
# (core/kernel_tests/): the H200's Triton, and a numpy its interpreter runs on (it reads
# one-element arrays with int()).
INTERPRETER_DEPS = ("triton==3.6.0", "numpy<2.4")
GPU_TEST_MODULES = ("pytest",)  # what gpu_tests needs in the machine's own environment

nox.options.sessions = ["lint", "typecheck", "tests", "install"]
nox.options.reuse_existing_virtualenvs = True
# Each CPU session's virtualenv holds its own torch (about 1 GB; the README's full run makes
# eleven of them). A session's virtualenv is removed when the session ends, so a run needs
# room for one at a time; MEGAMOE_NOX_KEEP_VENVS=1 keeps them, and nox then reuses them.
KEEP_VENVS = os.environ.get("MEGAMOE_NOX_KEEP_VENVS") == "1"


def _removes_its_venv(func: Callable[..., None]) -> Callable[..., None]:
    """The session's virtualenv is removed when it ends, passed or failed, unless kept."""

    @functools.wraps(func)
    def session_then_remove(session: nox.Session, **params: str) -> None:
        try:
            func(session, **params)
        finally:
            if not KEEP_VENVS:
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    return session_then_remove


def _install(session: nox.Session, *packages: str) -> None:
    """Install monorepo packages (non-editable: tests see what users get) and test deps."""
    session.install(*CONSTRAINTS, *TEST_DEPS, *(f"./{PACKAGES[p]}" for p in packages))


def _run_tests(
    session: nox.Session, paths: list[str], *extra: str, env: dict[str, str] | None = None
) -> None:
    # One intra-op thread: the test tensors are small, and torch's spinning worker threads
    # only contend with each other on CI's two cores.
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    session.run("pytest", *paths, *extra, *session.posargs, env=env)


# Each distribution alone with only its own dependencies, the GPU kernels in Triton's
# interpreter, then cross-package end-to-end tests over everything, once per weight format.
TEST_MATRIX = (
    [nox.param(p, "", id=p) for p in PACKAGES]
    + [nox.param("kernels", "", id="kernels")]
    + [nox.param("all", f, id=f"all-{f}") for f in FORMATS]
)


@nox.session
@nox.parametrize("target,weight_format", TEST_MATRIX)
@_removes_its_venv
def tests(session: nox.Session, target: str, weight_format: str) -> None:
    """CPU tests: one package alone, the kernels interpreted, or everything for one format."""
    if target == "kernels":
        _install(session, "core")
        session.install(*CONSTRAINTS, *INTERPRETER_DEPS)
        _run_tests(session, ["core/kernel_tests"], env={"TRITON_INTERPRET": "1"})
        return
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
@_removes_its_venv
def lint(session: nox.Session) -> None:
    """Ruff lint and format check; the import-linter contracts (pyproject.toml) and their test.

    ``lint-imports`` reads the sources (grimp finds them on PYTHONPATH; nothing is
    imported), then ``tests/test_import_layers.py`` shows that a planted wrong-way import
    breaks each contract.
    """
    session.install("ruff>=0.6", IMPORT_LINTER, "pytest>=8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = os.pathsep.join(str(ROOT / p) for p in SOURCE_PATHS)
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": sources})
    session.run("pytest", "tests/test_import_layers.py", "-p", "no:cacheprovider")


@nox.session
@_removes_its_venv
def typecheck(session: nox.Session) -> None:
    """Mypy over every package."""
    session.install(*CONSTRAINTS, "mypy>=1.10", "torch", "safetensors", "tqdm", "pytest")
    session.run("mypy")


@nox.session(default=False)
@_removes_its_venv
def docs(session: nox.Session) -> None:
    """Build the site (mkdocs-material, API pages from the docstrings) into site/, --strict.

    The API pages are read from the sources and the CLI reference from the argument parser
    (which imports no torch), so nothing but the generator is installed. The build fails
    on a page that loads a remote asset (docs/hooks/no_outside_references.py).
    """
    session.install(*DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


def _build_wheels(session: nox.Session) -> None:
    """Wheels of every distribution into dist/, older megamoe wheels there removed."""
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("megamoe*.whl"):
        old.unlink()
    folders = (str(ROOT / d) for d in DISTRIBUTIONS)
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(DIST), *folders)


@nox.session
@_removes_its_venv
def build(session: nox.Session) -> None:
    """Wheels of megamoe-core, megamoe-qwen4exp, megamoe-glm5next and megamoe into dist/."""
    _build_wheels(session)
    session.log("wheels: " + ", ".join(sorted(p.name for p in DIST.glob("megamoe*.whl"))))


@nox.session
@_removes_its_venv
def install(session: nox.Session) -> None:
    """megamoe-glm5next alone from dist/ (README "Install"), then install_tests/ on it.

    Every megamoe distribution is removed from the session's environment first, so what
    the tests see is what ``pip install --find-links dist megamoe-glm5next`` brought;
    torch comes pinned by constraints.txt (the CPU wheel).
    """
    _build_wheels(session)
    names = ("megamoe", "megamoe-core", "megamoe-qwen4exp", "megamoe-glm5next")
    session.run("python", "-m", "pip", "uninstall", "--yes", *names, silent=True)
    session.install(*CONSTRAINTS, "--find-links", str(DIST), "megamoe-glm5next", "pytest>=8")
    # From a folder outside the checkout: nothing of the sources is importable by accident.
    tmp = Path(session.create_tmp()).resolve()
    shutil.copytree(ROOT / "install_tests", tmp / "install_tests", dirs_exist_ok=True)
    session.chdir(tmp)
    session.run(
        "pytest",
        "install_tests",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp),
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session
@_removes_its_venv
def demo(session: nox.Session) -> None:
    """Run ``megamoe demo`` from a fresh install of every package."""
    _install(session, "core", "qwen4exp", "glm5next")
    session.run("megamoe", "demo", *session.posargs)


def _wheel_of(package: str) -> Path | None:
    """The newest ``nox -s build`` wheel of ``package`` in dist/, None without one."""
    name = f"megamoe_{package}-*.whl"
    wheels = sorted(DIST.glob(name), key=lambda w: w.stat().st_mtime)
    return wheels[-1] if wheels else None


def _wheel_drift(wheel: Path, package: str) -> list[str]:
    """The package's sources that ``wheel`` holds otherwise, lacks, or holds no longer.

    Compared by the sha256 of each file in the wheel's RECORD against the checkout's
    ``src/`` (its ``.py`` files and ``py.typed``).
    """
    src = ROOT / PACKAGES[package] / "src"
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        lines = archive.read(record).decode().splitlines()
    held: dict[str, str] = {}
    for line in lines:
        path, digest, _size = line.rsplit(",", 2)
        if path.startswith("megamoe/") and digest.startswith("sha256="):
            held[path] = digest.removeprefix("sha256=")
    sources = [f for f in src.rglob("*") if f.suffix == ".py" or f.name == "py.typed"]
    drift = []
    for source in sorted(sources):
        name = source.relative_to(src).as_posix()
        sha256 = hashlib.sha256(source.read_bytes()).digest()
        if held.pop(name, None) != base64.urlsafe_b64encode(sha256).rstrip(b"=").decode():
            drift.append(name)
    return drift + sorted(held)  # what is left: files the checkout no longer has


def _install_for_gpu_tests(session: nox.Session) -> None:
    """core, qwen4exp and glm5next into this machine's python3, without dependencies.

    Offline, never touching torch: ``pip install --no-deps --no-index``, from this checkout
    when hatchling (the build backend) is importable here (``--no-build-isolation``), else
    from the wheels ``nox -s build`` wrote into dist/ (on a machine with an index; copy
    dist/ along; wheels whose files differ from this checkout's sources are refused). So the
    GPU run discovers the adapters through the installed entry points and runs the installed
    ``megamoe`` command, as users do.
    """
    pip = ("python3", "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall")
    has_hatchling = session.run(
        "python3",
        "-c",
        "import importlib.util; print(importlib.util.find_spec('hatchling') is not None)",
        silent=True,
    )
    if has_hatchling and has_hatchling.strip() == "True":
        session.run(*pip, "--no-build-isolation", *(str(ROOT / PACKAGES[p]) for p in PACKAGES))
        return
    wheels = {p: _wheel_of(p) for p in PACKAGES}
    missing = [p for p, wheel in wheels.items() if wheel is None]
    if missing:
        session.error(
            "gpu_tests installs megamoe-core, -qwen4exp and -glm5next without dependencies "
            "and without an index: this python3 lacks hatchling (to build them here) and "
            f"dist/ lacks the wheels of {', '.join(missing)}: run `nox -s build` where a "
            "package index is reachable and copy dist/ here, or python3 -m pip install "
            "hatchling"
        )
    # Wheels of another checkout would test other code than this one's, silently.
    drift = {w.name: _wheel_drift(w, p) for p, w in wheels.items() if w is not None}
    stale = {name: files for name, files in drift.items() if files}
    if stale:
        named = "; ".join(
            f"{name}: {len(files)} file(s), e.g. {files[0]}" for name, files in stale.items()
        )
        session.error(
            f"dist/ holds wheels of other sources than this checkout's ({named}): rebuild them "
            "where hatchling is (nox -s build, or python3 -m pip wheel --no-deps ./core "
            "./qwen4exp ./glm5next -w dist) and copy dist/ here"
        )
    session.run(*pip, *(str(w) for w in wheels.values() if w is not None))


@nox.session(venv_backend="none", default=False)
def gpu_tests(session: nox.Session) -> None:
    """GPU tests (``-m gpu``) in this machine's own environment (its curated torch/CUDA).

    Needs pytest there (``python3 -m pip install pytest``); says so before running. The
    three packages are installed there first, without dependencies and offline
    (``_install_for_gpu_tests``), and the tests import those installed copies.
    """
    missing = session.run(
        "python3",
        "-c",
        "import importlib.util, sys; "
        f"print(' '.join(m for m in {GPU_TEST_MODULES!r} if importlib.util.find_spec(m) is None))",
        silent=True,
    )
    if missing and missing.strip():
        session.error(
            f"gpu_tests runs in this machine's python3, which lacks {missing.strip()}: "
            f"python3 -m pip install {missing.strip()}"
        )
    _install_for_gpu_tests(session)
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
        # Two intra-op threads a process: the tests build their weights on the CPU, and xdist
        # workers each starting one thread per core stalled one another (docs/gpu.md).
        env={"OMP_NUM_THREADS": "2"},
    )
