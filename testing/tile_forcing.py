"""Forcing the small-batch kernels' tile shape in a test (on the GPU and in the interpreter)."""

from __future__ import annotations

from types import ModuleType

import pytest


def force_tiles(monkeypatch: pytest.MonkeyPatch, kernels: ModuleType, name: str) -> None:
    """Every call of ``kernels`` (``experts_small_batch``) takes its tile shape ``name``."""
    tiles = getattr(kernels, name)
    monkeypatch.setattr(kernels, "tiles_for", lambda tokens, top_k, num_experts: tiles)
