"""The shared expert's SwiGLU (with its optional clamp) in one Triton launch.

``megamoe.core.numerics.swiglu.swiglu_gate_up`` on a bf16 ``[gate | up]`` row is three kernels with
a clamp (clamp, silu, multiply) and two without, each a launch of host time in eager mode
(13-25 us each on the H200 test machine). :func:`swiglu_rows` is one launch giving the same
bits:

1. the clamp to ``L`` rounded to bf16 (the bounds ``gate_up_bounds`` holds), NaN kept;
2. torch's CUDA bf16 silu: ``g / (1 + expf(-g))`` in float32, correctly rounded division,
   rounded to bf16;
3. the product in float32, rounded to bf16.

The launch skips Triton's JIT after a variant's first call (``kernels.launch.KernelLaunch``);
under ``torch.compile`` dynamo traces the JIT call as a user-defined Triton kernel, so
compiled and eager blocks compute the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megamoe.core.kernels.launch import KernelLaunch, cdiv, eager_key, next_power_of_2

__all__ = ["bf16_limit", "swiglu_rows"]

MAX_BLOCK = 1024  # columns per program: 4 warps of 32 threads, 8 bf16 each


@triton.jit
def _swiglu_kernel(
    gate_up_ptr: tl.tensor,
    out_ptr: tl.tensor,
    INTERMEDIATE: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """Columns ``program_id(1) * BLOCK ..`` of row ``program_id(0)`` (contiguous rows)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTERMEDIATE
    source = gate_up_ptr + row * 2 * INTERMEDIATE + cols
    gate = tl.load(source, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(source + INTERMEDIATE, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        # LIMIT is bf16-exact, so the clamped values are the bf16 ones torch's clamp gives.
        gate = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(up, -LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(tl.bfloat16)
    product = (act.to(tl.float32) * up).to(tl.bfloat16)
    tl.store(out_ptr + row * INTERMEDIATE + cols, product, mask=ok)


_launch = KernelLaunch(_swiglu_kernel, runtime_args=2)


def bf16_limit(limit: float) -> float:
    """``limit`` rounded to bf16 (as ``gate_up_bounds`` holds it), as a Python float."""
    return float(torch.tensor(limit, dtype=torch.float32).to(torch.bfloat16))


def swiglu_rows(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` of a bf16 ``[gate | up]`` (..., 2I) on CUDA.

    Args:
        gate_up: the first projection's output, gate columns first (made contiguous).
        limit: ``L`` already rounded to bf16 (:func:`bf16_limit`), None for no clamp.

    Returns:
        (..., I) bf16, the bits of ``swiglu_gate_up`` with the bf16 bounds of ``L``.

    Raises:
        ValueError: ``gate_up`` that is not bf16 or whose last size is odd.
    """
    width = gate_up.shape[-1]
    if gate_up.dtype != torch.bfloat16 or width % 2:
        raise ValueError(
            f"swiglu_rows: gate_up is {gate_up.dtype} {tuple(gate_up.shape)}; expected bf16 "
            "[gate | up] rows of an even width (the torch path takes other dtypes)"
        )
    gate_up = gate_up.contiguous()
    intermediate = width // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], intermediate))
    rows = out.numel() // max(intermediate, 1)
    if rows == 0 or intermediate == 0:
        return out
    block = min(MAX_BLOCK, next_power_of_2(intermediate))
    constexprs = (intermediate, limit is not None, 0.0 if limit is None else limit, block)
    _launch(
        eager_key(constexprs, gate_up), (rows, cdiv(intermediate, block), 1),
        gate_up.device.index, (gate_up, out), constexprs, 4,
    )  # fmt: skip
    return out
