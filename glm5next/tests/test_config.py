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
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
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
    assert cfg.num_nextn_predict_layers == 1
    assert (cfg.swiglu_limit, cfg.model_type) == (10.0, "glm5_next")
    assert cfg.weight_block_size == (128, 128)
    assert cfg.experts_per_group == 4
    assert cfg.shared_intermediate_size == 128
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_defaults_without_quantization_config() -> None:
    cfg = Glm5NextConfig.from_dict(
        _config(quantization_config=None, n_group=None, topk_group=None, n_shared_experts=None)
    )
    assert cfg.weight_block_size == (128, 128)
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (1, 1, 1)
    assert cfg.quantization_config is None


def test_missing_keys_take_transformers_defaults_per_family() -> None:
    glm5 = Glm5NextConfig.from_dict({"model_type": "glm5_next"})
    assert (glm5.hidden_size, glm5.n_routed_experts, glm5.moe_intermediate_size) == (
        4096,
        288,
        2048,
    )
    assert (glm5.routed_scaling_factor, glm5.n_shared_experts, glm5.swiglu_limit) == (
        2.5,
        1,
        10.0,
    )
    assert (glm5.n_group, glm5.topk_group, glm5.norm_topk_prob) == (1, 1, True)
    assert glm5.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 42
    v3 = Glm5NextConfig.from_dict({"model_type": "deepseek_v3"})
    assert (v3.n_routed_experts, v3.n_group, v3.topk_group, v3.swiglu_limit) == (256, 8, 4, None)
    assert v3.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    glm45 = Glm5NextConfig.from_dict({"model_type": "glm4_moe"})
    assert (glm45.routed_scaling_factor, glm45.n_routed_experts, glm45.swiglu_limit) == (
        1.0,
        128,
        None,
    )
    assert glm45.mlp_layer_types[:2] == ("dense", "sparse")


def test_composite_config_reads_text_config() -> None:
    flat = _config()
    quant = flat.pop("quantization_config")
    composite = {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": {**flat, "model_type": "glm5_next_text", "swiglu_limit": 1.5},
        "quantization_config": quant,
    }
    cfg = Glm5NextConfig.from_dict(composite)
    assert (cfg.hidden_size, cfg.swiglu_limit, cfg.quantization_config) == (256, 1.5, quant)


def test_stale_layer_keys_are_ignored_as_transformers_ignores_them() -> None:
    # GLM-5.3-Flash: mlp_layer_types decides; first_k_dense_replace is ignored.
    glm5 = Glm5NextConfig.from_dict(_config(mlp_layer_types=None, first_k_dense_replace=1))
    assert [glm5.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    # DeepSeek-V3 / GLM-4.5: first_k_dense_replace decides; moe_layer_freq is ignored.
    v3 = Glm5NextConfig.from_dict(
        _config(model_type="deepseek_v3", first_k_dense_replace=2, moe_layer_freq=2)
    )
    assert [v3.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 0}, r"hidden_size=0 must be an integer >= 1"),
        ({"swiglu_limit": 0}, r"swiglu_limit=0 must be a positive number"),
        ({"swiglu_limit": "10"}, r"swiglu_limit='10' must be a positive number"),
        ({"mlp_layer_types": ["dense"]}, r"mlp_layer_types=\['dense'\] must list 'dense' or"),
        ({"mlp_layer_types": ["moe"] * 4}, r"for each decoder layer \(num_hidden_layers=4\)"),
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
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            r"weight_block_size=\[64, 64\] is not supported: GLM-5.3-Flash's block-FP8 experts",
        ),
        ({"quantization_config": "fp8"}, r"quantization_config='fp8' must be an object"),
        ({"num_hidden_layers": -2}, r"num_hidden_layers=-2 must be an integer >= 1"),
    ],
)
def test_invalid_values_name_the_key(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Glm5NextConfig.from_dict(_config(**overrides))


@pytest.mark.parametrize(("key", "value"), [("scoring_func", "softmax"), ("hidden_act", "gelu")])
def test_unsupported_router_or_activation(key: str, value: str) -> None:
    with pytest.raises(NotImplementedError, match=f"{key}={value!r}"):
        Glm5NextConfig.from_dict(_config(**{key: value}))
