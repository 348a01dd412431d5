"""The transformers oracle harness against what MODELS.md says the checkpoints look like."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from safetensors import safe_open
from transformers_oracle import (
    FAMILIES,
    TinyModel,
    build_tiny_model,
    clamped_fraction,
    declare_mtp_without_tensors,
    reference_moe,
    save_checkpoint,
)

HIDDEN, INTER, EXPERTS, TOP_K = 256, 128, 8, 2
GROUPED = ("glm5_next", "deepseek_v3", "glm4_moe")
MOE_LAYERS = {
    "qwen4_exp": [0, 1, 2, 3],  # every decoder layer
    "qwen4_exp_text": [0, 1, 2, 3],
    "glm5_next": [1, 3],  # mlp_layer_types dense, sparse, dense, sparse
    "qwen3_next": [1, 3],  # decoder_sparse_step 2
    "deepseek_v3": [1, 2],  # first_k_dense_replace 1
    "glm4_moe": [1, 2],
}
MTP = 2
T = TypeVar("T")


@dataclasses.dataclass
class Saved:
    tiny: TinyModel
    main: list[str]  # main-model MoE prefixes (tiny.moe_blocks gains the MTP ones)
    per_expert: Path
    fused_mtp: Path  # fused experts, MTP layers appended


def _cached(build: Callable[[str], T]) -> Callable[[str], T]:
    """Build once per family, on first use, so a -k selection builds only what it needs."""
    cache: dict[str, T] = {}

    def get(family: str) -> T:
        if family not in cache:
            cache[family] = build(family)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Saved]:
    def build(family: str) -> Saved:
        tiny = build_tiny_model(family)
        main = list(tiny.moe_blocks)
        root = tmp_path_factory.mktemp(family)
        per_expert = save_checkpoint(tiny, root / "per_expert")
        fused_mtp = save_checkpoint(tiny, root / "fused_mtp", fused=True, mtp_layers=MTP)
        return Saved(tiny, main, per_expert, fused_mtp)

    return _cached(build)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[TinyModel, Path]]:
    def build(family: str) -> tuple[TinyModel, Path]:
        tiny = build_tiny_model(family)  # FP8 changes the model in place: its own instance
        root = tmp_path_factory.mktemp(f"{family}_fp8")
        return tiny, save_checkpoint(tiny, root / "fp8", fp8_block=True, mtp_layers=1)

    return _cached(build)


def _tensors(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """Name to (safetensors dtype, shape, file) over all shards."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = f.get_slice(key)
                out[key] = (sl.get_dtype(), sl.get_shape(), file.name)
    return out


