"""Check a loaded MoE layer's forward against the adapter's float64 reference.

``verify_layer`` builds a layer's block, loads it from the checkpoint, runs a forward on
random tokens and compares with ``ModelAdapter.reference_forward``, which computes the
layer from the checkpoint's dequantized tensors independently of the loading path. Given
the checkpoint a converted one was made from (``against``), the reference comes from that
source instead, so the error includes what the conversion lost.

The error is ``max |out - ref| / max |ref|`` over the layer's output; ``tolerance_for``
gives the accepted error of each (stored, run) format pair, and of experts whose kernel
also rounds the activations to FP8 (the DeepGEMM backend in a quantized format).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megamoe.core.adapters import ModelAdapter
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.errors import UsageError
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat

# Experts run as stored on the reference backend: bf16 outputs and activations.
TOLERANCE = {
    WeightFormat.BF16: 2e-2,
    WeightFormat.FP8_BLOCK: 5e-2,
    WeightFormat.MXFP8: 5e-2,
    WeightFormat.MXFP4: 5e-2,
}
# Experts requantized to the run format (while loading, or by convert and checked with
# --against): the weights' own rounding adds. Measured as max |out - ref| / max |ref| on
# the synthetic checkpoints of both adapters (reference backend, 32 tokens; sizes of
# SyntheticSizes(): 20 seeds x every MoE layer x 3 token seeds; hidden 1024 / intermediate
# 512 / 16 experts: 3-4 seeds), worst case per run format (glm5next's shared expert is
# requantized too, which makes it the larger):
# - to MXFP8 or FP8_BLOCK from BF16, FP8_BLOCK or MXFP8: 0.083 qwen4exp, 0.109 glm5next;
#   at hidden 1024 0.056 and 0.153.
# - to MXFP4 (E2M1: one mantissa bit) from any finer format: 0.37 qwen4exp, 0.49 glm5next;
#   at hidden 1024 0.28 and 0.57.
# Each tolerance leaves a margin of at least 1.3x over the worst, while a wrong scale,
# block or expert still shows (errors of 1 and more).
LOSSY_FP8_TOLERANCE = 0.2
LOSSY_MXFP4_TOLERANCE = 0.75
# Experts on the kernel in a quantized format: it also rounds each token's activations and
# the SwiGLU output to FP8 (E4M3: 3 mantissa bits). Measured with the reference backend's
# emulation of that rounding (``emulate_kernel=True``) on the demo's checkpoints
# (``demo.DEMO_SIZES``, run as fp8_block where a format does not run as stored; 4
# checkpoint seeds x every MoE layer x 6 token seeds), worst case: run as stored 0.080
# qwen4exp, 0.122 glm5next (its synthetic SwiGLU clamp of 0.75 cuts 93% of the up
# projections, where FP8 steps weigh most); requantized to FP8 0.104 and 0.158. The H200's
# Hopper kernel read 0.050 and 0.100 as stored, 0.125-0.130 requantized, on the demo's
# seed. Margins of 1.3x and more again.
KERNEL_TOLERANCE = 0.16
KERNEL_LOSSY_FP8_TOLERANCE = 0.25


@dataclass(frozen=True)
class LayerCheck:
    """One layer's forward checked against the reference.

    Attributes:
        layer: the checked layer.
        run_format: the format its experts ran in.
        backend: the experts backend that ran, and its path where it has several
            (``deepgemm: small_batch`` or ``deepgemm: megamoe``).
        max_rel_error: ``max |out - ref| / max |ref|``, the reference computed from the
            source checkpoint when one was given (``against``), else from this one.
        tolerance: the largest error accepted.
        load_seconds: building and loading the block (requantization included).
        conversion_error: with a source checkpoint, ``max |ref - ref_source| / max
            |ref_source|`` of the two float64 references: what the conversion changed;
            else None.
    """

    layer: MoELayer
    run_format: WeightFormat
    backend: str
    max_rel_error: float
    tolerance: float
    load_seconds: float
    conversion_error: float | None = None

    @property
    def ok(self) -> bool:
        """The error is finite and within tolerance."""
        return math.isfinite(self.max_rel_error) and self.max_rel_error <= self.tolerance


def tolerance_for(
    checkpoint: WeightFormat, run: WeightFormat, kernel_rounding: bool = False
) -> float:
    """The accepted ``max_rel_error`` for experts stored as ``checkpoint`` run as ``run``.

    ``TOLERANCE[run]`` for experts run as stored, MXFP4 run as MXFP8 (exact) and any run
    as BF16 (dequantizing loses nothing); for requantized ones ``LOSSY_MXFP4_TOLERANCE``
    (to MXFP4) or ``LOSSY_FP8_TOLERANCE`` (to MXFP8 or FP8_BLOCK). With
    ``kernel_rounding`` (a kernel that rounds activations to FP8 ran a quantized ``run``)
    at least ``KERNEL_TOLERANCE``, or ``KERNEL_LOSSY_FP8_TOLERANCE`` for requantized FP8.
    """
    exact = checkpoint is run or (checkpoint, run) == (WeightFormat.MXFP4, WeightFormat.MXFP8)
    rounding = kernel_rounding and run is not WeightFormat.BF16
    if exact or run is WeightFormat.BF16:
        return max(TOLERANCE[run], KERNEL_TOLERANCE) if rounding else TOLERANCE[run]
    if run is WeightFormat.MXFP4:
        return LOSSY_MXFP4_TOLERANCE
    return KERNEL_LOSSY_FP8_TOLERANCE if rounding else LOSSY_FP8_TOLERANCE


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in float64; infinity where it is not finite."""
    error = float(
        (out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)
    )
    return error if math.isfinite(error) else math.inf


