"""One pending weight update: run-format shards held until ``finalize()`` commits them.

Holding an update aside until every check passed is what lets a reload that fails midway
leave the previous weights serving. The experts hold at most a budget of staged bytes
(``expert_loading``: beyond it they write in place); replicas of one logical expert share
one staged copy.
"""

from __future__ import annotations

import torch

SlotShard = tuple[int, str]  # (kernel slot, shard id)


class PendingUpdate:
    """Run-format shards staged by ``load_*`` calls and written into place at commit."""

    def __init__(self) -> None:
        self._shards: dict[SlotShard, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._held = 0  # bytes of the staged tensors, replicas counted apart (an upper bound)

    def stage(
        self, slot: int, shard_id: str, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        """Hold one shard of one kernel slot; a newer shard for the same key replaces it."""
        old = self._shards.get((slot, shard_id))
        if old is not None:
            self._held -= _pair_bytes(old)
        self._shards[(slot, shard_id)] = (weight, scale)
        self._held += _pair_bytes((weight, scale))

    @property
    def held_bytes(self) -> int:
        """Bytes staged, counting replicas that share a storage once each (cheap upper bound)."""
        return self._held

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
        self.clear()
        return items

    def clear(self) -> None:
        """Drop the update."""
        self._shards.clear()
        self._held = 0


def _pair_bytes(pair: tuple[torch.Tensor, torch.Tensor | None]) -> int:
    return sum(t.nbytes for t in pair if t is not None)