def _load(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    where = _tensors(path)
    out = {}
    for name in names:
        with safe_open(path / where[name][2], "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _under(names: dict, prefix: str) -> dict:
    return {
        k.removeprefix(prefix + "."): v[:2] for k, v in names.items() if k.startswith(prefix + ".")
    }


def _expected_block(family: str, fused: bool) -> dict[str, tuple[str, list[int]]]:
    """MODELS.md §1b/§2b: one MoE layer's tensors, relative to its prefix."""
    grouped = family in GROUPED
    shared = "shared_experts" if grouped else "shared_expert"
    want = {"gate.weight": ("F32" if grouped else "BF16", [EXPERTS, HIDDEN])}
    if grouped:
        want["gate.e_score_correction_bias"] = ("F32", [EXPERTS])
    else:
        want["shared_expert_gate.weight"] = ("BF16", [1, HIDDEN])
    for proj, shape in (
        ("gate_proj", [INTER, HIDDEN]),
        ("up_proj", [INTER, HIDDEN]),
        ("down_proj", [HIDDEN, INTER]),
    ):
        want[f"{shared}.{proj}.weight"] = ("BF16", shape)
        for e in range(EXPERTS):
            if not fused:
                want[f"experts.{e}.{proj}.weight"] = ("BF16", shape)
    if fused:
        want["experts.gate_up_proj"] = ("BF16", [EXPERTS, 2 * INTER, HIDDEN])
        want["experts.down_proj"] = ("BF16", [EXPERTS, HIDDEN, INTER])
    return want


def _inputs(tokens: int = 64, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)


def _run(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]


def _mtp_prefixes(family: str, n: int) -> list[str]:
    spec = FAMILIES[family]
    if not spec.mtp_in_decoder:
        return [f"mtp.layers.{j}.mlp" for j in range(n)]
    layers = spec.text_config["num_hidden_layers"]
    return [f"{spec.decoder_prefix}.{layers + j}.mlp" for j in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_blocks_sit_where_the_config_says(family: str, bf16) -> None:
    saved = bf16(family)
    want = [f"{FAMILIES[family].decoder_prefix}.{i}.mlp" for i in MOE_LAYERS[family]]
    assert saved.main == want
    for prefix in want:  # every prefix is a real on-disk prefix
        assert any(k.startswith(prefix + ".experts.") for k in _tensors(saved.per_expert))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_layout(family: str, bf16) -> None:
    saved = bf16(family)
    spec = FAMILIES[family]
    on_disk = json.loads((saved.per_expert / "config.json").read_text())
    assert on_disk["architectures"] == [spec.model_cls.__name__]
    assert on_disk["model_type"] == spec.config_cls.model_type
    assert on_disk["dtype"] == "bfloat16" and "torch_dtype" not in on_disk
    experts_key = "num_experts" if family not in GROUPED else "n_routed_experts"
    if spec.vision_config is not None:  # composite: every MoE key inside text_config
        text = on_disk["text_config"]
        assert text["model_type"] == f"{family}_text" and text["dtype"] == "bfloat16"
        assert experts_key not in on_disk and "moe_intermediate_size" not in on_disk
    else:
        text = on_disk
        assert "text_config" not in on_disk
    assert (text[experts_key], text["num_experts_per_tok"], text["hidden_size"]) == (
        EXPERTS,
        TOP_K,
        HIDDEN,
    )
    assert text["moe_intermediate_size"] == INTER
    # DeepSeek-V3 / GLM-4-MoE write num_nextn_predict_layers=1 by default; the harness
    # writes the true count (0 here). Everything else is what save_pretrained wrote.
    expected = copy.deepcopy(saved.tiny.config_dict)
    if spec.mtp_key in expected:
        assert expected[spec.mtp_key] == 1
        expected[spec.mtp_key] = 0
    assert on_disk == expected
    if family == "glm5_next":
        assert text["swiglu_limit"] == 10.0 and text["routed_scaling_factor"] == 2.5
        assert text["mlp_layer_types"] == ["dense", "sparse", "dense", "sparse"]


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_tensors(family: str, bf16) -> None:
    saved = bf16(family)
    names = _tensors(saved.per_expert)
    for prefix in saved.main:
        assert _under(names, prefix) == _expected_block(family, fused=False)
    prefix = saved.main[-1]
    block = saved.tiny.moe_blocks[prefix]
    disk = _load(
        saved.per_expert,
        [f"{prefix}.experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")],
    )
    assert torch.equal(
        disk[f"{prefix}.experts.3.gate_proj.weight"], block.experts.gate_up_proj[3, :INTER]
    )
    assert torch.equal(
        disk[f"{prefix}.experts.3.up_proj.weight"], block.experts.gate_up_proj[3, INTER:]
    )
    assert torch.equal(disk[f"{prefix}.experts.3.down_proj.weight"], block.experts.down_proj[3])


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_tensors_and_mtp_layers(family: str, bf16) -> None:
    saved = bf16(family)
    spec = FAMILIES[family]
    names = _tensors(saved.fused_mtp)
    mtp = _mtp_prefixes(family, MTP)
    assert [p for p in saved.tiny.moe_blocks if p not in saved.main] == mtp
    for prefix in saved.main + mtp:
        assert _under(names, prefix) == _expected_block(family, fused=True)
    hidden = [HIDDEN, 2 * HIDDEN]
    if spec.mtp_in_decoder:  # decoder index N + j, with eh_proj / enorm / hnorm
        assert names[mtp[1].removesuffix(".mlp") + ".eh_proj.weight"][:2] == ("BF16", hidden)
        assert not any(k.startswith("mtp.") for k in names)
    else:
        assert names["mtp.fc.weight"][:2] == ("BF16", hidden)
    block = saved.tiny.moe_blocks[mtp[1]]
    disk = _load(saved.fused_mtp, [f"{mtp[1]}.experts.gate_up_proj", f"{mtp[1]}.gate.weight"])
    assert torch.equal(disk[f"{mtp[1]}.experts.gate_up_proj"], block.experts.gate_up_proj)
    assert torch.equal(disk[f"{mtp[1]}.gate.weight"], block.gate.weight)
    main = saved.tiny.moe_blocks[saved.main[0]]
    assert not torch.equal(block.experts.gate_up_proj, main.experts.gate_up_proj)
    config = json.loads((saved.fused_mtp / "config.json").read_text())
    text = config.get("text_config", config)
    assert text[spec.mtp_key] == MTP
    if "text_config" in config:
        assert spec.mtp_key not in config
    index = json.loads((saved.fused_mtp / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: v[2] for k, v in names.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_declare_mtp_without_tensors(family: str, bf16, tmp_path: Path) -> None:
    saved = bf16(family)
    (tmp_path / "config.json").write_text((saved.per_expert / "config.json").read_text())
    declare_mtp_without_tensors(tmp_path, 1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("text_config", config)[FAMILIES[family].mtp_key] == 1
    assert not any(
        k.startswith(tuple(_mtp_prefixes(family, 1))) for k in _tensors(saved.per_expert)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reload_gives_the_same_moe_outputs(family: str, bf16) -> None:
    saved = bf16(family)
    x = _inputs()
    for path in (saved.per_expert, saved.fused_mtp):  # MTP tensors are dropped on load
        model = FAMILIES[family].model_cls.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation="eager"
        )
        for prefix in saved.main:
            reloaded, block = model.get_submodule(prefix), saved.tiny.moe_blocks[prefix]
            for name, tensor in block.state_dict().items():
                assert torch.equal(reloaded.state_dict()[name], tensor), (
                    f"{path.name} {prefix}.{name}"
                )
            assert torch.equal(_run(reloaded, x), _run(block, x))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint(family: str, fp8) -> None:
    tiny, path = fp8(family)
    names = _tensors(path)
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization_config"]
    assert {
        k: quant[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")
    } == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert "quantization_config" not in config.get("text_config", {})
    skipped = set(quant["modules_to_not_convert"])
    assert "lm_head" in skipped
    assert len(tiny.moe_blocks) == len(MOE_LAYERS[family]) + 1  # the MTP block too
    for prefix, block in tiny.moe_blocks.items():
        assert f"{prefix}.gate" in skipped
        if family not in GROUPED:
            assert f"{prefix}.shared_expert_gate" in skipped
        want = {}
        for rel, (dtype, shape) in _expected_block(family, fused=False).items():
            if rel.endswith("proj.weight"):  # routed and shared experts
                want[rel] = ("F8_E4M3", shape)
                want[rel + "_scale_inv"] = ("F32", [math.ceil(s / 128) for s in shape])
                assert prefix + "." + rel.removesuffix(".weight") not in skipped
            else:
                want[rel] = (dtype, shape)
        assert _under(names, prefix) == want
        # On disk w * s per block is exactly tiny.exact_weights; the module holds it rounded.
        exact = tiny.exact_weights[prefix]
        disk = _load(
            path,
            [f"{prefix}.experts.5.up_proj.weight", f"{prefix}.experts.5.up_proj.weight_scale_inv"],
        )
        weight, scale = disk.values()
        dequant = weight.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(
            128, 1
        )
        assert torch.equal(dequant, exact["experts.gate_up_proj"][5, INTER:])
        for param, value in exact.items():
            assert torch.equal(
                block.get_parameter(param), value.to(block.get_parameter(param).dtype)
            )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: v[2] for k, v in names.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_moe_tracks_the_bf16_module(family: str, bf16, fp8) -> None:
    x = _inputs()
    for tiny in (bf16(family).tiny, fp8(family)[0]):
        for prefix in list(tiny.moe_blocks)[:2]:
            ref = reference_moe(tiny, prefix, x)
            assert ref.output.dtype == torch.float64 and ref.output.shape == (64, HIDDEN)
            assert ref.topk_ids.shape == (64, TOP_K) and bool((ref.topk_ids.diff(dim=-1) > 0).all())
            assert bool((ref.margin >= 0).all())
            block = tiny.moe_blocks[prefix]
            with torch.no_grad():
                bf16_ids = block.gate(x)[2].sort(dim=-1).values
            clear = ref.margin > 1e-2
            assert clear.float().mean() > 0.7
            assert torch.equal(bf16_ids[clear], ref.topk_ids[clear])
            err = (_run(block, x).double() - ref.output)[clear].abs().max()
            assert err <= 0.02 * ref.output.abs().max()
            if family in GROUPED:  # topk_group 1 of n_group 2: all picks in one group
                groups = ref.topk_ids // (EXPERTS // 2)
                assert bool((groups == groups[:, :1]).all())


@pytest.mark.parametrize("family", GROUPED)
def test_correction_bias_changes_some_selections(family: str, bf16) -> None:
    tiny, prefix = bf16(family).tiny, bf16(family).main[0]
    unbiased = copy.deepcopy(tiny.moe_blocks[prefix])
    assert unbiased.gate.e_score_correction_bias.abs().min() > 0
    unbiased.gate.e_score_correction_bias.zero_()
    x = _inputs(256)
    with_bias = reference_moe(tiny, prefix, x).topk_ids
    without = reference_moe(
        dataclasses.replace(tiny, moe_blocks={prefix: unbiased}), prefix, x
    ).topk_ids
    changed = (with_bias != without).any(dim=-1).float().mean()
    assert 0.05 < changed < 0.8


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_weight_magnitudes_differ_per_expert_projection_and_block(family: str, bf16) -> None:
    block = bf16(family).tiny.moe_blocks[bf16(family).main[0]]
    gate_up = block.experts.gate_up_proj.float()
    down = block.experts.down_proj.float()
    rms = lambda t, dims: t.pow(2).mean(dim=dims).sqrt()  # noqa: E731
    per_expert = rms(gate_up[:, :INTER], (1, 2))
    assert per_expert.max() / per_expert.min() > 1.5
    per_block = rms(
        gate_up[:, :INTER].reshape(EXPERTS, INTER, 2, 128), (1, 3)
    )  # (INTER, HIDDEN): 1 x 2 blocks each
    assert (per_block.max(dim=1).values / per_block.min(dim=1).values).max() > 1.5
    # Normalized by 1/sqrt(fan_in), what is left per projection is its gain.
    projections = torch.stack(
        [
            rms(gate_up[:, :INTER], (0, 1, 2)),
            rms(gate_up[:, INTER:], (0, 1, 2)),
            rms(down, (0, 1, 2)) * 2**0.5,
        ]
    )
    assert projections.max() / projections.min() > 1.1
    logits = _inputs(256).float() @ block.gate.weight.float().T
    assert 0.5 < logits.std() < 2.0


def test_glm5_clamp_acts_and_matters() -> None:
    tiny = build_tiny_model("glm5_next", swiglu_limit=1.5)
    assert tiny.config_dict["text_config"]["swiglu_limit"] == 1.5
    x = _inputs()
    prefix = next(iter(tiny.moe_blocks))
    gate_share, up_share = clamped_fraction(tiny, prefix, x)
    assert 0.02 < gate_share < 0.5 and 0.02 < up_share < 0.5
    clamped = reference_moe(tiny, prefix, x)
    unclamped = reference_moe(tiny, prefix, x, clamp=False)
    assert torch.equal(clamped.topk_ids, unclamped.topk_ids)
    scale = clamped.output.abs().max()
    got = _run(tiny.moe_blocks[prefix], x).double()
    assert (got - clamped.output).abs().max() <= 0.02 * scale
    assert (got - unclamped.output).abs().max() > 0.2 * scale


def test_clamp_options_are_glm5_only() -> None:
    with pytest.raises(ValueError, match="swiglu_limit"):
        build_tiny_model("qwen3_next", swiglu_limit=2.0)
    tiny = build_tiny_model("qwen3_next")
    prefix = next(iter(tiny.moe_blocks))
    with pytest.raises(ValueError, match="clamp"):
        reference_moe(tiny, prefix, _inputs(4), clamp=False)
    with pytest.raises(ValueError, match="clamp"):
        clamped_fraction(tiny, prefix, _inputs(4))
