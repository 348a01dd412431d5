"""The experts module on the reference backend against a float64 MoE written here.

Weights come from ``synthetic_expert_tensors``: magnitudes differ per expert, per shard
(gate/up/down) and per 128x128 block, so a swapped gate/up half, block scale or expert shows.
Tolerances (stated per check below):

- module (float32 math) vs float64 on the *same* kernel weights: the output is bf16, so
  ``|out - ref| <= 2^-8 |ref| + 1e-4 max|ref|`` (bf16 rounding plus float32 accumulation).
- kernel weights vs the checkpoint weights after a format conversion: the rounding bound
  of the run format (E4M3: 2^-4 relative + subnormal step; E2M1: 0.2 relative + 0.25 scale;
  bf16: 2^-8 relative).
- emulate_kernel=True vs a float64 emulation written here: relative Frobenius error
  <= 4e-3 (the bf16 output alone gives ~1.6e-3; float32 vs float64 GEMMs may flip a rare
  activation rounding).
"""

from __future__ import annotations

import logging
import re
import sys
import types
from functools import partial

import pytest
import torch
from bitcheck import relative_error

from megamoe.core.backends.reference import ACTIVATION_ROUNDING, ReferenceBackend
from megamoe.core.errors import CapabilityError, FormatMismatchError
from megamoe.core.modules import backend_select as select
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.modules.experts_backend import ExpertsBackend
from megamoe.core.numerics.formats import RUN_FORMATS, WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

FORMATS = list(RUN_FORMATS)
H, INTER = 256, 256
E2M1_MAGNITUDE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# ---------------------------------------------------------------- float64 oracle (independent)
def decode64(weight: torch.Tensor, scale: torch.Tensor | None, fmt: WeightFormat) -> torch.Tensor:
    """Stored (weight, scale) -> float64, from the format definitions."""
    if fmt is WeightFormat.MXFP4:
        codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2).long()
        sign = torch.where(codes >= 8, -1.0, 1.0).double()
        values = E2M1_MAGNITUDE[codes & 7] * sign
    else:
        values = weight.float().double()
    if fmt is WeightFormat.BF16:
        return values
    assert scale is not None
    if fmt is WeightFormat.FP8_BLOCK:
        full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        full = torch.pow(2.0, scale.double() - 127.0).repeat_interleave(32, -1)
    return values * full[: values.shape[0], : values.shape[1]]


def checkpoint_experts64(
    tensors: dict[str, torch.Tensor], fmt: WeightFormat, count: int
) -> list[dict[str, torch.Tensor]]:
    """Per logical expert: float64 w1, w3, w2 decoded from checkpoint tensors."""
    scale_name = fmt.scale_name
    return [
        {
            shard: decode64(
                tensors[f"{e}.{proj}.weight"],
                None if scale_name is None else tensors[f"{e}.{proj}.{scale_name}"],
                fmt,
            )
            for shard, proj in PROJ.items()
        }
        for e in range(count)
    ]


