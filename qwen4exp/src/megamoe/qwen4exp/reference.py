"""Float64 forward of a Qwen4Exp MoE layer straight from its checkpoint tensors.

Independent of the loading path (no experts module, no requantization, no backend): every
tensor is read from the checkpoint and dequantized (fused experts as their per-expert
slices, ``CheckpointReader.get_tensor``), and the layer is computed in float64.
It checks a loaded block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megamoe.core.checkpoint.quant_config import detect_expert_format, detect_mlp_format
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.qwen4exp.config import Qwen4ExpConfig

if TYPE_CHECKING:
    from megamoe.core.checkpoint.layers import MoELayer
    from megamoe.core.checkpoint.reader import CheckpointReader

_PROJS = ("gate_proj", "up_proj", "down_proj")


def _projection(reader: CheckpointReader, stem: str, fmt: WeightFormat) -> torch.Tensor:
    """One projection ``{stem}.*`` (weight, scales as the checkpoint names them), as float64."""
    weight, scale = reader.read_projection(stem, fmt)
    return quant.dequantize(weight, scale, fmt).double()


def _swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def reference_forward(
    reader: CheckpointReader, layer: MoELayer, hidden_states: torch.Tensor
) -> torch.Tensor:
    """The MoE layer ``layer`` applied to ``hidden_states``, in float64 on the CPU.

    Router softmax over all experts, top-k, renormalized when ``norm_topk_prob``; every
    selected expert's SwiGLU output weighted and summed; plus the shared expert times
    ``sigmoid(shared_expert_gate(x))``.

    Args:
        reader: the checkpoint.
        layer: the MoE layer (one of ``reader.layers``).
        hidden_states: (tokens, hidden_size), any float dtype.

    Returns:
        (tokens, hidden_size) float64.
    """
    prefix = layer.prefix
    cfg = Qwen4ExpConfig.from_dict(reader.config)
    quant_config = cfg.quantization_config
    x = hidden_states.detach().cpu().double()
    router = reader.get_tensor(f"{prefix}.gate.weight").double()
    probs = torch.softmax(F.linear(x, router), dim=-1)
    topk_weights, topk_ids = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)

    experts = f"{prefix}.experts"
    fmt = detect_expert_format(quant_config, experts, num_experts=cfg.num_experts)
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        gate, up, down = (_projection(reader, f"{experts}.{expert}.{p}", fmt) for p in _PROJS)
        rows, slot = (topk_ids == expert).nonzero(as_tuple=True)
        weight = topk_weights[rows, slot].unsqueeze(-1)
        out.index_add_(0, rows, weight * _swiglu(x[rows], gate, up, down))

    shared = f"{prefix}.shared_expert"
    shared_fmt = detect_mlp_format(quant_config, shared)
    gate, up, down = (_projection(reader, f"{shared}.{p}", shared_fmt) for p in _PROJS)
    shared_gate = reader.get_tensor(f"{prefix}.shared_expert_gate.weight").double()
    return out + _swiglu(x, gate, up, down) * torch.sigmoid(F.linear(x, shared_gate))
