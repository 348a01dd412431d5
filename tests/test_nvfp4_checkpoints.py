"""NVFP4 checkpoints of both adapters, in ModelOpt and compressed-tensors layouts.

Open and inspect, load (requantized, with the warning once per layer), verify against the
float64 reference of the NVFP4 tensors, convert (offline equals online, no NVFP4 tensors
left), and the refusals: a missing global scale, a bad one, an NVFP4 shared expert.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import ModelAdapter, SyntheticSizes, installed_adapters, open_checkpoint
from megamoe.core.checkpoint import nvfp4
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.cli.inspection import plan_checkpoint
from megamoe.core.cli.verify import tolerance_for, verify_layer
from megamoe.core.convert import convert_checkpoint
from megamoe.core.errors import CheckpointError, InvalidScaleError, UnsupportedCheckpointError
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import nvfp4_as_compressed_tensors, write_checkpoint

W = WeightFormat
ADAPTERS = installed_adapters()
SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
LAYOUTS = ("modelopt", "compressed-tensors")
CASES = [(name, layout) for name in ("qwen4exp", "glm5next") for layout in LAYOUTS]
IDS = [f"{name}-{layout}" for name, layout in CASES]
Tensors = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _write(
    path: Path, adapter: ModelAdapter, layout: str, edit: Tensors | None = None, seed: int = 0
) -> Path:
    """A synthetic NVFP4 checkpoint of ``adapter`` in ``layout``, its tensors ``edit``-ed."""
    config = adapter.synthetic_config(W.NVFP4, SIZES)
    tensors: Iterator[tuple[str, torch.Tensor]] = adapter.synthetic_tensors(config, seed)
    if layout == "compressed-tensors":
        config, tensors = nvfp4_as_compressed_tensors(config, tensors)
    held = dict(tensors)
    return write_checkpoint(path, config, (edit or dict)(held).items(), max_shard_bytes=300_000)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvfp4, "_warned_requantized", set())


def test_both_adapters_load_nvfp4() -> None:
    for name in ("qwen4exp", "glm5next"):
        assert W.NVFP4 in ADAPTERS[name].checkpoint_formats


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_open_and_inspect(tmp_path: Path, name: str, layout: str) -> None:
    path = _write(tmp_path / "ckpt", ADAPTERS[name], layout)
    reader, adapter = open_checkpoint(path)
    assert adapter is ADAPTERS[name] and len(reader.layers) == 3  # two MoE layers and MTP
    assert {layer.checkpoint_format for layer in reader.layers} == {W.NVFP4}
    names = reader.names_under(f"{reader.layers[0].prefix}.experts")
    kinds = {n.rpartition(".")[2] for n in names}
    if layout == "modelopt":
        assert kinds == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    else:
        assert kinds == {
            "weight_packed",
            "weight_scale",
            "weight_global_scale",
            "input_global_scale",
        }
    for arch, run in (("sm100", W.MXFP8), ("sm90", W.FP8_BLOCK), ("reference", W.MXFP8)):
        plan = plan_checkpoint(path, arch=arch)
        assert {p.run_format for p in plan.layers} == {run}
        assert plan.layers[0].conversion == f"nvfp4 -> {run.value} (requantized)"


@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_load_and_verify_against_the_nvfp4_reference(
    tmp_path: Path, name: str, layout: str
) -> None:
    """Every layer requantized to each run format stays within the stated tolerance."""
    reader, adapter = open_checkpoint(_write(tmp_path / "ckpt", ADAPTERS[name], layout, seed=3))
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    layer = reader.layers[0]
    for run in (W.MXFP8, W.FP8_BLOCK, W.MXFP4):
        with pytest.warns(UserWarning, match=rf"{layer.prefix}\.experts: NVFP4 experts requant"):
            check = verify_layer(
                reader, adapter, layer, parallel=parallel, moe_format=run, backend="reference"
            )
        assert check.run_format is run and check.tolerance == tolerance_for(W.NVFP4, run)
        assert check.ok, f"{run.value}: error {check.max_rel_error} > {check.tolerance}"
        assert check.max_rel_error > 1e-4  # requantized: not the NVFP4 values themselves
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer: the second load stays silent
        again = verify_layer(
            reader, adapter, layer, parallel=parallel, moe_format=W.MXFP8, backend="reference"
        )
    assert again.ok


def _kernel_tensors(
    adapter: ModelAdapter, reader: CheckpointReader, run: WeightFormat
) -> dict[str, torch.Tensor]:
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    found = {}
    for layer in reader.layers:
        forced = dataclasses.replace(layer, is_mtp=False)
        block = adapter.build_block(
            reader.config, forced, parallel=parallel, moe_format=run, backend="reference"
        )
        block.load_from_checkpoint(reader)
        for key, param in block.experts.kernel_params.items():
            found[f"{layer.prefix}.{key}"] = param.detach().clone()
        found[f"{layer.prefix}.fused_shared"] = torch.tensor(block.experts.num_shared_experts)
    return found


@pytest.mark.parametrize("run", [W.MXFP8, W.FP8_BLOCK, W.MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize(("name", "layout"), CASES, ids=IDS)
def test_convert_equals_online_requantization(
    tmp_path: Path, name: str, layout: str, run: WeightFormat
) -> None:
    adapter = ADAPTERS[name]
    src = _write(tmp_path / "src", adapter, layout)
    with pytest.warns(UserWarning, match="NVFP4 experts requantized .* --to chooses"):
        convert_checkpoint(src, tmp_path / "out", run, progress=False)
    reader, _ = open_checkpoint(tmp_path / "out")
    assert {layer.checkpoint_format for layer in reader.layers} == {run}
    leftovers = [
        n
        for n in reader.tensor_names()
        if n.rpartition(".")[2] in ("weight_scale_2", "weight_global_scale", "input_scale")
        or n.endswith("input_global_scale")
    ]
    assert leftovers == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        online = _kernel_tensors(adapter, CheckpointReader(src, adapter), run)
        offline = _kernel_tensors(adapter, reader, run)
    assert online.keys() == offline.keys() and online
    for key in online:
        assert_bitwise_equal(offline[key], online[key], key)


def _first_global(tensors: dict[str, torch.Tensor]) -> str:
    return next(n for n in sorted(tensors) if n.endswith(("weight_scale_2", "weight_global_scale")))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_missing_global_scale_is_named_at_open(tmp_path: Path, layout: str) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors.pop(_first_global(tensors))
        return tensors

    path = _write(tmp_path / "ckpt", ADAPTERS["qwen4exp"], layout, drop)
    with pytest.raises(
        CheckpointError,
        match=r"needs weight or weight_packed and weight_scale "
        r"and weight_scale_2 or weight_global_scale",
    ):
        open_checkpoint(path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_global_scale_is_refused_at_load(tmp_path: Path, layout: str) -> None:
    def zero(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = _first_global(tensors)
        tensors[name] = torch.zeros_like(tensors[name])
        return tensors

    path = _write(tmp_path / "ckpt", ADAPTERS["glm5next"], layout, zero)
    reader, adapter = open_checkpoint(path)
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    layer = reader.layers[0]
    with (
        pytest.raises(InvalidScaleError, match=r"global scale is 0\.0; it must be > 0"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        verify_layer(reader, adapter, layer, parallel=parallel, backend="reference")


def test_input_scale_of_the_wrong_shape_is_named_at_open(tmp_path: Path) -> None:
    def widen(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = next(n for n in sorted(tensors) if n.endswith("input_scale"))
        tensors[name] = torch.ones(2)
        return tensors

    path = _write(tmp_path / "ckpt", ADAPTERS["qwen4exp"], "modelopt", widen)
    with pytest.raises(CheckpointError, match=r"input_scale' has shape \(2,\), expected \(\)"):
        open_checkpoint(path)


def test_nvfp4_shared_expert_is_refused_by_name(tmp_path: Path) -> None:
    """A config that quantizes the shared expert too: megamoe loads NVFP4 routed experts only."""
    adapter = ADAPTERS["qwen4exp"]
    path = _write(tmp_path / "ckpt", adapter, "modelopt")
    config = json.loads((path / "config.json").read_text())
    quant: dict[str, Any] = config["quantization_config"]
    quant["ignore"] = [e for e in quant["ignore"] if not e.endswith("shared_expert")]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match=r"shared expert .* is stored as NVFP4"):
        open_checkpoint(path)


def test_engine_style_loading_in_any_order(tmp_path: Path) -> None:
    """compressed-tensors names through load_weights, shuffled and chunked: same weights."""
    adapter = ADAPTERS["qwen4exp"]
    config = adapter.synthetic_config(W.NVFP4, SIZES)
    config, stream = nvfp4_as_compressed_tensors(config, adapter.synthetic_tensors(config))
    layer = adapter.moe_layers(config)[0]
    head = f"{layer.prefix}."
    tensors = [(n[len(head) :], t) for n, t in stream if n.startswith(head)]
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    results = []
    for order in (list(range(len(tensors))), torch.randperm(len(tensors)).tolist()):
        block = adapter.build_block(
            config, layer, parallel=parallel, moe_format=W.MXFP8, backend="reference"
        )
        shuffled = [tensors[i] for i in order]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for start in range(0, len(shuffled), 7):
                block.load_weights(shuffled[start : start + 7])
            block.finalize()
        results.append({k: p.detach().clone() for k, p in block.experts.kernel_params.items()})
    for key in results[0]:
        assert_bitwise_equal(results[1][key], results[0][key], key)
