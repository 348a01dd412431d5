"""Every MoE layer of a transformers-written checkpoint, loaded by megamoe, vs the oracle.

Tests only (see ``transformers_oracle``). The path is the one users take:
``open_checkpoint`` -> ``adapter.build_block`` -> ``block.load_from_checkpoint``, on the
reference backend (CPU). Each layer's output is compared with a float64 copy of
transformers' own MoE module (``max |ours - oracle| / max |oracle|``), and so are the
experts each token is routed to, on tokens whose selection margin keeps them from ties.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers_oracle import (
    TinyModel,
    build_tiny_model,
    declare_mtp_without_tensors,
    reference_moe,
    save_checkpoint,
)

from megamoe.core import ParallelSettings
from megamoe.core.adapters import MoEBlock, open_checkpoint
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.modules.parallel import single_rank_group

TOKENS = 64
MIN_MARGIN = 1e-3  # selection-score gap below which bf16 rounding may flip a choice
MIN_AWAY_FROM_TIES = 0.75  # share of tokens the routing comparison must cover


@dataclass(frozen=True)
class LayerResult:
    """One MoE layer compared with the oracle.

    Attributes:
        prefix: the layer's tensor prefix.
        is_mtp: the layer belongs to the MTP drafter.
        error: ``max |ours - oracle| / max |oracle|`` over the layer output.
        unclamped_error: the same against the oracle without the SwiGLU clamp (None when
            not asked).
        compared_tokens: tokens away from ties whose experts were compared.
        routing_mismatches: of those, tokens whose chosen experts differ.
    """

    prefix: str
    is_mtp: bool
    error: float
    unclamped_error: float | None
    compared_tokens: int
    routing_mismatches: int


def tokens(hidden_size: int, seed: int = 0) -> torch.Tensor:
    """(TOKENS, hidden_size) bf16 block inputs of unit size."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, hidden_size, generator=gen).to(torch.bfloat16)


def _chosen_experts(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Our block's top-k expert ids per token, sorted per row."""
    router = getattr(block, "route", None) or block.gate
    _, ids = router(x)
    return ids.long().sort(dim=-1).values


def compare_checkpoint(
    path: Path, tiny: TinyModel, *, unclamped: bool = False
) -> tuple[CheckpointReader, list[LayerResult]]:
    """Every MoE layer of checkpoint ``path`` (written from ``tiny``) against the oracle.

    Args:
        path: the checkpoint directory.
        tiny: the transformers model it was written from (its MoE blocks by prefix).
        unclamped: also compare with the oracle run without GLM's SwiGLU clamp.

    Returns:
        The reader and one result per layer the reader lists.
    """
    reader, adapter = open_checkpoint(path)
    parallel = ParallelSettings(ep_group=single_rank_group())
    results = []
    for layer in reader.layers:
        block = adapter.build_block(reader.config, layer, parallel=parallel, backend="reference")
        block.load_from_checkpoint(reader)
        hidden = block.experts.hidden_size
        x = tokens(hidden, seed=layer.index + 100 * layer.is_mtp)
        with torch.no_grad():
            ours = block(x).double()
        oracle = reference_moe(tiny, layer.prefix, x)
        scale = oracle.output.abs().max()
        away = oracle.margin > MIN_MARGIN
        mismatches = (_chosen_experts(block, x) != oracle.topk_ids).any(dim=-1) & away
        off = None
        if unclamped:
            free = reference_moe(tiny, layer.prefix, x, clamp=False).output
            off = float((ours - free).abs().max() / free.abs().max())
        results.append(
            LayerResult(
                prefix=layer.prefix,
                is_mtp=layer.is_mtp,
                error=float((ours - oracle.output).abs().max() / scale),
                unclamped_error=off,
                compared_tokens=int(away.sum()),
                routing_mismatches=int(mismatches.sum()),
            )
        )
    return reader, results


class _Messages(logging.Handler):
    """Collects the warnings logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_mtp_declared_only(path: Path, family: str, tolerance: float) -> None:
    """A config declaring one MTP layer it does not hold loads its main layers, and says so.

    What transformers' ``save_pretrained`` writes for a release config: the MTP count
    stays, the MTP tensors do not.

    Raises:
        AssertionError: a layer is missing or off by more than ``tolerance``, an MTP layer
            is listed, or the warning was not given.
    """
    tiny = build_tiny_model(family, seed=3)
    save_checkpoint(tiny, path)
    declare_mtp_without_tensors(path, 1)
    logger, told = logging.getLogger("megamoe"), _Messages()
    logger.addHandler(told)
    try:
        reader, results = compare_checkpoint(path, tiny)
    finally:
        logger.removeHandler(told)
    seen = told.messages
    assert {r.prefix for r in results} == set(tiny.moe_blocks), results
    assert all(r.error <= tolerance for r in results), results
    assert not any(layer.is_mtp for layer in reader.layers)
    assert any("declares 1 MTP layer(s) but holds the experts of 0" in m for m in seen), seen
