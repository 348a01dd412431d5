"""Where the gate and up rows of an expert's first projection lie in its stored tensor.

The canonical order of ``w13`` (and ``shared_l1``) is ``[gate | up]``: gate rows
``0..I-1``, then up rows. DeepGEMM's MegaMoE kernels read them interleaved in groups of
``G = 8`` rows (gate 0..7, up 0..7, gate 8..15, up 8..15, ...). The experts store their
first projection in the order their backend's kernel reads, so the kernel reads the
module's own tensors and no second copy of the weights exists. Every canonical access to
a shard goes through ``L1RowOrder``: writes go through a strided view (no copy); a
canonical read of an interleaved tensor copies just what is read (one shard, one expert).

Only element tensors are reordered: scales keep the canonical order (block-FP8 scales
cover 128 rows, a whole number of groups; MX scales are repacked by the backend anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.core.loading.pairing import SHARD_GATE, SHARD_UP

CANONICAL = 0  # group size of the canonical [gate | up] order


@dataclass(frozen=True)
class L1RowOrder:
    """The row order of first-projection element tensors (..., 2I, C).

    Attributes:
        group: rows per interleaved group (8 for DeepGEMM), ``CANONICAL`` (0) for
            ``[gate | up]``.
    """

    group: int = CANONICAL

    @property
    def interleaved(self) -> bool:
        """Whether gate and up rows alternate in groups (not ``[gate | up]``)."""
        return self.group != CANONICAL

    def shard_view(self, l1: torch.Tensor, shard_id: str) -> torch.Tensor:
        """The gate (``w1``) or up (``w3``) rows of ``l1`` (..., 2I, C), as a view.

        Shaped (..., I, C) in canonical order, (..., I/G, G, C) interleaved.

        Raises:
            ValueError: ``shard_id`` is not ``w1``/``w3``, or 2I is not a multiple of 2G.
        """
        if shard_id not in (SHARD_GATE, SHARD_UP):
            raise ValueError(f"shard {shard_id!r} is no first-projection shard (w1 or w3)")
        rows = l1.shape[-2]
        half, which = rows // 2, 0 if shard_id == SHARD_GATE else 1
        if not self.interleaved:
            return l1.narrow(-2, which * half, half)
        if rows % (2 * self.group):
            raise ValueError(f"{rows} rows do not split into gate/up groups of {self.group}")
        grouped = l1.unflatten(-2, (half // self.group, 2, self.group))
        return grouped.select(-3, which)

    def write(self, l1: torch.Tensor, shard_id: str, value: torch.Tensor) -> None:
        """Copy canonical shard rows ``value`` (..., I, C) into their place in ``l1``."""
        view = self.shard_view(l1, shard_id)
        view.copy_(value.reshape(view.shape))

    def read(self, l1: torch.Tensor, shard_id: str) -> torch.Tensor:
        """The gate or up rows of ``l1`` in canonical form (..., I, C): a view or a copy."""
        view = self.shard_view(l1, shard_id)
        return view.reshape(*l1.shape[:-2], l1.shape[-2] // 2, l1.shape[-1])

    def to_canonical(self, l1: torch.Tensor) -> torch.Tensor:
        """``l1`` (..., 2I, C) in ``[gate | up]`` order (itself when already canonical)."""
        if not self.interleaved:
            return l1
        out = torch.empty_like(l1)  # the only temporary: rows are copied straight into it
        half = l1.shape[-2] // 2
        for shard_id, first in ((SHARD_GATE, 0), (SHARD_UP, half)):
            view = self.shard_view(l1, shard_id)
            out.narrow(-2, first, half).view(view.shape).copy_(view)
        return out

    def from_canonical(self, l1: torch.Tensor) -> torch.Tensor:
        """A ``[gate | up]`` tensor (..., 2I, C) in this order (itself when canonical)."""
        if not self.interleaved:
            return l1
        out = torch.empty_like(l1)
        half = l1.shape[-2] // 2
        self.write(out, SHARD_GATE, l1.narrow(-2, 0, half))
        self.write(out, SHARD_UP, l1.narrow(-2, half, half))
        return out
