"""Non-finite checks of loaded weights and scales, read back once per load call (SPEC §5).

A checkpoint tensor is checked where it will live, after its one copy to the experts'
device. On a GPU each tensor's count of NaN/inf stays on the device: ``NonFiniteLedger``
keeps it beside the tensor's name, and ``check()`` reads every count back in one transfer
(one host sync per load call instead of one per tensor) and raises ``NonFiniteError``
naming the bad tensors. On the CPU a one-pass test decides first whether the count (a
slower pass) is needed at all.
"""

from __future__ import annotations

import torch

from megamoe.core.errors import NonFiniteError, format_keys

ALL_ONES = 0xFF  # UE8M0 NaN; float8_e4m3fn NaN once its sign bit is set
SIGN_BIT = 0x80
MAX_PENDING_COUNTS = 1024  # device counts kept apart before they are joined into one tensor
FLAGGED = -1  # count of a conversion flag: non-finite values, number unknown


def _nonfinite_mask(tensor: torch.Tensor, ue8m0: bool) -> torch.Tensor | None:
    """Boolean mask of the elements that decode to NaN or inf; None when none can."""
    if tensor.dtype == torch.float8_e4m3fn:
        return (tensor.view(torch.uint8) | SIGN_BIT) == ALL_ONES  # both NaN bytes -> 0xFF
    if tensor.dtype == torch.uint8:
        return tensor == ALL_ONES if ue8m0 else None
    if tensor.is_floating_point():
        return ~torch.isfinite(tensor)
    return None


def _may_hold_nonfinite(tensor: torch.Tensor, ue8m0: bool) -> bool:
    """One pass, no temporaries of the tensor's size: False proves every element finite."""
    if tensor.numel() == 0:
        return False
    if tensor.dtype == torch.float8_e4m3fn:
        return int((tensor.view(torch.uint8) | SIGN_BIT).max()) == ALL_ONES
    if tensor.dtype == torch.uint8:
        return ue8m0 and int(tensor.max()) == ALL_ONES
    if tensor.is_floating_point():
        # A NaN or inf element makes the sum NaN or inf; an overflowing sum of finite
        # values only costs the exact count.
        wide = torch.float32 if tensor.dtype == torch.float16 else None
        return not bool(torch.isfinite(tensor.sum(dtype=wide)))
    return False


def count_nonfinite(tensor: torch.Tensor, *, ue8m0: bool = False) -> int:
    """Number of elements of a stored weight or scale that decode to NaN or infinity.

    Reads the value back to the host (a sync on a GPU); ``NonFiniteLedger`` avoids that.

    Args:
        tensor: float (any width), ``float8_e4m3fn`` (NaN = exponent and mantissa all
            ones), or ``uint8``: a UE8M0 scale when ``ue8m0`` (255 = NaN), otherwise packed
            E2M1 codes (always finite).
        ue8m0: read a ``uint8`` tensor as UE8M0 exponents.

    Returns:
        The count; 0 for a finite tensor.
    """
    if not _may_hold_nonfinite(tensor, ue8m0):
        return 0
    mask = _nonfinite_mask(tensor, ue8m0)
    return 0 if mask is None else int(torch.count_nonzero(mask))


class NonFiniteLedger:
    """Non-finite counts of the device tensors loaded since the last ``check()``, by name.

    A CPU tensor is counted at once (there is no sync to save) and a bad one raises right
    away, unless ``defer_cpu``.

    Args:
        label: the layer, prefixed to the error message.
        defer_cpu: keep CPU counts pending too, as device counts are (to test that path
            without a GPU).
    """

    def __init__(self, label: str, *, defer_cpu: bool = False) -> None:
        self.label = label
        self.defer_cpu = defer_cpu
        self._names: list[tuple[str, bool]] = []  # (name, is a flag) per count element
        self._counts: list[torch.Tensor] = []  # 1-D integers on one device, not read yet

    def record(self, what: str, tensor: torch.Tensor, *, ue8m0: bool = False) -> None:
        """Count the NaN/inf of ``tensor`` (see ``count_nonfinite``); no host sync on a GPU.

        Args:
            what: the tensor named for the message, e.g. ``"expert 3 w1 weight"``.
            tensor: the weight or scale, on the device it is loaded to.
            ue8m0: read a ``uint8`` tensor as UE8M0 exponents.

        Raises:
            NonFiniteError: a CPU tensor holds NaN or inf.
        """
        if tensor.device.type == "cpu" and not self.defer_cpu:
            bad = count_nonfinite(tensor, ue8m0=ue8m0)
            if bad:
                self._raise([(what, bad)])
            return
        mask = _nonfinite_mask(tensor, ue8m0)
        if mask is not None:
            self._append(what, mask.sum(dtype=torch.int64).reshape(1), flag=False)

    def record_flag(self, what: str, flag: torch.Tensor) -> None:
        """Keep a conversion's non-finite flag (nonzero: its input held NaN/inf).

        Raises:
            NonFiniteError: a CPU flag is set.
        """
        if flag.device.type == "cpu" and not self.defer_cpu:
            if bool(flag.any()):
                self._raise([(what, FLAGGED)])
            return
        self._append(what, flag.reshape(-1)[:1].to(torch.int64), flag=True)

    def _append(self, what: str, count: torch.Tensor, *, flag: bool) -> None:
        """Keep one device count; join many into one tensor (bounded bookkeeping)."""
        if self._counts:
            count = count.to(self._counts[0].device)  # a module's tensors share one device
        self._names.append((what, flag))
        self._counts.append(count)
        if len(self._counts) > MAX_PENDING_COUNTS:
            self._counts = [torch.cat(self._counts)]

    def check(self) -> None:
        """Read the pending counts back (one host sync) and forget them.

        Raises:
            NonFiniteError: names the first bad tensor with its count, then the others.
        """
        if not self._counts:
            return
        values = torch.cat(self._counts).tolist()
        found = [
            (what, FLAGGED if flag else int(n))
            for (what, flag), n in zip(self._names, values, strict=True)
            if n
        ]
        self.clear()
        if found:
            self._raise(found)

    def _raise(self, found: list[tuple[str, int]]) -> None:
        """Raise NonFiniteError for ``(name, count or FLAGGED)`` pairs, first one first."""
        what, bad = found[0]
        held = (
            "non-finite values (NaN/inf, or weight x scale overflows float32)"
            if bad == FLAGGED
            else f"{bad} non-finite value(s) (NaN/inf)"
        )
        others = (
            f"; {len(found) - 1} more tensor(s) too: {format_keys(w for w, _ in found[1:])}"
            if len(found) > 1
            else ""
        )
        raise NonFiniteError(
            f"{self.label}: {what} holds {held}{others}; fix the checkpoint tensor: the "
            "expert would be poisoned"
        )

    def clear(self) -> None:
        """Forget every pending count."""
        self._names, self._counts = [], []
