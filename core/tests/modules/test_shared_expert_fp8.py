"""The block-FP8 shared expert (``SwiGLUMLP(gemm="deep_gemm")``) on CPU, against a strict fake.

The fake ``deep_gemm.fp8_gemm_nt`` (``fake_deep_gemm.py``, ``dense_gemm=True``) checks every
operand's dtype, shape and scale layout and computes ``a @ b.T`` in float64 from the E4M3
values and their scales; the architecture is faked as SM90. References here are float64,
written from the checkpoint tensors independently of ``megamoe.core``.

Tolerances (relative Frobenius error of the MLP output):
- vs float64 on the dequantized weights and exact activations: ``FLOAT64_TOL`` = 0.06; the
  input and the SwiGLU output are rounded to E4M3 (3 mantissa bits) with 1x128 scales
  (measured 0.043-0.047 here over seeds and clamps);
- vs float64 emulating those roundings and the GEMMs' bf16 outputs: ``EMULATED_TOL`` = 1e-3
  (the fake multiplies in float64 too: measured 0).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from bitcheck import assert_bitwise_equal, relative_error
from fakes import load_fake
from memory import distinct_storage_bytes

from megamoe.core.errors import (
    CapabilityError,
    IncompleteShardsError,
    InvalidScaleError,
    NonFiniteError,
)
from megamoe.core.modules.shared_expert import SwiGLUMLP
from megamoe.core.numerics import fp8_gemm, quant
from megamoe.core.numerics.formats import ARCH_SM90, WeightFormat
from megamoe.core.numerics.fp8_gemm import SharedGemm, float_to_fp8_1x128, resolve_shared_gemm
from megamoe.core.testing import synthetic_expert_tensors

fake_dg = load_fake("fake_deep_gemm")
H, INTER, T = 256, 384, 19  # 19 tokens: the scale columns need TMA padding (to 20)
FP8 = WeightFormat.FP8_BLOCK
SCALE = "weight_scale_inv"
PREFIX = "model.layers.2.mlp.shared_expert"
FLOAT64_TOL = 0.06
EMULATED_TOL = 1e-3
RECIP_448 = 0.0022321429569274187  # float32(1/448)
Tensors = dict[str, torch.Tensor]


def install(monkeypatch: pytest.MonkeyPatch, *, dense_gemm: bool = True) -> object:
    """A fake Hopper deep_gemm (with or without ``fp8_gemm_nt``) and an SM90 architecture."""
    fake = fake_dg.FakeDeepGemm(
        arch="sm90", kinds=frozenset({fake_dg.SM90_KIND}), dense_gemm=dense_gemm
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", fake.module())
    monkeypatch.setattr(fp8_gemm, "_device_arch", lambda device: ARCH_SM90)
    return fake


def checkpoint(seed: int, fmt: WeightFormat = FP8) -> Tensors:
    """One shared expert's checkpoint tensors (magnitudes differ per projection and block)."""
    return {
        name.removeprefix("0."): t
        for name, t in synthetic_expert_tensors(fmt, 1, H, INTER, seed=seed)
    }


def build(tensors: Tensors, gemm: str | None = "deep_gemm", **kwargs: object) -> SwiGLUMLP:
    mlp = SwiGLUMLP(H, INTER, FP8, prefix=PREFIX, gemm=gemm, **kwargs)  # type: ignore[arg-type]
    mlp.load_weights(tensors.items())
    mlp.check_loaded()
    mlp.commit()
    return mlp


def tokens(seed: int = 0, count: int = T) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((count, H), generator=gen).to(torch.bfloat16)


def dequantized(tensors: Tensors, proj: str) -> torch.Tensor:
    w, s = tensors[f"{proj}.weight"], tensors[f"{proj}.{SCALE}"]
    return w.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)


def round_1x128(x: torch.Tensor) -> torch.Tensor:
    """float64 of DeepGEMM's per-token E4M3 cast: every float32 rounding replayed in float64."""
    groups = x.float().double().unflatten(-1, (-1, 128))
    amax = groups.abs().amax(-1, keepdim=True)
    floored = amax.clamp(min=1e-4).float().double()  # the floor is float32(1e-4)
    scale = (floored * RECIP_448).float().double()  # a float32 product
    inv = (1.0 / scale).float().double()  # float32 reciprocal
    values = (groups * inv).float().to(torch.float8_e4m3fn).double()
    return (values * scale).flatten(-2)


