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
    monkeypatch.setattr(kernels, "tiles_for", lambda tokens, top_k, num_experts: shape)


def variant(kernels: ModuleType, name: str, **changes: Any) -> Any:
    """The module's tile shape ``name`` with ``changes`` (a ``Tiles`` to force)."""
    return dataclasses.replace(getattr(kernels, name), **changes)


# The candidate past 32 pairs per expert (docs/gpu.md, thirteenth session): WIDE_TILES with
# the tokens as the dots' rows, three programs per SM of at most 168 registers a thread and
# 3 stages (kernel_resources.py: no spill, three fit); benchmarks/h200.sh times it beside
# WIDE_TILES. Both interpreted and GPU tests check it gives the production tiles' bits.
TOKEN_ROWS_CANDIDATE = {
    "token_rows": True, "max_registers": 168, "stages": 3, "l1_per_sm": 3, "l2_per_sm": 3,
}  # fmt: skip


def candidate_spec(base: str = "WIDE_TILES") -> str:
    """``TOKEN_ROWS_CANDIDATE`` over ``base``, written as ``--tiles`` takes it.

    The ``--tiles`` of ``bench_tiles.py`` and ``kernel_resources.py``.
    """
    changes = ",".join(f"{field}={value}" for field, value in TOKEN_ROWS_CANDIDATE.items())
    return f"{base}:{changes}"
