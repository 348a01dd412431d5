"""The SwiGLU activation MegaMoE fuses, with the optional clamp some models apply.

GLM-5.3-Flash clamps before the activation (``swiglu_limit`` L): the gate from above only
(``gate <= L``) and the up projection on both sides (``-L <= up <= L``); then
``silu(gate) * up``. DeepGEMM's MegaMoE kernels apply the same clamp when given
``activation_clamp=L``. ``None`` means no clamp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_swiglu_limit(limit: float | None, owner: str) -> float | None:
    """``limit`` as a float, refused unless it is None or a finite number > 0.

    Raises:
        ValueError: names ``owner``, the value and the rule.
    """
    if limit is None:
        return None
    if (
        isinstance(limit, bool)
        or not isinstance(limit, int | float)
        or not (math.isfinite(limit) and limit > 0)
    ):
        raise ValueError(
            f"{owner}: swiglu_limit={limit!r} must be a finite number > 0, or None for no clamp"
        )
    return float(limit)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``; ``silu(gate) * up`` when ``limit`` is None."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
