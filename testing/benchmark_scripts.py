"""Load a script of ``benchmarks/`` as a module, for tests of its functions on the CPU.

The scripts import each other (``bench_decode``, ``harness``) by name, as they do when run
from that folder, so the folder is on ``sys.path`` while one loads.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, executed as a module named ``name``.

    It is in ``sys.modules`` under that name, where its dataclasses look their module up.
    """
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))
