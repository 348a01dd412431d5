"""megamoe-glm5next: GLM-5.3-Flash experts (block-FP8 checkpoint) on DeepGEMM MegaMoE."""

from megamoe.glm5next.adapter import ADAPTER, Glm5NextAdapter
from megamoe.glm5next.block import Glm5NextMegaMoeBlock
from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.experts import Glm5NextMegaMoEExperts
from megamoe.glm5next.reference import reference_forward
from megamoe.glm5next.router import Glm5NextRouter, grouped_topk

__all__ = [
    "ADAPTER",
    "Glm5NextAdapter",
    "Glm5NextConfig",
    "Glm5NextMegaMoEExperts",
    "Glm5NextMegaMoeBlock",
    "Glm5NextRouter",
    "grouped_topk",
    "reference_forward",
]
