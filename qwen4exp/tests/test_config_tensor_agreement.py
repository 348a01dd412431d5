"""Qwen4Exp (and Qwen3-Next) configs that disagree with their tensors (issue 38).

Each case is refused by the API and by ``inspect``, ``verify`` and ``convert`` alike
(``refusals.assert_refused_everywhere``): MoE tensors under a layer Qwen3-Next's rule makes
dense (``mlp_only_layers``, ``decoder_sparse_step``; its defaults and Qwen4Exp make every
layer sparse), MoE tensors of an MTP index the config does not count, a size key left out
(transformers' default assumed, and named), and a checkpoint with no MoE layer at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from refusals import assert_refused_everywhere, drop_tensors, edit_config

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.reader import read_config
from megamoe.core.cli import main as cli
from megamoe.core.errors import NoMoELayerError
from megamoe.core.testing import write_synthetic_checkpoint
from megamoe.qwen4exp import ADAPTER

SIZES = SyntheticSizes(
    num_layers=2, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
DECODER = "model.language_model.layers"  # layers 0 and 1 sparse, MTP layer mtp.layers.0
MOE_PARTS = (".mlp.experts.", ".mlp.gate.", ".mlp.shared_expert.", ".mlp.shared_expert_gate.")


def _checkpoint(tmp_path: Path, **keys: Any) -> Path:
    """A Qwen4Exp checkpoint; with ``keys``, its config as a flat Qwen3-Next one."""
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", ADAPTER, "bf16", SIZES)
    if keys:

        def change(config: dict[str, Any]) -> None:
            config.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
            config.update({k: v for k, v in keys.items() if v is not None})

        edit_config(ckpt, change, flat=True)
    return ckpt


def test_dense_by_mlp_only_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: Qwen3-Next's mlp_only_layers names a layer that stores experts."""
    ckpt = _checkpoint(tmp_path, mlp_only_layers=[1])
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.1\.mlp holds MoE tensors \(e\.g\. .*\), but decoder layer 1 is dense by "
        r"mlp_only_layers=\[1\], which lists it.*remove 1 from mlp_only_layers in config\.json",
        capsys,
    )


def test_dense_by_decoder_sparse_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path, decoder_sparse_step=2)
    assert_refused_everywhere(
        ckpt,
        rf"{DECODER}\.0\.mlp holds MoE tensors .* decoder layer 0 is dense by "
        r"decoder_sparse_step=2 \(only every layer whose number from 1 is a multiple of 2 is "
        r"sparse\).*set decoder_sparse_step "
        r"to 1 in config\.json",
        capsys,
    )


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])
def test_the_defaults_make_every_layer_sparse(tmp_path: Path, family: str) -> None:
    """No default of either family makes a layer dense: the checkpoint is accepted."""
    keys = {"decoder_sparse_step": None} if family == "qwen3_next" else {}
    ckpt = _checkpoint(tmp_path, **keys)
    assert cli.main(["inspect", str(ckpt)]) == 0
    assert [m.index for m in ADAPTER.moe_layers(read_config(ckpt))]


def test_experts_of_an_mtp_index_the_config_does_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.__setitem__("mtp_num_hidden_layers", 0))
    assert_refused_everywhere(
        ckpt,
        r"mtp\.layers\.0\.mlp holds MoE tensors .* of MTP layer 0, but mtp_num_hidden_layers=0 "
        r"counts 0 MTP layer\(s\).*set mtp_num_hidden_layers to 1 in config\.json",
        capsys,
    )


def test_experts_of_an_mtp_index_without_the_count_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.pop("mtp_num_hidden_layers"))
    assert_refused_everywhere(
        ckpt,
        r"mtp\.layers\.0\.mlp holds MoE tensors .* but mtp_num_hidden_layers absent from "
        r"config\.json \(transformers' default 0 assumed\) counts 0 MTP layer\(s\)",
        capsys,
    )


SIZE_KEYS = {  # key left out -> what it leads to, then the key and default named
    "hidden_size": r"expected \(2048, 128\).*hidden_size=2048",
    "num_experts": r"routed-expert tensor\(s\) .* are missing.*num_experts=512",
    "moe_intermediate_size": r"expected \(128, 512\).*moe_intermediate_size=512",
    "shared_expert_intermediate_size": r"shared_expert.*expected .*512.*"
    r"shared_expert_intermediate_size=512",
    "num_hidden_layers": rf"{DECODER}\.2\.mlp.*num_hidden_layers=40",
}


@pytest.mark.parametrize("key", list(SIZE_KEYS))
def test_a_defaulted_size_key_is_named(
    tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    edit_config(ckpt, lambda c: c.pop(key))
    message = assert_refused_everywhere(ckpt, SIZE_KEYS[key], capsys)
    assert "so megamoe assumed transformers' qwen4_exp default(s)" in message, message


def test_a_checkpoint_with_no_moe_layer_is_named_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path, mlp_only_layers=[0, 1], mtp_num_hidden_layers=0)
    drop_tensors(ckpt, MOE_PARTS)
    assert_refused_everywhere(
        ckpt,
        r"the checkpoint has no MoE layer: each of its 2 decoder layer\(s\) is dense by "
        r"mlp_only_layers=\[0, 1\], which lists it, and it has no MTP layer "
        r"\(mtp_num_hidden_layers=0\); megamoe has nothing to load, verify or convert",
        capsys,
        NoMoELayerError,
    )
    with pytest.raises(NoMoELayerError, match="the checkpoint has no MoE layer"):
        ADAPTER.moe_layers(read_config(ckpt))
