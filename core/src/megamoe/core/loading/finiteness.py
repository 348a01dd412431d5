"""Data checks of loaded weights and scales, read back once per load call (SPEC §5).

Two checks: no weight or scale may decode to NaN or infinity, and a block-FP8 scale must be
finite, > 0 and at most ``MAX_BLOCK_SCALE`` (a zero scale erases its 128x128 block, a
negative one flips its sign, a larger one makes E4M3's 448 overflow float32; none is a
quantization a checkpoint writer produces). A UE8M0 (MX) scale byte counts as non-finite
from the one that takes its format's largest element past float32 on (``mx_scale_limit``:
247 for MXFP8, 253 for MXFP4; 255 is UE8M0's NaN): such a block decodes to infinity.

A checkpoint tensor is checked where it will live, after its one copy to the experts'
device. On a GPU each tensor's count of NaN/inf stays on the device: ``NonFiniteLedger``
keeps it beside the tensor's name, and ``check()`` reads every count back in one transfer
(one host sync per load call instead of one per tensor) and raises ``NonFiniteError``
naming the bad tensors. On the CPU a one-pass test decides first whether the count (a
slower pass) is needed at all.
"""

from __future__ import annotations

import torch

from megamoe.core.errors import InvalidScaleError, NonFiniteError, format_keys
from megamoe.core.numerics.formats import WeightFormat

ALL_ONES = 0xFF  # UE8M0 NaN; float8_e4m3fn NaN once its sign bit is set
SIGN_BIT = 0x80
MAX_PENDING_COUNTS = 1024  # device counts kept apart before they are joined into one tensor
FLAGGED = -1  # count of a conversion flag: non-finite values, number unknown
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLOAT32_MAX = torch.finfo(torch.float32).max
# The largest block-FP8 scale whose block decodes to finite float32 values (448 x scale).
MAX_BLOCK_SCALE = FLOAT32_MAX / E4M3_MAX
UE8M0_BIAS = 127


def _ue8m0_overflow_byte(element_max: float) -> int:
    """The least UE8M0 byte whose scale, 2^(byte - 127), takes ``element_max`` past float32."""
    return next(b for b in range(ALL_ONES) if element_max * 2.0 ** (b - UE8M0_BIAS) > FLOAT32_MAX)


_MX_SCALE_LIMIT = {
    WeightFormat.MXFP8: _ue8m0_overflow_byte(E4M3_MAX),
    WeightFormat.MXFP4: _ue8m0_overflow_byte(E2M1_MAX),
}


def mx_scale_limit(fmt: WeightFormat) -> int | None:
    """For an MX format, the least scale byte whose block decodes to inf or NaN; else None.

    Bytes from it on (255, UE8M0's NaN, included) count as non-finite in ``count_nonfinite``.
    """
    return _MX_SCALE_LIMIT.get(fmt)


def _nonfinite_mask(tensor: torch.Tensor, ue8m0_from: int | None) -> torch.Tensor | None:
    """Boolean mask of the elements that decode to NaN or inf; None when none can."""
    if tensor.dtype == torch.float8_e4m3fn:
        return (tensor.view(torch.uint8) | SIGN_BIT) == ALL_ONES  # both NaN bytes -> 0xFF
    if tensor.dtype == torch.uint8:
        return None if ue8m0_from is None else tensor >= ue8m0_from
    if tensor.is_floating_point():
        return ~torch.isfinite(tensor)
    return None


def _may_hold_nonfinite(tensor: torch.Tensor, ue8m0_from: int | None) -> bool:
    """One pass, no temporaries of the tensor's size: False proves every element finite."""
    if tensor.numel() == 0:
        return False
    if tensor.dtype == torch.float8_e4m3fn:
        return int((tensor.view(torch.uint8) | SIGN_BIT).max()) == ALL_ONES
    if tensor.dtype == torch.uint8:
        return ue8m0_from is not None and int(tensor.max()) >= ue8m0_from
    if tensor.is_floating_point():
        # A NaN or inf element makes the sum NaN or inf; an overflowing sum of finite
        # values only costs the exact count.
        wide = torch.float32 if tensor.dtype == torch.float16 else None
        return not bool(torch.isfinite(tensor.sum(dtype=wide)))
    return False


