"""A strict fake of sgl-deep-gemm 0.2.5's MegaMoE API, for the backend's next API generation.

Not wired into the DeepGEMM backend or its tests yet: the backend speaks sgl-deep-gemm
0.1.4.post1's API, which ``fake_deep_gemm.py`` models. This module builds on that fake
(its checks, layouts, decoders and float64 MoE are imported, not copied) and models what
0.2.5 changed, with the signatures of 0.2.5's Python files (``deep_gemm/__init__.py``,
``deep_gemm/mega/__init__.py``, ``deep_gemm/utils/math.py`` of the wheel):

- ``get_symm_buffer_for_mega_moe(..., num_shared_experts=0, use_fp8_dispatch=None,
  mma_type="fp8xfp4", activation="swiglu")``: ``num_shared_experts`` is new, seventh
  positional; on SM90 it dispatches to ``get_symm_buffer_for_sm90_mega_moe`` (shared must
  be 0, ``mma_type`` FP8); kinds add ``"nvfp4xnvfp4"`` (``"mxf4xmxf4"`` is not modelled);
- ``transform_weights_for_mega_moe(l1, l2, activation, mma_type)``: the FP4-activation
  kinds take the packed gate/up interleave (16 rows: even rows of gate, of up, odd rows of
  gate, of up); 2-D (one expert) inputs are taken too;
- ``transform_sf_into_required_layout(..., psum_layout=None)``;
- ``transform_scales_for_mega_moe(l1_scales, l2_scales)``: NVFP4 scales (four UE4M3 bytes
  per int32, MN-major) into the kernel layout;
- ``mega_moe_pre_dispatch(..., group_size=32, mma_type="fp8xfp4", buf_x_scales=None,
  expert_scales=None)`` (0.1.4.post1: ``use_fp4_acts``); ``mega_moe_pre_dispatch_sm90``
  unchanged;
- ``fp8_mega_moe(..., num_tokens_bound=None)``;
- ``fp8_fp4_mega_moe`` / ``bf16_mega_moe`` / ``nvfp4_mega_moe`` with ``shared_l1_weights``,
  ``shared_l2_weights`` (fourth and fifth, before ``cumulative_local_expert_recv_stats``),
  ``weight_layout``, ``global_num_tokens`` and options the fake refuses unless left at
  their defaults (``use_x_scales``, alphas, ``l2_act_scales``, ``post_expert_norm*``);
- ``per_token_cast_to_fp4`` rounds E2M1 ties to even; ``per_token_cast_to_nvfp4`` is new.

Modelled, not read from the wheel (the C++ extension decides them, so check them against
the hardware before relying on them): a fused shared expert takes every token with weight
1 (added after the routed output's bf16 rounding); the NVFP4 buffer holds ``x`` as packed
E2M1 (int8, T x H/2) and ``x_sf`` as packed UE4M3 (int32, T x H/64); the NVFP4 kernel
rounds its intermediate activations through NVFP4.

The casts here are written from the rules, independently of ``megamoe.core``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from fakes import load_fake

base = load_fake("fake_deep_gemm")  # the instance the backend tests load
FakeDeepGemmError = base.FakeDeepGemmError
FakeGroup = base.FakeGroup
_need, _check = base._need, base._check

NVFP4_KIND = "nvfp4xnvfp4"
SM100_KINDS = frozenset({*base.SM100_KINDS, NVFP4_KIND})
PACKED_FP4_INTERLEAVE = 16  # FP4-activation kinds interleave gate/up in groups of 16 rows
E2M1_VALUES = base.E2M1_VALUES
_REFUSED_DEFAULTS = {  # 0.2.5 kernel options the fake does not model: only their defaults
    "use_x_scales": False,
    "l1_alphas": None,
    "l2_alphas": None,
    "l2_act_scales": None,
    "post_expert_norm": False,
    "post_expert_norm_weight": None,
    "post_expert_norm_eps": 1e-6,
    "post_expert_norm_weight_first": False,
}


# ---------------------------------------------------------------- casts (utils.math)
def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 ``y``: nearest magnitude, ties to the even code, no -0."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    distance = (y.double().abs().unsqueeze(-1) - table).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    code = (nearest * (2 - torch.arange(8) % 2)).argmax(-1)  # of two nearest, the even one
    return code | torch.where((y < 0) & (code != 0), 8, 0)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, even column in the low nibble, as int8 (DeepGEMM's dtype)."""
    byte = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def per_token_cast_to_fp4(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 with one float32 (or power-of-two) scale per ``gran_k``; ties to even (0.2.5)."""
    _need(x.dim() == 2 and x.shape[1] % 2 == 0, f"x: (M, even N), got {tuple(x.shape)}")
    _need(not use_packed_ue8m0, "use_packed_ue8m0 is not modelled")
    m, n = x.shape
    pad = -n % gran_k
    groups = torch.nn.functional.pad(x.float(), (0, pad)).reshape(m, -1, gran_k)
    sf = groups.abs().amax(-1).clamp_min(1e-4) * float(torch.tensor(1 / 6.0))
    if use_ue8m0:
        sf = torch.exp2(torch.ceil(torch.log2(sf.double()))).float()
    codes = _e2m1_codes(groups * (1.0 / sf.unsqueeze(-1))).reshape(m, -1)[:, :n]
    return _pack(codes), sf


def per_token_cast_to_nvfp4(
    x: torch.Tensor, gran_k: int = 16, use_packed_ue4m3: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 with one UE4M3 scale per ``gran_k`` (no clamp; a zero scale gives codes 0)."""
    _need(x.dim() == 2 and x.shape[1] % gran_k == 0, f"x: (M, N % {gran_k} == 0)")
    m, n = x.shape
    groups = x.float().reshape(m, -1, gran_k)
    sf = (groups.abs().amax(-1) * float(torch.tensor(1 / 6.0))).to(torch.float8_e4m3fn).float()
    inverse = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    codes = _e2m1_codes(groups * inverse.unsqueeze(-1)).reshape(m, n)
    if use_packed_ue4m3:
        _need(sf.shape[1] % 4 == 0, "packed UE4M3 needs a multiple of 4 scales per row")
        return _pack(codes), sf.to(torch.float8_e4m3fn).view(torch.uint8).view(torch.int32)
    return _pack(codes), sf


def _ue4m3_packed_to_scale(sf_int32: torch.Tensor) -> torch.Tensor:
    """int32 (..., k/64), four UE4M3 bytes each (low byte first) -> float64 (..., k/16)."""
    return sf_int32.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).double()


