"""The DeepGEMM backend on CPU, against a strict fake ``deep_gemm`` and a faked architecture.

The fake (``fake_deep_gemm.py``) checks every tensor handed to it and computes the MoE from
the kernel layout, so these tests compare the backend's output with a float64 MoE written
here, independently, from the checkpoint tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bitcheck import relative_error
from fakes import load_fake
from memory import canonical_bytes, resident_bytes

from megamoe.core.backends import deepgemm as dg_backend
from megamoe.core.backends import symm_buffer
from megamoe.core.backends.deepgemm import DeepGemmBackend, missing_api, supported_kinds
from megamoe.core.backends.deepgemm_layout import L1_ROW_ORDER
from megamoe.core.cli.demo import DEMO_SIZES
from megamoe.core.errors import (
    CapabilityError,
    FormatMismatchError,
    KernelSizeError,
    NonFiniteError,
)
from megamoe.core.loading.expert_loading import STAGE_WHOLE_RELOAD
from megamoe.core.loading.tagging import KernelTag, tag, tag_of
from megamoe.core.modules import backend_select as select
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

fake_dg = load_fake("fake_deep_gemm")
fake_v025 = load_fake("fake_deep_gemm_v025")
# The API generations the backend speaks: sgl-deep-gemm 0.1.4.post1 (the H200's build) and
# 0.2.5 (num_shared_experts, shared_l1/l2_weights, num_tokens_bound, mma_type transforms).
OLD, NEW = "0.1.4.post1", "0.2.5"
GENERATIONS = (OLD, NEW)
E, TOP_K, H, INTER, T = 4, 2, 512, 256, 24
PREFIX = "model.layers.3.mlp.experts"
ARCH_OF = {
    WeightFormat.BF16: "sm100",
    WeightFormat.MXFP8: "sm100",
    WeightFormat.MXFP4: "sm100",
    WeightFormat.FP8_BLOCK: "sm90",
}
# float64 MoE without activation rounding vs the kernel's rounded activations: E4M3
# activations (3 mantissa bits) cost a few percent, bf16 well under one.
FLOAT_TOL = {
    WeightFormat.BF16: 0.01,
    WeightFormat.MXFP8: 0.08,
    WeightFormat.MXFP4: 0.08,
    WeightFormat.FP8_BLOCK: 0.08,
}
# The fake's kernel vs the reference backend emulating its activation rounding: the same math,
# so only float32 vs float64 accumulation and the bf16 output differ (seen: 0 to 2e-5).
EMULATION_TOL = 1e-2
# swiglu_limit at this quantile of |gate| and |up| over the routed pairs of ``inputs()``.
CLAMP_QUANTILE = 0.8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _fresh_buffers() -> Iterator[None]:
    symm_buffer.clear_symm_buffers()
    yield
    symm_buffer.clear_symm_buffers()


@pytest.fixture(params=GENERATIONS)
def generation(request: pytest.FixtureRequest) -> str:
    """The DeepGEMM API generation a test runs against (each test runs against both)."""
    return str(request.param)


def install(
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    kinds: frozenset[str] | None = None,
    *,
    activation_clamp: bool = True,
    generation: str = OLD,
) -> object:
    """Put a fake deep_gemm in sys.modules, fake the architecture and the one-rank group.

    ``activation_clamp=False`` installs the API generation whose kernels lack that keyword;
    ``generation`` picks the fake of 0.1.4.post1 (where ``kinds`` may drop kernels) or of
    0.2.5 (every kernel).
    """
    default = frozenset({fake_dg.SM90_KIND}) if arch == "sm90" else fake_dg.SM100_KINDS
    if generation == NEW:
        assert kinds is None and activation_clamp, "the 0.2.5 fake has every kernel"
        fake = fake_v025.FakeDeepGemm025(arch=arch)
    else:
        fake = fake_dg.FakeDeepGemm(
            arch=arch, kinds=default if kinds is None else kinds, activation_clamp=activation_clamp
        )
    monkeypatch.setitem(sys.modules, "deep_gemm", fake.module())
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: arch)
    group = fake_dg.FakeGroup()
    monkeypatch.setattr(dg_backend, "resolve_group", lambda process_group, device: group)
    return fake


def build(
    fmt: WeightFormat,
    backend: str,
    *,
    seed: int = 0,
    max_tokens: int = T,
    emulate: bool = False,
    swiglu_limit: float | None = None,
    shared_seed: int | None = None,
) -> MegaMoEExperts:
    """Experts of synthetic weights (``seed``), finalized; with ``shared_seed`` one fused
    shared expert too, of that seed's weights."""
    experts = one_rank_experts(
        E,
        H,
        INTER,
        top_k=TOP_K,
        weight_format=fmt,
        checkpoint_format=fmt,
        max_num_tokens=max_tokens,
        backend=backend,
        device="cpu",
        prefix=PREFIX,
        emulate_kernel=emulate,
        swiglu_limit=swiglu_limit,
        num_shared_experts=0 if shared_seed is None else 1,
        reload_staging_bytes=STAGE_WHOLE_RELOAD,
    )
    experts.load_weights(synthetic_expert_tensors(fmt, E, H, INTER, seed=seed))
    if shared_seed is not None:
        load_shared(experts, fmt, shared_seed)
    experts.finalize()
    return experts


