"""Damaged GLM-5.3-Flash checkpoints: shared expert, block-FP8 scales and config bounds.

Each case is refused the same way by the loading API, ``inspect`` / ``verify`` and
``convert`` (which changes nothing outside its output). Header-level damage (the shared
expert's tensors, config sizes) is refused when the checkpoint is opened; a block-FP8 scale
that is zero or negative is data, refused where the data is read: by a load, by ``verify``
(which loads) and by ``convert``; ``inspect`` reads no data and accepts it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from untouched import deadline, nothing_changes_outside

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.reader import INDEX_FILE, CheckpointReader
from megamoe.core.cli import main as cli
from megamoe.core.convert import convert_checkpoint
from megamoe.core.errors import CheckpointError, InvalidScaleError
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.testing import write_synthetic_checkpoint
from megamoe.glm5next import ADAPTER

SIZES = SyntheticSizes(
    num_layers=2, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
LAYER = "model.language_model.layers.1.mlp"
SHARED = f"{LAYER}.shared_experts"
pytestmark = pytest.mark.filterwarnings("ignore:.*not powers of two:UserWarning")
TIMEOUT_S = 60  # a command that loops over a huge config size fails instead of hanging


def _checkpoint(tmp_path: Path) -> Path:
    return write_synthetic_checkpoint(
        tmp_path / "ckpt", ADAPTER, "fp8_block", SIZES, max_shard_bytes=100_000
    )


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]


def _edit_tensor(ckpt: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or, with None, drop) one tensor in its shard and the index."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    if tensor is None:
        del tensors[name], index["weight_map"][name]
        (ckpt / INDEX_FILE).write_text(json.dumps(index))
    else:
        tensors[name] = tensor
    save_file(tensors, shard)


def _set_scale(ckpt: Path, name: str, block: tuple[int, int], value: float) -> None:
    shard = ckpt / _weight_map(ckpt)[name]
    scale = load_file(shard)[name].clone()
    scale[block] = value
    _edit_tensor(ckpt, name, scale)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _assert_convert_refuses(
    ckpt: Path, to: str, error: type[Exception], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root, out = ckpt.parent, ckpt.parent / "out"
    with nothing_changes_outside(root, out):
        with pytest.raises(error, match=message):
            convert_checkpoint(ckpt, out, to, progress=False)
        assert cli.main(["convert", str(ckpt), str(out), "--to", to, "--no-progress"]) == 1
    assert re.search(message, _one_line(capsys.readouterr().err))
    assert not out.exists() and not list(root.glob("out.partial-*"))


def _load(ckpt: Path, parallel: ParallelSettings) -> None:
    reader = CheckpointReader(ckpt, ADAPTER)
    layer = next(m for m in reader.layers if m.prefix == LAYER)
    block = ADAPTER.build_block(reader.config, layer, parallel=parallel, backend="reference")
    block.load_from_checkpoint(reader)


# -- the shared expert (headers) ------------------------------------------------------------

SHARED_CASES = {
    "shared expert of the wrong shape": (
        f"{SHARED}.up_proj.weight",
        torch.zeros(64, 128, dtype=torch.float8_e4m3fn),
        r"'.*shared_experts\.up_proj\.weight' has shape \(64, 128\), expected \(128, 128\) for "
        r"a fp8_block shared expert",
    ),
    "shared expert without its scale": (
        f"{SHARED}.down_proj.weight_scale_inv",
        None,
        r"1 tensor\(s\) of the shared expert .*shared_experts are missing, e\.g\. "
        r"'down_proj\.weight_scale_inv'",
    ),
    "shared expert scale of the wrong dtype": (
        f"{SHARED}.gate_proj.weight_scale_inv",
        torch.ones(1, 1, dtype=torch.bfloat16),
        r"shared_experts\.gate_proj\.weight_scale_inv' has dtype torch\.bfloat16, expected "
        r"torch\.float32",
    ),
}


@pytest.mark.parametrize("case", list(SHARED_CASES))
def test_a_damaged_shared_expert_is_refused_by_every_command(
    tmp_path: Path, case: str, parallel: ParallelSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    name, tensor, message = SHARED_CASES[case]
    ckpt = _checkpoint(tmp_path)
    _edit_tensor(ckpt, name, tensor)
    _assert_every_command_refuses(ckpt, parallel, message, capsys)


def _assert_every_command_refuses(
    ckpt: Path, parallel: ParallelSettings, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Loading, ``inspect``, ``verify`` and ``convert`` refuse it from the headers alike."""
    with pytest.raises(CheckpointError, match=message):
        _load(ckpt, parallel)
    for command in ("inspect", "verify"):
        assert cli.main([command, str(ckpt)]) == 1
        assert re.search(message, _one_line(capsys.readouterr().err))
    _assert_convert_refuses(ckpt, "mxfp8", CheckpointError, message, capsys)


def _add_tensor(ckpt: Path, name: str, tensor: torch.Tensor) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shard = next(iter(index["weight_map"].values()))
    tensors = load_file(ckpt / shard)
    tensors[name] = tensor
    save_file(tensors, ckpt / shard)
    index["weight_map"][name] = shard
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


