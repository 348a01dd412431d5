"""GLM-5.3-Flash (and DeepSeek-V3, GLM-4.5) configs that disagree with their tensors (issue 38).

Each case is refused by the API and by ``inspect``, ``verify`` and ``convert`` alike
(``refusals.assert_refused_everywhere``): MoE tensors under a layer the family's rule
makes dense (``mlp_layer_types``, ``first_k_dense_replace``, or transformers' default for
the family), MoE tensors of an MTP index the config does not count, a size key left out
(transformers' default assumed, and named), and a checkpoint with no MoE layer at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from refusals import assert_refused_everywhere, drop_tensors, edit_config, edit_tensors

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.reader import read_config
from megamoe.core.cli import main as cli
from megamoe.core.errors import NoMoELayerError
from megamoe.core.testing import write_synthetic_checkpoint
from megamoe.glm5next import ADAPTER

SIZES = SyntheticSizes(
    num_layers=2, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
DECODER = "model.language_model.layers"  # layer 0 dense, 1 and 2 sparse, 3 the MTP layer
MOE_PARTS = (".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts.")


def _checkpoint(tmp_path: Path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "ckpt", ADAPTER, "bf16", SIZES)


def _sibling(ckpt: Path, family: str, first_k_dense_replace: int | None) -> None:
    """Rewrite the config as a flat ``deepseek_v3`` / ``glm4_moe`` one (no clamp)."""
    arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}[family]

    def change(config: dict[str, Any]) -> None:
        config.update(model_type=family, architectures=[arch])
        for key in ("mlp_layer_types", "swiglu_limit"):
            config.pop(key)
        if first_k_dense_replace is not None:
            config["first_k_dense_replace"] = first_k_dense_replace

    edit_config(ckpt, change, flat=True)


def _experts_into_layer_0(ckpt: Path) -> None:
    """Layer 0 holds layer 1's MoE block instead of its dense MLP."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith(f"{DECODER}.0.mlp.")]:
            del tensors[name]
        for name in [n for n in tensors if n.startswith(f"{DECODER}.1.mlp.")]:
            tensors[name.replace(f"{DECODER}.1.", f"{DECODER}.0.")] = tensors[name].clone()

    edit_tensors(ckpt, change)


def test_dense_by_mlp_layer_types_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.__setitem__("mlp_layer_types", ["dense", "dense", "sparse"]))
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.1\.mlp holds MoE tensors \(e\.g\. .*\), but decoder layer 1 is dense by "
        r"mlp_layer_types\[1\]='dense'.*set mlp_layer_types\[1\] to 'sparse' in config\.json",
        capsys,
    )


def test_dense_by_mlp_layer_types_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: no mlp_layer_types, transformers' default makes 3 layers dense."""
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.pop("mlp_layer_types"))
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.1\.mlp holds MoE tensors .* decoder layer 1 is dense by mlp_layer_types, "
        r"absent from config\.json: transformers' glm5_next default makes the first 3 decoder "
        r"layers dense.*add mlp_layer_types to config\.json, 'sparse' for layer 1",
        capsys,
    )


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_dense_by_first_k_dense_replace_key(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _sibling(ckpt, family, first_k_dense_replace=2)
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.1\.mlp holds MoE tensors .* decoder layer 1 is dense by "
        r"first_k_dense_replace=2 .*set first_k_dense_replace to 1 or less in config\.json",
        capsys,
    )


def test_dense_by_first_k_dense_replace_default_of_deepseek_v3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _sibling(ckpt, "deepseek_v3", first_k_dense_replace=None)
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.1\.mlp holds MoE tensors .* dense by first_k_dense_replace, absent from "
        r"config\.json: transformers' deepseek_v3 default 3 makes the layers below it dense",
        capsys,
    )


def test_dense_by_first_k_dense_replace_default_of_glm4_moe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _sibling(ckpt, "glm4_moe", first_k_dense_replace=None)
    _experts_into_layer_0(ckpt)
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.0\.mlp holds MoE tensors .* dense by first_k_dense_replace, absent from "
        r"config\.json: transformers' glm4_moe default 1 makes the layers below it dense",
        capsys,
    )


def test_the_sibling_rules_accept_what_they_declare(tmp_path: Path) -> None:
    """first_k_dense_replace=1 (and glm4_moe's default 1) match the checkpoint: loads."""
    for family, first in (("deepseek_v3", 1), ("glm4_moe", None)):
        ckpt = write_synthetic_checkpoint(tmp_path / family, ADAPTER, "bf16", SIZES)
        _sibling(ckpt, family, first_k_dense_replace=first)
        assert cli.main(["inspect", str(ckpt)]) == 0


def test_experts_of_an_mtp_index_the_config_does_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.__setitem__("num_nextn_predict_layers", 0))
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.3\.mlp holds MoE tensors .* of MTP layer 0, but num_nextn_predict_layers=0 "
        r"counts 0 MTP layer\(s\).*set num_nextn_predict_layers to 1 in config\.json",
        capsys,
    )


def test_a_router_alone_under_a_dense_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_tensors(ckpt, lambda t: t.__setitem__(f"{DECODER}.0.mlp.gate.weight", torch.zeros(4, 128)))
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.0\.mlp holds MoE tensors \(e\.g\. '{DECODER}\.0\.mlp\.gate\.weight'\)",
        capsys,
    )


SIZE_KEYS = {  # key left out -> what it leads to, then the key and default named
    "hidden_size": r"has shape \(128, 128\), expected \(4096, 128\).*hidden_size=4096",
    "n_routed_experts": r"routed-expert tensor\(s\) .* are missing.*n_routed_experts=288",
    "moe_intermediate_size": r"expected \(128, 2048\).*moe_intermediate_size=2048",
    "num_hidden_layers": r"mlp_layer_types=.* \(num_hidden_layers absent from config\.json "
    r"\(transformers' default 45 assumed\)\)",
}


@pytest.mark.parametrize("key", list(SIZE_KEYS))
def test_a_defaulted_size_key_is_named(
    tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.pop(key))
    message = assert_refused_everywhere(ckpt, SIZE_KEYS[key], capsys)
    if key != "num_hidden_layers":
        assert "so megamoe assumed transformers' glm5_next default(s)" in message, message


@pytest.mark.parametrize("rule", ["mlp_layer_types", "default"])
def test_a_checkpoint_with_no_moe_layer_is_named_so(
    tmp_path: Path, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    drop_tensors(ckpt, MOE_PARTS)

    def change(config: dict[str, Any]) -> None:
        config["num_nextn_predict_layers"] = 0
        if rule == "default":
            config.pop("mlp_layer_types")
        else:
            config["mlp_layer_types"] = ["dense"] * 3

    edit_config(ckpt, change)
    cause = (
        r"mlp_layer_types\[0\]='dense'; mlp_layer_types\[1\]='dense'"
        if rule != "default"
        else r"mlp_layer_types, absent from config\.json: transformers' glm5_next default"
    )
    assert_refused_everywhere(
        ckpt,
        rf"the checkpoint has no MoE layer: each of its 3 decoder layer\(s\) is dense by {cause}"
        r".*it has no MTP layer \(num_nextn_predict_layers=0\); megamoe has nothing to load, "
        "verify or convert",
        capsys,
        NoMoELayerError,
    )
    with pytest.raises(NoMoELayerError, match="the checkpoint has no MoE layer"):
        ADAPTER.moe_layers(read_config(ckpt))
