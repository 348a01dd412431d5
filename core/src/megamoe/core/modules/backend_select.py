"""Backend registry by name and the ``backend="auto"`` choice (SPEC §3.5)."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import torch

from megamoe.core.errors import CapabilityError
from megamoe.core.modules.experts_backend import ExpertsBackend
from megamoe.core.numerics.formats import WeightFormat

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts

logger = logging.getLogger("megamoe")

AUTO = "auto"
# Backend name -> module defining one ExpertsBackend subclass with that ``name``. Imported
# lazily: DeepGEMM is optional at run time.
BACKEND_MODULES = {
    "reference": "megamoe.core.backends.reference",
    "deepgemm": "megamoe.core.backends.deepgemm",
}
_logged: set[tuple[str, WeightFormat, str]] = set()
_fallbacks_logged: set[tuple[object, ...]] = set()


def backend_class(name: str) -> type[ExpertsBackend]:
    """The backend class registered as ``name``.

    Raises:
        ValueError: ``name`` is not a registered backend; the message lists them.
        ImportError: the backend's module fails to import (e.g. a broken DeepGEMM install).
        TypeError: the module defines no ``ExpertsBackend`` subclass named ``name``.
    """
    if name not in BACKEND_MODULES:
        known = ", ".join([AUTO, *BACKEND_MODULES])
        raise ValueError(f"unknown experts backend {name!r}; expected one of: {known}")
    module = importlib.import_module(BACKEND_MODULES[name])
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, ExpertsBackend)
            and getattr(value, "name", None) == name
        ):
            return value
    raise TypeError(f"{module.__name__} defines no ExpertsBackend subclass with name={name!r}")


def _reason(name: str, run_format: WeightFormat, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run here (import failures included), None when it can."""
    try:
        cls = backend_class(name)
    except ImportError as exc:
        return f"{BACKEND_MODULES[name]} does not import ({exc})"
    return cls.unsupported_reason(run_format, device)


def _auto_choice(fmt: WeightFormat, device: torch.device) -> tuple[str, str | None]:
    """What ``"auto"`` picks for ``fmt`` on ``device``, and why DeepGEMM cannot (or None)."""
    reason = _reason("deepgemm", fmt, device)
    return ("reference" if reason is not None else "deepgemm"), reason


def fuses_shared_experts(
    name: str, run_format: WeightFormat | str, device: torch.device | str | None
) -> bool:
    """Whether the backend ``resolve_backend`` would give runs fused shared experts.

    Asks the class (``ExpertsBackend.fuses_shared_experts``); nothing is instantiated or
    logged.

    Raises:
        ValueError: an unknown backend name.
    """
    fmt = WeightFormat.parse(run_format)
    dev = torch.device("cpu") if device is None else torch.device(device)
    chosen = _auto_choice(fmt, dev)[0] if name == AUTO else name
    return backend_class(chosen).fuses_shared_experts(fmt, dev)


def resolve_backend(
    name: str, run_format: WeightFormat | str, device: torch.device | str | None
) -> ExpertsBackend:
    """Instantiate the backend ``name`` for ``run_format`` on ``device``.

    ``"auto"`` picks ``deepgemm`` where it can run ``run_format`` on ``device``, else
    ``reference``; the choice and its reason are logged once (INFO, logger ``megamoe``) per
    (choice, format, device type). An explicit backend that cannot run is an error, never a
    silent fallback.

    Args:
        name: ``"auto"``, ``"reference"`` or ``"deepgemm"``.
        run_format: the experts' run format.
        device: where the experts live (None = CPU).

    Returns:
        A new backend instance.

    Raises:
        ValueError: an unknown backend name.
        CapabilityError: an explicitly requested backend cannot run ``run_format`` on
            ``device``; the message gives the reason.
    """
    fmt = WeightFormat.parse(run_format)
    dev = torch.device("cpu") if device is None else torch.device(device)
    if name == AUTO:
        chosen, reason = _auto_choice(fmt, dev)
        key = (chosen, fmt, dev.type)
        if key not in _logged:
            _logged.add(key)
            why = f"deepgemm cannot: {reason}" if reason else "deepgemm can run it"
            logger.info(
                "megamoe experts backend auto -> %s for %s on %s (%s); pass backend=... "
                "to choose explicitly",
                chosen,
                fmt.value,
                dev,
                why,
            )
        return backend_class(chosen)()
    if name not in BACKEND_MODULES:
        backend_class(name)  # raises the unknown-name error
    reason = _reason(name, fmt, dev)
    if reason is not None:
        raise CapabilityError(
            f"experts backend {name!r} cannot run {fmt.value} on {dev}: {reason}; "
            "pass backend='reference' (or backend='auto') to use the torch reference path"
        )
    return backend_class(name)()


def layer_backend(name: str, experts: MegaMoEExperts) -> ExpertsBackend:
    """The backend for one layer: :func:`resolve_backend`, then its ``check_layer``.

    ``"auto"`` asks more than the format and the device here: where DeepGEMM is chosen but
    refuses this layer with a ``CapabilityError`` (sizes its kernel does not run, such as
    the Hopper kernel's multiples of 512 and 256, a SwiGLU clamp the installed kernel
    lacks), the layer runs on the reference backend instead, with a warning (logger
    ``megamoe``) once per layer shape naming the first such layer and the reason. An
    explicit backend still raises.

    Raises:
        as :func:`resolve_backend`, and what the backend's ``check_layer`` raises (under
        ``"auto"`` only what is not a ``CapabilityError``: a wrong process group, ...).
    """
    backend = resolve_backend(name, experts.weight_format, experts.device)
    try:
        backend.check_layer(experts)
    except CapabilityError as exc:
        if name != AUTO or backend.name == "reference":
            raise
        shape = (
            experts.weight_format, experts.hidden_size, experts.intermediate_size,
            experts.swiglu_limit is not None, experts.num_shared_experts, experts.device.type,
        )  # fmt: skip
        if shape not in _fallbacks_logged:
            _fallbacks_logged.add(shape)
            logger.warning(
                "megamoe experts backend auto -> reference for %s and every layer of its "
                "sizes: %s cannot run it (%s); the reference backend is far slower on a GPU",
                experts.layout.label,
                backend.name,
                exc,
            )
        backend = backend_class("reference")()
        backend.check_layer(experts)
    return backend
