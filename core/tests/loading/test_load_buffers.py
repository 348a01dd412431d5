"""Load buffers the caller refills: a half that waits for its partner is never the caller's.

Weight-sync loops (RL trainers, chunked reloads) copy each tensor into one reused buffer per
shape and dtype and hand that buffer to ``load_weights``. A weight that arrives before its
scale waits in the pairing; were it the caller's buffer, the next tensor copied into it
would silently become the weight. Each case loads every weight first, then every scale,
through reused buffers, and must give the bits of a load from fresh tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.modules.shared_expert import SwiGLUMLP
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

E, H, INTER = 4, 256, 256
Stream = list[tuple[str, torch.Tensor]]


def _weights_first(stream: Iterable[tuple[str, torch.Tensor]]) -> Stream:
    return sorted(stream, key=lambda item: not item[0].endswith(".weight"))


def _through_reused_buffers(stream: Stream) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor copied into the one buffer of its shape and dtype, as a sync loop does."""
    buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for name, tensor in stream:
        buffer = buffers.setdefault((tuple(tensor.shape), tensor.dtype), torch.empty_like(tensor))
        buffer.copy_(tensor)
        yield name, buffer


def _check_reused_buffers(fmt: WeightFormat, reload: bool, device: str, budget: int | None) -> None:
    """Experts loaded from ``_through_reused_buffers`` equal experts loaded from ``stream``.

    ``budget``: the bytes of waiting halves the experts keep on their device (None: the
    default), so that 0 makes every waiting half wait where the caller's tensor was.
    """
    stream = _weights_first(synthetic_expert_tensors(fmt, E, H, INTER, seed=1))

    def build() -> MegaMoEExperts:
        experts = one_rank_experts(
            E, H, INTER, weight_format=fmt, checkpoint_format=fmt, backend="reference",
            prefix="layers.0.experts", device=device,
        )  # fmt: skip
        if budget is not None:
            experts._arrival.budget = budget
        if reload:  # serving other weights first
            experts.load_weights(synthetic_expert_tensors(fmt, E, H, INTER, seed=2))
            experts.finalize()
        return experts

    expected, actual = build(), build()
    expected.load_weights(stream)
    expected.finalize()
    actual.load_weights(_through_reused_buffers(stream))
    actual.finalize()
    for name, param in expected.kernel_params.items():
        assert_bitwise_equal(actual.kernel_params[name], param, name)


FORMATS = [WeightFormat.FP8_BLOCK, WeightFormat.MXFP8, WeightFormat.MXFP4]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reload", [False, True], ids=["first load", "reload"])
def test_experts_loaded_through_reused_buffers_equal_a_fresh_load(
    fmt: WeightFormat, reload: bool
) -> None:
    _check_reused_buffers(fmt, reload, "cpu", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, 0], ids=["on the device", "beyond the device budget"])
@pytest.mark.parametrize("reload", [False, True], ids=["first load", "reload"])
def test_host_buffers_into_gpu_experts_equal_a_fresh_load(budget: int | None, reload: bool) -> None:
    _check_reused_buffers(WeightFormat.FP8_BLOCK, reload, "cuda", budget)


def test_a_shared_expert_loaded_through_reused_buffers_equals_a_fresh_load() -> None:
    gen = torch.Generator().manual_seed(3)
    stream: Stream = []
    for proj, shape in (
        ("gate_proj", (INTER, H)),
        ("up_proj", (INTER, H)),
        ("down_proj", (H, INTER)),
    ):
        weight, scale = quant.quantize_fp8_block(torch.randn(shape, generator=gen) * 0.05)
        stream += [(f"{proj}.weight", weight), (f"{proj}.weight_scale_inv", scale)]
    stream = _weights_first(stream)
    mlps = [SwiGLUMLP(H, INTER, WeightFormat.FP8_BLOCK, gemm="bf16") for _ in range(2)]
    mlps[0].load_weights(stream)
    mlps[1].load_weights(_through_reused_buffers(stream))
    for (name, expected), actual in zip(
        mlps[0].state_dict().items(), mlps[1].state_dict().values(), strict=True
    ):
        assert_bitwise_equal(actual, expected, name)
