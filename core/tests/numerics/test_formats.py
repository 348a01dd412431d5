from __future__ import annotations

import warnings

import pytest
import torch

from megamoe.core.numerics import formats
from megamoe.core.numerics.formats import WeightFormat, resolve_formats

# (format, element dtype, values per byte, scale block, scale dtype, scale name)
FORMAT_TABLE = [
    (WeightFormat.BF16, torch.bfloat16, 1, None, None, None),
    (WeightFormat.FP8_BLOCK, torch.float8_e4m3fn, 1, (128, 128), torch.float32, "weight_scale_inv"),
    (WeightFormat.MXFP8, torch.float8_e4m3fn, 1, (1, 32), torch.uint8, "weight_scale"),
    (WeightFormat.MXFP4, torch.uint8, 2, (1, 32), torch.uint8, "weight_scale"),
    (WeightFormat.NVFP4, torch.uint8, 2, (1, 16), torch.float8_e4m3fn, "weight_scale"),
]


@pytest.mark.parametrize(
    ("fmt", "dtype", "per_byte", "block", "scale_dtype", "scale_name"), FORMAT_TABLE
)
def test_format_properties(fmt, dtype, per_byte, block, scale_dtype, scale_name) -> None:
    assert fmt.value == fmt.name.lower()
    assert fmt.element_dtype == dtype
    assert fmt.values_per_byte == per_byte
    assert fmt.scale_block == block
    assert fmt.scale_dtype == scale_dtype
    assert fmt.scale_name == scale_name
    assert fmt.is_mx == (scale_dtype == torch.uint8)


def test_parse_accepts_values_and_members() -> None:
    assert WeightFormat.parse("MXFP8") is WeightFormat.MXFP8
    assert WeightFormat.parse(WeightFormat.BF16) is WeightFormat.BF16


def test_parse_rejects_unknown_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"unknown weight format 'fp6'.*bf16, fp8_block, mxfp8, mxfp4, nvfp4"
    ):
        WeightFormat.parse("fp6")


@pytest.mark.parametrize(
    ("arch", "runs"),
    [
        ("sm90", {WeightFormat.FP8_BLOCK}),
        ("sm100", {WeightFormat.BF16, WeightFormat.MXFP8, WeightFormat.MXFP4}),
        ("reference", set(formats.RUN_FORMATS)),
    ],
)
def test_runnable_formats(arch: str, runs: set[WeightFormat]) -> None:
    assert formats.runnable_formats(arch) == runs
    for fmt in WeightFormat:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, run = resolve_formats(fmt, arch=arch)
        assert run in runs
        if fmt in runs:
            assert run is fmt


def test_nvfp4_is_a_checkpoint_format_no_target_runs() -> None:
    """megamoe's backends do not run NVFP4 (DeepGEMM 0.2.5's nvfp4_mega_moe is not wired)."""
    assert WeightFormat.NVFP4 not in formats.RUN_FORMATS
    for arch in formats.ARCHES:
        assert WeightFormat.NVFP4 not in formats.runnable_formats(arch)
        with pytest.raises(ValueError, match=rf"moe_format='nvfp4' cannot run on {arch}"):
            resolve_formats("mxfp8", "nvfp4", arch=arch)


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="unknown arch 'sm80'"):
        formats.runnable_formats("sm80")


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "_warned", set())


@pytest.mark.parametrize(
    ("checkpoint_format", "arch", "converted"),
    [
        (WeightFormat.FP8_BLOCK, "sm100", WeightFormat.MXFP8),
        (WeightFormat.MXFP8, "sm90", WeightFormat.FP8_BLOCK),
        (WeightFormat.MXFP4, "sm90", WeightFormat.FP8_BLOCK),
        (WeightFormat.BF16, "sm90", WeightFormat.FP8_BLOCK),
        (WeightFormat.NVFP4, "sm90", WeightFormat.FP8_BLOCK),
        (WeightFormat.NVFP4, "sm100", WeightFormat.MXFP8),
        (WeightFormat.NVFP4, "reference", WeightFormat.MXFP8),
    ],
)
def test_implicit_conversion_warns_once_naming_option(checkpoint_format, arch, converted) -> None:
    with pytest.warns(UserWarning, match=rf"moe_format='{converted.value}'") as record:
        assert resolve_formats(checkpoint_format, arch=arch) == (checkpoint_format, converted)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_formats(checkpoint_format, arch=arch) == (checkpoint_format, converted)


def test_requested_format_wins_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_formats("fp8_block", "mxfp4", arch="sm100") == (
            WeightFormat.FP8_BLOCK,
            WeightFormat.MXFP4,
        )


def test_requested_format_the_target_cannot_run() -> None:
    with pytest.raises(
        ValueError, match=r"moe_format='mxfp8' cannot run on sm90 \(it runs: fp8_block\)"
    ):
        resolve_formats("bf16", "mxfp8", arch="sm90")


def test_detect_arch_without_cuda_device() -> None:
    assert formats.detect_arch(None) == "reference"
    assert formats.detect_arch("cpu") == "reference"
