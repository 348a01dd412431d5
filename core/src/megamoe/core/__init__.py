"""megamoe-core: checkpoint experts to DeepGEMM MegaMoE kernel weights, engine-agnostic."""

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
