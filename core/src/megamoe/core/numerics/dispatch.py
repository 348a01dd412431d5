"""The Hopper kernel's FP8 input buffer: its layout, which a router kernel can fill directly.

``DispatchBuffer`` is a plain layout rule (dtypes, shapes, the scale per 128 columns), so
the backend that owns such a buffer (``megamoe.core.backends.deepgemm``), the experts
module that hands it out (``megamoe.core.modules.experts``) and the router kernel that
writes it (``megamoe.core.kernels.router_triton``) all stand on this one definition.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DISPATCH_GROUP = 128  # columns per float32 scale of the Hopper kernel's FP8 input
DISPATCH_AMAX_FLOOR = 1e-10  # the Hopper pre-dispatch clamps a group's amax to this
_DISPATCH_DTYPES = (torch.float8_e4m3fn, torch.float32, torch.int64, torch.float32)


class DispatchBuffer(NamedTuple):
    """A kernel's input buffer that the router kernel can fill instead of the pre-dispatch.

    DeepGEMM's Hopper MegaMoE kernel reads this rank's tokens from its symmetric buffer,
    which ``mega_moe_pre_dispatch_sm90`` fills: the tokens cast to FP8 E4M3 with a float32
    scale per 128 columns (``scale = max(amax, 1e-10) / 448``, values ``x * (1 / scale)``, both
    divisions exact), the ids as int64 and the weights, then id -1 and weight 0 in every
    row from the call's tokens to the buffer's end. The one-launch router writes the same
    bits while it routes (``megamoe.core.kernels.router_triton``), one launch fewer per
    layer. Rows: the buffer's capacity in tokens.

    Attributes:
        x: (rows, H) float8_e4m3fn.
        x_scale: (rows, H / DISPATCH_GROUP) float32.
        topk_ids: (rows, top_k) int64.
        topk_weights: (rows, top_k) float32.
    """

    x: torch.Tensor
    x_scale: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    def fits(self, hidden: int, top_k: int) -> bool:
        """Whether the four tensors have the dtypes, shapes and row-major layout above.

        For ``hidden`` columns (a multiple of ``DISPATCH_GROUP``) and ``top_k`` slots.
        """
        rows = self.x.shape[0]
        shapes = ((rows, hidden), (rows, hidden // DISPATCH_GROUP), (rows, top_k), (rows, top_k))
        return (
            hidden % DISPATCH_GROUP == 0
            and tuple(t.dtype for t in self) == _DISPATCH_DTYPES
            and tuple(t.shape for t in self) == shapes
            and all(t.is_contiguous() for t in self)
        )

    def routing(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``tokens`` rows' weights (float32) and ids (int64), views of the buffer."""
        return self.topk_weights[:tokens], self.topk_ids[:tokens]
