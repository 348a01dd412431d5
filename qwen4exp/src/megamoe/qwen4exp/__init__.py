"""megamoe-qwen4exp: Qwen4Exp routed experts and MoE block on DeepGEMM MegaMoE."""

from megamoe.qwen4exp.adapter import ADAPTER, Qwen4ExpAdapter
from megamoe.qwen4exp.block import Qwen4ExpMegaMoeBlock
from megamoe.qwen4exp.config import Qwen4ExpConfig
from megamoe.qwen4exp.experts import Qwen4ExpMegaMoEExperts
from megamoe.qwen4exp.reference import reference_forward

__all__ = [
    "ADAPTER",
    "Qwen4ExpAdapter",
    "Qwen4ExpConfig",
    "Qwen4ExpMegaMoEExperts",
    "Qwen4ExpMegaMoeBlock",
    "reference_forward",
]
