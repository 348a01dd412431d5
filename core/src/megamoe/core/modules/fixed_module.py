"""Modules whose tensors keep their format and place: what ``torch.nn.Module`` would change.

A megamoe block and its experts hold tensors in the exact dtypes the kernel and the
router's numerics need, on the device their backend's buffers live on, and change them
only through ``load_weights()`` and ``finalize()`` (which check every tensor and keep each
storage, so captured CUDA graphs stay valid). ``torch.nn.Module`` offers other ways in,
each of which would leave such a module silently wrong or broken; ``FixedModule`` closes
them:

- casts (``model.to(torch.bfloat16)``, ``.half()``, ``.float()``) leave its tensors as they
  are, so a whole model can be cast around its megamoe blocks;
- moves to another device (``.to("cuda:1")``, ``.cpu()`` of a CUDA block) are refused;
- ``load_state_dict()`` of its tensors is refused (use ``load_weights()``);
- ``copy.deepcopy``, ``copy.copy`` and pickling are refused (build another module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Self, SupportsIndex

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device; ``cuda`` without an index is any CUDA device."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class FixedModule(torch.nn.Module):
    """A ``torch.nn.Module`` whose tensors keep their dtypes and device (module docstring).

    Subclasses set ``device`` and give ``fixed_label`` (the layer, for messages).
    """

    device: torch.device

    @property
    def fixed_label(self) -> str:
        """The module named in refusals (its layer prefix)."""
        raise NotImplementedError

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """Casts and same-device moves change nothing here or below; other moves raise.

        Raises:
            ValueError: ``fn`` moves tensors to a device other than ``device``.
        """
        del recurse
        probe = fn(torch.empty(0, device=self.device))  # where fn sends a tensor of ours
        if not same_device(probe.device, self.device):
            raise ValueError(
                f"{self.fixed_label}: cannot move it from {self.device} to {probe.device}: its "
                "kernel tensors and backend buffers live there; build it with "
                f"device={str(probe.device)!r} instead (a cast keeps its tensors as they are)"
            )
        return self

    def _load_from_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        """Refuse ``load_state_dict()`` of this module's tensors.

        Raises:
            NotImplementedError: ``state_dict`` holds a tensor under ``prefix``.
        """
        if any(key.startswith(prefix) for key in state_dict):
            raise NotImplementedError(
                f"{self.fixed_label}: load_state_dict() would write its tensors unchecked and "
                "unknown to finalize(); load checkpoint tensors with load_weights() (or "
                "load_from_checkpoint()), then finalize()"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        """Refused, as :meth:`__reduce_ex__`."""
        self.__reduce_ex__(0)

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuse copying and pickling.

        Raises:
            TypeError: always; the message says to build another module.
        """
        raise TypeError(
            f"{self.fixed_label}: cannot be copied or pickled: its kernel tensors, backend "
            "buffers and process group serve one layer; build another one and load_weights() "
            "into it"
        )