def kernel_experts64(m: MegaMoEExperts, shared: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per kernel slot: float64 w1, w3, w2 decoded from the module's canonical tensors."""
    l1, l2 = ("shared_l1", "shared_l2") if shared else ("w13", "w2")
    params = dict(m.named_parameters())
    count = m.num_shared_experts if shared else m.num_local_experts
    out = []
    for slot in range(count):
        scale1 = params.get(f"{l1}_weight_scale")
        scale2 = params.get(f"{l2}_weight_scale")
        w13 = decode64(
            params[f"{l1}_weight"][slot], None if scale1 is None else scale1[slot], m.weight_format
        )
        w2 = decode64(
            params[f"{l2}_weight"][slot], None if scale2 is None else scale2[slot], m.weight_format
        )
        out.append({"w1": w13[: m.intermediate_size], "w3": w13[m.intermediate_size :], "w2": w2})
    return out


def round_pow2_64(v: torch.Tensor, group: int) -> torch.Tensor:
    """E4M3 with a power-of-two scale (>= amax / 448) per ``group`` columns."""
    g = v.reshape(*v.shape[:-1], -1, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return ((g / scale).float().to(torch.float8_e4m3fn).double() * scale).reshape(v.shape)


def round_token_fp8_64(v: torch.Tensor) -> torch.Tensor:
    """E4M3 with a float32 scale amax / 448 per 128 columns of a token.

    In float32 as ``mega_moe_pre_dispatch_sm90`` computes it: scale = max(amax, 1e-10) / 448
    correctly rounded, values = E4M3(x * float32(1 / scale)). Each float32 step is done in
    float64 and rounded to float32 once (exact for one division or product of float32s).
    bf16 inputs often sit exactly on an E4M3 tie, where ``amax * float32(1/448)`` would
    round to the other neighbour.
    """
    g = v.float().reshape(*v.shape[:-1], -1, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-10).double()
    scale = (amax / 448.0).float().double()
    inverse = (1.0 / scale).float().double()
    q = (g.double() * inverse).float().to(torch.float8_e4m3fn)
    return (q.double() * scale).reshape(v.shape)


def _bf16_64(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).double()


_MX64 = partial(round_pow2_64, group=32)  # MX activations: 1x32 UE8M0 scales
_HOPPER_MID64 = partial(round_pow2_64, group=64)  # Hopper's intermediate: 1x64
# (input rounding, weighted-SwiGLU rounding) per run format.
EMULATION64 = {
    WeightFormat.BF16: (_bf16_64, _bf16_64),
    WeightFormat.FP8_BLOCK: (round_token_fp8_64, _HOPPER_MID64),
    WeightFormat.MXFP8: (_MX64, _MX64),
    WeightFormat.MXFP4: (_MX64, _MX64),
}


def moe64(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    physical: list[dict[str, torch.Tensor]],
    shared: list[dict[str, torch.Tensor]] = (),  # type: ignore[assignment]
    emulate: WeightFormat | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """float64 MoE: sum_k w_k * W2 (silu(W1 x) * (W3 x)) + shared experts (weight 1).

    With ``swiglu_limit`` L: W1 x is capped at L and W3 x limited to [-L, L] first. With
    ``emulate`` the kernel's roundings: the tokens, the weighted SwiGLU output, and each
    routed slot's row (to bf16) before the token's sum.
    """
    rnd_in, rnd_mid = EMULATION64[emulate] if emulate is not None else (None, None)
    x = x.double() if rnd_in is None else rnd_in(x.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        routes = [(int(p), float(w)) for p, w in zip(topk_ids[t], topk_weights[t], strict=True)]
        routed = [(physical[p], w, True) for p, w in routes if p >= 0]
        for weights, gain, is_slot in routed + [(s, 1.0, False) for s in shared]:
            g, u = weights["w1"] @ x[t], weights["w3"] @ x[t]
            if swiglu_limit is not None:
                limit = torch.tensor(swiglu_limit, dtype=torch.float64)
                g, u = torch.minimum(g, limit), torch.maximum(torch.minimum(u, limit), -limit)
            act = g / (1.0 + torch.exp(-g)) * u
            if emulate is None:
                out[t] += gain * (weights["w2"] @ act)
            else:  # a routed slot's row is rounded to bf16, as in the kernels' combine buffer
                row = weights["w2"] @ rnd_mid((act * gain)[None])[0]
                out[t] += row.to(torch.bfloat16).double() if is_slot else row
    return out


# ---------------------------------------------------------------- helpers
def routing(
    tokens: int, top_k: int, num_experts: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states with per-token magnitudes, distinct top-k ids (some -1), weights."""
    gen = torch.Generator().manual_seed(seed)
    gain = torch.exp2(torch.rand(tokens, 1, generator=gen) * 4 - 2)
    x = (torch.randn(tokens, H, generator=gen) * gain).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[::5, -1] = -1
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, weights, ids


def build(
    run_format: WeightFormat,
    checkpoint_format: WeightFormat,
    *,
    num_experts: int = 6,
    shared: int = 0,
    emulate: bool = False,
    top_k: int = 3,
    swiglu_limit: float | None = None,
) -> MegaMoEExperts:
    return one_rank_experts(
        num_experts,
        H,
        INTER,
        top_k=top_k,
        weight_format=run_format,
        checkpoint_format=checkpoint_format,
        num_shared_experts=shared,
        max_num_tokens=64,
        backend="reference",
        prefix="layers.0.mlp.experts",
        emulate_kernel=emulate,
        swiglu_limit=swiglu_limit,
    )


def load(
    m: MegaMoEExperts, fmt: WeightFormat, count: int, shared: int = 0, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Load routed (and shared) checkpoint tensors, finalize; return both tensor dicts."""
    routed = dict(synthetic_expert_tensors(fmt, count, H, INTER, seed=seed))
    m.load_weights(routed.items())
    shared_tensors: dict[str, torch.Tensor] = {}
    if shared:
        shared_tensors = dict(synthetic_expert_tensors(fmt, 1, H, shared * INTER, seed=seed + 7))
        for name, tensor in shared_tensors.items():
            _, proj, kind = name.split(".")
            shard = {v: k for k, v in PROJ.items()}[proj]
            m.load_shared_expert_tensor(shard, kind, tensor)
    m.finalize()
    return routed, shared_tensors


def split_shared(whole: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """The shared MLP (intermediate count*I) as ``count`` experts of intermediate I."""
    return [
        {
            "w1": whole["w1"][s * INTER : (s + 1) * INTER],
            "w3": whole["w3"][s * INTER : (s + 1) * INTER],
            "w2": whole["w2"][:, s * INTER : (s + 1) * INTER],
        }
        for s in range(count)
    ]


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (out.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 1e-4 * ref.abs().max()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: |out-ref| {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e}"
    )


# ---------------------------------------------------------------- forward vs float64
@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=lambda f: f"ckpt-{f.value}")
@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f"run-{f.value}")
def test_forward_matches_float64_moe(run_format: WeightFormat, checkpoint_format: WeightFormat):
    m = build(run_format, checkpoint_format, shared=2)
    routed, shared = load(m, checkpoint_format, 6, shared=2)
    x, w, ids = routing(16, 3, 6, seed=1)
    out = m(x, w, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (16, H)

    kernel = kernel_experts64(m)
    kernel_shared = kernel_experts64(m, shared=True)
    assert_close_bf16(out, moe64(x, w, ids, kernel, kernel_shared), "vs float64 on kernel weights")

    ckpt = checkpoint_experts64(routed, checkpoint_format, 6)
    ckpt_shared = split_shared(checkpoint_experts64(shared, checkpoint_format, 1)[0], 2)
    if run_format is checkpoint_format:
        for slot in range(6):  # stored as-is: the kernel holds exactly the checkpoint values
            for shard in PROJ:
                torch.testing.assert_close(kernel[slot][shard], ckpt[slot][shard], rtol=0, atol=0)
        for s in range(2):
            for shard in PROJ:
                got, want = kernel_shared[s][shard], ckpt_shared[s][shard]
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    # Converted: every kernel weight within the run format's rounding bound of the source.
    for got_all, want_all in ((kernel, ckpt), (kernel_shared, ckpt_shared)):
        for got_e, want_e in zip(got_all, want_all, strict=True):
            for shard in PROJ:
                got, want = got_e[shard], want_e[shard]
                bound = _rounding_bound(run_format, want, got)
                assert bool(((got - want).abs() <= bound).all()), (run_format, shard)
    # And the output stays within the format's noise of the float64 MoE on the source weights.
    ref = moe64(x, w, ids, ckpt, ckpt_shared)
    assert relative_error(out, ref) <= OUTPUT_NOISE[run_format]


# Relative Frobenius error of an output vs the source weights after conversion, bounded by
# the run format's worst-case relative rounding of one weight: E4M3 2^-4 (seen: 0.03-0.045),
# E2M1 1/3 near 0.75 (seen: 0.20-0.26), bf16 2^-8 plus the bf16 output's 2^-9 (seen: 0.003).
OUTPUT_NOISE = {
    WeightFormat.BF16: 0.01,
    WeightFormat.FP8_BLOCK: 2.0**-4,
    WeightFormat.MXFP8: 2.0**-4,
    WeightFormat.MXFP4: 0.35,
}


def _rounding_bound(fmt: WeightFormat, source: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Largest allowed |converted - source| per element for the run format ``fmt``."""
    if fmt is WeightFormat.BF16:
        return 2.0**-8 * source.abs()
    if fmt is WeightFormat.MXFP4:
        scale = _group_scale(source, 6.0)
        return 0.2 * source.abs() + 0.25 * scale + 1e-12
    scale = _group_scale(source, 448.0) if fmt is WeightFormat.MXFP8 else _block_scale(source)
    return 2.0**-4 * source.abs() + 2.0**-9 * scale + 1e-12


def _group_scale(v: torch.Tensor, top: float) -> torch.Tensor:
    g = v.reshape(v.shape[0], -1, 32).abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(g / top)) + 1)  # one power of two of slack
    return scale.expand(-1, -1, 32).reshape(v.shape)


def _block_scale(v: torch.Tensor) -> torch.Tensor:
    r, c = v.shape
    blocks = v.reshape(r // 128, 128, c // 128, 128).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    return (blocks / 448.0).repeat_interleave(128, 0).repeat_interleave(128, 1)


@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f.value)
def test_emulated_kernel_rounding_matches_float64_emulation(run_format: WeightFormat):
    ckpt = WeightFormat.FP8_BLOCK if run_format is not WeightFormat.BF16 else WeightFormat.BF16
    exact = build(run_format, ckpt, shared=1)
    emulated = build(run_format, ckpt, shared=1, emulate=True)
    load(exact, ckpt, 6, shared=1)
    load(emulated, ckpt, 6, shared=1)
    x, w, ids = routing(24, 3, 6, seed=2)
    kernel, kernel_shared = kernel_experts64(emulated), kernel_experts64(emulated, shared=True)
    ref_emulated = moe64(x, w, ids, kernel, kernel_shared, emulate=run_format)
    out_emulated, out_exact = emulated(x, w, ids), exact(x, w, ids)
    ref_exact = moe64(x, w, ids, kernel, kernel_shared)
    assert relative_error(out_emulated, ref_emulated) <= 4e-3
    assert relative_error(out_exact, ref_exact) <= 4e-3
    # The rounding really happens: with E4M3 activations the emulated output departs from
    # the exact one by their precision (a few 1e-2); bf16 rounding is below the output's.
    assert not torch.equal(out_emulated, out_exact)
    if run_format is not WeightFormat.BF16:
        assert relative_error(out_emulated, ref_exact) >= 1e-2


@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f.value)
def test_the_emulation_sums_bf16_rows_per_slot_as_the_kernels_combine(run_format: WeightFormat):
    # The kernels write each (token, slot) output as a bf16 row and sum a token's rows in
    # float32, lowest slot first; a float32 sum of the unrounded rows gives other bits.
    ckpt = WeightFormat.FP8_BLOCK if run_format is not WeightFormat.BF16 else WeightFormat.BF16
    m = build(run_format, ckpt, emulate=True)
    load(m, ckpt, 6)
    x, w, ids = routing(40, 3, 6, seed=5)
    tokens = ACTIVATION_ROUNDING[run_format].input(x.float())
    rows = m.backend.expert_contributions(m, tokens, w, ids.long())
    bf16_rows = rows.to(torch.bfloat16).float()
    summed_bf16_rows = bf16_rows[:, 0] + bf16_rows[:, 1] + bf16_rows[:, 2]
    summed_rows = rows[:, 0] + rows[:, 1] + rows[:, 2]
    out = m(x, w, ids)
    assert torch.equal(out, summed_bf16_rows.to(torch.bfloat16))
    assert not torch.equal(out, summed_rows.to(torch.bfloat16))


def gate_up64(
    x: torch.Tensor,
    ids: torch.Tensor,
    physical: list[dict[str, torch.Tensor]],
    shared: list[dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """float64 W1 x and W3 x of every routed (token, expert) pair and every shared expert."""
    xs = x.double()
    routes = [(t, int(p)) for t in range(x.shape[0]) for p in ids[t] if p >= 0]
    return {
        "routed gate": torch.stack([physical[p]["w1"] @ xs[t] for t, p in routes]),
        "routed up": torch.stack([physical[p]["w3"] @ xs[t] for t, p in routes]),
        "shared gate": torch.cat([xs @ e["w1"].T for e in shared]),
        "shared up": torch.cat([xs @ e["w3"].T for e in shared]),
    }


# swiglu_limit at this quantile of the routed and of the shared gates (the lower of the two):
# the gate is clamped from above only, and up (gain 1.7 over gate) by magnitude.
CLAMP_QUANTILE = 0.9


@pytest.mark.parametrize("emulate", [False, True], ids=["exact", "emulated"])
@pytest.mark.parametrize("run_format", FORMATS, ids=lambda f: f.value)
def test_swiglu_clamp_matches_float64(run_format: WeightFormat, emulate: bool):
    x, w, ids = routing(24, 3, 6, seed=8)
    plain = build(run_format, run_format, shared=1, emulate=emulate)
    load(plain, run_format, 6, shared=1)
    kernel, kernel_shared = kernel_experts64(plain), kernel_experts64(plain, shared=True)
    pre = gate_up64(x, ids, kernel, kernel_shared)
    gates = (pre["routed gate"].flatten(), pre["shared gate"].flatten())
    limit = float(min(torch.quantile(g, CLAMP_QUANTILE) for g in gates).to(torch.bfloat16))
    shares = {
        name: float(((v if "gate" in name else v.abs()) > limit).double().mean())
        for name, v in pre.items()
    }
    assert min(shares.values()) >= 0.05, shares  # routed and shared gates and ups all clamp
    clamped = build(run_format, run_format, shared=1, emulate=emulate, swiglu_limit=limit)
    load(clamped, run_format, 6, shared=1)
    out = clamped(x, w, ids)
    emulation = run_format if emulate else None
    ref = moe64(x, w, ids, kernel, kernel_shared, emulation, swiglu_limit=limit)
    if emulate:
        assert relative_error(out, ref) <= 4e-3
    else:
        assert_close_bf16(out, ref, f"clamped at {limit}")
    # The clamp moves the routed and the shared experts' outputs far beyond those bounds.
    for routes, shared in ((ids, []), (torch.full_like(ids, -1), kernel_shared)):
        part = moe64(x, w, routes, kernel, shared, emulation, swiglu_limit=limit)
        assert relative_error(moe64(x, w, routes, kernel, shared, emulation), part) > 0.1


@pytest.mark.parametrize("limit", [0, 0.0, -1.0, -7, float("inf"), float("nan"), True, False, "7"])
def test_swiglu_limit_must_be_finite_and_positive(limit: object):
    with pytest.raises(
        ValueError,
        match=rf"layers\.0\.mlp\.experts: swiglu_limit={re.escape(repr(limit))} must be a "
        "finite number > 0, or None for no clamp",
    ):
        build(WeightFormat.BF16, WeightFormat.BF16, swiglu_limit=limit)  # type: ignore[arg-type]
    assert build(WeightFormat.BF16, WeightFormat.BF16, swiglu_limit=7).swiglu_limit == 7.0


def test_swapped_gate_up_is_detected():
    """A layout mistake (gate/up halves swapped) must show against the oracle."""
    m = build(WeightFormat.MXFP8, WeightFormat.FP8_BLOCK)
    load(m, WeightFormat.FP8_BLOCK, 6)
    x, w, ids = routing(16, 3, 6, seed=3)
    ref = moe64(x, w, ids, kernel_experts64(m))
    for name in ("w13_weight", "w13_weight_scale"):
        p = getattr(m, name).data
        p.copy_(torch.cat([p[:, INTER:], p[:, :INTER]], dim=1))
    assert relative_error(m(x, w, ids), ref) > 0.3


def test_unused_slots_and_untouched_tokens():
    m = build(WeightFormat.BF16, WeightFormat.BF16)
    load(m, WeightFormat.BF16, 6)
    x, w, ids = routing(4, 3, 6, seed=4)
    ids[1] = -1
    out = m(x, w, ids)
    assert bool((out[1] == 0).all())
    empty = m(x[:0], w[:0], ids[:0])
    assert empty.shape == (0, H)


# ---------------------------------------------------------------- backend errors
def test_topk_id_out_of_range():
    m = build(WeightFormat.BF16, WeightFormat.BF16)
    load(m, WeightFormat.BF16, 6)
    x, w, ids = routing(4, 3, 6, seed=5)
    ids[2, 0] = 6
    with pytest.raises(ValueError, match=r"topk_ids holds 6; .* \[0, num_experts=6\) or -1"):
        m(x, w, ids)


def test_backend_prepared_for_another_format():
    a = build(WeightFormat.BF16, WeightFormat.BF16)
    b = build(WeightFormat.MXFP8, WeightFormat.BF16)
    load(a, WeightFormat.BF16, 6)
    load(b, WeightFormat.BF16, 6)
    a.backend = b.backend
    x, w, ids = routing(4, 3, 6, seed=6)
    with pytest.raises(
        FormatMismatchError, match=r"reference backend is tagged mxfp8 .* runs bf16"
    ):
        a(x, w, ids)


# ---------------------------------------------------------------- backend selection
def test_auto_picks_reference_on_cpu_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(select, "_logged", set())
    with caplog.at_level(logging.INFO, logger="megamoe"):
        first = select.resolve_backend("auto", WeightFormat.MXFP8, "cpu")
        second = select.resolve_backend("auto", "mxfp8", torch.device("cpu"))
    assert isinstance(first, ReferenceBackend) and isinstance(second, ReferenceBackend)
    records = [r for r in caplog.records if "backend auto -> reference" in r.getMessage()]
    assert len(records) == 1
    assert "deepgemm cannot" in records[0].getMessage()


def test_explicit_deepgemm_that_cannot_run_is_an_error():
    with pytest.raises(
        CapabilityError, match=r"experts backend 'deepgemm' cannot run mxfp8 on cpu"
    ):
        select.resolve_backend("deepgemm", WeightFormat.MXFP8, "cpu")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"unknown experts backend 'fast'; expected one of: auto"):
        select.resolve_backend("fast", WeightFormat.BF16, None)


def test_deepgemm_module_that_fails_to_import_counts_as_unsupported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setitem(select.BACKEND_MODULES, "deepgemm", "megamoe_no_such_module")
    monkeypatch.setattr(select, "_logged", set())
    with caplog.at_level(logging.INFO, logger="megamoe"):
        chosen = select.resolve_backend("auto", WeightFormat.BF16, "cpu")
    assert isinstance(chosen, ReferenceBackend)
    assert "megamoe_no_such_module does not import" in caplog.text
    with pytest.raises(CapabilityError, match="does not import"):
        select.resolve_backend("deepgemm", WeightFormat.BF16, "cpu")


def test_auto_picks_deepgemm_where_it_can_run(monkeypatch: pytest.MonkeyPatch):
    class CanRun(ExpertsBackend):
        name = "deepgemm"

        @classmethod
        def unsupported_reason(cls, run_format: WeightFormat, device: torch.device) -> str | None:
            return None if run_format is WeightFormat.MXFP4 else "only mxfp4 here"

        def prepare(self, experts, local_ids):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def forward(self, experts, hidden_states, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    fake = types.ModuleType("megamoe_fake_deepgemm")
    fake.CanRun = CanRun  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(select.BACKEND_MODULES, "deepgemm", fake.__name__)
    assert isinstance(select.resolve_backend("auto", WeightFormat.MXFP4, "cpu"), CanRun)
    assert isinstance(select.resolve_backend("auto", WeightFormat.MXFP8, "cpu"), ReferenceBackend)
    with pytest.raises(CapabilityError, match="only mxfp4 here"):
        select.resolve_backend("deepgemm", WeightFormat.MXFP8, "cpu")


def test_registered_module_without_the_backend_class(monkeypatch: pytest.MonkeyPatch):
    empty = types.ModuleType("megamoe_empty_backend")
    monkeypatch.setitem(sys.modules, empty.__name__, empty)
    monkeypatch.setitem(select.BACKEND_MODULES, "reference", empty.__name__)
    with pytest.raises(TypeError, match="defines no ExpertsBackend subclass with name='reference'"):
        select.backend_class("reference")


def test_reference_runs_everything():
    for fmt in FORMATS:
        assert ReferenceBackend.unsupported_reason(fmt, torch.device("cpu")) is None
