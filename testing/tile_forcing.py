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
