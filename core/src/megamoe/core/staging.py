"""One pending weight update: run-format shards held until ``finalize()`` commits them.

Holding an update aside until every check passed is what lets a reload that fails midway
leave the previous weights serving (SPEC §5, "Safe reload"). The memory it costs is at most
the final run-format bytes of the shards changed by the update; replicas of one logical
expert share one staged copy.
"""

from __future__ import annotations

import torch

SlotShard = tuple[int, str]  # (kernel slot, shard id)


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
