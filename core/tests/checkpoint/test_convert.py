"""Offline conversion: requantized experts, untouched other tensors, atomic, streaming."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from bitcheck import assert_bitwise_equal
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megamoe.core import convert as convert_module
from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint.reader import INDEX_FILE, CheckpointReader
from megamoe.core.convert import convert_checkpoint
from megamoe.core.errors import CheckpointError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.core.testing import (
    synthetic_expert_tensors,
    write_checkpoint,
    write_synthetic_checkpoint,
)

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
TARGETS = [WeightFormat.MXFP8, WeightFormat.MXFP4, WeightFormat.FP8_BLOCK]
SHARD = 150_000
TESTS_DIR = Path(__file__).resolve().parents[1]  # core/tests, where conftest.py lies
SRC_DIR = TESTS_DIR.parent / "src"


def _raw_bytes(path: Path, name: str) -> bytes:
    with safe_open(path, framework="pt") as f:
        tensor = f.get_tensor(name)
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _convert_quietly(src: Path, out: Path, to: WeightFormat) -> convert_module.ConvertResult:
    with warnings.catch_warnings():  # non-power-of-two block scales warn; checked below
        warnings.simplefilter("ignore")
        return convert_checkpoint(src, out, to, progress=False)


@pytest.mark.parametrize("checkpoint_format", list(RUN_FORMATS))  # NVFP4: tests/
@pytest.mark.parametrize("run_format", TARGETS)
def test_convert_requantizes_experts_and_copies_the_rest(
    tmp_path: Path, toy_adapter, checkpoint_format: WeightFormat, run_format: WeightFormat
) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, "toymoe", checkpoint_format, SIZES, max_shard_bytes=SHARD)
    (src / "tokenizer.json").write_text('{"vocab": 1}')
    result = _convert_quietly(src, out, run_format)

    before, after = CheckpointReader(src), CheckpointReader(out)
    before_experts, _ = open_checkpoint(src)
    reader, _ = open_checkpoint(out)
    assert [layer.checkpoint_format for layer in reader.layers] == [run_format] * 2
    assert after.config["quantization_config"]["quant_method"] == (
        "fp8" if run_format is WeightFormat.FP8_BLOCK else run_format.value
    )
    assert (out / "tokenizer.json").read_text() == '{"vocab": 1}'
    assert sorted(set(after.weight_map.values())) == sorted(set(before.weight_map.values()))
    same = checkpoint_format is run_format
    for name, file in before.weight_map.items():
        if before_experts.expert_layer(name) is not None and not same:
            continue
        assert after.weight_map[name] == file, f"{name} moved to another shard"
        digest = [hashlib.sha256(_raw_bytes(r.path / file, name)).digest() for r in (before, after)]
        assert digest[0] == digest[1], f"{name} changed"
    src_scale = checkpoint_format.scale_name
    stems = [f"model.layers.1.mlp.experts.{e}" for e in range(SIZES.num_experts)]
    for expert in [*stems, "model.layers.0.mlp.shared_experts"]:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stem = f"{expert}.{proj}"
            scale = before.get_tensor(f"{stem}.{src_scale}") if src_scale else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want_w, want_s = quant.requantize(
                    before.get_tensor(f"{stem}.weight"), scale, checkpoint_format, run_format
                )
            assert_bitwise_equal(after.get_tensor(f"{stem}.weight"), want_w, f"{stem}.weight")
            scale_name = f"{stem}.{run_format.scale_name}"
            assert_bitwise_equal(after.get_tensor(scale_name), want_s, scale_name)
            assert after.weight_map[f"{stem}.weight"] == before.weight_map[f"{stem}.weight"]
    converted = 0 if same else 2 * 3 * (SIZES.num_experts + 1)
    assert result.converted == converted
    assert result.source_bytes == sum(
        CheckpointReader(src).tensor_spec(n).nbytes for n in before.weight_map
    )
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(
        after.tensor_spec(n).nbytes for n in after.weight_map
    )


def test_fused_bf16_experts_become_per_expert_tensors(tmp_path: Path, toy_adapter) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    config = toy_adapter.synthetic_config(WeightFormat.BF16, SIZES) | {"toy_fused": True}
    write_checkpoint(src, config, toy_adapter.synthetic_tensors(config), max_shard_bytes=SHARD)
    convert_checkpoint(src, out, "mxfp8", progress=False)
    before, after = CheckpointReader(src), CheckpointReader(out)
    prefix = "model.layers.0.mlp.experts"
    fused = before.get_tensor(f"{prefix}.gate_up_proj")
    assert f"{prefix}.gate_up_proj" not in after and "toy_fused" not in after.config
    for e in range(SIZES.num_experts):
        for proj, rows in (("gate_proj", slice(0, 128)), ("up_proj", slice(128, 256))):
            want_w, want_s = quant.requantize(fused[e, rows], None, "bf16", "mxfp8")
            assert_bitwise_equal(after.get_tensor(f"{prefix}.{e}.{proj}.weight"), want_w, proj)
            assert_bitwise_equal(
                after.get_tensor(f"{prefix}.{e}.{proj}.weight_scale"), want_s, proj
            )
            assert (
                after.weight_map[f"{prefix}.{e}.{proj}.weight"]
                == (before.weight_map[f"{prefix}.gate_up_proj"])
            )
        down = quant.requantize(before.get_tensor(f"{prefix}.down_proj")[e], None, "bf16", "mxfp8")
        assert_bitwise_equal(after.get_tensor(f"{prefix}.{e}.down_proj.weight"), down[0], "down")


def _pow2_checkpoint(path: Path, adapter, pow2: bool | None) -> None:
    config = adapter.synthetic_config(WeightFormat.FP8_BLOCK, SIZES) | {"toy_shared": False}
    tensors = [
        (f"model.layers.{i}.mlp.experts.{rel}", t)
        for i in range(SIZES.num_layers)
        for rel, t in synthetic_expert_tensors(
            "fp8_block", 4, 256, 128, seed=i, pow2_block_scales=pow2
        )
    ]
    tensors += _routers(SIZES.num_layers, 4, 256)
    write_checkpoint(path, config, tensors, max_shard_bytes=SHARD)


def _routers(layers: int, experts: int, hidden: int) -> list[tuple[str, torch.Tensor]]:
    """Each MoE layer's router weight, which every checkpoint holds beside its experts."""
    return [
        (f"model.layers.{i}.mlp.gate.weight", torch.zeros(experts, hidden, dtype=torch.bfloat16))
        for i in range(layers)
    ]


