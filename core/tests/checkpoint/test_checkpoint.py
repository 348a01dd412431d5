"""Synthetic checkpoints in HF layout, and the reader's checks on bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint.reader import INDEX_FILE, SINGLE_FILE, CheckpointReader
from megamoe.core.errors import CheckpointError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.core.testing import (
    synthetic_dense,
    synthetic_expert_tensors,
    write_checkpoint,
    write_synthetic_checkpoint,
)

FORMATS = list(RUN_FORMATS)  # NVFP4: tests/test_nvfp4_checkpoints.py
SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=256, num_experts=4)
EXPERT = "model.layers.1.mlp.experts.2.down_proj"


def _dequantized(fmt: WeightFormat, tensors: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    scale = tensors.get(f"{stem}.{fmt.scale_name}") if fmt.scale_name else None
    return quant.dequantize(tensors[f"{stem}.weight"], scale, fmt)


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    return x.abs().reshape(rows // 128, 128, cols // 128, 128).amax(dim=(1, 3))


# ---------------------------------------------------------------- synthetic tensors
@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_magnitudes_differ_per_expert_shard_and_block(fmt: WeightFormat) -> None:
    tensors = dict(synthetic_expert_tensors(fmt, 3, 256, 256, seed=5))
    amax = {
        (e, proj): _block_amax(_dequantized(fmt, tensors, f"{e}.{proj}"))
        for e in range(3)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    for (e, proj), blocks in amax.items():
        assert len(set(blocks.flatten().tolist())) > 1, f"{e}.{proj}: every block alike"
        assert torch.isfinite(blocks).all() and (blocks > 0).all()
    for e in range(3):
        assert not torch.equal(amax[(e, "gate_proj")], amax[(e, "up_proj")])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert not torch.equal(amax[(0, proj)], amax[(1, proj)])
    # Typical magnitude grows with the expert index (gain 1 + 0.15 e).
    means = [torch.stack([amax[(e, p)].mean() for p in ("gate_proj",)]).item() for e in range(3)]
    assert len(set(means)) == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_tensor_names_dtypes_and_shapes(fmt: WeightFormat) -> None:
    tensors = dict(synthetic_expert_tensors(fmt, 2, 256, 128, seed=0))
    per_proj = 1 if fmt.scale_name is None else 2
    assert len(tensors) == 2 * 3 * per_proj
    gate = tensors["1.gate_proj.weight"]
    down = tensors["1.down_proj.weight"]
    assert gate.dtype == fmt.element_dtype and down.dtype == fmt.element_dtype
    assert gate.shape == (128, 256 // fmt.values_per_byte)
    assert down.shape == (256, 128 // fmt.values_per_byte)
    if fmt is WeightFormat.FP8_BLOCK:
        assert tensors["1.gate_proj.weight_scale_inv"].shape == (1, 2)
        assert tensors["1.down_proj.weight_scale_inv"].dtype == torch.float32
    elif fmt.is_mx:
        assert tensors["1.gate_proj.weight_scale"].shape == (128, 8)
        assert tensors["1.down_proj.weight_scale"].dtype == torch.uint8


@pytest.mark.parametrize("pow2", [True, False, None])
def test_block_fp8_scales_power_of_two_control(pow2: bool | None) -> None:
    tensors = dict(
        synthetic_expert_tensors("fp8_block", 2, 256, 256, seed=1, pow2_block_scales=pow2)
    )
    scales = torch.cat([t.flatten() for n, t in tensors.items() if n.endswith("scale_inv")])
    mantissa, _ = torch.frexp(scales)
    is_pow2 = mantissa == 0.5
    if pow2 is True:
        assert is_pow2.all()
    elif pow2 is False:
        assert not is_pow2.any()
    else:
        assert is_pow2.any() and not is_pow2.all()
        assert quant.is_power_of_two(tensors["0.gate_proj.weight_scale_inv"]) is False


def test_fused_bf16_holds_the_per_expert_weights() -> None:
    fused = dict(synthetic_expert_tensors("bf16", 3, 256, 128, seed=2, fused_bf16=True))
    split = dict(synthetic_expert_tensors("bf16", 3, 256, 128, seed=2))
    assert fused["gate_up_proj"].shape == (3, 256, 256)
    assert fused["down_proj"].shape == (3, 256, 128)
    for e in range(3):
        assert torch.equal(fused["gate_up_proj"][e, :128], split[f"{e}.gate_proj.weight"])
        assert torch.equal(fused["gate_up_proj"][e, 128:], split[f"{e}.up_proj.weight"])
        assert torch.equal(fused["down_proj"][e], split[f"{e}.down_proj.weight"])


def test_synthetic_refuses_bad_sizes_and_fused_quantized() -> None:
    with pytest.raises(ValueError, match=r"hidden_size=200: .*multiple of 128"):
        next(synthetic_expert_tensors("bf16", 2, 200, 128, seed=0))
    with pytest.raises(ValueError, match="fused_bf16=True needs fmt=bf16, got mxfp8"):
        next(synthetic_expert_tensors("mxfp8", 2, 256, 128, seed=0, fused_bf16=True))


def test_synthetic_dense_varies_per_block_and_is_reproducible() -> None:
    a = synthetic_dense((256, 384), 0.02, seed=3)
    assert a.dtype == torch.bfloat16
    assert torch.equal(a, synthetic_dense((256, 384), 0.02, seed=3))
    assert not torch.equal(a, synthetic_dense((256, 384), 0.02, seed=4))
    assert len(set(_block_amax(a.float()).flatten().tolist())) == 6


# ---------------------------------------------------------------- HF layout
def test_write_checkpoint_shards_and_indexes(tmp_path: Path) -> None:
    tensors = {f"t.{i}": torch.full((64, 64), float(i)) for i in range(10)}  # 16 KiB each
    write_checkpoint(tmp_path, {"model_type": "x"}, tensors.items(), max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]
    assert index["metadata"]["total_size"] == 10 * 64 * 64 * 4
    assert not (tmp_path / SINGLE_FILE).exists()
    assert not list(tmp_path.glob(".shard-*"))
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / file)[name], tensors[name])
    reader = CheckpointReader(tmp_path)
    assert reader.tensor_names() == sorted(tensors)
    assert torch.equal(reader.get_tensor("t.7"), tensors["t.7"])


def test_small_checkpoint_is_one_file_without_index(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, {"model_type": "x"}, [("a", torch.ones(3))])
    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    assert CheckpointReader(tmp_path).weight_map == {"a": SINGLE_FILE}


def test_write_checkpoint_refuses_duplicate_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'a' was given twice"):
        write_checkpoint(tmp_path, {}, [("a", torch.ones(1)), ("a", torch.ones(1))])


@pytest.mark.parametrize("fmt", FORMATS)
def test_synthetic_checkpoint_opens_and_checks(tmp_path: Path, toy_adapter, fmt) -> None:
    write_synthetic_checkpoint(tmp_path, "toymoe", fmt, SIZES, max_shard_bytes=300_000)
    reader, adapter = open_checkpoint(tmp_path)
    assert adapter is toy_adapter
    assert [layer.checkpoint_format for layer in reader.layers] == [fmt, fmt]
    assert len(set(reader.weight_map.values())) > 2, "expected a sharded checkpoint"
    for layer in reader.layers:
        reader.check_layer(layer)
    names = [n for n, _ in reader.iter_tensors("model.layers.1.mlp.experts", lambda n: n[0] == "3")]
    assert names and all(n.startswith("3.") for n in names)


def test_fused_experts_read_as_per_expert_slices_of_the_kept_experts(
    tmp_path: Path, toy_adapter
) -> None:
    config = toy_adapter.synthetic_config(WeightFormat.BF16, SIZES) | {"toy_fused": True}
    write_checkpoint(tmp_path, config, toy_adapter.synthetic_tensors(config))
    reader, _ = open_checkpoint(tmp_path)
    experts = "model.layers.1.mlp.experts"
    fused = {n: reader.get_tensor(f"{experts}.{n}") for n in ("gate_up_proj", "down_proj")}
    inter = SIZES.intermediate_size
    # This rank holds experts 1 and 3: the fused tensors come as their projections only.
    kept = {"1", "3"}
    stream = dict(reader.iter_tensors(experts, keep=lambda n: n.split(".")[0] in kept))
    assert sorted(stream) == [
        f"{e}.{p}.weight" for e in (1, 3) for p in ("down_proj", "gate_proj", "up_proj")
    ]
    for e in (1, 3):
        assert torch.equal(stream[f"{e}.gate_proj.weight"], fused["gate_up_proj"][e, :inter])
        assert torch.equal(stream[f"{e}.up_proj.weight"], fused["gate_up_proj"][e, inter:])
        assert torch.equal(stream[f"{e}.down_proj.weight"], fused["down_proj"][e])
        assert stream[f"{e}.gate_proj.weight"].is_contiguous()
    # One projection on its own, as the float64 references read them.
    piece = reader.fused_piece(f"{experts}.2.up_proj.weight")
    assert piece is not None and (piece.stored, piece.expert, piece.rows) == (
        f"{experts}.gate_up_proj",
        2,
        (inter, 2 * inter),
    )
    assert torch.equal(
        reader.get_tensor(f"{experts}.2.up_proj.weight"), fused["gate_up_proj"][2, inter:]
    )
    assert reader.fused_piece(f"{experts}.{SIZES.num_experts}.up_proj.weight") is None
    # Errors name the file a piece was read from: its fused tensor's.
    assert reader.source_of(f"{experts}.2.up_proj.weight") == reader.file_of(
        f"{experts}.gate_up_proj"
    )
    assert reader.source_of("model.layers.1.mlp.gate.weight") == reader.file_of(
        "model.layers.1.mlp.gate.weight"
    )
    with pytest.raises(CheckpointError, match=r"no tensor .*experts\.9\.down_proj\.weight"):
        reader.source_of(f"{experts}.9.down_proj.weight")
    with pytest.raises(CheckpointError, match=r"no tensor .*experts\.9\.up_proj\.weight"):
        reader.get_tensor(f"{experts}.9.up_proj.weight")


def test_synthetic_checkpoint_refuses_unknown_adapter(tmp_path: Path, toy_adapter) -> None:
    with pytest.raises(LookupError, match=r"no installed megamoe adapter named 'nope'.*toymoe"):
        write_synthetic_checkpoint(tmp_path, "nope", "bf16")


# ---------------------------------------------------------------- bad checkpoints
def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / INDEX_FILE).read_text())["weight_map"][name]


def _replace_tensor(path: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Rewrite the shard holding ``name`` with it replaced (or removed when None)."""
    shard = _shard_of(path, name)
    tensors = load_file(shard)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})


