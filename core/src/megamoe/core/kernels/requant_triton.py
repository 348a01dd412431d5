"""Triton requantization: one fused dequantize-requantize pass, bit-identical to torch.

``quant.requantize`` calls :func:`requantize_triton` for CUDA tensors when this module
imports (it needs Triton). Every conversion from BF16, FP8_BLOCK, MXFP8 or MXFP4 whose
target is MXFP8, MXFP4 or FP8_BLOCK runs as one kernel launch over all leading (expert)
dimensions: ``requant_mx.requant_to_mx_kernel`` for MX targets,
``requant_block.requant_to_block_kernel`` for block-FP8. The kernels compute the same
float32 operations as the torch path (see ``requant_codecs``), so the bits are the
same; ``tests/test_requant_triton.py`` checks that on a GPU.

Non-finite input is detected in the same pass (an int32 flag the kernels set); only then
does the torch path run, to find and name the first bad element. What the kernels do not
cover (NVFP4 sources, block sizes whose rows are not a power of two or whose columns are
not a multiple of 32, matrices of 2^31 elements or more) goes through the torch path too.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache

import torch
from torch import Tensor
from triton import knobs

from megamoe.core.errors import NonFiniteError
from megamoe.core.kernels.launch import cdiv, next_power_of_2
from megamoe.core.kernels.requant_block import requant_to_block_kernel
from megamoe.core.kernels.requant_codecs import (
    SRC_FLOAT,
    SRC_FP8_BLOCK,
    SRC_MXFP4,
    SRC_MXFP8,
)
from megamoe.core.kernels.requant_mx import requant_to_mx_kernel
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

__all__ = ["KernelConfig", "default_config", "requantize_triton", "requantize_triton_async"]

_SRC_CODE = {
    WeightFormat.BF16: int(SRC_FLOAT),
    WeightFormat.FP8_BLOCK: int(SRC_FP8_BLOCK),
    WeightFormat.MXFP8: int(SRC_MXFP8),
    WeightFormat.MXFP4: int(SRC_MXFP4),
}
_INT32_LIMIT = 2**31  # kernels index one matrix with int32 offsets
_MAX_BLOCK_ELEMENTS = 128 * 256  # a block-FP8 target block is held in registers


def _f32_reciprocal(value: float) -> float:
    """float32(1 / value) as a Python float: what torch multiplies by for ``x / value``."""
    return float(torch.tensor(1.0 / value, dtype=torch.float32))


_RECIP = {
    WeightFormat.MXFP8: _f32_reciprocal(quant.E4M3_MAX),
    WeightFormat.MXFP4: _f32_reciprocal(quant.E2M1_MAX),
    WeightFormat.FP8_BLOCK: _f32_reciprocal(quant.E4M3_MAX),
}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one conversion kernel.

    Attributes:
        rows: rows per tile (MX targets; a block-FP8 target's tile is one block).
        groups: 32-column groups per tile (MX targets).
        num_warps: warps per program.
        num_stages: software-pipelining depth of a program's tile loop (1 = none).
        programs_per_sm: 0 launches one program per tile; n > 0 launches n programs per
            multiprocessor that loop over the tiles (persistent grid).
        e2m1_ptx: encode MXFP4 with inline PTX; False uses portable integer operations
            (slower; the only choice under the Triton interpreter, and its default there).
    """

    rows: int = 32
    groups: int = 8
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: int = 0
    e2m1_ptx: bool = not knobs.runtime.interpret


# Chosen by ``benchmarks/bench_requant.py --sweep`` on the H200 (64x3072x4096 experts): two
# MX pairs gain from shorter tiles or fewer warps. The block-FP8 target would run faster
# with 4 warps (bf16 78% -> 88% of copy bandwidth) but then gives wrong bits for
# mxfp8 -> fp8_block on a 1x64 matrix (seen on the H200, not yet explained), so it keeps 8.
# Every default is verified bit for bit by the GPU tests, which run the defaults on every pair.
_DEFAULT_MX = KernelConfig(rows=32, groups=8, num_warps=4)
_DEFAULT_BLOCK = KernelConfig(rows=128, groups=4, num_warps=8)
_TUNED = {
    (WeightFormat.FP8_BLOCK, WeightFormat.MXFP8): KernelConfig(rows=16),
    (WeightFormat.FP8_BLOCK, WeightFormat.MXFP4): KernelConfig(num_warps=2),
    (WeightFormat.MXFP8, WeightFormat.MXFP4): KernelConfig(num_warps=2),
}


def default_config(src: WeightFormat | str, dst: WeightFormat | str) -> KernelConfig:
    """The launch configuration :func:`requantize_triton` uses for ``src -> dst``."""
    src, dst = WeightFormat.parse(src), WeightFormat.parse(dst)
    if (src, dst) in _TUNED:
        return _TUNED[(src, dst)]
    return _DEFAULT_BLOCK if dst is WeightFormat.FP8_BLOCK else _DEFAULT_MX


@cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _kernel_covers(
    src: WeightFormat, dst: WeightFormat, n: int, k: int, block: tuple[int, int]
) -> bool:
    """Whether the kernels handle this conversion and layout (else the torch path runs)."""
    if src not in _SRC_CODE or n * k >= _INT32_LIMIT:
        return False
    if dst is WeightFormat.FP8_BLOCK:
        bm, bk = block
        return _pow2(bm) and bk % 32 == 0 and _pow2(bk // 32) and bm * bk <= _MAX_BLOCK_ELEMENTS
    if src is WeightFormat.FP8_BLOCK:
        return block[1] % 32 == 0
    return True


def _out_shapes(
    lead: tuple[int, ...], n: int, k: int, dst: WeightFormat, block: tuple[int, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the converted weight and scale."""
    weight = (*lead, n, k // dst.values_per_byte)
    if dst is WeightFormat.FP8_BLOCK:
        return weight, (*lead, -(-n // block[0]), -(-k // block[1]))
    return weight, (*lead, n, -(-k // quant.MX_GROUP))


def _check_inputs(
    weight: Tensor, scale: Tensor | None, src: WeightFormat, dst: WeightFormat
) -> None:
    """Reject what only ``quant.requantize``'s validation would otherwise catch."""
    if dst not in quant.TARGET_FORMATS or dst is src:
        raise ValueError(
            f"requantize_triton converts between different formats into mxfp8, mxfp4 or "
            f"fp8_block; got {src.value} -> {dst.value}: call quant.requantize instead"
        )
    if weight.dim() < 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (..., N, K)")
    if (scale is None) != (src is WeightFormat.BF16):
        raise ValueError(
            f"{src.value} weights {'need a' if scale is None else 'take no'} scale; got "
            f"{'None' if scale is None else tuple(scale.shape)}: pass the stored scale"
        )


def _check_out(
    tensor: Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    device: torch.device,
    what: str,
) -> None:
    """Reject an ``out`` tensor the kernel cannot write the result into."""
    ok = tuple(tensor.shape) == shape and tensor.dtype == dtype and tensor.device == device
    if not (ok and tensor.is_contiguous()):
        raise ValueError(
            f"out {what} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
            f"(contiguous={tensor.is_contiguous()}); expected a contiguous {shape} {dtype} "
            f"tensor on {device}"
        )


def requantize_triton_async(
    weight: Tensor,
    scale: Tensor | None,
    src: WeightFormat | str,
    dst: WeightFormat | str,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
    config: KernelConfig | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the conversion without waiting for it or checking for non-finite input.

    Args:
        weight: stored weight (..., N, K) (K/2 bytes for MXFP4) in ``src``.
        scale: float32 block scales (FP8_BLOCK), UE8M0 bytes (MX) or None (BF16), in the
            shapes ``quant.requantize`` validates.
        src: stored format.
        dst: MXFP8, MXFP4 or FP8_BLOCK (not ``src``).
        block_size: FP8_BLOCK block (rows, columns) of the source or the target.
        config: launch shape; None uses :func:`default_config`.
        out: contiguous ``(weight, scale)`` tensors of the result's shapes and dtypes to
            write into (e.g. slices of preallocated kernel tensors); None allocates them.

    Returns:
        ``(weight, scale, nonfinite)``: the converted tensors (valid once the launch
        completes) and an int32 tensor of one element that the kernel sets to 1 when the
        input holds NaN or inf (then the outputs are meaningless).

    Raises:
        ValueError: a pair of formats or a layout the kernels do not handle, or ``out``
            tensors that do not fit.
    """
    src, dst = WeightFormat.parse(src), WeightFormat.parse(dst)
    _check_inputs(weight, scale, src, dst)
    *lead, n, k = (*weight.shape[:-1], weight.shape[-1] * src.values_per_byte)
    block = (int(block_size[0]), int(block_size[1]))
    if not _kernel_covers(src, dst, n, k, block):
        raise ValueError(
            f"the Triton kernels do not cover {src.value} -> {dst.value} with N={n}, K={k}, "
            f"block_size={block}: use quant.requantize, which runs the torch path for it"
        )
    cfg = config if config is not None else default_config(src, dst)
    device = weight.device
    w_shape, s_shape = _out_shapes(tuple(lead), n, k, dst, block)
    if out is None:
        out_w = torch.empty(w_shape, dtype=dst.element_dtype, device=device)
        out_s = torch.empty(s_shape, dtype=dst.scale_dtype, device=device)
    else:
        out_w, out_s = out
        _check_out(out_w, w_shape, dst.element_dtype, device, "weight")
        _check_out(out_s, s_shape, dst.scale_dtype, device, "scale")
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    matrices = math.prod(lead)
    if out_w.numel() == 0:
        return out_w, out_s, flag
    w = weight.contiguous()
    if scale is None:
        s = w  # never read for float sources
    else:
        s = scale.contiguous().view(torch.uint8) if src.is_mx else scale.contiguous().float()
    if dst is WeightFormat.FP8_BLOCK:
        tiles_n, tiles_k = -(-n // block[0]), -(-k // block[1])
        grid_tiles = matrices * tiles_n * tiles_k
        kernel_args = dict(
            s_stride=-(-k // quant.MX_GROUP),
            tiles_n=tiles_n,
            tiles_k=tiles_k,
            num_tiles=grid_tiles,
            SRC=_SRC_CODE[src],
            BLK_M=block[0],
            BLK_K=block[1],
            EVEN_N=n % block[0] == 0,
            EVEN_K=k % block[1] == 0,
        )
        kernel = requant_to_block_kernel
    else:
        rows = math.gcd(cfg.rows, block[0]) if src is WeightFormat.FP8_BLOCK else cfg.rows
        groups = min(cfg.groups, next_power_of_2(cdiv(k, quant.MX_GROUP)))
        tiles_n, tiles_k = -(-n // rows), -(-k // (32 * groups))
        grid_tiles = matrices * tiles_n * tiles_k
        s_stride = -(-k // block[1]) if src is WeightFormat.FP8_BLOCK else -(-k // quant.MX_GROUP)
        s_rows = -(-n // block[0]) if src is WeightFormat.FP8_BLOCK else n
        kernel_args = dict(
            s_stride=s_stride,
            s_matrix_stride=s_rows * s_stride,
            tiles_n=tiles_n,
            tiles_k=tiles_k,
            num_tiles=grid_tiles,
            SRC=_SRC_CODE[src],
            DST_FP4=dst is WeightFormat.MXFP4,
            R=rows,
            G=groups,
            BLK_M=block[0],
            BLK_K=block[1],
            EVEN_N=n % rows == 0,
            EVEN_K=k % (32 * groups) == 0,
            E2M1_PTX=cfg.e2m1_ptx,
        )
        kernel = requant_to_mx_kernel
    persistent = cfg.programs_per_sm > 0
    programs = grid_tiles
    if persistent:
        programs = min(grid_tiles, cfg.programs_per_sm * _multiprocessors(device))
    kernel[(programs,)](
        w,
        s,
        out_w,
        out_s,
        flag,
        n,
        k,
        num_programs=programs,
        amax_floor=quant.AMAX_FLOOR,
        recip_max=_RECIP[dst],
        PERSISTENT=persistent,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        **kernel_args,
    )
    return out_w, out_s, flag


def requantize_triton(
    weight: Tensor,
    scale: Tensor | None,
    src: WeightFormat | str,
    dst: WeightFormat | str,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
    *,
    name: str = "weight",
    flags: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Convert ``weight`` from ``src`` to ``dst`` on the GPU, bit-identical to the torch path.

    One kernel launch over all leading dimensions; then one synchronizing read of the
    non-finite flag, unless ``flags`` collects it. Layouts the kernels do not cover run
    through the torch path.

    Args:
        weight: stored weight (..., N, K) (K/2 bytes for MXFP4) in ``src``.
        scale: float32 block scales (FP8_BLOCK), UE8M0 bytes (MX) or None (BF16).
        src: stored format.
        dst: MXFP8, MXFP4 or FP8_BLOCK (not ``src``).
        block_size: FP8_BLOCK block (rows, columns) of the source or the target.
        name: tensor name used in error messages.
        flags: when given, the kernel's one-element int32 non-finite flag is appended here
            and not read (no host sync); the caller checks it (nonzero: the input held NaN
            or inf and the result is meaningless).

    Returns:
        ``(weight, scale)`` in ``dst``, shaped as ``quant.requantize`` returns them.

    Raises:
        NonFiniteError: the input holds NaN or inf (or weight x scale overflows); the
            message names the tensor, its role and the first bad index.
        ValueError: formats or shapes that do not fit.
    """
    src, dst = WeightFormat.parse(src), WeightFormat.parse(dst)
    _check_inputs(weight, scale, src, dst)
    n, k = weight.shape[-2], weight.shape[-1] * src.values_per_byte
    block = (int(block_size[0]), int(block_size[1]))
    if not _kernel_covers(src, dst, n, k, block):
        return quant.requantize(weight, scale, src, dst, block, name=name, use_triton=False)
    out_w, out_s, flag = requantize_triton_async(weight, scale, src, dst, block)
    if flags is not None:
        flags.append(flag)
        return out_w, out_s
    if int(flag.item()) != 0:
        # The torch path finds and names the first bad element (it raises NonFiniteError).
        quant.requantize(weight, scale, src, dst, block, name=name, use_triton=False)
        raise NonFiniteError(
            f"{name}: the {src.value} input holds a non-finite value (NaN or inf) that the "
            "torch path did not locate; fix the checkpoint tensor"
        )
    return out_w, out_s
