"""One pending weight update: run-format shards held until ``finalize()`` commits them.

Holding an update aside until every check passed is what lets a reload that fails midway
leave the previous weights serving (SPEC §5, "Safe reload"). The memory it costs is at most
the final run-format bytes of the shards changed by the update; replicas of one logical
expert share one staged copy.
"""

from __future__ import annotations

import torch

SlotShard = tuple[int, str]  # (kernel slot, shard id)


def count_nonfinite(tensor: torch.Tensor, *, ue8m0: bool = False) -> int:
    """Number of elements of a stored weight or scale that decode to NaN or infinity.

    Args:
        tensor: float (any width), ``float8_e4m3fn`` (NaN = exponent and mantissa all
            ones), or ``uint8``: a UE8M0 scale when ``ue8m0`` (255 = NaN), otherwise packed
            E2M1 codes (always finite).
        ue8m0: read a ``uint8`` tensor as UE8M0 exponents.

    Returns:
        The count; 0 for a finite tensor.
    """
    if tensor.dtype == torch.float8_e4m3fn:
        return int(((tensor.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if tensor.dtype == torch.uint8:
        return int((tensor == 0xFF).sum()) if ue8m0 else 0
    if tensor.is_floating_point():
        return int((~torch.isfinite(tensor)).sum())
    return 0


class PendingUpdate:
    """Run-format shards staged by ``load_*`` calls and written into place at commit."""

    def __init__(self) -> None:
        self._shards: dict[SlotShard, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def stage(
        self, slot: int, shard_id: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        """Hold one shard of one kernel slot; a newer shard for the same key replaces it."""
        self._shards[(slot, shard_id)] = (weight, scale)

    def keys(self) -> set[SlotShard]:
        """The staged ``(slot, shard id)`` keys."""
        return set(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def nbytes(self) -> int:
        """Bytes the staged tensors occupy, counting a storage shared by replicas once."""
        seen: dict[int, int] = {}
        for pair in self._shards.values():
            for tensor in pair:
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def take(self) -> list[tuple[SlotShard, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Hand out every staged shard (sorted by key) and forget them."""
        items = sorted(self._shards.items())
        self._shards.clear()
        return items

    def clear(self) -> None:
        """Drop the update."""
        self._shards.clear()
