"""megamoe-core: checkpoint experts to DeepGEMM MegaMoE kernel weights, engine-agnostic.

The public names below are imported on first use (PEP 562), so importing a light module
of the package (``megamoe.core.errors``, the ``megamoe`` command's parser) does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megamoe.core.adapters import ModelAdapter, MoEBlock, MoELayer, SyntheticSizes
    from megamoe.core.backends.reference import ReferenceBackend
    from megamoe.core.backends.select import resolve_backend
    from megamoe.core.checkpoint import CheckpointReader, open_checkpoint
    from megamoe.core.convert import convert_checkpoint
    from megamoe.core.errors import (
        CapabilityError,
        CheckpointError,
        FormatMismatchError,
        IncompleteShardsError,
        MissingExpertsError,
        NonFiniteError,
    )
    from megamoe.core.experts import MegaMoEExperts
    from megamoe.core.formats import WeightFormat, resolve_formats
    from megamoe.core.pairing import ShardPairing
    from megamoe.core.parallel import ParallelSettings
    from megamoe.core.tagging import KernelTag
    from megamoe.core.testing import write_synthetic_checkpoint

# Public name -> the module that defines it.
_EXPORTS = {
    "CapabilityError": "megamoe.core.errors",
    "CheckpointError": "megamoe.core.errors",
    "CheckpointReader": "megamoe.core.checkpoint",
    "FormatMismatchError": "megamoe.core.errors",
    "IncompleteShardsError": "megamoe.core.errors",
    "KernelTag": "megamoe.core.tagging",
    "MegaMoEExperts": "megamoe.core.experts",
    "MissingExpertsError": "megamoe.core.errors",
    "MoEBlock": "megamoe.core.adapters",
    "MoELayer": "megamoe.core.adapters",
    "ModelAdapter": "megamoe.core.adapters",
    "NonFiniteError": "megamoe.core.errors",
    "ParallelSettings": "megamoe.core.parallel",
    "ReferenceBackend": "megamoe.core.backends.reference",
    "ShardPairing": "megamoe.core.pairing",
    "SyntheticSizes": "megamoe.core.adapters",
    "WeightFormat": "megamoe.core.formats",
    "convert_checkpoint": "megamoe.core.convert",
    "open_checkpoint": "megamoe.core.checkpoint",
    "resolve_backend": "megamoe.core.backends.select",
    "resolve_formats": "megamoe.core.formats",
    "write_synthetic_checkpoint": "megamoe.core.testing",
}

__all__ = [
    "CapabilityError",
    "CheckpointError",
    "CheckpointReader",
    "FormatMismatchError",
    "IncompleteShardsError",
    "KernelTag",
    "MegaMoEExperts",
    "MissingExpertsError",
    "MoEBlock",
    "MoELayer",
    "ModelAdapter",
    "NonFiniteError",
    "ParallelSettings",
    "ReferenceBackend",
    "ShardPairing",
    "SyntheticSizes",
    "WeightFormat",
    "convert_checkpoint",
    "open_checkpoint",
    "resolve_backend",
    "resolve_formats",
    "write_synthetic_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megamoe.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
