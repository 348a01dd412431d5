"""Forcing the small-batch kernels' tile shape in a test (on the GPU and in the interpreter)."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest


def force_tiles(monkeypatch: pytest.MonkeyPatch, kernels: ModuleType, tiles: Any) -> None:
    """Every call of ``kernels`` (``experts_small_batch``) takes ``tiles``.

    ``tiles``: a tile shape's name in the module, or a ``Tiles`` (``variant``'s).
    """
    shape = getattr(kernels, tiles) if isinstance(tiles, str) else tiles
    monkeypatch.setattr(
        kernels, "tiles_for", lambda tokens, top_k, num_experts, expert_bytes: shape
    )


def variant(kernels: ModuleType, name: str, **changes: Any) -> Any:
    """The module's tile shape ``name`` with ``changes`` (a ``Tiles`` to force)."""
    return dataclasses.replace(getattr(kernels, name), **changes)


# WIDE_TILES as it was until the fourteenth session (docs/gpu.md): the weights' rows as the
# dots' rows, compiler-chosen registers (255 and 249 a thread), 4 stages, two programs per SM.
# Interpreted and GPU tests check the production tiles give its bits; h200.sh times it.
WEIGHT_ROWS_WIDE = {
    "token_rows": False, "max_registers": 0, "stages": 4, "l1_per_sm": 2, "l2_per_sm": 2,
}  # fmt: skip


def weight_rows_spec(base: str = "WIDE_TILES") -> str:
    """``WEIGHT_ROWS_WIDE`` over ``base``, written as ``--tiles`` takes it.

    The ``--tiles`` of ``bench_tiles.py`` and ``kernel_resources.py``.
    """
    changes = ",".join(f"{field}={value}" for field, value in WEIGHT_ROWS_WIDE.items())
    return f"{base}:{changes}"
