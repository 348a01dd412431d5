"""A strict fake ``deep_gemm`` for CPU tests of the DeepGEMM backend.

It models the MegaMoE API of a DeepGEMM build (SM100: ``get_symm_buffer_for_mega_moe``
with ``mma_type``, ``transform_sf_into_required_layout``, ``transform_weights_for_mega_moe``,
``fp8_fp4_mega_moe``, ``bf16_mega_moe``; Hopper: ``transform_weights_for_mega_moe_sm90``,
``mega_moe_pre_dispatch_sm90``, ``fp8_mega_moe``) and is not a mock that accepts anything:

- every function checks every tensor it is handed (dtype, shape, strides, contiguity,
  value encodings) and raises ``FakeDeepGemmError`` on any violation;
- the kernels accept only weight slices that one of its transforms produced (so untransformed
  or hand-rearranged weights are refused), decode them from the kernel layout (undoing the
  gate/up interleave and the scale rearrangement), and compute the MoE in float64 with the
  kernel's activation rounding, so tests can compare outputs with an independent reference;
- ``activation_clamp=L`` clamps the SwiGLU inputs as the kernels do (``gate <= L``,
  ``-L <= up <= L``, then ``silu(gate) * up``, then the top-k weight).

``dense_gemm=True`` adds the dense FP8 GEMM ``fp8_gemm_nt`` (Hopper's float32-scale path,
recipe (1, 128, 128)), computed in float64 from the operands and their scales.

API generations: ``kinds`` without ``"fp8xfp8"`` gives the buffer factory before
``num_shared_experts``; ``activation_clamp=False`` gives kernels from before the SwiGLU clamp
(their signatures lack ``activation_clamp`` and refuse it as an unexpected keyword).

The decoders here are written independently of ``megamoe.core`` on purpose.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

SM100_KINDS = frozenset({"fp8xfp4", "fp8xfp8", "bf16xbf16"})
SM90_KIND = "sm90_fp8"
INTERLEAVE = 8  # gate/up rows alternate in groups of 8
UTCCP_ROWS = 128  # scale rows are rearranged within groups of 128
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
TOKEN_ALIGN = 64  # the fake rounds a buffer's token count up to this (DeepGEMM does too)
KERNELS = frozenset({"fp8_mega_moe", "fp8_fp4_mega_moe", "bf16_mega_moe"})


class FakeDeepGemmError(RuntimeError):
    """A call broke DeepGEMM's contract (what a real host-side check would reject)."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise FakeDeepGemmError(message)


def _check_clamp(activation_clamp: Any) -> float | None:
    """The kernels' SwiGLU clamp: None, or a finite float > 0."""
    if activation_clamp is None:
        return None
    _need(
        isinstance(activation_clamp, float)
        and math.isfinite(activation_clamp)
        and activation_clamp > 0,
        f"activation_clamp={activation_clamp!r}: a finite float > 0, or None",
    )
    return activation_clamp


def _without_clamp(fn: Any) -> Any:
    """``fn`` as the generation before ``activation_clamp``: the keyword is not taken."""
    signature = inspect.signature(fn)
    older = signature.replace(
        parameters=[p for n, p in signature.parameters.items() if n != "activation_clamp"]
    )

    def kernel(*args: Any, **kwargs: Any) -> None:
        bound = older.bind(*args, **kwargs)  # TypeError on activation_clamp, as Python gives
        return fn(**bound.arguments)

    kernel.__name__ = kernel.__qualname__ = fn.__name__
    kernel.__signature__ = older  # type: ignore[attr-defined]
    return kernel


