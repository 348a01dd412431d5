"""``megamoe inspect``: what a checkpoint holds and what loading it here would do.

Reads ``config.json`` and the safetensors headers only, validated as every command
validates a checkpoint (``megamoe.core.checkpoint.reader``), never tensor data.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe.core.adapters import ModelAdapter, open_checkpoint
from megamoe.core.backends.deepgemm import KERNEL_KINDS
from megamoe.core.backends.small_batch import (
    CARD_COSTS,
    DEFAULT_CARD,
    LayerWork,
    crossover_tokens,
    layout_reason,
)
from megamoe.core.checkpoint.expert_names import projection_shape, projection_specs
from megamoe.core.checkpoint.hf_config import defaulted_keys
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.errors import UsageError
from megamoe.core.numerics.formats import WeightFormat, detect_arch, resolve_formats

EXPERTS_PATH_SCAN = 65536  # the most tokens per call inspect considers for the crossover


@dataclass(frozen=True)
class LayerPlan:
    """How one MoE layer would load on the target.

    Attributes:
        layer: the layer.
        run_format: the format its experts would run in.
        kernel_bytes_per_rank: routed-expert kernel weights and scales on one rank.
    """

    layer: MoELayer
    run_format: WeightFormat
    kernel_bytes_per_rank: int

    @property
    def conversion(self) -> str:
        """``"none"`` or ``"<stored> -> <run> (requantized)"`` (while loading)."""
        if self.run_format is self.layer.checkpoint_format:
            return "none"
        return f"{self.layer.checkpoint_format.value} -> {self.run_format.value} (requantized)"


@dataclass(frozen=True)
class CheckpointPlan:
    """A checkpoint's MoE layers as they would load on the target.

    Attributes:
        path: the checkpoint.
        adapter: the adapter that claims it.
        model_type: ``config.json`` ``model_type``.
        num_files: safetensors files.
        tensor_bytes: bytes of all tensors.
        dims: ``(experts, hidden, intermediate)``.
        swiglu_limit: the experts' SwiGLU clamp, None for none.
        arch: the target (``sm90``, ``sm100`` or ``reference``).
        ep_size: expert-parallel ranks.
        layers: one plan per MoE layer.
        defaulted: keys ``config.json`` leaves out, with the transformers default assumed.
        top_k: experts per token.
    """

    path: Path
    adapter: ModelAdapter
    model_type: str
    num_files: int
    tensor_bytes: int
    dims: tuple[int, int, int]
    swiglu_limit: float | None
    arch: str
    ep_size: int
    layers: tuple[LayerPlan, ...]
    defaulted: Mapping[str, Any] = field(default_factory=dict)
    top_k: int = 1

    @property
    def kernel_bytes_per_rank(self) -> int:
        """All layers' routed-expert kernel bytes on one rank."""
        return sum(p.kernel_bytes_per_rank for p in self.layers)

    def experts_path(self) -> str:
        """Which path runs the routed experts, by call size (``experts_path="auto"``).

        On sm90 with one rank, block-FP8 layers take the small-batch kernels for calls of up
        to their crossover token count on the card (``backends.small_batch``: each card
        measured has its own), MegaMoE above; elsewhere MegaMoE takes every call.
        """
        experts, hidden, inter = self.dims
        reasons = {
            p: layout_reason(KERNEL_KINDS.get((self.arch, p.run_format), "reference"),
                             f"--arch {self.arch}", self.ep_size, 0)
            for p in self.layers
        }  # fmt: skip
        small = [p for p, reason in reasons.items() if reason is None]
        if not small:
            return f"MegaMoE for every call (the small-batch path: {next(iter(reasons.values()))})"
        work = LayerWork(experts, experts, self.top_k, hidden, inter)
        layers = "every layer" if len(small) == len(self.layers) else f"{len(small)} layer(s)"
        by_crossover: dict[int, list[str]] = {}  # cards whose rules agree, said once
        for card in CARD_COSTS:
            tokens = crossover_tokens(work, EXPERTS_PATH_SCAN, card)
            by_crossover.setdefault(tokens, []).append(card)
        cards = "; ".join(
            f"on an {' and an '.join(names)}: {calls_taken(tokens)}"
            for tokens, names in by_crossover.items()
        )
        return (
            f"small-batch kernels {cards} ({layers}; experts_path='auto', capped by the engine's "
            f"max_num_tokens or small_batch_max_tokens; other cards take the {DEFAULT_CARD}'s "
            f"rule); scratch {work.scratch_bytes_per_token / 1000:.1f} KB per token it may "
            "take, shared by the layers of one shape"
        )


