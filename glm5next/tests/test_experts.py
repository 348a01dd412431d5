"""Glm5NextMegaMoEExperts: block-FP8 shards written in place, requantized to MXFP8 in place."""

from __future__ import annotations

import random
import re
import warnings
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.core.errors import IncompleteShardsError, MissingExpertsError, NonFiniteError
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_expert_tensors
from megamoe.glm5next import Glm5NextMegaMoEExperts

FP8, MX = WeightFormat.FP8_BLOCK, WeightFormat.MXFP8
E, H, INTER = 6, 256, 128  # experts, hidden, intermediate
PROJS = ("gate_proj", "up_proj", "down_proj")
PREFIX = "model.language_model.layers.1.mlp.experts"
NOT_POW2 = "ignore:.*not powers of two:UserWarning"

pytestmark = pytest.mark.filterwarnings(NOT_POW2)

Tensors = dict[str, torch.Tensor]


def _routed(seed: int = 0, pow2: bool | None = None, num: int = E) -> Tensors:
    return dict(synthetic_expert_tensors(FP8, num, H, INTER, seed=seed, pow2_block_scales=pow2))


def _shared(seed: int = 0, width: int = INTER, pow2: bool | None = None) -> Tensors:
    """The shared MLP ``{proj}.{kind}`` (intermediate ``width``)."""
    tensors = synthetic_expert_tensors(FP8, 1, H, width, seed=seed + 100, pow2_block_scales=pow2)
    return {name.removeprefix("0."): t for name, t in tensors}


def _experts(run: WeightFormat = MX, **overrides: Any) -> Glm5NextMegaMoEExperts:
    kwargs: dict[str, Any] = {
        "num_experts": E,
        "num_local_experts": E,
        "experts_start_idx": 0,
        "num_logical_experts": E,
        "top_k": 2,
        "hidden_size": H,
        "intermediate_size": INTER,
        "weight_format": run,
        "checkpoint_format": FP8,
        "backend": "reference",
        "reload_staging_bytes": STAGE_WHOLE_RELOAD,  # the bounded budget: core's tests
        "prefix": PREFIX,
    }
    kwargs.update(overrides)
    return Glm5NextMegaMoEExperts(**kwargs)


def _load(module: Glm5NextMegaMoEExperts, routed: Tensors, shared: Tensors | None = None) -> None:
    module.load_weights(routed.items())
    for name, tensor in (shared or {}).items():
        module.load_shared_expert_weight(name, tensor)


def _expected_l1_l2(tensors: Tensors, prefix: str) -> tuple[tuple[torch.Tensor, ...], ...]:
    """quant.requantize of the checkpoint tensors: (w13, s13), (w2, s2)."""
    gate_up = [tensors[f"{prefix}{p}.weight"] for p in PROJS[:2]]
    scales = [tensors[f"{prefix}{p}.weight_scale_inv"] for p in PROJS[:2]]
    l1 = quant.requantize(torch.cat(gate_up), torch.cat(scales), FP8, MX)
    l2 = quant.requantize(
        tensors[f"{prefix}down_proj.weight"],
        tensors[f"{prefix}down_proj.weight_scale_inv"],
        FP8,
        MX,
    )
    return l1, l2


def _state(module: Glm5NextMegaMoEExperts) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.kernel_params.items()}


# -- bit-exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_requantized_weights_equal_quant_requantize(chunk: int) -> None:
    routed, shared = _routed(seed=1), _shared(seed=1)
    module = _experts(num_shared_experts=1)
    _load(module, routed, shared)
    assert module.pending_requantization  # written in place, not yet rounded
    module.requantize_block_fp8(chunk=chunk)
    assert not module.pending_requantization
    params = module.kernel_params
    for e in range(E):
        (w13, s13), (w2, s2) = _expected_l1_l2(routed, f"{e}.")
        assert_bitwise_equal(params["w13_weight"][e], w13, f"expert {e} w13")
        assert_bitwise_equal(params["w13_weight_scale"][e], s13, f"expert {e} w13 scale")
        assert_bitwise_equal(params["w2_weight"][e], w2, f"expert {e} w2")
        assert_bitwise_equal(params["w2_weight_scale"][e], s2, f"expert {e} w2 scale")
    (w13, s13), (w2, s2) = _expected_l1_l2(shared, "")
    assert_bitwise_equal(params["shared_l1_weight"][0], w13, "shared l1")
    assert_bitwise_equal(params["shared_l1_weight_scale"][0], s13, "shared l1 scale")
    assert_bitwise_equal(params["shared_l2_weight"][0], w2, "shared l2")
    assert_bitwise_equal(params["shared_l2_weight_scale"][0], s2, "shared l2 scale")


