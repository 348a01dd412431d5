"""The comparison helpers every numerics test relies on: they must fail when they should."""

from __future__ import annotations

import math

import pytest
import torch
from bitcheck import assert_bitwise_equal, relative_error


def test_bitwise_equal_passes_on_identical_bits_nan_included() -> None:
    nan_row = torch.tensor([1.0, math.nan, -0.0, math.inf], dtype=torch.bfloat16)
    assert_bitwise_equal(nan_row, nan_row.clone(), "bf16 with NaN")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    assert_bitwise_equal(codes, codes.clone(), "every E4M3 byte")


def test_bitwise_equal_reports_the_first_difference() -> None:
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = -0.0  # equal as numbers, not as bits
    actual[1, 1] = 2.0**-149  # the smallest subnormal
    with pytest.raises(AssertionError) as failure:
        assert_bitwise_equal(actual, expected, "w13 scale")
    message = str(failure.value)
    assert message.startswith("w13 scale: 2 of 6 elements differ; first at index (1, 1)")
    assert "(0x00000001) != expected 0.0 (0x00000000)" in message


@pytest.mark.parametrize(
    ("actual", "message"),
    [
        (torch.zeros(3, 2), r"shape \(3, 2\) != expected \(2, 3\)"),
        (torch.zeros(2, 3, dtype=torch.bfloat16), "dtype torch.bfloat16 != expected torch.float32"),
    ],
    ids=["shape", "dtype"],
)
def test_bitwise_equal_checks_shape_and_dtype(actual: torch.Tensor, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_bitwise_equal(actual, torch.zeros(2, 3), "out")


def test_relative_error_is_the_frobenius_ratio() -> None:
    expected = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    actual = torch.tensor([[3.0, 0.5], [0.0, 4.0]], dtype=torch.bfloat16)  # off by 0.5
    assert relative_error(actual, expected) == 0.1
    assert relative_error(expected, expected) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) == math.inf


def test_relative_error_computes_in_float64() -> None:
    expected = torch.full((4,), 2.0**66, dtype=torch.float64)
    actual = expected + 2.0**20  # exact in float64; float32 (ulp 2^43 here) would lose it
    assert relative_error(actual, expected) == 2.0**-46


def test_relative_error_refuses_to_broadcast() -> None:
    with pytest.raises(ValueError, match=r"shape \(4,\), expected has shape \(1,\); pass two"):
        relative_error(torch.ones(4), torch.ones(1))
