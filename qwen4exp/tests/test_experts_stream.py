"""Qwen4ExpMegaMoEExperts: any order and chunking of a tensor stream, incomplete streams,
unexpected names, fused tensors and expert placement."""

from __future__ import annotations

import random

import pytest
import torch
from bitcheck import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megamoe.core.errors import IncompleteShardsError, MissingExpertsError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors
from megamoe.qwen4exp import Qwen4ExpMegaMoEExperts

H, INTER = 256, 128
LOGICAL = 4
# Placement: 4 logical + 2 redundant physical experts over 2 ranks; this is rank 1, holding
# physical experts 3, 4, 5 = logical 3, 0, 1 (so logical 2 belongs to the other rank).
PHYSICAL, LOCAL, START = 6, 3, 3
LOCAL_LOGICAL = (3, 0, 1)

Stream = list[tuple[str, torch.Tensor]]


def make_experts(ckpt: WeightFormat, run: WeightFormat) -> Qwen4ExpMegaMoEExperts:
    return Qwen4ExpMegaMoEExperts(
        num_experts=PHYSICAL, num_local_experts=LOCAL, experts_start_idx=START,
        num_logical_experts=LOGICAL, top_k=2, hidden_size=H, intermediate_size=INTER,
        weight_format=run, checkpoint_format=ckpt, backend="reference", prefix="layers.0.experts",
        reload_staging_bytes=STAGE_WHOLE_RELOAD,
    )  # fmt: skip


def stream_of(ckpt: WeightFormat, *, fused: bool = False, packed: bool = False) -> Stream:
    tensors = list(synthetic_expert_tensors(ckpt, LOGICAL, H, INTER, seed=7, fused_bf16=fused))
    if packed:  # compressed-tensors names packed MXFP4 weights weight_packed
        tensors = [(n.replace(".weight", ".weight_packed") if n.endswith(".weight") else n, t)
                   for n, t in tensors]  # fmt: skip
    return tensors


def kernel_state(experts: Qwen4ExpMegaMoEExperts) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in experts.kernel_params.items()}


# (checkpoint format, run format, fused, weight_packed): requantize-on-pairing, direct
# writes, packed MXFP4 names and the fused BF16 layout.
CASES = [
    (WeightFormat.FP8_BLOCK, WeightFormat.MXFP8, False, False),
    (WeightFormat.MXFP4, WeightFormat.FP8_BLOCK, False, True),
    (WeightFormat.MXFP8, WeightFormat.MXFP8, False, False),
    (WeightFormat.BF16, WeightFormat.MXFP4, True, False),
]
BASELINES: dict[tuple[WeightFormat, WeightFormat, bool, bool], dict[str, torch.Tensor]] = {}


def baseline(case: tuple[WeightFormat, WeightFormat, bool, bool]) -> dict[str, torch.Tensor]:
    if case not in BASELINES:
        ckpt, run, fused, packed = case
        experts = make_experts(ckpt, run)
        experts.load_weights(stream_of(ckpt, fused=fused, packed=packed))
        experts.finalize()
        BASELINES[case] = kernel_state(experts)
    return BASELINES[case]


@pytest.mark.parametrize(
    ("checkpoint_format", "run_format", "fused", "packed"),
    CASES,
    ids=[
        f"{c.value}{'-fused' if f else ''}{'-packed' if p else ''}->{r.value}"
        for c, r, f, p in CASES
    ],
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), chunks=st.integers(1, 12))
def test_any_order_and_chunking_gives_identical_kernel_weights(
    checkpoint_format: WeightFormat,
    run_format: WeightFormat,
    fused: bool,
    packed: bool,
    seed: int,
    chunks: int,
) -> None:
    case = (checkpoint_format, run_format, fused, packed)
    expected = baseline(case)
    stream = stream_of(checkpoint_format, fused=fused, packed=packed)
    rng = random.Random(seed)
    rng.shuffle(stream)
    cuts = sorted(rng.sample(range(1, len(stream)), min(chunks, len(stream)) - 1))
    experts = make_experts(checkpoint_format, run_format)
    for lo, hi in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        experts.load_weights(stream[lo:hi])
    experts.finalize()
    for name, tensor in kernel_state(experts).items():
        assert_bitwise_equal(tensor, expected[name], name)


