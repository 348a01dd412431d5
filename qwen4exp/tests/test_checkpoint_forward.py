"""Checkpoints in every format -> block on the reference backend -> forward vs float64.

The float64 reference (``float64_oracle``, conftest.py) is written independently of
megamoe: it reads the safetensors files itself, decodes FP8 / MXFP8 / MXFP4 by their
definitions and computes router, experts and the gated shared expert.

Tolerances (relative Frobenius error of the block output):
- vs the reference on the run-format weights: 1e-2 (bf16 input/output and bf16 shared
  expert arithmetic in the block; measured about 2-3e-3);
- vs the reference on the checkpoint's weights: the same 1e-2 where the run format holds
  the checkpoint's values (or BF16 of them), else the format's own quantization error:
  8e-2 into FP8_BLOCK / MXFP8, 0.3 into MXFP4 (E2M1 keeps one mantissa bit).
The kernel weights themselves must equal ``quant.requantize`` of the checkpoint's tensors
bit for bit (one projection at a time).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics import formats, quant
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.qwen4exp import ADAPTER, Qwen4ExpMegaMoeBlock

# Small, but each projection spans several 128x128 blocks (gate/up 128x256, down 256x128,
# shared 256x256).
SIZES = SyntheticSizes(
    num_layers=1, hidden_size=256, intermediate_size=128, num_experts=8, top_k=2,
    shared_intermediate_size=256,
)  # fmt: skip
# Every stored layout of the experts: (checkpoint format, fused BF16 tensors).
LAYOUTS = [
    (WeightFormat.BF16, False),
    (WeightFormat.BF16, True),
    (WeightFormat.FP8_BLOCK, False),
    (WeightFormat.MXFP8, False),
    (WeightFormat.MXFP4, False),
]
H, E = SIZES.hidden_size, SIZES.num_experts
TOKENS = 32
PROJS = ("gate_proj", "up_proj", "down_proj")
TIGHT = 1e-2
LOSSY = {WeightFormat.FP8_BLOCK: 8e-2, WeightFormat.MXFP8: 8e-2, WeightFormat.MXFP4: 0.3}

Weights = tuple[torch.Tensor, torch.Tensor | None]
CheckpointFactory = Callable[[WeightFormat, bool, SyntheticSizes], Path]
Oracle = Any  # conftest.Float64Oracle
RelErr = Callable[[torch.Tensor, torch.Tensor], float]


# -- what the kernel tensors must hold ------------------------------------------------------


def run_weights(weights: Weights, ckpt: WeightFormat, run: WeightFormat) -> Weights:
    """The run-format encoding of one projection, as the spec defines it."""
    weight, scale = weights
    if run is ckpt:
        return weight, scale
    if run is WeightFormat.BF16:
        return quant.dequantize(weight, scale, ckpt).to(torch.bfloat16), None
    return quant.requantize(weight, scale, ckpt, run)


def load_block(
    path: Path, parallel: ParallelSettings, run: WeightFormat, layer: int = 0
) -> tuple[Qwen4ExpMegaMoeBlock, CheckpointReader]:
    reader = CheckpointReader(path, ADAPTER)
    block = ADAPTER.build_block(
        reader.config, reader.layers[layer], parallel=parallel, moe_format=run,
        backend="reference",
    )  # fmt: skip
    block.load_from_checkpoint(reader)
    return block, reader


def tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((TOKENS, H), generator=gen).to(torch.bfloat16)


def _can_keep(ckpt: WeightFormat, run: WeightFormat) -> bool:
    """Whether ``run`` holds the checkpoint's values exactly (or as BF16 of them)."""
    return run in (ckpt, WeightFormat.BF16) or (ckpt, run) == (
        WeightFormat.MXFP4,
        WeightFormat.MXFP8,
    )


@pytest.mark.parametrize("run_format", list(RUN_FORMATS), ids=lambda f: f"run-{f.value}")
@pytest.mark.parametrize(
    ("checkpoint_format", "fused"),
    LAYOUTS,
    ids=[f"{fmt.value}{'-fused' if fused else ''}" for fmt, fused in LAYOUTS],
)
def test_every_format_loads_and_matches_float64(
    qwen_checkpoint: CheckpointFactory,
    parallel: ParallelSettings,
    float64_oracle: Callable[[Path], Oracle],
    relative_error: RelErr,
    checkpoint_format: WeightFormat,
    fused: bool,
    run_format: WeightFormat,
) -> None:
    path = qwen_checkpoint(checkpoint_format, fused, SIZES)
    block, reader = load_block(path, parallel, run_format)
    experts = block.experts
    assert (experts.checkpoint_format, experts.weight_format) == (checkpoint_format, run_format)
    prefix = reader.layers[0].prefix
    oracle = float64_oracle(path)
    assert oracle.num_files > 1  # sharded, with an index
    stored = oracle.stored_experts(prefix, checkpoint_format)

    # Kernel weights: bit for bit the run-format encoding of each checkpoint projection.
    run = [{p: run_weights(w[p], checkpoint_format, run_format) for p in PROJS} for w in stored]
    params = experts.kernel_params
    for e in range(E):
        gate, up, down = (run[e][p] for p in PROJS)
        assert_bitwise_equal(params["w13_weight"][e], torch.cat([gate[0], up[0]]), f"w13[{e}]")
        assert_bitwise_equal(params["w2_weight"][e], down[0], f"w2[{e}]")
        if gate[1] is not None:
            assert up[1] is not None and down[1] is not None
            scale13 = torch.cat([gate[1], up[1]])
            assert_bitwise_equal(params["w13_weight_scale"][e], scale13, f"w13 scale[{e}]")
            assert_bitwise_equal(params["w2_weight_scale"][e], down[1], f"w2 scale[{e}]")

    x = tokens(seed=11)
    y = block(x)
    assert y.dtype == torch.bfloat16 and y.shape == (TOKENS, H)
    decode = oracle.decode
    decoded_run = [{p: decode(*run[e][p], run_format) for p in PROJS} for e in range(E)]
    err_run = relative_error(y, oracle.forward(x, prefix, decoded_run, checkpoint_format))
    decoded_ckpt = oracle.decoded_experts(prefix, checkpoint_format)
    expected = oracle.forward(x, prefix, decoded_ckpt, checkpoint_format)
    err_ckpt = relative_error(y, expected)
    bound = TIGHT if _can_keep(checkpoint_format, run_format) else LOSSY[run_format]
    assert err_run <= TIGHT, f"vs run-format weights: {err_run:.3e}"
    assert err_ckpt <= bound, f"vs checkpoint weights: {err_ckpt:.3e} > {bound}"
    # The adapter's own float64 reference (used by `megamoe verify`) agrees with this one
    # (it decodes block-FP8 products in float32, hence not to 1e-15).
    adapter_ref = ADAPTER.reference_forward(reader, reader.layers[0], x)
    assert relative_error(adapter_ref, expected) < 1e-6


