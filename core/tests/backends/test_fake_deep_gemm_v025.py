"""The strict fake of sgl-deep-gemm 0.2.5 (``fake_deep_gemm_v025.py``): its API and its math.

Where the 0.2.5 wheel is unzipped on disk (``MEGAMOE_DG025``, default ``/tmp/dg025``), every
faked entry point's parameters (names, order, defaults) are compared with the wheel's
Python source, parsed without importing it (its CUDA extension is not needed).
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitcheck import assert_bitwise_equal, relative_error
from fakes import load_fake

from megamoe.core.checkpoint import nvfp4
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

fake_v025 = load_fake("fake_deep_gemm_v025")
E, TOP_K, H, INTER, T, S = 4, 2, 256, 256, 20, 1
WHEEL = Path(os.environ.get("MEGAMOE_DG025", "/tmp/dg025")) / "deep_gemm"
SOURCES = ("__init__.py", "mega/__init__.py", "utils/math.py")
FAKED = (*fake_v025.ENTRY_POINTS, *(fn.__name__ for fn in fake_v025.CASTS))


def _wheel_parameters() -> dict[str, list[tuple[str, str | None]]]:
    """Each function of the wheel's sources: (parameter, default source or None), in order."""
    found: dict[str, list[tuple[str, str | None]]] = {}
    for source in SOURCES:
        tree = ast.parse((WHEEL / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in FAKED:
                args = node.args.args
                defaults = [None] * (len(args) - len(node.args.defaults)) + [
                    ast.unparse(d) for d in node.args.defaults
                ]
                # The SM100 factory of mega/ is wrapped by the top-level one: keep the first.
                found.setdefault(
                    node.name, [(a.arg, d) for a, d in zip(args, defaults, strict=True)]
                )
    return found


def test_signatures_match_sgl_deep_gemm_025() -> None:
    if not all((WHEEL / s).is_file() for s in SOURCES):
        pytest.skip(f"sgl-deep-gemm 0.2.5 is not unzipped at {WHEEL.parent} (MEGAMOE_DG025)")
    wheel = _wheel_parameters()
    assert set(wheel) == set(FAKED)
    module = fake_v025.FakeDeepGemm025().module()
    for name in FAKED:
        params = inspect.signature(getattr(module, name)).parameters.values()
        ours = [
            (p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in params
        ]
        theirs = [(n, None if d is None else repr(ast.literal_eval(d))) for n, d in wheel[name]]
        assert ours == theirs, name


# ------------------------------------------------------------------ casts
def _tie_rows() -> torch.Tensor:
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [6.0, *ties, *(-t for t in ties), 0.0] * 4
    return torch.tensor([row, [v * 0.125 for v in row]], dtype=torch.bfloat16)


def test_casts_agree_with_megamoe() -> None:
    """Two implementations written apart: the fake's casts and megamoe.core's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([(torch.randn(30, 64, generator=gen) * 3).bfloat16(), _tie_rows()])
    packed, sf = fake_v025.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32)
    want_packed, want_scale = quant.quantize_mx(x, WeightFormat.MXFP4)
    assert_bitwise_equal(packed.view(torch.uint8), want_packed, "per_token_cast_to_fp4")
    assert_bitwise_equal(sf, quant.ue8m0_to_float32(want_scale), "fp4 scales")
    packed, sf = fake_v025.per_token_cast_to_nvfp4(x)
    want_packed, want_e4m3 = nvfp4.quantize_nvfp4(x)
    assert_bitwise_equal(packed.view(torch.uint8), want_packed, "per_token_cast_to_nvfp4")
    assert_bitwise_equal(sf, want_e4m3.float(), "nvfp4 scales")


# ------------------------------------------------------------------ buffers
def test_buffer_factory_rules() -> None:
    fake = fake_v025.FakeDeepGemm025()
    mod, group = fake.module(), fake_v025.FakeGroup()
    buf = mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, S, mma_type="fp8xfp4")
    assert fake.shared[id(buf)] == S  # the seventh positional is num_shared_experts
    with pytest.raises(fake_v025.FakeDeepGemmError, match="mxf4xmxf4"):
        mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, mma_type="mxf4xmxf4")
    with pytest.raises(AssertionError):
        mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, use_fp8_dispatch=False)
    nv = mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, mma_type="nvfp4xnvfp4")
    assert nv.x.dtype == torch.int8 and nv.x.shape[1] == H // 2 and nv.x_sf.shape[1] == H // 64
    hopper = fake_v025.FakeDeepGemm025(arch="sm90").module()
    sm90 = hopper.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER)
    assert sm90.kind == "sm90_fp8"
    with pytest.raises(AssertionError):  # no shared experts on SM90, as 0.2.5 asserts
        hopper.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, 1)
    with pytest.raises(fake_v025.FakeDeepGemmError, match="needs a Hopper"):
        mod.get_symm_buffer_for_sm90_mega_moe(group, E, T, TOP_K, H, INTER)


# ------------------------------------------------------------------ kernels
def _float_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """float64 routed (+ shared, weight 1) SwiGLU MoE without any activation rounding."""
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t] @ w13[e].T
            out[t] += weights[t, k] * ((F.silu(h[:INTER]) * h[INTER:]) @ w2[e].T)
        if shared is not None:
            h = x[t] @ shared[0][0].T
            out[t] += (F.silu(h[:INTER]) * h[INTER:]) @ shared[1][0].T
    return out


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
    return x, ids, torch.rand(T, TOP_K, generator=gen)


def _dense(count: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, rows, cols, generator=gen) * (0.5 / cols**0.5)


def test_fp8_fp4_with_fused_shared_experts_matches_float64() -> None:
    fake = fake_v025.FakeDeepGemm025()
    mod, group = fake.module(), fake_v025.FakeGroup()
    buf = mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, S, mma_type="fp8xfp4")

    def transformed(count: int, seed: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
        w13, w2 = _dense(count, 2 * INTER, H, seed), _dense(count, H, INTER, seed + 1)
        pairs = []
        for w in (w13, w2):
            values, scale = quant.quantize_mx(w, WeightFormat.MXFP4)
            sf = mod.transform_sf_into_required_layout(
                quant.ue8m0_to_float32(scale), w.shape[1], w.shape[2], (1, 32), count
            )
            pairs.append((values.view(torch.int8), sf))
        l1, l2 = mod.transform_weights_for_mega_moe(pairs[0], pairs[1])
        dense = [quant.dequantize(v, s, WeightFormat.MXFP4) for v, s in (
            quant.quantize_mx(w13, WeightFormat.MXFP4), quant.quantize_mx(w2, WeightFormat.MXFP4)
        )]  # fmt: skip
        return l1, l2, dense[0].double(), dense[1].double()

    l1, l2, w13, w2 = transformed(E, seed=1)
    s1, s2, sw13, sw2 = transformed(S, seed=3)
    x, ids, weights = _inputs(seed=5)
    staged = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)
    mod.mega_moe_pre_dispatch(x, ids, weights, *staged, T)
    y = torch.empty(T, H, dtype=torch.bfloat16)
    with pytest.raises(fake_v025.FakeDeepGemmError, match="buffer has 1 shared experts"):
        mod.fp8_fp4_mega_moe(y, l1, l2, buf)
    with pytest.raises(fake_v025.FakeDeepGemmError, match="use_x_scales=True is not modelled"):
        mod.fp8_fp4_mega_moe(y, l1, l2, buf, s1, s2, use_x_scales=True)
    with pytest.raises(fake_v025.FakeDeepGemmError, match=r"global_num_tokens must be in \[0, "):
        mod.fp8_fp4_mega_moe(y, l1, l2, buf, s1, s2, global_num_tokens=10_000)
    mod.fp8_fp4_mega_moe(y, l1, l2, buf, s1, s2, global_num_tokens=T)
    want = _float_moe(x, ids, weights, w13, w2, (sw13, sw2))
    assert relative_error(y.double(), want) < 0.05  # E4M3 activations: a few percent


def test_nvfp4_kernel_matches_float64() -> None:
    fake = fake_v025.FakeDeepGemm025()
    mod, group = fake.module(), fake_v025.FakeGroup()
    kind = "nvfp4xnvfp4"
    buf = mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER, mma_type=kind)
    w13, w2 = _dense(E, 2 * INTER, H, 7), _dense(E, H, INTER, 8)
    pairs, dense = [], []
    for w in (w13, w2):
        g, n, k = w.shape
        packed, sf = mod.per_token_cast_to_nvfp4(w.reshape(g * n, k), use_packed_ue4m3=True)
        pairs.append((packed.reshape(g, n, k // 2), sf.reshape(g, n, k // 64)))
        e4m3 = sf.view(torch.float8_e4m3fn).reshape(g * n, k // 16)
        dense.append(quant.dequantize(packed.view(torch.uint8), e4m3, "nvfp4").reshape(g, n, k))
    with pytest.raises(fake_v025.FakeDeepGemmError, match="not produced by a DeepGEMM transform"):
        mod.nvfp4_mega_moe(torch.empty(T, H, dtype=torch.bfloat16), pairs[0], pairs[1], buf)
    l1, l2 = mod.transform_weights_for_mega_moe(pairs[0], pairs[1], mma_type=kind)
    one = mod.transform_weights_for_mega_moe(
        (pairs[0][0][1], pairs[0][1][1]), (pairs[1][0][1], pairs[1][1][1]), mma_type=kind
    )
    assert_bitwise_equal(one[0][0].view(torch.uint8), l1[0][1].view(torch.uint8), "one expert")
    x, ids, weights = _inputs(seed=9)
    with pytest.raises(fake_v025.FakeDeepGemmError, match="group_size=32, nvfp4xnvfp4 uses 16"):
        mod.mega_moe_pre_dispatch(
            x, ids, weights, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, T, mma_type=kind
        )
    mod.mega_moe_pre_dispatch(
        x, ids, weights, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, T, 16, kind
    )
    y = torch.empty(T, H, dtype=torch.bfloat16)
    mod.nvfp4_mega_moe(y, l1, l2, buf)
    want = _float_moe(x, ids, weights, dense[0].double(), dense[1].double(), None)
    assert relative_error(y.double(), want) < 0.2  # NVFP4 activations: E2M1 per 16


def test_fp8_mega_moe_num_tokens_bound() -> None:
    fake = fake_v025.FakeDeepGemm025(arch="sm90")
    mod, group = fake.module(), fake_v025.FakeGroup()
    buf = mod.get_symm_buffer_for_mega_moe(group, E, T, TOP_K, H, INTER)
    w13, w2 = _dense(E, 2 * INTER, H, 11), _dense(E, H, INTER, 12)
    l1, l2 = mod.transform_weights_for_mega_moe_sm90(
        quant.quantize_fp8_block(w13), quant.quantize_fp8_block(w2)
    )
    x, ids, weights = _inputs(seed=13)
    staged = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)
    mod.mega_moe_pre_dispatch_sm90(x, ids.to(torch.int32), weights, *staged, T)
    y = torch.empty(T, H, dtype=torch.bfloat16)
    mod.fp8_mega_moe(y, l1, l2, buf, num_tokens_bound=T)
    assert fake.bounds == [T] and fake.kernel_calls == 1
    capacity = buf.num_max_tokens_per_rank
    for bound, match in ((capacity + 1, "in \\[0, buffer capacity"), (T - 1, "above num_tokens")):
        with pytest.raises(fake_v025.FakeDeepGemmError, match=match):
            mod.fp8_mega_moe(y, l1, l2, buf, num_tokens_bound=bound)
