"""Dense block-FP8 GEMMs on Hopper: the shared expert's projections without a bf16 copy.

A block-FP8 checkpoint stores each projection as E4M3 values with one float32 scale per
128x128 block (``weight_scale_inv``: multiply to dequantize). On SM90, DeepGEMM's dense FP8
GEMM (``fp8_gemm_nt``, recipe (1, 128, 128)) multiplies by them as they are: activations are
cast to E4M3 with one float32 scale per token and 128 columns (1x128, as DeepGEMM's
reference ``per_token_cast_to_fp8(x, use_ue8m0=False)`` computes them), the product is
accumulated in float32 and written in bf16. The weights take half the bytes of a bf16 copy.

The DeepGEMM call is the custom op ``torch.ops.megamoe.fp8_gemm_nt`` with a fake
implementation, so ``torch.compile(fullgraph=True)`` traces around it and CUDA graphs
capture it; the activation cast is plain torch, which inductor fuses with what precedes it.
What the installed DeepGEMM can do is read from the functions it exposes, never from its
version string.

Speed (H200, sgl-deep-gemm 0.1.4.post1, ``benchmarks/bench_shared_expert.py``): the two
DeepGEMM GEMMs take about half the bf16 GEMMs' time, but the torch activation casts and the
float32 SwiGLU cost more than that (CUDA-graphed, the FP8 path takes 1.4-2.0x the bf16
path's time from 1 to 4096 tokens), and each eager forward spends about 0.4 ms on the host.
torch's block-wise ``scaled_mm`` (1x128 x 128x128) was refused by cuBLASLt on torch 2.11 for
token counts that are not multiples of 128.
"""

from __future__ import annotations

import enum
import importlib
import logging
import math
from collections.abc import Callable

import torch

from megamoe.core.errors import CapabilityError
from megamoe.core.numerics.formats import ARCH_SM90, WeightFormat, detect_arch

logger = logging.getLogger(__name__)

__all__ = [
    "ACT_GROUP",
    "DEEP_GEMM_FUNCTION",
    "SharedGemm",
    "float_to_fp8_1x128",
    "fp8_gemm_nt",
    "resolve_shared_gemm",
]

ACT_GROUP = 128  # columns per activation scale (1x128) and the side of a weight block
TMA_ALIGN_FLOATS = 4  # float32 scales per 16 bytes, the TMA alignment of a scale column
DEEP_GEMM_FUNCTION = "fp8_gemm_nt"  # DeepGEMM's dense FP8 GEMM, D = A @ B.T
DEEP_GEMM_RECIPE = (1, 128, 128)  # (A rows, B rows, K) covered by one scale
# N and K fixed at JIT compile time (a weight's shape), M at run time: the kernel's own
# default; sgl-deep-gemm's Python wrapper passes "" (all at run time) unless told.
DEEP_GEMM_COMPILED_DIMS = "nk"
PIP_PACKAGE = "sgl-deep-gemm"
_AMAX_FLOOR = 1e-4  # a group's amax is clamped below to this, as DeepGEMM's cast does
_RECIP_E4M3_MAX = 0.0022321429569274187  # float32(1/448): DeepGEMM's amax / 448 on CUDA


class SharedGemm(enum.Enum):
    """How the shared expert multiplies by its projections.

    Members:

    - ``BF16`` ``"bf16"``: bf16 weights (a quantized checkpoint is dequantized to bf16 when
      loaded: 2 bytes per value) and ``F.linear``; any device.
    - ``DEEP_GEMM`` ``"deep_gemm"``: a block-FP8 checkpoint's E4M3 weights with their
      float32 128x128 block scales (about 1 byte per value) and DeepGEMM's ``fp8_gemm_nt`` on
      SM90 (Hopper); activations are cast to E4M3 with float32 1x128 scales (the
      DeepSeek-V3 recipe (1, 128, 128)).
    """

    BF16 = "bf16"
    DEEP_GEMM = "deep_gemm"


def _device_arch(device: torch.device) -> str:
    """Kernel family of ``device`` (a seam for tests that fake an architecture)."""
    return detect_arch(device)


def _deep_gemm_gap(
    checkpoint_format: WeightFormat, device: torch.device, shapes: tuple[int, int]
) -> tuple[type[Exception], str] | None:
    """Why DeepGEMM's FP8 GEMM cannot run these projections here (error type, reason), or None."""
    if checkpoint_format is not WeightFormat.FP8_BLOCK:
        return ValueError, f"the checkpoint stores it as {checkpoint_format.value}, not fp8_block"
    if any(size % ACT_GROUP for size in shapes):
        return ValueError, (
            f"hidden_size={shapes[0]} and intermediate_size={shapes[1]} must be multiples of "
            f"{ACT_GROUP} (one 128x128 scale block may not straddle gate and up)"
        )
    if _device_arch(device) != ARCH_SM90:
        return CapabilityError, f"{device} is not an SM90 (Hopper) CUDA device"
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as exc:  # a broken build fails with OSError/RuntimeError too
        return CapabilityError, (
            f"deep_gemm does not import ({type(exc).__name__}: {exc}); pip install {PIP_PACKAGE}"
        )
    if not callable(getattr(module, DEEP_GEMM_FUNCTION, None)):
        return CapabilityError, (
            f"the installed deep_gemm lacks {DEEP_GEMM_FUNCTION}; pip install {PIP_PACKAGE}"
        )
    return None


