"""Where the router kernel may write the kernel's inputs (``DispatchBuffer``), on the CPU.

The router kernel fills the Hopper kernel's buffer only on CUDA with DeepGEMM (its bits:
``test_gpu_router_dispatch.py``, ``tests/test_gpu_block.py``). Here: every other backend
and call gets no buffer, a forward that claims one is refused by name, and so is a router
given one where its kernel cannot run (``glm5next/tests/test_router.py``).
"""

from __future__ import annotations

import pytest
import torch

from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors

FMT = WeightFormat.FP8_BLOCK
H = 256


def _experts(finalized: bool = True) -> MegaMoEExperts:
    m = MegaMoEExperts(
        num_experts=4, num_local_experts=4, experts_start_idx=0, num_logical_experts=4,
        top_k=2, hidden_size=H, intermediate_size=H, weight_format=FMT,
        checkpoint_format=FMT, max_num_tokens=32, backend="reference",
        prefix="model.layers.3.mlp.experts",
    )  # fmt: skip
    if finalized:
        m.load_weights(synthetic_expert_tensors(FMT, 4, H, H, seed=0))
        m.finalize()
    return m


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    return x, torch.rand(tokens, 2, generator=gen) + 0.1, ids


def test_the_reference_backend_offers_no_buffer_and_refuses_a_dispatched_forward() -> None:
    m = _experts()
    x, weights, ids = routing(5)
    assert m.dispatch_buffer(x) is None
    with pytest.raises(RuntimeError, match=r"dispatched=True.*no dispatch buffer"):
        m(x, weights, ids, dispatched=True)
    with pytest.raises(NotImplementedError, match="reference experts backend has no dispatch"):
        m.backend.forward_dispatched(m, 5)
    plain = m(x, weights, ids)  # the routing as arguments still runs
    assert plain.shape == x.shape


def test_no_buffer_before_finalize_or_outside_one_to_max_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = _experts(finalized=False)
    sentinel = object()
    monkeypatch.setattr(m.backend, "dispatch_buffer", lambda experts: sentinel)
    assert m.dispatch_buffer(torch.zeros(1, 256)) is None  # not finalized
    m.load_weights(synthetic_expert_tensors(FMT, 4, H, H, seed=0))
    m.finalize()
    assert m.dispatch_buffer(torch.zeros(1, 256)) is sentinel
    assert m.dispatch_buffer(torch.zeros(32, 256)) is sentinel  # max_num_tokens
    assert m.dispatch_buffer(torch.zeros(0, 256)) is None
    assert m.dispatch_buffer(torch.zeros(33, 256)) is None  # forward raises its own error


def test_a_buffer_fits_only_in_the_documented_dtypes_shapes_and_layout() -> None:
    from megamoe.core.numerics.dispatch import DispatchBuffer

    rows, hidden, top_k = 12, 256, 4
    good = DispatchBuffer(
        torch.zeros(rows, hidden, dtype=torch.float8_e4m3fn),
        torch.zeros(rows, hidden // 128),
        torch.zeros(rows, top_k, dtype=torch.int64),
        torch.zeros(rows, top_k),
    )
    assert good.fits(hidden, top_k)
    assert not good.fits(hidden, top_k + 1)
    assert not good.fits(hidden + 128, top_k)
    assert not good._replace(topk_ids=good.topk_ids.int()).fits(hidden, top_k)
    assert not good._replace(x_scale=torch.zeros(hidden // 128, rows).t()).fits(hidden, top_k)
    assert not good._replace(topk_weights=torch.zeros(rows + 1, top_k)).fits(hidden, top_k)
