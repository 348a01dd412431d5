"""Small Qwen4Exp checkpoints in every expert format, for the demo, tests and users.

Each MoE layer gets a router, a sigmoid-gated shared expert and routed experts; weights
differ in magnitude per expert, per projection and per 128x128 block
(``megamoe.core.testing``). The router and the shared-expert gate stay BF16 and are listed
in the quantization config's ignore list, as in released quantized checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.expert_names import WEIGHT, WEIGHT_PACKED
from megamoe.core.checkpoint.layers import COMPOSITE_DECODER, MLP, MoELayer
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat
from megamoe.core.testing import synthetic_dense, synthetic_expert_tensors
from megamoe.qwen4exp.config import (
    ARCHITECTURE,
    MODEL_TYPE,
    MTP_BLOCK_PREFIX,
    TEXT_MODEL_TYPE,
    Qwen4ExpConfig,
)

NUM_MTP_LAYERS = 1  # the synthetic model has an MTP drafter layer
ROUTER_STD = 0.08  # router logits of order 1 for unit-size activations at H = 256
SHARED_GATE_STD = 0.05


def synthetic_config(fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
    """``config.json`` of a small Qwen4Exp model storing its experts as ``fmt``.

    Laid out as the release: a composite ``qwen4_exp`` config with the text model's keys
    under ``text_config`` (layers at ``model.language_model.layers.{L}``), the MTP drafter
    at ``mtp.layers.{j}`` (``mtp_num_hidden_layers``) and ``quantization_config`` at the
    top level. BF16: no quantization config. FP8_BLOCK: HF ``fp8`` with 128x128 blocks.
    MXFP8: the ``mxfp8`` quant method. MXFP4: compressed-tensors ``mxfp4-pack-quantized``
    (weights named ``weight_packed``). NVFP4: ModelOpt ``NVFP4`` with the shared experts
    kept BF16 (``megamoe.core.testing.nvfp4_as_compressed_tensors`` gives the
    compressed-tensors layout). Every layer, the MTP one included, is an MoE layer.
    """
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "text_config": {
            "model_type": TEXT_MODEL_TYPE,
            "hidden_size": sizes.hidden_size,
            "num_experts": sizes.num_experts,
            "num_experts_per_tok": sizes.top_k,
            "moe_intermediate_size": sizes.intermediate_size,
            "shared_expert_intermediate_size": sizes.shared_intermediate_size,
            "num_hidden_layers": sizes.num_layers,
            "mtp_num_hidden_layers": NUM_MTP_LAYERS,
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "dtype": "bfloat16",
        },
        "dtype": "bfloat16",
    }
    blocks = [f"{COMPOSITE_DECODER}.{i}.{MLP}" for i in range(sizes.num_layers)]
    blocks += [MTP_BLOCK_PREFIX.format(i) for i in range(NUM_MTP_LAYERS)]
    dense = ["lm_head"] + [f"{b}.{n}" for b in blocks for n in ("gate", "shared_expert_gate")]
    if fmt is WeightFormat.FP8_BLOCK:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(BLOCK_FP8_DEFAULT),
            "modules_to_not_convert": dense,
        }
    elif fmt is WeightFormat.MXFP8:
        config["quantization_config"] = {"quant_method": "mxfp8", "modules_to_not_convert": dense}
    elif fmt is WeightFormat.MXFP4:
        scheme = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": "mxfp4-pack-quantized",
                    "weights": scheme,
                }
            },
            "ignore": dense,
        }
    elif fmt is WeightFormat.NVFP4:
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": dense + [f"{b}.shared_expert" for b in blocks],
        }
    return config


def synthetic_tensors(
    config: Mapping[str, Any],
    layers: list[MoELayer],
    seed: int = 0,
    *,
    fused_experts: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the MoE layers of a synthetic checkpoint, in checkpoint naming.

    Args:
        config: a ``config.json`` (from ``synthetic_config``).
        layers: its MoE layers (with their expert formats).
        seed: reproducible contents; each layer's tensors differ.
        fused_experts: BF16 routed experts in the fused layout (``experts.gate_up_proj``
            (E, 2I, H), gate rows first, and ``experts.down_proj`` (E, H, I)).

    Yields:
        ``(name, tensor)``.

    Raises:
        ValueError: ``fused_experts`` with quantized experts.
    """
    cfg = Qwen4ExpConfig.from_dict(config)
    hidden = cfg.hidden_size
    # compressed-tensors names packed MXFP4 weights weight_packed.
    packed = (cfg.quantization_config or {}).get("quant_method") == "compressed-tensors"
    for number, layer in enumerate(layers):
        layer_seed = seed * 1009 + number * 7 + 1
        fmt, p = layer.checkpoint_format, layer.prefix
        yield f"{p}.gate.weight", synthetic_dense((cfg.num_experts, hidden), ROUTER_STD, layer_seed)
        yield (
            f"{p}.shared_expert_gate.weight",
            synthetic_dense((1, hidden), SHARED_GATE_STD, layer_seed),
        )
        shared_fmt = detect_mlp_format(cfg.quantization_config, f"{p}.shared_expert")
        shared = synthetic_expert_tensors(
            shared_fmt, 1, hidden, cfg.shared_expert_intermediate_size, seed=layer_seed + 3
        )
        for name, tensor in shared:
            yield (
                f"{p}.shared_expert.{_renamed(name.partition('.')[2], shared_fmt, packed)}",
                tensor,
            )
        experts = synthetic_expert_tensors(
            fmt,
            cfg.num_experts,
            hidden,
            cfg.moe_intermediate_size,
            seed=layer_seed,
            fused_bf16=fused_experts,
        )
        for name, tensor in experts:
            yield f"{p}.experts.{_renamed(name, fmt, packed)}", tensor


def _renamed(name: str, fmt: WeightFormat, packed: bool) -> str:
    """``weight`` -> ``weight_packed`` for compressed-tensors MXFP4."""
    stem, _, kind = name.rpartition(".")
    if packed and fmt is WeightFormat.MXFP4 and kind == WEIGHT:
        return f"{stem}.{WEIGHT_PACKED}"
    return name
