"""Exception types of megamoe, each a subclass of the builtin a caller would catch."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

MAX_LISTED = 8  # keys named in one message; the rest are counted


def _natural(key: Hashable) -> tuple[Any, ...]:
    """Sort key: None first, then numbers by value, then strings; tuples element-wise."""
    parts = key if isinstance(key, tuple) else (key,)
    return tuple(
        (0, 0, "") if p is None else (1, p, "") if isinstance(p, int) else (2, 0, str(p))
        for p in parts
    )


def format_keys(keys: Iterable[Hashable]) -> str:
    """Sorted, truncated listing of keys for an error message."""
    ordered = sorted(keys, key=_natural)
    shown = ", ".join(repr(k) for k in ordered[:MAX_LISTED])
    more = len(ordered) - MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def note_source(err: BaseException, name: str, path: object, also: str = "") -> None:
    """Add to ``err`` the note of where tensor ``name`` was read: ``path`` (then ``also``).

    The CLI prints an error's notes on its one line; a traceback shows them below it.
    """
    err.add_note(f"{name} was read from {path}{also}")


def refuse_meta_tensor(what: str, tensor: Any) -> None:
    """Raise ``ValueError`` naming ``what`` when ``tensor`` is a meta tensor (no data).

    torch's own error (``Cannot copy out of meta tensor``) names neither the tensor nor the
    cause: a model built on the meta device handing its placeholders to a load.
    """
    if getattr(tensor, "is_meta", False):
        raise ValueError(
            f"{what} is a meta tensor (a shape without data, as a model built on the meta "
            "device holds); load the checkpoint's tensors instead"
        )


class IncompleteShardsError(ValueError):
    """Some expert shards received only their weight or only their scale.

    The message names the missing checkpoint tensors (``up_proj.weight_scale_inv`` of local
    expert 2, ``gate_proj.weight`` of the shared expert).

    Attributes:
        missing: the unpaired keys, each ``(local expert id or None, shard id)``,
            mapped to the halves that are still missing.

    Args:
        prefix: the layer or module the shards belong to.
        missing: as the attribute.
        shard_names: shard id -> projection name for the message
            (``megamoe.core.loading.pairing.SHARD_TO_PROJ``); ids without a name are shown as
            they are.
    """

    def __init__(
        self,
        prefix: str,
        missing: Mapping[Any, tuple[str, ...]],
        shard_names: Mapping[str, str] | None = None,
    ) -> None:
        self.missing = dict(missing)

        def tensors(key: Any, halves: tuple[str, ...]) -> str:
            expert, shard = key
            proj = (shard_names or {}).get(shard, shard)
            owner = "the shared expert" if expert is None else f"local expert {expert}"
            return f"{' and '.join(f'{proj}.{half}' for half in halves)} of {owner}"

        ordered = sorted(self.missing.items(), key=lambda kv: _natural(kv[0]))
        listed = ", ".join(tensors(key, halves) for key, halves in ordered[:MAX_LISTED])
        more = len(self.missing) - MAX_LISTED
        super().__init__(
            f"{prefix}: {len(self.missing)} expert projection(s) lack a tensor: {listed}"
            f"{f' and {more} more' if more > 0 else ''}; load the missing tensors (local "
            "expert k is this rank's k-th, checkpoint expert experts_start_idx + k), then "
            "finalize"
        )


class NonFiniteError(ValueError):
    """A weight, scale or activation holds NaN or infinity."""


class MissingExpertsError(ValueError):
    """Local expert slots that never received their tensors."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or they disagree with its config."""


class UnsupportedCheckpointError(CheckpointError, NotImplementedError):
    """A valid checkpoint megamoe cannot run (a quantization method, an activation, ...)."""


class NoMoELayerError(CheckpointError):
    """A checkpoint whose config declares no MoE layer: nothing to load, verify or convert."""


class NoAdapterError(CheckpointError, LookupError):
    """No installed adapter claims a checkpoint's ``config.json``."""


class InvalidScaleError(ValueError):
    """A block-FP8 scale is zero, negative or not finite."""


class UsageError(ValueError):
    """A command-line option has a value the command cannot use (the CLI exits 2)."""


class CapabilityError(RuntimeError):
    """The installed DeepGEMM or the device lacks what the chosen path needs."""


class KernelSizeError(CapabilityError, ValueError):
    """A kernel does not run a layer of these sizes (also a ValueError: the caller's sizes)."""


class FormatMismatchError(ValueError):
    """Tagged kernel tensors or buffers of different formats were combined."""
