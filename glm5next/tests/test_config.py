"""Glm5NextConfig reads DeepSeek-V3-style keys and names the key it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from megamoe.glm5next.config import Glm5NextConfig


def _config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_type": "glm5next",
        "hidden_size": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_reads_every_key() -> None:
    cfg = Glm5NextConfig.from_dict(_config())
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (256, 8, 2)
    assert (cfg.moe_intermediate_size, cfg.n_shared_experts) == (128, 1)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (2, 1, 2.5)
    assert cfg.norm_topk_prob is True
    assert (cfg.first_k_dense_replace, cfg.num_nextn_predict_layers) == (1, 1)
    assert cfg.weight_block_size == (128, 128)
    assert cfg.experts_per_group == 4
    assert cfg.shared_intermediate_size == 128
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_defaults_without_quantization_config() -> None:
    cfg = Glm5NextConfig.from_dict(
        _config(quantization_config=None, n_group=None, topk_group=None, n_shared_experts=None)
    )
    assert cfg.weight_block_size == (128, 128)
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (1, 1, 0)
    assert cfg.quantization_config is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": None}, r"'hidden_size' is missing"),
        ({"n_routed_experts": 0}, r"n_routed_experts=0 must be an integer >= 1"),
        ({"num_experts_per_tok": 2.0}, r"num_experts_per_tok=2.0 must be an integer"),
        ({"moe_intermediate_size": True}, r"moe_intermediate_size=True must be an integer"),
        ({"n_shared_experts": -1}, r"n_shared_experts=-1 must be an integer >= 0"),
        ({"routed_scaling_factor": 0}, r"routed_scaling_factor=0 must be a positive number"),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob='yes' must be true or false"),
        ({"n_group": 3}, r"n_routed_experts=8 is not divisible by n_group=3"),
        ({"n_group": 8, "topk_group": 1}, r"n_group=8 leaves 1 expert\(s\) per group"),
        ({"topk_group": 3}, r"topk_group=3 exceeds n_group=2"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 exceeds the 4 experts"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
            r"weight_block_size=\[128\] must be two positive integers",
        ),
        ({"quantization_config": "fp8"}, r"quantization_config='fp8' must be an object"),
        ({"num_hidden_layers": None}, r"'num_hidden_layers' is missing"),
    ],
)
def test_invalid_values_name_the_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Glm5NextConfig.from_dict(_config(**overrides))


@pytest.mark.parametrize(("key", "value"), [("scoring_func", "softmax"), ("hidden_act", "gelu")])
def test_unsupported_router_or_activation(key: str, value: str) -> None:
    with pytest.raises(NotImplementedError, match=f"{key}={value!r}"):
        Glm5NextConfig.from_dict(_config(**{key: value}))