def _missing_shard(path: Path) -> None:
    _shard_of(path, f"{EXPERT}.weight").unlink()


def _absent_tensor(path: Path) -> None:
    _replace_tensor(path, f"{EXPERT}.weight", None)


def _truncated(path: Path) -> None:
    shard = _shard_of(path, f"{EXPERT}.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])


def _corrupt_header(path: Path) -> None:
    shard = _shard_of(path, f"{EXPERT}.weight")
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\x00{{{"
    shard.write_bytes(bytes(data))


def _wrong_dtype(path: Path) -> None:
    _replace_tensor(path, f"{EXPERT}.weight", torch.zeros(256, 256, dtype=torch.int16))


ROUTER = "model.layers.1.mlp.gate.weight"


def _router_missing(path: Path) -> None:
    _replace_tensor(path, ROUTER, None)
    index = json.loads((path / INDEX_FILE).read_text())
    del index["weight_map"][ROUTER]
    (path / INDEX_FILE).write_text(json.dumps(index))


def _router_shape(path: Path) -> None:
    _replace_tensor(path, ROUTER, torch.zeros(2, 256, dtype=torch.bfloat16))


def _router_quantized(path: Path) -> None:
    _replace_tensor(path, ROUTER, torch.zeros(4, 256, dtype=torch.float8_e4m3fn))


def _float32_experts(path: Path) -> None:
    _replace_tensor(path, f"{EXPERT}.weight", torch.zeros(256, 256, dtype=torch.float32))


def _wrong_shape(path: Path) -> None:
    _replace_tensor(path, f"{EXPERT}.weight", torch.zeros(256, 128, dtype=torch.bfloat16))


def _unknown_model(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))


def _unsupported_quant(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))


def _unlisted_tensor(path: Path) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    del index["weight_map"][f"{EXPERT}.weight"]
    (path / INDEX_FILE).write_text(json.dumps(index))


def _missing_expert(path: Path) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    shard = path / index["weight_map"].pop(f"{EXPERT}.weight")
    (path / INDEX_FILE).write_text(json.dumps(index))
    tensors = load_file(shard)
    del tensors[f"{EXPERT}.weight"]
    save_file(tensors, shard)


BAD = {
    "missing shard": (_missing_shard, CheckpointError, r"shard file is missing; .* names it"),
    "index names absent tensor": (
        _absent_tensor,
        CheckpointError,
        r"tensor 'model.layers.1.mlp.experts.2.down_proj.weight' is named in "
        r"model.safetensors.index.json but absent from this file",
    ),
    "truncated file": (_truncated, CheckpointError, r"model-\d+-of-\d+.safetensors: .*truncated"),
    "corrupt header": (_corrupt_header, CheckpointError, r"not a readable safetensors file"),
    "wrong dtype": (
        _wrong_dtype,
        CheckpointError,
        r"down_proj.weight' has dtype torch.int16, expected torch.bfloat16 for bf16 experts",
    ),
    "router missing": (
        _router_missing,
        CheckpointError,
        rf"index.json: tensor '{ROUTER}' is missing; the MoE layer model.layers.1.mlp that "
        r"config.json declares loads it \(shape \(4, 256\)\)",
    ),
    "router shape": (
        _router_shape,
        CheckpointError,
        rf"safetensors: tensor '{ROUTER}' has shape \(2, 256\), expected \(4, 256\) per config",
    ),
    "router quantized": (
        _router_quantized,
        CheckpointError,
        rf"'{ROUTER}' has dtype torch.float8_e4m3fn; megamoe loads it unquantized",
    ),
    "float32 experts": (
        _float32_experts,
        CheckpointError,
        r"down_proj.weight' has dtype torch.float32; megamoe reads unquantized expert weights "
        r"in bfloat16 only .*: save the checkpoint in bfloat16 first",
    ),
    "wrong shape": (
        _wrong_shape,
        CheckpointError,
        r"down_proj.weight' has shape \(256, 128\), expected \(256, 256\) .* \(4, 256, 256\)",
    ),
    "unknown model type": (
        _unknown_model,
        LookupError,
        r"model_type='llama'.*installed: toymoe \(toy_moe\); for other models: pip install "
        r"megamoe-qwen4exp megamoe-glm5next",
    ),
    "unsupported quantization": (
        _unsupported_quant,
        NotImplementedError,
        r"model.layers.0.mlp.experts: quantization_config quant_method='awq' is not supported",
    ),
    "tensor of a shard missing from the index": (
        _unlisted_tensor,
        CheckpointError,
        r"1 tensor\(s\) of the shards are not listed in model.safetensors.index.json, e.g. "
        r"'model.layers.1.mlp.experts.2.down_proj.weight'",
    ),
    "expert missing": (
        _missing_expert,
        CheckpointError,
        r"1 routed-expert tensor\(s\) of model.layers.1.mlp.experts are missing .*"
        r"'2.down_proj.weight'",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_fails_before_reading_data(tmp_path: Path, toy_adapter, case: str) -> None:
    write_synthetic_checkpoint(tmp_path, "toymoe", "bf16", SIZES, max_shard_bytes=300_000)
    damage, error, message = BAD[case]
    damage(tmp_path)

    with pytest.raises(error, match=message):
        open_checkpoint(tmp_path)  # validates everything, reads no tensor data


def test_reader_without_adapter_still_checks_files(tmp_path: Path, toy_adapter) -> None:
    write_synthetic_checkpoint(tmp_path, "toymoe", "bf16", SIZES, max_shard_bytes=300_000)
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        reader.get_tensor("nope")
    _absent_tensor(tmp_path)
    with pytest.raises(CheckpointError, match="absent from this file"):
        CheckpointReader(tmp_path)


def test_format_mismatch_between_config_and_tensors(tmp_path: Path, toy_adapter) -> None:
    write_synthetic_checkpoint(tmp_path, "toymoe", "mxfp8", SIZES, max_shard_bytes=300_000)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is not a tensor of fp8_block routed experts"):
        open_checkpoint(tmp_path)


def test_missing_config_and_index(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors\.index\.json nor"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a valid index"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        CheckpointReader(tmp_path)


def test_headers_are_read_without_tensor_data(tmp_path: Path, toy_adapter) -> None:
    """Validation parses headers only: it passes on a file whose data bytes are garbage."""
    write_synthetic_checkpoint(tmp_path, "toymoe", "bf16", SIZES, max_shard_bytes=300_000)
    shard = _shard_of(tmp_path, f"{EXPERT}.weight")
    data = bytearray(shard.read_bytes())
    with safe_open(shard, framework="pt") as f:
        header_len = int.from_bytes(data[:8], "little")
        assert f.keys()
    data[8 + header_len :] = bytes(len(data) - 8 - header_len)  # zero every tensor byte
    shard.write_bytes(bytes(data))
    reader, _ = open_checkpoint(tmp_path)
    reader.check_layer(reader.layers[1])  # no error: nothing was read
    assert not reader.get_tensor(f"{EXPERT}.weight").any()


def test_a_stray_single_file_beside_an_index_is_named(
    tmp_path: Path, toy_adapter, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_synthetic_checkpoint(tmp_path / "ckpt", "toymoe", "bf16", SIZES)
    save_file({"x": torch.zeros(2)}, path / "model.safetensors")
    with caplog.at_level("WARNING", logger="megamoe"):
        CheckpointReader(path, toy_adapter)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "both model.safetensors.index.json and model.safetensors are present; megamoe reads "
        "the shards the index names" in m
        for m in said
    ), said
