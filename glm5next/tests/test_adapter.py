"""The GLM-5.3-Flash adapter: layers, synthetic checkpoints, conversion, standalone install."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import SyntheticSizes, adapter_for
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.convert import convert_checkpoint
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
from megamoe.glm5next import ADAPTER, Glm5NextAdapter
from megamoe.glm5next.config import Glm5NextConfig

FP8, MX, BF16 = WeightFormat.FP8_BLOCK, WeightFormat.MXFP8, WeightFormat.BF16
PACKAGE_SRC = Path(__file__).resolve().parents[1] / "src" / "megamoe" / "glm5next"
NOT_POW2 = "ignore:.*not powers of two:UserWarning"

Checkpoint = Callable[[WeightFormat], Path]


def _config(**text_changes: Any) -> dict[str, Any]:
    """The synthetic composite config; ``quantization_config`` stays at the top level."""
    config = ADAPTER.synthetic_config(FP8, SyntheticSizes(num_layers=3))
    if "quantization_config" in text_changes:
        config["quantization_config"] = text_changes.pop("quantization_config")
    config["text_config"] = {**config["text_config"], **text_changes}
    return config


def test_moe_layers_follow_mlp_layer_types_then_mtp_layers() -> None:
    layers = ADAPTER.moe_layers(
        _config(mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_nextn_predict_layers=2)
    )
    assert [(m.index, m.prefix, m.is_mtp) for m in layers] == [
        (1, "model.language_model.layers.1.mlp", False),
        (3, "model.language_model.layers.3.mlp", False),
        (0, "model.language_model.layers.4.mlp", True),
        (1, "model.language_model.layers.5.mlp", True),
    ]
    assert {m.checkpoint_format for m in layers} == {FP8}
    # The default when mlp_layer_types is absent: three dense layers, then sparse ones; a
    # stale first_k_dense_replace is ignored (as transformers ignores it).
    default = ADAPTER.moe_layers(_config(mlp_layer_types=None, first_k_dense_replace=1))
    assert [m.prefix for m in default if not m.is_mtp] == ["model.language_model.layers.3.mlp"]


def test_moe_layers_of_deepseek_v3_and_glm45_follow_first_k_dense_replace() -> None:
    text = {k: v for k, v in _config()["text_config"].items() if k != "mlp_layer_types"}
    for family, arch in (
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
        ("glm4_moe", "Glm4MoeForCausalLM"),
    ):
        flat = {**text, "model_type": family, "architectures": [arch], "first_k_dense_replace": 2}
        layers = ADAPTER.moe_layers(flat)
        assert [(m.prefix, m.is_mtp) for m in layers] == [
            ("model.layers.2.mlp", False),
            ("model.layers.3.mlp", False),
            ("model.layers.4.mlp", True),
        ]
        assert Glm5NextConfig.from_dict(flat).swiglu_limit is None


def test_moe_layers_refuse_an_unknown_quantization_by_name() -> None:
    with pytest.raises(
        NotImplementedError, match=r"model.language_model.layers.1.mlp.experts: .*'awq'"
    ):
        ADAPTER.moe_layers(_config(quantization_config={"quant_method": "awq"}))


def test_claims_by_model_type_or_architecture() -> None:
    assert ADAPTER.claims({"model_type": "glm5next"})
    assert ADAPTER.claims({"model_type": "glm5_next"})
    assert ADAPTER.claims({"model_type": "other", "text_config": {"model_type": "glm5_next_text"}})
    assert ADAPTER.claims({"model_type": "deepseek_v3"})
    assert ADAPTER.claims({"model_type": "glm4_moe"})
    assert ADAPTER.claims({"architectures": ["Glm5NextForConditionalGeneration"]})
    assert ADAPTER.claims({"architectures": ["Glm5NextForCausalLM"]})
    assert not ADAPTER.claims({"model_type": "qwen4_exp", "architectures": ["Other"]})
    assert isinstance(adapter_for({"model_type": "glm5next"}), Glm5NextAdapter)


def test_registered_entry_point_resolves_to_the_adapter() -> None:
    points = {ep.name: ep for ep in md.entry_points(group="megamoe.adapters")}
    assert points["glm5next"].value == "megamoe.glm5next.adapter:ADAPTER"
    assert points["glm5next"].load() is ADAPTER


def test_synthetic_config_refuses_what_glm_cannot_store() -> None:
    with pytest.raises(ValueError, match=r"store experts as fp8_block, nvfp4 or bf16, got mxfp4"):
        ADAPTER.synthetic_config(WeightFormat.MXFP4, SyntheticSizes())
    with pytest.raises(
        ValueError, match=r"shared_intermediate_size=384 must be a positive multiple"
    ):
        ADAPTER.synthetic_config(FP8, SyntheticSizes(shared_intermediate_size=384))


@pytest.mark.filterwarnings(NOT_POW2)
@pytest.mark.parametrize("checkpoint_format", [FP8, BF16])
def test_reference_forward_agrees_with_the_loaded_block(
    checkpoint_format: WeightFormat,
    glm_checkpoint: Checkpoint,
    parallel: ParallelSettings,
    tokens: torch.Tensor,
) -> None:
    reader = CheckpointReader(glm_checkpoint(checkpoint_format), ADAPTER)
    for layer in reader.layers:  # main layer and MTP layer
        assert layer.checkpoint_format is checkpoint_format
        block = ADAPTER.build_block(reader.config, layer, parallel=parallel, device="cpu")
        block.load_from_checkpoint(reader)
        want = ADAPTER.reference_forward(reader, layer, tokens)
        assert want.dtype == torch.float64
        error = float((block(tokens).double() - want).norm() / want.norm())
        assert error < 1e-2, (layer.prefix, error)


def test_converted_config_marks_routed_and_shared_experts(glm_checkpoint: Checkpoint) -> None:
    config = json.loads((glm_checkpoint(FP8) / "config.json").read_text())
    converted = ADAPTER.converted_config(config, MX)
    quant_config = converted["quantization_config"]
    for layer in ADAPTER.moe_layers(converted):
        assert layer.checkpoint_format is MX
        shared = detect_mlp_format(quant_config, f"{layer.prefix}.shared_experts")
        assert shared is MX  # fused into the kernel as one more expert: same format
    assert (
        config["quantization_config"]
        == ADAPTER.synthetic_config(FP8, SyntheticSizes())["quantization_config"]
    )  # the original is left alone


@pytest.mark.filterwarnings(NOT_POW2)
def test_offline_conversion_equals_online_requantization(
    glm_checkpoint: Checkpoint,
    parallel: ParallelSettings,
    tmp_path: Path,
    tokens: torch.Tensor,
) -> None:
    src = glm_checkpoint(FP8)
    out = tmp_path / "mxfp8"
    convert_checkpoint(src, out, MX, progress=False)
    online_reader, offline_reader = CheckpointReader(src, ADAPTER), CheckpointReader(out, ADAPTER)
    layer = online_reader.layers[0]
    online = ADAPTER.build_block(online_reader.config, layer, parallel=parallel, moe_format=MX)
    online.load_from_checkpoint(online_reader)
    offline_layer = offline_reader.layers[0]
    assert offline_layer.checkpoint_format is MX
    offline = ADAPTER.build_block(
        offline_reader.config, offline_layer, parallel=parallel, moe_format=MX
    )
    offline.load_from_checkpoint(offline_reader)
    assert not offline.experts.requantizes_in_place  # stored as it runs: nothing to round
    assert set(offline.experts.kernel_params) == set(online.experts.kernel_params)
    for name, param in online.experts.kernel_params.items():
        assert_bitwise_equal(offline.experts.kernel_params[name], param, name)
    # The shared expert was converted too, so both run it fused, with identical results.
    assert online.fused_shared and offline.fused_shared
    assert_bitwise_equal(offline(tokens), online(tokens), "block output")


def test_glm_sources_never_import_qwen4exp() -> None:
    for path in PACKAGE_SRC.rglob("*.py"):
        assert "qwen4exp" not in path.read_text(), path


def test_loads_and_runs_with_qwen4exp_unimportable(glm_checkpoint: Checkpoint) -> None:
    """What ``pip install megamoe-glm5next`` gives: core plus this adapter only."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys, warnings
        warnings.simplefilter("ignore")

        class NoQwen(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("megamoe.qwen4exp"):
                    raise ImportError("megamoe-qwen4exp is not installed")
                return None

        sys.meta_path.insert(0, NoQwen())
        import torch
        from megamoe.core.checkpoint.reader import CheckpointReader
        from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
        from megamoe.glm5next import ADAPTER

        reader = CheckpointReader(sys.argv[1], ADAPTER)
        parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
        block = ADAPTER.build_block(reader.config, reader.layers[0], parallel=parallel)
        block.load_from_checkpoint(reader)
        x = torch.randn(4, reader.config["text_config"]["hidden_size"]).to(torch.bfloat16)
        assert torch.isfinite(block(x).float()).all()
        assert not any(m.startswith("megamoe.qwen4exp") for m in sys.modules)
        print("ok")
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p and "qwen4exp" not in p] + [env.get("PYTHONPATH", "")]
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(glm_checkpoint(FP8))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
