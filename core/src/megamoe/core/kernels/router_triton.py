"""A MoE router in one Triton launch: the logits GEMM and the top-k selection together.

Eager engines pay host time for every kernel they launch (10-25 us each on the H200 test
machine), so a router written as torch operations (cast, GEMM, softmax or sigmoid, top-k,
renormalization, cast) costs far more than its GPU work. :class:`TritonRouter` runs it as
one launch:

1. Every program multiplies a (16 tokens x ``BLOCK_E`` experts, or 16 x 64 from 64
   tokens) tile of logits over the hidden size on tensor cores, summing in float32, and
   stores it. Calls with few tokens make few such tiles, so the hidden size is split too
   (about 256 tiles share the weight's read); then each split stores partial sums. A
   float32 weight (GLM's) is split into three bf16 parts (``hi + mid + lo``, the weight to
   2^-24 relative), in registers or given (``router_logits.weight_planes``, kept by the
   GLM router), whose products with the bf16 input are exact, so the logits are as
   accurate as a float32 GEMM's.
2. Programs take their tiles in the order they start (an atomic counter), token block by
   token block, and count themselves in on their block's ticket (release). Up to 16 of a
   block's programs then wait for its ticket to be full (acquire) and select the block's
   rows between them, one row at a time for routers of more than 128 experts, after adding
   the splits in split order (deterministic for a given token count). Only the newest
   block's programs can wait on tiles not yet started, so the launch never needs more
   than 17 programs resident at once. The last program to finish sets every ticket back
   to zero for the next call and every CUDA-graph replay. An earlier version let the last
   program of a block select all its rows alone: 2-4x the GPU time for E >= 256 at 16-128
   tokens on the H200 (docs/gpu.md).

Calls of ``matmul_tokens_for(E)`` tokens or more (256; 64 for routers of 256 experts or
more) take torch's GEMM (cuBLAS) for the logits and launch the selection alone (one
program per row, or per 4 rows of a 64-expert router): there the kernel's tiles took
1.2-1.8x (E=64, 256 tokens) and 1.1-7.3x (E >= 256, 64-255 tokens) the GPU time on the
H200. Eager calls of routers under 256 experts keep the one launch (64-token tiles from
256 tokens) up to 1024 tokens (``matmul_tokens_for(E, eager=True)``): eagerly a call's time
is its host time, which the second launch costs more of than the one launch costs GPU
time; a CUDA graph replays GPU time only, so captures (and ``torch.compile``) switch at
``matmul_tokens``. A float32 weight given with its three bf16 parts takes one bf16
tensor-core GEMM against them, whose three products the selection adds, instead of a
float32 GEMM of widened activations. After a variant's first call the launch skips Triton's JIT
(``kernels.launch.KernelLaunch``): 47 instead of 89 us of host time per call there.

Selection (:func:`select_experts`, a few rows at once, each token's row a (groups x
experts per group) tile in registers) has two scorings:

- ``SCORE_SOFTMAX`` (Qwen-style): the top-k logits; weights ``softmax`` of the chosen
  logits when renormalizing, else the chosen experts' softmax probabilities over all.
- ``SCORE_SIGMOID`` (DeepSeek/GLM-style): sigmoid scores plus a selection bias, groups
  scored by their two best biased scores, the best groups kept, the top-k among them;
  weights the unbiased scores (divided by their sum plus ``NORM_EPS`` when renormalizing)
  times ``routed_scaling_factor``. Bit for bit with the torch expression given the same
  logits: torch's CUDA sigmoid, keys ordered as torch sorts floats (NaN largest), ties to
  the lower index; only the renormalizing sum may add in another order.

Order and ties are decided on integer keys: each float maps to an int32 in float order
(every NaN above +inf), packed with the reversed index into one int64, so a max reduction
picks the largest value and, among equal values, the lowest index. The chosen experts come
out in decreasing key order.

The logits are sums in float32 whose order differs from cuBLAS's, as cuBLAS's own order
differs between shapes; the adapters' GPU tests bound them against float64.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megamoe.core.kernels.launch import ALIGNMENT, KernelLaunch, cdiv, eager_key, next_power_of_2
from megamoe.core.numerics.dispatch import DISPATCH_AMAX_FLOOR, DISPATCH_GROUP, DispatchBuffer
from megamoe.core.numerics.quant import E4M3_MAX
from megamoe.core.numerics.router_logits import PLANES, router_logits

__all__ = [
    "LAUNCH_SHAPES",
    "MAX_EXPERTS",
    "MAX_GROUPS",
    "MAX_TOP_K",
    "NORM_EPS",
    "SCORE_SIGMOID",
    "SCORE_SOFTMAX",
    "LaunchShape",
    "TritonRouter",
    "covers",
    "matmul_tokens_for",
    "ticket_buffer",
]

SCORE_SOFTMAX = 0
SCORE_SIGMOID = 1
NORM_EPS = 1e-20  # the sigmoid scoring's renormalization epsilon (DeepSeek-V3, GLM)
MAX_EXPERTS = 512  # the largest router a token's row holds in registers (Qwen4-Exp's E)
MAX_TOP_K = 16
MAX_GROUPS = 16
BLOCK_T = 16  # tokens per program at least: the smallest tl.dot tile (and a ticket's block)
BLOCK_E = 32  # experts per program
SPLIT_PROGRAMS = 256  # about two programs per SM of an H100/H200 (132 SMs)
# Hidden-size splits at most (their partial sums cost a pass each). Against 16, on the
# H200: an E=64 float32 router takes one step per tile (~1.6 us each) for 16 more partial
# sums, 0.5-1.3 us less GPU time at 1-128 tokens; DeepSeek-V3's E=256 two steps instead of
# four, 1.7 us less at 1-16 tokens; GLM-5.3-Flash, Qwen4-Exp and bf16 E=64 unchanged
# within 0.1 us (docs/gpu.md).
MAX_SPLITS = 32
COUNTERS = 2  # the tickets' first entries: tiles started, programs finished
MAX_WAITERS = 16  # programs of a token block that wait for its sums and select its rows
SELECT_ENTRIES = 256  # a selection step's tile at most: rows times a token's entries
_KEY_NAN = tl.constexpr(0x7FFFFFFF)  # int32 key of every NaN: above +inf's 0x7F800000
_LOW_MAX = tl.constexpr(0x7FFFFFFF)  # a packed key's low word: index ^ _LOW_MAX
_MASKED = tl.constexpr(-(2**63))  # packed key of a padded, excluded or chosen entry
_COUNTERS = tl.constexpr(COUNTERS)
_MAX_WAITERS = tl.constexpr(MAX_WAITERS)
_NORM_EPS = tl.constexpr(NORM_EPS)
_CAST_COLS = tl.constexpr(1024)  # columns per step of the dispatch's FP8 cast
_DISPATCH_GROUP = tl.constexpr(DISPATCH_GROUP)
_AMAX_FLOOR = tl.constexpr(DISPATCH_AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)  # bf16: one product; float32: three


def covers(num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether the kernel handles this router (E <= 512, top-k <= 16, at most 16 groups)."""
    return num_experts <= MAX_EXPERTS and top_k <= MAX_TOP_K and n_group <= MAX_GROUPS