L1_WEIGHTS = ("w13_weight", "shared_l1_weight")


@pytest.mark.parametrize("chunk", [1, 8])
def test_the_kernel_row_order_holds_the_same_bits(chunk: int) -> None:
    """Stored in DeepGEMM's gate/up row order (groups of 8, as its backend stores them),
    the in-place first load and a staged reload give the canonical bits, reordered."""
    routed, shared = _routed(seed=1), _shared(seed=1)
    new_routed, new_shared = _routed(seed=2), _shared(seed=2)
    states = []
    for order in (L1RowOrder(), L1RowOrder(group=8)):
        module = _experts(num_shared_experts=1)
        module.l1_order = order  # what the DeepGEMM backend picks (it needs a GPU)
        _load(module, routed, shared)
        module.requantize_block_fp8(chunk=chunk)
        module.finalize()
        first = {
            n: order.to_canonical(t) if n in L1_WEIGHTS else t for n, t in _state(module).items()
        }
        _load(module, new_routed, new_shared)  # a reload: requantized as it loads, staged
        module.finalize()
        second = {
            n: order.to_canonical(t) if n in L1_WEIGHTS else t for n, t in _state(module).items()
        }
        states.append((first, second))
    (canonical_first, canonical_second), (reordered_first, reordered_second) = states
    for name in canonical_first:
        assert_bitwise_equal(reordered_first[name], canonical_first[name], f"first load {name}")
        assert_bitwise_equal(reordered_second[name], canonical_second[name], f"reload {name}")


def test_two_shared_experts_split_the_shared_mlp() -> None:
    shared = _shared(seed=2, width=2 * INTER)
    module = _experts(num_shared_experts=2)
    _load(module, _routed(seed=2), shared)
    module.finalize()
    params = module.kernel_params
    for s in range(2):
        rows = slice(s * INTER, (s + 1) * INTER)
        part = {
            "gate_proj.weight": shared["gate_proj.weight"][rows],
            "up_proj.weight": shared["up_proj.weight"][rows],
            "down_proj.weight": shared["down_proj.weight"][:, rows].contiguous(),
            "gate_proj.weight_scale_inv": shared["gate_proj.weight_scale_inv"][s : s + 1],
            "up_proj.weight_scale_inv": shared["up_proj.weight_scale_inv"][s : s + 1],
            "down_proj.weight_scale_inv": shared["down_proj.weight_scale_inv"][:, s : s + 1],
        }
        (w13, s13), (w2, s2) = _expected_l1_l2(part, "")
        assert_bitwise_equal(params["shared_l1_weight"][s], w13, f"shared {s} l1")
        assert_bitwise_equal(params["shared_l1_weight_scale"][s], s13, f"shared {s} l1 scale")
        assert_bitwise_equal(params["shared_l2_weight"][s], w2, f"shared {s} l2")
        assert_bitwise_equal(params["shared_l2_weight_scale"][s], s2, f"shared {s} l2 scale")


