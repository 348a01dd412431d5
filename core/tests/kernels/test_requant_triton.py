"""Triton requantization kernels vs. the torch path: bit for bit, on a CUDA device.

Every conversion the kernels run (any source to MXFP8, MXFP4 or FP8_BLOCK) is compared
with ``quant.requantize(..., use_triton=False)`` on the same device: on random data of
several magnitudes and shapes (magnitudes differ per expert and per 128x128 block), on
random bit patterns that cover every element encoding, and on edge-case tables. The
torch path is itself checked against independent oracles in ``test_quant.py``.

Triton's CPU interpreter cannot stand in on CPU CI: it converts float32 to float8e4nv
with wrong rounding (``../shared/gpu/README.md``) and cannot run the inline PTX of the
E2M1 encoder, so these tests need a GPU. E2M1 ties round to even in both encoders (PTX and
integer): ``test_fp4_ties_round_to_even`` checks them against a table written by hand.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.errors import NonFiniteError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_dense

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

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
# (experts, rows, cols): aligned, partial row tiles and blocks, K not a multiple of 128,
# K not a multiple of 32, one row.
SHAPES = [(4, 256, 512), (3, 200, 352), (2, 130, 96), (2, 64, 80), (1, 1, 64)]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from megamoe.core.kernels import requant_triton

    return requant_triton


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _model_like(src: W, shape: tuple[int, int, int], std: float, seed: int) -> tuple[Any, ...]:
    """Weights as a checkpoint holds them: magnitudes differ per expert and per block."""
    experts = [
        synthetic_dense(shape[1:], std * (1.0 + 0.6 * e) * 4.0 ** (e % 3 - 1), seed + e)
        for e in range(shape[0])
    ]
    dense = torch.stack(experts).cuda()
    if src is W.BF16:
        return dense, None
    if src is W.FP8_BLOCK:
        return quant.quantize_fp8_block(dense)
    return quant.quantize_mx(dense, src)


def _random_bits(src: W, shape: tuple[int, int, int], seed: int) -> tuple[Any, ...]:
    """Random encodings: every finite element value, scales over a wide range."""
    gen = _generator(seed)
    e, n, k = shape
    if src is W.BF16:
        bits = torch.randint(0, 1 << 16, shape, generator=gen, device="cuda", dtype=torch.int32)
        bits = torch.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # finite only
        return bits.to(torch.int16).view(torch.bfloat16), None
    if src is W.MXFP4:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device="cuda")
        scale = torch.randint(0, 251, (e, n, -(-k // 32)), generator=gen, device="cuda")
        return packed.to(torch.uint8), scale.to(torch.uint8)
    codes = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no E4M3 NaN
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    if src is W.MXFP8:
        scale = torch.randint(0, 246, (e, n, -(-k // 32)), generator=gen, device="cuda")
        return weight, scale.to(torch.uint8)
    blocks = (e, -(-n // 128), -(-k // 128))
    log2 = torch.rand(blocks, generator=gen, device="cuda") * 200.0 - 100.0
    return weight, torch.exp2(log2) * torch.where(log2 > 60.0, -1.0, 1.0)


def _assert_same(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    src: W,
    dst: W,
    what: str,
    block: tuple[int, int] = (128, 128),
) -> None:
    want_w, want_s = quant.requantize(weight, scale, src, dst, block, use_triton=False)
    got_w, got_s = quant.requantize(weight, scale, src, dst, block, use_triton=True)
    assert got_w.is_cuda and got_s.is_cuda
    assert_bitwise_equal(_bytes(got_w), _bytes(want_w), f"{what}: weight")
    assert_bitwise_equal(got_s, want_s, f"{what}: scale")


@pytest.mark.parametrize("std", [1e-6, 3e-2, 50.0, 2e4], ids=["tiny", "typical", "large", "huge"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_model_like_weights(src: W, dst: W, shape: tuple[int, int, int], std: float) -> None:
    weight, scale = _model_like(src, shape, std, seed=7)
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} {shape} std={std}")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_random_bit_patterns(src: W, dst: W, seed: int) -> None:
    weight, scale = _random_bits(src, (3, 384, 640), seed)
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} random bits")


@pytest.mark.parametrize(
    "block", [(64, 128), (128, 64), (32, 256), (1, 32)], ids=lambda b: f"{b[0]}x{b[1]}"
)
@pytest.mark.parametrize(
    "src, dst",
    [(W.FP8_BLOCK, W.MXFP8), (W.FP8_BLOCK, W.MXFP4), (W.BF16, W.FP8_BLOCK), (W.MXFP8, W.FP8_BLOCK)],
)
def test_other_block_sizes(src: W, dst: W, block: tuple[int, int]) -> None:
    dense, _ = _model_like(W.BF16, (2, 192, 320), 0.05, seed=3)
    if src is W.FP8_BLOCK:
        weight, scale = quant.quantize_fp8_block(dense, block)
    elif src is W.MXFP8:
        weight, scale = quant.quantize_mx(dense, src)
    else:
        weight, scale = dense, None
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} block {block}", block)


@pytest.mark.parametrize("block", [(96, 128), (128, 48)], ids=["rows96", "cols48"])
def test_layouts_outside_the_kernels_use_the_torch_path(
    kernels: ModuleType, block: tuple[int, int]
) -> None:
    dense, _ = _model_like(W.BF16, (2, 192, 192), 0.05, seed=4)
    src, dst = (W.BF16, W.FP8_BLOCK) if block[0] == 96 else (W.FP8_BLOCK, W.MXFP8)
    weight, scale = (dense, None) if src is W.BF16 else quant.quantize_fp8_block(dense, block)
    with pytest.raises(ValueError, match="do not cover"):
        kernels.requantize_triton_async(weight, scale, src, dst, block)
    _assert_same(weight, scale, src, dst, f"fallback {block}", block)


@pytest.mark.parametrize(
    "config",
    [
        dict(programs_per_sm=2, num_stages=1),
        dict(programs_per_sm=4, num_stages=3),
        dict(rows=64, groups=4, num_warps=8),
        dict(rows=8, groups=16, num_warps=2, programs_per_sm=1, num_stages=2),
        dict(e2m1_ptx=False),
        dict(rows=16),
        dict(num_warps=2),
    ],
    ids=["persistent", "pipelined", "tall", "wide-pipelined", "integer-e2m1", "rows16", "w2"],
)
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_launch_configs_give_the_same_bits(
    kernels: ModuleType, src: W, dst: W, config: dict[str, Any]
) -> None:
    weight, scale = _model_like(src, (3, 256, 384), 0.1, seed=5)
    want_w, want_s = quant.requantize(weight, scale, src, dst, use_triton=False)
    cfg = kernels.KernelConfig(**config)
    got_w, got_s, flag = kernels.requantize_triton_async(weight, scale, src, dst, config=cfg)
    assert int(flag.item()) == 0
    assert_bitwise_equal(_bytes(got_w), _bytes(want_w), f"{config} weight")
    assert_bitwise_equal(got_s, want_s, f"{config} scale")


@pytest.mark.parametrize("src, dst", [(W.FP8_BLOCK, W.MXFP4), (W.MXFP4, W.FP8_BLOCK)])
def test_out_writes_into_slices_of_kernel_tensors(kernels: ModuleType, src: W, dst: W) -> None:
    weight, scale = _model_like(src, (4, 256, 256), 0.1, seed=6)
    want_w, want_s = quant.requantize(weight, scale, src, dst, use_triton=False)
    big_w = torch.full((6, *want_w.shape[1:]), 0x55, dtype=torch.uint8, device="cuda")
    big_s = torch.full((6, *want_s.shape[1:]), 7.0, device="cuda").to(want_s.dtype)
    big_w = big_w.view(want_w.dtype)
    out = (big_w[1:5], big_s[1:5])
    got_w, got_s, flag = kernels.requantize_triton_async(weight, scale, src, dst, out=out)
    assert int(flag.item()) == 0 and got_w.data_ptr() == big_w[1].data_ptr()
    assert got_s.data_ptr() == big_s[1].data_ptr()
    assert_bitwise_equal(_bytes(big_w[1:5]), _bytes(want_w), "out weight")
    assert_bitwise_equal(big_s[1:5], want_s, "out scale")
    assert bool((_bytes(big_w[0]) == 0x55).all()) and bool((_bytes(big_w[5]) == 0x55).all())
    with pytest.raises(ValueError, match="out weight"):
        kernels.requantize_triton_async(weight, scale, src, dst, out=(big_w[1:4], big_s[1:4]))


# ------------------------------------------------------------------ edge-case tables
def _f32(bits: int) -> float:
    return float(torch.tensor(bits, dtype=torch.int32).view(torch.float32))


def _next_up(v: float) -> float:
    return float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf)))


def _next_down(v: float) -> float:
    return float(torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)))


THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# One row per case, 32 float32 values (one MX group). A leading 6.0 or 448.0 pins the
# group's scale to 1 so the values themselves meet the thresholds and limits.
EDGE_ROWS: dict[str, list[float]] = {
    "zeros": [0.0] * 32,
    "negative_zeros": [-0.0] * 31 + [1.0],
    "fp4_ties": [6.0, *THRESHOLDS, *(-t for t in THRESHOLDS)] + [0.0] * 17,
    "fp4_above_ties": [6.0, *(_next_up(t) for t in THRESHOLDS)] + [0.0] * 24,
    "fp4_below_ties": [6.0, *(-_next_down(t) for t in THRESHOLDS)] + [0.0] * 24,
    "fp4_grid": [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    + [0.1, -0.1, 0.26, -0.24]
    + [0.0] * 14,
    "saturation_448": [448.0, -448.0, 447.0, 440.0, 432.0, 416.0, -464.0 / 2] + [1.0] * 25,
    "above_pow2_amax": [_next_up(448.0), 1.0, -2.0] + [0.5] * 29,
    "e4m3_ties": [448.0, 1.0625, 1.1875, -1.3125, 2**-10, 3 * 2**-10, -5 * 2**-10, 2**-9]
    + [0.0] * 24,
    "e4m3_carry": [448.0, 15.75, 31.5, 63.0, 124.0, 120.0, 100.0, -124.0] + [0.0] * 24,
    "subnormal_inputs": [_f32(1), -_f32(0x12345), _f32(0x7FFFFF), -_f32(0x400000)] + [0.0] * 28,
    "subnormal_beside_one": [1.0, 1e-40, -1e-42, _f32(3)] + [1e-39] * 28,
    "amax_floor": [1e-4, -3e-5] + [1e-6] * 30,
    "below_amax_floor": [9.9e-5, -5e-5] + [2e-5] * 30,
    "powers_of_two": [2.0 ** (i - 16) for i in range(32)],
    "huge": [3.0e38, -1.0e38, 1.0] + [2.0e37] * 29,
    "tiny_scale_results": [1e-38, 3e-39, -1e-45] + [0.0] * 29,
}


@pytest.mark.parametrize("dst", [W.MXFP8, W.MXFP4, W.FP8_BLOCK], ids=lambda f: f.value)
@pytest.mark.parametrize("case", list(EDGE_ROWS), ids=list(EDGE_ROWS))
def test_edge_case_rows(case: str, dst: W) -> None:
    row = torch.tensor(EDGE_ROWS[case], dtype=torch.float32)
    x = torch.stack([row, -row, row.roll(5), row * 0.5]).reshape(1, 4, 32).cuda()
    _assert_same(x, None, W.BF16, dst, case, block=(1, 32))
    _assert_same(x.repeat(1, 32, 4), None, W.BF16, dst, f"{case} in 128x128 blocks")


# E2M1 ties round to the even code: 0.75, 1.75, 3.5 up, 0.25, 1.25, 2.5, 5.0 down (by hand).
FP4_TIE_ROW = [6.0, *THRESHOLDS, *(-t for t in THRESHOLDS)] + [0.0] * 17
FP4_TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14]


@pytest.mark.parametrize("e2m1_ptx", [True, False], ids=["ptx", "integer"])
@pytest.mark.parametrize("src", [W.BF16, W.MXFP8, W.FP8_BLOCK], ids=lambda f: f.value)
def test_fp4_ties_round_to_even(kernels: ModuleType, src: W, e2m1_ptx: bool) -> None:
    """Sources that hold the ties exactly, at several scales: Triton == torch == the table."""
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
    weight = weight.reshape(8, 1, 32).cuda()
    scale = None if scale is None else scale.reshape(8, 1, 1).cuda()
    block = (1, 32)
    want_w, want_s = quant.requantize(weight, scale, src, W.MXFP4, block, use_triton=False)
    cfg = kernels.KernelConfig(e2m1_ptx=e2m1_ptx)
    got_w, got_s, flag = kernels.requantize_triton_async(
        weight, scale, src, W.MXFP4, block, config=cfg
    )
    assert int(flag.item()) == 0
    assert_bitwise_equal(got_w, want_w, f"{src.value} ties: Triton vs torch")
    assert_bitwise_equal(got_s, want_s, f"{src.value} tie scales")
    codes = quant.unpack_e2m1(got_w.cpu())[:, 0, :15]
    assert codes.tolist() == [FP4_TIE_CODES] * 8
    assert got_s.cpu().flatten().tolist() == exps.tolist()


@pytest.mark.parametrize("exponent", [0, 1, 30, 117, 127, 140, 245])
def test_every_e4m3_byte(exponent: int) -> None:
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # no NaN
    weight = codes[torch.arange(254 * 4) % 254].reshape(1, 8, 127).cuda()
    weight = torch.cat([weight, weight[..., :1]], dim=-1).view(torch.float8_e4m3fn)
    scale = torch.full((1, 8, 4), exponent, dtype=torch.uint8, device="cuda")
    for dst in (W.MXFP4, W.FP8_BLOCK):
        _assert_same(weight, scale, W.MXFP8, dst, f"all E4M3 bytes, scale 2^{exponent - 127}")
    block_scale = torch.full((1, 1, 1), 2.0 ** (exponent - 127), device="cuda")
    for dst in (W.MXFP8, W.MXFP4):
        _assert_same(weight, block_scale, W.FP8_BLOCK, dst, f"all E4M3 bytes, block {exponent}")


@pytest.mark.parametrize("exponent", [0, 1, 2, 64, 127, 200, 250])
def test_every_e2m1_byte(exponent: int) -> None:
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 16, 16).cuda()
    scale = torch.full((1, 16, 1), exponent, dtype=torch.uint8, device="cuda")
    for dst in (W.MXFP8, W.FP8_BLOCK):
        _assert_same(packed, scale, W.MXFP4, dst, f"all E2M1 bytes, scale 2^{exponent - 127}")


def test_every_bf16_value() -> None:
    bits = torch.arange(1 << 16, dtype=torch.int32)
    bits = bits[(bits & 0x7F80) != 0x7F80].to(torch.int16)  # finite only
    bits = bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(0))]
    x = bits[: 63 * 1024].view(torch.bfloat16).reshape(3, 168, 128).cuda()
    for dst in (W.MXFP8, W.MXFP4, W.FP8_BLOCK):
        _assert_same(x, None, W.BF16, dst, f"every bf16 value -> {dst.value}")


# ------------------------------------------------------------------ non-finite input
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


@pytest.mark.parametrize(
    "src, role, index, bad", POISON, ids=[f"{p[0].value}-{p[1]}-{p[3]}" for p in POISON]
)
def test_non_finite_input_is_detected_and_located(
    kernels: ModuleType, src: W, role: str, index: tuple[int, int, int], bad: float
) -> None:
    weight, scale = _model_like(src, (3, 192, 256), 0.05, seed=9)
    if role == "scale":
        scale[index] = bad
    elif src is W.BF16:
        weight[index] = bad
    else:
        weight.view(torch.uint8)[index] = int(bad)
    dsts = [d for s, d in PAIRS if s is src]
    for dst in dsts:
        _, _, flag = kernels.requantize_triton_async(weight, scale, src, dst)
        assert int(flag.item()) == 1, f"{src.value}->{dst.value}: flag not set"
        with pytest.raises(NonFiniteError) as torch_error:
            quant.requantize(weight, scale, src, dst, name="layers.3.w13", use_triton=False)
        with pytest.raises(NonFiniteError) as triton_error:
            kernels.requantize_triton(weight, scale, src, dst, name="layers.3.w13")
        assert str(triton_error.value) == str(torch_error.value)
        with pytest.raises(NonFiniteError):
            quant.requantize(weight, scale, src, dst, use_triton=True)


def test_clean_input_leaves_the_flag_clear(kernels: ModuleType) -> None:
    for src, dst in PAIRS:
        weight, scale = _random_bits(src, (2, 128, 256), seed=11)
        _, _, flag = kernels.requantize_triton_async(weight, scale, src, dst)
        assert int(flag.item()) == 0, f"{src.value}->{dst.value}"


def test_empty_and_non_contiguous_inputs(kernels: ModuleType) -> None:
    dense, _ = _model_like(W.BF16, (2, 128, 256), 0.05, seed=12)
    got_w, got_s = kernels.requantize_triton(dense[:0], None, W.BF16, W.MXFP8)
    assert got_w.shape == (0, 128, 256) and got_s.shape == (0, 128, 8)
    strided = dense.transpose(1, 2)
    _assert_same(strided, None, W.BF16, W.MXFP4, "transposed bf16")


def test_bad_calls_are_rejected(kernels: ModuleType) -> None:
    dense, _ = _model_like(W.BF16, (1, 128, 128), 0.05, seed=13)
    with pytest.raises(ValueError, match="different formats"):
        kernels.requantize_triton_async(dense, None, W.BF16, W.BF16)
    with pytest.raises(ValueError, match="need a scale"):
        kernels.requantize_triton_async(dense.to(torch.float8_e4m3fn), None, W.MXFP8, W.MXFP4)
    with pytest.raises(ValueError, match=r"\(\.\.\., N, K\)"):
        kernels.requantize_triton_async(dense[0, 0], None, W.BF16, W.MXFP8)