def inputs(tokens: int = T, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gain = torch.exp2(torch.rand(tokens, 1, generator=gen) * 4 - 2)  # per-token magnitude
    x = (torch.randn(tokens, H, generator=gen) * gain).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    ids[::5, -1] = -1  # unused slots
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1)
    weights = weights.masked_fill(ids < 0, 0.0)
    return x, weights.float(), ids.to(torch.int32)


def _decode(fmt: WeightFormat, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float64 of one checkpoint projection, written here independently of megamoe.core."""
    if fmt is WeightFormat.BF16:
        return weight.double()
    assert scale is not None
    if fmt is WeightFormat.FP8_BLOCK:
        return weight.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    if fmt is WeightFormat.MXFP8:
        values = weight.double()
    else:
        b = weight.to(torch.int64)
        codes = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)
        values = torch.where(codes >= 8, -E2M1[codes & 7], E2M1[codes & 7])
    return values * torch.exp2(scale.double() - 127).repeat_interleave(32, 1)


def experts64(
    fmt: WeightFormat, seed: int = 0, overrides: dict[int, int] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per expert: float64 (W1, W3, W2) of the checkpoint; ``overrides`` maps an expert to
    the seed of the checkpoint its weights come from."""
    tensors: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for s in {seed, *(overrides or {}).values()}:
        for name, t in synthetic_expert_tensors(fmt, E, H, INTER, seed=s):
            expert, proj, kind = name.split(".")
            tensors.setdefault(s, {}).setdefault(f"{expert}.{proj}", {})[kind] = t
    scale_name = fmt.scale_name
    out = []
    for e in range(E):
        src = tensors[(overrides or {}).get(e, seed)]
        w1, w3, w2 = (
            _decode(fmt, src[f"{e}.{p}"]["weight"], src[f"{e}.{p}"].get(scale_name or ""))
            for p in ("gate_proj", "up_proj", "down_proj")
        )
        out.append((w1, w3, w2))
    return out


def float64_moe(
    fmt: WeightFormat,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    seed: int = 0,
    overrides: dict[int, int] | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """sum_k w_k * (silu(x W1^T) * (x W3^T)) W2^T in float64; with ``swiglu_limit`` L the
    gate is clamped to <= L and up to [-L, L] first."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e, (w1, w3, w2) in enumerate(experts64(fmt, seed, overrides)):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xs = x[tok].double()
        gate, up = xs @ w1.T, xs @ w3.T
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        y = (F.silu(gate) * up) @ w2.T
        out.index_add_(0, tok, y * weights[tok, slot, None].double())
    return out


FORMATS = [WeightFormat.BF16, WeightFormat.MXFP8, WeightFormat.MXFP4, WeightFormat.FP8_BLOCK]


# ------------------------------------------------------------------ capabilities
def test_supported_kinds_follow_the_api() -> None:
    full = fake_dg.FakeDeepGemm(arch="sm100").module()
    assert supported_kinds(full) == {"fp8xfp4", "fp8xfp8", "bf16xbf16"}
    # Without the num_shared_experts generation, fp8xfp8 is not claimed.
    older = fake_dg.FakeDeepGemm(arch="sm100", kinds=frozenset({"fp8xfp4", "bf16xbf16"})).module()
    assert supported_kinds(older) == {"fp8xfp4", "bf16xbf16"}
    assert "mma_type='fp8xfp8'" in missing_api(older, "fp8xfp8")[0]
    hopper = fake_dg.FakeDeepGemm(arch="sm90", kinds=frozenset({fake_dg.SM90_KIND})).module()
    assert supported_kinds(hopper) == {"sm90_fp8"}
    del hopper.mega_moe_pre_dispatch_sm90
    assert missing_api(hopper, "sm90_fp8") == ["mega_moe_pre_dispatch_sm90"]


@pytest.mark.parametrize(
    ("arch", "fmt", "kinds", "expected"),
    [
        ("reference", WeightFormat.FP8_BLOCK, None, "is not a CUDA device"),
        (
            "sm100",
            WeightFormat.FP8_BLOCK,
            None,
            "does not run fp8_block experts (it runs bf16, mxfp4, mxfp8)",
        ),
        ("sm90", WeightFormat.MXFP8, None, "does not run mxfp8 experts (it runs fp8_block)"),
        (
            "sm100",
            WeightFormat.MXFP4,
            frozenset({"bf16xbf16"}),
            "lacks transform_sf_into_required_layout, fp8_fp4_mega_moe",
        ),
        ("sm100", WeightFormat.MXFP4, None, None),
        ("sm90", WeightFormat.FP8_BLOCK, None, None),
    ],
)
def test_unsupported_reason(
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    fmt: WeightFormat,
    kinds: frozenset[str] | None,
    expected: str | None,
) -> None:
    install(monkeypatch, arch if arch != "reference" else "sm100", kinds)
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: arch)
    reason = DeepGemmBackend.unsupported_reason(fmt, torch.device("cpu"))
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason
    if kinds is not None:
        assert reason is not None and "pip install sgl-deep-gemm" in reason
        with pytest.raises(CapabilityError, match="fp8_fp4_mega_moe"):
            build(fmt, "deepgemm")


def test_missing_deep_gemm_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: "sm90")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import fails
    reason = DeepGemmBackend.unsupported_reason(WeightFormat.FP8_BLOCK, torch.device("cpu"))
    assert reason is not None and "deep_gemm does not import" in reason
    assert "pip install sgl-deep-gemm" in reason
    auto = one_rank_experts(
        E,
        H,
        INTER,
        top_k=TOP_K,
        weight_format="fp8_block",
        checkpoint_format="fp8_block",
        backend="auto",
    )
    assert auto.backend.name == "reference"


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_forward_matches_float64_moe(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, generation: str
) -> None:
    fake = install(monkeypatch, ARCH_OF[fmt], generation=generation)
    experts = build(fmt, "deepgemm")
    assert experts.backend.name == "deepgemm"
    x, weights, ids = inputs()
    y = experts(x, weights, ids)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    want = float64_moe(fmt, x, weights, ids)
    assert relative_error(y, want) <= FLOAT_TOL[fmt]
    assert fake.kernel_calls == 1  # type: ignore[attr-defined]
    # The reference backend emulating the kernel rounds activations the same way.
    reference = build(fmt, "reference", emulate=True)
    assert relative_error(y, reference(x, weights, ids)) <= EMULATION_TOL


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_swapped_gate_and_up_is_caught(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, generation: str
) -> None:
    install(monkeypatch, ARCH_OF[fmt], generation=generation)
    experts = build(fmt, "deepgemm")
    x, weights, ids = inputs()
    want = float64_moe(fmt, x, weights, ids)
    assert relative_error(experts(x, weights, ids), want) <= FLOAT_TOL[fmt]
    names = ["w13_weight"] + (["w13_weight_scale"] if fmt.scale_block else [])
    for name in names:  # swap the halves of each canonical tensor, then of the scales alone
        data = experts.kernel_params[name].data
        half = data.shape[1] // 2
        data.copy_(torch.cat([data[:, half:], data[:, :half]], 1))
        experts.backend.prepare(experts, range(E))
        assert relative_error(experts(x, weights, ids), want) > 0.2, name


def test_fake_refuses_what_deepgemm_would(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, "sm100")
    experts = build(WeightFormat.MXFP8, "deepgemm")
    module = sys.modules["deep_gemm"]
    buf = experts.backend.symm_buffer.buffer  # type: ignore[union-attr]
    l1w, l1s, l2w, l2s = experts.backend._layout.pieces  # type: ignore[union-attr]
    y = torch.empty((4, H), dtype=torch.bfloat16)
    canonical = experts.l1_order.to_canonical(experts.kernel_params["w13_weight"].data)
    with pytest.raises(fake_dg.FakeDeepGemmError, match="not produced by a DeepGEMM transform"):
        module.fp8_fp4_mega_moe(y, (canonical, l1s), (l2w, l2s), buf)
    with pytest.raises(fake_dg.FakeDeepGemmError, match="not MN-major"):
        module.fp8_fp4_mega_moe(y, (l1w, l1s.contiguous()), (l2w, l2s), buf)
    with pytest.raises(fake_dg.FakeDeepGemmError, match="bfloat16 tensor"):
        module.fp8_fp4_mega_moe(y.float(), (l1w, l1s), (l2w, l2s), buf)
    with pytest.raises(fake_dg.FakeDeepGemmError, match="powers of two"):
        module.transform_sf_into_required_layout(
            torch.full((1, 2 * INTER, H // 32), 0.75), 2 * INTER, H, (1, 32), 1
        )
    assert fake.kernel_calls == 0  # type: ignore[attr-defined]


# ------------------------------------------------------------------ SwiGLU clamp
def gate_up64(
    fmt: WeightFormat, x: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 gate and up pre-activations of every routed (token, expert) pair."""
    gates, ups = [], []
    for e, (w1, w3, _) in enumerate(experts64(fmt)):
        tok, _slot = (ids == e).nonzero(as_tuple=True)
        gates.append(x[tok].double() @ w1.T)
        ups.append(x[tok].double() @ w3.T)
    return torch.cat(gates), torch.cat(ups)


def clamping_limit(fmt: WeightFormat, x: torch.Tensor, ids: torch.Tensor) -> float:
    """A swiglu_limit that clamps a good share of this input's gates and ups.

    A bf16 value: SM100 kernels compare bf16 gate/up with the clamp as bf16.
    """
    gate, up = gate_up64(fmt, x, ids)
    magnitudes = torch.cat([gate, up]).abs().flatten()
    limit = float(torch.quantile(magnitudes, CLAMP_QUANTILE).to(torch.bfloat16))
    gate_share = float((gate > limit).double().mean())
    up_share = float((up.abs() > limit).double().mean())
    assert gate_share >= 0.05 and up_share >= 0.05, (limit, gate_share, up_share)
    return limit


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_swiglu_clamp_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, generation: str
) -> None:
    fake = install(monkeypatch, ARCH_OF[fmt], generation=generation)
    x, weights, ids = inputs()
    limit = clamping_limit(fmt, x, ids)
    y = build(fmt, "deepgemm", swiglu_limit=limit)(x, weights, ids)
    assert fake.clamps == [limit]  # type: ignore[attr-defined]
    reference = build(fmt, "reference", emulate=True, swiglu_limit=limit)
    assert relative_error(y, reference(x, weights, ids)) <= EMULATION_TOL
    want = float64_moe(fmt, x, weights, ids, swiglu_limit=limit)
    assert relative_error(y, want) <= FLOAT_TOL[fmt]
    # The clamp changes the output far beyond the tolerance (seen: 0.85-0.92), so
    # dropping it in the backend, the fake or the reference fails one of the checks above.
    unclamped = build(fmt, "deepgemm")(x, weights, ids)
    assert relative_error(y, unclamped) > 10 * EMULATION_TOL
    assert fake.clamps == [limit, None]  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_kernel_without_activation_clamp(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat
) -> None:
    fake = install(monkeypatch, ARCH_OF[fmt], activation_clamp=False)
    kernel = dg_backend.KERNEL_FUNCTIONS[dg_backend.KERNEL_KINDS[(ARCH_OF[fmt], fmt)]]
    with pytest.raises(TypeError, match="activation_clamp"):  # the older generation's kernel
        getattr(sys.modules["deep_gemm"], kernel)(None, None, None, None, activation_clamp=1.5)
    with pytest.raises(
        CapabilityError,
        match=rf"swiglu_limit=1\.5, but the installed deep_gemm\.{kernel} takes no "
        "activation_clamp",
    ):
        build(fmt, "deepgemm", swiglu_limit=1.5)
    assert fake.buffers == [] and fake.transform_calls == 0  # type: ignore[attr-defined]
    experts = build(fmt, "deepgemm")  # without a clamp the same kernel serves
    x, weights, ids = inputs()
    assert (
        relative_error(experts(x, weights, ids), float64_moe(fmt, x, weights, ids))
        <= (FLOAT_TOL[fmt])
    )
    assert fake.clamps == [None]  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_clamp_is_in_the_kernel_tag_not_the_buffer_tag(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat
) -> None:
    fake = install(monkeypatch, ARCH_OF[fmt])
    x, weights, ids = inputs()
    limit = clamping_limit(fmt, x, ids)
    clamped = build(fmt, "deepgemm", swiglu_limit=limit)  # allocates the buffer
    plain = build(fmt, "deepgemm")
    rows = L1_ROW_ORDER.group  # DeepGEMM's weights keep gate/up interleaved by 8
    assert clamped.kernel_tag == KernelTag.for_format(fmt, swiglu_limit=limit, l1_row_group=rows)
    assert plain.kernel_tag == KernelTag.for_format(fmt, l1_row_group=rows)
    assert plain.kernel_tag.buffer_tag == clamped.kernel_tag.buffer_tag == KernelTag.for_format(fmt)
    entry = clamped.backend.symm_buffer
    assert entry is not None and entry is plain.backend.symm_buffer
    assert len(fake.buffers) == 1  # type: ignore[attr-defined]
    assert entry.kernel_tag == tag_of(entry.buffer) == plain.kernel_tag.buffer_tag
    y_clamped = clamped(x, weights, ids)
    y_plain = plain(x, weights, ids)
    assert relative_error(y_clamped, y_plain) > 10 * EMULATION_TOL
    again = clamped(x, weights, ids)  # each layer hands the kernel its own clamp
    assert torch.equal(again.view(torch.int16), y_clamped.view(torch.int16))
    assert fake.clamps == [limit, None, limit]  # type: ignore[attr-defined]

    calls = fake.kernel_calls  # type: ignore[attr-defined]
    piece = clamped.backend.kernel_weights["deepgemm l1_weight"]
    other = KernelTag.for_format(fmt, swiglu_limit=2 * limit, l1_row_group=rows)
    for wrong, described in ((other, f"clamp {2 * limit:g}"), (plain.kernel_tag, "no clamp")):
        tag(piece, wrong)
        with pytest.raises(
            FormatMismatchError,
            match=rf"deepgemm l1_weight is tagged .*{described}[,)].* runs .*clamp {limit:g}[,)]",
        ):
            clamped(x, weights, ids)
    tag(piece, clamped.kernel_tag)
    tag(plain.backend.kernel_weights["deepgemm l1_weight"], clamped.kernel_tag)
    with pytest.raises(
        FormatMismatchError, match=rf"tagged .*clamp {limit:g}[,)].* runs .*no clamp"
    ):
        plain(x, weights, ids)
    tag(plain.backend.kernel_weights["deepgemm l1_weight"], plain.kernel_tag)
    tag(clamped.kernel_params["w2_weight"], other)  # a canonical tensor, checked by the module
    with pytest.raises(FormatMismatchError, match="w2_weight is tagged"):
        clamped(x, weights, ids)
    tag(clamped.kernel_params["w2_weight"], clamped.kernel_tag)
    tag(entry.buffer, clamped.kernel_tag)  # a buffer carries no clamp
    for layer in (clamped, plain):
        with pytest.raises(FormatMismatchError, match="symmetric buffer is tagged"):
            layer(x, weights, ids)
    assert fake.kernel_calls == calls  # type: ignore[attr-defined]  # nothing reached the kernel
    tag(entry.buffer, plain.kernel_tag.buffer_tag)
    assert torch.equal(clamped(x, weights, ids).view(torch.int16), y_clamped.view(torch.int16))


# ------------------------------------------------------------------ API generations
SM100_FORMATS = [WeightFormat.BF16, WeightFormat.MXFP8, WeightFormat.MXFP4]
SHARDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def load_shared(experts: MegaMoEExperts, fmt: WeightFormat, seed: int) -> None:
    shared = dict(synthetic_expert_tensors(fmt, 1, H, INTER, seed=seed))
    for shard, proj in SHARDS.items():
        for kind in ("weight", *([fmt.scale_name] if fmt.scale_name else [])):
            experts.load_shared_expert_tensor(shard, kind, shared[f"0.{proj}.{kind}"])


@pytest.mark.parametrize("fmt", SM100_FORMATS, ids=lambda f: f.value)
def test_fused_shared_experts_where_the_api_takes_them(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, generation: str
) -> None:
    fake = install(monkeypatch, "sm100", generation=generation)
    fuses = DeepGemmBackend.fuses_shared_experts(fmt, torch.device("cpu"))
    assert fuses is (generation == NEW)
    if generation == OLD:
        with pytest.raises(CapabilityError, match=r"_mega_moe takes no shared_l1_weights"):
            build(fmt, "deepgemm", shared_seed=2)
        return
    experts = build(fmt, "deepgemm", shared_seed=2)
    entry = experts.backend.symm_buffer
    assert entry is not None and entry.key.num_shared_experts == 1
    assert fake.shared[id(entry.buffer)] == 1  # type: ignore[attr-defined]
    x, weights, ids = inputs()
    y = experts(x, weights, ids)
    reference = build(fmt, "reference", emulate=True, shared_seed=2)
    error = relative_error(y, reference(x, weights, ids))
    assert error <= EMULATION_TOL
    # The shared expert's share of the output (seen: 0.58-1.0; the emulation 0.002)
    # is far above the emulation's difference, so dropping it fails.
    routed_only = build(fmt, "reference", emulate=True)
    assert relative_error(y, routed_only(x, weights, ids)) > max(EMULATION_TOL, 10 * error)
    # A reload of the shared expert alone reaches the kernel, in place.
    before = {n: t.data_ptr() for n, t in experts.backend.kernel_weights.items()}
    assert {n for n in before if n.startswith("deepgemm shared")}
    load_shared(experts, fmt, seed=3)
    experts.finalize()
    assert {n: t.data_ptr() for n, t in experts.backend.kernel_weights.items()} == before
    reloaded = build(fmt, "reference", emulate=True, shared_seed=3)
    error = relative_error(experts(x, weights, ids), reloaded(x, weights, ids))
    assert error <= EMULATION_TOL
    assert relative_error(experts(x, weights, ids), y) > max(EMULATION_TOL, 10 * error)


@pytest.mark.parametrize("fmt", SM100_FORMATS, ids=lambda f: f.value)
def test_transforms_are_told_the_kernel_kind(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat
) -> None:
    fake = install(monkeypatch, "sm100", generation=NEW)
    build(fmt, "deepgemm")
    kind = dg_backend.KERNEL_KINDS[("sm100", fmt)]
    assert fake.transform_mma_types == [kind] * E  # type: ignore[attr-defined]


def test_fp8_mega_moe_gets_the_token_bound_where_it_takes_one(
    monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    fake = install(monkeypatch, "sm90", generation=generation)
    experts = build(WeightFormat.FP8_BLOCK, "deepgemm")
    for tokens in (T, 5):
        x, weights, ids = inputs(tokens)
        want = float64_moe(WeightFormat.FP8_BLOCK, x, weights, ids)
        assert relative_error(experts(x, weights, ids), want) <= FLOAT_TOL[WeightFormat.FP8_BLOCK]
    if generation == NEW:
        assert fake.bounds == [T, 5]  # type: ignore[attr-defined]
    else:
        assert not hasattr(fake, "bounds")


# ------------------------------------------------------------------ buffers
def test_one_buffer_per_shape_and_kind_allocated_at_finalize(
    monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    fake = install(monkeypatch, "sm100", generation=generation)
    first = build(WeightFormat.MXFP4, "deepgemm", seed=0)
    second = build(WeightFormat.MXFP4, "deepgemm", seed=1)
    assert len(fake.buffers) == 1  # type: ignore[attr-defined]
    entry = first.backend.symm_buffer
    assert entry is second.backend.symm_buffer and entry is not None
    assert entry.capacity == T and entry.key.kind == "fp8xfp4"
    assert (
        entry.kernel_tag == first.kernel_tag.buffer_tag == KernelTag.for_format(WeightFormat.MXFP4)
    )
    x, weights, ids = inputs()
    first(x, weights, ids)
    second(x, weights, ids)
    assert len(fake.buffers) == 1  # type: ignore[attr-defined]  # forward never allocates
    build(WeightFormat.MXFP4, "deepgemm", max_tokens=2 * T)
    build(WeightFormat.BF16, "deepgemm")
    assert [b.kind for b in fake.buffers] == ["fp8xfp4", "fp8xfp4", "bf16xbf16"]  # type: ignore[attr-defined]
    assert len(symm_buffer.cached_buffers()) == 3


def test_more_tokens_than_the_buffer_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, "sm90")
    experts = build(WeightFormat.FP8_BLOCK, "deepgemm")
    x, weights, ids = inputs(T + 1)
    with pytest.raises(
        ValueError,
        match=rf"{T + 1} tokens exceed the DeepGEMM symmetric buffer's capacity of {T} "
        "tokens per rank; raise max_num_tokens",
    ):
        experts.backend.forward(experts, x, weights, ids)
    with pytest.raises(ValueError, match=rf"{T + 1} tokens exceed max_num_tokens={T}"):
        experts(x, weights, ids)


def test_tags_of_buffer_and_kernel_tensors_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, "sm100")
    experts = build(WeightFormat.MXFP8, "deepgemm")
    entry = experts.backend.symm_buffer
    assert entry is not None
    x, weights, ids = inputs()
    other = KernelTag.for_format(WeightFormat.MXFP4)
    tag(entry.buffer, other)
    with pytest.raises(FormatMismatchError, match="symmetric buffer is tagged mxfp4"):
        experts(x, weights, ids)
    tag(entry.buffer, experts.kernel_tag.buffer_tag)
    tag(experts.backend.kernel_weights["deepgemm l1_scale"], other)
    with pytest.raises(FormatMismatchError, match="deepgemm l1_scale is tagged mxfp4"):
        experts(x, weights, ids)
    with pytest.raises(FormatMismatchError, match="serves mxfp8"):
        symm_buffer.get_symm_buffer(entry.key, other, lambda: pytest.fail("reallocated"))


# ------------------------------------------------------------------ reload
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_reload_of_some_experts_is_in_place(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, generation: str
) -> None:
    fake = install(monkeypatch, ARCH_OF[fmt], generation=generation)
    experts = build(fmt, "deepgemm", seed=0)
    before = {n: t.data_ptr() for n, t in experts.backend.kernel_weights.items()}
    calls = fake.transform_calls  # type: ignore[attr-defined]
    assert calls == E
    changed = {1: 5, 3: 5}
    experts.load_weights(
        (n, t)
        for n, t in synthetic_expert_tensors(fmt, E, H, INTER, seed=5)
        if int(n.split(".")[0]) in changed
    )
    experts.finalize()
    assert fake.transform_calls == calls + len(changed)  # type: ignore[attr-defined]
    assert {n: t.data_ptr() for n, t in experts.backend.kernel_weights.items()} == before
    x, weights, ids = inputs()
    want = float64_moe(fmt, x, weights, ids, overrides=changed)
    assert relative_error(experts(x, weights, ids), want) <= FLOAT_TOL[fmt]


def test_failed_reload_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, "sm90")
    experts = build(WeightFormat.FP8_BLOCK, "deepgemm")
    x, weights, ids = inputs()
    served = experts(x, weights, ids)
    update = dict(synthetic_expert_tensors(WeightFormat.FP8_BLOCK, E, H, INTER, seed=9))
    update["2.up_proj.weight_scale_inv"] = update["2.up_proj.weight_scale_inv"].clone()
    update["2.up_proj.weight_scale_inv"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        experts.load_weights(update.items())
    experts.finalize()
    assert torch.equal(experts(x, weights, ids).view(torch.int16), served.view(torch.int16))


@pytest.mark.parametrize(
    ("fmt", "aliased"),
    [
        (
            WeightFormat.FP8_BLOCK,
            {
                "l1_weight": "w13_weight",
                "l1_scale": "w13_weight_scale",
                "l2_weight": "w2_weight",
                "l2_scale": "w2_weight_scale",
            },
        ),
        (WeightFormat.MXFP8, {"l1_weight": "w13_weight", "l2_weight": "w2_weight"}),
        (WeightFormat.MXFP4, {"l1_weight": "w13_weight", "l2_weight": "w2_weight"}),
        (WeightFormat.BF16, {"l1_weight": "w13_weight", "l2_weight": "w2_weight"}),
    ],
    ids=lambda v: getattr(v, "value", ""),
)
def test_the_kernel_reads_the_experts_own_weights(
    monkeypatch: pytest.MonkeyPatch, fmt: WeightFormat, aliased: dict[str, str], generation: str
) -> None:
    """One resident copy: every weight piece is an expert parameter's own storage; only
    SM100's packed scales (DeepGEMM's layout of the UE8M0 bytes) are the backend's."""
    install(monkeypatch, ARCH_OF[fmt], generation=generation)
    experts = build(fmt, "deepgemm")
    params = experts.kernel_params
    for name, tensor in experts.backend.kernel_weights.items():
        piece = name.removeprefix("deepgemm ")
        owner = params.get(aliased.get(piece, ""))
        shares = owner is not None and tensor.untyped_storage().data_ptr() == (
            owner.untyped_storage().data_ptr()
        )
        assert shares == (piece in aliased), name
    scales = sum(
        t.untyped_storage().nbytes()
        for n, t in experts.backend.kernel_weights.items()
        if n.removeprefix("deepgemm ") not in aliased
    )
    assert resident_bytes(experts) == canonical_bytes(experts) + scales
    ratio = resident_bytes(experts) / canonical_bytes(experts)
    assert ratio <= SM100_SCALE_COPY[fmt], f"{fmt.value}: resident {ratio:.4f}x canonical"


# SM100 keeps UE8M0 scales twice (canonical bytes, and DeepGEMM's packed int32 layout of
# them): 1/32 of an MXFP8 weight's bytes, 1/16 of a packed MXFP4 one's. Hopper: one copy.
SM100_SCALE_COPY = {
    WeightFormat.FP8_BLOCK: 1.0,
    WeightFormat.MXFP8: 1 + 1 / 32 / (1 + 1 / 32),
    WeightFormat.MXFP4: 1 + 1 / 16 / (1 + 1 / 16),
    WeightFormat.BF16: 1.0,
}


# ------------------------------------------------------------------ refusals
def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, "sm90")
    common = dict(
        top_k=TOP_K, weight_format="fp8_block", checkpoint_format="fp8_block", backend="deepgemm"
    )
    with pytest.raises(ValueError, match="intermediate_size=4352 exceeds 4096"):
        one_rank_experts(E, H, 4352, **common)
    # The Hopper buffer's scale rows: H / 32 and I / 16 bytes, in 16-byte units.
    multiples = "multiples of 512 and intermediate sizes that are multiples of 256"
    for hidden, intermediate in ((256, INTER), (H + 128, INTER), (H, 384)):
        sizes = f"hidden_size={hidden}, intermediate_size={intermediate};.*{multiples}"
        with pytest.raises(ValueError, match=sizes):
            one_rank_experts(E, hidden, intermediate, **common)
    with pytest.raises(CapabilityError, match="takes no shared_l1_weights"):
        one_rank_experts(E, H, INTER, num_shared_experts=1, **common)
    experts = build(WeightFormat.FP8_BLOCK, "deepgemm")
    with pytest.raises(
        ValueError, match="first prepare\\(\\) must cover all 4 local experts and 0 shared"
    ):
        DeepGemmBackend().prepare(experts, [0])
    with pytest.raises(RuntimeError, match="call finalize\\(\\) first"):
        DeepGemmBackend().forward(experts, *inputs())