def test_power_of_two_blocks_requantize_exactly() -> None:
    routed = _routed(seed=3, pow2=True)
    module = _experts()
    _load(module, routed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no power-of-two warning either
        module.requantize_block_fp8()
    params = module.kernel_params
    for e in range(E):
        block = quant.dequantize(
            torch.cat([routed[f"{e}.{p}.weight"] for p in PROJS[:2]]),
            torch.cat([routed[f"{e}.{p}.weight_scale_inv"] for p in PROJS[:2]]),
            FP8,
        )
        mx = quant.dequantize(params["w13_weight"][e], params["w13_weight_scale"][e], MX)
        assert_bitwise_equal(mx, block, f"expert {e} dequantized w13")


def test_other_block_scales_change_the_weights() -> None:
    # The counterpart of the exact case: the same check fails for non-power-of-two scales.
    routed = _routed(seed=3, pow2=False)
    module = _experts()
    _load(module, routed)
    module.requantize_block_fp8()
    params = module.kernel_params
    block = quant.dequantize(
        routed["0.down_proj.weight"], routed["0.down_proj.weight_scale_inv"], FP8
    )
    mx = quant.dequantize(params["w2_weight"][0], params["w2_weight_scale"][0], MX)
    assert not torch.equal(mx, block)
    # Rounding to E4M3 again: within half an E4M3 step (2^-4 relative) of the magnitude.
    assert float(((mx - block).abs() / block.abs().clamp_min(1e-12)).max()) <= 2**-3


def test_not_power_of_two_warns_once_naming_the_option(fresh_power_of_two_warning: None) -> None:
    module = _experts()
    _load(module, _routed(seed=4))
    with pytest.warns(UserWarning, match=re.escape('moe_format="fp8_block"')) as record:
        module.requantize_block_fp8(chunk=2)  # three chunks with such scales, one warning
    assert len([w for w in record if "powers of two" in str(w.message)]) == 1
    again = _experts()
    _load(again, _routed(seed=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.requantize_block_fp8()


# -- Hopper / forced block-FP8: no requantization ------------------------------------------


def test_fp8_block_run_format_keeps_the_checkpoint_bits(fresh_power_of_two_warning: None) -> None:
    routed = _routed(seed=6)
    module = _experts(run=FP8)
    assert not module.requantizes_in_place
    assert not hasattr(module, "w13_weight_scale_inv")
    _load(module, routed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no power-of-two warning: nothing is rounded
        module.finalize()
    params = module.kernel_params
    for e in range(E):
        gate_up = torch.cat([routed[f"{e}.{p}.weight"] for p in PROJS[:2]])
        scales = torch.cat([routed[f"{e}.{p}.weight_scale_inv"] for p in PROJS[:2]])
        assert_bitwise_equal(params["w13_weight"][e], gate_up, f"expert {e} w13")
        assert_bitwise_equal(params["w13_weight_scale"][e], scales, f"expert {e} w13 scale")


# -- split loads, updates -------------------------------------------------------------------


def _reference_state() -> dict[str, torch.Tensor]:
    module = _experts(num_shared_experts=1)
    _load(module, _routed(seed=7), _shared(seed=7))
    module.finalize()
    return _state(module)


_REFERENCE: dict[str, torch.Tensor] = {}


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(1, 4),
    calls=st.integers(1, 6),
    chunk=st.integers(1, 8),
    resend=st.booleans(),
)
def test_split_loads_give_identical_bits(
    seed: int, rounds: int, calls: int, chunk: int, resend: bool
) -> None:
    """Weights and scales in different calls, any order, several requantize rounds."""
    if not _REFERENCE:
        _REFERENCE.update(_reference_state())
    rng = random.Random(seed)
    items = [("r", n, t) for n, t in _routed(seed=7).items()]
    items += [("s", n, t) for n, t in _shared(seed=7).items()]
    shards = sorted({(kind, name.rsplit(".", 1)[0]) for kind, name, _ in items})
    rng.shuffle(shards)
    module = _experts(num_shared_experts=1)
    for r in range(rounds):
        # Each round completes its shards (a weight update must), delivered shuffled.
        mine = set(shards[r::rounds])
        if resend and r == rounds - 1:
            mine |= set(shards[: len(shards) // 3])  # an update re-sending loaded shards
        batch = [item for item in items if (item[0], item[1].rsplit(".", 1)[0]) in mine]
        rng.shuffle(batch)
        for c in range(calls):
            part = batch[c::calls]
            module.load_weights([(n, t) for kind, n, t in part if kind == "r"])
            for _, n, t in (item for item in part if item[0] == "s"):
                module.load_shared_expert_weight(n, t)
        module.requantize_block_fp8(chunk=chunk)
    module.finalize()
    for name, want in _REFERENCE.items():
        assert_bitwise_equal(module.kernel_params[name].detach(), want, name)


def test_missing_halves_name_local_expert_and_shard() -> None:
    # Rank 1 of 2: logical experts 6..11 live in local slots 0..5.
    module = _experts(
        num_experts=2 * E, num_logical_experts=2 * E, experts_start_idx=E, num_shared_experts=1
    )
    routed, shared = _routed(seed=8, num=2 * E), _shared(seed=8)
    module.load_weights([("9.gate_proj.weight", routed["9.gate_proj.weight"])])
    module.load_weights([("7.down_proj.weight_scale_inv", routed["7.down_proj.weight_scale_inv"])])
    module.load_shared_expert_weight("up_proj.weight", shared["up_proj.weight"])
    with pytest.raises(IncompleteShardsError) as err:
        module.requantize_block_fp8()
    message = str(err.value)
    assert "gate_proj.weight_scale_inv of local expert 3" in message
    assert "down_proj.weight of local expert 1" in message
    assert "up_proj.weight_scale_inv of the shared expert" in message
    assert set(err.value.missing) == {(3, "w1"), (1, "w2"), (None, "w3")}
    # The update stays pending: the missing halves complete it.
    module.load_weights([("9.gate_proj.weight_scale_inv", routed["9.gate_proj.weight_scale_inv"])])
    module.load_weights([("7.down_proj.weight", routed["7.down_proj.weight"])])
    module.load_shared_expert_weight("up_proj.weight_scale_inv", shared["up_proj.weight_scale_inv"])
    module.requantize_block_fp8()
    (w13, _), _ = _expected_l1_l2(routed, "9.")
    assert_bitwise_equal(
        module.kernel_params["w13_weight"][3][:INTER], w13[:INTER], "expert 9 gate"
    )
    _, (w2, _) = _expected_l1_l2(routed, "7.")
    assert_bitwise_equal(module.kernel_params["w2_weight"][1], w2, "expert 7 down")


def test_the_backend_prepares_a_first_load_only_once_it_is_complete(monkeypatch) -> None:
    """A first load missing an expert: finalize() names the slot and prepares nothing (the
    DeepGEMM backend refuses a first prepare() of a subset), keeping the load pending; once
    the expert arrives one prepare() covers every slot."""
    module = _experts()
    calls: list[list[int]] = []
    prepare = module.backend.prepare
    monkeypatch.setattr(
        module.backend,
        "prepare",
        lambda experts, ids: (calls.append(list(ids)), prepare(experts, ids)),
    )
    routed = _routed(seed=21)
    module.load_weights((n, t) for n, t in routed.items() if not n.startswith(f"{E - 1}."))
    with pytest.raises(MissingExpertsError, match=r"1 kernel slot\(s\) never received"):
        module.finalize()
    assert calls == []
    module.load_weights((n, t) for n, t in routed.items() if n.startswith(f"{E - 1}."))
    module.finalize()
    assert calls == [list(range(E))]
    fresh = _experts()
    _load(fresh, routed)
    fresh.finalize()
    for name, value in fresh.kernel_params.items():
        assert_bitwise_equal(module.kernel_params[name], value, name)


def test_second_update_changes_only_that_subset() -> None:
    module = _experts()
    _load(module, _routed(seed=9))
    module.finalize()
    before = _state(module)
    pointers = {n: p.data_ptr() for n, p in module.kernel_params.items()}
    assert module.w13_weight_scale_inv.numel() == 0, "the first finalize frees the staging"
    assert module.w2_weight_scale_inv.numel() == 0
    update = _routed(seed=10)
    changed = (2, 5)
    module.load_weights((n, t) for n, t in update.items() if int(n.split(".")[0]) in changed)
    module.finalize()
    after = module.kernel_params
    for e in range(E):
        for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
            if e in changed:
                continue
            assert_bitwise_equal(after[name][e], before[name][e], f"untouched expert {e} {name}")
    for e in changed:
        (w13, s13), (w2, s2) = _expected_l1_l2(update, f"{e}.")
        assert_bitwise_equal(after["w13_weight"][e], w13, f"updated expert {e} w13")
        assert_bitwise_equal(after["w13_weight_scale"][e], s13, f"updated expert {e} w13 scale")
        assert_bitwise_equal(after["w2_weight"][e], w2, f"updated expert {e} w2")
        assert_bitwise_equal(after["w2_weight_scale"][e], s2, f"updated expert {e} w2 scale")
        assert not torch.equal(after["w13_weight"][e], before["w13_weight"][e])
    now = {n: p.data_ptr() for n, p in module.kernel_params.items()}
    assert now == pointers
    assert module.w13_weight_scale_inv.numel() == 0, "a reload stages in the run format"


def test_a_reload_is_staged_and_the_previous_weights_serve_until_finalize() -> None:
    routed = _routed(seed=11)
    module = _experts()
    _load(module, routed)
    module.finalize()
    x = torch.randn(4, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 4)
    weights = torch.full((4, 2), 0.5)
    before = module(x, weights, ids)
    module.load_weights([(n, t) for n, t in _routed(seed=12).items() if n.startswith("1.")])
    assert not module.pending_requantization and module.pending_bytes > 0  # staged in MXFP8
    assert_bitwise_equal(module(x, weights, ids), before, "output before finalize")
    module.finalize()
    assert not torch.equal(module(x, weights, ids), before)


def test_update_failing_midway_is_dropped_then_completes() -> None:
    module = _experts()
    _load(module, _routed(seed=14))
    module.finalize()
    x, ids, weights = (
        torch.randn(4, H).to(torch.bfloat16),
        torch.tensor([[2, 3]] * 4),
        torch.ones(4, 2),
    )
    update = _routed(seed=15)
    good = [(n, t) for n, t in update.items() if n.startswith("2.")]
    bad = [("3.up_proj.weight", torch.zeros(INTER, H + 128, dtype=torch.float8_e4m3fn))]
    before = module(x, weights, ids)
    with pytest.raises(ValueError, match=r"expert 3 up_proj.weight has shape \(128, 384\)"):
        module.load_weights(good + bad)
    module.finalize()  # the failed update was dropped, expert 2 included
    assert_bitwise_equal(module(x, weights, ids), before, "output after the failed update")
    module.load_weights(good)
    module.finalize()
    (w13, _), _ = _expected_l1_l2(update, "2.")
    assert_bitwise_equal(module.kernel_params["w13_weight"][2], w13, "expert 2 after the retry")
    assert not torch.equal(module(x, weights, ids), before)


def test_redundant_replicas_receive_the_same_bits() -> None:
    routed = _routed(seed=13)
    module = _experts(num_experts=E + 2, num_local_experts=E + 2)  # physical 6, 7 = logical 0, 1
    _load(module, routed)
    module.finalize()
    params = module.kernel_params
    for replica, logical in ((E, 0), (E + 1, 1)):
        for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
            assert_bitwise_equal(params[name][replica], params[name][logical], f"{name} {replica}")


# -- error paths ----------------------------------------------------------------------------


def test_block_size_other_than_128_is_refused() -> None:
    with pytest.raises(
        NotImplementedError, match=r"weight_block_size=\[128, 64\] is not supported"
    ):
        _experts(weight_block_size=(128, 64))


@pytest.mark.parametrize(("option", "value"), [("hidden_size", 192), ("intermediate_size", 64)])
def test_sizes_off_the_block_grid_are_refused(option: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{option}={value} must be a positive multiple of 128"):
        _experts(**{option: value})


def test_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"chunk=0 must be >= 1"):
        _experts().requantize_block_fp8(chunk=0)


def test_unexpected_shared_name_is_named() -> None:
    module = _experts(num_shared_experts=1)
    with pytest.raises(ValueError, match=r"unexpected shared-expert tensor 'gate_proj.bias'"):
        module.load_shared_expert_weight("gate_proj.bias", torch.zeros(1))


def test_shared_weight_without_fused_shared_expert() -> None:
    shared = _shared()
    with pytest.raises(ValueError, match=r"num_shared_experts=0"):
        _experts().load_shared_expert_weight("gate_proj.weight", shared["gate_proj.weight"])


def test_wrong_block_scale_shape_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"gate_proj.weight_scale_inv has shape \(2, 2\), expected \(1, 2\)"
    ):
        _experts().load_weights([("0.gate_proj.weight_scale_inv", torch.ones(2, 2))])


def test_non_finite_block_scale_is_refused() -> None:
    scale = torch.ones(1, 2)
    scale[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"gate_proj.weight_scale_inv holds 1 non-finite"):
        _experts().load_weights([("0.gate_proj.weight_scale_inv", scale)])
