"""DeepGEMM MegaMoE's physical layout of one rank's experts, built expert by expert.

The experts store ``w13`` with gate and up rows interleaved in groups of 8, the order
DeepGEMM's kernels read (``megamoe.core.loading.l1_order``), so the weights need no copy of their
own: the kernel reads the experts' tensors. DeepGEMM's own transforms
(``transform_weights_for_mega_moe_sm90`` on Hopper; ``transform_sf_into_required_layout``
+ ``transform_weights_for_mega_moe`` on SM100) still run on each expert that changed, from
a one-expert canonical temporary: the weights they return must equal the stored ones bit
for bit (a DeepGEMM whose layout differs is refused, never run on the wrong order), and
the scales they repack (SM100: packed UE8M0 in DeepGEMM's layout) are copied into tensors
allocated once for all local experts. Pieces returned unchanged (Hopper: the block scales
and ``w2``; SM100: ``w2``) are the experts' tensors themselves. Finalizing needs only one
expert's temporaries, and a reload rewrites the changed experts in place (addresses
captured by CUDA graphs stay valid).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.loading.tagging import KernelTag, tag

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

KIND_SM90 = "sm90_fp8"  # fp8_mega_moe: FP8 x FP8 with float32 128x128 weight block scales
KIND_FP8XFP4 = "fp8xfp4"  # fp8_fp4_mega_moe: MXFP8 activations x MXFP4 weights
KIND_FP8XFP8 = "fp8xfp8"  # fp8_fp4_mega_moe: MXFP8 activations x MXFP8 weights
KIND_BF16 = "bf16xbf16"  # bf16_mega_moe
MX_GROUP = 32  # columns per UE8M0 scale
UE8M0_SHIFT = 23  # a UE8M0 exponent is the float32 exponent field: bits 23..30
PIECES = ("l1_weight", "l1_scale", "l2_weight", "l2_scale")
L1_ROW_ORDER = L1RowOrder(group=8)  # gate/up rows as every MegaMoE kernel reads them


def takes(fn: Any, parameter: str) -> bool:
    """Whether callable ``fn`` accepts a keyword ``parameter`` (how API generations differ)."""
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


Pieces = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


ROUTED_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SHARED_TENSORS = (
    "shared_l1_weight",
    "shared_l1_weight_scale",
    "shared_l2_weight",
    "shared_l2_weight_scale",
)


def _stored(experts: MegaMoEExperts, names: tuple[str, ...]) -> Pieces:
    """The experts' (l1, l1 scale, l2, l2 scale) of ``names``, None where a format has none."""
    params = experts.kernel_params
    found = [params[n].data if n in params else None for n in names]
    return found[0], found[1], found[2], found[3]