def resolve_shared_gemm(
    requested: SharedGemm | str | None,
    checkpoint_format: WeightFormat,
    device: torch.device | str | None,
    hidden_size: int,
    intermediate_size: int,
    owner: str,
) -> SharedGemm:
    """The GEMM a shared expert runs: ``requested``, or the best one here for None.

    None picks ``DEEP_GEMM`` for a block-FP8 checkpoint on an SM90 device whose installed
    ``deep_gemm`` exposes ``fp8_gemm_nt`` (and sizes that are multiples of 128), else
    ``BF16`` (the CPU, other GPUs, no DeepGEMM, unquantized checkpoints).

    Args:
        requested: a member or its value, or None for the automatic choice.
        checkpoint_format: how the checkpoint stores the projections.
        device: where the weights live (None: the CPU).
        hidden_size: model width H.
        intermediate_size: MLP width I.
        owner: the module's name prefix, for messages.

    Returns:
        The member to build.

    Raises:
        ValueError: an unknown value, or ``deep_gemm`` requested for a checkpoint or sizes
            it cannot run.
        CapabilityError: ``deep_gemm`` requested where it cannot run (not SM90, no DeepGEMM
            or no ``fp8_gemm_nt``).
    """
    dev = torch.device("cpu" if device is None else device)
    if requested is not None:
        try:
            choice = SharedGemm(requested)
        except ValueError:
            valid = ", ".join(g.value for g in SharedGemm)
            raise ValueError(
                f"{owner}: gemm={requested!r} is not one of {valid}, or None for automatic"
            ) from None
        if choice is SharedGemm.BF16:
            return choice
    gap = _deep_gemm_gap(checkpoint_format, dev, (hidden_size, intermediate_size))
    if gap is None:
        return SharedGemm.DEEP_GEMM
    if requested is None:
        logger.debug("%s: shared expert in bf16: %s", owner, gap[1])
        return SharedGemm.BF16
    error, reason = gap
    raise error(
        f"{owner}: gemm='deep_gemm' cannot run here: {reason}; pass gemm='bf16' (a bf16 copy "
        "dequantized at load) or gemm=None to choose automatically"
    )


def float_to_fp8_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast (M, K) activations to E4M3 with float32 1x128 scales, as DeepGEMM's reference does.

    ``scale = max(amax, 1e-4) * float32(1/448)`` per token and 128 columns, values
    ``x * (1 / scale)`` rounded to E4M3: bit for bit ``per_token_cast_to_fp8(x,
    use_ue8m0=False)`` on CUDA, on every device.

    Args:
        x: (M, K) bf16 or float32, K a multiple of 128.

    Returns:
        ``(x_fp8, scale_t)``: E4M3 (M, K) and the float32 scales transposed, (K/128, M
        rounded up to 4), contiguous: the storage of DeepGEMM's MN-major, TMA-aligned
        scale layout (``fp8_gemm_nt`` takes ``scale_t[:, :M].t()`` without a copy).
    """
    m, k = x.shape
    groups = x.unflatten(-1, (k // ACT_GROUP, ACT_GROUP))
    amax = torch.linalg.vector_norm(groups, ord=math.inf, dim=-1, dtype=torch.float32)
    scale = amax.clamp(min=_AMAX_FLOOR) * _RECIP_E4M3_MAX
    x_fp8 = (groups * scale.reciprocal().unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    # The padding columns are never read: DeepGEMM loads whole aligned columns, uses M rows.
    scale_t = scale.new_empty((k // ACT_GROUP, m + -m % TMA_ALIGN_FLOATS))
    scale_t[:, :m].copy_(scale.t())
    return x_fp8, scale_t


def _deep_gemm_fp8_gemm_nt() -> Callable[..., None]:
    """The installed ``deep_gemm.fp8_gemm_nt`` (whatever ``sys.modules`` holds)."""
    gemm: Callable[..., None] = getattr(importlib.import_module("deep_gemm"), DEEP_GEMM_FUNCTION)
    return gemm


@torch.library.custom_op("megamoe::fp8_gemm_nt", mutates_args=())
def fp8_gemm_nt(
    x_fp8: torch.Tensor, x_scale_t: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """``x @ w.T`` in bf16 from E4M3 operands and their float32 scales (DeepGEMM, SM90).

    Args:
        x_fp8: (M, K) E4M3 activations.
        x_scale_t: their 1x128 scales as ``float_to_fp8_1x128`` returns them.
        w_fp8: (N, K) E4M3 weights, contiguous.
        w_scale: (N/128, K/128) float32 block scales, contiguous.

    Returns:
        (M, N) bf16.
    """
    m = x_fp8.shape[0]
    out = torch.empty((m, w_fp8.shape[0]), dtype=torch.bfloat16, device=x_fp8.device)
    if m == 0:  # no tokens on this rank: nothing to multiply (and no scale layout to build)
        return out
    x_scale = x_scale_t.contiguous()[:, :m].t()  # MN-major and TMA-aligned: no copy inside
    gemm = _deep_gemm_fp8_gemm_nt()
    gemm(
        (x_fp8.contiguous(), x_scale), (w_fp8, w_scale), out,
        recipe=DEEP_GEMM_RECIPE, compiled_dims=DEEP_GEMM_COMPILED_DIMS,
    )  # fmt: skip
    return out


@fp8_gemm_nt.register_fake
def _fp8_gemm_nt_fake(
    x_fp8: torch.Tensor, x_scale_t: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    del x_scale_t, w_scale
    return x_fp8.new_empty((x_fp8.shape[0], w_fp8.shape[0]), dtype=torch.bfloat16)
