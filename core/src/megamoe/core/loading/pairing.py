"""Pair each quantized expert shard's weight with its scale (SPEC §3.3).

A shard is one projection of one expert: key ``(local expert id or None for the shared
expert, shard id)`` with shard ids ``w1`` (gate), ``w3`` (up), ``w2`` (down). A chunked
weight update may deliver the weight and its scale in different ``load_weights`` calls, in
either order; ``ShardPairing`` keeps the halves that arrived and hands back the complete pair
exactly once, as soon as the second half comes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megamoe.core.errors import IncompleteShardsError

SHARD_GATE = "w1"
SHARD_UP = "w3"
SHARD_DOWN = "w2"
SHARD_IDS = (SHARD_GATE, SHARD_UP, SHARD_DOWN)
# Checkpoint projection name -> shard id.
PROJ_TO_SHARD = {"gate_proj": SHARD_GATE, "up_proj": SHARD_UP, "down_proj": SHARD_DOWN}
SHARD_TO_PROJ = {shard: proj for proj, shard in PROJ_TO_SHARD.items()}

ShardKey = tuple[int | None, str]


class ShardPairing:
    """Collects the halves (``weight`` and its scale) of each expert shard.

    Args:
        halves: names of the tensors that make a shard complete, e.g. ``("weight",)`` for
            BF16 or ``("weight", "weight_scale_inv")`` for block FP8.
        prefix: layer prefix for error messages.
    """

    def __init__(self, halves: Sequence[str], prefix: str = "") -> None:
        if not halves or len(set(halves)) != len(halves):
            raise ValueError(f"halves must be distinct, non-empty names, got {tuple(halves)}")
        self.halves = tuple(halves)
        self.prefix = prefix
        self._pending: dict[ShardKey, dict[str, torch.Tensor]] = {}
        self._held_bytes: dict[torch.device, int] = {}

    def add(
        self,
        key: ShardKey,
        half: str,
        tensor: torch.Tensor,
        keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """Record one half of shard ``key``.

        A half that arrives again before its partner replaces the earlier one (the newer
        tensor of a weight update wins). A half that must wait is held as a tensor of the
        pairing's own: the caller may reuse its memory once the call returns (a load buffer
        refilled with the next tensor). The half that completes a shard is handed back as
        given, for use before the caller's call returns.

        Args:
            key: ``(local expert id or None, shard id)``.
            half: one of ``self.halves``.
            tensor: the checkpoint tensor.
            keep: makes the tensor held while the half waits; it must not share memory
                with ``tensor``'s caller. None holds ``tensor.clone()``.

        Returns:
            The complete ``{half: tensor}`` mapping when this call completed the shard (it is
            then forgotten, so each pair is handed out once), else None.

        Raises:
            ValueError: ``half`` or the shard id is not one this pairing knows.
        """
        if half not in self.halves:
            raise ValueError(
                f"{self.prefix}: tensor kind {half!r} for shard {key!r} is not one of {self.halves}"
            )
        if key[1] not in SHARD_IDS:
            raise ValueError(f"{self.prefix}: shard id {key[1]!r} is not one of {SHARD_IDS}")
        parts = self._pending.setdefault(key, {})
        if half in parts:
            self._count(parts.pop(half), -1)
        if len(parts) + 1 < len(self.halves):
            held = tensor.clone() if keep is None else keep(tensor)
            parts[half] = held
            self._count(held, 1)
            return None
        for held in parts.values():
            self._count(held, -1)
        parts[half] = tensor
        del self._pending[key]
        return parts

    def _count(self, tensor: torch.Tensor, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) a held half's bytes on its device."""
        self._held_bytes[tensor.device] = self._held_bytes.get(tensor.device, 0) + sign * (
            tensor.nbytes
        )

    def held_bytes(self, device: torch.device) -> int:
        """Bytes of the halves waiting for their partner that lie on ``device``."""
        return self._held_bytes.get(device, 0)

    @property
    def pending(self) -> dict[ShardKey, tuple[str, ...]]:
        """Incomplete shards mapped to the halves they still lack."""
        return {
            key: tuple(h for h in self.halves if h not in parts)
            for key, parts in self._pending.items()
        }

    def check_complete(self) -> None:
        """Raise unless every shard that received a half also received the other.

        Raises:
            IncompleteShardsError: names the unpaired keys (first few, sorted).
        """
        if self._pending:
            raise IncompleteShardsError(self.prefix, self.pending, SHARD_TO_PROJ)

    def clear(self) -> None:
        """Drop every pending half (after a failed load, to start the update again)."""
        self._pending.clear()
        self._held_bytes.clear()
