"""Safe reload of a block's unquantized tensors: router, biases, gates, the shared MLP.

The routed experts hold a reload aside until ``finalize()`` (``megamoe.core.loading.staging``); a
block's dense tensors follow the same rule through ``DenseUpdate``, so that a reload which
fails midway leaves the previous router and shared expert serving beside the previous
experts (SPEC §5, "Safe reload"). Before the first commit there is nothing to protect:
tensors are written straight into their parameters and no extra memory is used. After it,
each tensor is validated, copied into a staging tensor of its parameter's dtype and device,
and written in place (``param.data.copy_``, storage unchanged) only by ``commit()``.

Memory: the staged copies take at most the bytes of the parameters they replace (a newer
tensor of the same name replaces the staged one), i.e. the block's router, gates and
shared MLP: small beside the routed experts (an (E, H) router is one H-wide row per
expert; the shared MLP is about one expert's size). Source tensors are not kept alive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from megamoe.core.errors import refuse_meta_tensor
from megamoe.core.numerics.formats import UNQUANTIZED_DTYPES, loads_unquantized


class PendingUpdateHolder(Protocol):
    """Anything that keeps a weight update aside and can drop it (experts, ``DenseUpdate``)."""

    def discard_pending(self) -> None:
        """Forget every tensor loaded since the last commit."""


@contextlib.contextmanager
def discard_on_error(
    *holders: PendingUpdateHolder, keep: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Drop the pending updates of ``holders`` together when the body raises.

    Args:
        *holders: the parts of one block's update (routed experts, dense tensors, shared MLP).
        keep: error types that leave the updates pending, for errors the caller can repair
            by loading more (a shard that lacks its scale) and finalizing again.
    """
    try:
        yield
    except keep:
        raise
    except BaseException:
        for holder in holders:
            holder.discard_pending()
        raise


class DenseUpdate:
    """The unquantized tensors of one module, written straight in until served, then staged.

    Args:
        label: the module's tensor prefix; messages name ``{label}.{name}``.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._serving = False  # True once commit() ran: updates are staged from then on
        self._written: set[str] = set()  # names whose values are in their parameters
        self._direct: set[str] = set()  # written straight in since the last commit
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> param, value

    def load(
        self, name: str, param: torch.Tensor, tensor: torch.Tensor, *, shape_note: str
    ) -> None:
        """Load an unquantized checkpoint tensor (router weight, bias, gate) for ``param``.

        Args:
            name: the tensor's name relative to ``label``.
            param: the module's parameter; it keeps its storage, dtype and device.
            tensor: the checkpoint tensor, bf16, fp16 or fp32.
            shape_note: what the dimensions are, e.g. ``"n_routed_experts=8, hidden_size=256"``.

        Raises:
            ValueError: a shape other than ``param``'s, a dtype other than bf16, fp16 or
                fp32, or NaN or infinity (also after the cast to ``param``'s dtype).
        """
        if loads_unquantized(tensor.dtype):
            self.write(name, param, tensor, shape_note=shape_note)
            return
        raise ValueError(
            f"{self.label}.{name} has dtype {tensor.dtype}, expected {UNQUANTIZED_DTYPES}: megamoe "
            "loads it unquantized; store it unquantized in the checkpoint"
        )

    def write(
        self, name: str, param: torch.Tensor, value: torch.Tensor, *, shape_note: str
    ) -> None:
        """Check ``value`` and write it into ``param``, or stage it once the module serves.

        Args:
            name: the tensor's name relative to ``label``.
            param: the destination parameter.
            value: a floating-point tensor of ``param``'s shape (cast on the copy).
            shape_note: what the dimensions are, for the shape error.

        Raises:
            ValueError: a shape other than ``param``'s, or NaN or infinity (in ``value``, or
                after its cast to ``param``'s dtype: values beyond its range).
        """
        refuse_meta_tensor(f"{self.label}.{name}", value)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{self.label}.{name} has shape {tuple(value.shape)}, expected "
                f"{tuple(param.shape)} ({shape_note})"
            )
        cast = value.to(device=param.device, dtype=param.dtype)
        if not bool(torch.isfinite(cast).all()):  # checked as stored: a cast may overflow
            held = (
                "NaN or infinity"
                if not bool(torch.isfinite(value).all())
                else f"values beyond {param.dtype}'s range (largest |x| "
                f"{float(value.abs().max()):.3g})"
            )
            raise ValueError(f"{self.label}.{name} holds {held}; fix the checkpoint")
        if not self._serving:
            param.data.copy_(cast)
            self._direct.add(name)
            return
        staged = cast if cast is not value else torch.empty_like(param.data).copy_(value)
        self._staged[name] = (param, staged)

    def missing(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` neither written nor staged."""
        have = self._written | self._direct | self._staged.keys()
        return [name for name in names if name not in have]

    def check_loaded(self, names: Iterable[str]) -> None:
        """Raise unless every one of ``names`` was written or is staged.

        Raises:
            ValueError: names the tensors never loaded.
        """
        missing = self.missing(names)
        if missing:
            raise ValueError(f"{self.label}: never loaded: {', '.join(missing)}")

    def commit(self) -> None:
        """Write the staged tensors in place; from now on updates are staged."""
        for name, (param, value) in self._staged.items():
            param.data.copy_(value)
            self._written.add(name)
        self._written |= self._direct
        self._staged.clear()
        self._direct.clear()
        self._serving = True

    def discard_pending(self) -> None:
        """Drop the staged tensors; before the first commit, forget what was written in."""
        self._staged.clear()
        self._direct.clear()

    @property
    def pending_bytes(self) -> int:
        """Bytes held by the staged tensors (at most the staged parameters' size)."""
        return sum(value.nbytes for _, value in self._staged.values())
