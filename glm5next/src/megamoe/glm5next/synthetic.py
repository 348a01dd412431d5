"""Small GLM-5.3-Flash checkpoints in Hugging Face layout, for the demo and tests."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.hf_config import text_config
from megamoe.core.checkpoint.layers import COMPOSITE_DECODER, MLP, MoELayer
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat
from megamoe.core.testing import synthetic_dense, synthetic_expert_tensors
from megamoe.glm5next.config import (
    ARCHITECTURE,
    GLM5_NEXT,
    GLM5_NEXT_TEXT,
    MLP_DENSE,
    MLP_SPARSE,
    Glm5NextConfig,
)

# Clamps a share of the SwiGLU inputs of the synthetic experts (activations of order one),
# so the demo and tests exercise the clamp as the real model's limit of 10 does its own.
SWIGLU_LIMIT = 0.75
ROUTER_STD = 0.05  # router weight magnitude: logits of order one for unit activations
BIAS_STD = 0.05  # e_score_correction_bias: moves selection, comparable to score gaps
ROUTED_SCALING_FACTOR = 2.5
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK_FP8_DEFAULT),
}
_DENSE = ("gate", "shared_experts")  # modules an NVFP4 synthetic checkpoint keeps BF16


def _router_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """``(n_group, topk_group)``: the most groups (up to 4) the sizes allow."""
    for n_group in (4, 2):
        per_group, topk_group = num_experts // n_group, max(1, n_group // 2)
        if num_experts % n_group == 0 and per_group >= 2 and top_k <= topk_group * per_group:
            return n_group, topk_group
    return 1, 1


def synthetic_config(fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
    """A ``config.json`` with one dense layer, ``sizes.num_layers`` MoE layers and one MTP layer.

    Laid out as the release: a composite ``glm5_next`` config with the text model's keys
    under ``text_config`` (layers at ``model.language_model.layers.{L}``, ``mlp_layer_types``
    marking the sparse ones, the MTP layer at decoder index ``num_hidden_layers``) and
    ``quantization_config`` at the top level: block-FP8, or ModelOpt NVFP4 routed experts
    (dense MLP, routers and shared experts BF16).

    Raises:
        ValueError: a shared-expert size that is not a multiple of the expert size (GLM's
            shared MLP is ``n_shared_experts`` experts wide).
    """
    inter, shared = sizes.intermediate_size, sizes.shared_intermediate_size
    if shared <= 0 or shared % inter:
        raise ValueError(
            f"shared_intermediate_size={shared} must be a positive multiple of "
            f"intermediate_size={inter} for {ARCHITECTURE} (n_shared_experts experts wide)"
        )
    n_group, topk_group = _router_groups(sizes.num_experts, sizes.top_k)
    text: dict[str, Any] = {
        "model_type": GLM5_NEXT_TEXT,
        "hidden_size": sizes.hidden_size,
        "intermediate_size": 2 * inter,
        "moe_intermediate_size": inter,
        "n_routed_experts": sizes.num_experts,
        "num_experts_per_tok": sizes.top_k,
        "n_shared_experts": shared // inter,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "swiglu_limit": SWIGLU_LIMIT,
        "num_hidden_layers": sizes.num_layers + 1,
        "mlp_layer_types": [MLP_DENSE] + [MLP_SPARSE] * sizes.num_layers,
        "num_nextn_predict_layers": 1,
        "dtype": "bfloat16",
    }
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": GLM5_NEXT,
        "text_config": text,
        "dtype": "bfloat16",
    }
    if fmt is WeightFormat.FP8_BLOCK:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    elif fmt is WeightFormat.NVFP4:
        layers = [f"{COMPOSITE_DECODER}.{i}.{MLP}" for i in range(text["num_hidden_layers"] + 1)]
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            # Kept BF16: the dense layer's MLP, routers and shared experts.
            "ignore": ["lm_head", layers[0], *(f"{p}.{n}" for p in layers[1:] for n in _DENSE)],
        }
    elif fmt is not WeightFormat.BF16:
        raise ValueError(
            f"synthetic {ARCHITECTURE} checkpoints store experts as fp8_block, nvfp4 or bf16, "
            f"got {fmt.value}; write one of those and run megamoe convert for the others"
        )
    return config


def _layer_seed(seed: int, prefix: str) -> int:
    """A seed per layer, so that layers differ."""
    return (seed * 1_000_003 + zlib.crc32(prefix.encode())) % (2**31)


def _mlp_tensors(
    fmt: WeightFormat, prefix: str, hidden: int, inter: int, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """One SwiGLU MLP's ``{gate,up,down}_proj`` tensors under ``prefix``."""
    for name, tensor in synthetic_expert_tensors(fmt, 1, hidden, inter, seed=seed):
        yield f"{prefix}.{name.removeprefix('0.')}", tensor


def synthetic_tensors(
    config: Mapping[str, Any], layers: list[MoELayer], seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dense-layer MLPs, then per MoE layer its router, bias, shared MLP and experts.

    Expert and shared-expert magnitudes differ per expert, projection and 128x128 block
    (``megamoe.core.testing``); block-FP8 scales mix powers of two and other values.
    """
    cfg = Glm5NextConfig.from_dict(config)
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    dense_inter = int(text_config(config).get("intermediate_size") or 2 * inter)
    for index in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(index):
            prefix = f"{COMPOSITE_DECODER}.{index}.{MLP}"
            fmt = detect_mlp_format(cfg.quantization_config, prefix)
            yield from _mlp_tensors(fmt, prefix, hidden, dense_inter, _layer_seed(seed, prefix))
    for layer in layers:
        layer_seed = _layer_seed(seed, layer.prefix)
        gen = torch.Generator().manual_seed(layer_seed)
        num_experts = cfg.n_routed_experts
        yield (
            f"{layer.prefix}.gate.weight",
            synthetic_dense((num_experts, hidden), ROUTER_STD, layer_seed),
        )
        bias = torch.randn(num_experts, generator=gen) * BIAS_STD
        yield f"{layer.prefix}.gate.e_score_correction_bias", bias.to(torch.float32)
        if cfg.n_shared_experts:
            shared = f"{layer.prefix}.shared_experts"
            yield from _mlp_tensors(
                detect_mlp_format(cfg.quantization_config, shared),
                shared,
                hidden,
                cfg.shared_intermediate_size,
                layer_seed + 1,
            )
        for name, tensor in synthetic_expert_tensors(
            layer.checkpoint_format, num_experts, hidden, inter, seed=layer_seed + 2
        ):
            yield f"{layer.prefix}.experts.{name}", tensor