def test_redundant_replicas_hold_their_logical_expert_and_others_are_skipped() -> None:
    experts = make_experts(WeightFormat.BF16, WeightFormat.BF16)
    assert [experts.map_global_expert_id(e) for e in range(LOGICAL)] == [[1], [2], [], [0]]
    stream = dict(stream_of(WeightFormat.BF16))
    accepted = experts.load_weights(stream.items())
    assert accepted == set(stream)  # other ranks' tensors are accepted and skipped
    experts.finalize()
    w13 = experts.kernel_params["w13_weight"]
    for slot, logical in enumerate(LOCAL_LOGICAL):
        gate_up = torch.cat(
            [stream[f"{logical}.gate_proj.weight"], stream[f"{logical}.up_proj.weight"]]
        )
        assert_bitwise_equal(w13[slot], gate_up, f"slot {slot}")


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.MXFP4])
def test_incomplete_stream_names_the_shard(fmt: WeightFormat) -> None:
    experts = make_experts(fmt, WeightFormat.MXFP8)
    scale = fmt.scale_name
    dropped = f"0.up_proj.{scale}"  # logical 0 sits in local slot 1; up is shard w3
    experts.load_weights((n, t) for n, t in stream_of(fmt) if n != dropped)
    with pytest.raises(
        IncompleteShardsError, match=rf"up_proj.{scale} of local expert 1\b"
    ) as info:
        experts.finalize()
    assert list(info.value.missing) == [(1, "w3")]
    # The missing half arrives later (a chunked update): the load completes.
    experts.load_weights([(dropped, dict(stream_of(fmt))[dropped])])
    experts.finalize()


def test_expert_never_loaded_is_named() -> None:
    experts = make_experts(WeightFormat.BF16, WeightFormat.BF16)
    experts.load_weights((n, t) for n, t in stream_of(WeightFormat.BF16) if not n.startswith("3."))
    with pytest.raises(MissingExpertsError, match=r"expert slot 0 \(physical 3, logical 3\)"):
        experts.finalize()


@pytest.mark.parametrize(
    ("fmt", "name", "pattern"),
    [
        (WeightFormat.FP8_BLOCK, "0.gate_proj.weight_scale",
         r"\{expert\}\.\{gate,up,down\}_proj\.\{weight,weight_scale_inv\}"),
        (WeightFormat.MXFP8, "0.gate_proj.weight_packed",
         r"\{expert\}\.\{gate,up,down\}_proj\.\{weight,weight_scale\}"),
        (WeightFormat.MXFP4, "0.w1.weight", r"\{weight,weight_packed,weight_scale\}"),
        (WeightFormat.BF16, "gate_up", r"\{weight\} or fused gate_up_proj / down_proj"),
        (WeightFormat.BF16, "0.gate_proj.bias",
         r"unexpected bf16 expert tensor '0\.gate_proj\.bias'"),
    ],
)  # fmt: skip
def test_unexpected_names_name_the_tensor_and_the_pattern(
    fmt: WeightFormat, name: str, pattern: str
) -> None:
    experts = make_experts(fmt, fmt)
    with pytest.raises(ValueError, match=pattern) as info:
        experts.load_weights([(name, torch.zeros(1))])
    assert repr(name) in str(info.value)


def test_fused_tensor_errors() -> None:
    fp8 = make_experts(WeightFormat.FP8_BLOCK, WeightFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match=r"fused expert tensor 'gate_up_proj' in a fp8_block"):
        fp8.load_weights(
            [("gate_up_proj", torch.zeros(LOGICAL, 2 * INTER, H, dtype=torch.bfloat16))]
        )
    bf16 = make_experts(WeightFormat.BF16, WeightFormat.BF16)
    wrong = torch.zeros(LOGICAL, INTER, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused gate_up_proj has shape \(4, 128, 256\), expected "
                       r"\(4, 256, 256\) = \(E, 2I, H\)"):  # fmt: skip
        bf16.load_weights([("gate_up_proj", wrong)])
    with pytest.raises(ValueError, match=r"fused down_proj has shape \(4, 128, 256\), expected "
                       r"\(4, 256, 128\) = \(E, H, I\)"):  # fmt: skip
        bf16.load_weights([("down_proj", wrong)])


def test_a_failed_load_keeps_the_previous_weights() -> None:
    experts = make_experts(WeightFormat.MXFP8, WeightFormat.MXFP8)
    experts.load_weights(stream_of(WeightFormat.MXFP8))
    experts.finalize()
    before = kernel_state(experts)
    update = [(n, t) for n, t in stream_of(WeightFormat.MXFP8) if n.startswith("0.")]
    with pytest.raises(ValueError, match="unexpected"):
        experts.load_weights([*update, ("0.gate_proj.bias", torch.zeros(1))])
    experts.finalize()  # nothing pending: the failed update was discarded
    for name, tensor in kernel_state(experts).items():
        assert_bitwise_equal(tensor, before[name], name)
