"""A MoE router's logits, ``x @ weight^T`` in float32: exact products, float32 sums.

Both adapters route on float32 logits of bf16 activations (Qwen4Exp's bf16 router weight,
GLM-5.3-Flash's float32 one), and the one-launch router kernel takes torch's GEMM for them
on large calls. On CUDA a bf16 weight goes straight into one GEMM with a float32 output
(``torch.mm(..., out_dtype=)``; torch has no CPU kernel for it), where widening both
operands first would add two casts. Elsewhere both are widened to float32: the same
products (a bf16 times a bf16 is exact in float32) and float32 sums.

A float32 weight can also be split into three bf16 parts (``weight_planes``): one bf16
GEMM of the activations against them gives three exact products per logit, which the
one-launch router's selection adds, instead of a float32 GEMM of widened activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PLANES", "router_logits", "weight_planes"]

PLANES = 3  # the bf16 parts of a float32 weight (``weight_planes``)


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


def weight_planes(weight: torch.Tensor) -> torch.Tensor:
    """A float32 router weight (E, H) as its three bf16 parts stacked, (3E, H).

    ``hi = bf16(w)``, ``mid = bf16(w - hi)``, ``lo = bf16(w - hi - mid)``: the parts the
    kernel splits in registers, which hold the weight to 2^-24 relative. A bf16 activation
    times each is exact in float32, so one bf16 GEMM against the stack gives the three
    products whose sum is the float32 logit.
    """
    hi = weight.to(torch.bfloat16)
    rest = weight - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.cat([hi, mid, (rest - mid.float()).to(torch.bfloat16)])
