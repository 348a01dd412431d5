"""One Hopper rank's routed experts for a few tokens, at the weights' memory bandwidth.

DeepGEMM's MegaMoE kernel costs 110-175 us per layer on one H200 rank whatever the batch
(its dispatch, barriers and persistent schedule), more than reading a decode step's active
experts takes. This path runs the same layer in three to five Triton launches over the
experts' own resident tensors (no second copy of any weight), each launch after the first
a programmatic dependent one below the persistent sizes (``Tiles.pdl``: its programs start
while the launch before it runs, and wait for it only before reading what it wrote):

1. **route** (program 0, plus cast programs): the (token, slot) pairs of each local expert,
   grouped by expert (counts, offsets, the pairs in expert order, the list of experts that
   have any and, for persistent programs, each one's tiles of ``block_m`` pairs), and the
   tokens cast to FP8 E4M3 with a float32 scale per 128 columns, the
   dispatch buffer's rule, one program per 128 columns of 4 tokens (no cast when the router
   already wrote them there). Up to ``SCAN_PAIRS`` pairs there is no grouping: each l1 and
   l2 program scans the ids for its expert's pairs itself, and the first pair of each
   expert leads it (no route launch at all for FP8 tokens, its cast programs alone for
   bf16 ones). From 512 tokens the grouping is spread: one counting program per
   ``COUNT_BLOCK`` pairs (each ranks its block's pairs per expert), then a **place** launch
   of as many programs puts them in expert order (one program grouping 40960 pairs alone
   took 105 us; spread, 33);
2. **l1** (a program per active expert and 64 intermediate columns; from 512 tokens, once
   an expert holds more than ``MIDSIZE_PAIRS_PER_EXPERT`` pairs on average,
   ``Tiles.l1_per_sm`` persistent programs per SM, each claiming (expert tile, 64 columns)
   items from a counter, ``Tiles.claim``; tiles of 64 tokens past
   ``WIDE_PAIRS_PER_EXPERT`` pairs per expert, ``LARGE_EXPERT_WIDE_PAIRS`` for large
   experts): the gate and up rows
   of the block-FP8 ``w13`` (stored with gate and up rows interleaved in groups of 8,
   ``l1_order``) against the expert's tokens, 128x128 float32 block scales, SwiGLU with the
   layer's clamp, times the top-k weight, cast to FP8 with a power-of-two scale per 64
   columns (the Hopper kernel's rounding of its intermediate);
3. **l2** (a program per active expert and ``block_n2`` hidden columns, or persistent
   programs as l1's): ``w2`` against those rows, one bf16 row per (token, slot), as the
   Hopper kernel rounds its experts' outputs before its combine. In the decode grids where
   l1's programs do not all run at once, an l2 program waits for its own expert's l1
   programs only (each adds one to its expert's count once its rows are written; the
   combine zeroes the counts), so l2 streams the first experts' ``w2`` while l1 streams
   the last experts' ``w13``;
4. **combine** (a program per token and 256 columns): the slots' rows summed in float32 in
   slot order, unused and other ranks' slots skipped, rounded to bf16 (the Hopper kernel's
   combine).

Every active expert's weights are streamed once per tile of ``block_m`` of its tokens: once
per call at decode sizes, where one tile holds them (one program loops over its tiles, of
32 tokens from 512 tokens on); with more pairs per expert its tiles are items that the
persistent programs take side by side (each tile after the first cost about half a
stream of the weights more on the H200, read from L2: Qwen4-Exp at 4096 tokens took 3.15x
the floor with about 3 tiles of 32 per expert). They come in tiles that the
Tensor Memory Accelerator copies (host-side tensor descriptors over the resident ``w13``
and ``w2``, made once per tensor and tile shape). The numerics are the Hopper kernel's, so
the reference backend's emulation (``emulate_kernel=True``) is the oracle of both; the GEMMs
accumulate in another order than the kernel's (float32 sums, so outputs agree within the
kernel's tolerance, not bit for bit). The result does not depend on which order an expert's
pairs are listed in (each row's sums are its own), so a replay of a CUDA graph gives the
bits of the eager call.

The grid is fixed by the token count (the largest possible number of active experts, or
of pairs when scanning, or the persistent programs of the device's SMs), so a CUDA graph
captures one launch sequence per token count; programs beyond the call's active experts
return at once, and persistent ones take as many items as the route table lists. No host
sync.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.core.kernels.launch import KernelLaunch, cdiv, eager_key, next_power_of_2
from megamoe.core.kernels.requant_codecs import ceil_ue8m0_exponent, ue8m0_reciprocal

__all__ = [
    "BATCH_TILES",
    "DECODE_TILES",
    "MIDSIZE_TILES",
    "WIDE_TILES",
    "ExpertWeights",
    "SmallBatchExperts",
    "Tiles",
    "l2_stages",
    "tiles_for",
]

SCALE_BLOCK = 128  # rows and columns per float32 weight scale; columns per token scale
ACT_GROUP = 64  # columns per power-of-two scale of the intermediate (the Hopper kernel's)
L1_GROUP = 8  # gate/up rows interleaved in groups of 8 (DeepGEMM's L1 order)
BLOCK_N1 = ACT_GROUP  # intermediate columns per l1 program: one act scale group
ROUTE_BLOCK = 4096  # pairs per step of the route program
ROUTE_WARPS = 8  # warps of each route program (the grouping one's step: 16 pairs a thread)
COUNT_BLOCK = 1024  # pairs per counting program, when the grouping is spread (512 tokens on)
COUNT_ROWS = 8  # blocks' counts each place program sums per step
CAST_ROWS = 4  # token rows per cast program of the route launch
COMBINE_BLOCK = 256  # hidden columns per combine program
E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude
TOKEN_AMAX_FLOOR = 1e-10  # the dispatch rule's amax floor (DISPATCH_AMAX_FLOOR)
ACT_AMAX_FLOOR = 1e-4  # the intermediate's amax floor (the Hopper kernel's, AMAX_FLOOR)
TILE_LIMIT = 1 << 16  # an expert tile entry: expert * TILE_LIMIT + its tile (of fewer tiles)
SMALLEST_BLOCK_M = 16  # the fewest pairs a tile holds (a tensor-core dot's least rows)
TOKEN_ROW_BLOCK = 64  # rows of a Hopper tensor-core dot (wgmma) per warp group
MIN_REGISTERS, MAX_REGISTERS = 24, 255  # what ptxas takes as a thread's register limit
# The route table's expert tiles come after a header: their number, then the counters from
# which l1's and l2's persistent programs claim their items (``Tiles.claim``).
TILES_HEADER = 3
L1_CLAIMS, L2_CLAIMS = 1, 2
_CAST_ROWS = tl.constexpr(CAST_ROWS)
_ROUTE_BLOCK = tl.constexpr(ROUTE_BLOCK)
_COUNT_ROWS = tl.constexpr(COUNT_ROWS)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_RECIPROCAL = tl.constexpr(1.0 / E4M3_MAX)
_TOKEN_AMAX_FLOOR = tl.constexpr(TOKEN_AMAX_FLOOR)
_TILE_LIMIT = tl.constexpr(TILE_LIMIT)
_TILES_HEADER = tl.constexpr(TILES_HEADER)
_L1_CLAIMS = tl.constexpr(L1_CLAIMS)
_L2_CLAIMS = tl.constexpr(L2_CLAIMS)
_BLOCK_N1 = tl.constexpr(BLOCK_N1)
_ACT_AMAX_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)


@dataclass(frozen=True)
class Tiles:
    """One call size's tiles: their shapes, pipelining, launches and grids.

    ``block_m``: (token, slot) pairs per tile; ``block_n2``: l2's output columns per
    program; ``warps`` and ``stages``: each program's (l2's stages: ``l2_stages``).

    ``l2_step``: groups of 64 intermediate columns each l2 loop step loads, their loads
    issued together (with 2, a ``w2`` row's 64-byte pieces are read as 128-byte ones).
    ``pdl``: every launch after the call's first is a programmatic dependent launch (l2
    finds its expert while l1 streams; the next launch starts as soon as each program of
    this one has begun its main loop).
    ``persistent``: l1 and l2 run ``l1_per_sm`` and ``l2_per_sm`` programs per SM, each
    taking every so many of the call's (expert tile, column tile) items in turn, in place of
    one program per active expert and column tile.
    ``spread``: the grouping of the pairs by expert is spread over counting programs and a
    place launch (one program per ``COUNT_BLOCK`` pairs each), in place of one program.
    ``l1_per_sm``: l1 programs one SM runs at once (what its shared memory holds: 5 stages
    of 20 KB hold two). The persistent grids start this many per SM; in the decode grids,
    l2 waits per expert where l1 has more programs than that (more than one wave).
    ``l2_per_sm``: persistent l2 programs per SM (three streamed best, 2026-12-04,
    docs/gpu.md). A program that does not fit starts only when another ends, late for its
    share of the items.
    ``claim``: persistent programs claim their items one at a time from a counter (an
    atomic add each, the next claimed while the current one runs) in place of taking every
    so many: the items run in about the order they are listed, whatever the programs' pace,
    so an expert's tiles (listed side by side) stream its weights together. On the H200
    (2026-12-05, ``bench_tiles.py``) GLM-5.3-Flash's layer took 7-9% less at 1024-4096
    tokens (2093.6 to 1949.0 us at 1024), Qwen4-Exp's changed by under 1%: its tiles past
    the first still cost about half a stream of its weights each, read from L2.
    ``token_rows``: the dots' rows are the tile's tokens and their columns the weights' rows
    (``block_m`` a multiple of 64, a Hopper tensor-core dot's rows), in place of the
    weights' rows by the tokens (what tiles of 16 or 32 tokens need). Each step's per-token
    block scales then lie along the rows of a thread's part of the product, a few values a
    thread, where along its columns they take many: on 64-token tiles, compiled for sm90,
    l1 takes 203 registers a thread in place of 255 and l2 178 in place of 249
    (``kernel_resources.py``). The same products summed in the same order: the
    interpreter gives the weight-row tiles' bits (``core/kernel_tests``), the GPU's are
    compared in ``test_gpu_small_batch.py``.
    ``max_registers``: the most registers a thread of l1 and l2 may take (``maxnreg``; 0:
    the compiler's choice), so that more programs share an SM (at most 168 for three
    programs of 4 warps); a kernel that needs more spills to its stack
    (``kernel_resources.py`` says).
    """

    block_m: int
    block_n2: int
    warps: int
    stages: int
    l2_step: int
    pdl: bool
    persistent: bool
    spread: bool
    l1_per_sm: int = 2
    l2_per_sm: int = 3
    claim: bool = False
    token_rows: bool = False
    max_registers: int = 0

    def __post_init__(self) -> None:
        if self.block_m < SMALLEST_BLOCK_M:
            raise ValueError(
                f"Tiles: block_m={self.block_m}; at least {SMALLEST_BLOCK_M} (the least rows "
                "of a tensor-core dot, and what the route table is sized for)"
            )
        if self.token_rows and self.block_m % TOKEN_ROW_BLOCK:
            raise ValueError(
                f"Tiles: token_rows with block_m={self.block_m}; the tokens are the dots' rows "
                f"then, which a Hopper tensor-core dot takes in {TOKEN_ROW_BLOCK}s: use a "
                f"block_m multiple of {TOKEN_ROW_BLOCK}, or token_rows=False"
            )
        if self.max_registers and not MIN_REGISTERS <= self.max_registers <= MAX_REGISTERS:
            raise ValueError(
                f"Tiles: max_registers={self.max_registers}; 0 (the compiler's choice) or "
                f"{MIN_REGISTERS} to {MAX_REGISTERS} registers a thread"
            )


DECODE_TILES = Tiles(
    block_m=16, block_n2=64, warps=4, stages=5, l2_step=2, pdl=True, persistent=False,
    spread=False,
)  # fmt: skip
MIDSIZE_TILES = Tiles(
    block_m=32, block_n2=128, warps=4, stages=5, l2_step=1, pdl=True, persistent=False,
    spread=True,
)  # fmt: skip
BATCH_TILES = Tiles(
    block_m=32, block_n2=128, warps=4, stages=5, l2_step=1, pdl=False, persistent=True,
    spread=True, claim=True,
)  # fmt: skip
# 64-token tiles with the tokens as the dots' rows: at most 168 registers a thread (no
# spill), 3 stages, so three l1 and three l2 programs share an SM (the weights' rows as the
# dots' rows took 255 and 249 registers: two each; docs/gpu.md, fourteenth session)
WIDE_TILES = Tiles(
    block_m=64, block_n2=128, warps=4, stages=3, l2_step=1, pdl=False, persistent=True,
    spread=True, l1_per_sm=3, l2_per_sm=3, claim=True, token_rows=True, max_registers=168,
)  # fmt: skip
# From 512 tokens: the decode grid on 32-token tiles while the call's pairs per local expert
# are at most this (three quarters of a tile: few experts hold a second one, which their
# program would stream after the first), the persistent programs past it (docs/gpu.md).
MIDSIZE_PAIRS_PER_EXPERT = 24
# Past this many pairs per local expert on average, 64-token tiles (one tile holds most
# experts' pairs, where 32-token ones need two or more, each streaming the weights again).
WIDE_PAIRS_PER_EXPERT = 32
# Experts of at least this many weight bytes take the 64-token tiles past fewer pairs: a
# second 32-pair tile of a large expert costs more than the wide tiles' empty rows (H100
# SXM, 2026-12-05: GLM-5.3-Flash's 25 MB experts 1.1-1.5% faster on 64-token tiles at 28
# and 32 pairs, 0.3% slower at 25; a DeepSeek-V3-shaped layer's 44 MB ones 4.6% and 9.5%
# faster at 28 and 32; Qwen4-Exp's 3.1 MB ones 2.6% slower at 28, 0.5% faster at 32).
LARGE_EXPERT_BYTES = 8 << 20
LARGE_EXPERT_WIDE_PAIRS = 26
# Up to this many (token, slot) pairs, when the router already wrote the FP8 tokens, the l1
# and l2 programs find their expert's pairs by scanning the ids: no route launch at all.
SCAN_PAIRS = 64


def tiles_for(tokens: int, top_k: int, num_experts: int, expert_bytes: int) -> Tiles:
    """The tile shape for a call of ``tokens`` tokens (measured on the H200, docs/gpu.md).

    ``top_k`` slots per token over ``num_experts`` local experts of ``expert_bytes`` weight
    bytes each: from 512 tokens the pairs an expert holds on average choose between the
    decode grid's 32-token tiles and the persistent programs (``MIDSIZE_PAIRS_PER_EXPERT``),
    and these between 32- and 64-token tiles (``WIDE_PAIRS_PER_EXPERT``, or
    ``LARGE_EXPERT_WIDE_PAIRS`` for experts of ``LARGE_EXPERT_BYTES`` or more).

    Decode sizes put one or two tokens on most experts: 16-token tiles waste least, and
    l2 programs of 64 columns with 5 stages in flight streamed best (within 4% of the best of
    the ten shapes tried at 1-256 tokens on both real layers). Loading two 64-column groups
    per l2 step took GLM-5.3-Flash's l2 (rows of 2048 bytes) from 292 to 210 us at 16 tokens
    and its layer from 1.38x to 1.23x the floor (eight shapes tried at 1-256 tokens); two
    128-column blocks per l1 step were slower on both layers. From 512 tokens an expert holds
    tens of tokens: 32-token tiles read its weights fewer times (Qwen4-Exp at 1024 tokens:
    606 us against 980 with 64-token tiles of 8 warps). Programmatic dependent launches took
    1.5-4.8 us off each call of 1-16 tokens on both layers and of 64-256 on Qwen4-Exp's
    (one token: 23.2 us against 24.9; GLM-5.3-Flash: 63.7 against 66.5), changed 64
    GLM-5.3-Flash tokens by under 0.1% and added 1.5% at 1024 tokens, so batch tiles launch
    each kernel after the last has ended. With the weights' tiles copied by the TMA, 128-column
    l2 programs at decode sizes and 4-group l2 steps came within 1% or were slower (at 1-256
    tokens, 2026-12-04). Batch tiles run persistent programs (a fixed number per SM, each
    taking items in turn: the programs of a wave no longer start and end together, leaving
    the memory idle between waves), with 5 stages: Qwen4-Exp at 1024 tokens 547 to 500 us,
    GLM-5.3-Flash at 512 1995 to 1834 (the same bits). Since l2 waits per expert (the decode
    grids), the decode grid of 32-token tiles and 128-column l2 programs beats them while an
    expert holds up to about 25 pairs: Qwen4-Exp 3.0% and 3.1% faster at 512 and 1024 tokens
    (10 and 20 pairs per expert), 0.8% at 1280 (25), 4.6% slower at 1536 (30); GLM-5.3-Flash
    2.5% and 4.6% faster at 512 and 768 (14 and 21), 6.3% slower at 1024 (28; 2026-12-04).
    Past 32 pairs per expert, 64-token tiles (claiming, 4 stages, 2 l2 programs per SM)
    against the 32-token ones claiming (2026-12-05): GLM-5.3-Flash 17% and 18% faster at 2048
    and 4096 tokens (57 and 114 pairs per expert; 2680.4 against 3241.3 us at 2048),
    Qwen4-Exp 8.4% faster at 2048 (40) and 1.1% slower at 4096 (80); at 28 pairs
    (GLM-5.3-Flash, 1024 tokens) 11% slower. With the tokens as the dots' rows, three
    programs per SM (2026-12-05, an H100 SXM, the same bits): Qwen4-Exp 4.3% and 19% faster
    at 2048 and 4096 tokens (695.1 against 726.0 us at 2048), GLM-5.3-Flash 0.8% slower at
    2048 and 19% faster at 4096 (3618.6 against 4481.9); 128-token tiles of 8 warps, and
    64-token ones at 128 registers (four programs an SM, spilling), took 1.1-2.4x as long.
    Experts of 8 MiB and more take the 64-token tiles past 26 pairs (2026-12-05, an H100
    SXM): a DeepSeek-V3-shaped layer (44 MB experts) 9.5% faster at 32 pairs (1024 tokens:
    4155.1 against 4593.5 us), 4.6% at 28; GLM-5.3-Flash 1.1% and 1.5% at 28 and 32, 0.3%
    slower at 25; Qwen4-Exp's 3.1 MB experts keep the 32-token ones to 32 pairs (64-token
    ones 2.6% and 1.8% slower at 28 and 30, 0.5% faster at 32).
    """
    if tokens < 512:
        return DECODE_TILES
    if tokens * top_k <= MIDSIZE_PAIRS_PER_EXPERT * num_experts:
        return MIDSIZE_TILES
    large = expert_bytes >= LARGE_EXPERT_BYTES
    wide_pairs = LARGE_EXPERT_WIDE_PAIRS if large else WIDE_PAIRS_PER_EXPERT
    if tokens * top_k <= wide_pairs * num_experts:
        return BATCH_TILES
    return WIDE_TILES


def most_expert_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """The most expert tiles of ``block_m`` pairs that ``pairs`` pairs make (the route table's).

    Each active expert has at most one partial tile.
    """
    return pairs // block_m + min(num_experts, pairs)


def l2_stages(tiles: Tiles, intermediate: int) -> int:
    """l2's pipeline depth: the tiles' stages, at most one fewer than its loop's steps.

    A stage beyond that only holds shared memory, so fewer l2 programs share an SM:
    Qwen4-Exp's l2 (I=512: four steps of two 64-column groups) took 120.6 us at 16 tokens
    with 3 stages against 126.7 with 5, and 20.3 against 21.1 at one token; GLM-5.3-Flash's
    (I=2048, sixteen steps) keeps 5 (measured on the H200, docs/gpu.md).
    """
    steps = intermediate // (ACT_GROUP * tiles.l2_step)
    return max(2, min(tiles.stages, steps - 1))


@triton.jit
def _write_groups(
    table_ptr: tl.tensor,
    counts: tl.tensor,
    experts: tl.tensor,
    num_pairs: int,
    NUM_EXPERTS: tl.constexpr,
    TILE_M: tl.constexpr,
) -> tl.tensor:
    """The route table's offsets, active experts and expert tiles from each expert's count.

    The expert tiles only with ``TILE_M`` (the route kernel's docstring). Returns the offsets.
    """
    experts_ok = experts < NUM_EXPERTS
    offsets = tl.cumsum(counts, 0) - counts
    tl.store(table_ptr + NUM_EXPERTS + experts, offsets, mask=experts_ok)
    active_ptr = table_ptr + 2 * NUM_EXPERTS
    used = counts > 0
    tl.store(active_ptr + tl.cumsum(used.to(tl.int32), 0) - 1, experts, mask=used)
    tl.store(active_ptr + NUM_EXPERTS, tl.sum(used.to(tl.int32), 0))
    if TILE_M:
        tiles_ptr = _expert_tiles(table_ptr, num_pairs, NUM_EXPERTS)
        expert_tiles = (counts + TILE_M - 1) // TILE_M
        first_tile = tl.cumsum(expert_tiles, 0) - expert_tiles
        tl.store(tiles_ptr, tl.sum(expert_tiles, 0))
        tl.store(tiles_ptr + _L1_CLAIMS, 0)
        tl.store(tiles_ptr + _L2_CLAIMS, 0)
        for tile in range(0, tl.max(expert_tiles, 0)):
            tl.store(
                tiles_ptr + _TILES_HEADER + first_tile + tile, experts * _TILE_LIMIT + tile,
                mask=experts_ok & (tile < expert_tiles),
            )  # fmt: skip
    return offsets


@triton.jit
def _local_experts(
    ids_ptr: tl.tensor,
    pairs: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The local experts of ``pairs`` and which of them are this rank's (used, in range)."""
    local = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    local -= first_expert
    return local, (pairs < num_pairs) & (local >= 0) & (local < NUM_EXPERTS)


@triton.jit
def _count_block(
    ids_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    block: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    COUNT: tl.constexpr,
) -> None:
    """Block ``block``'s ``COUNT`` pairs: their count per expert, each one's rank in the block.

    The counts go to ``counts`` (E), the ranks (among the block's pairs of the same expert)
    to ``ranks``.
    """
    experts = tl.arange(0, EXPERTS_POW2)
    tl.store(counts_ptr + experts, tl.zeros([EXPERTS_POW2], tl.int32), mask=experts < NUM_EXPERTS)
    tl.debug_barrier()
    pairs = block * COUNT + tl.arange(0, COUNT)
    local, ok = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS)
    rank = tl.atomic_add(counts_ptr + local, 1, mask=ok, sem="relaxed")
    tl.store(ranks_ptr + pairs, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_tokens", "first_expert"])
def _route_kernel(
    ids_ptr: tl.tensor,
    table_ptr: tl.tensor,
    block_counts_ptr: tl.tensor,
    x_ptr: tl.tensor,
    x_fp8_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    num_pairs: int,
    num_tokens: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    CAST: tl.constexpr,
    PDL: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_M: tl.constexpr,
    COUNT: tl.constexpr,
) -> None:
    """The grouping programs (one, or one per ``COUNT`` pairs), then the cast programs.

    A cast program casts 128 columns of 4 tokens.

    ``table``: counts (E), offsets (E), active experts (E), their number (1), each pair's
    rank within its expert (pairs), the pairs in expert order (pairs); int32. With ``TILE_M``
    (persistent programs' tiles) it goes on with the number of expert tiles (1), l1's and
    l2's claim counters (2, zeroed), then each active expert's tiles of ``TILE_M`` pairs
    (``expert * TILE_LIMIT + tile``). Without
    ``GROUP`` program 0 does nothing (l1 and l2 scan the ids). With ``COUNT`` each grouping
    program counts its block's pairs per expert into its row of ``block_counts`` and ranks
    them within the block; the place launch finishes the table. With ``PDL`` the next
    launch's programs may start at once (they wait for this launch to end). The counters are
    relaxed atomics: the program's barriers order them, and no other program reads them
    before it ends.
    """
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    groups = tl.cdiv(num_pairs, COUNT) if GROUP and COUNT else 1
    if pid >= groups:
        if CAST:  # one block of 128 columns of CAST_ROWS tokens: one load, one store
            KB: tl.constexpr = HIDDEN // 128
            kb = (pid - groups) % KB
            rows = ((pid - groups) // KB) * _CAST_ROWS + tl.arange(0, _CAST_ROWS)
            rows_ok = rows < num_tokens
            at = rows[:, None].to(tl.int64) * HIDDEN + kb * 128 + tl.arange(0, 128)[None, :]
            x = tl.load(x_ptr + at, mask=rows_ok[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), _TOKEN_AMAX_FLOOR)
            scale = tl.math.div_rn(amax, _E4M3_MAX)
            x_fp8 = (x * tl.math.div_rn(1.0, scale)[:, None]).to(tl.float8e4nv)
            tl.store(x_fp8_ptr + at, x_fp8, mask=rows_ok[:, None])
            tl.store(x_scale_ptr + rows * KB + kb, scale, mask=rows_ok)
        return
    if not GROUP:
        return
    ranks_ptr = table_ptr + 3 * NUM_EXPERTS + 1
    experts = tl.arange(0, EXPERTS_POW2)
    experts_ok = experts < NUM_EXPERTS
    if COUNT:
        _count_block(
            ids_ptr, block_counts_ptr + pid * NUM_EXPERTS, ranks_ptr, pid, num_pairs, first_expert,
            NUM_EXPERTS, EXPERTS_POW2, COUNT,
        )  # fmt: skip
        return
    counts_ptr = table_ptr
    sorted_ptr = _sorted_pairs(table_ptr, num_pairs, NUM_EXPERTS)
    tl.store(counts_ptr + experts, tl.zeros([EXPERTS_POW2], tl.int32), mask=experts_ok)
    tl.debug_barrier()
    for start in range(0, num_pairs, _ROUTE_BLOCK):
        pairs = start + tl.arange(0, _ROUTE_BLOCK)
        local, ok = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS)
        rank = tl.atomic_add(counts_ptr + local, 1, mask=ok, sem="relaxed")
        tl.store(ranks_ptr + pairs, rank, mask=ok)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, mask=experts_ok, other=0)
    _write_groups(table_ptr, counts, experts, num_pairs, NUM_EXPERTS, TILE_M)
    tl.debug_barrier()
    offsets_ptr = table_ptr + NUM_EXPERTS
    for start in range(0, num_pairs, _ROUTE_BLOCK):
        pairs = start + tl.arange(0, _ROUTE_BLOCK)
        local, ok = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS)
        rank = tl.load(ranks_ptr + pairs, mask=ok, other=0)
        offset = tl.load(offsets_ptr + local, mask=ok, other=0)
        tl.store(sorted_ptr + offset + rank, pairs, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "first_expert"])
