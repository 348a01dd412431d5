"""Which tolerance ``verify`` and ``demo`` apply to each (stored, run) format pair."""

from __future__ import annotations

import pytest

from megamoe.core.cli.verify import (
    KERNEL_LOSSY_FP8_TOLERANCE,
    KERNEL_TOLERANCE,
    LOSSY_FP8_TOLERANCE,
    LOSSY_MXFP4_TOLERANCE,
    TOLERANCE,
    tolerance_for,
)
from megamoe.core.numerics.formats import WeightFormat

W = WeightFormat
CASES = [
    # run as stored: the run format's own tolerance
    *[(f, f, TOLERANCE[f]) for f in TOLERANCE],
    (W.MXFP4, W.MXFP8, TOLERANCE[W.MXFP8]),  # E2M1 x UE8M0 is exact in E4M3 x UE8M0
    (W.FP8_BLOCK, W.BF16, TOLERANCE[W.BF16]),
    (W.BF16, W.MXFP8, LOSSY_FP8_TOLERANCE),
    (W.FP8_BLOCK, W.MXFP8, LOSSY_FP8_TOLERANCE),  # block scales rounded to UE8M0
    (W.BF16, W.FP8_BLOCK, LOSSY_FP8_TOLERANCE),
    (W.MXFP8, W.FP8_BLOCK, LOSSY_FP8_TOLERANCE),
    (W.BF16, W.MXFP4, LOSSY_MXFP4_TOLERANCE),
    (W.FP8_BLOCK, W.MXFP4, LOSSY_MXFP4_TOLERANCE),
    (W.MXFP8, W.MXFP4, LOSSY_MXFP4_TOLERANCE),
]


def test_lossy_tolerances_are_looser_than_the_exact_ones() -> None:
    assert max(TOLERANCE.values()) < LOSSY_FP8_TOLERANCE < LOSSY_MXFP4_TOLERANCE < 1


KERNEL_CASES = [
    # the kernel rounds activations to FP8 in every quantized format, not in BF16
    (W.FP8_BLOCK, W.FP8_BLOCK, KERNEL_TOLERANCE),
    (W.MXFP4, W.MXFP4, KERNEL_TOLERANCE),
    (W.MXFP4, W.MXFP8, KERNEL_TOLERANCE),
    (W.BF16, W.BF16, TOLERANCE[W.BF16]),
    (W.FP8_BLOCK, W.BF16, TOLERANCE[W.BF16]),
    (W.BF16, W.FP8_BLOCK, KERNEL_LOSSY_FP8_TOLERANCE),
    (W.NVFP4, W.MXFP8, KERNEL_LOSSY_FP8_TOLERANCE),
    (W.BF16, W.MXFP4, LOSSY_MXFP4_TOLERANCE),
]


@pytest.mark.parametrize(
    ("checkpoint", "run", "rounding", "want"),
    [(*case[:2], False, case[2]) for case in CASES]
    + [(*case[:2], True, case[2]) for case in KERNEL_CASES],
)
def test_tolerance_per_stored_and_run_format(
    checkpoint: WeightFormat, run: WeightFormat, rounding: bool, want: float
) -> None:
    assert tolerance_for(checkpoint, run, kernel_rounding=rounding) == want


def test_the_kernels_rounding_only_loosens() -> None:
    for checkpoint in W:
        for run in (W.BF16, W.FP8_BLOCK, W.MXFP8, W.MXFP4):
            assert tolerance_for(checkpoint, run, True) >= tolerance_for(checkpoint, run)
    assert max(TOLERANCE.values()) < KERNEL_TOLERANCE < KERNEL_LOSSY_FP8_TOLERANCE < 1
