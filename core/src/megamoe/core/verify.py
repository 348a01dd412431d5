"""Check a loaded MoE layer's forward against the adapter's float64 reference (SPEC §3.7).

``verify_layer`` builds a layer's block, loads it from the checkpoint, runs a forward on
random tokens and compares with ``ModelAdapter.reference_forward``, which computes the
layer from the checkpoint's dequantized tensors independently of the loading path.

The error is ``max |out - ref| / max |ref|`` over the layer's output. Tolerances per run
format (``TOLERANCE``) cover bf16 outputs and activations (BF16) and, for the quantized run
formats, the kernel's FP8 activation rounding (E4M3 keeps 3 mantissa bits); requantizing
finer weights to MXFP4 while loading loses more, so it gets ``LOSSY_MXFP4_TOLERANCE``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from megamoe.core.adapters import ModelAdapter, MoELayer
from megamoe.core.checkpoint import CheckpointReader
from megamoe.core.formats import WeightFormat
from megamoe.core.parallel import ParallelSettings

TOLERANCE = {
    WeightFormat.BF16: 2e-2,
    WeightFormat.FP8_BLOCK: 5e-2,
    WeightFormat.MXFP8: 5e-2,
    WeightFormat.MXFP4: 5e-2,
}
LOSSY_MXFP4_TOLERANCE = 0.25  # E2M1 has one mantissa bit: finer weights lose ~1/8 per value


@dataclass(frozen=True)
class LayerCheck:
    """One layer's forward checked against the reference.

    Attributes:
        layer: the checked layer.
        run_format: the format its experts ran in.
        backend: the experts backend that ran.
        max_rel_error: ``max |out - ref| / max |ref|``.
        tolerance: the largest error accepted.
        load_seconds: building and loading the block (requantization included).
    """

    layer: MoELayer
    run_format: WeightFormat
    backend: str
    max_rel_error: float
    tolerance: float
    load_seconds: float

    @property
    def ok(self) -> bool:
        """The error is finite and within tolerance."""
        return math.isfinite(self.max_rel_error) and self.max_rel_error <= self.tolerance


def tolerance_for(checkpoint: WeightFormat, run: WeightFormat) -> float:
    """The accepted ``max_rel_error`` for experts stored as ``checkpoint`` run as ``run``."""
    if run is WeightFormat.MXFP4 and checkpoint is not WeightFormat.MXFP4:
        return LOSSY_MXFP4_TOLERANCE
    return TOLERANCE[run]


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
        tolerance: accepted error; None uses ``tolerance_for``.

    Returns:
        The check; ``ok`` tells whether it passed.
    """
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
    hidden_size = adapter.expert_dims(reader.config)[1]
    gen = torch.Generator().manual_seed(seed * 1000 + layer.index)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = block(hidden.to(device)).double().cpu()
    ref = adapter.reference_forward(reader, layer, hidden).double().cpu()
    if out.shape != ref.shape:
        raise ValueError(
            f"{layer.prefix}: block output has shape {tuple(out.shape)} but the reference "
            f"has {tuple(ref.shape)}"
        )
    error = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    run_format = block.experts.weight_format
    return LayerCheck(
        layer=layer,
        run_format=run_format,
        backend=block.experts.backend.name,
        max_rel_error=error if math.isfinite(error) else math.inf,
        tolerance=tolerance_for(layer.checkpoint_format, run_format)
        if tolerance is None
        else tolerance,
        load_seconds=load_seconds,
    )