def _check(t: Any, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _need(isinstance(t, torch.Tensor), f"{what}: expected a tensor, got {type(t).__name__}")
    _need(t.dtype == dtype, f"{what}: dtype {t.dtype}, expected {dtype}")
    _need(tuple(t.shape) == shape, f"{what}: shape {tuple(t.shape)}, expected {shape}")


def _mn_major(t: torch.Tensor, what: str) -> None:
    """DeepGEMM's packed SF layout: (G, mn, k4) with mn the fastest dimension."""
    _need(
        t.stride(1) == 1 and t.stride(2) >= t.shape[1],
        f"{what}: not MN-major, strides {t.stride()}",
    )


def _digest(t: torch.Tensor) -> bytes:
    data = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(repr((t.dtype, tuple(t.shape))).encode() + data).digest()


def interleave(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows -> groups of 8 gate rows, 8 up rows, ... (dim 1)."""
    g, n, *rest = t.shape
    gate = t[:, : n // 2].reshape(g, n // 2 // INTERLEAVE, INTERLEAVE, *rest)
    up = t[:, n // 2 :].reshape(g, n // 2 // INTERLEAVE, INTERLEAVE, *rest)
    return torch.empty_like(t).copy_(torch.stack([gate, up], 2).reshape(t.shape))  # keeps strides


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    g, n, *rest = t.shape
    pairs = t.reshape(g, n // (2 * INTERLEAVE), 2, INTERLEAVE, *rest)
    return torch.cat(
        [pairs[:, :, 0].reshape(g, n // 2, *rest), pairs[:, :, 1].reshape(g, n // 2, *rest)], 1
    )


def utccp(sf: torch.Tensor) -> torch.Tensor:
    """Row r = 32 i + j of each 128-row group moves to 4 j + i (keeps MN-major strides)."""
    g, mn, k4 = sf.shape
    moved = sf.reshape(g, mn // UTCCP_ROWS, 4, 32, k4).transpose(2, 3).reshape(g, mn, k4)
    return torch.empty_like(sf).copy_(moved)


def un_utccp(sf: torch.Tensor) -> torch.Tensor:
    g, mn, k4 = sf.shape
    return sf.reshape(g, mn // UTCCP_ROWS, 32, 4, k4).transpose(2, 3).reshape(g, mn, k4)


def packed_to_scale(sf_int32: torch.Tensor) -> torch.Tensor:
    """int32 (..., k/128), four UE8M0 bytes each (low byte first) -> float64 (..., k/32)."""
    exps = sf_int32.contiguous().view(torch.uint8).to(torch.float64)
    return torch.exp2(exps - 127.0)


def e2m1_decode(packed_int8: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 pairs (even column in the low nibble) -> float64, twice as many columns."""
    b = packed_int8.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    value = table[codes & 0x7]
    return torch.where((codes & 0x8) != 0, -value, value)


def round_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """float32 rounding through E4M3 with UE8M0 1x32 scales (ceil of amax/448), as float64."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax.double() / E4M3_MAX))).float()
    values = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)
    return (values.double() * scale.double()).reshape(x.shape)


def round_pow2_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """Hopper intermediate: E4M3 with power-of-two 1x``group`` scales, as float64."""
    groups = x.float().reshape(*x.shape[:-1], -1, group)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.double() / E4M3_MAX))).float()
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    values = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)
    return (values.double() * scale.double()).reshape(x.shape)


class FakeGroup:
    """A one-rank process group as DeepGEMM uses it (size, rank, barrier)."""

    def __init__(self, size: int = 1, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def barrier(self) -> None:
        """Nothing to wait for on one rank."""


@dataclass
class FakeBuffer:
    group: Any
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    kind: str
    x: torch.Tensor
    x_sf: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int8))

    def dims(self) -> tuple[int, int, int]:
        """(experts per rank, hidden, intermediate): the shapes the kernels' weights have."""
        return self.num_experts // self.group.size(), self.hidden, self.intermediate_hidden


@dataclass
class FakeDeepGemm:
    """State of one fake installation; ``module()`` builds the importable module."""

    arch: str = "sm100"
    kinds: frozenset[str] = SM100_KINDS
    device: str = "cpu"
    activation_clamp: bool = True  # False: kernels of the generation without the clamp
    buffers: list[FakeBuffer] = field(default_factory=list)
    transformed: set[bytes] = field(default_factory=set)
    transform_calls: int = 0
    kernel_calls: int = 0
    clamps: list[float | None] = field(default_factory=list)  # activation_clamp per call
    dense_gemm: bool = False  # True: the module has fp8_gemm_nt (SM90 only)
    dense_gemm_calls: int = 0
    _sf_outputs: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("deep_gemm")
        mod.__dict__["fake"] = self
        names: list[str] = ["get_symm_buffer_for_mega_moe"]
        if self.arch == "sm90":
            names += [
                "transform_weights_for_mega_moe_sm90",
                "mega_moe_pre_dispatch_sm90",
                "fp8_mega_moe",
            ]
        else:
            names.append("transform_weights_for_mega_moe")
            if self.kinds & {"fp8xfp4", "fp8xfp8"}:
                names += ["transform_sf_into_required_layout", "fp8_fp4_mega_moe"]
            if "bf16xbf16" in self.kinds:
                names.append("bf16_mega_moe")
        if self.dense_gemm:
            names.append("fp8_gemm_nt")
        for name in names:
            fn = getattr(self, name)
            if name in KERNELS and not self.activation_clamp:
                fn = _without_clamp(fn)
            mod.__dict__[name] = fn
        if "fp8xfp8" in self.kinds:  # the API generation with mma_type="fp8xfp8"
            mod.__dict__["get_symm_buffer_for_mega_moe"] = self._buffer_fn_with_shared()
        return mod

    # ---------------------------------------------------------------- buffers
    def get_symm_buffer_for_mega_moe(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        use_fp8_dispatch: bool | None = None,
        mma_type: str = "fp8xfp4",
        activation: str = "swiglu",
    ) -> FakeBuffer:
        return self._allocate(
            group,
            num_experts,
            num_max_tokens_per_rank,
            num_topk,
            hidden,
            intermediate_hidden,
            mma_type,
            activation,
            0,
        )

    def _buffer_fn_with_shared(self) -> Any:
        def get_symm_buffer_for_mega_moe(
            group: Any,
            num_experts: int,
            num_max_tokens_per_rank: int,
            num_topk: int,
            hidden: int,
            intermediate_hidden: int,
            num_shared_experts: int = 0,
            mma_type: str = "fp8xfp4",
            activation: str = "swiglu",
        ) -> FakeBuffer:
            return self._allocate(
                group,
                num_experts,
                num_max_tokens_per_rank,
                num_topk,
                hidden,
                intermediate_hidden,
                mma_type,
                activation,
                num_shared_experts,
            )

        return get_symm_buffer_for_mega_moe

    def _allocate(
        self,
        group: Any,
        num_experts: int,
        max_tokens: int,
        top_k: int,
        hidden: int,
        inter: int,
        mma_type: str,
        activation: str,
        shared: int,
    ) -> FakeBuffer:
        _need(
            callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None)),
            f"group {group!r} is not a process group",
        )
        _need(group.size() == 1, "the fake runs one rank")
        _need(num_experts % group.size() == 0 and num_experts > 0, f"num_experts={num_experts}")
        _need(
            hidden % 128 == 0 and inter % 128 == 0,
            f"hidden={hidden}, intermediate={inter}: multiples of 128",
        )
        _need(max_tokens >= 1 and top_k >= 1, f"max tokens {max_tokens}, top-k {top_k}")
        _need(activation == "swiglu" and shared == 0, f"activation {activation}, shared {shared}")
        if self.arch == "sm90":
            assert mma_type.split("x")[0] == "fp8", mma_type  # as DeepGEMM asserts
            kind = SM90_KIND
            _need(inter // 64 <= 64, f"intermediate_hidden={inter}: intermediate / 64 <= 64")
        else:
            assert mma_type in self.kinds, f"mma_type {mma_type!r} is not supported by this build"
            kind = mma_type
        rows = -(-max_tokens // TOKEN_ALIGN) * TOKEN_ALIGN
        dev = self.device
        x_dtype = torch.bfloat16 if kind == "bf16xbf16" else torch.float8_e4m3fn
        x_sf = None
        if kind == SM90_KIND:
            x_sf = torch.zeros((rows, hidden // 128), dtype=torch.float32, device=dev)
        elif kind != "bf16xbf16":
            x_sf = torch.zeros((rows, hidden // 128), dtype=torch.int32, device=dev)
        buf = FakeBuffer(
            group,
            num_experts,
            rows,
            top_k,
            hidden,
            inter,
            kind,
            torch.zeros((rows, hidden), dtype=x_dtype, device=dev),
            x_sf,
            torch.full((rows, top_k), -1, dtype=torch.int64, device=dev),
            torch.zeros((rows, top_k), dtype=torch.float32, device=dev),
        )
        self.buffers.append(buf)
        return buf

    # ---------------------------------------------------------------- transforms
    def _record(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            for g in range(t.shape[0]):
                self.transformed.add(_digest(t[g]))

    def transform_sf_into_required_layout(
        self,
        sf: Any,
        mn: int,
        k: int,
        recipe: tuple[int, ...],
        num_groups: int | None = None,
        is_sfa: bool | None = None,
        disable_ue8m0_cast: bool = False,
    ) -> torch.Tensor:
        _need(tuple(recipe) == (1, 32), f"recipe {recipe}: MX weights use (1, 32)")
        _need(num_groups is not None and not disable_ue8m0_cast, "num_groups must be given")
        _check(sf, "sf", torch.float32, (num_groups, mn, -(-k // 32)))
        _need(sf.is_contiguous(), "sf must be contiguous")
        bits = sf.view(torch.int32)
        _need(
            bool(((bits & 0x807FFFFF) == 0).all()),
            "sf values must be non-negative powers of two (UE8M0)",
        )
        _need(k % 128 == 0 and mn % 128 == 0, f"mn={mn}, k={k}: multiples of 128")
        exps = ((bits >> 23) & 0xFF).to(torch.uint8).contiguous()
        packed = exps.view(torch.int32)  # (G, mn, k/128), low byte = first group
        out = torch.empty(
            (num_groups, k // 128, mn), dtype=torch.int32, device=sf.device
        ).transpose(1, 2)
        out.copy_(packed)
        self._sf_outputs.add(out)
        return out

    def _check_l_pair(
        self, pair: Any, what: str, n: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _need(isinstance(pair, tuple) and len(pair) == 2, f"{what}: expected (weight, sf)")
        w, sf = pair
        _need(
            isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_contiguous(),
            f"{what} weight: a contiguous (G, N, K) tensor",
        )
        _need(
            w.dtype in (torch.int8, torch.float8_e4m3fn),
            f"{what} weight dtype {w.dtype}: int8 (FP4) or float8_e4m3fn",
        )
        g, rows, cols = w.shape
        k = cols * (2 if w.dtype == torch.int8 else 1)
        _check(sf, f"{what} sf", torch.int32, (g, rows, k // 128))
        _mn_major(sf, f"{what} sf")
        _need(
            any(sf is s for s in self._sf_outputs),
            f"{what} sf was not produced by transform_sf_into_required_layout",
        )
        if n is not None:
            _need(rows == n, f"{what}: {rows} rows, expected {n}")
        return w, sf

    def transform_weights_for_mega_moe(
        self, l1_weights: Any, l2_weights: Any, activation: str = "swiglu"
    ) -> Any:
        _need(activation == "swiglu", f"activation {activation}")
        self.transform_calls += 1
        if isinstance(l1_weights, tuple):
            w1, sf1 = self._check_l_pair(l1_weights, "l1", None)
            w2, sf2 = self._check_l_pair(l2_weights, "l2", None)
            g, n, _ = w1.shape
            h = w1.shape[2] * (2 if w1.dtype == torch.int8 else 1)
            _need(
                w2.dtype == w1.dtype and w2.shape[0] == g,
                "l1/l2 weights differ in dtype or experts",
            )
            per_byte = 2 if w2.dtype == torch.int8 else 1
            _need(
                tuple(w2.shape) == (g, h, n // 2 // per_byte),
                f"l2 weight shape {tuple(w2.shape)}, expected {(g, h, n // 2 // per_byte)}",
            )
            _need(n % (2 * UTCCP_ROWS) == 0, f"l1 rows {n}: gate + up, each a multiple of 128")
            out = ((interleave(w1).contiguous(), utccp(interleave(sf1))), (w2, utccp(sf2)))
            self._record(out[0][0], out[0][1], out[1][0], out[1][1])
            return out
        w1, w2 = l1_weights, l2_weights
        _need(
            isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor),
            "BF16: tensors, not tuples",
        )
        g, n, h = w1.shape
        _check(w1, "l1 weight", torch.bfloat16, (g, n, h))
        _check(w2, "l2 weight", torch.bfloat16, (g, h, n // 2))
        _need(w1.is_contiguous() and w2.is_contiguous(), "BF16 weights must be contiguous")
        out_bf16 = (interleave(w1).contiguous(), w2)
        self._record(*out_bf16)
        return out_bf16

    def transform_weights_for_mega_moe_sm90(self, l1_weights: Any, l2_weights: Any) -> Any:
        self.transform_calls += 1
        (w1, s1), (w2, s2) = l1_weights, l2_weights
        g, n, h = w1.shape
        _check(w1, "l1 weight", torch.float8_e4m3fn, (g, n, h))
        _check(s1, "l1 scale", torch.float32, (g, n // 128, h // 128))
        _check(w2, "l2 weight", torch.float8_e4m3fn, (g, h, n // 2))
        _check(s2, "l2 scale", torch.float32, (g, h // 128, n // 2 // 128))
        _need(
            all(t.is_contiguous() for t in (w1, s1, w2, s2)),
            "Hopper weights and scales must be contiguous",
        )
        out = ((interleave(w1).contiguous(), s1), (w2, s2))  # scales stay in [gate | up] order
        self._record(out[0][0], s1, w2, s2)
        return out

    # ---------------------------------------------------------------- kernels
    def _check_kernel_weights(
        self, buf: FakeBuffer, pieces: dict[str, torch.Tensor | None]
    ) -> None:
        e_local = buf.dims()[0]
        for name, t in pieces.items():
            if t is None:
                continue
            _need(
                t.shape[0] == e_local,
                f"{name}: {t.shape[0]} experts, buffer has {e_local} per rank",
            )
            for e in range(e_local):
                _need(
                    _digest(t[e]) in self.transformed,
                    f"{name}[{e}] was not produced by a DeepGEMM transform "
                    "(untransformed or rearranged weights)",
                )

    def _check_call(
        self, y: Any, sym_buffer: Any, kinds: tuple[str, ...], what: str
    ) -> tuple[FakeBuffer, int]:
        """The buffer (of one of ``kinds``) and the token count of a kernel call writing ``y``."""
        buf = sym_buffer
        _need(
            isinstance(buf, FakeBuffer) and buf.kind in kinds,
            f"sym_buffer is not {what} MegaMoE buffer",
        )
        _need(
            isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.dim() == 2,
            "y: a (T, H) bfloat16 tensor",
        )
        _need(
            y.is_contiguous() and y.shape[1] == buf.hidden, f"y shape {tuple(y.shape)} / contiguity"
        )
        tokens = y.shape[0]
        _need(
            tokens <= buf.num_max_tokens_per_rank,
            f"num_tokens {tokens} > buffer capacity {buf.num_max_tokens_per_rank}",
        )
        ids = buf.topk_idx[:tokens]
        _need(
            bool(((ids >= -1) & (ids < buf.num_experts)).all()), "topk_idx out of [-1, num_experts)"
        )
        return buf, tokens

    def fp8_fp4_mega_moe(
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        cumulative_local_expert_recv_stats: Any = None,
        recipe: tuple[int, int, int] = (1, 1, 32),
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
    ) -> None:
        buf, tokens = self._check_call(y, sym_buffer, ("fp8xfp4", "fp8xfp8"), "an FP8")
        _need(tuple(recipe) == (1, 1, 32) and activation == "swiglu", "recipe/activation")
        clamp = _check_clamp(activation_clamp)
        (w1, sf1), (w2, sf2) = l1_weights, l2_weights
        fp4 = buf.kind == "fp8xfp4"
        dtype, per_byte = (torch.int8, 2) if fp4 else (torch.float8_e4m3fn, 1)
        e, h, i = buf.dims()
        _check(w1, "l1 weight", dtype, (e, 2 * i, h // per_byte))
        _check(w2, "l2 weight", dtype, (e, h, i // per_byte))
        _check(sf1, "l1 sf", torch.int32, (e, 2 * i, h // 128))
        _check(sf2, "l2 sf", torch.int32, (e, h, i // 128))
        _need(w1.is_contiguous() and w2.is_contiguous(), "weights must be contiguous")
        _mn_major(sf1, "l1 sf")
        _mn_major(sf2, "l2 sf")
        self._check_kernel_weights(
            buf, {"l1 weight": w1, "l1 sf": sf1, "l2 weight": w2, "l2 sf": sf2}
        )
        assert buf.x_sf is not None
        x_bytes = buf.x_sf[:tokens].contiguous().view(torch.uint8)
        _need(bool((x_bytes != 255).all()), "x_sf holds a NaN exponent (255)")

        def decode(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
            values = e2m1_decode(w) if fp4 else w.double()
            return values * packed_to_scale(sf).repeat_interleave(32, -1)

        w13 = deinterleave(decode(w1, un_utccp(sf1)))
        w2f = decode(w2, un_utccp(sf2))
        x = buf.x[:tokens].double() * packed_to_scale(buf.x_sf[:tokens]).repeat_interleave(32, -1)
        self._moe(y, x, buf, w13, w2f, round_mxfp8, clamp)

    def bf16_mega_moe(
        self,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        cumulative_local_expert_recv_stats: Any = None,
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
    ) -> None:
        buf, tokens = self._check_call(y, sym_buffer, ("bf16xbf16",), "a BF16")
        _need(activation == "swiglu", f"activation {activation}")
        clamp = _check_clamp(activation_clamp)
        e, h, i = buf.dims()
        _check(l1_weights, "l1 weight", torch.bfloat16, (e, 2 * i, h))
        _check(l2_weights, "l2 weight", torch.bfloat16, (e, h, i))
        self._check_kernel_weights(buf, {"l1 weight": l1_weights, "l2 weight": l2_weights})
        x = buf.x[:tokens].double()
        self._moe(
            y,
            x,
            buf,
            deinterleave(l1_weights.double()),
            l2_weights.double(),
            lambda a: a.to(torch.bfloat16).double(),
            clamp,
        )

    def mega_moe_pre_dispatch_sm90(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        buf_x: Any,
        buf_x_sf: Any,
        buf_topk_idx: Any,
        buf_topk_weights: Any,
        num_tokens: int,
        group_size: int = 128,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        owner = next((b for b in self.buffers if buf_x is b.x), None)
        _need(owner is not None, "buf_x is not the x view of a MegaMoE buffer")
        assert owner is not None
        _need(
            buf_x_sf is owner.x_sf
            and buf_topk_idx is owner.topk_idx
            and buf_topk_weights is owner.topk_weights,
            "buffer views of different buffers",
        )
        _need(group_size == 128 and routed_scaling_factor == 1.0, f"group_size {group_size}")
        t, h, k = num_tokens, owner.hidden, owner.num_topk
        _need(
            t <= owner.num_max_tokens_per_rank,
            f"num_tokens {t} > capacity {owner.num_max_tokens_per_rank}",
        )
        _check(x, "x", torch.bfloat16, (t, h))
        _check(topk_idx, "topk_idx", torch.int32, (t, k))
        _check(topk_weights, "topk_weights", torch.float32, (t, k))
        _need(
            x.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous(),
            "inputs must be contiguous",
        )
        groups = x.float().reshape(t, h // 128, 128)
        scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX
        buf_x[:t].copy_((groups * (1.0 / scale)).to(torch.float8_e4m3fn).reshape(t, h))
        buf_x_sf[:t].copy_(scale.squeeze(-1))
        buf_topk_idx.fill_(-1)
        buf_topk_idx[:t].copy_(topk_idx)
        buf_topk_weights.zero_()
        buf_topk_weights[:t].copy_(topk_weights)

    def fp8_mega_moe(
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
    ) -> None:
        buf, tokens = self._check_call(y, sym_buffer, (SM90_KIND,), "a Hopper")
        _need(tuple(recipe) == (128, 128, 128) and activation == "swiglu", "recipe/activation")
        clamp = _check_clamp(activation_clamp)
        (w1, s1), (w2, s2) = l1_weights, l2_weights
        e, h, i = buf.dims()
        _check(w1, "l1 weight", torch.float8_e4m3fn, (e, 2 * i, h))
        _check(s1, "l1 scale", torch.float32, (e, 2 * i // 128, h // 128))
        _check(w2, "l2 weight", torch.float8_e4m3fn, (e, h, i))
        _check(s2, "l2 scale", torch.float32, (e, h // 128, i // 128))
        _need(
            all(t.is_contiguous() for t in (w1, s1, w2, s2)),
            "weights and scales must be contiguous",
        )
        self._check_kernel_weights(
            buf, {"l1 weight": w1, "l1 scale": s1, "l2 weight": w2, "l2 scale": s2}
        )

        def blocks(s: torch.Tensor) -> torch.Tensor:
            return s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)

        w13 = deinterleave(w1.double()) * blocks(s1)  # scales are in [gate | up] order already
        assert buf.x_sf is not None
        x = buf.x[:tokens].double() * buf.x_sf[:tokens].double().repeat_interleave(128, -1)
        w2f = w2.double() * blocks(s2)
        self._moe(y, x, buf, w13, w2f, lambda a: round_pow2_fp8(a, 64), clamp)

    def fp8_gemm_nt(
        self,
        a: Any,
        b: Any,
        d: Any,
        c: Any = None,
        recipe: Any = None,
        recipe_a: Any = None,
        recipe_b: Any = None,
        compiled_dims: str = "",
        disable_ue8m0_cast: bool = False,
    ) -> None:
        """``d = a @ b.T`` in float64 (bf16 out) from ``(E4M3, float32 scale)`` pairs."""
        _need(self.arch == "sm90", "the fake's fp8_gemm_nt models Hopper's float32 scales")
        _need(
            recipe is not None and tuple(recipe) == (1, 128, 128),
            f"recipe {recipe!r}: the fake takes (1, 128, 128) (1x128 A, 128x128 B scales)",
        )
        _need(recipe_a is None and recipe_b is None, "recipe_a/recipe_b: the fake takes recipe")
        _need(c is None and not disable_ue8m0_cast, "no C accumulation, no disable_ue8m0_cast")
        _need(compiled_dims in ("", "nk"), f"compiled_dims {compiled_dims!r}: '' or 'nk'")
        _need(all(isinstance(p, tuple) and len(p) == 2 for p in (a, b)), "a, b: (data, sf) pairs")
        (x, sfa), (w, sfb) = a, b
        _need(isinstance(x, torch.Tensor) and x.dim() == 2, "a: a 2-D tensor")
        _need(isinstance(w, torch.Tensor) and w.dim() == 2, "b: a 2-D tensor")
        (m, k), n = x.shape, w.shape[0]
        _check(x, "a", torch.float8_e4m3fn, (m, k))
        _check(w, "b", torch.float8_e4m3fn, (n, k))
        _need(k % 128 == 0 and m > 0, f"m={m}, k={k}: m > 0 and k a multiple of 128")
        _need(x.is_contiguous() and w.is_contiguous(), "a and b must be K-major, contiguous")
        _check(sfa, "sfa", torch.float32, (m, k // 128))
        aligned = -(-m // 4) * 4
        _need(
            sfa.stride() == (1, aligned),
            f"sfa: strides {sfa.stride()}, expected (1, {aligned}): MN-major and TMA-aligned "
            "(DeepGEMM would copy any other layout into that one on every call)",
        )
        _check(sfb, "sfb", torch.float32, (-(-n // 128), k // 128))
        _need(sfb.is_contiguous(), "sfb must be contiguous")
        _check(d, "d", torch.bfloat16, (m, n))
        _need(d.is_contiguous(), "d must be contiguous")
        self.dense_gemm_calls += 1
        xf = x.double() * sfa.double().repeat_interleave(128, 1)
        wf = w.double() * sfb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        d.copy_((xf @ wf.T).to(torch.bfloat16))

    def _moe(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        buf: FakeBuffer,
        w13: torch.Tensor,
        w2: torch.Tensor,
        rounding: Any,
        clamp: float | None,
    ) -> None:
        """y = sum over top-k of rounding(silu(gate) * up * w) @ w2, in float64.

        With ``clamp`` L: ``gate <= L`` and ``-L <= up <= L`` before the SiLU.
        """
        self.kernel_calls += 1
        self.clamps.append(clamp)
        tokens, i = x.shape[0], buf.intermediate_hidden
        ids, weights = buf.topk_idx[:tokens], buf.topk_weights[:tokens].double()
        out = torch.zeros((tokens, buf.hidden), dtype=torch.float64)
        start = buf.group.rank() * w13.shape[0]
        for e in range(w13.shape[0]):
            tok, slot = (ids == start + e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = x[tok] @ w13[e].T
            gate, up = h[:, :i], h[:, i:]
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            act = F.silu(gate) * up * weights[tok, slot, None]
            out.index_add_(0, tok, rounding(act) @ w2[e].T)
        y.copy_(out.to(torch.bfloat16))