def _round_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """float64 through NVFP4 (per_token_cast_to_nvfp4 and back), for the NVFP4 kernel."""
    flat = x.reshape(-1, x.shape[-1])
    packed, sf = per_token_cast_to_nvfp4(flat)
    values = base.e2m1_decode(packed) * sf.double().repeat_interleave(16, -1)
    return values.reshape(x.shape)


def _interleave_packed(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows -> per 16: gate's even rows, up's even rows, gate's odd, up's odd."""
    g, n, *rest = t.shape
    half = n // 2
    _need(half % PACKED_FP4_INTERLEAVE == 0, f"{n} rows: gate and up multiples of 16")
    gate = t[:, :half].reshape(g, half // 16, 16, *rest)
    up = t[:, half:].reshape(g, half // 16, 16, *rest)
    parts = [gate[:, :, 0::2], up[:, :, 0::2], gate[:, :, 1::2], up[:, :, 1::2]]
    return torch.empty_like(t).copy_(torch.cat(parts, 2).reshape(t.shape))


def _deinterleave_packed(t: torch.Tensor) -> torch.Tensor:
    g, n, *rest = t.shape
    blocks = t.reshape(g, n // 32, 4, 8, *rest)
    gate = torch.stack([blocks[:, :, 0], blocks[:, :, 2]], 3).reshape(g, n // 2, *rest)
    up = torch.stack([blocks[:, :, 1], blocks[:, :, 3]], 3).reshape(g, n // 2, *rest)
    return torch.cat([gate, up], 1)


def _unsqueezed(t: Any) -> tuple[Any, bool]:
    """0.2.5's transforms take one expert (2-D) too: (3-D tensor, whether it was 2-D)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2:
        return t.unsqueeze(0), True
    return t, False


# The 0.2.5 functions the fake module exposes (its casts, ``CASTS``, besides).
ENTRY_POINTS = (
    "get_symm_buffer_for_mega_moe",
    "get_symm_buffer_for_sm90_mega_moe",
    "transform_weights_for_mega_moe",
    "transform_weights_for_mega_moe_sm90",
    "transform_sf_into_required_layout",
    "transform_scales_for_mega_moe",
    "mega_moe_pre_dispatch",
    "mega_moe_pre_dispatch_sm90",
    "fp8_mega_moe",
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
    "nvfp4_mega_moe",
)
CASTS = (per_token_cast_to_fp4, per_token_cast_to_nvfp4)


class FakeDeepGemm025(base.FakeDeepGemm):
    """State of one fake sgl-deep-gemm 0.2.5 installation; ``module()`` builds the module."""

    def __init__(self, arch: str = "sm100", device: str = "cpu") -> None:
        kinds = SM100_KINDS if arch == "sm100" else frozenset({base.SM90_KIND})
        super().__init__(arch=arch, kinds=kinds, device=device)
        self.shared: dict[int, int] = {}  # id(buffer) -> num_shared_experts
        self.bounds: list[int | None] = []  # num_tokens_bound per fp8_mega_moe call
        self.transform_mma_types: list[str] = []  # per transform_weights_for_mega_moe call

    def module(self) -> types.ModuleType:
        """The fake ``deep_gemm``: 0.2.5 has every entry point on every architecture."""
        mod = types.ModuleType("deep_gemm")
        mod.__dict__["fake"] = self
        for name in ENTRY_POINTS:
            mod.__dict__[name] = getattr(self, name)
        math_mod = types.ModuleType("deep_gemm.utils.math")
        for fn in CASTS:
            math_mod.__dict__[fn.__name__] = mod.__dict__[fn.__name__] = fn
        mod.__dict__["utils"] = types.SimpleNamespace(math=math_mod)
        return mod

    # ---------------------------------------------------------------- buffers
    def get_symm_buffer_for_mega_moe(  # type: ignore[override]
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        num_shared_experts: int = 0,
        use_fp8_dispatch: bool | None = None,
        mma_type: str = "fp8xfp4",
        activation: str = "swiglu",
    ) -> Any:
        if use_fp8_dispatch is not None:
            assert use_fp8_dispatch == (mma_type.split("x")[0] == "fp8")
        if self.arch == "sm90":
            assert mma_type.split("x")[0] == "fp8" and num_shared_experts == 0
            return self.get_symm_buffer_for_sm90_mega_moe(
                group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                intermediate_hidden, True, activation,
            )  # fmt: skip
        _need(
            isinstance(num_shared_experts, int) and num_shared_experts >= 0,
            f"num_shared_experts={num_shared_experts!r}: an int >= 0",
        )
        _need(mma_type != "mxf4xmxf4", "mma_type='mxf4xmxf4' is not modelled by the fake")
        args = (group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
        buf = self._allocate(*args, mma_type, activation, 0)
        if mma_type == NVFP4_KIND:  # E2M1 activations with UE4M3 scales per 16
            rows = buf.x.shape[0]
            buf.x = torch.zeros((rows, hidden // 2), dtype=torch.int8, device=self.device)
            buf.x_sf = torch.zeros((rows, hidden // 64), dtype=torch.int32, device=self.device)
        self.shared[id(buf)] = num_shared_experts
        return buf

    def get_symm_buffer_for_sm90_mega_moe(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        use_fp8_dispatch: bool = True,
        activation: str = "swiglu",
    ) -> Any:
        _need(self.arch == "sm90", "the SM90 MegaMoE buffer needs a Hopper device")
        _need(use_fp8_dispatch is True, "SM90 MegaMoE dispatches FP8")
        args = (group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
        return self._allocate(*args, "fp8xfp4", activation, 0)

    # ---------------------------------------------------------------- transforms
    def transform_sf_into_required_layout(  # type: ignore[override]
        self,
        sf: Any,
        mn: int,
        k: int,
        recipe: tuple[int, ...],
        num_groups: int | None = None,
        is_sfa: bool | None = None,
        disable_ue8m0_cast: bool = False,
        psum_layout: Any = None,
    ) -> torch.Tensor:
        _need(psum_layout is None, "psum_layout is not modelled by the fake")
        return super().transform_sf_into_required_layout(
            sf, mn, k, recipe, num_groups, is_sfa, disable_ue8m0_cast
        )

    def transform_weights_for_mega_moe(  # type: ignore[override]
        self,
        l1_weights: Any,
        l2_weights: Any,
        activation: str = "swiglu",
        mma_type: str = "fp8xfp4",
    ) -> Any:
        _need(activation == "swiglu", f"activation {activation!r} is not modelled")
        self.transform_mma_types.append(mma_type)
        if mma_type != NVFP4_KIND:
            one = isinstance(l1_weights, torch.Tensor) and l1_weights.dim() == 2
            if one:  # one expert: 0.2.5 adds and removes the expert dimension
                l1_weights, l2_weights = l1_weights.unsqueeze(0), l2_weights.unsqueeze(0)
            out = super().transform_weights_for_mega_moe(l1_weights, l2_weights, activation)
            return (out[0][0], out[1][0]) if one else out
        _need(isinstance(l1_weights, tuple), "NVFP4 weights: (packed E2M1, UE4M3 sf) pairs")
        self.transform_calls += 1
        (w1, sf1), (w2, sf2) = l1_weights, l2_weights
        (w1, one), (w2, _), (sf1, _), (sf2, _) = map(_unsqueezed, (w1, w2, sf1, sf2))
        g, n, h2 = w1.shape
        _check(w1, "l1 weight", torch.int8, (g, n, h2))
        _check(w2, "l2 weight", torch.int8, (g, 2 * h2, n // 4))
        _check(sf1, "l1 sf", torch.int32, (g, n, 2 * h2 // 64))
        _check(sf2, "l2 sf", torch.int32, (g, 2 * h2, n // 2 // 64))
        _need(all(t.is_contiguous() for t in (w1, w2)), "NVFP4 weights must be contiguous")
        l1 = (_interleave_packed(w1).contiguous(), base.utccp(_interleave_packed(sf1)))
        out = (l1, (w2, base.utccp(sf2)))
        self._record(l1[0], l1[1], out[1][0], out[1][1])
        if one:
            return ((l1[0][0], l1[1][0]), (w2[0], out[1][1][0]))
        return out

    def transform_scales_for_mega_moe(self, l1_scales: Any, l2_scales: Any) -> Any:
        """Packed MN-major NVFP4 scales ([gate; up] rows) into the kernel layout."""
        for what, sf in (("l1_scales", l1_scales), ("l2_scales", l2_scales)):
            _need(
                isinstance(sf, torch.Tensor) and sf.dtype == torch.int32 and sf.dim() in (2, 3),
                f"{what}: int32 (G, MN, K/64) packed UE4M3",
            )
        (l1, one), (l2, _) = _unsqueezed(l1_scales), _unsqueezed(l2_scales)
        base._mn_major(l1, "l1_scales")
        base._mn_major(l2, "l2_scales")
        out = (base.utccp(_interleave_packed(l1)), base.utccp(l2))
        self._record(*out)
        return (out[0][0], out[1][0]) if one else out

    # ---------------------------------------------------------------- dispatch
    def mega_moe_pre_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        buf_x: Any,
        buf_x_sf: Any,
        buf_topk_idx: Any,
        buf_topk_weights: Any,
        num_tokens: int,
        group_size: int = 32,
        mma_type: str = "fp8xfp4",
        buf_x_scales: Any = None,
        expert_scales: Any = None,
    ) -> None:
        owner = next((b for b in self.buffers if buf_x is b.x), None)
        _need(owner is not None, "buf_x is not the x view of a MegaMoE buffer")
        assert owner is not None
        _need(owner.kind == mma_type, f"mma_type {mma_type!r}, the buffer is {owner.kind!r}")
        _need(buf_x_scales is None and expert_scales is None, "x/expert scales: not modelled")
        want_group = 16 if mma_type == NVFP4_KIND else 32
        _need(group_size == want_group, f"group_size={group_size}, {mma_type} uses {want_group}")
        t, h, k = num_tokens, owner.hidden, owner.num_topk
        _need(t <= owner.num_max_tokens_per_rank, f"num_tokens {t} > buffer capacity")
        _check(x, "x", torch.bfloat16, (t, h))
        _need(
            isinstance(topk_idx, torch.Tensor) and topk_idx.dtype in (torch.int32, torch.int64),
            "topk_idx: int32 or int64",
        )
        _check(topk_idx, "topk_idx", topk_idx.dtype, (t, k))
        _check(topk_weights, "topk_weights", torch.float32, (t, k))
        if mma_type == NVFP4_KIND:
            packed, sf = per_token_cast_to_nvfp4(x, use_packed_ue4m3=True)
        else:
            groups = x.float().reshape(t, h // 32, 32)
            amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-4)
            scale = torch.exp2(torch.ceil(torch.log2(amax.double() / base.E4M3_MAX))).float()
            packed = (groups * (1.0 / scale)).to(torch.float8_e4m3fn).reshape(t, h)
            exps = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).reshape(t, h // 32)
            sf = exps.contiguous().view(torch.int32)
        buf_x[:t].copy_(packed)
        buf_x_sf[:t].copy_(sf)
        buf_topk_idx.fill_(-1)
        buf_topk_idx[:t].copy_(topk_idx)
        buf_topk_weights.zero_()
        buf_topk_weights[:t].copy_(topk_weights)

    # ---------------------------------------------------------------- kernels
    def fp8_mega_moe(  # type: ignore[override]
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        cumulative_local_expert_recv_stats: Any = None,
        recipe: tuple[int, int, int] = (128, 128, 128),
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
        num_tokens_bound: int | None = None,
    ) -> None:
        if num_tokens_bound is not None:
            capacity = getattr(sym_buffer, "num_max_tokens_per_rank", 0)
            _need(
                isinstance(num_tokens_bound, int) and 0 <= num_tokens_bound <= capacity,
                f"num_tokens_bound={num_tokens_bound!r}: in [0, buffer capacity {capacity}]",
            )
            _need(
                isinstance(y, torch.Tensor) and y.shape[0] <= num_tokens_bound,
                f"{getattr(y, 'shape', (None,))[0]} tokens above num_tokens_bound",
            )
        self.bounds.append(num_tokens_bound)
        super().fp8_mega_moe(
            y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, recipe,
            activation, activation_clamp, fast_math,
        )  # fmt: skip

    def _check_options(self, buf: Any, options: dict[str, Any]) -> None:
        """0.2.5's host checks of weight_layout and global_num_tokens; refused extras."""
        layout = options.pop("weight_layout")
        _need(layout in ("megamoe", "trtllm"), f"Unsupported MegaMoE weight layout: {layout!r}")
        _need(layout == "megamoe", "weight_layout='trtllm' is not modelled by the fake")
        tokens = options.pop("global_num_tokens")
        limit = buf.group.size() * buf.num_max_tokens_per_rank
        _need(
            tokens is None or 0 <= tokens <= limit,
            f"global_num_tokens must be in [0, {limit}] (EP ranks x num_max_tokens_per_rank)",
        )
        for name, value in options.items():
            _need(
                value is _REFUSED_DEFAULTS[name] or value == _REFUSED_DEFAULTS[name],
                f"{name}={value!r} is not modelled by the fake",
            )

    def _shared(self, buf: Any, l1: Any, l2: Any) -> tuple[Any, Any] | None:
        """The fused shared experts' weights, checked against the buffer's count."""
        count = self.shared.get(id(buf), 0)
        _need((l1 is None) == (l2 is None), "shared_l1_weights and shared_l2_weights go together")
        _need((l1 is not None) == (count > 0), f"the buffer has {count} shared experts")
        if l1 is None:
            return None
        first = l1[0] if isinstance(l1, tuple) else l1
        _need(first.shape[0] == count, f"shared weights hold {first.shape[0]}, buffer {count}")
        self._check_kernel_weights(
            types.SimpleNamespace(dims=lambda: (count, buf.hidden, buf.intermediate_hidden)),
            {"shared l1": first, "shared l2": l2[0] if isinstance(l2, tuple) else l2},
        )
        return l1, l2

    def fp8_fp4_mega_moe(  # type: ignore[override]
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        shared_l1_weights: Any = None,
        shared_l2_weights: Any = None,
        cumulative_local_expert_recv_stats: Any = None,
        recipe: tuple[int, int, int] = (1, 1, 32),
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
        use_x_scales: bool = False,
        l1_alphas: Any = None,
        l2_alphas: Any = None,
        l2_act_scales: Any = None,
        weight_layout: str = "megamoe",
        global_num_tokens: int | None = None,
        post_expert_norm: bool = False,
        post_expert_norm_weight: Any = None,
        post_expert_norm_eps: float = 1e-6,
        post_expert_norm_weight_first: bool = False,
    ) -> None:
        options = {
            "use_x_scales": use_x_scales,
            "l1_alphas": l1_alphas,
            "l2_alphas": l2_alphas,
            "l2_act_scales": l2_act_scales,
            "weight_layout": weight_layout,
            "global_num_tokens": global_num_tokens,
            "post_expert_norm": post_expert_norm,
            "post_expert_norm_weight": post_expert_norm_weight,
            "post_expert_norm_eps": post_expert_norm_eps,
            "post_expert_norm_weight_first": post_expert_norm_weight_first,
        }
        self._check_options(sym_buffer, options)
        shared = self._shared(sym_buffer, shared_l1_weights, shared_l2_weights)
        if getattr(sym_buffer, "kind", None) == NVFP4_KIND:
            self._nvfp4_moe(y, l1_weights, l2_weights, sym_buffer, shared, recipe, activation_clamp)
            return
        super().fp8_fp4_mega_moe(
            y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, recipe,
            activation, activation_clamp, fast_math,
        )  # fmt: skip
        if shared is not None:
            self._add_shared(y, sym_buffer, shared, activation_clamp, fp4=True)

    def bf16_mega_moe(  # type: ignore[override]
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        shared_l1_weights: Any = None,
        shared_l2_weights: Any = None,
        cumulative_local_expert_recv_stats: Any = None,
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
        weight_layout: str = "megamoe",
        global_num_tokens: int | None = None,
        post_expert_norm: bool = False,
        post_expert_norm_weight: Any = None,
        post_expert_norm_eps: float = 1e-6,
        post_expert_norm_weight_first: bool = False,
    ) -> None:
        options = {
            "weight_layout": weight_layout,
            "global_num_tokens": global_num_tokens,
            "post_expert_norm": post_expert_norm,
            "post_expert_norm_weight": post_expert_norm_weight,
            "post_expert_norm_eps": post_expert_norm_eps,
            "post_expert_norm_weight_first": post_expert_norm_weight_first,
        }
        self._check_options(sym_buffer, options)
        shared = self._shared(sym_buffer, shared_l1_weights, shared_l2_weights)
        super().bf16_mega_moe(
            y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
            activation, activation_clamp, fast_math,
        )  # fmt: skip
        if shared is not None:
            self._add_shared(y, sym_buffer, shared, activation_clamp, fp4=False)

    def nvfp4_mega_moe(
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        shared_l1_weights: Any = None,
        shared_l2_weights: Any = None,
        cumulative_local_expert_recv_stats: Any = None,
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
        use_x_scales: bool = False,
        l1_alphas: Any = None,
        l2_alphas: Any = None,
        l2_act_scales: Any = None,
        weight_layout: str = "megamoe",
        global_num_tokens: int | None = None,
        post_expert_norm: bool = False,
        post_expert_norm_weight: Any = None,
        post_expert_norm_eps: float = 1e-6,
        post_expert_norm_weight_first: bool = False,
    ) -> None:
        """``fp8_fp4_mega_moe`` with ``recipe=(1, 1, 16)``, as 0.2.5 forwards it."""
        self.fp8_fp4_mega_moe(
            y, l1_weights, l2_weights, sym_buffer, shared_l1_weights, shared_l2_weights,
            cumulative_local_expert_recv_stats, (1, 1, 16), activation, activation_clamp,
            fast_math, use_x_scales, l1_alphas, l2_alphas, l2_act_scales, weight_layout,
            global_num_tokens, post_expert_norm, post_expert_norm_weight, post_expert_norm_eps,
            post_expert_norm_weight_first,
        )  # fmt: skip

    # ---------------------------------------------------------------- the math
    def _decode_fp(self, pair: Any, nvfp4: bool) -> torch.Tensor:
        """float64 (G, N, K) of a transformed (weight, sf) pair, gate/up order restored."""
        w, sf = pair
        values = base.e2m1_decode(w) if w.dtype == torch.int8 else w.double()
        if nvfp4:
            scale = _ue4m3_packed_to_scale(base.un_utccp(sf)).repeat_interleave(16, -1)
        else:
            scale = base.packed_to_scale(base.un_utccp(sf)).repeat_interleave(32, -1)
        return values * scale

    def _nvfp4_moe(
        self,
        y: Any,
        l1: Any,
        l2: Any,
        buf: Any,
        shared: tuple[Any, Any] | None,
        recipe: tuple[int, int, int],
        clamp: float | None,
    ) -> None:
        buf, tokens = self._check_call(y, buf, (NVFP4_KIND,), "an NVFP4")
        _need(tuple(recipe) == (1, 1, 16), f"recipe {recipe}: NVFP4 uses (1, 1, 16)")
        clamp = base._check_clamp(clamp)
        e, h, i = buf.dims()
        (w1, sf1), (w2, sf2) = l1, l2
        _check(w1, "l1 weight", torch.int8, (e, 2 * i, h // 2))
        _check(w2, "l2 weight", torch.int8, (e, h, i // 2))
        _check(sf1, "l1 sf", torch.int32, (e, 2 * i, h // 64))
        _check(sf2, "l2 sf", torch.int32, (e, h, i // 64))
        pieces = {"l1 weight": w1, "l1 sf": sf1, "l2 weight": w2, "l2 sf": sf2}
        self._check_kernel_weights(buf, pieces)
        w13 = _deinterleave_packed(self._decode_fp((w1, sf1), True))
        w2f = self._decode_fp((w2, sf2), True)
        x = base.e2m1_decode(buf.x[:tokens]) * _ue4m3_packed_to_scale(
            buf.x_sf[:tokens]
        ).repeat_interleave(16, -1)
        self._moe(y, x, buf, w13, w2f, _round_nvfp4, clamp)
        if shared is not None:
            sl1, sl2 = shared
            s13 = _deinterleave_packed(self._decode_fp(sl1, True))
            self._shared_out(y, x, buf, s13, self._decode_fp(sl2, True), _round_nvfp4, clamp)

    def _add_shared(
        self, y: torch.Tensor, buf: Any, shared: tuple[Any, Any], clamp: float | None, fp4: bool
    ) -> None:
        """Add the fused shared experts (every token, weight 1) to the routed output."""
        tokens = y.shape[0]
        sl1, sl2 = shared
        if isinstance(sl1, tuple):
            s13 = base.deinterleave(self._decode_fp(sl1, False))
            s2 = self._decode_fp(sl2, False)
            x = buf.x[:tokens].double() * base.packed_to_scale(buf.x_sf[:tokens]).repeat_interleave(
                32, -1
            )
            self._shared_out(y, x, buf, s13, s2, base.round_mxfp8, clamp)
        else:
            x = buf.x[:tokens].double()
            s13, s2 = base.deinterleave(sl1.double()), sl2.double()
            self._shared_out(y, x, buf, s13, s2, lambda a: a.to(torch.bfloat16).double(), clamp)

    def _shared_out(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        buf: Any,
        w13: torch.Tensor,
        w2: torch.Tensor,
        rounding: Any,
        clamp: float | None,
    ) -> None:
        i = buf.intermediate_hidden
        out = y.double()
        for s in range(w13.shape[0]):
            h = x @ w13[s].T
            gate, up = h[:, :i], h[:, i:]
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            out += rounding(torch.nn.functional.silu(gate) * up) @ w2[s].T
        y.copy_(out.to(torch.bfloat16))
