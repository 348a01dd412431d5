"""Triton kernel: any source format to MXFP8 or MXFP4 (UE8M0 scale per 1x32), one pass.

A tile is (R rows, G groups of 32 columns) of one matrix of the (M, N, K) weight. For
each tile the kernel loads and dequantizes it (``requant_codecs.load_tile_f32``), takes
each group's amax, derives the UE8M0 scale exactly as ``quant._cast_mxfp8`` /
``quant._cast_mxfp4`` do, and stores E4M3 values or packed E2M1 pairs plus the scale
bytes. A tile that holds NaN or inf sets ``flag_ptr[0]`` to 1; the host checks it after
the launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.core.kernels.requant_codecs import (
    INF_BITS,
    SRC_MXFP4,
    abs_bits,
    ceil_ue8m0_exponent,
    f32_pair_to_e2m1_byte,
    f32_to_e2m1,
    load_tile_f32,
    ue8m0_reciprocal,
)


@triton.jit
def _mx_tile(
    tile: tl.tensor,
    w_ptr: tl.tensor,
    s_ptr: tl.tensor,
    out_w_ptr: tl.tensor,
    out_s_ptr: tl.tensor,
    flag_ptr: tl.tensor,
    n_rows: tl.tensor,
    n_cols: tl.tensor,
    s_stride: tl.tensor,
    s_matrix_stride: tl.tensor,
    tiles_n: tl.tensor,
    tiles_k: tl.tensor,
    amax_floor: tl.constexpr,
    recip_max: tl.constexpr,
    SRC: tl.constexpr,
    DST_FP4: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BLK_M: tl.constexpr,
    BLK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    E2M1_PTX: tl.constexpr,
) -> None:
    """Requantize one tile; a group holding NaN or inf sets ``flag_ptr[0]`` to 1."""
    matrix = tile // (tiles_n * tiles_k)
    within = tile - matrix * (tiles_n * tiles_k)
    row0 = (within // tiles_k) * R
    group0 = (within % tiles_k) * G
    matrix64 = matrix.to(tl.int64)
    row_bytes_in = n_cols // 2 if SRC == SRC_MXFP4 else n_cols
    x = load_tile_f32(
        w_ptr + matrix64 * n_rows * row_bytes_in,
        s_ptr + matrix64 * s_matrix_stride,
        row0,
        group0,
        n_rows,
        n_cols,
        s_stride,
        SRC,
        R,
        G,
        BLK_M,
        BLK_K,
        EVEN_N,
        EVEN_K,
    )
    amax_bits = tl.max(abs_bits(x), axis=2)
    # A masked store per group: no cross-warp reduction (and no barrier) on clean tiles.
    tl.store(flag_ptr + tl.zeros_like(amax_bits), 1, mask=amax_bits >= INF_BITS)
    amax = tl.maximum(amax_bits.to(tl.float32, bitcast=True), amax_floor)
    exponent = ceil_ue8m0_exponent(amax * recip_max)
    y = x * ue8m0_reciprocal(exponent)[:, :, None]

    rows = row0 + tl.arange(0, R)
    groups = group0 + tl.arange(0, G)
    groups_out = tl.cdiv(n_cols, 32)
    out_s_ptrs = out_s_ptr + matrix64 * n_rows * groups_out + rows[:, None] * groups_out
    if EVEN_N and EVEN_K:
        tl.store(out_s_ptrs + groups[None, :], exponent.to(tl.uint8))
    else:
        s_mask = (rows[:, None] < n_rows) & (groups[None, :] < groups_out)
        tl.store(out_s_ptrs + groups[None, :], exponent.to(tl.uint8), mask=s_mask)

    if DST_FP4:
        y_even, y_odd = tl.split(tl.reshape(y, (R, G, 16, 2)))
        if E2M1_PTX:
            packed = f32_pair_to_e2m1_byte(y_even, y_odd).to(tl.uint8)
        else:
            packed = (f32_to_e2m1(y_even) | (f32_to_e2m1(y_odd) << 4)).to(tl.uint8)
        byte_cols = groups[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        out_ptrs = out_w_ptr + matrix64 * n_rows * (n_cols // 2)
        out_ptrs += rows[:, None, None] * (n_cols // 2) + byte_cols
        if EVEN_N and EVEN_K:
            tl.store(out_ptrs, packed)
        else:
            mask = (rows[:, None, None] < n_rows) & (byte_cols < n_cols // 2)
            tl.store(out_ptrs, packed, mask=mask)
    else:
        cols = groups[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        out_ptrs = out_w_ptr + matrix64 * n_rows * n_cols + (rows[:, None, None] * n_cols + cols)
        values = y.to(tl.float8e4nv)
        if EVEN_N and EVEN_K:
            tl.store(out_ptrs, values)
        else:
            mask = (rows[:, None, None] < n_rows) & (cols < n_cols)
            tl.store(out_ptrs, values, mask=mask)


@triton.jit
def requant_to_mx_kernel(
    w_ptr: tl.tensor,
    s_ptr: tl.tensor,
    out_w_ptr: tl.tensor,
    out_s_ptr: tl.tensor,
    flag_ptr: tl.tensor,
    n_rows: tl.tensor,
    n_cols: tl.tensor,
    s_stride: tl.tensor,
    s_matrix_stride: tl.tensor,
    tiles_n: tl.tensor,
    tiles_k: tl.tensor,
    num_tiles: tl.tensor,
    num_programs: tl.tensor,
    amax_floor: tl.constexpr,
    recip_max: tl.constexpr,
    SRC: tl.constexpr,
    DST_FP4: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BLK_M: tl.constexpr,
    BLK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    E2M1_PTX: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
) -> None:
    """Requantize (M, N, K) weights to MXFP8 or MXFP4.

    Args:
        w_ptr: source elements (M, N, K) (K/2 bytes for MXFP4), contiguous.
        s_ptr: source scales (M, ..., s_stride), contiguous; unused for float sources.
        out_w_ptr: E4M3 (M, N, K) or packed E2M1 (M, N, K/2) output.
        out_s_ptr: UE8M0 bytes (M, N, ceil(K/32)) output.
        flag_ptr: one int32, set to 1 when the input holds a non-finite value.
        n_rows: N.
        n_cols: K (logical columns).
        s_stride: source scales per scale row.
        s_matrix_stride: source scales per matrix.
        tiles_n: row tiles per matrix.
        tiles_k: column tiles per matrix.
        num_tiles: M * tiles_n * tiles_k.
        num_programs: programs in the grid (the tile stride of a persistent program).
        amax_floor: lower clamp of a group's amax (``quant.AMAX_FLOOR``).
        recip_max: float32 ``1 / 448`` (MXFP8) or ``1 / 6`` (MXFP4).
        SRC: source encoding (``requant_codecs.SRC_*``).
        DST_FP4: write MXFP4 (else MXFP8).
        R: rows per tile (divides BLK_M for block-FP8 sources).
        G: 32-column groups per tile.
        BLK_M: block-FP8 source block rows.
        BLK_K: block-FP8 source block columns.
        EVEN_N: R divides N.
        EVEN_K: G * 32 divides K.
        E2M1_PTX: encode E2M1 with inline PTX (else portable integer operations).
        PERSISTENT: each program loops over tiles ``pid, pid + num_programs, ...``;
            otherwise the grid has one program per tile.
        NUM_STAGES: software-pipelining depth of the persistent loop.
    """
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs, num_stages=NUM_STAGES):
            _mx_tile(
                tile, w_ptr, s_ptr, out_w_ptr, out_s_ptr, flag_ptr, n_rows, n_cols, s_stride,
                s_matrix_stride, tiles_n, tiles_k, amax_floor, recip_max, SRC, DST_FP4, R, G,
                BLK_M, BLK_K, EVEN_N, EVEN_K, E2M1_PTX,
            )  # fmt: skip
    else:
        _mx_tile(
            tl.program_id(0), w_ptr, s_ptr, out_w_ptr, out_s_ptr, flag_ptr, n_rows, n_cols,
            s_stride, s_matrix_stride, tiles_n, tiles_k, amax_floor, recip_max, SRC, DST_FP4,
            R, G, BLK_M, BLK_K, EVEN_N, EVEN_K, E2M1_PTX,
        )  # fmt: skip
