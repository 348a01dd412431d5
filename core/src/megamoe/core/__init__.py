"""megamoe-core: checkpoint experts to DeepGEMM MegaMoE kernel weights, engine-agnostic."""

from megamoe.core.adapters import ModelAdapter, MoEBlock, MoELayer, SyntheticSizes
from megamoe.core.errors import (
    CapabilityError,
    CheckpointError,
    FormatMismatchError,
    IncompleteShardsError,
    MissingExpertsError,
    NonFiniteError,
)
from megamoe.core.formats import WeightFormat, resolve_formats
from megamoe.core.pairing import ShardPairing
from megamoe.core.parallel import ParallelSettings

__all__ = [
    "CapabilityError",
    "CheckpointError",
    "FormatMismatchError",
    "IncompleteShardsError",
    "MissingExpertsError",
    "MoEBlock",
    "MoELayer",
    "ModelAdapter",
    "NonFiniteError",
    "ParallelSettings",
    "ShardPairing",
    "SyntheticSizes",
    "WeightFormat",
    "resolve_formats",
]