def test_auto_leaves_a_layer_the_kernel_refuses_to_the_reference(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``backend="auto"`` where DeepGEMM runs the format but not the layer: sizes the
    Hopper kernel refuses, or a clamp the installed kernel lacks. The layer runs on the
    reference backend, warned once per layer shape; fitting layers keep DeepGEMM; an
    explicit ``"deepgemm"`` still raises, a ``KernelSizeError`` (a ValueError too)."""
    install(monkeypatch, "sm90", activation_clamp=False)
    monkeypatch.setattr(select, "_fallbacks_logged", set())
    common = dict(top_k=TOP_K, weight_format="fp8_block", checkpoint_format="fp8_block")
    with caplog.at_level("WARNING", logger="megamoe"):
        odd = [one_rank_experts(E, 256, INTER, backend="auto", **common) for _ in range(2)]
        fits = one_rank_experts(E, H, INTER, backend="auto", **common)
        clamped = one_rank_experts(E, H, INTER, backend="auto", swiglu_limit=7.0, **common)
    assert [x.backend.name for x in odd] == ["reference", "reference"]
    assert fits.backend.name == "deepgemm"
    assert clamped.backend.name == "reference"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # one per layer shape, not per layer
    assert "auto -> reference" in warnings[0] and "hidden_size=256" in warnings[0]
    assert "multiples of 512" in warnings[0]
    assert "takes no activation_clamp" in warnings[1]
    with pytest.raises(KernelSizeError, match="hidden_size=256") as refused:
        one_rank_experts(E, 256, INTER, backend="deepgemm", **common)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, CapabilityError)
    with pytest.raises(CapabilityError, match="takes no activation_clamp"):
        one_rank_experts(E, H, INTER, backend="deepgemm", swiglu_limit=7.0, **common)


def test_which_backends_round_activations_to_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``verify`` judges a layer's error by: the kernel in a quantized format, and the
    reference only where it emulates the kernel; never BF16."""
    install(monkeypatch, "sm100")

    def rounds(fmt: str, backend: str, emulate: bool = False) -> bool:
        experts = one_rank_experts(
            E, H, INTER, top_k=TOP_K, weight_format=fmt, checkpoint_format=fmt,
            backend=backend, emulate_kernel=emulate,
        )  # fmt: skip
        return experts.backend.rounds_activations(experts)

    assert rounds("mxfp8", "deepgemm") and rounds("mxfp4", "deepgemm")
    assert not rounds("bf16", "deepgemm")
    assert rounds("mxfp8", "reference", emulate=True)
    assert not rounds("mxfp8", "reference") and not rounds("bf16", "reference", emulate=True)


def test_the_demo_checkpoints_fit_the_hopper_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, "sm90")
    sizes = DEMO_SIZES
    experts = one_rank_experts(
        sizes.num_experts, sizes.hidden_size, sizes.intermediate_size, top_k=sizes.top_k,
        weight_format="fp8_block", checkpoint_format="fp8_block", backend="deepgemm",
    )  # fmt: skip
    DeepGemmBackend().check_layer(experts)  # raises where the kernel would refuse the sizes


