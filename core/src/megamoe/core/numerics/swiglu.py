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


def gate_up_bounds(
    limit: float | None,
    intermediate_size: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.Tensor | None:
    """Per-column clamp bounds ``(2, 2I)`` of a stacked ``[gate | up]`` row, None for no clamp.

    Row 0 is the lower bound (-inf under the gate, -L under up), row 1 the upper (L).
    Rounding is monotone, so clamping to ``L`` rounded to ``dtype`` gives the same bits as
    clamping to ``L`` and rounding: one clamp replaces :func:`swiglu`'s two.
    """
    if limit is None:
        return None
    lower = torch.full((2 * intermediate_size,), -limit, dtype=dtype, device=device)
    lower[:intermediate_size] = -torch.inf
    return torch.stack([lower, torch.full_like(lower, limit)])


def swiglu_gate_up(gate_up: torch.Tensor, bounds: torch.Tensor | None) -> torch.Tensor:
    """:func:`swiglu` of a stacked ``[gate | up]`` (..., 2I) in three kernels (two unclamped).

    Args:
        gate_up: the first projection's output, gate columns first.
        bounds: :func:`gate_up_bounds` in ``gate_up``'s dtype, None for no clamp.
    """
    if bounds is not None:
        gate_up = torch.clamp(gate_up, bounds[0], bounds[1])
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
