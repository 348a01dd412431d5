"""Requantization cases shared by the Triton kernels' tests on the GPU and in the interpreter.

Model-like and random-bit inputs of every kernel source format, on any device; rows of
edge cases (ties, carries, saturation, subnormals, the amax floor), the E2M1 tie table and
non-finite inputs. ``core/tests/kernels/test_requant_triton.py`` runs them on a CUDA
device, ``core/kernel_tests/test_requant_interpreted.py`` in Triton's CPU interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_dense

W = WeightFormat
# Every conversion the kernels run: any other format but NVFP4 (a torch-path source) to
# MXFP8, MXFP4 or FP8_BLOCK.
KERNEL_SOURCES = (W.BF16, W.FP8_BLOCK, W.MXFP8, W.MXFP4)
PAIRS = [
    (src, dst)
    for dst in (W.MXFP8, W.MXFP4, W.FP8_BLOCK)
    for src in KERNEL_SOURCES
    if src is not dst
]
PAIR_IDS = [f"{s.value}->{d.value}" for s, d in PAIRS]


def model_like(
    src: W, shape: tuple[int, int, int], std: float, seed: int, device: str
) -> tuple[Any, ...]:
    """Weights as a checkpoint holds them: magnitudes differ per expert and per block."""
    experts = [
        synthetic_dense(shape[1:], std * (1.0 + 0.6 * e) * 4.0 ** (e % 3 - 1), seed + e)
        for e in range(shape[0])
    ]
    dense = torch.stack(experts).to(device)
    if src is W.BF16:
        return dense, None
    if src is W.FP8_BLOCK:
        return quant.quantize_fp8_block(dense)
    return quant.quantize_mx(dense, src)


def random_bits(src: W, shape: tuple[int, int, int], seed: int, device: str) -> tuple[Any, ...]:
    """Random encodings: every finite element value, scales over a wide range."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, n, k = shape
    if src is W.BF16:
        bits = torch.randint(0, 1 << 16, shape, generator=gen, device=device, dtype=torch.int32)
        bits = torch.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # finite only
        return bits.to(torch.int16).view(torch.bfloat16), None
    if src is W.MXFP4:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=device)
        scale = torch.randint(0, 251, (e, n, -(-k // 32)), generator=gen, device=device)
        return packed.to(torch.uint8), scale.to(torch.uint8)
    codes = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no E4M3 NaN
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    if src is W.MXFP8:
        scale = torch.randint(0, 246, (e, n, -(-k // 32)), generator=gen, device=device)
        return weight, scale.to(torch.uint8)
    blocks = (e, -(-n // 128), -(-k // 128))
    log2 = torch.rand(blocks, generator=gen, device=device) * 200.0 - 100.0
    return weight, torch.exp2(log2) * torch.where(log2 > 60.0, -1.0, 1.0)


def f32(bits: int) -> float:
    """The float32 of these bits."""
    return float(torch.tensor(bits, dtype=torch.int32).view(torch.float32))


def next_up(v: float) -> float:
    """The next float32 above ``v``."""
    return float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf)))


def next_down(v: float) -> float:
    """The next float32 below ``v``."""
    return float(torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)))


THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# One row per case, 32 float32 values (one MX group). A leading 6.0 or 448.0 pins the
# group's scale to 1 so the values themselves meet the thresholds and limits.
EDGE_ROWS: dict[str, list[float]] = {
    "zeros": [0.0] * 32,
    "negative_zeros": [-0.0] * 31 + [1.0],
    "fp4_ties": [6.0, *THRESHOLDS, *(-t for t in THRESHOLDS)] + [0.0] * 17,
    "fp4_above_ties": [6.0, *(next_up(t) for t in THRESHOLDS)] + [0.0] * 24,
    "fp4_below_ties": [6.0, *(-next_down(t) for t in THRESHOLDS)] + [0.0] * 24,
    "fp4_grid": [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    + [0.1, -0.1, 0.26, -0.24]
    + [0.0] * 14,
    "saturation_448": [448.0, -448.0, 447.0, 440.0, 432.0, 416.0, -464.0 / 2] + [1.0] * 25,
    "above_pow2_amax": [next_up(448.0), 1.0, -2.0] + [0.5] * 29,
    "e4m3_ties": [448.0, 1.0625, 1.1875, -1.3125, 2**-10, 3 * 2**-10, -5 * 2**-10, 2**-9]
    + [0.0] * 24,
    "e4m3_carry": [448.0, 15.75, 31.5, 63.0, 124.0, 120.0, 100.0, -124.0] + [0.0] * 24,
    "subnormal_inputs": [f32(1), -f32(0x12345), f32(0x7FFFFF), -f32(0x400000)] + [0.0] * 28,
    "subnormal_beside_one": [1.0, 1e-40, -1e-42, f32(3)] + [1e-39] * 28,
    "amax_floor": [1e-4, -3e-5] + [1e-6] * 30,
    "below_amax_floor": [9.9e-5, -5e-5] + [2e-5] * 30,
    "powers_of_two": [2.0 ** (i - 16) for i in range(32)],
    "huge": [3.0e38, -1.0e38, 1.0] + [2.0e37] * 29,
    "tiny_scale_results": [1e-38, 3e-39, -1e-45] + [0.0] * 29,
}


# E2M1 ties round to the even code: 0.75, 1.75, 3.5 up, 0.25, 1.25, 2.5, 5.0 down (by hand).
FP4_TIE_ROW = [6.0, *THRESHOLDS, *(-t for t in THRESHOLDS)] + [0.0] * 17
FP4_TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14]


# Non-finite inputs: (format, the tensor poisoned, where, the bad value or byte).
POISON = [
    (W.BF16, "weight", (2, 131, 7), math.inf),
    (W.BF16, "weight", (0, 0, 0), math.nan),
    (W.FP8_BLOCK, "weight", (1, 5, 170), 0x7F),
    (W.MXFP8, "weight", (2, 191, 0), 0xFF),
    (W.FP8_BLOCK, "scale", (2, 1, 0), math.nan),
    (W.FP8_BLOCK, "scale", (0, 0, 1), math.inf),
    (W.FP8_BLOCK, "scale", (1, 0, 0), 1e38),  # 448 x 1e38 overflows float32
    (W.MXFP8, "scale", (1, 64, 5), 255),
    (W.MXFP4, "scale", (0, 100, 3), 255),
]


def edge_case_rows(case: str) -> torch.Tensor:
    """``EDGE_ROWS[case]`` as four rows of one MX group (itself, negated, rolled, halved)."""
    row = torch.tensor(EDGE_ROWS[case], dtype=torch.float32)
    return torch.stack([row, -row, row.roll(5), row * 0.5]).reshape(1, 4, 32)


def fp4_tie_inputs(src: W) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``FP4_TIE_ROW`` at eight scales, held exactly by ``src``; the expected UE8M0 bytes.

    Returns ``(weight (8, 1, 32), scale or None, exponents (8,))`` for one-by-32 blocks.
    """
    rows = torch.tensor([FP4_TIE_ROW]) * torch.exp2(torch.arange(-12.0, 12.0, 3.0))[:, None]
    exps = torch.arange(-12, 12, 3, dtype=torch.int32) + 127
    if src is W.BF16:
        weight, scale = rows.to(torch.bfloat16), None
    elif src is W.MXFP8:  # 6 x 2^k over the UE8M0 scale 2^(k-6): every value is E4M3
        weight = (rows * torch.exp2(-(exps[:, None] - 127.0) + 6.0)).to(torch.float8_e4m3fn)
        scale = (exps - 6).to(torch.uint8)[:, None]
    else:  # one block per row, scale 2^(k-3)
        weight = (rows * torch.exp2(-(exps[:, None] - 127.0) + 3.0)).to(torch.float8_e4m3fn)
        scale = torch.exp2(exps.double() - 127.0 - 3.0).float()[:, None]
    return weight.reshape(8, 1, 32), None if scale is None else scale.reshape(8, 1, 1), exps


def every_e4m3_byte(exponent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every finite E4M3 byte, four times, (1, 8, 128); its UE8M0 scales and block scale."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # no NaN
    weight = codes[torch.arange(254 * 4) % 254].reshape(1, 8, 127)
    weight = torch.cat([weight, weight[..., :1]], dim=-1).view(torch.float8_e4m3fn)
    mx_scale = torch.full((1, 8, 4), exponent, dtype=torch.uint8)
    return weight, mx_scale, torch.full((1, 1, 1), 2.0 ** (exponent - 127))


def every_e2m1_byte(exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte of two E2M1 codes, (1, 16, 16) packed, and its UE8M0 scales."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 16, 16)
    return packed, torch.full((1, 16, 1), exponent, dtype=torch.uint8)


def every_bf16_value() -> torch.Tensor:
    """Every finite bfloat16 value but a few, shuffled, (3, 168, 128)."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    bits = bits[(bits & 0x7F80) != 0x7F80].to(torch.int16)  # finite only
    bits = bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(0))]
    return bits[: 63 * 1024].view(torch.bfloat16).reshape(3, 168, 128)


def poisoned(
    src: W, role: str, index: tuple[int, int, int], bad: float, device: str
) -> tuple[Any, ...]:
    """Model-like ``src`` weights with one ``POISON`` entry written into ``role``."""
    weight, scale = model_like(src, (3, 192, 256), 0.05, seed=9, device=device)
    if role == "scale":
        scale[index] = bad
    elif src is W.BF16:
        weight[index] = bad
    else:
        weight.view(torch.uint8)[index] = int(bad)
    return weight, scale


def assert_same_result(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    """Two ``(weight, scale)`` results are the same bytes."""
    for name, a, b in (("weight", got[0], want[0]), ("scale", got[1], want[1])):
        a_bytes, b_bytes = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, b))
        assert_bitwise_equal(a_bytes, b_bytes, f"{what}: {name}")


# A requantization under test: (weight, scale, src, dst, block) -> (weight, scale).
Requantize = Callable[[torch.Tensor, Any, W, W, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]


def assert_matches_torch(
    requantize: Requantize,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    src: W,
    dst: W,
    what: str,
    block: tuple[int, int] = (128, 128),
) -> None:
    """``requantize``'s result is the torch path's, byte for byte."""
    want = quant.requantize(weight, scale, src, dst, block, use_triton=False)
    assert_same_result(requantize(weight, scale, src, dst, block), want, what)
