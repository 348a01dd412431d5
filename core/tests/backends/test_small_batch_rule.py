"""The small-batch path's choice rule, the ``experts_path`` option and its refusals, on CPU.

The kernels themselves run on a Hopper GPU only (``test_gpu_small_batch.py``); here the rule
that picks them per call, and what a layer says and refuses, with a fake ``deep_gemm`` where
the DeepGEMM backend is needed.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fakes import load_fake

from megamoe.core.backends import deepgemm as dg_backend
from megamoe.core.backends import small_batch
from megamoe.core.backends.small_batch import (
    CARD_COSTS,
    DEFAULT_CARD,
    H100_COSTS,
    H200_COSTS,
    LayerWork,
    card_costs,
    crossover_between,
    crossover_tokens,
)
from megamoe.core.errors import CapabilityError
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

fake_dg = load_fake("fake_deep_gemm")
FMT = WeightFormat.FP8_BLOCK
H200 = "NVIDIA H200"  # torch.cuda.get_device_name of each card measured
H100 = "NVIDIA H100 80GB HBM3"
# The released layers (transformers 5.24.0 configs), one rank holding every expert.
QWEN4EXP = LayerWork(
    num_experts=512, num_local_experts=512, top_k=10, hidden=2048, intermediate=512
)
GLM53FLASH = LayerWork(
    num_experts=288, num_local_experts=288, top_k=8, hidden=4096, intermediate=2048
)


# The GPU tests' GLM-5.3-Flash-sized layer of 32 experts.
GLM_32_EXPERTS = LayerWork(
    num_experts=32, num_local_experts=32, top_k=8, hidden=4096, intermediate=2048
)
# A layer no model measured: 8 large experts, every one active from the first token, each
# holding hundreds of tokens by 512 (the GPU tests' ``wide8``); the cards' models cross on
# it at different counts.
EIGHT_LARGE = LayerWork(num_experts=8, num_local_experts=8, top_k=8, hidden=7168, intermediate=4096)


@pytest.mark.parametrize("card", [H200, H100])
def test_the_crossover_is_where_the_models_cross(card: str) -> None:
    costs = card_costs(card)[1]
    tokens = crossover_tokens(EIGHT_LARGE, 65536, card)
    assert 0 < tokens < 65536
    for below in (1, tokens):
        small, megamoe = (EIGHT_LARGE.predicted_us(m, below) for m in (costs.small, costs.megamoe))
        assert small <= megamoe
    after = tokens + 1
    assert EIGHT_LARGE.predicted_us(costs.small, after) > EIGHT_LARGE.predicted_us(
        costs.megamoe, after
    )


@pytest.mark.parametrize("card", [H200, H100])
def test_the_measured_crossovers_of_the_real_layers(card: str) -> None:
    # The fifteenth session's runs (docs/img/decode_h200.json, decode_h100.json): on both
    # cards the small-batch path beat MegaMoE at every count of both layers, 1-8192 tokens
    # (Qwen4-Exp on the H200 1193.6 against 2973.9 us at 8192; GLM-5.3-Flash 3264.2 against
    # 3585.8 at 4096, 5937.2 against 6283.1 at 8192; on the H100 3745.6 against 3830.3 and
    # 6442.7 against 6588.9).
    for work in (QWEN4EXP, GLM53FLASH, GLM_32_EXPERTS):
        assert crossover_tokens(work, 65536, card) > 8192


def test_the_crossover_follows_the_layer_shape() -> None:
    # Eight large experts, all active at any batch, hand calls to MegaMoE where the measured
    # layers' many experts keep the small-batch path: one rule, measured constants, two
    # answers.
    for card in (H200, H100):
        assert crossover_tokens(EIGHT_LARGE, 65536, card) < crossover_tokens(
            GLM53FLASH, 65536, card
        )


@pytest.mark.parametrize(
    ("name", "key"),
    [(H200, "H200"), ("NVIDIA GH200 480GB", "H200"), (H100, "H100"), ("NVIDIA H100 PCIe", "H100"),
     ("NVIDIA H800", DEFAULT_CARD), ("NVIDIA H20", DEFAULT_CARD), ("", DEFAULT_CARD)],
)  # fmt: skip
def test_a_card_takes_the_models_measured_on_it_by_name(name: str, key: str) -> None:
    assert card_costs(name) == (key, CARD_COSTS[key])
    assert CARD_COSTS["H100"] is H100_COSTS
    assert CARD_COSTS["H200"] is H200_COSTS


def test_the_crossover_follows_the_card() -> None:
    # Each card's own models decide: where they differ, so does the crossover.
    on_h200, on_h100 = (crossover_tokens(EIGHT_LARGE, 65536, card) for card in (H200, H100))
    assert on_h200 != on_h100
    for tokens, costs in ((on_h200, H200_COSTS), (on_h100, H100_COSTS)):
        assert tokens == crossover_between(EIGHT_LARGE, costs.small, costs.megamoe, 65536)
    assert crossover_tokens(EIGHT_LARGE, 65536, "NVIDIA H800") == on_h200


@pytest.mark.parametrize("card", [H200, H100])
def test_the_crossover_is_capped_by_the_layers_max_tokens(card: str) -> None:
    assert crossover_tokens(QWEN4EXP, 3, card) == 3
    assert crossover_tokens(QWEN4EXP, 0, card) == 0


def test_active_experts_under_uniform_routing() -> None:
    assert QWEN4EXP.active_experts(0) == 0
    assert QWEN4EXP.active_experts(1) == pytest.approx(10)
    assert QWEN4EXP.active_experts(100_000) == pytest.approx(512)
    half = LayerWork(
        num_experts=512, num_local_experts=256, top_k=10, hidden=2048, intermediate=512
    )
    assert half.active_experts(1) == pytest.approx(5)


def experts(
    path: str,
    backend: str = "auto",
    device: str = "cpu",
    max_tokens: int = 64,
    cap: int | None = None,
):
    return one_rank_experts(
        4, 512, 256, top_k=2, weight_format=FMT, checkpoint_format=FMT,
        max_num_tokens=max_tokens, backend=backend, device=device, experts_path=path,
        small_batch_max_tokens=cap,
    )  # fmt: skip


def test_an_unknown_path_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"experts_path='fast'; expected one of auto, small_b"):
        experts("fast")


def test_forcing_the_small_batch_path_where_it_cannot_run_names_why() -> None:
    with pytest.raises(
        CapabilityError,
        match=r"experts_path='small_batch' cannot run here: the reference experts backend has "
        r"no small-batch path; use experts_path='auto'",
    ):
        experts("small_batch", backend="reference")


@pytest.mark.parametrize("path", ["auto", "megamoe"])
def test_the_reference_backend_has_one_path(path: str) -> None:
    layer = experts(path, backend="reference")
    assert layer.backend.path_for(layer, 1) == "reference"
    assert f"experts_path={path}" in repr(layer)


def install_fake_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_dg.FakeDeepGemm(arch="sm90", kinds=frozenset({fake_dg.SM90_KIND}))
    monkeypatch.setitem(sys.modules, "deep_gemm", fake.module())
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: "sm90")
    group = fake_dg.FakeGroup()
    monkeypatch.setattr(dg_backend, "resolve_group", lambda process_group, device: group)


def test_the_deepgemm_backend_on_a_cpu_tensor_keeps_megamoe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_fake_hopper(monkeypatch)
    layer = experts("auto", backend="deepgemm")
    layer.load_weights(synthetic_expert_tensors(FMT, 4, 512, 256, seed=0))
    layer.finalize()
    assert layer.backend.path_for(layer, 1) == "megamoe"
    with pytest.raises(
        CapabilityError, match=r"it runs on a CUDA device; this layer's experts are on cpu"
    ):
        experts("small_batch", backend="deepgemm")


@pytest.mark.parametrize(("path", "expected"), [("auto", 17), ("small_batch", 64), ("megamoe", 0)])
def test_the_option_sets_how_many_tokens_take_the_path(
    monkeypatch: pytest.MonkeyPatch, path: str, expected: int
) -> None:
    install_fake_hopper(monkeypatch)
    layer = experts("megamoe", backend="deepgemm")
    layer.experts_path = path
    monkeypatch.setattr(small_batch, "unavailable_reason", lambda experts, kind: None)
    monkeypatch.setattr(small_batch, "device_card", lambda device: H100)
    monkeypatch.setattr(small_batch, "crossover_tokens", lambda work, max_tokens, card: 17)
    assert small_batch.small_batch_tokens(layer, dg_backend.KIND_SM90) == expected
    assert layer.backend.path_for(layer, expected or 1) == (
        "megamoe" if path == "megamoe" else "small_batch"
    )
    assert layer.backend.path_for(layer, expected + 1) == "megamoe"
    # An empty call takes the small path only where the layer has one (MegaMoE runs it too).
    assert layer.backend.path_for(layer, 0) == ("small_batch" if expected else "megamoe")


@pytest.mark.parametrize(
    ("path", "cap", "expected"),
    [("auto", 8, 8), ("auto", 40, 17), ("auto", 500, 17), ("small_batch", 8, 8),
     ("small_batch", 40, 40), ("small_batch", 500, 64)],
)  # fmt: skip
def test_small_batch_max_tokens_caps_the_calls_the_path_takes(
    monkeypatch: pytest.MonkeyPatch, path: str, cap: int, expected: int
) -> None:
    install_fake_hopper(monkeypatch)
    layer = experts(path if path == "auto" else "megamoe", backend="deepgemm")
    layer.experts_path, layer.small_batch_max_tokens = path, cap
    monkeypatch.setattr(small_batch, "unavailable_reason", lambda experts, kind: None)
    monkeypatch.setattr(small_batch, "device_card", lambda device: H100)
    asked = []

    def crossover(work: LayerWork, max_tokens: int, card: str) -> int:
        asked.append((max_tokens, card))
        return min(17, max_tokens)

    monkeypatch.setattr(small_batch, "crossover_tokens", crossover)
    assert small_batch.small_batch_tokens(layer, dg_backend.KIND_SM90) == expected
    # the rule is asked up to the cap or max_num_tokens, whichever is less, for the card
    # the layer's device is
    assert asked == ([(min(cap, 64), H100)] if path == "auto" else [])
    assert layer.backend.path_for(layer, expected) == "small_batch"
    assert layer.backend.path_for(layer, expected + 1) == "megamoe"
    assert f"small_batch_max_tokens={cap}" in repr(layer)


def test_without_a_cap_the_layer_says_none() -> None:
    assert "small_batch_max_tokens" not in repr(experts("auto", backend="reference"))


@pytest.mark.parametrize(
    ("path", "cap", "error", "message"),
    [("auto", 0, ValueError, r"small_batch_max_tokens=0; expected at least 1 \(for no "
      r"small-batch path, pass experts_path='megamoe'\)"),
     ("auto", -3, ValueError, r"small_batch_max_tokens=-3; expected at least 1"),
     ("auto", 2.5, TypeError, r"small_batch_max_tokens=2.5 \(float\); expected an int"),
     ("auto", True, TypeError, r"small_batch_max_tokens=True \(bool\); expected an int"),
     ("megamoe", 16, ValueError, r"small_batch_max_tokens=16 beside experts_path='megamoe', "
      r"which runs no call on the small-batch path; drop one of the two")],
    ids=["zero", "negative", "float", "bool", "beside-megamoe"],
)  # fmt: skip
def test_a_bad_small_batch_max_tokens_is_refused_by_name(
    path: str, cap: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^MegaMoEExperts: " + message):
        experts(path, backend="reference", cap=cap)  # type: ignore[arg-type]


def test_several_ranks_keep_megamoe(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = experts("megamoe", backend="reference")
    monkeypatch.setattr(small_batch.dist, "get_world_size", lambda group: 2)
    layer.process_group = object()  # type: ignore[assignment]
    layer.device = torch.device("cuda")
    reason = small_batch.unavailable_reason(layer, dg_backend.KIND_SM90)
    assert reason is not None
    assert "runs one rank, where this layer's expert-parallel group has 2" in reason
