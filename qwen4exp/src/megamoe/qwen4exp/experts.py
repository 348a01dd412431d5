"""Qwen4Exp routed experts: per-expert or fused checkpoint tensors into MegaMoE's layout."""

from __future__ import annotations

from megamoe.core.modules.experts import MegaMoEExperts


class Qwen4ExpMegaMoEExperts(MegaMoEExperts):
    """The routed experts of one Qwen4Exp MoE layer on this rank, in the run format.

    Accepts the per-expert tensors ``{e}.{gate,up,down}_proj.{weight,<scale>}`` (scale name
    by checkpoint format; ``weight_packed`` for MXFP4) and, for BF16 checkpoints, the fused
    ``gate_up_proj`` (E, 2I, H; gate rows first) and ``down_proj`` (E, H, I), as
    ``MegaMoEExperts.load_weights`` does. Only this rank's experts (redundant replicas
    included) are kept. A projection stored in the run format is staged as is; otherwise it
    is requantized as soon as its weight and scale are both in. ``finalize()`` names any
    projection still missing a half.

    Constructor arguments are those of ``MegaMoEExperts``.
    """