def calls_taken(tokens: int) -> str:
    """Which calls the small-batch kernels take, given a card's crossover of ``tokens``."""
    if tokens == 0:
        return "none (the rule predicts MegaMoE faster at every size)"
    if tokens == EXPERTS_PATH_SCAN:
        return (
            f"every call up to the {tokens} tokens considered (the rule never predicts "
            "MegaMoE faster there)"
        )
    return f"calls of up to {tokens} tokens, MegaMoE above"


def expert_kernel_bytes(fmt: WeightFormat, hidden_size: int, intermediate_size: int) -> int:
    """Bytes of one routed expert's kernel weights and scales (gate, up, down) in ``fmt``."""
    total = 0
    for proj in ("gate_proj", "up_proj", "down_proj"):
        specs = projection_specs(fmt, *projection_shape(proj, hidden_size, intermediate_size))
        total += sum(spec.nbytes for spec in specs if spec is not None)
    return total


def run_formats(
    layers: Sequence[MoELayer], moe_format: WeightFormat | str | None, arch: str
) -> list[WeightFormat]:
    """The format each layer's experts run as on ``arch`` (MTP layers ignore ``moe_format``).

    Conversions warn, as ``resolve_formats`` does.

    Raises:
        UsageError: ``moe_format`` is one ``arch`` cannot run, or that no stored format
            converts to (a ``ValueError``; the message names the formats that run).
        ValueError: a stored format ``arch`` cannot run.
    """
    runs = []
    for layer in layers:
        forced = None if layer.is_mtp else moe_format
        try:
            _, run = resolve_formats(layer.checkpoint_format, forced, arch)
        except ValueError as exc:
            if forced is None:
                raise
            raise UsageError(str(exc)) from exc
        runs.append(run)
    return runs


def plan_checkpoint(
    path: str | Path,
    *,
    ep_size: int = 1,
    arch: str | None = None,
    moe_format: WeightFormat | str | None = None,
) -> CheckpointPlan:
    """Describe how a checkpoint's MoE layers would load.

    Args:
        path: the checkpoint directory.
        ep_size: expert-parallel ranks the experts are spread over.
        arch: target (``sm90``, ``sm100``, ``reference``); None detects this machine.
        moe_format: a forced run format (MTP drafter layers keep the default).

    Returns:
        The plan.

    Raises:
        UsageError: ``ep_size`` does not divide the experts, or ``moe_format`` is one the
            target cannot run (each a ``ValueError``).
        ValueError: a stored format the target cannot run.
        CheckpointError: a missing, unreadable or mismatching tensor (headers only).
    """
    reader, adapter = open_checkpoint(path)
    num_experts, hidden, inter = adapter.expert_dims(reader.config)
    if ep_size < 1 or num_experts % ep_size:
        raise UsageError(
            f"--ep-size {ep_size} does not divide the {num_experts} routed experts; MegaMoE "
            "places experts linearly in equal parts per rank"
        )
    arch = detect_arch("cuda") if arch is None else arch
    with warnings.catch_warnings():  # the table states every conversion
        warnings.simplefilter("ignore")
        runs = run_formats(reader.layers, moe_format, arch)
    plans = [
        LayerPlan(layer, run, num_experts // ep_size * expert_kernel_bytes(run, hidden, inter))
        for layer, run in zip(reader.layers, runs, strict=True)
    ]
    files = set(reader.weight_map.values())
    cfg = adapter.parse_config(reader.config)
    return CheckpointPlan(
        path=reader.path,
        adapter=adapter,
        model_type=str(reader.config.get("model_type")),
        num_files=len(files),
        tensor_bytes=sum(reader.tensor_spec(n).nbytes for n in reader.weight_map),
        dims=(num_experts, hidden, inter),
        swiglu_limit=cfg.swiglu_limit,
        arch=arch,
        ep_size=ep_size,
        layers=tuple(plans),
        defaulted=dict(defaulted_keys(cfg)),
        top_k=cfg.num_experts_per_tok,
    )


def human_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
