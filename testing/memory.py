"""What a layer's experts keep resident, against the bytes their weights need.

``resident_bytes`` counts each distinct storage once: the experts' parameters and buffers
(weights, scales, staging buffers) and the tensors their backend keeps for its kernel
(``backend.kernel_weights``; a piece that is a view of a parameter shares its storage and
is not counted again). ``canonical_bytes`` is what the weights and scales of the run
format take, one copy: the floor any layout can reach. Their ratio is what an engine pays
per layer beyond the weights themselves (DeepGEMM's symmetric buffer is activation
memory, shared by layers of one shape, and not counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from megamoe.core.checkpoint.expert_names import projection_specs
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT

if TYPE_CHECKING:
    from megamoe.core.modules.experts import MegaMoEExperts


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def resident_bytes(experts: MegaMoEExperts) -> int:
    """Bytes the experts module and its backend keep resident (distinct storages)."""
    tensors = [*experts.parameters(), *experts.buffers(), *experts.backend.kernel_weights.values()]
    return distinct_storage_bytes(tensors)


def canonical_bytes(experts: MegaMoEExperts) -> int:
    """Bytes of one copy of the run-format weights and scales of every kernel slot."""
    fmt, h, i = experts.weight_format, experts.hidden_size, experts.intermediate_size
    per_slot = sum(
        spec.nbytes
        for rows, cols in ((2 * i, h), (h, i))
        for spec in projection_specs(fmt, rows, cols, BLOCK_FP8_DEFAULT)
        if spec is not None
    )
    return per_slot * experts.layout.num_slots