def test_fp8xfp8_refused_by_the_build_is_a_capability_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = fake_dg.FakeDeepGemm(arch="sm100", kinds=frozenset({"fp8xfp4", "bf16xbf16"}))
    module = fake.module()
    module.get_symm_buffer_for_mega_moe = fake._buffer_fn_with_shared()  # claims the API generation
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: "sm100")
    monkeypatch.setattr(
        dg_backend, "resolve_group", lambda process_group, device: fake_dg.FakeGroup()
    )
    with pytest.raises(CapabilityError, match="refused a fp8xfp8 MegaMoE buffer"):
        build(WeightFormat.MXFP8, "deepgemm")


def test_no_buffer_allocation_during_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    key = symm_buffer.BufferKey(
        object(), torch.device("cuda", 0), E, T, TOP_K, H, INTER, "sm90_fp8"
    )
    with pytest.raises(RuntimeError, match="during CUDA-graph capture; call finalize"):
        symm_buffer.get_symm_buffer(key, KernelTag.for_format(WeightFormat.FP8_BLOCK), object)


def test_group_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    given = object()
    assert symm_buffer.resolve_group(given, torch.device("cpu")) is given  # type: ignore[arg-type]
    created = not dist.is_initialized()  # else another test's world is there: reuse it
    try:
        group = symm_buffer.resolve_group(None, torch.device("cpu"))
        assert group is dist.group.WORLD and dist.get_world_size() == 1
        if created:
            assert dist.get_backend() == "gloo"
        assert symm_buffer.resolve_group(None, torch.device("cpu")) is group  # created once
    finally:
        if created:
            dist.destroy_process_group()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(
        ValueError, match=r"torch\.distributed runs 2 ranks; pass the expert-parallel group"
    ):
        symm_buffer.resolve_group(None, torch.device("cpu"))


def test_the_auto_choice_tells_whether_shared_experts_fuse(
    monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    cpu = torch.device("cpu")
    assert select.fuses_shared_experts("reference", WeightFormat.MXFP8, cpu)
    assert select.fuses_shared_experts("auto", WeightFormat.MXFP8, cpu)  # no DeepGEMM here
    install(monkeypatch, "sm100", generation=generation)
    assert select.fuses_shared_experts("auto", WeightFormat.MXFP8, cpu) is (generation == NEW)
    assert select.fuses_shared_experts("deepgemm", WeightFormat.BF16, cpu) is (generation == NEW)
    monkeypatch.setattr(dg_backend, "_device_arch", lambda device: "sm90")
    assert not select.fuses_shared_experts("deepgemm", WeightFormat.FP8_BLOCK, cpu)
    with pytest.raises(ValueError, match="unknown experts backend 'triton'"):
        select.fuses_shared_experts("triton", WeightFormat.BF16, cpu)
