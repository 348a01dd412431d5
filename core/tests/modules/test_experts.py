"""MegaMoEExperts: parameters, placement, loading, reload, failure safety and every error path.

Numerics of the forward against a float64 MoE live in ``test_reference_backend.py``; here
kernel tensors are compared bit for bit wherever the result is defined exactly.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Iterable

import pytest
import torch
from bitcheck import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megamoe.core.errors import (
    CapabilityError,
    FormatMismatchError,
    IncompleteShardsError,
    MissingExpertsError,
    NonFiniteError,
)
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.loading.finiteness import NonFiniteLedger
from megamoe.core.loading.tagging import KernelTag, check_tags, tag
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.core.testing import synthetic_expert_tensors

FORMATS = list(RUN_FORMATS)
H, INTER = 256, 256
Stream = list[tuple[str, torch.Tensor]]


def build(
    run_format: WeightFormat | str = WeightFormat.MXFP8,
    checkpoint_format: WeightFormat | str = WeightFormat.FP8_BLOCK,
    **overrides: object,
) -> MegaMoEExperts:
    kwargs: dict[str, object] = {
        "num_experts": 4,
        "num_local_experts": 4,
        "experts_start_idx": 0,
        "num_logical_experts": 4,
        "top_k": 2,
        "hidden_size": H,
        "intermediate_size": INTER,
        "weight_format": run_format,
        "checkpoint_format": checkpoint_format,
        "max_num_tokens": 32,
        "reload_staging_bytes": STAGE_WHOLE_RELOAD,  # the bounded budget: its own tests
        "backend": "reference",
        "prefix": "model.layers.3.mlp.experts",
    }
    kwargs.update(overrides)
    return MegaMoEExperts(**kwargs)  # type: ignore[arg-type]


def stream(fmt: WeightFormat, count: int, seed: int = 0, h: int = H, i: int = INTER) -> Stream:
    return list(synthetic_expert_tensors(fmt, count, h, i, seed=seed))


def snapshot(m: MegaMoEExperts) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in m.named_parameters()}


def assert_params_equal(m: MegaMoEExperts, expected: dict[str, torch.Tensor], what: str) -> None:
    for name, p in m.named_parameters():
        assert_bitwise_equal(p.data, expected[name], f"{what}: {name}")


def routing(tokens: int, num_experts: int, top_k: int = 2, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    return x, torch.rand(tokens, top_k, generator=gen) + 0.1, ids


class PrepareSpy:
    """Records the local ids every backend.prepare call receives."""

    def __init__(self, m: MegaMoEExperts) -> None:
        self.calls: list[list[int]] = []
        original = m.backend.prepare

        def prepare(experts, local_ids):  # type: ignore[no-untyped-def]
            self.calls.append(list(local_ids))
            original(experts, local_ids)

        m.backend.prepare = prepare  # type: ignore[method-assign]


# ---------------------------------------------------------------- parameters and tags
@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f.value)
def test_kernel_parameters_in_canonical_form(run_format: WeightFormat):
    m = build(run_format, run_format, num_shared_experts=2)
    packed = 2 if run_format is WeightFormat.MXFP4 else 1
    want = {
        "w13_weight": ((4, 2 * INTER, H // packed), run_format.element_dtype),
        "w2_weight": ((4, H, INTER // packed), run_format.element_dtype),
        "shared_l1_weight": ((2, 2 * INTER, H // packed), run_format.element_dtype),
        "shared_l2_weight": ((2, H, INTER // packed), run_format.element_dtype),
    }
    if run_format is WeightFormat.FP8_BLOCK:
        scales = {"w13": (2 * INTER // 128, H // 128), "w2": (H // 128, INTER // 128)}
    elif run_format.is_mx:
        scales = {"w13": (2 * INTER, H // 32), "w2": (H, INTER // 32)}
    else:
        scales = {}
    for stem, shape in scales.items():
        want[f"{stem}_weight_scale"] = ((4, *shape), run_format.scale_dtype)  # type: ignore[assignment]
        shared_stem = "shared_l1" if stem == "w13" else "shared_l2"
        want[f"{shared_stem}_weight_scale"] = ((2, *shape), run_format.scale_dtype)  # type: ignore[assignment]
    got = {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()}
    assert got == want
    tag_want = KernelTag(run_format, run_format.scale_block, 2)
    assert m.kernel_tag == tag_want
    for p in m.parameters():
        assert not p.requires_grad
        assert getattr(p, "megamoe_kernel_tag", None) == tag_want


def test_kernel_tag_describes_itself():
    t = KernelTag.for_format(WeightFormat.FP8_BLOCK, 1)
    assert t.describe() == "fp8_block (128x128, 1 shared, no clamp)"
    assert (
        KernelTag.for_format(WeightFormat.BF16).describe() == "bf16 (no scale, 0 shared, no clamp)"
    )
    clamped = KernelTag.for_format(WeightFormat.MXFP8, 0, 7.5)
    assert clamped.describe() == "mxfp8 (1x32, 0 shared, clamp 7.5)"
    assert clamped != KernelTag.for_format(WeightFormat.MXFP8)
    assert clamped.buffer_tag == KernelTag.for_format(WeightFormat.MXFP8)
    x = torch.zeros(1)
    with pytest.raises(FormatMismatchError, match=r"layer: x is tagged no tag, .* fp8_block"):
        check_tags(t, {"x": x}, "layer")
    tag(x, t)
    check_tags(t, {"x": x}, "layer")


# ---------------------------------------------------------------- construction checks
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 200}, r"hidden_size=200 must be a positive multiple of 128"),
        ({"intermediate_size": 0}, r"intermediate_size=0 must be a positive multiple of 128"),
        ({"num_logical_experts": 0}, r"num_logical_experts=0 must be >= 1"),
        ({"num_experts": 3, "num_local_experts": 3}, r"num_experts=3 must be >= num_logical"),
        ({"num_experts": 8, "num_local_experts": 3}, r"num_local_experts=3 must be a divisor"),
        ({"num_experts": 8, "experts_start_idx": 2}, r"experts_start_idx=2 must be rank \*"),
        ({"num_experts": 8, "experts_start_idx": 8}, r"experts_start_idx=8 must be rank \*"),
        ({"top_k": 0}, r"top_k=0 must be in \[1, num_experts=4\]"),
        ({"top_k": 5}, r"top_k=5 must be in \[1, num_experts=4\]"),
        ({"num_shared_experts": -1}, r"num_shared_experts=-1 must be >= 0"),
        ({"max_num_tokens": 0}, r"max_num_tokens=0 must be >= 1"),
        ({"weight_format": "nvfp4"}, r"weight_format='nvfp4' is a checkpoint format megamoe"),
        ({"weight_format": "fp6"}, r"unknown weight format 'fp6'"),
        ({"backend": "fast"}, r"unknown experts backend 'fast'"),
    ],
)
def test_constructor_rejects(overrides: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message):
        build(**overrides)


def test_explicit_deepgemm_on_cpu_is_a_capability_error():
    with pytest.raises(CapabilityError, match=r"backend 'deepgemm' cannot run mxfp8 on cpu"):
        build(backend="deepgemm")


def test_sizes_are_checked_before_any_allocation():
    # Allocating these sizes would need petabytes: the size rule must fire first.
    huge = 2**40 + 1
    with pytest.raises(ValueError, match=rf"hidden_size={huge} must be a positive multiple"):
        build(hidden_size=huge, intermediate_size=2**40)
    with pytest.raises(ValueError, match=r"top_k=0"):
        build(hidden_size=2**40, intermediate_size=2**40, top_k=0)


# ---------------------------------------------------------------- placement
@pytest.mark.parametrize(
    ("ep_size", "rank", "expected"),
    [
        # 8 physical experts hold 6 logical ones: physical p holds logical p % 6.
        (1, 0, {0: [0, 6], 1: [1, 7], 2: [2], 5: [5]}),
        (2, 0, {0: [0], 1: [1], 3: [3], 4: [], 5: []}),
        (2, 1, {0: [2], 1: [3], 4: [0], 5: [1], 2: []}),
        (4, 3, {0: [0], 1: [1], 2: [], 5: []}),
        (4, 2, {4: [0], 5: [1], 0: []}),
    ],
)
def test_map_global_expert_id_with_redundant_experts(
    ep_size: int, rank: int, expected: dict[int, list[int]]
):
    local = 8 // ep_size
    m = build(num_experts=8, num_local_experts=local, experts_start_idx=rank * local,
              num_logical_experts=6)  # fmt: skip
    for logical, slots in expected.items():
        assert m.map_global_expert_id(logical) == slots
    with pytest.raises(
        ValueError, match=r"expert id 6 is out of range \[0, num_logical_experts=6\)"
    ):
        m.map_global_expert_id(6)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_expert_parallel_ranks_add_up_to_one_rank(ep_size: int):
    """Simulated ranks: each holds its slice; their contributions sum to the whole layer."""
    fmt = WeightFormat.FP8_BLOCK
    tensors = stream(fmt, 6)
    whole = build(WeightFormat.MXFP8, fmt, num_experts=8, num_local_experts=8,
                  num_logical_experts=6, top_k=3)  # fmt: skip
    whole.load_weights(tensors)
    whole.finalize()
    # Replicas hold the same bits: physical 6 and 7 repeat logical 0 and 1.
    for replica, original in ((6, 0), (7, 1)):
        for name, p in whole.named_parameters():
            assert_bitwise_equal(p.data[replica], p.data[original], f"replica {replica} {name}")
    x, w, ids = routing(12, 8, top_k=3, seed=1)
    local = 8 // ep_size
    total = torch.zeros(12, 3, H)
    outputs = torch.zeros(12, H, dtype=torch.float64)
    for rank in range(ep_size):
        part = build(WeightFormat.MXFP8, fmt, num_experts=8, num_local_experts=local,
                     experts_start_idx=rank * local, num_logical_experts=6, top_k=3)  # fmt: skip
        part.load_weights(tensors)  # the whole stream: other ranks' experts are skipped
        part.finalize()
        for name, p in part.named_parameters():
            assert_bitwise_equal(
                p.data, whole.get_parameter(name).data[rank * local : (rank + 1) * local], name
            )
        total += part.backend.expert_contributions(part, x.float(), w, ids)  # type: ignore[attr-defined]
        outputs += part(x, w, ids).double()
    expected = whole.backend.expert_contributions(whole, x.float(), w, ids)  # type: ignore[attr-defined]
    assert_bitwise_equal(total, expected, "sum over ranks of (token, slot) contributions")
    single = whole(x, w, ids).double()
    # Each rank's bf16 output is rounded once (2^-9 relative), so the sum is close, not exact.
    assert bool(((outputs - single).abs() <= 2.0**-7 * single.abs() + 1e-2).all())


# ---------------------------------------------------------------- load order, chunking
ORDER_CASES = [
    (WeightFormat.MXFP8, WeightFormat.FP8_BLOCK),
    (WeightFormat.FP8_BLOCK, WeightFormat.MXFP4),
    (WeightFormat.MXFP4, WeightFormat.BF16),
    (WeightFormat.MXFP8, WeightFormat.MXFP8),
]


@pytest.mark.parametrize(("run_format", "checkpoint_format"), ORDER_CASES,
                         ids=lambda f: f.value)  # fmt: skip
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_order_and_chunking_gives_identical_kernel_weights(
    run_format: WeightFormat, checkpoint_format: WeightFormat, data: st.DataObject
):
    small = {"hidden_size": 128, "intermediate_size": 128, "num_experts": 4,
             "num_local_experts": 4, "num_logical_experts": 3}  # fmt: skip
    tensors = stream(checkpoint_format, 3, h=128, i=128)
    reference = build(run_format, checkpoint_format, **small)
    reference.load_weights(tensors)
    reference.finalize()
    order = data.draw(st.permutations(range(len(tensors))), label="order")
    items = [tensors[k] for k in order]
    # A whole shard sent again (a second update of the same values) changes nothing.
    shards = sorted({n.rsplit(".", 1)[0] for n, _ in tensors})
    for shard in data.draw(st.lists(st.sampled_from(shards), max_size=3), label="again"):
        halves = [(n, t) for n, t in tensors if n.startswith(shard + ".")]
        items += data.draw(st.permutations(halves), label="halves")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(items) - 1), max_size=6), label="cuts"))
    m = build(run_format, checkpoint_format, **small)
    for start, stop in zip([0, *cuts], [*cuts, len(items)], strict=True):
        m.load_weights(items[start:stop])
    m.finalize()
    assert_params_equal(m, snapshot(reference), f"order {order}, cuts {cuts}")


# ---------------------------------------------------------------- reload
def mixed_stream(fmt: WeightFormat, count: int, changed: Iterable[int]) -> Stream:
    """seed-0 tensors, with experts in ``changed`` from seed 1."""
    new = dict(stream(fmt, count, seed=1))
    changed = {str(e) for e in changed}
    return [(n, new[n] if n.split(".")[0] in changed else t) for n, t in stream(fmt, count)]


@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f.value)
def test_reload_of_a_subset_is_in_place_and_touches_only_it(run_format: WeightFormat):
    fmt = WeightFormat.FP8_BLOCK if run_format is not WeightFormat.BF16 else WeightFormat.BF16
    # 6 physical experts hold 4 logical ones: logical 1 also lives in slot 5.
    sizes = {"num_experts": 6, "num_local_experts": 6, "num_logical_experts": 4}
    m = build(run_format, fmt, **sizes)
    m.load_weights(stream(fmt, 4))
    m.finalize()
    pointers = {n: p.data_ptr() for n, p in m.named_parameters()}
    spy = PrepareSpy(m)
    update = [(n, t) for n, t in stream(fmt, 4, seed=1) if n.split(".")[0] in ("1", "3")]
    random.Random(0).shuffle(update)
    m.load_weights(update[:5])
    m.load_weights(update[5:])
    # Staging holds each changed logical expert once, however many replicas it has.
    per_expert = sum(p[0].numel() * p.element_size() for p in m.parameters())
    assert m.pending_bytes == 2 * per_expert
    m.finalize()
    assert spy.calls == [[1, 3, 5]]
    expected = build(run_format, fmt, **sizes)
    expected.load_weights(mixed_stream(fmt, 4, changed=(1, 3)))
    expected.finalize()
    assert_params_equal(m, snapshot(expected), "after reloading experts 1 and 3")
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == pointers
    m.finalize()  # idempotent: nothing pending, nothing redone
    assert spy.calls == [[1, 3, 5]]
    # One projection alone: only that shard of that expert changes.
    before = snapshot(m)
    down = [(n, t) for n, t in stream(fmt, 4, seed=2) if n.startswith("2.down_proj.")]
    m.load_weights(down)
    m.finalize()
    assert spy.calls[-1] == [2]
    for name, p in m.named_parameters():
        if name.startswith("w2"):
            assert not torch.equal(p.data[2], before[name][2]), name
            keep = [s for s in range(6) if s != 2]
            assert_bitwise_equal(p.data[keep], before[name][keep], name)
        else:
            assert_bitwise_equal(p.data, before[name], name)
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == pointers


def _nan_bf16(t: torch.Tensor) -> torch.Tensor:
    bad = t.clone()
    bad[3, 5] = float("nan")
    return bad


def _inf_scale(t: torch.Tensor) -> torch.Tensor:
    bad = t.clone()
    bad[0, 1] = float("inf")
    return bad


@pytest.mark.parametrize(
    ("checkpoint_format", "target", "corrupt", "error", "message"),
    [
        (WeightFormat.BF16, "2.up_proj.weight", _nan_bf16, NonFiniteError,
         r"expert 2 up_proj.weight holds 1 non-finite value"),
        (WeightFormat.FP8_BLOCK, "1.down_proj.weight_scale_inv", _inf_scale, NonFiniteError,
         r"expert 1 down_proj.weight_scale_inv holds 1 non-finite value"),
        (WeightFormat.FP8_BLOCK, "2.gate_proj.weight", lambda t: t[:128], ValueError,
         r"expert 2 gate_proj.weight has shape \(128, 256\), expected \(256, 256\)"),
        (WeightFormat.MXFP8, "3.gate_proj.weight_scale", lambda t: t.float(), ValueError,
         r"expert 3 gate_proj.weight_scale has dtype torch.float32, expected torch.uint8"),
    ],
)  # fmt: skip
def test_a_reload_that_fails_midway_leaves_the_previous_weights_serving(
    checkpoint_format: WeightFormat,
    target: str,
    corrupt,
    error: type,
    message: str,  # type: ignore[no-untyped-def]
):
    m = build(WeightFormat.MXFP8, checkpoint_format)
    m.load_weights(stream(checkpoint_format, 4))
    m.finalize()
    before = snapshot(m)
    x, w, ids = routing(8, 4)
    out_before = m(x, w, ids)
    spy = PrepareSpy(m)
    update = [(n, corrupt(t) if n == target else t) for n, t in stream(checkpoint_format, 4, 1)]
    with pytest.raises(error, match=message):
        m.load_weights(update)
    assert m.pending_bytes == 0
    m.finalize()
    assert spy.calls == []
    assert_params_equal(m, before, "after a failed reload")
    assert_bitwise_equal(m(x, w, ids), out_before, "output after a failed reload")
    # The next complete update goes through.
    m.load_weights(stream(checkpoint_format, 4, seed=1))
    m.finalize()
    assert spy.calls == [[0, 1, 2, 3]]
    assert not torch.equal(m.w13_weight.data, before["w13_weight"])


def test_first_load_writes_in_place_and_a_failed_one_names_what_it_dropped():
    fmt = WeightFormat.MXFP8
    m = build(fmt, fmt)
    tensors = stream(fmt, 4)
    m.load_weights(tensors[:12])  # experts 0 and 1: nothing serves yet, nothing is staged
    assert m.pending_bytes == 0
    bad = [(n, t.view(torch.uint8).clone().fill_(0x7F).view(t.dtype) if n == "2.up_proj.weight"
            else t) for n, t in tensors[12:]]  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"expert 2 up_proj.weight holds 65536 non-finite"):
        m.load_weights(bad)
    with pytest.raises(MissingExpertsError, match=r"4 kernel slot\(s\) never received"):
        m.finalize()  # the failed update is dropped whole, experts 0 and 1 included
    m.load_weights(tensors)
    m.finalize()
    expected = build(fmt, fmt)
    expected.load_weights(tensors)
    expected.finalize()
    assert_params_equal(m, snapshot(expected), "after a failed first load")


def test_incomplete_reload_keeps_serving_until_its_missing_half_arrives():
    fmt = WeightFormat.FP8_BLOCK
    m = build(WeightFormat.MXFP8, fmt)
    m.load_weights(stream(fmt, 4))
    m.finalize()
    before = snapshot(m)
    new = dict(stream(fmt, 4, seed=1))
    m.load_weights([("1.gate_proj.weight", new["1.gate_proj.weight"])])
    missing = r"gate_proj.weight_scale_inv of local expert 1\b"
    with pytest.raises(IncompleteShardsError, match=missing):
        m.finalize()
    assert_params_equal(m, before, "while a shard waits for its scale")
    m.load_weights([("1.gate_proj.weight_scale_inv", new["1.gate_proj.weight_scale_inv"])])
    m.finalize()
    assert not torch.equal(m.w13_weight.data[1, :INTER], before["w13_weight"][1, :INTER])
    assert_bitwise_equal(m.w13_weight.data[1, INTER:], before["w13_weight"][1, INTER:], "up rows")


@pytest.mark.parametrize("fmt", [WeightFormat.BF16, WeightFormat.MXFP4], ids=lambda f: f.value)
def test_staged_tensors_do_not_alias_the_callers(fmt: WeightFormat):
    tensors = stream(fmt, 4)
    expected = build(fmt, fmt)
    expected.load_weights(tensors)
    expected.finalize()
    m = build(fmt, fmt)
    m.load_weights(tensors)
    for _, t in tensors:  # the caller reuses its buffers before finalize()
        t.view(torch.uint8).zero_()
    m.finalize()
    assert_params_equal(m, snapshot(expected), "after the caller overwrote its tensors")


def test_source_tensors_are_not_kept_alive():
    fmt = WeightFormat.MXFP8
    m = build(fmt, fmt)
    weight, scale = (t for n, t in stream(fmt, 4) if n.startswith("0.gate_proj."))
    refs = [weakref.ref(weight), weakref.ref(scale)]
    m.load_expert_tensor(0, "w1", "weight", weight)
    assert m.load_expert_tensor(0, "w1", "weight_scale", scale) == {
        "w13_weight", "w13_weight_scale"
    }  # fmt: skip
    del weight, scale
    gc.collect()
    assert [r() for r in refs] == [None, None]


# ---------------------------------------------------------------- loading errors
@pytest.mark.parametrize(
    ("checkpoint_format", "name", "message"),
    [
        (WeightFormat.FP8_BLOCK, "0.gate_proj.bias",
         r"unexpected fp8_block expert tensor '0.gate_proj.bias'; expected "
         r"\{expert\}.\{gate,up,down\}_proj.\{weight,weight_scale_inv\}"),
        (WeightFormat.FP8_BLOCK, "0.gate_proj.weight_scale", r"'0.gate_proj.weight_scale'"),
        (WeightFormat.FP8_BLOCK, "gate_up_proj", r"fused gate_up_proj / down_proj are BF16 only"),
        (WeightFormat.MXFP8, "0.gate_proj.weight_packed", r"'0.gate_proj.weight_packed'"),
        (WeightFormat.BF16, "shared_expert.gate_proj.weight", r"'shared_expert.gate_proj"),
        (WeightFormat.BF16, "4.gate_proj.weight", r"expert id 4 is out of range \[0, "),
    ],
)  # fmt: skip
def test_unexpected_names(checkpoint_format: WeightFormat, name: str, message: str):
    m = build(WeightFormat.MXFP8, checkpoint_format)
    with pytest.raises(ValueError, match=message):
        m.load_weights([(name, torch.zeros(INTER, H))])


def test_weight_packed_is_the_mxfp4_weight():
    fmt = WeightFormat.MXFP4
    plain, packed = build(fmt, fmt), build(fmt, fmt)
    tensors = stream(fmt, 4)
    plain.load_weights(tensors)
    packed.load_weights((n.replace(".weight", ".weight_packed", 1) if n.endswith(".weight")
                         else n, t) for n, t in tensors)  # fmt: skip
    plain.finalize()
    packed.finalize()
    assert_params_equal(packed, snapshot(plain), "weight_packed")


@pytest.mark.parametrize(
    ("checkpoint_format", "kind", "corrupt", "message"),
    [
        (WeightFormat.FP8_BLOCK, "weight", lambda t: t.to(torch.bfloat16),
         r"expert 1 down_proj.weight has dtype torch.bfloat16, expected torch.float8_e4m3fn"),
        (WeightFormat.FP8_BLOCK, "weight_scale_inv", lambda t: t[:, :1],
         r"expert 1 down_proj.weight_scale_inv has shape \(2, 1\), expected \(2, 2\)"),
        (WeightFormat.MXFP8, "weight",
         lambda t: t.view(torch.uint8).clone().index_fill_(1, torch.tensor([7]), 0x7F)
         .view(torch.float8_e4m3fn),
         r"expert 1 down_proj.weight holds 256 non-finite value"),
        (WeightFormat.MXFP4, "weight_scale", lambda t: t.clone().fill_(255),
         r"expert 1 down_proj.weight_scale holds 2048 non-finite value"),
        # finite scale bytes whose blocks overflow float32: 448 x 2^120, 6 x 2^126
        (WeightFormat.MXFP8, "weight_scale",
         lambda t: t.clone().index_fill_(1, torch.tensor([2]), 247),
         r"expert 1 down_proj.weight_scale holds 256 non-finite value\(s\) \(NaN/inf, or a scale"),
        (WeightFormat.MXFP4, "weight_scale",
         lambda t: t.clone().index_fill_(0, torch.tensor([5]), 253),
         r"expert 1 down_proj.weight_scale holds 8 non-finite value"),
        (WeightFormat.MXFP4, "weight", lambda t: t.T.contiguous(),
         r"expert 1 down_proj.weight has shape \(128, 256\), expected \(256, 128\)"),
    ],
)  # fmt: skip
def test_checkpoint_tensor_checks_name_the_tensor(
    checkpoint_format: WeightFormat,
    kind: str,
    corrupt,
    message: str,  # type: ignore[no-untyped-def]
):
    m = build(WeightFormat.MXFP8, checkpoint_format)
    good = dict(stream(checkpoint_format, 4))
    tensor = corrupt(good[f"1.down_proj.{kind}"])
    error = NonFiniteError if "non-finite" in message else ValueError
    with pytest.raises(error, match=message):
        m.load_expert_tensor(1, "w2", kind, tensor)


def test_bad_shard_id_and_kind():
    m = build(WeightFormat.MXFP8, WeightFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match=r"shard id 'w4' / kind 'weight'; expected a shard id in"):
        m.load_expert_tensor(0, "w4", "weight", torch.zeros(1))
    with pytest.raises(
        ValueError, match=r"kind 'weight_scale'; .* \('weight', 'weight_scale_inv'\)"
    ):
        m.load_expert_tensor(0, "w1", "weight_scale", torch.zeros(1))


def test_shared_expert_needs_num_shared_experts():
    m = build()
    with pytest.raises(ValueError, match=r"built with num_shared_experts=0; pass num_shared"):
        m.load_shared_expert_tensor("w1", "weight", torch.zeros(INTER, H))


def test_shared_expert_checks_the_whole_shared_mlp_shape():
    m = build(WeightFormat.BF16, WeightFormat.BF16, num_shared_experts=2)
    with pytest.raises(ValueError, match=r"shared expert down_proj.weight has shape \(256, 256\), "
                                         r"expected \(256, 512\)"):  # fmt: skip
        m.load_shared_expert_tensor("w2", "weight", torch.zeros(H, INTER, dtype=torch.bfloat16))


# ---------------------------------------------------------------- finalize errors
def test_never_loaded_experts_are_named():
    fmt = WeightFormat.FP8_BLOCK
    m = build(WeightFormat.MXFP8, fmt, num_experts=8, num_local_experts=4, experts_start_idx=4,
              num_shared_experts=1)  # fmt: skip
    m.load_weights((n, t) for n, t in stream(fmt, 4) if not n.startswith(("2.", "3.down")))
    with pytest.raises(MissingExpertsError) as info:
        m.finalize()
    text = str(info.value)
    assert "3 kernel slot(s) never received their tensors" in text
    assert "expert slot 2 (physical 6, logical 2): gate_proj+up_proj+down_proj" in text
    assert "expert slot 3 (physical 7, logical 3): down_proj" in text
    assert "shared expert 0: gate_proj+up_proj+down_proj" in text
    with pytest.raises(RuntimeError, match=r"forward\(\) before finalize\(\)"):
        m(*routing(2, 8))


def test_unpaired_halves_are_named_at_finalize():
    fmt = WeightFormat.MXFP4
    m = build(WeightFormat.MXFP4, fmt)
    tensors = [(n, t) for n, t in stream(fmt, 4) if n != "2.up_proj.weight_scale"]
    m.load_weights(tensors)
    with pytest.raises(IncompleteShardsError, match=r"up_proj.weight_scale of local expert 2\b"):
        m.finalize()


# ---------------------------------------------------------------- forward errors
@pytest.fixture(scope="module")
def loaded() -> MegaMoEExperts:
    m = build(WeightFormat.MXFP4, WeightFormat.MXFP4)
    m.load_weights(stream(WeightFormat.MXFP4, 4))
    m.finalize()
    return m


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda x, w, i: (x.float(), w, i), TypeError,
         r"hidden_states has dtype torch.float32, expected torch.bfloat16"),
        (lambda x, w, i: (x[:, :128], w, i), ValueError,
         r"hidden_states has shape \(4, 128\), expected \(tokens, hidden_size=256\)"),
        (lambda x, w, i: (x, w[:, :1], i), ValueError,
         r"topk_weights has shape \(4, 1\), expected \(4, top_k=2\)"),
        (lambda x, w, i: (x, w.double(), i), TypeError, r"topk_weights has dtype torch.float64"),
        (lambda x, w, i: (x, w, i.float()), TypeError, r"topk_ids has dtype torch.float32"),
        (lambda x, w, i: (x.repeat(9, 1), w.repeat(9, 1), i.repeat(9, 1)), ValueError,
         r"36 tokens exceed max_num_tokens=32"),
        (lambda x, w, i: (x, w, i.fill_(-2)), ValueError, r"topk_ids holds -2"),
    ],
)  # fmt: skip
def test_forward_input_checks(loaded: MegaMoEExperts, change, error: type, message: str):  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        loaded(*change(*routing(4, 4)))


def test_forward_with_kernel_tensors_of_another_format():
    m = build(WeightFormat.MXFP8, WeightFormat.MXFP8)
    m.load_weights(stream(WeightFormat.MXFP8, 4))
    m.finalize()
    other = build(WeightFormat.MXFP4, WeightFormat.MXFP4)
    m.w2_weight_scale = other.w2_weight_scale  # same shape and dtype, another format's tag
    mismatch = (
        r"w2_weight_scale is tagged mxfp4 \(1x32, 0 shared, no clamp\), but this forward runs "
        r"mxfp8"
    )
    with pytest.raises(FormatMismatchError, match=mismatch):
        m(*routing(2, 4))
    m.w2_weight_scale = torch.nn.Parameter(other.w2_weight_scale.data, requires_grad=False)
    with pytest.raises(FormatMismatchError, match=r"w2_weight_scale is tagged no tag"):
        m(*routing(2, 4))


# ---------------------------------------------------------------- weight_loader
def test_weight_loader_stages_run_format_halves():
    fmt = WeightFormat.MXFP8
    source = build(fmt, WeightFormat.BF16, num_shared_experts=1)
    source.load_weights(stream(WeightFormat.BF16, 4))
    for shard in ("w1", "w3", "w2"):
        tensors = dict(synthetic_expert_tensors(WeightFormat.BF16, 1, H, INTER, seed=9))
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[shard]
        source.load_shared_expert_tensor(shard, "weight", tensors[f"0.{proj}.weight"])
    source.finalize()
    m = build(fmt, fmt, num_shared_experts=1)
    for stem, count in (("w13", 4), ("w2", 4), ("shared_l1", 1), ("shared_l2", 1)):
        for slot in range(count):
            for shard in ("w2",) if stem in ("w2", "shared_l2") else ("w1", "w3"):
                rows = (
                    slice(None)
                    if shard == "w2"
                    else slice(0, INTER)
                    if shard == "w1"
                    else slice(INTER, 2 * INTER)
                )
                weight = source.get_parameter(f"{stem}_weight").data[slot, rows]
                scale = source.get_parameter(f"{stem}_weight_scale").data[slot, rows]
                assert not m.weight_loader(
                    m.get_parameter(f"{stem}_weight"), weight, "w", shard, slot
                )
                assert m.weight_loader(
                    m.get_parameter(f"{stem}_weight_scale"), scale, "s", shard, slot
                )
    m.finalize()
    assert_params_equal(m, snapshot(source), "weight_loader")


@pytest.mark.parametrize(
    ("param", "shard", "expert", "shape", "message"),
    [
        ("foreign", "w1", 0, (INTER, H), r"w: param is not a kernel parameter of this module"),
        ("w2_weight", "w1", 0, (H, INTER), r"w: shard_id 'w1' is not one of \('w2',\)"),
        ("w13_weight", "w3", 4, (INTER, H), r"expert_id 4 is out of range \[0, 4\) for w13_weight"),
        ("w13_weight", "w3", 0, (2 * INTER, H), r"w has shape \(512, 256\), expected \(256, 256\)"),
        ("w2_weight_scale", "w2", 0, (H, INTER // 128),
         r"w has shape \(256, 2\), expected \(256, 8\) for mxfp8"),
    ],
)  # fmt: skip
def test_weight_loader_checks(
    param: str, shard: str, expert: int, shape: tuple[int, int], message: str
):
    m = build(WeightFormat.MXFP8, WeightFormat.MXFP8)
    target = torch.nn.Parameter(torch.zeros(1)) if param == "foreign" else m.get_parameter(param)
    dtype = torch.uint8 if param.endswith("scale") else torch.float8_e4m3fn
    with pytest.raises(ValueError, match=message):
        m.weight_loader(target, torch.zeros(shape).to(dtype), "w", shard, expert)


# ---------------------------------------------------------------- finiteness
def _deferred(m: MegaMoEExperts) -> MegaMoEExperts:
    """Keep CPU counts pending until the load call ends, as a GPU module does."""
    m._arrival.ledger = NonFiniteLedger(m.layout.label, defer_cpu=True)
    return m


def _poison(tensors: Stream, target: str) -> Stream:
    return [
        (n, t.view(torch.uint8).clone().fill_(0x7F).view(t.dtype) if n == target else t)
        for n, t in tensors
    ]


def test_counts_read_once_per_call_still_name_the_tensor_and_keep_serving():
    fmt = WeightFormat.MXFP8
    m = _deferred(build(fmt, fmt))
    m.load_weights(stream(fmt, 4))
    m.finalize()
    before = snapshot(m)
    update = _poison(stream(fmt, 4, seed=1), "2.up_proj.weight")
    with pytest.raises(NonFiniteError, match=r"expert 2 up_proj.weight holds 65536 non-finite"):
        m.load_weights(update)  # raised when the call ends, after every tensor went in
    assert m.pending_bytes == 0
    m.finalize()
    assert_params_equal(m, before, "after a reload found non-finite at its end")
    m.load_weights(stream(fmt, 4, seed=1))
    m.finalize()
    expected = build(fmt, fmt)
    expected.load_weights(stream(fmt, 4, seed=1))
    expected.finalize()
    assert_params_equal(m, snapshot(expected), "after the next good reload")


def test_deferred_first_load_drops_what_it_wrote_in_place():
    fmt = WeightFormat.MXFP8
    m = _deferred(build(fmt, fmt))
    tensors = stream(fmt, 4)
    m.load_weights(tensors[:12])
    with pytest.raises(NonFiniteError, match=r"expert 3 down_proj.weight holds 65536 non-finite"):
        m.load_weights(_poison(tensors[12:], "3.down_proj.weight"))
    with pytest.raises(MissingExpertsError, match=r"4 kernel slot\(s\) never received"):
        m.finalize()


def test_a_waiting_half_is_checked_by_the_call_it_came_in():
    fmt = WeightFormat.MXFP8
    m = _deferred(build(fmt, fmt))
    tensors = dict(stream(fmt, 4))
    scale = tensors["1.gate_proj.weight_scale"].clone()
    scale[7, 3] = 255
    with pytest.raises(NonFiniteError, match=r"expert 1 gate_proj.weight_scale holds 1 non-finite"):
        m.load_weights([("1.gate_proj.weight_scale", scale)])  # its weight never came
    m.load_weights(tensors.items())  # the dropped half does not linger
    m.finalize()


def test_weight_loader_counts_are_read_when_the_call_ends():
    fmt = WeightFormat.MXFP8
    m = _deferred(build(fmt, fmt))
    weight = torch.zeros(INTER, H).to(torch.float8_e4m3fn)
    weight.view(torch.uint8)[0, :3] = 0xFF
    with pytest.raises(NonFiniteError, match=r"w holds 3 non-finite"):
        m.weight_loader(m.w13_weight, weight, "w", "w1", 0)