def reference(
    tensors: Tensors, x: torch.Tensor, limit: float | None, emulate: bool
) -> torch.Tensor:
    """float64 MLP; ``emulate`` replays the FP8 path's roundings (E4M3 inputs, float32 SwiGLU)."""
    gate_w, up_w, down_w = (dequantized(tensors, p) for p in ("gate_proj", "up_proj", "down_proj"))
    xd = round_1x128(x) if emulate else x.double()
    gate, up = xd @ gate_w.T, xd @ up_w.T
    if emulate:  # the GEMM writes bf16; torch's float32 ops compute the SwiGLU
        gate, up = gate.to(torch.bfloat16).float(), up.to(torch.bfloat16).float()
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    hidden = F.silu(gate) * up
    if emulate:  # E4M3 again, and the GEMM's bf16 output
        return (round_1x128(hidden) @ down_w.T).to(torch.bfloat16).double()
    return hidden @ down_w.T


def quantile_limit(tensors: Tensors, x: torch.Tensor, q: float = 0.8) -> float:
    """A clamp that cuts about a fifth of |gate| and |up|."""
    gate_up = (
        x.double()
        @ torch.cat([dequantized(tensors, "gate_proj"), dequantized(tensors, "up_proj")]).T
    )
    return float(gate_up.abs().flatten().quantile(q))


# -------------------------------------------------------------------- choosing the GEMM
def test_auto_choice_is_bf16_on_the_cpu_and_deep_gemm_on_a_hopper_with_fp8_gemm_nt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_shared_gemm(None, FP8, "cpu", H, INTER, PREFIX) is SharedGemm.BF16
    install(monkeypatch, dense_gemm=False)
    assert resolve_shared_gemm(None, FP8, "cpu", H, INTER, PREFIX) is SharedGemm.BF16
    install(monkeypatch)
    assert resolve_shared_gemm(None, FP8, "cpu", H, INTER, PREFIX) is SharedGemm.DEEP_GEMM
    assert resolve_shared_gemm("bf16", FP8, "cpu", H, INTER, PREFIX) is SharedGemm.BF16
    for fmt in (WeightFormat.BF16, WeightFormat.MXFP8):
        assert resolve_shared_gemm(None, fmt, "cpu", H, INTER, PREFIX) is SharedGemm.BF16
    assert resolve_shared_gemm(None, FP8, "cpu", H, 320, PREFIX) is SharedGemm.BF16
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # the import fails
    assert resolve_shared_gemm(None, FP8, "cpu", H, INTER, PREFIX) is SharedGemm.BF16


def test_deep_gemm_requested_where_it_cannot_run_names_the_reason_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fix = r"pass gemm='bf16' .* or gemm=None"
    with pytest.raises(CapabilityError, match=rf"{PREFIX}: .*cpu is not an SM90 .*; {fix}"):
        SwiGLUMLP(H, INTER, FP8, prefix=PREFIX, gemm="deep_gemm")
    install(monkeypatch, dense_gemm=False)
    with pytest.raises(CapabilityError, match=r"deep_gemm lacks fp8_gemm_nt; pip install sgl"):
        SwiGLUMLP(H, INTER, FP8, gemm=SharedGemm.DEEP_GEMM)
    install(monkeypatch)
    with pytest.raises(ValueError, match=r"stores it as bf16, not fp8_block"):
        SwiGLUMLP(H, INTER, WeightFormat.BF16, gemm="deep_gemm")
    with pytest.raises(ValueError, match=r"intermediate_size=320 must be multiples of 128"):
        SwiGLUMLP(H, 320, FP8, gemm="deep_gemm")
    with pytest.raises(ValueError, match=r"gemm='fp8' is not one of bf16, deep_gemm, or None"):
        SwiGLUMLP(H, INTER, FP8, gemm="fp8")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    with pytest.raises(CapabilityError, match=r"deep_gemm does not import .*pip install sgl"):
        SwiGLUMLP(H, INTER, FP8, gemm="deep_gemm")


