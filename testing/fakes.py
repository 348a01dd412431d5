"""The strict DeepGEMM fakes of ``core/tests``, each loaded once under one module name.

The test directories are no packages (pytest runs with ``--import-mode=importlib``), so the
fakes are loaded from their files; one shared name per fake keeps one module object, so
that the 0.2.5 fake and the tests see the same classes and error types.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CORE_TESTS = Path(__file__).resolve().parent.parent / "core" / "tests"


def load_fake(stem: str) -> ModuleType:
    """``core/tests/{stem}.py`` (e.g. ``fake_deep_gemm``), loaded on first use."""
    name = f"megamoe_tests_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CORE_TESTS / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
