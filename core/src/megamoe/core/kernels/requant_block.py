"""Triton kernel: bf16 / MX sources to block-FP8 (float32 scale per block), one pass.

A tile is one (BLK_M, BLK_K) block of one matrix, held in registers: the program loads
and dequantizes it, reduces its amax, computes ``scale = max(amax, 1e-4) * float32(1/448)``
and the correctly rounded ``1 / scale`` (``div_rn``, as torch's reciprocal), and stores
``E4M3(x * (1 / scale))`` (round to nearest even) and the float32 scale, exactly as
``quant._cast_fp8_block``. A block that holds NaN or inf sets ``flag_ptr[0]`` to 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.core.kernels.requant_codecs import INF_BITS, SRC_MXFP4, abs_bits, load_tile_f32


@triton.jit
def _block_tile(
    tile: tl.tensor,
    w_ptr: tl.tensor,
    s_ptr: tl.tensor,
    out_w_ptr: tl.tensor,
    out_s_ptr: tl.tensor,
    flag_ptr: tl.tensor,
    n_rows: tl.tensor,
    n_cols: tl.tensor,
    s_stride: tl.tensor,
    tiles_n: tl.tensor,
    tiles_k: tl.tensor,
    amax_floor: tl.constexpr,
    recip_max: tl.constexpr,
    SRC: tl.constexpr,
    BLK_M: tl.constexpr,
    BLK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
) -> None:
    """Requantize one block; a block holding NaN or inf sets ``flag_ptr[0]`` to 1."""
    G: tl.constexpr = BLK_K // 32
    matrix = tile // (tiles_n * tiles_k)
    within = tile - matrix * (tiles_n * tiles_k)
    block_col = within % tiles_k
    row0 = (within // tiles_k) * BLK_M
    matrix64 = matrix.to(tl.int64)
    row_bytes_in = n_cols // 2 if SRC == SRC_MXFP4 else n_cols
    x = load_tile_f32(
        w_ptr + matrix64 * n_rows * row_bytes_in,
        s_ptr + matrix64 * n_rows * s_stride,
        row0,
        block_col * G,
        n_rows,
        n_cols,
        s_stride,
        SRC,
        BLK_M,
        G,
        BLK_M,
        BLK_K,
        EVEN_N,
        EVEN_K,
    )
    amax_bits = tl.max(tl.max(tl.max(abs_bits(x), axis=2), axis=1), axis=0)
    tl.store(flag_ptr, 1, mask=amax_bits >= INF_BITS)
    scale = tl.maximum(amax_bits.to(tl.float32, bitcast=True), amax_floor) * recip_max
    y = x * tl.math.div_rn(1.0, scale)

    tl.store(out_s_ptr + matrix64 * (tiles_n * tiles_k) + within, scale)
    rows = row0 + tl.arange(0, BLK_M)
    cols = block_col * BLK_K + tl.arange(0, G)[None, :, None] * 32 + tl.arange(0, 32)
    out_ptrs = out_w_ptr + matrix64 * n_rows * n_cols + (rows[:, None, None] * n_cols + cols)
    values = y.to(tl.float8e4nv)
    if EVEN_N and EVEN_K:
        tl.store(out_ptrs, values)
    else:
        tl.store(out_ptrs, values, mask=(rows[:, None, None] < n_rows) & (cols < n_cols))


@triton.jit
def requant_to_block_kernel(
    w_ptr: tl.tensor,
    s_ptr: tl.tensor,
    out_w_ptr: tl.tensor,
    out_s_ptr: tl.tensor,
    flag_ptr: tl.tensor,
    n_rows: tl.tensor,
    n_cols: tl.tensor,
    s_stride: tl.tensor,
    tiles_n: tl.tensor,
    tiles_k: tl.tensor,
    num_tiles: tl.tensor,
    num_programs: tl.tensor,
    amax_floor: tl.constexpr,
    recip_max: tl.constexpr,
    SRC: tl.constexpr,
    BLK_M: tl.constexpr,
    BLK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
) -> None:
    """Requantize (M, N, K) weights to block-FP8.

    Args:
        w_ptr: source elements (M, N, K) (K/2 bytes for MXFP4), contiguous.
        s_ptr: source UE8M0 scales (M, N, s_stride); unused for float sources.
        out_w_ptr: E4M3 (M, N, K) output.
        out_s_ptr: float32 (M, tiles_n, tiles_k) output.
        flag_ptr: one int32, set to 1 when the input holds a non-finite value.
        n_rows: N.
        n_cols: K (logical columns).
        s_stride: source scales per row.
        tiles_n: blocks per matrix along N (ceil(N / BLK_M)).
        tiles_k: blocks per matrix along K (ceil(K / BLK_K)).
        num_tiles: M * tiles_n * tiles_k.
        num_programs: programs in the grid (the tile stride of a persistent program).
        amax_floor: lower clamp of a block's amax (``quant.AMAX_FLOOR``).
        recip_max: float32 ``1 / 448``.
        SRC: source encoding (``requant_codecs.SRC_*``, not block-FP8).
        BLK_M: block rows.
        BLK_K: block columns (a multiple of 32).
        EVEN_N: BLK_M divides N.
        EVEN_K: BLK_K divides K.
        PERSISTENT: each program loops over tiles ``pid, pid + num_programs, ...``;
            otherwise the grid has one program per block.
        NUM_STAGES: software-pipelining depth of the persistent loop.
    """
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs, num_stages=NUM_STAGES):
            _block_tile(
                tile, w_ptr, s_ptr, out_w_ptr, out_s_ptr, flag_ptr, n_rows, n_cols, s_stride,
                tiles_n, tiles_k, amax_floor, recip_max, SRC, BLK_M, BLK_K, EVEN_N, EVEN_K,
            )  # fmt: skip
    else:
        _block_tile(
            tl.program_id(0), w_ptr, s_ptr, out_w_ptr, out_s_ptr, flag_ptr, n_rows, n_cols,
            s_stride, tiles_n, tiles_k, amax_floor, recip_max, SRC, BLK_M, BLK_K, EVEN_N, EVEN_K,
        )  # fmt: skip