def test_the_bf16_path_keeps_todays_numerics_bit_for_bit() -> None:
    tensors = checkpoint(seed=1)
    mlp = build(tensors, gemm=None)  # the CPU: automatic is bf16
    assert mlp.gemm is SharedGemm.BF16
    dense = {
        p: quant.dequantize(tensors[f"{p}.weight"], tensors[f"{p}.{SCALE}"], FP8).to(torch.bfloat16)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    gate_up = torch.cat([dense["gate_proj"], dense["up_proj"]])
    assert_bitwise_equal(mlp.gate_up_proj.data, gate_up, "gate_up_proj")
    assert_bitwise_equal(mlp.down_proj.data, dense["down_proj"], "down_proj")
    x = tokens()
    hidden = F.silu(F.linear(x, dense["gate_proj"])) * F.linear(x, dense["up_proj"])
    assert_bitwise_equal(mlp(x), F.linear(hidden, dense["down_proj"]), "bf16 forward")


# -------------------------------------------------------------------- the activation cast
def _cast_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    normal = torch.randn((5, 512), generator=gen)
    zero = normal.clone()
    zero[1, 128:256] = 0.0  # an all-zero group: amax floored at 1e-4
    tiny = normal.clone()
    tiny[2, :128] *= 1e-6  # amax below the floor: values scale to < 448
    powers = torch.exp2(torch.arange(-10, 118, dtype=torch.float32)).repeat(5, 4)[:, :512]
    mixed = normal * torch.exp2(torch.arange(4, dtype=torch.float32) * 6 - 9).repeat_interleave(128)
    saturate = normal.clone()
    saturate[3, 300] = 448.0 * 64  # the group maximum maps to 448 exactly
    return {"normal": normal, "zero group": zero, "below floor": tiny, "powers of two": powers,
            "magnitudes per group": mixed, "saturation": saturate}  # fmt: skip


@pytest.mark.parametrize("case", list(_cast_cases()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_activation_cast_is_deep_gemms_per_token_cast_in_its_scale_layout(
    case: str, dtype: torch.dtype
) -> None:
    x = _cast_cases()[case].to(dtype)
    m, k = x.shape
    x_fp8, scale_t = float_to_fp8_1x128(x)
    assert scale_t.shape == (k // 128, 8) and scale_t.is_contiguous()  # 5 rows, padded to 8
    scale = scale_t[:, :m].t()
    groups = x.double().unflatten(-1, (-1, 128))
    floored = groups.abs().amax(-1).clamp(min=1e-4).float().double()  # float32(1e-4)
    want_scale = (floored * RECIP_448).float()
    assert_bitwise_equal(scale, want_scale, f"{case}: scale")
    inv = (1.0 / want_scale.double()).float().double().unsqueeze(-1)
    want = (groups * inv).float().to(torch.float8_e4m3fn).flatten(-2)
    assert_bitwise_equal(x_fp8, want, f"{case}: values")
    assert float(x_fp8.float().abs().max()) <= 448.0


# -------------------------------------------------------------------- forward
@pytest.mark.parametrize("clamped", [False, True])
@pytest.mark.parametrize("seed", [0, 7])
def test_fp8_forward_vs_float64_and_the_emulated_roundings(
    monkeypatch: pytest.MonkeyPatch, seed: int, clamped: bool
) -> None:
    fake = install(monkeypatch)
    tensors, x = checkpoint(seed), tokens(seed)
    limit = quantile_limit(tensors, x) if clamped else None
    mlp = build(tensors, swiglu_limit=limit)
    assert mlp.gemm is SharedGemm.DEEP_GEMM
    y = mlp(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert fake.dense_gemm_calls == 2  # type: ignore[attr-defined]  # gate+up, then down
    err = relative_error(y, reference(tensors, x, limit, emulate=False))
    emulated = relative_error(y, reference(tensors, x, limit, emulate=True))
    print(f"seed {seed}, clamp {limit}: vs float64 {err:.4f}, vs emulated {emulated:.2e}")
    assert err <= FLOAT64_TOL
    assert emulated <= EMULATED_TOL
    if clamped:  # the clamp is applied: without it the output differs
        assert relative_error(y, reference(tensors, x, None, emulate=True)) > 10 * EMULATED_TOL


def test_fp8_forward_keeps_leading_dimensions_and_takes_zero_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = install(monkeypatch)
    mlp = build(checkpoint(seed=2))
    x = tokens(count=12)
    assert_bitwise_equal(mlp(x.view(3, 4, H)), mlp(x).view(3, 4, H), "(3, 4, H) input")
    calls = fake.dense_gemm_calls  # type: ignore[attr-defined]
    empty = mlp(x[:0])
    assert empty.shape == (0, H) and fake.dense_gemm_calls == calls  # type: ignore[attr-defined]


def test_fp8_weights_take_about_half_the_bf16_copys_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch)
    fp8 = SwiGLUMLP(H, INTER, FP8, gemm="deep_gemm")
    bf16 = SwiGLUMLP(H, INTER, FP8, gemm="bf16")
    fp8_bytes = distinct_storage_bytes(fp8.parameters())
    bf16_bytes = distinct_storage_bytes(bf16.parameters())
    assert bf16_bytes == 3 * H * INTER * 2
    assert fp8_bytes == 3 * H * INTER + 3 * (H // 128) * (INTER // 128) * 4
    assert fp8_bytes / bf16_bytes <= 0.51


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")  # inductor's own imports
def test_fp8_forward_compiles_to_one_graph_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch)
    tensors, x = checkpoint(seed=3), tokens(3)
    mlp = build(tensors, swiglu_limit=quantile_limit(tensors, x))
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)  # a graph break raises
    eager, once = mlp(x), compiled(x)
    print(f"compiled vs eager: {relative_error(once, eager):.2e}")
    assert relative_error(once, eager) <= EMULATED_TOL
    assert torch.equal(compiled(x), once)


# -------------------------------------------------------------------- loading and reloads
def test_a_weight_and_its_scale_may_come_in_different_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch)
    tensors = checkpoint(seed=4)
    mlp = SwiGLUMLP(H, INTER, FP8, prefix=PREFIX, gemm="deep_gemm")
    assert (
        mlp.load_weights([("up_proj.weight_scale_inv", tensors["up_proj.weight_scale_inv"])])
        == set()
    )
    with pytest.raises(IncompleteShardsError, match=r"up_proj\.weight\b"):
        mlp.check_loaded()
    assert mlp.load_weights([("up_proj.weight", tensors["up_proj.weight"])]) == {"up_proj"}
    never = (
        r"gate_proj\.weight, gate_proj\.weight_scale_inv, down_proj\.weight, down_proj\.weight_s"
    )
    with pytest.raises(ValueError, match=rf"{PREFIX}: never loaded: {never}"):
        mlp.check_loaded()
    mlp.load_weights((n, t) for n, t in tensors.items() if not n.startswith("up_proj"))
    mlp.check_loaded()
    mlp.commit()
    x = tokens()
    assert_bitwise_equal(mlp(x), build(tensors)(x), "chunked vs one-call load")
    i = INTER
    assert_bitwise_equal(mlp.gate_up_fp8.data[i:], tensors["up_proj.weight"], "up rows")
    gate_scale = tensors["gate_proj.weight_scale_inv"]
    assert_bitwise_equal(mlp.gate_up_scale.data[: i // 128], gate_scale, "gate scales")
    assert_bitwise_equal(mlp.down_scale.data, tensors["down_proj.weight_scale_inv"], "down scales")


def _bad(tensors: Tensors, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(n, value if n == name else t) for n, t in tensors.items()]


def _nan_byte(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(torch.uint8)[3, 5] = 0x7F  # E4M3 NaN
    return out


def _negative(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[1, 0] = -out[1, 0]
    return out


@pytest.mark.parametrize(
    ("name", "corrupt", "error", "message"),
    [
        ("gate_proj.weight", lambda t: t.to(torch.bfloat16), TypeError,
         r"gate_proj\.weight has dtype torch\.bfloat16, expected torch\.float8_e4m3fn"),
        ("up_proj.weight_scale_inv", lambda t: t.to(torch.float8_e4m3fn), TypeError,
         r"up_proj\.weight_scale_inv has dtype torch\.float8_e4m3fn, expected float32"),
        ("down_proj.weight", lambda t: t[:128], ValueError,
         r"down_proj\.weight has shape \(128, 384\), expected \(256, 384\) \(hidden_size"),
        ("gate_proj.weight_scale_inv", lambda t: t[:, :1], ValueError,
         r"gate_proj\.weight_scale_inv has shape \(3, 1\), expected \(3, 2\) .*128x128"),
        ("up_proj.weight", _nan_byte, NonFiniteError, r"up_proj\.weight holds NaN or infinity"),
        ("down_proj.weight_scale_inv", lambda t: t * math.inf, NonFiniteError,
         r"down_proj\.weight_scale_inv holds NaN or infinity"),
        ("gate_proj.weight_scale_inv", _negative, InvalidScaleError,
         r"gate_proj\.weight_scale_inv: block \(1, 0\) has scale -"),
    ],
)  # fmt: skip
def test_a_bad_tensor_is_refused_before_anything_of_its_projection_is_written(
    monkeypatch: pytest.MonkeyPatch, name: str, corrupt: object, error: type, message: str
) -> None:
    install(monkeypatch)
    tensors = checkpoint(seed=5)
    mlp = SwiGLUMLP(H, INTER, FP8, prefix=PREFIX, gemm="deep_gemm")
    proj = name.partition(".")[0]
    before = [slot.view(torch.uint8).clone() for slot in mlp._fp8_slots(proj)]
    with pytest.raises(error, match=message):
        mlp.load_weights(_bad(tensors, name, corrupt(tensors[name])))  # type: ignore[operator]
    for slot, was in zip(mlp._fp8_slots(proj), before, strict=True):  # nothing of it written
        assert_bitwise_equal(slot.view(torch.uint8), was, f"{proj} storage")
    with pytest.raises(ValueError, match=rf"never loaded: .*{proj}\.weight"):
        mlp.check_loaded()


@pytest.mark.parametrize(
    ("fmt", "name", "corrupt", "error", "message"),
    [
        (WeightFormat.BF16, "up_proj.weight", lambda t: t.float(), TypeError,
         r"shared_expert\.up_proj\.weight has dtype torch\.float32, expected torch\.bfloat16"),
        (FP8, "down_proj.weight", lambda t: t.t().contiguous(), ValueError,
         r"shared_expert\.down_proj\.weight has shape \(384, 256\), expected \(256, 384\)"),
        (FP8, "gate_proj.weight", lambda t: t.view(torch.int8), TypeError,
         r"shared_expert\.gate_proj: weight dtype torch\.int8 does not match format 'fp8_block'"),
        (WeightFormat.MXFP4, "down_proj.weight", lambda t: t[:, :-1].contiguous(),
         ValueError, r"down_proj\.weight has shape \(256, 191\), expected \(256, 192\) \(mxfp4"),
    ],
)  # fmt: skip
def test_the_bf16_paths_refusals_name_the_tensor(
    fmt: WeightFormat, name: str, corrupt: object, error: type, message: str
) -> None:
    """Checkpoint tensors dequantized to bf16 are checked by name before dequantization."""
    tensors = checkpoint(seed=6, fmt=fmt)
    mlp = SwiGLUMLP(H, INTER, fmt, prefix=PREFIX, gemm="bf16")
    with pytest.raises(error, match=message):
        mlp.load_weights(_bad(tensors, name, corrupt(tensors[name])))  # type: ignore[operator]


def test_a_reload_is_staged_until_commit_and_written_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch)
    old, new, x = checkpoint(seed=6), checkpoint(seed=8), tokens()
    mlp = build(old)
    before = mlp(x)
    pointers = {n: p.data_ptr() for n, p in mlp.named_parameters()}
    mlp.load_weights([(n, new[n]) for n in ("up_proj.weight", "up_proj.weight_scale_inv")])
    assert mlp.pending_bytes == INTER * H + (INTER // 128) * (H // 128) * 4  # E4M3 + scales
    assert_bitwise_equal(mlp(x), before, "served before commit")
    mlp.discard_pending()
    assert mlp.pending_bytes == 0
    mlp.commit()
    assert_bitwise_equal(mlp(x), before, "after a discarded reload")
    mlp.load_weights(new.items())
    assert mlp.pending_bytes == 3 * INTER * H + 3 * (INTER // 128) * (H // 128) * 4
    assert_bitwise_equal(mlp(x), before, "a full reload, staged")
    mlp.check_loaded()
    mlp.commit()
    assert mlp.pending_bytes == 0
    assert {n: p.data_ptr() for n, p in mlp.named_parameters()} == pointers
    fresh = build(new)
    assert not torch.equal(fresh(x), before)
    assert_bitwise_equal(mlp(x), fresh(x), "reloaded vs fresh")


def test_a_failed_reload_keeps_the_previous_weights_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch)
    old, new, x = checkpoint(seed=6), checkpoint(seed=8), tokens()
    mlp = build(old)
    before = mlp(x)
    bad = _bad(new, "down_proj.weight_scale_inv", _negative(new["down_proj.weight_scale_inv"]))
    with pytest.raises(InvalidScaleError):
        mlp.load_weights(bad)  # gate and up were staged before down failed
    assert mlp.pending_bytes > 0
    mlp.discard_pending()
    mlp.commit()
    assert_bitwise_equal(mlp(x), before, "after the failed reload")
