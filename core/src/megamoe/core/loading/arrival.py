"""Checkpoint halves arriving at the experts' device: one copy, checks there (SPEC §5).

Each half of a shard (its weight or its scale) is copied to the module's device once and
its NaN/inf are counted there (``NonFiniteLedger``: read back once per load call, not once
per tensor); then it waits in a ``ShardPairing`` for its partner. Waiting halves are kept
on the device up to ``UNPAIRED_DEVICE_SHARE`` of the kernel tensors' bytes; beyond that
a copy waits where the caller's tensor was (host memory, for a checkpoint read on the CPU;
copied again once paired), so peak device memory stays bounded whatever the order of the
tensors. A waiting half never shares memory with the caller's tensor: the caller may refill
its load buffers as soon as the call returns.
"""

from __future__ import annotations

import torch

from megamoe.core.loading.finiteness import NonFiniteLedger
from megamoe.core.loading.pairing import ShardKey, ShardPairing

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
        ue8m0_from: int | None,
        block_scale: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """Copy one half to the device (once), count its NaN/inf there, pair it.

        Args:
            pairing: where the half waits for its partner.
            key: its shard.
            kind: which half (a name ``pairing`` knows).
            tensor: the half, dtype and shape already checked.
            what: the tensor named for messages.
            ue8m0_from: a ``uint8`` tensor holds UE8M0 exponents, non-finite from this byte
                on (``finiteness.mx_scale_limit``); None for any other half.
            block_scale: the half is a block-FP8 scale, which must also be > 0.

        Returns:
            The complete shard (halves on the device, or where the caller's tensor was for
            one that waited beyond the budget) when this half completed it, else None.
        """
        moved = tensor.to(self.device)
        self.ledger.record(what, moved, ue8m0_from=ue8m0_from)
        if block_scale:
            self.ledger.record_block_scale(what, moved)
        copied = moved.device != tensor.device or moved.data_ptr() != tensor.data_ptr()

        def keep(half: torch.Tensor) -> torch.Tensor:
            """What waits: the device copy, or beyond the budget a copy where the caller's is."""
            if not copied:
                return half.clone()
            if pairing.held_bytes(self.device) + half.nbytes > self.budget:
                return tensor.clone()
            return half

        return pairing.add(key, kind, moved, keep)

    def kept(self, tensor: torch.Tensor, *, staged: bool) -> torch.Tensor:
        """A run-format tensor on the device; a copy of its own when ``staged``.

        A shard written into place at once may be read from the caller's memory; a staged
        one waits for the commit, so it must not share memory the caller may reuse.
        """
        moved = tensor.to(self.device)
        if staged and moved.data_ptr() == tensor.data_ptr():
            return moved.clone()
        return moved