def verify_layer(
    reader: CheckpointReader,
    adapter: ModelAdapter,
    layer: MoELayer,
    *,
    parallel: ParallelSettings,
    moe_format: WeightFormat | str | None = None,
    backend: str = "auto",
    device: torch.device | str | None = None,
    num_tokens: int = 32,
    seed: int = 0,
    tolerance: float | None = None,
    against: tuple[CheckpointReader, MoELayer] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> LayerCheck:
    """Load ``layer`` from the checkpoint, run it on random tokens, compare with the reference.

    Args:
        reader: the checkpoint.
        adapter: its adapter.
        layer: one of ``reader.layers``.
        parallel: expert-parallel settings (a group of size 1 for one device).
        moe_format: force a run format (None: the adapter's default for this machine).
        backend: ``"auto"``, ``"reference"`` or ``"deepgemm"``.
        device: where the block runs (None = CPU).
        num_tokens: tokens in the forward.
        seed: seeds the random tokens.
        tolerance: accepted error; None uses ``tolerance_for`` (of the source's format
            when ``against`` is given; with the kernel's FP8 rounding where the experts'
            backend rounds activations, ``ExpertsBackend.rounds_activations``).
        against: the checkpoint ``reader`` was converted from and its layer of the same
            prefix (same adapter and sizes): the reference is computed from it.
        on_stage: called with ``"load"``, ``"forward"`` and ``"reference"`` as each starts.

    Returns:
        The check; ``ok`` tells whether it passed.

    Raises:
        ValueError: the block's output and the reference differ in shape.
    """
    stage = on_stage or (lambda _: None)
    stage("load")
    start = time.perf_counter()
    block = adapter.build_block(
        reader.config,
        layer,
        parallel=parallel,
        moe_format=moe_format,
        backend=backend,
        device=device,
        max_num_tokens=num_tokens,
    )
    block.load_from_checkpoint(reader)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    load_seconds = time.perf_counter() - start
    stage("forward")
    hidden_size = adapter.expert_dims(reader.config)[1]
    gen = torch.Generator().manual_seed(seed * 1000 + layer.index)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = block(hidden.to(device)).double().cpu()
    stage("reference")
    ref = adapter.reference_forward(reader, layer, hidden).double().cpu()
    conversion_error = None
    source_format = layer.checkpoint_format
    if against is not None:
        source_reader, source_layer = against
        source_ref = adapter.reference_forward(source_reader, source_layer, hidden).double().cpu()
        conversion_error = max_rel_error(ref, source_ref)
        ref, source_format = source_ref, source_layer.checkpoint_format
    if out.shape != ref.shape:
        raise ValueError(
            f"{layer.prefix}: block output has shape {tuple(out.shape)} but the reference "
            f"has {tuple(ref.shape)}"
        )
    run_format = block.experts.weight_format
    experts = block.experts
    if tolerance is None:
        rounding = experts.backend.rounds_activations(experts)
        tolerance = tolerance_for(source_format, run_format, rounding)
    name, path = experts.backend.name, experts.backend.path_for(experts, num_tokens)
    return LayerCheck(
        layer=layer,
        run_format=run_format,
        backend=name if path == name else f"{name}: {path}",
        max_rel_error=max_rel_error(out, ref),
        tolerance=tolerance,
        load_seconds=load_seconds,
        conversion_error=conversion_error,
    )


def source_layers(
    reader: CheckpointReader,
    adapter: ModelAdapter,
    source: CheckpointReader,
    source_adapter: ModelAdapter,
) -> dict[str, MoELayer]:
    """The source checkpoint's layer for each of ``reader``'s, by prefix (for ``against``).

    Args:
        reader: the converted checkpoint.
        adapter: its adapter.
        source: the checkpoint it was converted from.
        source_adapter: the source's adapter.

    Returns:
        Prefix -> the source's layer of that prefix.

    Raises:
        UsageError: the source is of another model or other sizes, or lacks a layer.
    """
    where = f"--against {source.path}"
    if source_adapter.name != adapter.name:
        raise UsageError(
            f"{where}: a {source_adapter.name} checkpoint, but {reader.path} is {adapter.name}; "
            "give the checkpoint this one was converted from"
        )
    dims, source_dims = adapter.expert_dims(reader.config), adapter.expert_dims(source.config)
    if dims != source_dims:
        raise UsageError(
            f"{where}: experts, hidden and intermediate sizes are {source_dims}, but "
            f"{dims} in {reader.path}; give the checkpoint this one was converted from"
        )
    layers = {layer.prefix: layer for layer in source.layers}
    missing = [layer.prefix for layer in reader.layers if layer.prefix not in layers]
    if missing:
        raise UsageError(
            f"{where}: has no MoE layer {', '.join(missing)} (its MoE layers: "
            f"{', '.join(layers) or 'none'}); give the checkpoint this one was converted from"
        )
    return layers