def _bad_scale_summary(scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[bad count, flat index of the first bad scale, its value]`` (no host sync)."""
    # NaN and infinity are the non-finite check's.
    huge = (scale > MAX_BLOCK_SCALE) & (scale < torch.inf)
    bad = ((scale <= 0) | huge).reshape(-1)
    first = torch.argmax(bad.to(torch.uint8)).reshape(1)
    value = scale.reshape(-1).index_select(0, first)  # a tensor index: no host sync
    return torch.cat([bad.sum().reshape(1), first, value.reshape(1)]).double()


def check_block_scales(scale: torch.Tensor, what: str) -> None:
    """Raise unless every block-FP8 scale is > 0 and at most ``MAX_BLOCK_SCALE`` (a sync).

    NaN and infinity are ``count_nonfinite``'s to report (``NonFiniteError``).

    Args:
        scale: float32 block scales, (rows/128, cols/128) or with leading dimensions.
        what: the tensor for the message, e.g. ``"expert 3 gate_proj.weight_scale_inv"``.

    Raises:
        InvalidScaleError: names ``what``, the first bad block and how many are bad.
    """
    _raise_bad_scales(what, tuple(scale.shape), _bad_scale_summary(scale).tolist())


def _raise_bad_scales(what: str, shape: tuple[int, ...], summary: list[float]) -> None:
    count, first, value = summary
    if not count:
        return
    block: tuple[int, ...] = ()
    rest = int(first)
    for dim in reversed(shape):
        block = (rest % dim, *block)
        rest //= dim
    others = f" ({int(count)} bad blocks in all)" if count > 1 else ""
    raise InvalidScaleError(
        f"{what}: block {block} has scale {value!r}{others}; block-FP8 scales must be > 0 "
        f"and <= {MAX_BLOCK_SCALE:.3g} (0 erases the block, a negative scale flips it, a "
        "larger one overflows float32 at E4M3's 448): fix the checkpoint tensor"
    )


def count_nonfinite(tensor: torch.Tensor, *, ue8m0_from: int | None = None) -> int:
    """Number of elements of a stored weight or scale that decode to NaN or infinity.

    Reads the value back to the host (a sync on a GPU); ``NonFiniteLedger`` avoids that.

    Args:
        tensor: float (any width), ``float8_e4m3fn`` (NaN = exponent and mantissa all
            ones), or ``uint8``: a UE8M0 scale when ``ue8m0_from`` is given, otherwise
            packed E2M1 codes (always finite).
        ue8m0_from: read a ``uint8`` tensor as UE8M0 exponents, bytes from this one on
            non-finite (``mx_scale_limit`` of the weights' format).

    Returns:
        The count; 0 for a finite tensor.
    """
    if not _may_hold_nonfinite(tensor, ue8m0_from):
        return 0
    mask = _nonfinite_mask(tensor, ue8m0_from)
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
        # Block-FP8 scales: (name, shape) and the summary of each, not read yet.
        self._scales: list[tuple[str, tuple[int, ...]]] = []
        self._scale_summaries: list[torch.Tensor] = []

    def record(self, what: str, tensor: torch.Tensor, *, ue8m0_from: int | None = None) -> None:
        """Count the NaN/inf of ``tensor`` (see ``count_nonfinite``); no host sync on a GPU.

        Args:
            what: the tensor named for the message, e.g. ``"expert 3 w1 weight"``.
            tensor: the weight or scale, on the device it is loaded to.
            ue8m0_from: read a ``uint8`` tensor as UE8M0 exponents, non-finite from this
                byte on (``mx_scale_limit``).

        Raises:
            NonFiniteError: a CPU tensor holds NaN or inf.
        """
        if tensor.device.type == "cpu" and not self.defer_cpu:
            bad = count_nonfinite(tensor, ue8m0_from=ue8m0_from)
            if bad:
                self._raise([(what, bad)])
            return
        mask = _nonfinite_mask(tensor, ue8m0_from)
        if mask is not None:
            self._append(what, mask.sum(dtype=torch.int64).reshape(1), flag=False)

    def record_block_scale(self, what: str, scale: torch.Tensor) -> None:
        """Check that a block-FP8 scale is > 0 (``record`` checks NaN/inf); no sync on a GPU.

        Args:
            what: the tensor named for the message.
            scale: the float32 block scales, on the device they are loaded to.

        Raises:
            InvalidScaleError: a CPU scale breaks the rule (device ones: at ``check()``).
        """
        if scale.device.type == "cpu" and not self.defer_cpu:
            check_block_scales(scale, f"{self.label}: {what}")
            return
        self._scales.append((what, tuple(scale.shape)))
        self._scale_summaries.append(_bad_scale_summary(scale))
        if len(self._scale_summaries) > MAX_PENDING_COUNTS:
            self._scale_summaries = [torch.cat(self._scale_summaries)]

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
        """Read the pending counts and scale checks back (one host sync) and forget them.

        Raises:
            NonFiniteError: names the first bad tensor with its count, then the others.
            InvalidScaleError: a block-FP8 scale that is zero or negative (first one); NaN
                and inf are reported first.
        """
        if not self._counts and not self._scale_summaries:
            return
        parts = [torch.cat(self._counts).double()] if self._counts else []
        parts += [s.reshape(-1) for s in self._scale_summaries]
        device = parts[0].device
        values = torch.cat([p.to(device) for p in parts]).tolist()  # the one read-back
        counts, summaries = values[: len(self._names)], values[len(self._names) :]
        found = [
            (what, FLAGGED if flag else int(n))
            for (what, flag), n in zip(self._names, counts, strict=True)
            if n
        ]
        scales = self._scales
        self.clear()
        if found:
            self._raise(found)
        for i, (what, shape) in enumerate(scales):
            _raise_bad_scales(f"{self.label}: {what}", shape, summaries[3 * i : 3 * i + 3])

    def _raise(self, found: list[tuple[str, int]]) -> None:
        """Raise NonFiniteError for ``(name, count or FLAGGED)`` pairs, first one first."""
        what, bad = found[0]
        held = (
            "non-finite values (NaN/inf, or weight x scale overflows float32)"
            if bad == FLAGGED
            else f"{bad} non-finite value(s) (NaN/inf, or a scale whose block overflows float32)"
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
        self._scales, self._scale_summaries = [], []