def _require(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    """``tensor``, or a RuntimeError naming the missing experts tensor."""
    if tensor is None:
        raise RuntimeError(f"the experts module has no {what} (its run format does not match)")
    return tensor


def transform_expert(
    module: ModuleType, kind: str, experts: MegaMoEExperts, slot: int
) -> tuple[Pieces, Pieces]:
    """DeepGEMM's layout of one local expert (routed, or a fused shared one).

    Args:
        module: the ``deep_gemm`` module.
        kind: the kernel kind.
        experts: the experts module (canonical tensors).
        slot: the kernel slot: a routed expert ``0 .. num_local_experts - 1``, then the
            fused shared experts (``shared_l1_weight`` ... at ``slot - num_local_experts``).

    Returns:
        ``(pieces, stored)``: the expert's (l1 weight, l1 scale, l2 weight, l2 scale) in
        the kernel's layout, each (1, ...), and the experts' full tensors each piece may be
        an unchanged slice of (None where it cannot be). The l1 weight is the stored slice.

    Raises:
        RuntimeError: DeepGEMM's l1 weight layout differs from the stored row order.
    """
    shared = slot >= experts.num_local_experts
    names = SHARED_TENSORS if shared else ROUTED_TENSORS
    slot -= experts.num_local_experts if shared else 0
    w13, s13, w2, s2 = _stored(experts, names)
    w13, w2 = _require(w13, names[0]), _require(w2, names[2])
    if experts.l1_order != L1_ROW_ORDER:
        raise RuntimeError(
            f"{experts.layout.label}: w13 is stored in {experts.l1_order}, not the order the "
            "DeepGEMM kernels read; build the experts with backend='deepgemm'"
        )
    if kind == KIND_FP8XFP4:  # DeepGEMM takes packed E2M1 pairs as int8
        w13, w2 = w13.view(torch.int8), w2.view(torch.int8)
    one = slice(slot, slot + 1)
    l1 = L1_ROW_ORDER.to_canonical(w13[one])  # one expert's temporary, [gate | up]
    if kind == KIND_SM90:
        s13, s2 = _require(s13, names[1]), _require(s2, names[3])
        (a, b), (c, d) = module.transform_weights_for_mega_moe_sm90(
            (l1, s13[one]), (w2[one], s2[one])
        )
        return (_as_stored(a, w13[one], experts, slot), b, c, d), (w13, s13, w2, s2)
    # 0.2.5 takes the buffer's mma_type (the FP4-activation kinds interleave differently).
    mma = {"mma_type": kind} if takes(module.transform_weights_for_mega_moe, "mma_type") else {}
    if kind == KIND_BF16:
        a, c = module.transform_weights_for_mega_moe(l1, w2[one], **mma)
        return (_as_stored(a, w13[one], experts, slot), None, c, None), (w13, None, w2, None)
    s13, s2 = _require(s13, names[1]), _require(s2, names[3])
    h, i = experts.hidden_size, experts.intermediate_size
    sf13 = sm100_scale(module, s13[one], 2 * i, h)
    sf2 = sm100_scale(module, s2[one], h, i)
    (a, b), (c, d) = module.transform_weights_for_mega_moe((l1, sf13), (w2[one], sf2), **mma)
    return (_as_stored(a, w13[one], experts, slot), b, c, d), (w13, None, w2, None)


def _as_stored(
    piece: torch.Tensor, stored: torch.Tensor, experts: MegaMoEExperts, slot: int
) -> torch.Tensor:
    """``stored`` when DeepGEMM's transformed l1 weight equals it bit for bit.

    Raises:
        RuntimeError: they differ: this DeepGEMM reads another row order than megamoe
            stores, and running it would be silently wrong.
    """
    same = piece.shape == stored.shape and torch.equal(
        piece.contiguous().view(torch.uint8), stored.contiguous().view(torch.uint8)
    )
    if not same:
        raise RuntimeError(
            f"{experts.layout.label}: deep_gemm's weight transform laid out expert slot "
            f"{slot}'s w13 rows differently from the order megamoe stores them in "
            f"({L1_ROW_ORDER}); this DeepGEMM build is not supported: report it with its "
            "version, or use backend='reference'"
        )
    return stored


def sm100_scale(module: ModuleType, scale_ue8m0: torch.Tensor, mn: int, k: int) -> torch.Tensor:
    """UE8M0 bytes (1, mn, k/32) -> DeepGEMM's packed int32 scale layout (1, mn, k/128).

    Each byte becomes the float32 power of two with that exponent field (exact for every
    byte), which DeepGEMM packs back into bytes, four per int32, in its own layout.
    """
    scale_pow2 = (scale_ue8m0.to(torch.int32) << UE8M0_SHIFT).view(torch.float32)
    packed = module.transform_sf_into_required_layout(scale_pow2, mn, k, (1, MX_GROUP), 1)
    return packed if packed.dim() == 3 else packed.unsqueeze(0)


def _empty_experts(sample: torch.Tensor, count: int) -> torch.Tensor:
    """Storage for ``count`` experts laid out like ``sample`` (one expert, (1, ...))."""
    inner = [st * n for st, n in zip(sample.stride()[1:], sample.shape[1:], strict=True)]
    return torch.empty_strided(
        (count, *sample.shape[1:]),
        (max([sample.stride(0), *inner]), *sample.stride()[1:]),
        dtype=sample.dtype,
        device=sample.device,
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same memory seen the same way."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride()[1:] == b.stride()[1:]
    )


class KernelLayout:
    """The tensors the kernel reads for one rank's experts, updated in place.

    Attributes:
        pieces: (l1 weight, l1 scale, l2 weight, l2 scale), None where the kind has none.
        aliased: per piece, whether it is the canonical tensor itself (not copied).
    """

    def __init__(self, pieces: Pieces, aliased: tuple[bool, ...]) -> None:
        self.pieces = pieces
        self.aliased = aliased

    @classmethod
    def allocate(
        cls, first: Pieces, canonical: Pieces, count: int, kernel_tag: KernelTag
    ) -> KernelLayout:
        """Kernel tensors for ``count`` experts, shaped after expert 0's pieces ``first``.

        A piece that is an unchanged slice of its canonical tensor is that tensor; others
        get storage of their own. Every piece is tagged with ``kernel_tag``.
        """
        tensors: list[torch.Tensor | None] = []
        aliased: list[bool] = []
        for piece, full in zip(first, canonical, strict=True):
            if piece is None:
                tensors.append(None)
                aliased.append(False)
                continue
            alias = full is not None and _same_view(piece, full[0:1])
            kept = full if alias and full is not None else _empty_experts(piece, count)
            tag(kept, kernel_tag)  # a view of a canonical tensor carries no tag of its own
            tensors.append(kept)
            aliased.append(alias)
        return cls((tensors[0], tensors[1], tensors[2], tensors[3]), tuple(aliased))

    def write(self, slot: int, pieces: Pieces, canonical: Pieces) -> None:
        """Store one expert's transformed pieces into the kernel tensors, in place.

        Raises:
            RuntimeError: a piece that was an unchanged canonical slice for the first
                expert is not for this one (DeepGEMM's transform behaves inconsistently).
        """
        for name, piece, full, target, aliased in zip(
            PIECES, pieces, canonical, self.pieces, self.aliased, strict=True
        ):
            if piece is None or target is None:
                continue
            if aliased:
                if full is None or not _same_view(piece, full[slot : slot + 1]):
                    raise RuntimeError(
                        f"deep_gemm's weight transform returned a new {name} for expert {slot} "
                        "after leaving it in place for expert 0; rebuild the layer"
                    )
                continue
            target[slot].copy_(piece[0])

    def named(self, prefix: str) -> dict[str, torch.Tensor]:
        """The kernel tensors by ``prefix`` and piece name (for tag checks and inspection)."""
        return {
            f"{prefix} {name}": t
            for name, t in zip(PIECES, self.pieces, strict=True)
            if t is not None
        }

    def nbytes(self, *, owned_only: bool = False) -> int:
        """Bytes of the kernel tensors (``owned_only``: those not aliasing canonical ones)."""
        return sum(
            t.untyped_storage().nbytes()
            for t, alias in zip(self.pieces, self.aliased, strict=True)
            if t is not None and not (owned_only and alias)
        )
