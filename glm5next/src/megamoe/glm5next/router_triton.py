"""The GLM router's selection on given logits in one Triton launch: the torch path's bits.

``router.route_logits`` calls :func:`grouped_topk_triton` for CUDA logits when Triton
imports and the shape is covered (:func:`triton_covers`); everything else runs the torch
path, ``router.grouped_topk``. The kernel is core's router kernel
(``megamoe.core.kernels.router_triton``, sigmoid scoring) with the logits given; there the
bit-for-bit rules are written down: torch's CUDA sigmoid, float keys ordered as torch
sorts them (NaN largest), ties to the lower index, the chosen experts in decreasing biased
score; only the renormalizing sum may add in another order (weights a few ulp apart, ids
never).

``tests/test_router_triton.py`` checks all of it on a GPU (the sigmoid over 2^20 logits
from -120 to 120 and the special values, bit for bit on the H200 with Triton 3.6).
"""

from __future__ import annotations

from functools import cache

import torch

from megamoe.core.kernels.router_triton import SCORE_SIGMOID, TritonRouter
from megamoe.core.kernels.router_triton import covers as triton_covers
from megamoe.glm5next.config import check_group_settings

__all__ = ["grouped_topk_triton", "triton_covers"]

# One kernel object per setting, built and checked on the first call with it.
_kernel = cache(TritonRouter)


def grouped_topk_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router.grouped_topk(torch.sigmoid(logits), ...)`` in one kernel launch.

    Args:
        logits: (tokens, E) float32 router logits on a CUDA device.
        correction_bias: (E,) float32 selection bias on the same device.
        top_k: experts per token (at most 16).
        n_group: router groups (E a multiple, at least 2 experts per group, at most 16).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier.

    Returns:
        ``(topk_weights float32, topk_ids int32)``, each (tokens, top_k), in decreasing
        biased score (ties: lower id first).

    Raises:
        ValueError: dtypes, shapes or group settings the router does not allow, or a
            shape :func:`triton_covers` rejects.
    """
    num_experts = logits.shape[-1]
    if logits.dtype != torch.float32 or correction_bias.dtype != torch.float32:
        raise ValueError(
            f"router (triton): logits are {logits.dtype} and the bias {correction_bias.dtype}; "
            "both must be torch.float32 (the router runs in float32)"
        )
    # raises for shapes the kernel does not cover
    kernel = _kernel(
        SCORE_SIGMOID,
        num_experts,
        top_k,
        bool(norm_topk_prob),
        n_group,
        topk_group,
        float(routed_scaling_factor),
    )
    check_group_settings(num_experts, correction_bias, top_k, n_group, topk_group)
    return kernel.select(logits.contiguous(), correction_bias.contiguous())
