"""Float64 output of a GLM-5.3-Flash MoE layer straight from checkpoint tensors.

Independent of the loading path (no pairing, requantization or kernel layout): each
projection is read from the checkpoint and dequantized, and the layer is computed in
float64, with the model's SwiGLU clamp (``swiglu_limit``). Routed experts stored fused
read as their per-expert slices (``CheckpointReader.get_tensor``). It checks a loaded
``Glm5NextMegaMoeBlock``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megamoe.core.checkpoint.quant_config import detect_expert_format, detect_mlp_format
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.swiglu import swiglu
from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.router import grouped_topk, routing_of

if TYPE_CHECKING:
    from megamoe.core.checkpoint.layers import MoELayer
    from megamoe.core.checkpoint.reader import CheckpointReader

_PROJS = ("gate_proj", "up_proj", "down_proj")


def _dense_projection(
    reader: CheckpointReader, prefix: str, fmt: WeightFormat, block: tuple[int, int]
) -> torch.Tensor:
    """One projection ``prefix`` (e.g. ``...experts.3.up_proj``) as float64."""
    weight, scale = reader.read_projection(prefix, fmt)
    return quant.dequantize(weight, scale, fmt, block_size=block).double()


def _mlp(x: torch.Tensor, projs: list[torch.Tensor], limit: float | None) -> torch.Tensor:
    """``down(swiglu(gate x, up x))`` for ``projs = [gate, up, down]``, clamped at ``limit``."""
    gate, up, down = projs
    return swiglu(x @ gate.T, x @ up.T, limit) @ down.T


def reference_forward(
    reader: CheckpointReader, layer: MoELayer, hidden_states: torch.Tensor
) -> torch.Tensor:
    """Routed plus shared output of ``layer`` for ``hidden_states``, float64.

    Args:
        reader: the checkpoint.
        layer: the MoE layer (one of ``reader.layers``).
        hidden_states: (tokens, H), any float dtype (computed in float64).

    Returns:
        (tokens, H) float64.
    """
    prefix = layer.prefix
    cfg = Glm5NextConfig.from_dict(reader.config)
    x = hidden_states.double().cpu()
    block = cfg.weight_block_size
    router = reader.get_tensor(f"{prefix}.gate.weight").double()
    bias = reader.get_tensor(f"{prefix}.gate.e_score_correction_bias").double()
    topk_weights, topk_ids = grouped_topk(torch.sigmoid(x @ router.T), bias, **routing_of(cfg))
    fmt = detect_expert_format(
        cfg.quantization_config, f"{prefix}.experts", num_experts=cfg.n_routed_experts
    )
    out = torch.zeros_like(x)
    for expert in sorted(set(topk_ids.flatten().tolist())):
        token, k = (topk_ids == expert).nonzero().unbind(1)
        projs = [
            _dense_projection(reader, f"{prefix}.experts.{expert}.{p}", fmt, block) for p in _PROJS
        ]
        routed = _mlp(x[token], projs, cfg.swiglu_limit)
        out.index_add_(0, token, routed * topk_weights[token, k, None])
    if cfg.n_shared_experts:
        shared_prefix = f"{prefix}.shared_experts"
        shared_fmt = detect_mlp_format(cfg.quantization_config, shared_prefix)
        projs = [
            _dense_projection(reader, f"{shared_prefix}.{p}", shared_fmt, block) for p in _PROJS
        ]
        out += _mlp(x, projs, cfg.swiglu_limit)
    return out
