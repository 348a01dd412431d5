"""Checkpoint halves arriving at the experts' device: one copy, checks there (SPEC §5).

Each half of a shard (its weight or its scale) is copied to the module's device once and
its NaN/inf are counted there (``NonFiniteLedger``: read back once per load call, not once
per tensor); then it waits in a ``ShardPairing`` for its partner. Waiting halves are kept
on the device up to ``UNPAIRED_DEVICE_SHARE`` of the kernel tensors' bytes; beyond that
the caller's tensor waits instead (copied again once paired), so peak device memory stays
bounded whatever the order of the tensors.
"""

from __future__ import annotations

import torch

from megamoe.core.finiteness import NonFiniteLedger
from megamoe.core.pairing import ShardKey, ShardPairing

UNPAIRED_DEVICE_SHARE = 1 / 16  # of the kernel tensors' bytes, for halves on the device


class DeviceArrival:
    """Moves checked halves to ``device``, counts their non-finite values, pairs them.

    Args:
        device: the kernel tensors' device.
        label: the layer, for messages.
        kernel_bytes: bytes of the kernel tensors (sets the budget of waiting halves).
    """

    def __init__(self, device: torch.device, label: str, kernel_bytes: int) -> None:
        self.device = device
        self.ledger = NonFiniteLedger(label)
        self.budget = int(UNPAIRED_DEVICE_SHARE * kernel_bytes)

    def arrive(
        self,
        pairing: ShardPairing,
        key: ShardKey,
        kind: str,
        tensor: torch.Tensor,
        what: str,
        *,
        ue8m0: bool,
        block_scale: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """Copy one half to the device (once), count its NaN/inf there, pair it.

        Args:
            pairing: where the half waits for its partner.
            key: its shard.
            kind: which half (a name ``pairing`` knows).
            tensor: the half, dtype and shape already checked.
            what: the tensor named for messages.
            ue8m0: a ``uint8`` tensor holds UE8M0 exponents (255 = NaN).
            block_scale: the half is a block-FP8 scale, which must also be > 0.

        Returns:
            The complete shard (halves on the device, or the caller's where one waited
            beyond the budget) when this half completed it, else None.
        """
        held = tensor.to(self.device)
        self.ledger.record(what, held, ue8m0=ue8m0)
        if block_scale:
            self.ledger.record_block_scale(what, held)
        parts = pairing.add(key, kind, held)
        over_budget = pairing.held_bytes(held.device) > self.budget
        if parts is None and held is not tensor and over_budget:
            pairing.add(key, kind, tensor)
        return parts

    def kept(self, tensor: torch.Tensor, *, staged: bool) -> torch.Tensor:
        """A run-format tensor on the device; a copy of its own when ``staged``.

        A shard written into place at once may be read from the caller's memory; a staged
        one waits for the commit, so it must not share memory the caller may reuse.
        """
        moved = tensor.to(self.device)
        if staged and moved.data_ptr() == tensor.data_ptr():
            return moved.clone()
        return moved