@pytest.mark.parametrize("checkpoint_format", [WeightFormat.FP8_BLOCK, WeightFormat.MXFP4])
def test_mtp_layer_ignores_the_forced_format(
    qwen_checkpoint: CheckpointFactory,
    parallel: ParallelSettings,
    float64_oracle: Callable[[Path], Oracle],
    relative_error: RelErr,
    checkpoint_format: WeightFormat,
) -> None:
    path = qwen_checkpoint(checkpoint_format, False, SIZES)
    reader = CheckpointReader(path, ADAPTER)
    main, mtp = reader.layers
    assert (main.is_mtp, mtp.is_mtp, mtp.prefix) == (False, True, "mtp.layers.0.mlp")
    forced = (
        WeightFormat.MXFP8 if checkpoint_format is WeightFormat.FP8_BLOCK else WeightFormat.BF16
    )
    block, _ = load_block(path, parallel, forced, layer=1)
    assert block.is_mtp and block.experts.weight_format is checkpoint_format
    main_block = ADAPTER.build_block(
        reader.config, main, parallel=parallel, moe_format=forced, backend="reference"
    )
    assert main_block.experts.weight_format is forced
    x = tokens(seed=5)
    oracle = float64_oracle(path)
    experts = oracle.decoded_experts(mtp.prefix, checkpoint_format)
    expected = oracle.forward(x, mtp.prefix, experts, checkpoint_format)
    assert relative_error(block(x), expected) <= TIGHT


def test_block_fp8_on_sm100_is_requantized_with_one_warning(
    qwen_checkpoint: CheckpointFactory, parallel: ParallelSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(formats, "_warned", set())
    config = CheckpointReader(qwen_checkpoint(WeightFormat.FP8_BLOCK, False, SIZES)).config
    prefix = "model.language_model.layers.0.mlp"

    def build(**kwargs: object) -> Qwen4ExpMegaMoeBlock:
        return Qwen4ExpMegaMoeBlock(
            config, prefix=prefix, parallel=parallel, backend="reference", arch="sm100",
            **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip

    with pytest.warns(UserWarning, match=r"requantizing them to mxfp8.*Pass moe_format='mxfp8'"):
        assert build().experts.weight_format is WeightFormat.MXFP8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build().experts.weight_format is WeightFormat.MXFP8  # warned once only
        assert build(moe_format="mxfp4").experts.weight_format is WeightFormat.MXFP4  # forced
        mtp = build(moe_format="mxfp4", is_mtp=True)
    assert mtp.experts.weight_format is WeightFormat.MXFP8  # default for the drafter


def test_forced_format_the_target_cannot_run_is_refused(
    qwen_checkpoint: CheckpointFactory, parallel: ParallelSettings
) -> None:
    config = CheckpointReader(qwen_checkpoint(WeightFormat.BF16, False, SIZES)).config
    with pytest.raises(ValueError, match=r"moe_format='mxfp8' cannot run on sm90"):
        Qwen4ExpMegaMoeBlock(
            config, prefix="model.language_model.layers.0.mlp", parallel=parallel,
            moe_format="mxfp8", arch="sm90", backend="reference",
        )  # fmt: skip


def test_checkpoint_reads_only_this_layer(
    qwen_checkpoint: CheckpointFactory, parallel: ParallelSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call per layer, reading exactly that layer's tensors, each once."""
    path = qwen_checkpoint(WeightFormat.MXFP8, False, SIZES)
    reader = CheckpointReader(path, ADAPTER)
    block = ADAPTER.build_block(
        reader.config, reader.layers[0], parallel=parallel, backend="reference"
    )
    seen: list[str] = []
    original = reader.iter_tensors

    def spy(prefix: str, keep=None):  # type: ignore[no-untyped-def]
        for name, tensor in original(prefix, keep):
            seen.append(f"{prefix}.{name}")
            yield name, tensor

    monkeypatch.setattr(reader, "iter_tensors", spy)
    block.load_from_checkpoint(reader)
    layer_names = [
        n for n in reader.tensor_names() if n.startswith("model.language_model.layers.0.mlp.")
    ]
    assert sorted(seen) == layer_names
    assert isinstance(parallel.ep_group, dist.ProcessGroup)
