"""Repository-wide pytest options: the weight-format matrix used by ``nox -s tests``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FORMAT_PARAM_NAMES = ("fmt", "checkpoint_format", "weight_format", "run_format")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--weight-format",
        default="",
        help="run only format-parametrized tests for this format (bf16, fp8_block, mxfp8, "
        "mxfp4); tests that are not format-specific run under every value",
    )


def _formats_of(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    found = set()
    for name in FORMAT_PARAM_NAMES:
        value = callspec.params.get(name)
        if value is not None:
            found.add(str(getattr(value, "value", value)))
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--weight-format")
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        formats = _formats_of(item)
        (drop if formats and wanted not in formats else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# Test-only harnesses (testing/transformers_oracle.py) import by module name; no package
# under */src imports them, so transformers stays a test dependency.
sys.path.insert(0, str(Path(__file__).resolve().parent / "testing"))