@pytest.mark.parametrize("rel", ["gate.extra_bias", "norm.weight"])
def test_a_tensor_under_the_moe_block_that_no_part_loads_is_refused_by_every_command(
    tmp_path: Path, rel: str, parallel: ParallelSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path)
    _add_tensor(ckpt, f"{LAYER}.{rel}", torch.ones(4))
    message = rf"tensor '{re.escape(LAYER)}\.{re.escape(rel)}' is under the MoE block"
    _assert_every_command_refuses(ckpt, parallel, message, capsys)


def test_an_empty_tensor_under_the_moe_block_is_nothing_to_load(
    tmp_path: Path, parallel: ParallelSettings
) -> None:
    ckpt = _checkpoint(tmp_path)
    _add_tensor(ckpt, f"{LAYER}.gate.unused", torch.ones(0, 8))
    _load(ckpt, parallel)


# -- block-FP8 scales (data) ----------------------------------------------------------------

SCALE_CASES = {
    "zero routed-expert scale": (
        f"{LAYER}.experts.1.down_proj.weight_scale_inv",
        0.0,
        r"expert 1 down_proj\.weight_scale_inv: block \(0, 0\) has scale 0\.0; block-FP8 "
        r"scales must be > 0",
        r"experts\.1\.down_proj\.weight_scale_inv: block \(0, 0\) has scale 0\.0",
    ),
    "negative shared-expert scale": (
        f"{SHARED}.gate_proj.weight_scale_inv",
        -0.5,
        r"shared_experts\.gate_proj\.weight_scale_inv: block \(0, 0\) has scale -0\.5",
        r"shared_experts\.gate_proj\.weight_scale_inv: block \(0, 0\) has scale -0\.5",
    ),
}


@pytest.mark.parametrize("case", list(SCALE_CASES))
def test_a_scale_that_is_not_positive_is_refused_where_data_is_read(
    tmp_path: Path, case: str, parallel: ParallelSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    name, value, load_message, convert_message = SCALE_CASES[case]
    ckpt = _checkpoint(tmp_path)
    _set_scale(ckpt, name, (0, 0), value)
    with pytest.raises(InvalidScaleError, match=load_message):
        _load(ckpt, parallel)
    assert cli.main(["verify", str(ckpt), "--layers", "1", "--device", "cpu"]) == 1
    assert re.search(load_message, _one_line(capsys.readouterr().err))
    assert cli.main(["inspect", str(ckpt)]) == 0  # headers only: no data is read
    capsys.readouterr()
    for to in ("mxfp8", "fp8_block"):  # requantized, and copied unchanged
        _assert_convert_refuses(ckpt, to, InvalidScaleError, convert_message, capsys)


def test_the_scale_error_names_the_first_bad_block_and_counts_the_others(
    tmp_path: Path, parallel: ParallelSettings
) -> None:
    wide = SyntheticSizes(
        num_layers=2,
        hidden_size=256,
        intermediate_size=256,
        num_experts=4,
        top_k=2,
        shared_intermediate_size=256,
    )  # fmt: skip: 2x2 blocks of 128x128 per projection
    ckpt = write_synthetic_checkpoint(
        tmp_path / "wide", ADAPTER, "fp8_block", wide, max_shard_bytes=100_000
    )
    name = f"{LAYER}.experts.2.gate_proj.weight_scale_inv"
    _set_scale(ckpt, name, (1, 0), -1.0)
    _set_scale(ckpt, name, (1, 1), 0.0)
    with pytest.raises(InvalidScaleError, match=r"block \(1, 0\) has scale -1\.0 \(2 bad blocks"):
        _load(ckpt, parallel)


# -- config bounds --------------------------------------------------------------------------

BOUND_CASES = {
    "n_routed_experts": 10**9,
    "num_hidden_layers": 10**9,
    "hidden_size": 2**31,
}


@pytest.mark.parametrize("key", list(BOUND_CASES))
def test_a_huge_config_size_is_refused_before_any_loop_or_allocation(
    tmp_path: Path, key: str, parallel: ParallelSettings
) -> None:
    ckpt = _checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"][key] = BOUND_CASES[key]
    (ckpt / "config.json").write_text(json.dumps(config))
    message = rf"config\.json: {key}={BOUND_CASES[key]} exceeds \d+, the largest megamoe accepts"
    with deadline(TIMEOUT_S), pytest.raises(CheckpointError, match=message):
        _load(ckpt, parallel)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for args in (["inspect"], ["verify"], ["convert", "--to", "mxfp8"]):
        argv = [args[0], str(ckpt), *([str(tmp_path / "out")] if args[0] == "convert" else [])]
        done = subprocess.run(
            [sys.executable, "-m", "megamoe.core.cli.main", *argv, *args[1:]],
            capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert re.search(message, _one_line(done.stderr)), done.stderr
    assert not (tmp_path / "out").exists()
