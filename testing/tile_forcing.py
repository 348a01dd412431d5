"""Forcing the small-batch kernels' tile shape in a test (on the GPU and in the interpreter)."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest


def force_tiles(monkeypatch: pytest.MonkeyPatch, kernels: ModuleType, tiles: Any) -> None:
    """Every call of ``kernels`` (``experts_small_batch``) takes ``tiles``.

    ``tiles``: a tile shape's name in the module, or a ``Tiles`` (``with_variant``'s).
    """
    shape = getattr(kernels, tiles) if isinstance(tiles, str) else tiles
    monkeypatch.setattr(kernels, "tiles_for", lambda tokens, top_k, num_experts: shape)


def with_variant(
    monkeypatch: pytest.MonkeyPatch, kernels: ModuleType, name: str, **changes: Any
) -> Any:
    """The module's tile shape ``name`` with ``changes``, for the kernels built after this.

    They make each shape's launch constants when constructed, from ``ALL_TILES``.
    """
    variant = dataclasses.replace(getattr(kernels, name), **changes)
    monkeypatch.setattr(kernels, "ALL_TILES", (*kernels.ALL_TILES, variant))
    return variant
