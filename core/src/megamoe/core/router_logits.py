"""A MoE router's logits, ``x @ weight^T`` in float32: exact products, float32 sums.

Both adapters route on float32 logits of bf16 activations (Qwen4Exp's bf16 router weight,
GLM-5.3-Flash's float32 one), and the one-launch router kernel takes torch's GEMM for them
on large calls. On CUDA a bf16 weight goes straight into one GEMM with a float32 output
(``torch.mm(..., out_dtype=)``; torch has no CPU kernel for it), where widening both
operands first would add two casts. Elsewhere both are widened to float32: the same
products (a bf16 times a bf16 is exact in float32) and float32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["router_logits"]


def router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden_states @ weight^T`` in float32.

    Args:
        hidden_states: (..., H) activations.
        weight: (E, H) router weight.

    Returns:
        (..., E) float32.
    """
    if (
        hidden_states.is_cuda
        and hidden_states.dim() == 2
        and hidden_states.dtype == weight.dtype == torch.bfloat16
    ):
        return torch.mm(hidden_states, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden_states.float(), weight.float())
