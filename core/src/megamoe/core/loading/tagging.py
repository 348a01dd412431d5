"""Format tags on kernel-ready tensors and buffers (SPEC §5, "Formats are tagged").

Every tensor a MegaMoE kernel reads (weights, scales, the symmetric buffer) carries a
``KernelTag``: the run format, its scale granularity, the number of fused shared experts
and the SwiGLU clamp the weights run with. A forward compares the tags of all its pieces
first, so combining pieces built for different formats is an error instead of silently
wrong output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megamoe.core.errors import FormatMismatchError
from megamoe.core.numerics.formats import WeightFormat

TAG_ATTR = "megamoe_kernel_tag"  # attribute name that holds the tag on a tensor or buffer


@dataclass(frozen=True)
class KernelTag:
    """What a kernel-ready tensor or buffer was built for.

    Attributes:
        weight_format: the run format of the expert weights.
        scale_block: rows x columns covered by one scale (None for BF16).
        num_shared_experts: fused shared experts behind the routed ones.
        swiglu_limit: the SwiGLU clamp (``megamoe.core.numerics.swiglu``), None for none.
        l1_row_group: the gate/up row interleave of first-projection weights
            (``megamoe.core.loading.l1_order``; 0 for ``[gate | up]``).
    """

    weight_format: WeightFormat
    scale_block: tuple[int, int] | None
    num_shared_experts: int
    swiglu_limit: float | None = None
    l1_row_group: int = 0

    @classmethod
    def for_format(
        cls,
        weight_format: WeightFormat,
        num_shared_experts: int = 0,
        swiglu_limit: float | None = None,
        l1_row_group: int = 0,
    ) -> KernelTag:
        """The tag of ``weight_format`` with its own scale granularity."""
        return cls(
            weight_format, weight_format.scale_block, num_shared_experts, swiglu_limit, l1_row_group
        )

    @property
    def buffer_tag(self) -> KernelTag:
        """The tag of a symmetric buffer serving these weights (no clamp, no row order).

        The clamp is a kernel argument and the row order a property of the weights, so one
        buffer serves layers of any clamp.
        """
        return KernelTag(self.weight_format, self.scale_block, self.num_shared_experts)

    def describe(self) -> str:
        """Short human-readable form for error messages."""
        block = "no scale" if self.scale_block is None else "x".join(map(str, self.scale_block))
        clamp = "no clamp" if self.swiglu_limit is None else f"clamp {self.swiglu_limit:g}"
        rows = f", gate/up rows in groups of {self.l1_row_group}" if self.l1_row_group else ""
        return (
            f"{self.weight_format.value} ({block}, {self.num_shared_experts} shared, {clamp}{rows})"
        )


def tag(obj: object, kernel_tag: KernelTag) -> None:
    """Attach ``kernel_tag`` to a tensor (or any buffer object that takes attributes)."""
    setattr(obj, TAG_ATTR, kernel_tag)


def tag_of(obj: object) -> KernelTag | None:
    """The tag attached to ``obj``, None when it carries none."""
    found = getattr(obj, TAG_ATTR, None)
    return found if isinstance(found, KernelTag) else None


def check_tags(expected: KernelTag, pieces: Mapping[str, object], owner: str) -> None:
    """Raise unless every piece carries exactly ``expected``.

    Args:
        expected: the tag the pieces must carry.
        pieces: name -> tensor or buffer.
        owner: who combines them (module prefix), for the message.

    Raises:
        FormatMismatchError: names the first piece whose tag differs or is missing.
    """
    for name, piece in pieces.items():
        found = tag_of(piece)
        # The same tag object (the usual case) is checked without the dataclass comparison.
        if found is not expected and found != expected:
            got = "no tag" if found is None else found.describe()
            raise FormatMismatchError(
                f"{owner}: {name} is tagged {got}, but this forward runs "
                f"{expected.describe()}; rebuild the piece for this format (assign tensors "
                "only through load_weights()/finalize(), never replace kernel tensors)"
            )
