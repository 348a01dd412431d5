"""The GLM router's selection in one Triton kernel: the same ids and weights as the torch path.

``router.route_logits`` (and so ``Glm5NextRouter.forward``) calls
:func:`grouped_topk_triton` for CUDA logits when Triton imports and the shape is covered
(:func:`triton_covers`); everything else runs the torch path, ``router.grouped_topk``.
One program routes one token with its (groups x experts per group) tile in registers:
sigmoid, bias, the groups' top-2 sums, the kept groups and the top-k, then the weights
of the chosen experts.

Bit for bit with the torch path:
- The sigmoid is ``1 / (1 + exp(-x))`` with the CUDA math library's ``expf`` and a
  correctly rounded division, the float32 operations torch's CUDA sigmoid performs; the
  bias add and the group sums are single float32 additions, as in torch.
- Order and ties are decided on integer keys: each float maps to an int32 whose order is
  the float order, with every NaN above +inf (torch's sort and top-k treat NaN as the
  largest value), and the key is packed with the reversed index into one int64, so one
  max reduction picks the largest value and, among equal values, the lowest index.
  The chosen experts come out in decreasing biased score, ties lower id first, as the
  torch path's stable sort orders them.
- Only the renormalizing sum (over top_k values) may add in another order: weights can
  differ by float32 rounding (a few ulp), ids never.

``tests/test_router_triton.py`` checks all of it on a GPU (the sigmoid over 2^20 logits
from -120 to 120 and the special values, bit for bit on the H200 with Triton 3.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megamoe.glm5next.router import NORM_EPS, check_group_settings

__all__ = ["grouped_topk_triton", "triton_covers"]

MAX_EXPERTS = 512  # the largest router the kernel holds in registers (Qwen4-Exp's E)
MAX_TOP_K = 16
MAX_GROUPS = 16
_KEY_NAN = tl.constexpr(0x7FFFFFFF)  # int32 key of every NaN: above +inf's 0x7F800000
_LOW_MAX = tl.constexpr(0x7FFFFFFF)  # a packed key's low word: index ^ _LOW_MAX
_MASKED = tl.constexpr(-(2**63))  # packed key of a padded, excluded or chosen entry
_NORM_EPS = tl.constexpr(NORM_EPS)


def triton_covers(num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether the kernel handles this router (E <= 512, top-k <= 16, at most 16 groups)."""
    return num_experts <= MAX_EXPERTS and top_k <= MAX_TOP_K and n_group <= MAX_GROUPS


@triton.jit
def _float_to_key(value: tl.tensor) -> tl.tensor:
    """int32 keys in float order (NaN above +inf); no -0.0 arises here (s >= +0)."""
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
def _grouped_topk_kernel(
    logits_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    logits_row_stride: tl.tensor,
    routed_scaling_factor: tl.tensor,
    PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """Route one token (program id): ids and weights of its TOP_K experts."""
    token = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + token * logits_row_stride
    group = tl.arange(0, BLOCK_G)
    member = tl.arange(0, BLOCK_J)
    expert = group[:, None] * PER_GROUP + member[None, :]
    valid = (group[:, None] < N_GROUP) & (member[None, :] < PER_GROUP)
    score = _sigmoid(tl.load(logits_row + expert, mask=valid, other=0.0))
    biased = score + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    packed = tl.where(valid, _pack(_float_to_key(biased), expert), _MASKED)

    if TOPK_GROUP < N_GROUP:
        # A group scores its two best biased scores added; keys are unique, so removing
        # the best one entry leaves the second even when the two are equal.
        best = tl.max(packed, axis=1)
        second = tl.max(tl.where(packed == best[:, None], _MASKED, packed), axis=1)
        group_sum = _key_to_float((best >> 32).to(tl.int32)) + _key_to_float(
            (second >> 32).to(tl.int32)
        )
        group_valid = group < N_GROUP
        group_packed = tl.where(group_valid, _pack(_float_to_key(group_sum), group), _MASKED)
        # Rank of each group: how many groups beat it; the TOPK_GROUP lowest ranks stay.
        beaten_by = tl.sum((group_packed[None, :] > group_packed[:, None]).to(tl.int32), axis=1)
        kept = group_valid & (beaten_by < TOPK_GROUP)
        packed = tl.where(kept[:, None], packed, _MASKED)

    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(packed, axis=1), axis=0)
        ids = tl.where(slot == i, best.to(tl.int32) ^ _LOW_MAX, ids)
        packed = tl.where(packed == best, _MASKED, packed)

    in_top_k = slot < TOP_K
    # The chosen experts' unbiased scores, recomputed from their logits: the same bits.
    weights = tl.where(in_top_k, _sigmoid(tl.load(logits_row + ids, mask=in_top_k, other=0.0)), 0.0)
    if NORM_TOPK_PROB:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=0) + _NORM_EPS)
    weights = weights * routed_scaling_factor
    out = token * TOP_K + slot
    tl.store(weights_ptr + out, weights, mask=in_top_k)
    tl.store(ids_ptr + out, ids, mask=in_top_k)


def grouped_topk_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router.grouped_topk(torch.sigmoid(logits), ...)`` in one kernel launch.

    Args:
        logits: (tokens, E) float32 router logits on a CUDA device, unit stride along E.
        correction_bias: (E,) float32 selection bias on the same device.
        top_k: experts per token (at most ``MAX_TOP_K``).
        n_group: router groups (E a multiple, at least 2 experts per group, at most
            ``MAX_GROUPS``).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier.

    Returns:
        ``(topk_weights float32, topk_ids int32)``, each (tokens, top_k), in decreasing
        biased score (ties: lower id first).

    Raises:
        ValueError: dtypes, shapes or group settings the router does not allow, or a
            shape :func:`triton_covers` rejects.
    """
    tokens, num_experts = logits.shape
    if logits.dtype != torch.float32 or correction_bias.dtype != torch.float32:
        raise ValueError(
            f"router (triton): logits are {logits.dtype} and the bias {correction_bias.dtype}; "
            "both must be torch.float32 (the router runs in float32)"
        )
    if not triton_covers(num_experts, top_k, n_group):
        raise ValueError(
            f"router (triton): E={num_experts}, top_k={top_k}, n_group={n_group} exceed the "
            f"kernel's E <= {MAX_EXPERTS}, top_k <= {MAX_TOP_K}, n_group <= {MAX_GROUPS}; "
            "use router.grouped_topk"
        )
    check_group_settings(num_experts, correction_bias, top_k, n_group, topk_group)
    per_group = num_experts // n_group
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_g, block_j = triton.next_power_of_2(n_group), triton.next_power_of_2(per_group)
    _grouped_topk_kernel[(tokens,)](
        logits,
        correction_bias.contiguous(),
        weights,
        ids,
        logits.stride(0),
        float(routed_scaling_factor),
        PER_GROUP=per_group,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORM_TOPK_PROB=bool(norm_topk_prob),
        BLOCK_G=block_g,
        BLOCK_J=block_j,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(4, block_g * block_j // 512)),
    )
    return weights, ids