@triton.jit
def _float_to_key(value: tl.tensor) -> tl.tensor:
    """int32 keys in float order, every NaN above +inf (-0.0 just below +0.0)."""
    bits = value.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(value != value, _KEY_NAN, key)


@triton.jit
def _key_to_float(key: tl.tensor) -> tl.tensor:
    """Inverse of ``_float_to_key`` (a NaN comes back as a NaN)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pack(key: tl.tensor, index: tl.tensor) -> tl.tensor:
    """One int64 whose order is (key, then lower index first)."""
    # index ^ 0x7FFFFFFF is 0x7FFFFFFF - index: larger for a lower index, never negative.
    return (key.to(tl.int64) << 32) | (index ^ _LOW_MAX).to(tl.int64)


@triton.jit
def _sigmoid(logit: tl.tensor) -> tl.tensor:
    """Torch's CUDA float32 sigmoid, ``1 / (1 + expf(-x))``, correctly rounded division."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-logit))


@triton.jit
def select_experts(
    logits_ptr: tl.tensor,
    NUM_EXPERTS: tl.constexpr,
    bias_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    first_token: tl.tensor,
    num_tokens: tl.tensor,
    SCALE: tl.constexpr,
    SCORE: tl.constexpr,
    PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    DISPATCH: tl.constexpr,
    dispatch_weights_ptr: tl.tensor,
    dispatch_ids_ptr: tl.tensor,
) -> None:
    """Route tokens ``first_token .. + ROWS`` (those below ``num_tokens``) at once.

    Each token's logits row (contiguous (T, NUM_EXPERTS) logits) is a (groups x experts
    per group) tile; the tiles of the ROWS tokens stack into one (ROWS, BLOCK_G, BLOCK_J)
    block, reduced along its last axes. With ``DISPATCH`` the weights and the ids (int64)
    go to the kernel's input buffer instead of ``weights_ptr`` and ``ids_ptr`` (unused).
    """
    token = first_token + tl.arange(0, ROWS).to(tl.int64)
    token_ok = token < num_tokens
    group = tl.arange(0, BLOCK_G)
    member = tl.arange(0, BLOCK_J)
    expert = group[:, None] * PER_GROUP + member[None, :]
    in_row = (group[:, None] < N_GROUP) & (member[None, :] < PER_GROUP)
    valid = token_ok[:, None, None] & in_row[None, :, :]
    row = logits_ptr + token * NUM_EXPERTS
    # .cg: other programs wrote these rows; read them from L2, never a stale L1 line.
    logit = tl.load(row[:, None, None] + expert[None, :, :], mask=valid, other=0.0,
                    cache_modifier=".cg")  # fmt: skip
    if SCORE == 1:
        bias = tl.load(bias_ptr + expert, mask=in_row, other=0.0)
        keyed = _sigmoid(logit) + bias[None, :, :]
    else:
        keyed = logit
    packed = tl.where(valid, _pack(_float_to_key(keyed), expert[None, :, :]), _MASKED)

    if TOPK_GROUP < N_GROUP:
        # A group scores its two best biased scores added; keys are unique, so removing
        # the best one entry leaves the second even when the two are equal.
        best = tl.max(packed, axis=2)
        second = tl.max(tl.where(packed == best[:, :, None], _MASKED, packed), axis=2)
        group_sum = _key_to_float((best >> 32).to(tl.int32)) + _key_to_float(
            (second >> 32).to(tl.int32)
        )
        group_valid = (group < N_GROUP)[None, :]
        group_packed = tl.where(
            group_valid, _pack(_float_to_key(group_sum), group[None, :]), _MASKED
        )
        # Rank of each group: how many groups beat it; the TOPK_GROUP lowest ranks stay.
        beats = group_packed[:, None, :] > group_packed[:, :, None]
        beaten_by = tl.sum(beats.to(tl.int32), axis=2)
        kept = group_valid & (beaten_by < TOPK_GROUP)
        packed = tl.where(kept[:, :, None], packed, _MASKED)

    slot = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(packed, axis=2), axis=1)
        ids = tl.where(slot == i, best[:, None].to(tl.int32) ^ _LOW_MAX, ids)
        packed = tl.where(packed == best[:, None, None], _MASKED, packed)

    out_ok = token_ok[:, None] & (slot < TOP_K)
    chosen = tl.load(row[:, None] + ids, mask=out_ok, other=0.0, cache_modifier=".cg")
    if SCORE == 1:
        # The chosen experts' unbiased scores, recomputed from their logits: the same bits.
        weights = tl.where(out_ok, _sigmoid(chosen), 0.0)
        if NORM_TOPK_PROB:
            total = tl.sum(weights, axis=1)[:, None] + _NORM_EPS
            weights = tl.math.div_rn(weights, total)
        weights = weights * SCALE
    else:
        top = tl.max(tl.max(tl.where(valid, logit, -float("inf")), axis=2), axis=1)
        exps = tl.where(out_ok, libdevice.exp(chosen - top[:, None]), 0.0)
        if NORM_TOPK_PROB:
            total = tl.sum(exps, axis=1)
        else:
            every = tl.where(valid, libdevice.exp(logit - top[:, None, None]), 0.0)
            total = tl.sum(tl.sum(every, axis=2), axis=1)
        weights = tl.math.div_rn(exps, tl.where(token_ok, total, 1.0)[:, None])
    out = token[:, None] * TOP_K + slot
    if DISPATCH:
        tl.store(dispatch_weights_ptr + out, weights, mask=out_ok)
        tl.store(dispatch_ids_ptr + out, ids.to(tl.int64), mask=out_ok)
    else:
        tl.store(weights_ptr + out, weights, mask=out_ok)
        tl.store(ids_ptr + out, ids, mask=out_ok)