def test_block_fp8_to_mx_warns_only_for_non_power_of_two_scales(
    tmp_path: Path, toy_adapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "_warned_not_power_of_two", set())
    _pow2_checkpoint(tmp_path / "pow2", toy_adapter, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(tmp_path / "pow2", tmp_path / "a", "mxfp8", progress=False)
    _pow2_checkpoint(tmp_path / "odd", toy_adapter, False)
    with pytest.warns(UserWarning, match="not powers of two.*Pass --to fp8_block"):
        convert_checkpoint(tmp_path / "odd", tmp_path / "b", "mxfp8", progress=False)


def test_interrupted_convert_leaves_no_output(
    tmp_path: Path, toy_adapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, "toymoe", "bf16", SIZES, max_shard_bytes=SHARD)
    real, calls = quant.requantize, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C midway
        return real(*args, **kwargs)

    monkeypatch.setattr(quant, "requantize", failing)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert len(calls) == 10
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "partial output left behind"


def test_killed_convert_leaves_only_a_partial_directory(tmp_path: Path, toy_adapter, monkeypatch):
    """A process killed midway (no cleanup) leaves OUT.partial-<pid>, never OUT."""
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, "toymoe", "bf16", SIZES, max_shard_bytes=SHARD)
    seen: list[list[str]] = []

    def snapshot(*args, **kwargs):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        raise RuntimeError("stop")

    monkeypatch.setattr(convert_module, "_finish", snapshot)
    with pytest.raises(RuntimeError, match="stop"):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert seen == [[f"out.partial-{os.getpid()}", "src"]]


def test_a_nan_router_is_refused_before_anything_is_written(tmp_path: Path, toy_adapter) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, "toymoe", "bf16", SIZES)
    name = "model.layers.0.mlp.gate.weight"
    shard = src / json.loads((src / INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][0, 3] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds NaN or infinity"):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_refuses_existing_output_and_bad_source(tmp_path: Path, toy_adapter) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, "toymoe", "bf16", SIZES, max_shard_bytes=SHARD)
    out.mkdir()
    with pytest.raises(FileExistsError, match="already exists; remove it"):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    out.rmdir()
    with pytest.raises(ValueError, match=r"the output lies inside the checkpoint .*outside it"):
        convert_checkpoint(src, src / "sub", "mxfp8", progress=False)
    assert not (src / "sub").exists() and not list(src.glob("sub.partial-*"))
    with pytest.raises(ValueError, match="--to nvfp4: convert writes one of mxfp8, mxfp4"):
        convert_checkpoint(src, out, "nvfp4", progress=False)
    with pytest.raises(
        ValueError, match="--to bf16: convert writes one of mxfp8, mxfp4, fp8_block"
    ):
        convert_checkpoint(src, out, "bf16", progress=False)
    index = json.loads((src / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (src / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not listed in .*'.*experts\.3\.up_proj\.weight'"):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


STREAM_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from conftest import TOY
    from megamoe.core import adapters
    adapters.installed_adapters = lambda: {TOY.name: TOY}
    from megamoe.core.convert import convert_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    start = status("VmRSS")
    convert_checkpoint(sys.argv[2], sys.argv[3], "mxfp8", progress=False)
    print(json.dumps({"start": start, "peak": status("VmHWM")}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_convert_streams_with_memory_near_one_projection(tmp_path: Path, toy_adapter) -> None:
    """A 100 MB checkpoint of 50 MB layers converts with peak RSS growing < 25 MB."""
    sizes = SyntheticSizes(num_layers=2, hidden_size=512, intermediate_size=256, num_experts=64)
    config = toy_adapter.synthetic_config(WeightFormat.BF16, sizes) | {"toy_shared": False}
    ramp = (torch.arange(512 * 256) % 251 - 125).to(torch.bfloat16) / 1024  # cheap to make
    tensors = (
        (f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", (ramp * (e + 1)).reshape(shape))
        for i in range(2)
        for e in range(64)
        for proj, shape in (
            ("gate_proj", (256, 512)),
            ("up_proj", (256, 512)),
            ("down_proj", (512, 256)),
        )
    )
    src = tmp_path / "src"
    write_checkpoint(src, config, [*tensors, *_routers(2, 64, 512)], max_shard_bytes=40 << 20)
    checkpoint_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    layer_bytes = 64 * 3 * 512 * 256 * 2
    assert checkpoint_bytes > 1.99 * layer_bytes
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SRC_DIR), os.environ.get("PYTHONPATH", "")])
    )
    child = subprocess.run(
        [sys.executable, "-c", STREAM_CHILD, str(TESTS_DIR), str(src), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, check=False, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    rss = json.loads(child.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["start"]
    # Holding the checkpoint (150 MB) or one layer (50 MB) in memory would fail this.
    assert growth < 0.5 * layer_bytes, f"peak RSS grew {growth / 1e6:.1f} MB"
    assert (tmp_path / "out" / INDEX_FILE).is_file()
