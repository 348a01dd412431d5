"""Qwen4ExpConfig: keys read from config.json and the errors that name them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megamoe.core.errors import CheckpointError
from megamoe.qwen4exp.config import Qwen4ExpConfig

BASE: dict[str, Any] = {
    "model_type": "qwen4_exp",
    "hidden_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "num_hidden_layers": 4,
}


def test_defaults_and_values() -> None:
    config = Qwen4ExpConfig.from_dict(BASE)
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (256, 8, 2)
    assert config.norm_topk_prob is True
    assert config.decoder_sparse_step == 1
    assert config.num_nextn_predict_layers == 0
    assert config.quantization_config is None
    assert config.swiglu_limit is None
    assert [config.is_moe_layer(i) for i in range(4)] == [True] * 4


@pytest.mark.parametrize(
    ("key", "value"), [("num_experts", 10**9), ("num_hidden_layers", 10**9), ("hidden_size", 2**31)]
)
def test_sizes_beyond_their_bounds_are_refused(key: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"config\.json: {key}={value} exceeds \d+, the largest"):
        Qwen4ExpConfig.from_dict({**BASE, key: value})


def test_missing_keys_take_transformers_defaults() -> None:
    qwen4 = Qwen4ExpConfig.from_dict({"model_type": "qwen4_exp_text"})
    assert (qwen4.hidden_size, qwen4.num_hidden_layers, qwen4.num_experts) == (2048, 40, 512)
    assert (qwen4.num_experts_per_tok, qwen4.moe_intermediate_size) == (10, 512)
    assert qwen4.shared_expert_intermediate_size == 512
    assert Qwen4ExpConfig.from_dict({"model_type": "qwen3_next"}).num_hidden_layers == 48


def test_composite_config_reads_text_config_and_top_level_quantization() -> None:
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    text = {k: v for k, v in BASE.items() if k != "model_type"}
    composite = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "hidden_size": 9999,  # a stale top-level copy: text_config wins, as in transformers
        "text_config": {**text, "model_type": "qwen4_exp_text", "mtp_num_hidden_layers": 1},
        "quantization_config": quant,
    }
    config = Qwen4ExpConfig.from_dict(composite)
    assert (config.hidden_size, config.num_experts, config.num_nextn_predict_layers) == (256, 8, 1)
    assert config.quantization_config == quant
    nested = {
        **composite,
        "text_config": {**composite["text_config"], "quantization_config": quant},
    }
    del nested["quantization_config"]
    assert Qwen4ExpConfig.from_dict(nested).quantization_config == quant


def test_qwen3_next_follows_sparse_step_and_mlp_only_layers() -> None:
    config = Qwen4ExpConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen3_next",
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "norm_topk_prob": False,
        }
    )
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert config.norm_topk_prob is False


def test_qwen4exp_ignores_stale_sparse_step_keys() -> None:
    # Qwen4ExpTextDecoderLayer always builds the sparse block: transformers ignores them.
    config = Qwen4ExpConfig.from_dict({**BASE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [config.is_moe_layer(i) for i in range(4)] == [True] * 4


def test_from_json_reads_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_nextn_predict_layers": 1}))
    assert Qwen4ExpConfig.from_json(tmp_path).num_nextn_predict_layers == 1
    assert Qwen4ExpConfig.from_json(tmp_path / "config.json").hidden_size == 256
    with pytest.raises(CheckpointError, match=r"other\.json: Qwen4ExpConfig.from_json reads"):
        Qwen4ExpConfig.from_json(tmp_path / "other.json")
    for name, text, message in [
        ("bad", "{not json", r"bad/config\.json: not valid JSON"),
        ("list", "[1]", r"expected a JSON object, got list"),
        ("twice", '{"hidden_size": 1, "hidden_size": 2}', r"key 'hidden_size' appears twice"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=message):  # read as every command reads it
            Qwen4ExpConfig.from_json(tmp_path / name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "256"}, r"config\.json: hidden_size='256' must be an integer >= 1"),
        ({"num_experts": 0}, r"config\.json: num_experts=0 must be an integer >= 1"),
        ({"moe_intermediate_size": 12.5}, r"moe_intermediate_size=12\.5 must be an integer >= 1"),
        ({"num_experts_per_tok": True}, r"num_experts_per_tok=True must be an integer >= 1"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 exceeds num_experts=8"),
        (
            {"model_type": "qwen3_next", "decoder_sparse_step": 0},
            r"decoder_sparse_step=0 must be an integer >= 1",
        ),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob='yes' must be true or false"),
        (
            {"model_type": "qwen3_next", "mlp_only_layers": [4]},
            r"mlp_only_layers=\[4\] must list layer indices in \[0, ",
        ),
        ({"model_type": "qwen3_next", "mlp_only_layers": "0"}, r"mlp_only_layers='0'"),
        ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers=-1 must be an integer >= 0"),
        ({"mtp_num_hidden_layers": 1.5}, r"mtp_num_hidden_layers=1\.5 must be an integer >= 0"),
        (
            {"quantization_config": "fp8"},
            r"quantization_config='fp8' must be an object .*, got str",
        ),
    ],
)
def test_invalid_keys_are_named(change: dict[str, Any], message: str) -> None:
    config = {**BASE, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        Qwen4ExpConfig.from_dict(config)


def test_activation_other_than_silu_is_refused() -> None:
    with pytest.raises(NotImplementedError, match=r"hidden_act='gelu' is not supported"):
        Qwen4ExpConfig.from_dict({**BASE, "hidden_act": "gelu"})