@triton.jit
def _write_dispatch(
    x_ptr: tl.tensor,
    dispatch_x_ptr: tl.tensor,
    dispatch_scale_ptr: tl.tensor,
    dispatch_weights_ptr: tl.tensor,
    dispatch_ids_ptr: tl.tensor,
    num_tokens: tl.tensor,
    rows: tl.tensor,
    program: tl.tensor,
    programs: tl.tensor,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
) -> None:
    """This program's share of the Hopper kernel's inputs (``backends.base.DispatchBuffer``).

    Tokens in ``CAST_COLS``-column pieces, program ``program`` of ``programs`` taking
    every ``programs``-th piece: each 128 columns' scale ``max(amax, 1e-10) / 448`` and the
    values times ``1 / scale`` rounded to E4M3, both divisions exact (DeepGEMM's
    pre-dispatch bits). Then its share of the padding: id -1 and weight 0 in every slot of
    rows ``num_tokens .. rows``.
    """
    groups: tl.constexpr = HIDDEN // _DISPATCH_GROUP
    per_piece: tl.constexpr = _CAST_COLS // _DISPATCH_GROUP
    pieces: tl.constexpr = (HIDDEN + _CAST_COLS - 1) // _CAST_COLS
    column = tl.arange(0, _CAST_COLS)
    for piece in range(program, num_tokens * pieces, programs):
        token = (piece // pieces).to(tl.int64)
        first_group = (piece % pieces) * per_piece
        cols = first_group * _DISPATCH_GROUP + column
        cols_ok = cols < HIDDEN
        x = tl.load(x_ptr + token * HIDDEN + cols, mask=cols_ok, other=0.0).to(tl.float32)
        grouped = tl.reshape(x, (per_piece, _DISPATCH_GROUP))
        amax = tl.maximum(tl.max(tl.abs(grouped), axis=1), _AMAX_FLOOR)
        scale = tl.math.div_rn(amax, _E4M3_MAX)
        values = tl.reshape(grouped * tl.math.div_rn(1.0, scale)[:, None], (_CAST_COLS,))
        tl.store(dispatch_x_ptr + token * HIDDEN + cols, values.to(tl.float8e4nv), mask=cols_ok)
        group = first_group + tl.arange(0, per_piece)
        tl.store(dispatch_scale_ptr + token * groups + group, scale, mask=group < groups)
    slots_end = rows * TOP_K
    slot = tl.arange(0, _CAST_COLS)
    for at in range(num_tokens * TOP_K + program * _CAST_COLS, slots_end, programs * _CAST_COLS):
        index = at + slot
        index_ok = index < slots_end
        tl.store(dispatch_ids_ptr + index, tl.full([_CAST_COLS], -1, tl.int64), mask=index_ok)
        tl.store(dispatch_weights_ptr + index, tl.zeros([_CAST_COLS], tl.float32), mask=index_ok)


@triton.jit
def _add_splits(
    partial_ptr: tl.tensor,
    logits_ptr: tl.tensor,
    first_token: tl.tensor,
    num_tokens: tl.tensor,
    splits: tl.tensor,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
) -> None:
    """Logits of tokens ``first_token .. + ROWS``: their splits' partial sums, in order."""
    token = first_token + tl.arange(0, ROWS).to(tl.int64)
    expert = tl.arange(0, E_PAD)
    ok = (token < num_tokens)[:, None] & (expert < NUM_EXPERTS)[None, :]
    at = token[:, None] * NUM_EXPERTS + expert[None, :]
    total = tl.zeros([ROWS, E_PAD], dtype=tl.float32)
    for split in range(0, splits):
        plane = tl.cast(split, tl.int64) * num_tokens * NUM_EXPERTS  # num_tokens may be 1
        total += tl.load(partial_ptr + plane + at, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(logits_ptr + at, total, mask=ok)
    tl.debug_barrier()  # the selection reads these rows back


@triton.jit
def _add_planes(
    stacked_ptr: tl.tensor,
    logits_ptr: tl.tensor,
    first_token: tl.tensor,
    num_tokens: tl.tensor,
    PLANES: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
) -> None:
    """Logits of tokens ``first_token .. + ROWS`` from stacked (T, PLANES * E) products.

    Each row is ``[x.hi | x.mid | x.lo]`` of a split float32 weight, added in that order.
    """
    token = first_token + tl.arange(0, ROWS).to(tl.int64)
    expert = tl.arange(0, E_PAD)
    ok = (token < num_tokens)[:, None] & (expert < NUM_EXPERTS)[None, :]
    source = stacked_ptr + token[:, None] * (PLANES * NUM_EXPERTS) + expert[None, :]
    total = tl.zeros([ROWS, E_PAD], dtype=tl.float32)
    for plane in tl.static_range(PLANES):
        total += tl.load(source + plane * NUM_EXPERTS, mask=ok, other=0.0)
    tl.store(logits_ptr + token[:, None] * NUM_EXPERTS + expert[None, :], total, mask=ok)
    tl.debug_barrier()  # the selection reads these rows back


@triton.jit(do_not_specialize=["num_tokens", "split_size", "dispatch_rows"])
def _route_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    logits_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    tickets_ptr: tl.tensor,
    partial_ptr: tl.tensor,
    dispatch_x_ptr: tl.tensor,
    dispatch_scale_ptr: tl.tensor,
    dispatch_weights_ptr: tl.tensor,
    dispatch_ids_ptr: tl.tensor,
    num_tokens: tl.tensor,
    split_size: tl.tensor,
    dispatch_rows: tl.tensor,
    HIDDEN: tl.constexpr,
    GIVEN_LOGITS: tl.constexpr,
    GIVEN_PLANES: tl.constexpr,
    SPLIT_FP32: tl.constexpr,
    WEIGHT_PLANES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCORE: tl.constexpr,
    PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SEL_ROWS: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DISPATCH: tl.constexpr,
) -> None:
    """One (ROWS x COLS) tile of a hidden-size split's logits, then a share of the selection.

    Programs take their tile in the order they start (the dispatch counter, ticket 0), block
    by block: tile ``d`` is token block ``d // P``, column tile and split within it, P the
    block's tiles. A tile sums hidden indices ``split * split_size`` up to the next split's,
    from the bf16 weight, a float32 one split in registers (``SPLIT_FP32``) or its bf16
    parts (``WEIGHT_PLANES``: ``w_ptr`` is (3E, H), hi, mid, lo; the same products). With
    ``SPLIT_K`` it stores partial sums (``partial_ptr``, (splits, T, E)), else the logits
    (``partial_ptr`` is then unused: never an alias of a written argument, which
    ``torch.compile`` would clone apart). Then it counts itself in on its block's ticket.

    The block's first ``min(P, MAX_WAITERS)`` tiles then wait for the ticket to reach P and
    select the block's rows, SEL_ROWS at a time, taking row groups in turn (adding the splits in
    split order first: deterministic for a given token count). Only the newest block's
    tiles can wait on tiles not yet started, and at most ``MAX_WAITERS`` of them, so the
    launch needs that many programs resident at once. The last program to finish (ticket
    1) sets every ticket back to zero for the next call and every CUDA-graph replay.

    ``GIVEN_LOGITS`` skips the GEMM: program p selects rows ``p * ROWS ..`` (ROWS ==
    SEL_ROWS; with ``DISPATCH`` there are at least ``SPLIT_PROGRAMS``, the ones past the
    last row only casting); with ``GIVEN_PLANES`` > 1 the given products are the
    (T, GIVEN_PLANES * E) ``partial_ptr``, added into the logits first (``_add_planes``).
    Inputs are contiguous.

    With ``DISPATCH`` the programs also write the Hopper MegaMoE kernel's inputs
    (``_write_dispatch``, ``dispatch_rows`` rows; the selection adds the routing), between
    their tile and their wait. Unused pointer arguments are the activations (read only).
    """
    num_experts: tl.constexpr = N_GROUP * PER_GROUP
    if GIVEN_LOGITS:
        first = tl.program_id(0) * ROWS
        if DISPATCH:
            _write_dispatch(x_ptr, dispatch_x_ptr, dispatch_scale_ptr, dispatch_weights_ptr,
                            dispatch_ids_ptr, num_tokens, dispatch_rows, tl.program_id(0),
                            tl.num_programs(0), HIDDEN, TOP_K)  # fmt: skip
        if GIVEN_PLANES > 1:
            _add_planes(partial_ptr, logits_ptr, first, num_tokens, GIVEN_PLANES,
                        num_experts, E_PAD, ROWS)  # fmt: skip
        select_experts(
            logits_ptr, num_experts, bias_ptr, weights_ptr, ids_ptr, first, num_tokens,
            SCALE, SCORE, PER_GROUP, N_GROUP, TOPK_GROUP, TOP_K, NORM_TOPK_PROB,
            BLOCK_G, BLOCK_J, BLOCK_K, ROWS, DISPATCH, dispatch_weights_ptr, dispatch_ids_ptr,
        )  # fmt: skip
    else:
        column_tiles: tl.constexpr = (num_experts + COLS - 1) // COLS
        splits = tl.cdiv(HIDDEN, split_size)
        per_block = column_tiles * splits
        tile_id = tl.atomic_add(tickets_ptr, 1, sem="relaxed")
        block = tile_id // per_block
        within = tile_id % per_block
        rows = block * ROWS + tl.arange(0, ROWS)
        cols = (within // splits) * COLS + tl.arange(0, COLS)
        split = within % splits
        row_ok, col_ok = rows < num_tokens, cols < num_experts
        h_begin = split * split_size
        h_end = tl.minimum(h_begin + split_size, HIDDEN)
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        for h0 in range(h_begin, h_end, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < h_end
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * HIDDEN + hs[None, :],
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            w_mask = col_ok[:, None] & h_ok[None, :]
            if WEIGHT_PLANES:
                for part in tl.static_range(3):
                    w = tl.load(
                        w_ptr + (part * num_experts + cols)[:, None] * HIDDEN + hs[None, :],
                        mask=w_mask,
                        other=0.0,
                    )
                    acc = tl.dot(x, tl.trans(w), acc)
            else:
                w = tl.load(w_ptr + cols[:, None] * HIDDEN + hs[None, :], mask=w_mask, other=0.0)
                if SPLIT_FP32:
                    # w = hi + mid + lo, three bf16 parts (to 2^-24 relative): bf16 x times
                    # each is exact in float32, so three tensor-core products sum to x * w.
                    hi = w.to(tl.bfloat16)
                    rest = w - hi.to(tl.float32)
                    mid = rest.to(tl.bfloat16)
                    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                    acc = tl.dot(x, tl.trans(hi), acc)
                    acc = tl.dot(x, tl.trans(mid), acc)
                    acc = tl.dot(x, tl.trans(lo), acc)
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
        tile = rows[:, None].to(tl.int64) * num_experts + cols[None, :]
        tile_ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT_K:
            plane = split.to(tl.int64) * num_tokens * num_experts
            tl.store(partial_ptr + plane + tile, acc, mask=tile_ok)
        else:
            tl.store(logits_ptr + tile, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's sums are written before the ticket is taken
        block_ticket = tickets_ptr + _COUNTERS + block
        tl.atomic_add(block_ticket, 1, sem="release")
        if DISPATCH:
            _write_dispatch(x_ptr, dispatch_x_ptr, dispatch_scale_ptr, dispatch_weights_ptr,
                            dispatch_ids_ptr, num_tokens, dispatch_rows, tile_id,
                            tl.num_programs(0), HIDDEN, TOP_K)  # fmt: skip
        groups: tl.constexpr = ROWS // SEL_ROWS
        block_first = block * ROWS
        waiters = tl.minimum(per_block, _MAX_WAITERS)
        selects = (within < waiters) & (within < groups)
        if selects & (block_first + within * SEL_ROWS < num_tokens):
            arrived = tl.atomic_add(block_ticket, 0, sem="acquire")
            while arrived < per_block:
                arrived = tl.atomic_add(block_ticket, 0, sem="acquire")
            tl.debug_barrier()  # no thread reads the block's sums before the wait ends
            for group in range(within, groups, waiters):
                first = block_first + group * SEL_ROWS
                if first < num_tokens:
                    if SPLIT_K:
                        _add_splits(partial_ptr, logits_ptr, first, num_tokens, splits,
                                    num_experts, E_PAD, SEL_ROWS)  # fmt: skip
                    select_experts(
                        logits_ptr, num_experts, bias_ptr, weights_ptr, ids_ptr, first,
                        num_tokens, SCALE, SCORE, PER_GROUP, N_GROUP, TOPK_GROUP, TOP_K,
                        NORM_TOPK_PROB, BLOCK_G, BLOCK_J, BLOCK_K, SEL_ROWS, DISPATCH,
                        dispatch_weights_ptr, dispatch_ids_ptr,
                    )  # fmt: skip
        finished = tl.atomic_add(tickets_ptr + 1, 1, sem="acq_rel")
        if finished == tl.num_programs(0) - 1:
            used = _COUNTERS + tl.cdiv(num_tokens, ROWS)
            for at in range(0, used, 128):
                index = at + tl.arange(0, 128)
                tl.store(tickets_ptr + index, 0, mask=index < used)


_launch = KernelLaunch(_route_kernel, runtime_args=15)


def matmul_tokens_for(num_experts: int, eager: bool = False) -> int:
    """From how many tokens a router of ``num_experts`` takes cuBLAS's logits.

    ``eager``: for calls outside a CUDA-graph capture and ``torch.compile``
    (``EAGER_MATMUL_TOKENS`` for routers under ``LARGE_ROUTER`` experts).
    """
    if num_experts >= LARGE_ROUTER:
        return LARGE_MATMUL_TOKENS
    return EAGER_MATMUL_TOKENS if eager else MATMUL_TOKENS


def ticket_buffer(max_num_tokens: int, device: torch.device | str | None) -> torch.Tensor:
    """The zeroed int32 tickets a router's calls of up to ``max_num_tokens`` tokens use.

    Two counters, then one ticket per 16-token block. Every launch leaves them zero again.
    One call at a time per buffer (one stream).
    """
    blocks = cdiv(max(max_num_tokens, 1), BLOCK_T)
    return torch.zeros(COUNTERS + blocks, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class LaunchShape:
    """How calls of ``min_tokens`` tokens and more (up to the next shape's) are tiled.

    Attributes:
        min_tokens: the smallest call this shape serves.
        rows: tokens per GEMM tile (a multiple of 16), and per ticket's token block.
        cols: experts per GEMM tile.
        block_h: hidden indices per step with a bf16 weight (a float32 one, or its parts,
            take half).
        programs: the hidden size is split (up to ``MAX_SPLITS``) until about this many
            tiles share the weight's read.
        select_entries: a selection step's tile at most, rows times a token's entries
            (one row at least).
        num_warps: the launch's warps.
    """

    min_tokens: int
    rows: int = BLOCK_T
    cols: int = BLOCK_E
    block_h: int = 256
    programs: int = SPLIT_PROGRAMS
    select_entries: int = SELECT_ENTRIES
    num_warps: int = 4


# Under 64 tokens 32-expert tiles, from 64 on 64-expert ones (routers under 256 experts;
# the larger take cuBLAS's logits there): on the H200 within 1.2 us of the 32-expert tiles
# for E=64 at 64-128 tokens, faster at 255. Both step 256 hidden indices (128 of a float32
# weight's parts): against 128, graphed on the H200 at 1-63 tokens, 1-4 us faster for GLM
# (E=288) and DeepSeek-V3 (E=256), 1.8 us for an E=64 float32 router, 1.1-1.2 us at
# 128-255 tokens, equal for the bf16 ones (Qwen4-Exp, E=64); 512 was slower (docs/gpu.md).
# From 256 tokens (eager calls only, ``EAGER_MATMUL_TOKENS``) 64-token by 32-expert tiles:
# of seven tilings tried on the H200 the fastest for E=64 at 256-1024 tokens, bf16 and
# float32 alike (GLM's float32 router 13.6 / 17.2 / 25.9 us at 256 / 512 / 1024 against
# 15.8 / 23.9 / 39.3 with the 16-token tiles).
LAUNCH_SHAPES = (LaunchShape(1), LaunchShape(64, cols=64), LaunchShape(256, rows=64))
# From this many tokens a call takes torch's GEMM (cuBLAS) for the logits and launches the
# selection alone; from 64 for routers of 256 experts or more, whose weight the kernel's
# 16-token tiles read once per 16 tokens. On the H200 the kernel took 1.2-1.8x the GPU time
# of cuBLAS's GEMM and the selection there at 256 tokens (E=64), and 1.1-7.3x at 64-255
# tokens for E >= 256 (docs/gpu.md): more than the second launch's host time.
MATMUL_TOKENS = 256
LARGE_ROUTER = 256  # experts
LARGE_MATMUL_TOKENS = 64
# Eager calls of routers under 256 experts keep the one launch up to 1024 tokens: eagerly
# the router's time is its host time, and there the second launch (cuBLAS's, 17-38 us of
# host time on the H200 test machines) costs more than the one launch's extra GPU time
# (GLM's E=64 float32 router, graphed: 13.6 / 17.2 / 25.9 against 12.1 / 15.1 / 19.4 us at
# 256 / 512 / 1024 tokens; host: 30-34 against 60-98 us a call). Graph captures and
# torch.compile take cuBLAS's logits from ``MATMUL_TOKENS`` as before: what a replay
# costs is GPU time only. Routers of 256 experts or more gain nothing (their one launch
# took 2-30x the GPU time from 64 tokens).
EAGER_MATMUL_TOKENS = 1025
# How a launch reads the router weight: bf16 (one product), float32 split into three bf16
# parts in registers, or those parts given (``router_logits.weight_planes``, (3E, H)).
WEIGHT_BF16, WEIGHT_FP32, WEIGHT_PLANES = 0, 1, 2
# Call sizes whose scratch views, and whose dispatch-buffer views, a router keeps (each a
# few hundred bytes; an engine's eager calls come in a few sizes; a full set starts over).
KEPT_VIEWS = 256


class _Plan(NamedTuple):
    """One call size's launch: grid, split size, constants and the variant they make."""

    grid: tuple[int, int, int]
    split_size: int
    splits: int
    rows: int
    constexprs: tuple[Any, ...]
    num_warps: int
    variant: tuple[Any, ...]


def _variant(plan: _Plan, *inputs: torch.Tensor) -> Hashable | None:
    """The launch's key (``launch.eager_key``), or None for the JIT.

    Beside the device: every constexpr and the warps (``plan.variant``) and the last
    input's dtype (the bias's, or the weight standing in for it; the other dtypes are
    checked or fixed by the constexprs).
    """
    return eager_key((plan.variant, inputs[-1].dtype), *inputs)


@dataclass(frozen=True)
class TritonRouter:
    """One router's settings, checked once; calls launch the kernel.

    Attributes:
        score: ``SCORE_SOFTMAX`` or ``SCORE_SIGMOID``.
        num_experts: E.
        top_k: experts per token.
        norm_topk_prob: renormalize the chosen weights.
        n_group: router groups (``SCORE_SIGMOID``; 1 for no group limit).
        topk_group: groups kept per token.
        routed_scaling_factor: weight multiplier (``SCORE_SIGMOID``).
        shapes: the launch shapes by call size (``LAUNCH_SHAPES``; benchmarks try others).
        matmul_tokens: calls of this many tokens or more compute the logits with torch's
            GEMM, then launch the selection alone (``matmul_tokens_for(num_experts)``,
            derived), while a CUDA graph is captured or ``torch.compile`` traces.
        eager_matmul_tokens: the same for eager calls (``matmul_tokens_for(num_experts,
            eager=True)``, derived: 1025 under 256 experts, else ``matmul_tokens``). Eager
            and graphed calls of a size between the two sum the logits in different orders,
            so their routing may differ where two experts' logits tie to float32 rounding.

    Raises:
        ValueError: settings :func:`covers` rejects, an unknown scoring, or launch shapes
            whose first does not serve 1 token.
    """

    score: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shapes: tuple[LaunchShape, ...] = LAUNCH_SHAPES
    matmul_tokens: int = field(init=False, compare=False)
    eager_matmul_tokens: int = field(init=False, compare=False)
    _plans: dict[tuple[int, int, int, int, bool], _Plan] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    _shared_plans: dict[tuple[LaunchShape, int, int, int, int, bool], _Plan] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    _fitting: dict[int, DispatchBuffer] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    _views: dict[type, tuple[Any, dict[Hashable, tuple[Any, ...]]]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.score not in (SCORE_SOFTMAX, SCORE_SIGMOID):
            raise ValueError(f"router (triton): score={self.score}, expected 0 or 1")
        if not covers(self.num_experts, self.top_k, self.n_group):
            raise ValueError(
                f"router (triton): E={self.num_experts}, top_k={self.top_k}, "
                f"n_group={self.n_group} exceed the kernel's E <= {MAX_EXPERTS}, top_k <= "
                f"{MAX_TOP_K}, n_group <= {MAX_GROUPS}; use the torch path"
            )
        # frozen: the derived field is set once, here
        object.__setattr__(self, "matmul_tokens", matmul_tokens_for(self.num_experts))
        object.__setattr__(
            self, "eager_matmul_tokens", matmul_tokens_for(self.num_experts, eager=True)
        )
        first = self.shapes[0].min_tokens if self.shapes else None
        if first != 1:
            raise ValueError(
                f"router (triton): the launch shapes start at {first} tokens; the first "
                "must serve calls of 1 token (min_tokens=1)"
            )

    def _shape(self, tokens: int) -> LaunchShape:
        """The launch shape of a call of ``tokens`` tokens (branches: dynamo guards on them)."""
        chosen = self.shapes[0]
        for shape in self.shapes[1:]:
            if tokens >= shape.min_tokens:
                chosen = shape
        return chosen

    def _plan(self, tokens: int, hidden: int, weight: int, given: int, dispatch: bool) -> _Plan:
        """The launch of a call: its shape, hidden-size splits and constants.

        ``weight``: ``WEIGHT_BF16``, ``WEIGHT_FP32`` or ``WEIGHT_PLANES``. ``given``: 0 for
        the kernel's own GEMM; else the selection alone, on logits given as that many
        planes of products (1: the logits themselves), planned for 1 token (its programs
        are one selection step's rows each; the caller sizes the grid). ``dispatch``: the
        launch also writes a ``DispatchBuffer`` (of ``hidden`` columns).
        """
        shape = self._shape(tokens)
        per_group = self.num_experts // self.n_group
        block_g, block_j = next_power_of_2(self.n_group), next_power_of_2(per_group)
        entries = block_g * block_j  # one token's selection entries
        sel_rows = max(1, min(shape.rows, shape.select_entries // entries))
        block_h = shape.block_h if weight == WEIGHT_BF16 else shape.block_h // 2
        if given:
            rows, splits, split_size, block_h = sel_rows, 1, 0, 16
            hidden = hidden if dispatch else 1  # the selection reads no activations
            grid = (1, 1, 1)  # the caller's: one program per ``rows`` tokens
        else:
            # Few tiles: split the hidden size too, so that about ``shape.programs`` tiles
            # share the weight's read.
            rows = shape.rows
            blocks = cdiv(tokens, rows)
            column_tiles = cdiv(self.num_experts, shape.cols)
            chunks = cdiv(hidden, block_h)
            wanted = max(1, min(MAX_SPLITS, shape.programs // (blocks * column_tiles), chunks))
            split_size = cdiv(chunks, wanted) * block_h
            splits = cdiv(hidden, split_size)
            grid = (blocks * column_tiles * splits, 1, 1)
        split_k = splits > 1
        values = {
            "HIDDEN": hidden,
            "GIVEN_LOGITS": given > 0,
            "GIVEN_PLANES": given,
            "SPLIT_FP32": weight == WEIGHT_FP32,
            "WEIGHT_PLANES": weight == WEIGHT_PLANES,
            "SPLIT_K": split_k,
            "BLOCK_H": block_h,
            "SCORE": self.score,
            "PER_GROUP": per_group,
            "N_GROUP": self.n_group,
            "TOPK_GROUP": self.topk_group,
            "TOP_K": self.top_k,
            "NORM_TOPK_PROB": self.norm_topk_prob,
            "SCALE": float(self.routed_scaling_factor),
            "BLOCK_G": block_g,
            "BLOCK_J": block_j,
            "BLOCK_K": next_power_of_2(self.top_k),
            "SEL_ROWS": sel_rows,
            "E_PAD": next_power_of_2(self.num_experts),
            "ROWS": rows,
            "COLS": shape.cols,
            "DISPATCH": dispatch,
        }
        constexprs = _launch.constexprs(values)
        warps = shape.num_warps
        return _Plan(grid, split_size, splits, rows, constexprs, warps, (*constexprs, warps))

    def _cached_plan(
        self, tokens: int, hidden: int, weight: int, given: int, dispatch: bool
    ) -> _Plan:
        """:meth:`_plan`, kept in eager mode (dynamo traces it instead).

        Looked up by call size first. A plan depends on the call size only through its
        launch shape and token blocks, so call sizes share one plan per (shape, blocks).
        Fused calls are below ``eager_matmul_tokens`` and the selection alone is planned
        for 1 token (its grid is the caller's), so both caches stay small.
        """
        if torch.compiler.is_compiling():
            return self._plan(tokens, hidden, weight, given, dispatch)
        by_size = (tokens, hidden, weight, given, dispatch)
        plan = self._plans.get(by_size)
        if plan is None:
            shape = self._shape(tokens)
            blocks = cdiv(tokens, shape.rows)
            by_blocks = (shape, blocks, hidden, weight, given, dispatch)
            plan = self._shared_plans.get(by_blocks)
            if plan is None:
                plan = self._shared_plans[by_blocks] = self._plan(*by_size)
            self._plans[by_size] = plan
        return plan

    def scratch_floats(self, max_num_tokens: int, hidden: int) -> int:
        """float32 entries a :meth:`route` ``scratch`` needs for calls of up to that many tokens.

        What the one launch writes besides its outputs, for calls under
        ``eager_matmul_tokens``: the logits, then (16-byte aligned) the hidden-size splits'
        partial sums, at the largest token count of each launch shape and token-block
        count, for any weight (bf16, float32 or its parts). Larger calls take fresh tensors.
        """
        most = 0
        fused = min(max_num_tokens, self.eager_matmul_tokens - 1)
        for shape_index, shape in enumerate(self.shapes):
            ends = [s.min_tokens - 1 for s in self.shapes[shape_index + 1 :]] + [fused]
            first, last = shape.min_tokens, min(ends[0], fused)
            # The largest call of each token-block count from ``first`` to ``last``.
            for blocks in range(cdiv(first, shape.rows), cdiv(last, shape.rows) + 1):
                tokens = min(blocks * shape.rows, last)
                for kind in (WEIGHT_BF16, WEIGHT_FP32, WEIGHT_PLANES):
                    splits = self._plan(tokens, hidden, kind, 0, False).splits
                    most = max(most, _scratch_end(tokens * self.num_experts, splits))
        return most

    def route(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        tickets: torch.Tensor,
        bias: torch.Tensor | None = None,
        planes: torch.Tensor | None = None,
        dispatch: DispatchBuffer | None = None,
        scratch: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``hidden_states`` (T, H) bf16 with ``weight`` (E, H), bf16 or float32.

        Args:
            hidden_states: bf16 activations on CUDA (made contiguous if they are not).
            weight: the router weight, contiguous (bf16: one tensor-core product; float32:
                three, of its exact bf16 parts).
            tickets: :func:`ticket_buffer` for at least T tokens (used by one call at a time).
            bias: (E,) float32 selection bias (``SCORE_SIGMOID``), else None.
            planes: ``router_logits.weight_planes`` of a float32 ``weight``, or None. The
                kernel's tiles read them instead of splitting the weight in registers (the
                same products and sums, so the same bits).
            dispatch: a Hopper MegaMoE kernel's input buffer to fill as well
                (``backends.base.DispatchBuffer``: the activations in FP8 with their scales,
                the routing, the padding rows), so that the kernel needs no pre-dispatch.
                The routing is then written there only, and the weights and ids returned
                are its first T rows (ids int64), valid until the buffer's next use.
            scratch: contiguous float32 room of :meth:`scratch_floats` entries (used by one
                call at a time), where a one-launch call writes its logits and partial sums
                instead of fresh tensors (two allocations less of host time), and a cuBLAS
                call its GEMM's products and logits where they fit (:meth:`_matmul_workspace`);
                the logits returned are then a view of it, valid until its next use. Not
                used while ``torch.compile`` traces.

        Calls of ``matmul_tokens`` tokens or more in a CUDA-graph capture or under
        ``torch.compile``, and eager calls of ``eager_matmul_tokens`` or more, take torch's
        GEMM for the logits (exact products, float32 sums, like the kernel's) and launch
        the selection alone. With
        ``planes`` that GEMM is one bf16 tensor-core GEMM of the activations with the
        weight's three bf16 parts (T, 3E), which the selection adds; without, a float32
        GEMM of the widened activations.

        Returns:
            ``(topk_weights float32, topk_ids int32, logits float32)``: (T, top_k) twice,
            then (T, E). With ``dispatch`` the first two are its rows (ids int64); with
            ``scratch`` the logits are a view of it where the call used it.

        Raises:
            ValueError: more tokens than ``tickets`` serves, activations that are not bf16,
                a weight that is neither bf16 nor float32 or not contiguous, ``planes``
                of another shape than (3E, H), a ``dispatch`` buffer that does not fit
                the call (:meth:`_check_dispatch`), or a ``scratch`` too small for it.
        """
        if hidden_states.dtype != torch.bfloat16 or weight.dtype not in _WEIGHT_DTYPES:
            raise ValueError(
                f"router (triton): activations are {hidden_states.dtype} and the weight "
                f"{weight.dtype}; expected bf16 activations and a bf16 or float32 weight "
                "(cast them, or use the torch path)"
            )
        if not weight.is_contiguous():
            raise ValueError(
                f"router (triton): the weight {tuple(weight.shape)} has strides "
                f"{weight.stride()}; the kernel reads it row-major (pass weight.contiguous())"
            )
        hidden_states = hidden_states.contiguous()
        tokens, hidden = hidden_states.shape
        serves = (tickets.shape[0] - COUNTERS) * BLOCK_T
        if tokens > serves:
            raise ValueError(
                f"router (triton): {tokens} tokens exceed the {serves} its ticket buffer "
                "serves; build the layer with a larger max_num_tokens"
            )
        if weight.dtype != torch.float32:
            planes = None  # a bf16 weight is one product already
        if planes is not None and planes.shape != (PLANES * self.num_experts, hidden):
            raise ValueError(
                f"router (triton): weight planes {tuple(planes.shape)}; expected "
                f"({PLANES * self.num_experts}, {hidden}), the weight's three bf16 "
                "parts (router_logits.weight_planes)"
            )
        if dispatch is not None:
            self._check_dispatch(dispatch, tokens, hidden)
        if self._takes_matmul(tokens):
            parts = 1 if planes is None else PLANES
            views = None
            if planes is not None or weight.dtype == torch.bfloat16:
                views = self._matmul_workspace(tokens, parts, scratch)
            if views is not None:  # one bf16 GEMM into the scratch
                given, logits = views
                factor = weight if planes is None else planes
                torch.mm(hidden_states, factor.t(), out_dtype=torch.float32, out=given)
            elif planes is not None:
                given = torch.mm(hidden_states, planes.t(), out_dtype=torch.float32)
                logits = given.new_empty((tokens, self.num_experts))
            else:
                given = logits = router_logits(hidden_states, weight)
            out = logits if parts > 1 else None
            return (*self._select(given, bias, parts, out, hidden_states, dispatch), logits)
        if tokens == 0:
            weights, ids = self._outputs(hidden_states, None)
            return weights, ids, weights.new_empty((0, self.num_experts))
        if planes is not None:
            kind, weight = WEIGHT_PLANES, planes
        else:
            kind = WEIGHT_FP32 if weight.dtype == torch.float32 else WEIGHT_BF16
        plan = self._cached_plan(tokens, hidden, kind, 0, dispatch is not None)
        logits, partial = self._workspace(hidden_states, plan.splits, scratch)
        weights, ids = self._outputs(hidden_states, dispatch)
        bias_or_weight = weight if bias is None else bias
        written, rows = _dispatch_args(dispatch, hidden_states)
        _launch(
            _variant(plan, hidden_states, weight, *written, bias_or_weight), plan.grid,
            hidden_states.device.index,
            (hidden_states, weight, bias_or_weight, logits, weights, ids, tickets, partial,
             *written, tokens, plan.split_size, rows),
            plan.constexprs, plan.num_warps,
        )  # fmt: skip
        if dispatch is not None:
            return (*self._routing_views(dispatch, tokens), logits)
        return weights, ids, logits

    def _takes_matmul(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens takes cuBLAS's logits (then the selection).

        From ``matmul_tokens`` while a CUDA graph is captured or ``torch.compile`` traces,
        from ``eager_matmul_tokens`` otherwise (asked of the current stream only in between).
        """
        if tokens < self.matmul_tokens:
            return False
        if tokens >= self.eager_matmul_tokens:
            return True
        return torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()

    def _outputs(
        self, like: torch.Tensor, dispatch: DispatchBuffer | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh (T, top_k) float32 weights and int32 ids of ``like``'s T.

        With ``dispatch``, which takes the routing instead: ``like`` twice, pointers the
        launch does not write.
        """
        if dispatch is not None:
            return like, like
        tokens, device = like.shape[0], like.device
        weights = torch.empty((tokens, self.top_k), dtype=torch.float32, device=device)
        return weights, torch.empty((tokens, self.top_k), dtype=torch.int32, device=device)

    def _workspace(
        self, hidden_states: torch.Tensor, splits: int, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-launch call's float32 logits (T, E) and partial sums (splits, T, E).

        Views of ``scratch`` where given (eager), else fresh. Without splits the partial
        sums are ``hidden_states``, a pointer the launch does not write.

        Raises:
            ValueError: a ``scratch`` too small for the call.
        """
        tokens, experts = hidden_states.shape[0], self.num_experts
        size = tokens * experts
        if scratch is None or torch.compiler.is_compiling():
            logits = hidden_states.new_empty((tokens, experts), dtype=torch.float32)
            if splits == 1:
                return logits, hidden_states
            return logits, hidden_states.new_empty((splits, tokens, experts), dtype=torch.float32)
        views = self._cached_views(scratch, (tokens, splits))
        if views is None:
            if scratch.numel() < _scratch_end(size, splits) or scratch.dtype != torch.float32:
                raise ValueError(
                    f"router (triton): a scratch of {scratch.numel()} {scratch.dtype} entries; "
                    f"a call of {tokens} tokens in {splits} hidden-size splits needs "
                    f"{_scratch_end(size, splits)} float32 (size it with scratch_floats() for "
                    "the layer's max_num_tokens and hidden size)"
                )
            logits = scratch.as_strided((tokens, experts), (experts, 1))
            partial = None
            if splits > 1:
                partial = scratch.as_strided(
                    (splits, tokens, experts), (size, experts, 1), _partial_offset(size)
                )
            views = self._keep_views(scratch, (tokens, splits), (logits, partial))
        logits, partial = views
        return logits, hidden_states if partial is None else partial

    def _matmul_workspace(
        self, tokens: int, parts: int, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of ``scratch`` for a cuBLAS call: its products and its logits, or None.

        The one launch's layout (``_scratch_end``): the logits (T, E) first, then, with a
        float32 weight's ``parts`` (3), the GEMM's products (T, 3E), 16-byte aligned, which
        the selection adds into them; with one part the products are the logits. None
        (fresh tensors) while ``torch.compile`` traces, without a scratch, or where the call
        does not fit in it: ``scratch_floats`` sizes it for one-launch calls, which covers
        Qwen4-Exp's router (E=512, H=2048) to 315 tokens and GLM-5.3-Flash's (E=288, three
        parts, H=4096) to 126 (a layer of ``max_num_tokens`` 64 or more). Writing the GEMM
        into a given ``out`` saved 10 us of its host time on the H200 (17 against 27 us).
        """
        if scratch is None or torch.compiler.is_compiling():
            return None
        size = ("matmul", tokens, parts)
        views = self._cached_views(scratch, size)
        if views is None:
            experts = self.num_experts
            logits = tokens * experts
            views = ()  # kept too: a call that does not fit is not measured again
            if scratch.numel() >= _scratch_end(logits, parts) and scratch.dtype == torch.float32:
                given = out = scratch.as_strided((tokens, experts), (experts, 1))
                if parts > 1:
                    given = scratch.as_strided(
                        (tokens, parts * experts), (parts * experts, 1), _partial_offset(logits)
                    )
                views = (given, out)
            self._keep_views(scratch, size, views)
        return views or None

    def _routing_views(self, dispatch: DispatchBuffer, tokens: int) -> tuple[Any, ...]:
        """``dispatch.routing(tokens)``, kept per call size (:meth:`_cached_views`)."""
        if torch.compiler.is_compiling():
            return dispatch.routing(tokens)
        views = self._cached_views(dispatch, tokens)
        if views is None:
            views = self._keep_views(dispatch, tokens, dispatch.routing(tokens))
        return views

    def _cached_views(self, owner: torch.Tensor | DispatchBuffer, size: Hashable) -> Any:
        """Views of ``owner`` kept for calls of ``size`` by :meth:`_keep_views`, or None.

        An eager forward asks for the same views of the same scratch and dispatch buffer at
        every call of a size, and each view made afresh is a dispatcher call (1-2 us of host
        time). Views are kept for the last scratch and the last dispatch buffer seen (one
        each per layer), by identity: a new one (the module moved, a buffer rebuilt)
        replaces its kind's views and releases the old owner.
        """
        kept = self._views.get(type(owner))
        if kept is None or kept[0] is not owner:
            return None
        return kept[1].get(size)

    def _keep_views(
        self, owner: torch.Tensor | DispatchBuffer, size: Hashable, views: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Keep ``views`` of ``owner`` for :meth:`_cached_views`; a full set starts over."""
        kept = self._views.get(type(owner))
        if kept is None or kept[0] is not owner or len(kept[1]) >= KEPT_VIEWS:
            kept = self._views[type(owner)] = (owner, {})
        kept[1][size] = views
        return views

    def _check_dispatch(self, dispatch: DispatchBuffer, tokens: int, hidden: int) -> None:
        """Refuse a dispatch buffer whose dtypes or shapes do not fit this call.

        The last buffer that fitted calls of ``hidden`` columns is kept, and the same tuple
        again (an immutable tuple of tensors whose dtypes and shapes do not change) skips
        ``DispatchBuffer.fits``, a few us of host time per eager call (a layer's router
        gets its experts' one buffer every call). Its rows are checked every call.

        Raises:
            ValueError: no tokens or more than its rows, a hidden size that is not a
                multiple of 128, or a tensor of another dtype, shape or layout than
                ``DispatchBuffer`` describes.
        """
        known = self._fitting.get(hidden) is dispatch
        if not 0 < tokens <= dispatch.x.shape[0] or not (
            known or dispatch.fits(hidden, self.top_k)
        ):
            found = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in dispatch)
            raise ValueError(
                f"router (triton): a dispatch buffer of {found} for {tokens} tokens of "
                f"hidden size {hidden}; expected contiguous float8_e4m3fn (rows, H), float32 "
                f"(rows, H / {DISPATCH_GROUP}), int64 and float32 (rows, top_k={self.top_k}), "
                f"1 <= tokens <= rows and H a multiple of {DISPATCH_GROUP} (take it from the "
                "experts' dispatch_buffer())"
            )
        if not known:
            self._fitting[hidden] = dispatch

    def select(
        self, logits: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection alone, on given contiguous float32 ``logits`` (T, E).

        Returns:
            ``(topk_weights float32, topk_ids int32)``, each (T, top_k).

        Raises:
            ValueError: logits that are not contiguous float32 (T, E).
        """
        if (
            logits.dtype != torch.float32
            or not logits.is_contiguous()
            or logits.dim() != 2
            or logits.shape[1] != self.num_experts
        ):
            raise ValueError(
                f"router (triton): logits {logits.dtype} {tuple(logits.shape)}; expected "
                f"contiguous float32 (tokens, {self.num_experts})"
            )
        return self._select(logits, bias)

    def _select(
        self,
        given: torch.Tensor,
        bias: torch.Tensor | None,
        planes: int = 1,
        logits: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        dispatch: DispatchBuffer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select` on contiguous float32 ``given`` (T, planes * E).

        With ``planes`` > 1, ``given`` holds each token's products with the weight's parts
        side by side; the kernel adds them into ``logits`` (T, E) first. With ``dispatch``
        (checked by the caller, who passes both) the launch also fills it from
        ``hidden_states`` and the routing goes there only.
        """
        tokens = given.shape[0]
        if tokens == 0:
            return self._outputs(given, None)
        filled: DispatchBuffer | None = None
        source = given
        if hidden_states is not None and dispatch is not None:
            filled, source = dispatch, hidden_states
        weights, ids = self._outputs(given, filled)
        hidden = 1 if source is given else source.shape[1]
        plan = self._cached_plan(1, hidden, WEIGHT_BF16, planes, filled is not None)
        programs = cdiv(tokens, plan.rows)
        if filled is not None:  # programs past the rows only cast: spread the cast wider
            programs = max(programs, SPLIT_PROGRAMS)
        grid = (programs, 1, 1)
        out = given if logits is None else logits
        bias_or_logits = given if bias is None else bias  # never an alias of ``out``
        written, rows = _dispatch_args(filled, source)
        _launch(
            _variant(plan, source, given, *written, bias_or_logits), grid, given.device.index,
            (source, given, bias_or_logits, out, weights, ids, ids, given, *written, tokens, 0,
             rows),
            plan.constexprs, plan.num_warps,
        )  # fmt: skip
        if filled is not None:
            return self._routing_views(filled, tokens)
        return weights, ids


def _partial_offset(logits: int) -> int:
    """Where a call's partial sums start in its scratch, in floats.

    After its ``logits`` floats, 16-byte aligned (the launch's key assumes aligned pointers).
    """
    per_alignment = ALIGNMENT // 4
    return -(-logits // per_alignment) * per_alignment


def _scratch_end(logits: int, splits: int) -> int:
    """float32 entries a call of ``logits`` logits in ``splits`` splits takes of a scratch."""
    return logits if splits == 1 else _partial_offset(logits) + splits * logits


def _dispatch_args(
    dispatch: DispatchBuffer | None, unused: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], int]:
    """The kernel's four dispatch pointers (x, scale, weights, ids) and its rows.

    Without a dispatch: ``unused`` four times (a tensor the launch only reads) and 0 rows.
    """
    if dispatch is None:
        return (unused,) * 4, 0
    return (dispatch.x, dispatch.x_scale, dispatch.topk_weights, dispatch.topk_ids), (
        dispatch.x.shape[0]
    )
