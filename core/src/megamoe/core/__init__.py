"""megamoe-core: checkpoint experts to DeepGEMM MegaMoE kernel weights, engine-agnostic.

The public names below are imported on first use (PEP 562), so importing a light module
of the package (``megamoe.core.errors``, the ``megamoe`` command's parser) does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megamoe.core.adapters import ModelAdapter, MoEBlock, SyntheticSizes, open_checkpoint
    from megamoe.core.backends.reference import ReferenceBackend
    from megamoe.core.checkpoint.layers import MoELayer
    from megamoe.core.checkpoint.reader import CheckpointReader
    from megamoe.core.convert import convert_checkpoint
    from megamoe.core.errors import (
        CapabilityError,
        CheckpointError,
        FormatMismatchError,
        IncompleteShardsError,
        MissingExpertsError,
        NonFiniteError,
    )
    from megamoe.core.loading.pairing import ShardPairing
    from megamoe.core.loading.tagging import KernelTag
    from megamoe.core.modules.backend_select import resolve_backend
    from megamoe.core.modules.experts import MegaMoEExperts
    from megamoe.core.modules.parallel import ParallelSettings
    from megamoe.core.numerics.formats import WeightFormat, resolve_formats
    from megamoe.core.testing import write_synthetic_checkpoint

# Public name -> the module that defines it.
_EXPORTS = {
    "CapabilityError": "megamoe.core.errors",
    "CheckpointError": "megamoe.core.errors",
    "CheckpointReader": "megamoe.core.checkpoint.reader",
    "FormatMismatchError": "megamoe.core.errors",
    "IncompleteShardsError": "megamoe.core.errors",
    "KernelTag": "megamoe.core.loading.tagging",
    "MegaMoEExperts": "megamoe.core.modules.experts",
    "MissingExpertsError": "megamoe.core.errors",
    "MoEBlock": "megamoe.core.adapters",
    "MoELayer": "megamoe.core.checkpoint.layers",
    "ModelAdapter": "megamoe.core.adapters",
    "NonFiniteError": "megamoe.core.errors",
    "ParallelSettings": "megamoe.core.modules.parallel",
    "ReferenceBackend": "megamoe.core.backends.reference",
    "ShardPairing": "megamoe.core.loading.pairing",
    "SyntheticSizes": "megamoe.core.adapters",
    "WeightFormat": "megamoe.core.numerics.formats",
    "convert_checkpoint": "megamoe.core.convert",
    "open_checkpoint": "megamoe.core.adapters",
    "resolve_backend": "megamoe.core.modules.backend_select",
    "resolve_formats": "megamoe.core.numerics.formats",
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