def _place_kernel(
    ids_ptr: tl.tensor,
    table_ptr: tl.tensor,
    block_counts_ptr: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TILE_M: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Block ``program_id(0)``'s pairs into expert order, after the route's counting programs.

    Every program sums the blocks' counts per expert (all of them, and those before its
    own): a pair goes to its expert's offset, plus the earlier blocks' pairs of that expert,
    plus its rank within its block. Program 0 also writes the counts, the offsets, the
    active experts and the expert tiles. ``block_counts``: the counting programs' rows, then
    one row per program here (where its pairs' experts start).
    """
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    block = tl.program_id(0)
    blocks = tl.cdiv(num_pairs, COUNT)
    experts = tl.arange(0, EXPERTS_POW2)
    experts_ok = experts < NUM_EXPERTS
    counts = tl.zeros([EXPERTS_POW2], tl.int32)
    before = tl.zeros([EXPERTS_POW2], tl.int32)
    for row in range(0, blocks, _COUNT_ROWS):
        rows = row + tl.arange(0, _COUNT_ROWS)
        at = block_counts_ptr + rows[:, None] * NUM_EXPERTS + experts[None, :]
        block_counts = tl.load(at, mask=(rows < blocks)[:, None] & experts_ok[None, :], other=0)
        counts += tl.sum(block_counts, 0)
        before += tl.sum(tl.where((rows < block)[:, None], block_counts, 0), 0)
    if block == 0:
        tl.store(table_ptr + experts, counts, mask=experts_ok)
        offsets = _write_groups(table_ptr, counts, experts, num_pairs, NUM_EXPERTS, TILE_M)
    else:
        offsets = tl.cumsum(counts, 0) - counts
    starts_ptr = block_counts_ptr + (blocks + block) * NUM_EXPERTS
    tl.store(starts_ptr + experts, offsets + before, mask=experts_ok)
    tl.debug_barrier()
    pairs = block * COUNT + tl.arange(0, COUNT)
    local, ok = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS)
    rank = tl.load(table_ptr + 3 * NUM_EXPERTS + 1 + pairs, mask=ok, other=0)
    start = tl.load(starts_ptr + local, mask=ok, other=0)
    tl.store(_sorted_pairs(table_ptr, num_pairs, NUM_EXPERTS) + start + rank, pairs, mask=ok)


@triton.jit
def _sorted_pairs(table_ptr: tl.tensor, num_pairs: int, NUM_EXPERTS: tl.constexpr) -> tl.tensor:
    """Where the route table's pairs in expert order are (the route kernel's docstring)."""
    return table_ptr + 3 * NUM_EXPERTS + 1 + num_pairs


@triton.jit
def _listed_expert(
    table_ptr: tl.tensor, slot: int, num_pairs: int, NUM_EXPERTS: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """The route table's active expert ``slot``: skip, id, pairs' count, where they start.

    ``slot`` past the active experts skips (its entries are read as expert 0's).
    """
    active = tl.load(table_ptr + 3 * NUM_EXPERTS)
    expert = tl.load(table_ptr + 2 * NUM_EXPERTS + slot, mask=slot < active, other=0)
    sorted_ptr = _sorted_pairs(table_ptr, num_pairs, NUM_EXPERTS)
    sorted_ptr += tl.load(table_ptr + NUM_EXPERTS + expert)
    return slot >= active, expert, tl.load(table_ptr + expert), sorted_ptr


@triton.jit
def _scanned_expert(
    ids_ptr: tl.tensor,
    pair: int,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    PAIRS: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """Pair ``pair``'s local expert found by scanning every pair's id (no route table).

    Returns whether the program skips (``pair`` is unused, another rank's, or not the first
    pair of its expert: the first leads, so each expert is one program's), the expert, which
    pairs are its (a mask over ``arange(PAIRS)``), their ranks among them, their count and
    that arange.
    """
    expert = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
    q = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + q, mask=q < num_pairs, other=-1).to(tl.int32) - first_expert
    mine = (ids == expert) & (q < num_pairs)
    leader = tl.min(tl.where(mine, q, PAIRS), 0)
    skip = (expert < 0) | (expert >= NUM_EXPERTS) | (leader != pair)
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    return skip, expert, mine, rank, tl.sum(mine.to(tl.int32), 0), q


@triton.jit
def _scanned_rows(
    mine: tl.tensor, rank: tl.tensor, q: tl.tensor, m0: int, BLOCK_M: tl.constexpr
) -> tl.tensor:
    """The pairs of ranks ``m0 .. m0 + BLOCK_M`` among an expert's (``_scanned_expert``)."""
    m = m0 + tl.arange(0, BLOCK_M)
    return tl.sum(tl.where(mine[None, :] & (rank[None, :] == m[:, None]), q[None, :], 0), 1)


@triton.jit
def _program_expert(
    ids_ptr: tl.tensor,
    table_ptr: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    SCAN: tl.constexpr,
    PAIRS: tl.constexpr,
) -> tuple[tl.tensor, ...]:
    """Program ``program_id(1)``'s expert: skip, id, pairs' count, where its pairs are.

    The route table's active expert of that index, or with ``SCAN`` the expert that pair
    leads; the last four values are what ``_expert_pairs`` reads.
    """
    if SCAN:
        skip, expert, mine, rank, count, q = _scanned_expert(
            ids_ptr, tl.program_id(1), num_pairs, first_expert, NUM_EXPERTS, PAIRS
        )
        sorted_ptr = table_ptr
    else:
        skip, expert, count, sorted_ptr = _listed_expert(
            table_ptr, tl.program_id(1), num_pairs, NUM_EXPERTS
        )
        q = tl.arange(0, PAIRS)
        mine, rank = q < 0, q
    return skip, expert, count, sorted_ptr, mine, rank, q


@triton.jit
def _expert_pairs(
    sorted_ptr: tl.tensor,
    mine: tl.tensor,
    rank: tl.tensor,
    q: tl.tensor,
    m0: int,
    count: tl.tensor,
    SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The expert's pairs of ranks ``m0 .. m0 + BLOCK_M``: which rows hold one, the pairs.

    The pairs are int64, 0 past the expert's ``count``.
    """
    m_ok = m0 + tl.arange(0, BLOCK_M) < count
    if SCAN:
        pair = _scanned_rows(mine, rank, q, m0, BLOCK_M)
    else:
        pair = tl.load(sorted_ptr + m0 + tl.arange(0, BLOCK_M), mask=m_ok, other=0)
    return m_ok, pair.to(tl.int64)


@triton.jit
def _expert_tiles(table_ptr: tl.tensor, num_pairs: int, NUM_EXPERTS: tl.constexpr) -> tl.tensor:
    """Where the route table's expert tiles are: their number, the claim counters, the tiles."""
    return _sorted_pairs(table_ptr, num_pairs, NUM_EXPERTS) + num_pairs


@triton.jit
def _items(
    table_ptr: tl.tensor, num_pairs: int, NUM_EXPERTS: tl.constexpr, COLUMN_TILES: tl.constexpr
) -> tl.tensor:
    """How many items the call's persistent programs take: (expert tile, column tile) pairs.

    The route table's expert tiles, each times ``COLUMN_TILES`` column tiles.
    """
    return tl.load(_expert_tiles(table_ptr, num_pairs, NUM_EXPERTS)) * COLUMN_TILES


@triton.jit
def _item_pairs(
    table_ptr: tl.tensor,
    item: int,
    num_pairs: int,
    NUM_EXPERTS: tl.constexpr,
    COLUMN_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """Item ``item`` (``_items``): its expert, column tile, which rows hold pairs, the pairs.

    Its expert tile is the route table's ``item // COLUMN_TILES``; the pairs are its
    expert's of ranks ``BLOCK_M * t .. BLOCK_M * (t + 1)`` (t: the tile's index among its
    expert's), int64, 0 past the expert's count.
    """
    tile = item // COLUMN_TILES
    packed = tl.load(_expert_tiles(table_ptr, num_pairs, NUM_EXPERTS) + _TILES_HEADER + tile)
    expert = packed // _TILE_LIMIT
    m = (packed % _TILE_LIMIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < tl.load(table_ptr + expert)
    sorted_ptr = _sorted_pairs(table_ptr, num_pairs, NUM_EXPERTS)
    sorted_ptr += tl.load(table_ptr + NUM_EXPERTS + expert)
    pair = tl.load(sorted_ptr + m, mask=m_ok, other=0).to(tl.int64)
    return expert, item % COLUMN_TILES, m_ok, pair


@triton.jit
def _claim(
    table_ptr: tl.tensor, num_pairs: int, NUM_EXPERTS: tl.constexpr, COUNTER: tl.constexpr
) -> tl.tensor:
    """The next unclaimed item of the launch (``Tiles.claim``): counter ``COUNTER``, plus one.

    Relaxed: the claims need only be distinct; what the items read was written by earlier
    launches.
    """
    counter = _expert_tiles(table_ptr, num_pairs, NUM_EXPERTS) + COUNTER
    return tl.atomic_add(counter, 1, sem="relaxed")


@triton.jit
def _mark_done(done_ptr: tl.tensor, expert: tl.tensor) -> None:
    """One more of ``expert``'s programs has written its rows (after all its threads have).

    A release: what the program wrote is visible to whoever acquires the count after it.
    """
    tl.debug_barrier()
    tl.atomic_add(done_ptr + expert, 1, sem="release")


@triton.jit
def _wait_done(done_ptr: tl.tensor, expert: tl.tensor, PROGRAMS: tl.constexpr) -> None:
    """Spin until ``PROGRAMS`` of ``expert``'s programs have marked their rows written.

    An acquire: their rows are visible after it. The programs it waits for are running or
    done: a dependent launch's programs start only once every program of the launch before
    it has let them (l1's do once they have found their expert) or ended.
    """
    while tl.atomic_add(done_ptr + expert, 0, sem="acquire") < PROGRAMS:
        pass


@triton.jit
def _is_lead() -> tl.tensor:
    """Whether this is the launch's program (0, 0), which does its once-a-launch work."""
    return (tl.program_id(0) == 0) & (tl.program_id(1) == 0)


@triton.jit
def _lead_outlasts_previous_launch() -> None:
    """Program (0, 0) waits for the previous launch: this launch does not end before it."""
    if _is_lead():
        gdc_wait()


@triton.jit
def _lead_zeroes(counts_ptr: tl.tensor, COUNT: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """Program (0, 0) zeroes the ``COUNT`` int32 counts, ``BLOCK`` a step."""
    if _is_lead():
        for first in range(0, COUNT, BLOCK):
            at = first + tl.arange(0, BLOCK)
            tl.store(counts_ptr + at, tl.zeros([BLOCK], tl.int32), mask=at < COUNT)


@triton.jit
def _l1_tile(
    x_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    w13_desc: tl.tensor_descriptor,
    w13_scale_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    expert: tl.tensor,
    tile: tl.tensor,
    pair: tl.tensor,
    m_ok: tl.tensor,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """``expert``'s intermediate columns ``64 * tile ..`` for the ``BLOCK_M`` rows ``pair``.

    ``w13_desc``: the (E * 2I, H) weights in 128x128 tiles. Columns 64t..64t+63 are stored
    rows 128t..128t+127: 8 gate rows, then the same 8 columns' up rows, and so on (L1
    order); one dot covers both, split afterwards. The dot's rows are those 128 weight rows
    and its columns the tokens, or with ``TOKEN_ROWS`` (``Tiles.token_rows``) the other way.
    """
    KB: tl.constexpr = HIDDEN // 128
    n = tile * 64 + tl.arange(0, 64)
    k = tl.arange(0, 128)
    w_row = expert * (2 * INTERMEDIATE) + tile * 128
    scale_base = w13_scale_ptr + expert.to(tl.int64) * (2 * INTERMEDIATE // 128) * KB
    gate_scales = scale_base + ((tile * 64) // 128) * KB
    up_scales = scale_base + ((INTERMEDIATE + tile * 64) // 128) * KB
    is_gate = (tl.arange(0, 128) // 8) % 2 == 0
    token = pair // TOP_K
    # the axis of the tokens in the dot's output, and of the columns
    TOKENS: tl.constexpr = 0 if TOKEN_ROWS else 1
    COLUMNS: tl.constexpr = 1 - TOKENS
    if TOKEN_ROWS:
        acc = tl.zeros([BLOCK_M, 128], tl.float32)
    else:
        acc = tl.zeros([128, BLOCK_M], tl.float32)
    for kb in range(KB):
        cols = kb * 128 + k
        w = w13_desc.load([w_row, kb * 128])
        x_at = x_ptr + token[:, None] * HIDDEN + cols[None, :]
        x = tl.load(x_at, mask=m_ok[:, None], other=0.0)
        x_scale = tl.load(x_scale_ptr + token * KB + kb, mask=m_ok, other=0.0)
        w_scale = tl.where(is_gate, tl.load(gate_scales + kb), tl.load(up_scales + kb))
        if TOKEN_ROWS:
            acc += tl.dot(x, tl.trans(w)) * (w_scale[None, :] * x_scale[:, None])
        else:
            acc += tl.dot(w, tl.trans(x)) * (w_scale[:, None] * x_scale[None, :])
    if TOKEN_ROWS:
        acc = tl.permute(tl.reshape(acc, (BLOCK_M, 8, 2, 8)), (0, 1, 3, 2))
    else:
        acc = tl.permute(tl.reshape(acc, (8, 2, 8, BLOCK_M)), (0, 2, 3, 1))
    gate, up = tl.split(acc)
    if TOKEN_ROWS:
        gate = tl.reshape(gate, (BLOCK_M, 64))
        up = tl.reshape(up, (BLOCK_M, 64))
    else:
        gate = tl.reshape(gate, (64, BLOCK_M))
        up = tl.reshape(up, (64, BLOCK_M))
    if CLAMP:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)) * up
    act *= tl.expand_dims(tl.load(weights_ptr + pair, mask=m_ok, other=0.0), COLUMNS)
    amax = tl.maximum(tl.max(tl.abs(act), axis=COLUMNS), _ACT_AMAX_FLOOR)
    exponent = ceil_ue8m0_exponent(amax * _E4M3_RECIPROCAL)
    act_fp8 = (act * tl.expand_dims(ue8m0_reciprocal(exponent), COLUMNS)).to(tl.float8e4nv)
    at = tl.expand_dims(pair.to(tl.int64), COLUMNS) * INTERMEDIATE + tl.expand_dims(n, TOKENS)
    tl.store(act_ptr + at, act_fp8, mask=tl.expand_dims(m_ok, COLUMNS))
    act_scale = (exponent << 23).to(tl.float32, bitcast=True)
    tl.store(act_scale_ptr + pair * (INTERMEDIATE // 64) + tile, act_scale, mask=m_ok)


@triton.jit
def _l1_item(
    x_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    w13_desc: tl.tensor_descriptor,
    w13_scale_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    table_ptr: tl.tensor,
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    item: tl.tensor,
    num_pairs: int,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """A persistent l1 program's item ``item`` (``_items``: an expert tile, 64 columns)."""
    NT: tl.constexpr = INTERMEDIATE // 64
    expert, column, m_ok, pair = _item_pairs(table_ptr, item, num_pairs, NUM_EXPERTS, NT, BLOCK_M)
    _l1_tile(
        x_ptr, x_scale_ptr, w13_desc, w13_scale_ptr, weights_ptr, act_ptr, act_scale_ptr,
        expert, column, pair, m_ok, TOP_K, HIDDEN, INTERMEDIATE, CLAMP, LIMIT, BLOCK_M,
        TOKEN_ROWS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "first_expert"])
def _l1_kernel(
    x_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    w13_desc: tl.tensor_descriptor,
    w13_scale_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    table_ptr: tl.tensor,
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    l1_done_ptr: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SCAN: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PER_EXPERT: tl.constexpr,
    CLAIM: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """One expert's 64 intermediate columns ``program_id(0)``, or with ``PERSISTENT`` items.

    The expert: the route table's active expert ``program_id(1)``, or with ``SCAN`` the one
    that pair ``program_id(1)`` leads; the column tiles vary fastest, so an expert's programs
    start together (1.6-3.3% faster than experts fastest from 16 to 256 tokens, docs/gpu.md).
    ``PERSISTENT``: program p takes the items p, p + programs, ... of (the route table's
    expert tiles of ``BLOCK_M`` pairs, 64 columns), or with ``CLAIM`` those it claims from
    the table's l1 counter until they run out. With ``PDL`` it waits for the route
    launch (a no-op when it is the call's first launch) and lets l2's programs start. With
    ``PER_EXPERT`` (and ``PDL``), once its rows are written it adds one to its expert's count
    in ``l1_done``, what l2 waits for.
    """
    if PDL:
        gdc_wait()
    if PERSISTENT:
        NT: tl.constexpr = INTERMEDIATE // 64
        items = _items(table_ptr, num_pairs, NUM_EXPERTS, NT)
        if CLAIM:
            item = _claim(table_ptr, num_pairs, NUM_EXPERTS, _L1_CLAIMS)
            while item < items:
                claimed = _claim(table_ptr, num_pairs, NUM_EXPERTS, _L1_CLAIMS)
                _l1_item(
                    x_ptr, x_scale_ptr, w13_desc, w13_scale_ptr, weights_ptr, table_ptr, act_ptr,
                    act_scale_ptr, item, num_pairs, NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE,
                    CLAMP, LIMIT, BLOCK_M, TOKEN_ROWS,
                )  # fmt: skip
                item = claimed
        else:
            for item in range(tl.program_id(0), items, tl.num_programs(0)):
                _l1_item(
                    x_ptr, x_scale_ptr, w13_desc, w13_scale_ptr, weights_ptr, table_ptr, act_ptr,
                    act_scale_ptr, item, num_pairs, NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE,
                    CLAMP, LIMIT, BLOCK_M, TOKEN_ROWS,
                )  # fmt: skip
    else:
        skip, expert, count, sorted_ptr, mine, rank, q = _program_expert(
            ids_ptr, table_ptr, num_pairs, first_expert, NUM_EXPERTS, SCAN, PAIRS
        )
        if skip:
            return
        if PDL:
            gdc_launch_dependents()
        for m0 in range(0, count, BLOCK_M):
            m_ok, pair = _expert_pairs(sorted_ptr, mine, rank, q, m0, count, SCAN, BLOCK_M)
            _l1_tile(
                x_ptr, x_scale_ptr, w13_desc, w13_scale_ptr, weights_ptr, act_ptr, act_scale_ptr,
                expert, tl.program_id(0), pair, m_ok, TOP_K, HIDDEN, INTERMEDIATE, CLAMP, LIMIT,
                BLOCK_M, TOKEN_ROWS,
            )  # fmt: skip
        if PER_EXPERT:
            _mark_done(l1_done_ptr, expert)


@triton.jit
def _l2_tile(
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    w2_desc: tl.tensor_descriptor,
    w2_scale_ptr: tl.tensor,
    y_ptr: tl.tensor,
    expert: tl.tensor,
    tile: tl.tensor,
    pair: tl.tensor,
    m_ok: tl.tensor,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """``expert``'s output columns ``BLOCK_N * tile ..`` for the ``BLOCK_M`` rows ``pair``.

    ``w2_desc``: the (E * H, I) weights in ``BLOCK_N`` x 64 tiles; ``STEP`` of them per loop
    step. The dot's rows are the output columns and its columns the tokens, or with
    ``TOKEN_ROWS`` (``Tiles.token_rows``) the other way.
    """
    KS: tl.constexpr = INTERMEDIATE // 128
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, 64)
    w_row = expert * HIDDEN + tile * BLOCK_N
    scales = w2_scale_ptr + expert.to(tl.int64) * (HIDDEN // 128) * KS
    scales += ((tile * BLOCK_N) // 128) * KS
    TOKENS: tl.constexpr = 0 if TOKEN_ROWS else 1  # the tokens' axis in the dot's output
    COLUMNS: tl.constexpr = 1 - TOKENS
    if TOKEN_ROWS:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb0 in range(0, INTERMEDIATE // 64, STEP):
        for step in tl.static_range(STEP):
            kb = kb0 + step
            cols = kb * 64 + k
            act_at = act_ptr + pair[:, None] * INTERMEDIATE + cols[None, :]
            act = tl.load(act_at, mask=m_ok[:, None], other=0.0)
            act_scale = tl.load(act_scale_ptr + pair * (INTERMEDIATE // 64) + kb, mask=m_ok)
            w = w2_desc.load([w_row, kb * 64])
            if TOKEN_ROWS:
                acc += tl.dot(act, tl.trans(w)) * (act_scale[:, None] * tl.load(scales + kb // 2))
            else:
                acc += tl.dot(w, tl.trans(act)) * (act_scale[None, :] * tl.load(scales + kb // 2))
    y = acc.to(tl.bfloat16)
    y_at = y_ptr + tl.expand_dims(pair, COLUMNS) * HIDDEN + tl.expand_dims(n, TOKENS)
    tl.store(y_at, y, mask=tl.expand_dims(m_ok, COLUMNS))


@triton.jit
def _l2_item(
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    w2_desc: tl.tensor_descriptor,
    w2_scale_ptr: tl.tensor,
    table_ptr: tl.tensor,
    y_ptr: tl.tensor,
    item: tl.tensor,
    num_pairs: int,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """A persistent l2 program's item ``item`` (an expert tile, ``BLOCK_N`` columns)."""
    NT: tl.constexpr = HIDDEN // BLOCK_N
    expert, column, m_ok, pair = _item_pairs(table_ptr, item, num_pairs, NUM_EXPERTS, NT, BLOCK_M)
    _l2_tile(
        act_ptr, act_scale_ptr, w2_desc, w2_scale_ptr, y_ptr, expert, column, pair, m_ok,
        HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, STEP, TOKEN_ROWS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "first_expert"])
def _l2_kernel(
    act_ptr: tl.tensor,
    act_scale_ptr: tl.tensor,
    w2_desc: tl.tensor_descriptor,
    w2_scale_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    table_ptr: tl.tensor,
    y_ptr: tl.tensor,
    l1_done_ptr: tl.tensor,
    num_pairs: int,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
    SCAN: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PER_EXPERT: tl.constexpr,
    CLAIM: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
) -> None:
    """One expert's ``BLOCK_N`` output columns ``program_id(0)``, or with ``PERSISTENT`` items.

    The expert and the items as in l1 (items of ``BLOCK_N`` columns; with ``CLAIM`` from the
    table's l2 counter). With ``PDL`` it finds
    its expert while l1 runs (the ids and the route table are older than l1) and waits for
    l1 before reading its rows: for the whole l1 launch, or with ``PER_EXPERT`` for its
    expert's l1 programs alone (their count in ``l1_done``), so that it streams ``w2``
    while l1's programs of other experts still run (Qwen4-Exp 3% faster at 16 tokens, 9%
    at 4); then program (0, 0) waits for the whole l1 launch too, so that this launch
    never ends before l1 has.
    """
    if PERSISTENT:
        if PDL:
            gdc_wait()
        NT: tl.constexpr = HIDDEN // BLOCK_N
        items = _items(table_ptr, num_pairs, NUM_EXPERTS, NT)
        if CLAIM:
            item = _claim(table_ptr, num_pairs, NUM_EXPERTS, _L2_CLAIMS)
            while item < items:
                claimed = _claim(table_ptr, num_pairs, NUM_EXPERTS, _L2_CLAIMS)
                _l2_item(
                    act_ptr, act_scale_ptr, w2_desc, w2_scale_ptr, table_ptr, y_ptr, item,
                    num_pairs, NUM_EXPERTS, HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, STEP,
                    TOKEN_ROWS,
                )  # fmt: skip
                item = claimed
        else:
            for item in range(tl.program_id(0), items, tl.num_programs(0)):
                _l2_item(
                    act_ptr, act_scale_ptr, w2_desc, w2_scale_ptr, table_ptr, y_ptr, item,
                    num_pairs, NUM_EXPERTS, HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, STEP,
                    TOKEN_ROWS,
                )  # fmt: skip
    else:
        skip, expert, count, sorted_ptr, mine, rank, q = _program_expert(
            ids_ptr, table_ptr, num_pairs, first_expert, NUM_EXPERTS, SCAN, PAIRS
        )
        if PDL and not PER_EXPERT:
            gdc_wait()
        if PDL:
            gdc_launch_dependents()
        if skip:
            if PER_EXPERT:
                _lead_outlasts_previous_launch()
            return
        if PER_EXPERT:
            _wait_done(l1_done_ptr, expert, INTERMEDIATE // _BLOCK_N1)
        for m0 in range(0, count, BLOCK_M):
            m_ok, pair = _expert_pairs(sorted_ptr, mine, rank, q, m0, count, SCAN, BLOCK_M)
            _l2_tile(
                act_ptr, act_scale_ptr, w2_desc, w2_scale_ptr, y_ptr, expert, tl.program_id(0),
                pair, m_ok, HIDDEN, INTERMEDIATE, BLOCK_M, BLOCK_N, STEP, TOKEN_ROWS,
            )  # fmt: skip
        if PER_EXPERT:
            _lead_outlasts_previous_launch()


@triton.jit(do_not_specialize=["first_expert"])
def _combine_kernel(
    y_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    out_ptr: tl.tensor,
    l1_done_ptr: tl.tensor,
    first_expert: int,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PER_EXPERT: tl.constexpr,
) -> None:
    """Token ``program_id(0)``'s columns ``program_id(1) * BLOCK ..``: its slots, in order.

    With ``PDL`` it waits for l2 first; with ``PER_EXPERT`` program (0, 0) then zeroes
    ``l1_done`` for the next call (l1 and l2 have ended: l2's launch ends after l1's).
    """
    if PDL:
        gdc_wait()
    if PER_EXPERT:
        _lead_zeroes(l1_done_ptr, NUM_EXPERTS, BLOCK)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < HIDDEN
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + token * TOP_K + j).to(tl.int32) - first_expert
        mine = (local >= 0) & (local < NUM_EXPERTS)
        y_at = y_ptr + (token * TOP_K + j) * HIDDEN + cols
        acc += tl.load(y_at, mask=cols_ok & mine, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, acc.to(tl.bfloat16), mask=cols_ok)


def _key(constexprs: Hashable, *inputs: torch.Tensor) -> Hashable | None:
    """A launch's direct-launch key: its constexprs and its inputs' dtypes (the JIT's too).

    The ids come as int32 (the caller's routing) or int64 (the dispatch buffer): a kernel
    compiled for one reads the other wrongly, so the dtypes are part of every key.
    """
    return eager_key((constexprs, tuple(t.dtype for t in inputs)), *inputs)


_route = KernelLaunch(_route_kernel, runtime_args=9)
_place = KernelLaunch(_place_kernel, runtime_args=5)
_l1 = KernelLaunch(_l1_kernel, runtime_args=12)
_l2 = KernelLaunch(_l2_kernel, runtime_args=10)
_combine = KernelLaunch(_combine_kernel, runtime_args=5)


class ExpertWeights:
    """One layer's resident block-FP8 expert tensors and the TMA descriptors of their tiles.

    A descriptor encodes a tensor's address, shape and strides (host-side, passed by value
    to each launch and captured with it in a CUDA graph), so it stays right while the tensor
    is rewritten in place; it holds the tensor, so this object lives as long as the layer's
    own reference to its weights (the backend's), no longer.

    Args:
        w13: (E, 2I, H) float8_e4m3fn in L1 order (gate/up groups of 8).
        w13_scale: (E, 2I/128, H/128) float32 in ``[gate | up]`` order.
        w2: (E, H, I) float8_e4m3fn.
        w2_scale: (E, H/128, I/128) float32.

    Raises:
        ValueError: a weight that is not contiguous or not 16-byte aligned (what the Tensor
            Memory Accelerator reads).
    """

    def __init__(
        self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor
    ) -> None:
        for name, weight in (("w13", w13), ("w2", w2)):
            if weight.dim() != 3 or not weight.is_contiguous() or weight.data_ptr() % 16:
                raise ValueError(
                    f"small-batch experts: {name} {tuple(weight.shape)} at "
                    f"{weight.data_ptr():#x} must be a contiguous, 16-byte aligned (E, rows, "
                    "columns) tensor (the TMA copies its tiles); pass the experts' resident one"
                )
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self._tiles: dict[tuple[str, int, int], TensorDescriptor] = {}

    def descriptor(self, name: str, tile: tuple[int, int]) -> TensorDescriptor:
        """``w13`` or ``w2`` (E, R, K) as the 2-D (E * R, K) tensor of ``tile``-shaped tiles."""
        key = (name, *tile)
        found = self._tiles.get(key)
        if found is None:
            weight = self.w13 if name == "w13" else self.w2
            experts, rows, columns = weight.shape
            found = TensorDescriptor.from_tensor(weight.view(experts * rows, columns), list(tile))
            self._tiles[key] = found
        return found


class SmallBatchExperts:
    """The launches of one layer shape and the scratch they share, for up to ``max_tokens``.

    The scratch (the grouping table, the tokens in FP8, the intermediate in FP8, a bf16
    row per (token, slot)) holds activations only; layers of one shape on one device share
    one (``megamoe.core.backends.small_batch``), as they share the kernel's symmetric buffer.

    Args:
        num_experts: this rank's routed experts (the first dimension of the weights).
        first_expert: the physical id of local expert 0.
        top_k: slots per token.
        hidden: H, a multiple of 128.
        intermediate: I, a multiple of 128.
        swiglu_limit: the SwiGLU clamp, None for none.
        max_tokens: the most tokens one call takes.
        device: a CUDA device.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        first_expert: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        swiglu_limit: float | None,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        if hidden % SCALE_BLOCK or intermediate % SCALE_BLOCK:
            raise ValueError(
                f"small-batch experts: hidden {hidden} and intermediate {intermediate} must be "
                f"multiples of {SCALE_BLOCK} (the block scales' size)"
            )
        # sized for tiles of the fewest pairs any may hold: every tile shape fits
        most_experts, most_tokens = (1 << 31) // TILE_LIMIT, TILE_LIMIT * SMALLEST_BLOCK_M
        if num_experts > most_experts or max_tokens > most_tokens:
            raise ValueError(
                f"small-batch experts: {num_experts} local experts and max_tokens {max_tokens}; "
                f"at most {most_experts} and {most_tokens} (the route table packs an expert "
                f"tile in one int32, expert * {TILE_LIMIT} + tile); give the layer a smaller "
                "max_num_tokens, or experts_path='megamoe'"
            )
        self.num_experts, self.first_expert, self.top_k = num_experts, first_expert, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.swiglu_limit = swiglu_limit
        self.max_tokens = max_tokens
        self._expert_bytes = 3 * hidden * intermediate  # block-FP8 w13 and w2 (tiles_for)
        pairs = max_tokens * top_k
        expert_tiles = most_expert_tiles(pairs, num_experts, SMALLEST_BLOCK_M)
        self._table = torch.empty(
            3 * num_experts + 1 + 2 * pairs + TILES_HEADER + expert_tiles,
            dtype=torch.int32,
            device=device,
        )
        self._block_counts = torch.empty(
            2 * cdiv(pairs, COUNT_BLOCK) * num_experts, dtype=torch.int32, device=device
        )
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._x_fp8 = torch.empty(max_tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
        self._x_scale = torch.empty(
            max_tokens, hidden // SCALE_BLOCK, dtype=torch.float32, device=device
        )
        self._act = torch.empty(pairs, intermediate, dtype=torch.float8_e4m3fn, device=device)
        self._act_scale = torch.empty(
            pairs, intermediate // ACT_GROUP, dtype=torch.float32, device=device
        )
        self._rows = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=device)
        # each expert's l1 programs that have written their rows (decode sizes; l2 waits for
        # them, the combine zeroes them): zero between calls
        self._l1_done = torch.zeros(num_experts, dtype=torch.int32, device=device)
        # The constexprs that the layer fixes, made once (eager calls pay host time per
        # launch); the route and place launches' per tile shape on its first call.
        self._experts_pow2 = next_power_of_2(num_experts)
        self._route_c: dict[tuple[bool, Tiles, bool], tuple[int, ...]] = {}
        self._place_c: dict[Tiles, tuple[int, ...]] = {}
        clamp = (swiglu_limit is not None, 0.0 if swiglu_limit is None else swiglu_limit)
        self._l1_c = (num_experts, top_k, hidden, intermediate, *clamp)
        self._l2_c = (num_experts, hidden, intermediate)
        self._combine_c = {
            (pdl, per_expert): (num_experts, top_k, hidden, COMBINE_BLOCK, pdl, per_expert)
            for pdl in (False, True)
            for per_expert in (False, True)
        }

    def tiles(self, tokens: int) -> Tiles:
        """The tile shape a call of ``tokens`` tokens takes (``tiles_for`` of this layer)."""
        return tiles_for(tokens, self.top_k, self.num_experts, self._expert_bytes)

    def _route_constants(self, cast: bool, tiles: Tiles, group: bool) -> tuple[int, ...]:
        """The route launch's constexprs for ``tiles``, made on their first call."""
        constants = self._route_c[(cast, tiles, group)] = (
            self.num_experts, self._experts_pow2, self.hidden, cast, tiles.pdl, group,
            tiles.block_m if group and tiles.persistent else 0,
            COUNT_BLOCK if group and tiles.spread else 0,
        )  # fmt: skip
        return constants

    def _place_constants(self, tiles: Tiles) -> tuple[int, ...]:
        """The place launch's constexprs for ``tiles``, made on their first call."""
        constants = self._place_c[tiles] = (
            self.num_experts, self._experts_pow2, tiles.block_m if tiles.persistent else 0,
            COUNT_BLOCK, tiles.pdl,
        )  # fmt: skip
        return constants

    @property
    def scratch_bytes(self) -> int:
        """Bytes of its scratch: the activations and index tables it holds beside the weights."""
        tensors = (
            self._table, self._block_counts, self._x_fp8, self._x_scale, self._act,
            self._act_scale, self._rows, self._l1_done,
        )  # fmt: skip
        return sum(t.nbytes for t in tensors)

    @staticmethod
    def weights(
        w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor
    ) -> ExpertWeights:
        """A layer's resident tensors as :meth:`forward` reads them (see ``ExpertWeights``)."""
        return ExpertWeights(w13, w13_scale, w2, w2_scale)

    def forward(
        self,
        weights: ExpertWeights,
        hidden_states: torch.Tensor,
        hidden_scale: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' output for ``tokens`` tokens, (tokens, H) bfloat16.

        Args:
            weights: the layer's resident expert tensors (:meth:`weights`).
            hidden_states: (tokens, H) bf16, or FP8 E4M3 already cast by the dispatch rule.
            hidden_scale: None for bf16 tokens; the FP8 tokens' (tokens, H/128) float32.
            topk_weights: (tokens, top_k) float32, contiguous.
            topk_ids: (tokens, top_k) int32 or int64 physical expert ids, contiguous; -1 and
                other ranks' experts are skipped.

        Raises:
            ValueError: more tokens than ``max_tokens``.
        """
        tokens = topk_ids.shape[0]
        if tokens > self.max_tokens:
            raise ValueError(
                f"small-batch experts: {tokens} tokens exceed the {self.max_tokens} its scratch "
                "holds; calls of more tokens take the MegaMoE kernel"
            )
        out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16, device=topk_ids.device)
        if tokens == 0:
            return out
        pairs, index = tokens * self.top_k, topk_ids.device.index
        tiles = self.tiles(tokens)
        cast = hidden_scale is None
        x, x_scale = self._x_fp8, self._x_scale
        if hidden_scale is not None:  # the router wrote FP8 tokens by the same rule
            x, x_scale = hidden_states, hidden_scale
        # l1 and l2 find the pairs themselves: no grouping
        scan = pairs <= SCAN_PAIRS and not tiles.persistent
        if cast or not scan:  # FP8 tokens at scan sizes need no route launch at all
            route_c = self._route_c.get((cast, tiles, not scan)) or self._route_constants(
                cast, tiles, not scan
            )
            casts = cdiv(tokens, CAST_ROWS) * (self.hidden // SCALE_BLOCK) if cast else 0
            # from 512 tokens the grouping is spread: counting programs, then the place launch
            groups = cdiv(pairs, COUNT_BLOCK) if tiles.spread else 1
            _route(
                _key(route_c, topk_ids, hidden_states),
                (groups + casts, 1, 1), index,
                (topk_ids, self._table, self._block_counts, hidden_states, self._x_fp8,
                 self._x_scale, pairs, tokens, self.first_expert),
                route_c, ROUTE_WARPS,
            )  # fmt: skip
            if tiles.spread:
                place_c = self._place_c.get(tiles) or self._place_constants(tiles)
                _place(
                    _key(place_c, topk_ids), (groups, 1, 1), index,
                    (topk_ids, self._table, self._block_counts, pairs, self.first_expert),
                    place_c, ROUTE_WARPS, None, tiles.pdl,
                )  # fmt: skip
        try:
            self._experts(weights, x, x_scale, topk_weights, topk_ids, out, tiles, scan, cast)
        except BaseException:
            # l1 may have counted (l1_done) with no combine after it to zero the counts: a
            # later call's l2 would take them for its own l1's
            self._l1_done.zero_()
            raise
        return out

    def _experts(
        self,
        weights: ExpertWeights,
        x: torch.Tensor,
        x_scale: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor,
        tiles: Tiles,
        scan: bool,
        cast: bool,
    ) -> None:
        """l1, l2 and the combine into ``out``, after the route launch where there is one."""
        w13, w13_scale, w2, w2_scale = weights.w13, weights.w13_scale, weights.w2, weights.w2_scale
        tokens = topk_ids.shape[0]
        pairs, index = tokens * self.top_k, topk_ids.device.index
        l1_columns, l2_columns = self.intermediate // BLOCK_N1, self.hidden // tiles.block_n2
        if tiles.persistent:  # as many items as expert tiles of the call times column tiles
            most = most_expert_tiles(pairs, self.num_experts, tiles.block_m)
            l1_grid = (min(most * l1_columns, self._sms * tiles.l1_per_sm), 1, 1)
            l2_grid = (min(most * l2_columns, self._sms * tiles.l2_per_sm), 1, 1)
            scan_pairs = 16
        else:
            programs = pairs if scan else min(self.num_experts, pairs)
            l1_grid, l2_grid = (l1_columns, programs, 1), (l2_columns, programs, 1)
            scan_pairs = max(16, next_power_of_2(pairs)) if scan else 16
        w13_desc = weights.descriptor("w13", (2 * BLOCK_N1, SCALE_BLOCK))
        w2_desc = weights.descriptor("w2", (tiles.block_n2, ACT_GROUP))
        # l2 waits for each expert's l1 programs (decode grids) where l1 runs in more than
        # one wave of the programs an SM holds (where all run at once they end together:
        # Qwen4-Exp and GLM-5.3-Flash at one token were 0.5% slower with it)
        waves = l1_grid[0] * l1_grid[1] > self._sms * tiles.l1_per_sm
        per_expert = tiles.pdl and not tiles.persistent and waves
        l1_c = (
            *self._l1_c, tiles.block_m, scan, scan_pairs, tiles.pdl, tiles.persistent, per_expert,
            tiles.claim, tiles.token_rows,
        )  # fmt: skip
        l1_pdl = tiles.pdl and (cast or not scan)  # after the route launch, where there is one
        _l1(
            _key((l1_c, tiles, l1_pdl), x, x_scale, w13, w13_scale, topk_weights, topk_ids),
            l1_grid, index,
            (x, x_scale, w13_desc, w13_scale, topk_weights, topk_ids, self._table, self._act,
             self._act_scale, self._l1_done, pairs, self.first_expert),
            l1_c, tiles.warps, tiles.stages, l1_pdl, tiles.max_registers,
        )  # fmt: skip
        l2_c = (
            *self._l2_c, tiles.block_m, tiles.block_n2, tiles.l2_step, scan, scan_pairs,
            tiles.pdl, tiles.persistent, per_expert, tiles.claim, tiles.token_rows,
        )  # fmt: skip
        _l2(
            _key((l2_c, tiles), w2, w2_scale, topk_ids), l2_grid, index,
            (self._act, self._act_scale, w2_desc, w2_scale, topk_ids, self._table, self._rows,
             self._l1_done, pairs, self.first_expert),
            l2_c, tiles.warps, l2_stages(tiles, self.intermediate), tiles.pdl,
            tiles.max_registers,
        )  # fmt: skip
        combine_c = self._combine_c[(tiles.pdl, per_expert)]
        _combine(
            _key(combine_c, topk_ids), (tokens, cdiv(self.hidden, COMBINE_BLOCK), 1),
            index, (self._rows, topk_ids, out, self._l1_done, self.first_expert), combine_c, 4,
            None, tiles.pdl,
        )  # fmt: skip
