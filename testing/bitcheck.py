"""Tensor comparison for tests and benchmarks.

Bit for bit where the numerics are defined exactly (:func:`assert_bitwise_equal`), else the
relative Frobenius error against a reference (:func:`relative_error`).
"""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _describe(bits: torch.Tensor, values: torch.Tensor, index: tuple[int, ...]) -> str:
    """One element as its value and its bit pattern in hex."""
    element = values[index]
    shown = element.float().item() if element.is_floating_point() else element.item()
    width = 2 * values.element_size()
    raw = int(bits[index].item()) & ((1 << (4 * width)) - 1)
    return f"{shown!r} (0x{raw:0{width}x})"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Fail unless two tensors have the same shape, dtype and bits (NaNs included).

    Compares through an integer view of each element's bytes, so it works for float8,
    bfloat16, float32, integer and bool tensors alike, and on any device.

    Args:
        actual: the tensor under test.
        expected: the reference tensor.
        what: what is compared, first in the failure message.

    Raises:
        AssertionError: shape, dtype or bits differ; the message gives how many elements
            differ, the first differing index and both values with their bits.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a = actual.detach().cpu().contiguous()
    e = expected.detach().cpu().contiguous()
    int_dtype = _INT_OF_SIZE.get(a.element_size())
    if int_dtype is None or a.is_complex():
        raise TypeError(f"{what}: cannot compare bits of dtype {a.dtype}")
    if a.dtype == torch.bool:
        a, e = a.to(torch.uint8), e.to(torch.uint8)
    a_bits, e_bits = a.view(int_dtype), e.view(int_dtype)
    differ = a_bits != e_bits
    if not bool(differ.any()):
        return
    flat = int(differ.flatten().nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    raise AssertionError(
        f"{what}: {int(differ.sum())} of {a.numel()} elements differ; first at index "
        f"{index}: actual {_describe(a_bits, a, index)} != expected "
        f"{_describe(e_bits, e, index)}"
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ``||actual - expected|| / ||expected||``, in float64.

    Both tensors are copied to the CPU as float64 first, so they may live on different
    devices and have any floating dtype.

    Args:
        actual: the tensor under test.
        expected: the reference tensor.

    Returns:
        The error; ``inf`` (or ``nan`` when both are zero) for an all-zero ``expected``.

    Raises:
        ValueError: the shapes differ (no broadcasting: compare tensors of one shape).
    """
    if actual.shape != expected.shape:
        raise ValueError(
            f"relative_error: actual has shape {tuple(actual.shape)}, expected has shape "
            f"{tuple(expected.shape)}; pass two tensors of the same shape"
        )
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    return float((a - e).norm() / e.norm())
